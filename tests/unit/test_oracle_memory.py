"""Notebook 08's layer sized to the GPU share of ranks that share one GPU (`questions.oracle.memory`, applied by
`experiment.cases`): the rule against the H100 run that ran out of memory and the H200 run that did not, the bytes it
counts, where it applies, the record it leaves and the findings' words. Torch-free."""

import dataclasses

import pytest

from moe_lab import profiles
from moe_lab.questions.oracle import experiment, memory
from moe_lab.questions.oracle.params import OracleParams
from moe_lab.config import ClusterConfig
from moe_lab.questions.oracle import findings as found

H100_GIB, H200_GIB = 79.18, 139.8  # as the engines' torch read them (total_memory / 2**30)


def _gpu():
    c = profiles.load("gpu")
    return c.layer, c.params(OracleParams)


def test_the_seed_layer_at_ep4_is_the_fp64_weights_measured_on_the_h100():
    layer, _ = _gpu()
    fp64 = memory.expert_weights_per_rank(layer, "ep4", 4, memory.FP64_BYTES)
    by_hand = (64 // 4) * (4096 * 16384 + 16384 * 4096) * 8 + 4096 * 64 * 8  # 16 experts' fc1 + fc2, the router
    assert fp64 == by_hand and round(fp64 / 2**30, 1) == 16.0
    # EP 1 in bf16 holds every expert: the same bytes; ETP 2 halves a rank's expert share; gated doubles fc1
    assert memory.expert_weights_per_rank(layer, "ep1", 4, memory.BF16_BYTES) == (
        64 * (2 * 4096 * 16384) * 2 + 4096 * 64 * 2)
    assert memory.expert_weights_per_rank(layer, "tp2,ep2", 4, memory.FP64_BYTES) == fp64
    gated = layer.replace(gated=True)
    assert memory.expert_weights_per_rank(gated, "ep4", 4, 8) == 16 * (2 * 4096 * 16384 + 16384 * 4096) * 8 \
        + 4096 * 64 * 8


def test_on_an_h100_shared_by_four_ranks_the_seed_layer_is_sized_and_on_an_h200_it_is_not():
    layer, p = _gpu()
    h100 = memory.size(layer, p, 4, H100_GIB / 4)
    # the H100 run (22.0 GiB held a rank, out of memory) is what the rule says does not fit ...
    assert h100.need_gib > H100_GIB / 4 and h100.ffn_hidden == 8192 and h100.sized_need_gib < H100_GIB / 4
    # ... where the fp64 weights alone (16.0 GiB) would have said it fits: the held-over-weights factor decides
    assert memory.need_gib(layer, p, 4) / memory.HELD_OVER_WEIGHTS < H100_GIB / 4
    words = h100.words()
    assert "sized to this GPU: expert ffn 8192, not the profile's 16384" in words and "19.8 GiB" in words \
        and "22.4 GiB" in words
    h200 = memory.size(layer, p, 4, H200_GIB / 4)
    assert h200.ffn_hidden is None and h200.words() == ""


def test_a_layer_that_cannot_be_narrowed_says_it_may_run_out_of_memory():
    layer, p = _gpu()
    narrow = layer.replace(ffn_hidden=memory.MIN_FFN)
    s = memory.size(narrow, p, 4, 0.01)
    assert s.ffn_hidden is None and "cannot be halved further: it may run out of memory" in s.words()
    tiny = memory.size(layer, p, 4, 0.05)  # narrowed to the floor and still over: said
    assert tiny.ffn_hidden == memory.MIN_FFN and "so it may run out of memory" in tiny.words()
    with pytest.raises(ValueError, match="must be positive"):
        memory.size(layer, p, 4, 0)


def test_the_parameter_sets_the_oracle_layer_alone():
    c = profiles.load("cpu", {"oracle.ffn_hidden": 256})
    (case,) = experiment.cases(c)
    assert case.moe.ffn_hidden == 256 and c.layer.ffn_hidden == 512  # the other notebooks keep the profile's
    assert experiment.cases(profiles.load("cpu"))[0].moe.ffn_hidden == 512
    for bad in (-1, 1.5, True):
        with pytest.raises(ValueError, match="oracle.ffn_hidden"):
            profiles.load("cpu", {"oracle.ffn_hidden": bad})


def _placed(monkeypatch, gib, *, device="cuda", ranks_per_gpu=4, engines=4):
    from moe_lab.controller import placement

    monkeypatch.setattr(placement, "from_settings",
                        lambda settings: ClusterConfig(device=device, engines=engines, ranks_per_gpu=ranks_per_gpu))
    monkeypatch.setattr(placement, "gpu_total_bytes", lambda n: None if gib is None else [int(gib * 2**30)] * n)


def test_the_case_is_sized_only_where_ranks_share_a_gpu_too_small_for_it(monkeypatch):
    config = profiles.load("gpu")
    _placed(monkeypatch, H100_GIB)
    (c,) = experiment.cases(config)
    assert c.moe.ffn_hidden == 8192 and c.knobs["memory"]["ffn_hidden"] == 8192
    assert c.knobs["memory"]["profile_ffn"] == 16384 and round(c.knobs["memory"]["share_gib"], 1) == 19.8
    for gib, kw in ((H200_GIB, {}), (H100_GIB, {"ranks_per_gpu": 1}), (None, {}), (H100_GIB, {"device": "cpu", "ranks_per_gpu": 1})):
        _placed(monkeypatch, gib, **kw)  # an H200, a GPU per rank (NCCL), no memory read, a CPU: the profile's
        (c,) = experiment.cases(config)
        assert c.moe.ffn_hidden == 16384 and "memory" not in c.knobs, (gib, kw)
    _placed(monkeypatch, H100_GIB)
    (c,) = experiment.cases(profiles.load("gpu", {"oracle.ffn_hidden": 16384}))  # given: not sized
    assert c.moe.ffn_hidden == 16384 and "memory" not in c.knobs


def test_the_record_keeps_the_sizing_and_the_findings_say_it(monkeypatch):
    layer, p = _gpu()
    sized = memory.size(layer, p, 4, int(H100_GIB * 2**30) / 2**30 / 4)  # as the GPU's bytes read
    rec = {"kind": "oracle", "memory": dataclasses.asdict(sized)}
    assert found._sized_words(rec) == "; " + sized.words() and "expert ffn 8192" in found._sized_words(rec)
    assert found._sized_words({"kind": "oracle"}) == ""  # unsized: nothing said
    _placed(monkeypatch, H100_GIB)
    (c,) = experiment.cases(profiles.load("gpu"))
    per_rank = [{"rank": 0, "runs": [], "pairs": [], "fp64_layouts": {}, "truth": {"layout": "ep4", "elements": 1}}]
    assert experiment.records(c, per_rank)[0]["memory"] == dataclasses.asdict(sized)
    _placed(monkeypatch, H200_GIB)
    (c,) = experiment.cases(profiles.load("gpu"))
    assert "memory" not in experiment.records(c, per_rank)[0]
