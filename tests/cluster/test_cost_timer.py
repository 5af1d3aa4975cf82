"""Costs that mean something on 4 gloo engines: every timed round also books the seconds spent inside
torch.distributed collectives (capture.collective_timer, the ledger's patching), the wrapper changes no bit of the
output, and the records of 03 / 04 / 05 carry the compute figure, the collective share and the placement."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles, stats
from moe_lab.questions.compound import experiment as compound
from moe_lab.questions.promotion import experiment as promotion
from moe_lab.experiments import protocol
from moe_lab.questions.truncation import experiment as truncation
from moe_lab.tools import bench_engine

pytestmark = pytest.mark.cluster

P = profiles.load("cpu")
CFG = P.layer  # hidden 256, 8 experts, top-4, 128 tokens, bf16


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_collective_seconds_are_inside_the_forward_and_change_no_bit(cpu_cluster, dispatcher):
    per_rank = cpu_cluster.run(bench_engine.time_collective_timer, {"moe": CFG.replace(dispatcher=dispatcher).asdict()},
                               rounds=4)
    for r in per_rank:
        wall, coll = r["wall_s"]["timed"], r["collective_s"]["timed"]
        assert len(wall) == len(coll) == 4 and "plain" not in r["collective_s"]  # only the timed fn was wrapped
        assert all(0 < c < w for c, w in zip(coll, wall))
        assert all(n > 0 for n in r["calls"]["timed"])
        assert r["outputs_equal"] and r["forwards"] == 10  # warm-up + 4 rounds, both ways: one fingerprint
        assert r["placement"] == {"world": 4, "ranks_per_gpu": 1, "backend": "gloo", "device": "cpu"}
    if dispatcher == "allgather":  # probs + tokens all-gathers, the combine's reduce-scatter
        assert per_rank[0]["calls"]["timed"][0] >= 3
    cost = stats.paired_cost([{**r, "collective_s": {**r["collective_s"], "plain": r["collective_s"]["timed"]}}
                              for r in per_rank], "timed", "plain")
    assert 0 < cost["collective_share"]["with"] < 1 and cost["placement"] == "4 CPU engines over gloo"


def test_a_case_is_bitwise_the_same_with_and_without_the_timer(cpu_cluster):
    """The bf16 allgather case whose ranks differ (EP order): each rank's output, with the collectives timed and
    without, compared element by element (not only by fingerprint), and the ranks' differences the same."""
    per_rank = cpu_cluster.run(_with_and_without, CFG.asdict())
    for r in per_rank:
        assert r["cmp"]["bitwise_equal"] and r["cmp"]["n_mismatch"] == 0
        assert r["fp_timed"] == r["fp_plain"] and r["collective_s"] > 0
    assert len({r["fp_plain"] for r in per_rank}) > 1  # the case still diverges across ranks: it is the real layer
    assert per_rank[0]["leftovers"] == []


@ipp.interactive  # sent by value: the engines cannot import this test module
def _with_and_without(cfg_dict):
    import torch.distributed
    from megatron.core.tensor_parallel import mappings

    from moe_lab import metrics
    from moe_lab.engine import capture, toolkit

    s = toolkit.setup(cfg_dict)
    plain = toolkit.forward(s.layer, s.tokens)
    acc = {}
    with capture.collective_timer(acc):
        timed = toolkit.forward(s.layer, s.tokens)
    left = [n for n in ("all_gather_into_tensor", "reduce_scatter_tensor", "all_to_all_single")
            if getattr(getattr(torch.distributed, n), "_moe_lab_timer", False)]
    left += ["mappings"] if getattr(mappings.dist_all_gather_func, "_moe_lab_timer", False) else []
    return {"cmp": metrics.compare(plain, timed), "fp_plain": metrics.fingerprint(plain),
            "fp_timed": metrics.fingerprint(timed), "collective_s": acc["collective_s"], "leftovers": left}


def _cost_fields(cost):
    assert cost["rounds"] == 3 and cost["compute"]["rounds"] == 3
    assert cost["compute"]["ratio"] > 0 and len(cost["compute"]["ci"]) == 2
    assert 0 < cost["collective_share"]["without"] < 1 and 0 < cost["collective_share"]["with"] < 1
    assert isinstance(cost["transport_bound"], bool)
    assert stats.headline_cost(cost) == ("compute" if cost["transport_bound"] else "wall")
    assert cost["placement"] == "4 CPU engines over gloo"
    assert cost["placement_fields"] == {"world": 4, "ranks_per_gpu": 1, "backend": "gloo", "device": "cpu"}
    assert "environment" in cost


def test_notebook_03_cells_carry_compute_and_collective_share(cpu_cluster):
    Q = profiles.load("cpu", {"dispatchers": ["allgather"], "sweep_router_dtypes": ["none"], "releases": ["installed"],
                              "trials": 1, "cost_rounds": 3, "probs_fp32_gather": [False],
                              "deterministic": [False, True]})
    recs = protocol.run(promotion, Q, cluster=cpu_cluster)
    assert [r["deterministic"] for r in recs] == [False, True]
    for r in recs:  # the plain cell is the A/A floor: the same fields
        _cost_fields(r["cost"])
    assert recs[1]["cost"]["environment"]["deterministic_algorithms"] is True


def test_notebook_04_and_05_costs_carry_them_too(cpu_cluster):
    per_rank = cpu_cluster.run(truncation.engine_case, CFG.asdict(), dict(emulation="none", remedy="none", tile=None),
                               cut=90, rounds=3)
    _cost_fields(truncation._case_record(per_rank)["cost"])
    Q = profiles.load("cpu", {"trials": 1, "cost_rounds": 3, "dispatchers": ["allgather"]})
    cases = [c for c in compound.cases(Q, settings=["plain"], depth_settings=[]) if c.kind == "backward"]
    (rec,) = protocol.run(compound, Q, cluster=cpu_cluster, cases=cases)
    _cost_fields(rec["cost"])
    assert rec["cost"]["environment"]["remedy"] == "none"
