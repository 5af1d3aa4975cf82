"""Model presets (with their sources), router-feature rules, the Layout and `moe-lab preflight` — each refusal
beside a value that passes, and the numbers checked against hand arithmetic."""

import json

import pytest

from moe_lab import models, profiles
from moe_lab.cli.main import main
from moe_lab.config import MoEConfig
from moe_lab.layout import Layout
from moe_lab.tools import preflight, scale

GIB = 2**30


def test_every_preset_builds_a_valid_config_and_cites_its_source():
    assert set(models.PRESETS) >= {"mixtral-8x7b", "qwen3-30b-a3b", "qwen3-235b-a22b", "deepseek-v3",
                                   "moonlight-16b-a3b", "gpt-oss-20b"}
    for name, p in models.PRESETS.items():
        cfg = p.moe()
        assert cfg.model == name and cfg.gated  # every preset model has SwiGLU-style gated experts
        assert p.sources and all("@" in s for s in p.sources), f"{name}: a source without its commit"
        assert cfg.num_experts % 4 == 0  # they all run at the lab's EP=4


def test_deepseek_v3_is_its_published_router():
    c = models.moe_config("deepseek-v3")
    assert (c.hidden, c.num_experts, c.topk, c.ffn_hidden, c.shared_ffn) == (7168, 256, 8, 2048, 2048)
    assert (c.score_function, c.expert_bias, c.num_groups, c.group_topk, c.topk_scaling_factor) == (
        "sigmoid", True, 8, 4, 2.5)
    # bf16 weights of one layer (every expert, EP=1): 256 x 3 x 2048 x 7168 x 2 B = 21 GiB, as the issue says
    assert scale.param_bytes(c, 1)["experts"] / GIB == pytest.approx(21.0, abs=0.01)


def test_a_scaled_preset_keeps_its_router_and_says_it_is_scaled():
    c = models.moe_config("qwen3-30b-a3b", 0.125)
    assert (c.hidden, c.ffn_hidden, c.num_experts, c.topk) == (256, 96, 128, 8)
    assert "scaled" in c.model and "scaled" in c.label()
    assert models.moe_config("qwen3-30b-a3b").label().count("scaled") == 0  # the control: unscaled says nothing
    for bad in (0, 1.5, -1, True):
        with pytest.raises(ValueError, match="scale"):
            models.moe_config("qwen3-30b-a3b", bad)
    with pytest.raises(ValueError, match="must be one of"):
        models.get("llama")


@pytest.mark.parametrize("bad, msg", [
    (dict(expert_bias=True), "needs score_function 'sigmoid'"),
    (dict(num_groups=4), "set together"),
    (dict(num_groups=3, group_topk=1), "divisible by num_groups"),
    (dict(num_groups=4, group_topk=3), "multiple of group_topk"),
    (dict(pad_to_capacity=True), "needs capacity_factor"),
    (dict(topk=1), "pre_softmax"),
    (dict(score_function="relu"), "score_function"),
    (dict(capacity_factor=float("inf")), "capacity_factor"),
    (dict(shared_ffn=-1), "shared_ffn"),
])
def test_router_feature_rules(bad, msg):
    with pytest.raises(ValueError, match=msg):
        MoEConfig(**bad)


def test_router_features_that_pass_and_the_seed_layer_label_is_unchanged():
    ok = MoEConfig(score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2, capacity_factor=1.5,
                   pad_to_capacity=True, drop_policy="position", shared_ffn=64, gated=True)
    assert set(ok.features()) == {"score_function", "expert_bias", "num_groups", "group_topk", "capacity_factor",
                                  "pad_to_capacity", "drop_policy", "shared_ffn", "gated"}
    assert MoEConfig().features() == {}
    assert MoEConfig.seed_report().label() == "hidden 4096, 64 experts, top-6, ffn 16384, 1024 tokens, bf16"


def test_layout_parse_and_groups():
    lay = Layout.parse("tp2,ep4")
    assert (lay.tp, lay.ep, lay.expert_tp, lay.min_world) == (2, 4, 2, 8)
    assert lay.groups(8) == {"world": 8, "tp": 2, "dp": 4, "ep": 4, "etp": 2, "edp": 1}
    assert Layout.parse("tp2,ep2,etp1,sp").groups(4) == {"world": 4, "tp": 2, "dp": 2, "ep": 2, "etp": 1, "edp": 2}
    for bad, msg in (("", "empty"), ("tp0", "positive"), ("pp2", "is not tpN"), ("ep2,ep4", "twice")):
        with pytest.raises(ValueError, match=msg):
            Layout.parse(bad)
    with pytest.raises(ValueError, match="multiple of etp x ep"):
        lay.check_world(4)
    for text, spec in (("ep4", "ep4"), ("tp1,ep4", "ep4"), ("tp2,ep2,etp2,sp", "tp2,ep2,sp"),
                       ("sp,etp1,ep2,tp2", "tp2,ep2,etp1,sp"), ("tp1,ep2,etp2", "ep2,etp2")):
        got = Layout.parse(text)
        assert got.spec() == spec and Layout.parse(spec).groups(4) == got.groups(4), text  # round trip
    assert Layout.parse("tp2,ep2").spec() != Layout.parse("tp2,ep2,sp").spec()  # control: sp is named


def test_preflight_refuses_what_the_layer_cannot_take_and_passes_the_rest(capsys):
    assert main(["preflight", "--model", "qwen3-30b-a3b", "--layout", "tp2,ep4"]) == 0  # the control
    out = capsys.readouterr().out
    assert "left out" in out and "moe_grouped_gemm: needs TransformerEngine" in out and "sequence parallel" in out
    for argv, msg in ((["--model", "qwen3-30b-a3b", "--layout", "tp3,ep4"], "hidden (2048) must be divisible by tp"),
                      (["--model", "mixtral-8x7b", "--layout", "ep16"], "num_experts (8) must be divisible by ep"),
                      (["--model", "moonlight-16b-a3b", "--layout", "tp32,ep4"], "attention heads (16)"),
                      (["--model", "gpt-oss-20b", "--layout", "ep4", "--world", "6"], "multiple of etp x ep"),
                      (["--model", "deepseek-v3", "--layout", "ep1", "--gpus", "1", "--gpu-memory", "20"],
                       "does not fit in 20 GiB")):
        assert main(["preflight", *argv]) == 2
        err = capsys.readouterr().err.strip().splitlines()
        assert len(err) == 1 and msg in err[0], err


def test_preflight_memory_adds_up_over_ranks_sharing_a_gpu():
    cfg, p = preflight.layer_for("deepseek-v3", 1.0, 1024)
    one = preflight.plan(cfg, Layout(ep=4), preset=p, gpus=4, dispatchers=("alltoall",)).memory[0]
    shared = preflight.plan(cfg, Layout(ep=4), preset=p, gpus=1, dispatchers=("alltoall",)).memory[0]
    assert one["ranks_per_gpu"] == 1 and shared["ranks_per_gpu"] == 4
    assert shared["gpu_gib"] == pytest.approx(4 * one["gpu_gib"])
    assert one["experts_gib"] == pytest.approx(21.0 / 4, abs=0.01)  # 64 local experts of 256
    etp2 = preflight.plan(cfg, Layout(tp=2, ep=4), preset=p, dispatchers=("alltoall",)).memory[0]
    assert etp2["experts_gib"] == pytest.approx(one["experts_gib"] / 2)


def test_preflight_says_what_an_fp64_copy_of_the_weights_needs():
    """DeepSeek-V3's layer at EP=4 on one H200 — its fp64 copy is 4x the bf16 weights, per rank and per
    GPU, and whether it fits beside the bf16 layer (the control: a smaller GPU where it does not)."""
    cfg, p = preflight.layer_for("deepseek-v3", 1.0, 1024)
    big = preflight.plan(cfg, Layout(ep=4), preset=p, gpus=1, dispatchers=("alltoall",), gpu_memory_gib=139)
    w = big.memory[0]["weights_gib"]
    line = next(n for n in big.notes if n.startswith("an fp64 copy"))
    assert f"{4 * w:.2f} GiB per rank, {16 * w:.2f} GiB per GPU (4 rank(s) on it); fits beside" in line
    small = preflight.plan(cfg, Layout(ep=4), preset=p, gpus=1, dispatchers=("alltoall",), gpu_memory_gib=100)
    assert "does NOT fit beside the bf16 layer" in next(n for n in small.notes if n.startswith("an fp64 copy"))


def test_preflight_json_and_profile_model_key(capsys):
    assert main(["preflight", "--model", "qwen3-30b-a3b", "--scale", "0.125", "--layout", "tp2,ep2", "--device",
                 "cpu", "--json"]) == 0
    d = json.loads(capsys.readouterr().out)
    assert "4 CPU engines" in d["title"] and d["fits"] is None
    p = profiles.load("cpu", {"model": "moonlight-16b-a3b", "scale": 0.125})
    base = p.layer
    assert base.model.startswith("moonlight-16b-a3b") and base.seq_len == p.raw()["seq_len"] and base.expert_bias
    with pytest.raises(ValueError, match="needs model"):
        profiles.load("cpu", {"scale": 0.5})
