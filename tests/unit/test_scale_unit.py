"""Scale plan: the per-GPU memory calculation by hand on a tiny layer, its errors, and the dispatchers' difference."""

import json

import pytest
import torch

from moe_lab import cli, metrics
from moe_lab.tools import scale, scale_measure, scale_plan
from moe_lab.config import MoEConfig

# hidden 8, 4 experts, top-2, ffn 16, 10 tokens, bf16 (2 B), router dtype = bf16
TINY = MoEConfig(hidden=8, num_experts=4, topk=2, ffn_hidden=16, seq_len=10)


def test_parameters_by_hand():
    p = scale.param_bytes(TINY, 2)
    assert p["router"] == 4 * 8 * 2  # [experts x hidden] in bf16 (megatron casts its fp32 weight to params_dtype)
    assert p["per_expert"] == 16 * 8 * 2 + 8 * 16 * 2  # fc1 [ffn x hidden] + fc2 [hidden x ffn]
    assert p["local_experts"] == 2 and p["experts"] == 2 * 512 and p["total"] == 64 + 1024
    assert scale.param_bytes(TINY, 2, gated=True)["per_expert"] == 2 * 16 * 8 * 2 + 8 * 16 * 2  # fc1 x2
    # the seed report's layer at EP=2: the 8192.5 MiB measured on each H200
    assert scale.param_bytes(MoEConfig.seed_report(), 2)["total"] == 32 * 2 * 16384 * 4096 * 2 + 64 * 4096 * 2


def test_rows_by_hand():
    assert scale.rows_per_expert(TINY, 2) == [10, 10]  # 2 ranks x 10 tokens x top-2 / 4 experts
    assert scale.rows_per_expert(TINY, 2, imbalance=1.5) == [15, 15]
    # tokens[4:] = 0: 6 zero tokens on each of 2 ranks go to experts 0 and 1 (rank 0's), + each expert's share of
    # the 4 kept tokens of every rank (EP x cut x topk / experts)
    assert scale.rows_per_expert(TINY, 2, scenario="truncation", cut=4) == [2 * 6 + 4, 2 * 6 + 4]
    # EP 4: one local expert, so the busiest rank holds one of the two hot experts
    assert scale.rows_per_expert(TINY, 4, scenario="truncation", cut=4) == [4 * 6 + 4 * 4 * 2 // 4]


def test_alltoall_forward_by_hand():
    steps = dict(scale.forward_phases(TINY.replace(dispatcher="alltoall"), 2))
    # kept through the experts: probs [10x4] bf16 + routing map [10x4] bool; permuted rows [20x8] bf16, their probs
    # and int64 indices; received rows + probs; rows sorted by expert + probs
    base = 80 + 40 + (320 + 40 + 160) + (320 + 40) + (320 + 40)
    assert sum(steps["dispatch.sort_by_expert"].values()) == base
    # expert 0: 10 rows; fc1 out + gelu [10x16] bf16 = 640 (= activation + scaled copy, > act + fc2 out 480)
    assert sum(steps["experts.0"].values()) == base + 640
    # expert 1 also holds expert 0's [10x8] output
    assert sum(steps["experts.1"].values()) == base + 160 + 640
    peak = scale.forward_peak(TINY.replace(dispatcher="alltoall"), 2)
    assert (peak["bytes"], peak["step"]) == (base + 800, "experts.1")
    assert scale.persistent_bytes(TINY.replace(dispatcher="alltoall"), 2) == 0


def test_allgather_forward_by_hand():
    steps = dict(scale.forward_phases(TINY, 2))
    # gathered: tokens [20x8] bf16 (global buffer, kept after the forward), probs [20x4] bf16, map [20x4] bool
    gathered = 80 + 40 + 320 + 160 + 80
    assert sum(steps["dispatch.all_gather"].values()) == gathered
    # through the experts: map + buffer + gathered probs, local map [20x2], local probs [20], indices, rows [20x8]
    keep = 40 + 320 + 160 + 40 + 40 + 160 + 320
    assert sum(steps["experts.1"].values()) == keep + 160 + 640
    assert sum(steps["combine.unpermute"].values()) == keep + 320 + 320  # expert out + zeros [20x8]
    assert scale.forward_peak(TINY, 2)["step"] == "experts.1"
    assert scale.persistent_bytes(TINY, 2) == 320 and scale.persistent_bytes(TINY, 1) == 0
    # deterministic: index_add_ into a second zeroed [20x8]
    det = dict(scale.forward_phases(TINY.replace(deterministic=True), 2))
    assert sum(det["combine.unpermute"].values()) == keep + 320 + 2 * 320
    # fp32 router: x and W cast to fp32, [20x8] cast to fp32 for the reduce-scatter, its fp32 [10x8] result
    fp32 = dict(scale.forward_phases(TINY.replace(router_dtype="fp32"), 2))
    assert fp32["router.gating"]["router.casts"] == 10 * 8 * 4 + 4 * 8 * 4
    rs = fp32["combine.reduce_scatter"]
    assert rs["combine.cast_to_probs_dtype"] == 20 * 8 * 4 and rs["combine.reduce_scattered"] == 10 * 8 * 4
    # CPU/gloo terms: reduce-scatter on a copy; bf16 x fp32 multiply copies the bf16 operand
    cpu = dict(scale.forward_phases(TINY.replace(router_dtype="fp32"), 2, device="cpu"))
    assert cpu["combine.reduce_scatter"]["combine.gloo_copy"] == 20 * 8 * 4
    assert cpu["experts.0"]["experts.intermediates"] == 10 * 16 * (2 + 4 + 4)


def test_allgather_grows_with_ep_alltoall_does_not():
    ds = scale.presets()["deepseek-v3"]
    ag = [scale_plan.plan(ds, ep, dispatcher="allgather") for ep in (8, 16, 32, 64)]
    a2a = [scale_plan.plan(ds, ep, dispatcher="alltoall") for ep in (8, 16, 32, 64)]
    assert [r["tokens_seen"] for r in ag] == [4096 * ep for ep in (8, 16, 32, 64)]
    assert [r["persistent_bytes"] for r in ag] == [4096 * ep * 7168 * 2 for ep in (8, 16, 32, 64)]
    assert all(b["forward_bytes"] + b["persistent_bytes"] > a["forward_bytes"] + a["persistent_bytes"]
               for a, b in zip(ag, ag[1:]))
    assert len({r["forward_bytes"] for r in a2a}) == 1 and all(r["persistent_bytes"] == 0 for r in a2a)
    assert all(r["rows"] == 4096 * 8 for r in ag + a2a)  # seq x topk rows per rank, balanced
    assert all(r["fits"] for r in ag + a2a)  # one layer fits an H200 at every EP
    # compute of the busiest rank: 2 x rows x hidden x ffn x 2 GEMMs, and the estimate at 600 TFLOP/s
    r = a2a[0]
    assert r["expert_flops"] == 2 * 32768 * 7168 * 2048 * 2 and r["router_flops"] == 2 * 4096 * 7168 * 256
    assert r["est_ms"] == pytest.approx(1e3 * (r["expert_flops"] + r["router_flops"]) / 600e12)


def test_truncation_input_concentrates_rows_on_one_rank():
    seed = MoEConfig.seed_report()
    for ep in (2, 4, 8):
        r = scale_plan.plan(seed, ep)
        # zero tokens on every rank → experts 0..5 on rank 0: EP x (1024 - 90) x 6 rows + a share of the 90 kept
        assert r["rows_truncation"] >= ep * 934 * 6 > r["rows"] == 1024 * 6
        assert r["forward_truncation_bytes"] > r["forward_bytes"]


def test_deepseek_v3_needs_ep16_when_gated():
    ds = scale.presets()["deepseek-v3"]
    assert scale_plan.min_ep(ds, scale.DEEPSEEK_V3_MOE_LAYERS) == 8  # gelu experts, as the lab builds them
    assert scale_plan.min_ep(ds, scale.DEEPSEEK_V3_MOE_LAYERS, gated=True) == 16  # SwiGLU, as V3: fc1 x2
    row = scale_plan.plan(ds, 8, gated=True, moe_layers=58)
    assert not row["model_fits"] and row["fits"]


def test_bad_input_says_value_and_rule():
    with pytest.raises(ValueError, match=r"num_experts \(64\) must be divisible by ep \(3\)"):
        scale_plan.plan(MoEConfig.seed_report(), 3)
    with pytest.raises(ValueError, match=r"ep \(0\) must be a positive integer"):
        scale.param_bytes(TINY, 0)
    with pytest.raises(ValueError, match=r"imbalance \(0.5\) must be a number >= 1"):
        scale.rows_per_expert(TINY, 2, imbalance=0.5)
    with pytest.raises(ValueError, match=r"cut \(10\) must be an integer in 1..seq_len-1 \(9\)"):
        scale.rows_per_expert(TINY, 2, scenario="truncation", cut=10)
    with pytest.raises(ValueError, match="scenario"):
        scale.rows_per_expert(TINY, 2, scenario="worst")
    with pytest.raises(ValueError, match=r"counts has 1 entries; this rank has 2 local experts"):
        scale.forward_phases(TINY, 2, counts=[3])
    with pytest.raises(ValueError, match=r"tflops \(0\) must be a positive number"):
        scale_plan.plan(TINY, 2, tflops=0)


def test_lab_comparison_constants_match_the_cpu_allocator():
    """COMPARE_BYTES_PER_ELEMENT and the fingerprint terms are what metrics.compare / fingerprint allocate (profiler)."""
    n = 1 << 16
    a = torch.randn(n // 64, 64).to(torch.bfloat16)
    b = a.clone()
    b.view(torch.int16).add_(1)  # every element one ULP off: compare's worst case (it measures differing elements)
    peak = scale_measure._cpu_peak(lambda: metrics.compare(a, b))["peak_bytes"] / n
    assert peak == pytest.approx(scale.COMPARE_BYTES_PER_ELEMENT, rel=0.1)
    one = a.clone()
    one[0, 0] += 1  # one differing element: the mask and the bit views, a small fraction of the worst case
    assert scale_measure._cpu_peak(lambda: metrics.compare(a, one))["peak_bytes"] / n < 0.2 * peak
    # fingerprint: bounded by one chunk's working set, whatever the size; the weight table is its only state
    assert (scale.FINGERPRINT_CHUNK_WORDS["cuda"], scale.FINGERPRINT_CHUNK_WORDS["cpu"]) == (metrics.FP_CHUNK,
                                                                                           metrics.FP_CHUNK_CPU)
    metrics._FP_TABLES.clear()
    cold = scale_measure._cpu_peak(lambda: metrics.fingerprint(a))
    assert cold["kept_bytes"] == pytest.approx(scale.FINGERPRINT_TABLE_BYTES, rel=0.01)
    warm = scale_measure._cpu_peak(lambda: metrics.fingerprint(a))
    assert warm["peak_bytes"] == pytest.approx(scale.fingerprint_peak_bytes(n, "cpu"), rel=0.05)
    big = torch.zeros(1 << 20, dtype=torch.bfloat16)  # 4 chunks on CPU: the peak stays one chunk's
    metrics.fingerprint(big)
    assert scale_measure._cpu_peak(lambda: metrics.fingerprint(big))["peak_bytes"] == pytest.approx(
        scale.fingerprint_peak_bytes(big.numel(), "cpu"), rel=0.05)
    assert scale.fingerprint_peak_bytes(big.numel(), "cpu") == scale.FINGERPRINT_CHUNK_WORDS["cpu"] * 24


def test_cli_table_json_and_errors(capsys):
    assert cli.main(["scale"]) == 0
    out = capsys.readouterr().out
    assert "| allgather | 8 | 8 |" in out and "| alltoall | 2 | 32 |" in out and "ESTIMATE at 600 TFLOP/s" in out
    assert cli.main(["scale", "--preset", "deepseek-v3", "--ep", "8,64", "--seq", "2048", "--tflops", "400",
                     "--json"]) == 0
    rec = json.loads(capsys.readouterr().out)
    assert [(r["dispatcher"], r["ep"]) for r in rec["plan"]] == [("allgather", 8), ("allgather", 64),
                                                                ("alltoall", 8), ("alltoall", 64)]
    assert {r["seq_len"] for r in rec["plan"]} == {2048} and {r["tflops"] for r in rec["plan"]} == {400.0}
    assert rec["measured"] is None
    assert cli.main(["scale", "--ep", "3"]) == 2
    assert "moe-lab scale: error: num_experts (64) must be divisible by ep (3)" in capsys.readouterr().err
    assert cli.main(["scale", "--dispatcher", "flex"]) == 2
    assert "each value must be one of allgather, alltoall" in capsys.readouterr().err
    with pytest.raises(SystemExit):
        cli.main(["scale", "--ep", "0"])
