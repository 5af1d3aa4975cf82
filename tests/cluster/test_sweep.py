"""Notebook 03's grid, its input checks, and resuming from results.json without re-measuring."""

import pytest

from moe_lab import profiles
from moe_lab.questions.promotion import experiment as promotion
from moe_lab.experiments import protocol
from moe_lab import results


def test_grid_is_the_full_product():
    """Every dispatcher x router dtype x probs-fp32-gather x deterministic cell, once (the cpu profile's axes, and
    the control: the full axes given as overrides)."""
    from moe_lab.questions.promotion.params import PromotionParams

    for P in (profiles.load("cpu"), profiles.load("cpu", {"sweep_router_dtypes": ["none", "fp32", "fp64"],
                                                         "deterministic": [False, True]})):
        pp = P.params(PromotionParams)
        cells = promotion.grid(P)
        assert len(cells) == (len(P.run.dispatchers) * len(pp.router_dtypes(P)) * len(pp.probs_fp32_gather)
                              * len(pp.deterministic))
        assert len({(c.dispatcher, c.router_dtype, c.probs_fp32_gather, c.deterministic) for c in cells}) == len(cells)
    assert len(cells) == 2 * 3 * 2 * 2


@pytest.mark.parametrize("bad, msg", [({"releases": ["latest"]}, "releases entry"), ({"trials": 0}, "trials"),
                                      ({"deterministic": ["yes"]}, "deterministic")])
def test_bad_sweep_parameters(bad, msg):
    with pytest.raises(ValueError, match=msg):
        profiles.load("cpu", bad)


@pytest.mark.cluster
def test_an_interrupted_sweep_resumes_without_remeasuring(tmp_path, monkeypatch, cpu_cluster):
    """On the session's cluster (the resume is the protocol's: results.json, not the engines)."""
    P = profiles.load("cpu", {"dispatchers": ["allgather"], "sweep_router_dtypes": ["none", "fp32"],
                              "releases": ["installed"], "trials": 1, "cost_rounds": 2, "probs_fp32_gather": [False],
                              "deterministic": [False]})
    path = tmp_path / "results.json"
    calls = []
    real = protocol.measure

    def one_then_interrupt(*a, **k):
        if calls:
            raise KeyboardInterrupt  # the user stops the sweep after the first cell
        calls.append(1)
        return real(*a, **k)

    monkeypatch.setattr(protocol, "measure", one_then_interrupt)
    with pytest.raises(KeyboardInterrupt):
        protocol.run(promotion, P, cluster=cpu_cluster, results=path)
    kept = results.load(path)
    assert len(kept) == 1 and kept[0]["router_dtype"] == "none"  # the finished cell was kept

    monkeypatch.setattr(protocol, "measure", real)
    recs = protocol.run(promotion, P, cluster=cpu_cluster, results=path)
    assert [r["router_dtype"] for r in recs] == ["none", "fp32"]
    assert len(results.load(path)) == 2  # the first cell was not measured again
    assert recs[0]["cross_rank"]["mismatch_frac"] > 0 and recs[1]["cross_rank"]["bitwise_equal"]
    assert recs[1]["cost"]["rounds"] == 2 and recs[0]["notebook"] == "03"
