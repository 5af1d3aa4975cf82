"""Notebook 08's layer sized to the GPU share of ranks that share one GPU (`questions.oracle.memory`, the runner's
`_size_the_oracle`): the rule against the H100 run that ran out of memory and the H200 run that did not, the bytes it
counts, the parameter it sets, and the index's words. Torch-free."""

from types import SimpleNamespace

import pytest

from moe_lab import profiles
from moe_lab.questions.oracle import experiment, memory
from moe_lab.questions.oracle.params import OracleParams
from moe_lab.reporting import runner

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
    assert "expert ffn 8192, not the profile's 16384" in words and "19.8 GiB" in words and "22.4 GiB" in words
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


def _cluster(gib, ranks_per_gpu=4, engines=4):
    info = [{"rank": r, "gpu_memory_bytes": int(gib * 2**30)} for r in range(engines)]
    return SimpleNamespace(info=info, state=SimpleNamespace(config=SimpleNamespace(ranks_per_gpu=ranks_per_gpu),
                                                            engine_ids=list(range(engines))))


def test_the_run_sizes_the_oracle_only_where_08_runs_on_ranks_sharing_a_gpu():
    config = profiles.load("gpu")
    s = runner._size_the_oracle(_cluster(H100_GIB), config, {}, ["07", "08"])
    assert s.ffn_hidden == 8192
    assert runner._size_the_oracle(_cluster(H200_GIB), config, {}, ["08"]).ffn_hidden is None
    assert runner._size_the_oracle(_cluster(H100_GIB), config, {}, ["07", "09"]) is None  # 08 not in the run
    assert runner._size_the_oracle(_cluster(H100_GIB), config, {"oracle.ffn_hidden": 16384}, ["08"]) is None
    assert runner._size_the_oracle(_cluster(H100_GIB, ranks_per_gpu=1), config, {}, ["08"]) is None  # NCCL
    assert runner._size_the_oracle(None, config, {}, ["08"]) is None
    page = runner._profile_and_sizing_notes({"oracle_sizing": s.words()})
    assert "Sized for this GPU's memory:</b> notebook 08 ran its layer with expert ffn 8192" in page
    assert "Sized for this GPU's memory" not in runner._profile_and_sizing_notes({})
