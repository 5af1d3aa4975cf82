"""On 4 gloo engines: the same global weights and tokens under EP=1, EP=4, TP=2 x EP=2 (ETP=2 and ETP=1)
and sequence parallelism. In fp32 with an fp64 router every layout computes the same function (relative error at
rounding level) — the control, another seed for the reference, is far off, so the check can fail; and records carry
the case's own layout, not the one the cluster started with."""

import pytest

from moe_lab.config import MoEConfig
from moe_lab.questions.reproduce import layouts
from moe_lab.experiments import protocol

pytestmark = pytest.mark.cluster

LAYOUTS = ("ep1", "ep4", "ep2", "tp2,ep2", "tp2,ep2,etp1", "tp2,ep2,sp", "tp4,ep1")


def _run(cluster, base, specs=LAYOUTS, **kw):
    cases = [layouts.case(base, s, **kw) for s in specs]
    return {r["layout_spec"]: r for r in protocol.run(layouts, cluster=cluster, cases=cases, notebook="")}


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_every_layout_computes_the_same_layer(cpu_cluster, dispatcher):
    base = MoEConfig(num_experts=8, topk=4, dtype="fp32", router_dtype="fp64", dispatcher=dispatcher, gated=True,
                     shared_ffn=128)
    recs = _run(cpu_cluster, base)
    for spec, r in recs.items():
        c = r["vs_reference"]
        assert c["numel"] == 128 * 256 and r["stages_vs_reference"]["router.routing_map"]["bitwise_equal"], spec
        # the same weights: fp32 rounding-order differences only, a few ULPs on average (near-zero outputs can be
        # 1e3 ULPs apart after cancellation, hence the mean)
        assert c["mean_ulp"] < 100, f"{spec}: {c}"
    assert recs["ep1"]["is_reference"] and recs["ep1"]["vs_reference"]["bitwise_equal"]
    # records carry the case's layout (the cluster started at tp 1 x ep 4)
    assert (recs["tp2,ep2"]["tp"], recs["tp2,ep2"]["ep"], recs["tp2,ep2"]["etp"]) == (2, 2, 2)
    assert (recs["tp2,ep2,etp1"]["etp"], recs["tp4,ep1"]["ep"], recs["ep1"]["ep"]) == (1, 1, 1)
    assert recs["tp2,ep2,sp"]["sequence_parallel"] and recs["tp2,ep2,sp"]["layout"].endswith("sequence parallel")


def test_the_check_fails_against_another_layer(cpu_cluster):
    """The control: a reference of another seed differs everywhere (so 'same layer' above is a real check)."""
    base = MoEConfig(num_experts=8, topk=4, dtype="fp32", router_dtype="fp64")
    other = layouts.case(base, "ep4")
    other.knobs["reference_seed"] = base.seed + 1
    rec = protocol.run(layouts, cluster=cpu_cluster, cases=[other], notebook="")[0]
    assert rec["vs_reference"]["mean_ulp"] > 1e5 and rec["vs_reference"]["mismatch_frac"] > 0.9


def test_bf16_allgather_at_ep4_differs_from_ep1_and_says_where(cpu_cluster_pinned):
    """bf16, allgather: the combine sums a token's k expert outputs in another order at EP=4 than at EP=1 (gloo's
    reduce order, not a CPU GEMM: on engines with oneDNN capped below AMX)."""
    recs = _run(cpu_cluster_pinned, MoEConfig(num_experts=8, topk=4), specs=("ep1", "ep4"), trials=2)
    r = recs["ep4"]
    assert r["vs_reference"]["n_differ"] == 2 and r["first_divergent_stage"] == "out"
    assert r["rerun"]["bitwise_equal"] and recs["ep1"]["vs_reference"]["bitwise_equal"]


def test_a_layout_the_world_cannot_take_is_refused_before_engines_start():
    from moe_lab import profiles

    p = profiles.load("cpu", {"layouts": ["ep1", "ep3"]})
    with pytest.raises(ValueError, match=r"layouts entry 'ep3' on 4 ranks: .*world \(4\) must be a multiple of etp x ep"):
        layouts.cases(p)
    p = profiles.load("cpu", {"layouts": ["ep1", "ep4"], "num_experts": 6, "topk": 2})  # the layer's rule
    with pytest.raises(ValueError, match=r"layouts entry 'ep4' on 4 ranks: .*num_experts \(6\) must be divisible"):
        layouts.cases(p)
    assert len(layouts.cases(profiles.load("cpu", {"layouts": ["ep1", "tp2,ep2"]}))) == 2 * 2 * 2  # the control


def test_switching_layouts_leaves_no_threads_behind(cpu_cluster):
    """Each layout re-initialises megatron's parallel_state; the groups of the previous one are destroyed, so an
    engine's OS threads do not grow with the number of switches (before the fix: ~20 gloo groups, each with its
    threads, left per switch — ~890 threads per engine after this file's tests)."""
    from moe_lab.engine import dist

    base = MoEConfig(num_experts=8, topk=4)
    _run(cpu_cluster, base, specs=("ep1", "ep4", "tp2,ep2"))  # warm: every kind of group made once
    before = cpu_cluster.run(dist.thread_count)
    for _ in range(3):
        _run(cpu_cluster, base.replace(seed=base.seed + _ + 1), specs=("ep1", "ep4", "tp2,ep2", "tp2,ep2,etp1"))
    after = cpu_cluster.run(dist.thread_count)
    assert all(b > 0 for b in before), before
    assert all(a - b <= 8 for a, b in zip(after, before)), (before, after)  # 12 more switches, no growth
