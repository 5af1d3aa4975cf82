"""Notebook 05 on 4 gloo engines: gradients compared across ranks, reruns and truncation; the backward
localised; depth stacks; megatron's options reported as run or not — measured, never assumed."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles
from moe_lab.questions.compound import experiment as compound
from moe_lab.experiments import protocol

pytestmark = pytest.mark.cluster

SETTINGS = ["plain", "router fp32", "router fp32 + fp32 grad reduce", "routing replay", "batch_invariant_mode",
            "moe_permute_fusion", "deterministic + ordered_combine+no_splitk + routing replay",
            "deterministic + ordered_combine+no_splitk + routing replay + fp32 grad reduce"]


@pytest.fixture(scope="module")
def recs(cpu_cluster, cpu_cluster_pinned, cpu_layer):
    """The backward cases on the default engines; the depth stacks, whose truncation check needs batch-invariant
    GEMMs (not the point there), on engines with oneDNN capped below AMX (tests/README.md). At the layer for this
    CPU's bf16 GEMM: 16 cases' forwards and backwards, most of this tier's GEMMs on a slow path."""
    P = profiles.load("cpu", {"trials": 2, "cost_rounds": 2, **cpu_layer.overrides()})
    cases = compound.cases(P, settings=SETTINGS, depth_settings=["plain"], layers=3)
    back = protocol.run(compound, P, cluster=cpu_cluster, cases=[c for c in cases if c.kind != "depth"])
    return back + protocol.run(compound, P, cluster=cpu_cluster_pinned, cases=[c for c in cases if c.kind == "depth"])


@ipp.interactive  # sent by value: the engines cannot import this test module
def _cached_layers_with_grads():
    from moe_lab.engine.dist import STATE

    layers = STATE.get("layers", {})
    return len(layers), sum(any(p.grad is not None for p in lyr.parameters()) for lyr in layers.values())


def test_no_cached_layer_keeps_gradients_after_the_backward_cases(recs, cpu_cluster):
    """A case's gradients (and its cost rounds', of the case's and the plain layer) are dropped when it ends: on a GPU
    a set of the seed layer's gradients is as big as its weights (4 GiB a rank at EP 4), and the engine's layer cache
    keeps the layers into the next case."""
    kept = cpu_cluster.run(_cached_layers_with_grads)
    assert all(n >= 2 for n, _ in kept), kept  # the last case's layer and its plain reference are cached
    assert [with_grads for _, with_grads in kept] == [0] * 4, kept


def _back(recs, d, setting):
    return next(r for r in recs if r["kind"] == "backward" and r["dispatcher"] == d and r["setting"] == setting)


def test_allgather_gradients_differ_across_ranks_and_router_fp32_fixes_only_the_forward(recs):
    plain, fp32 = _back(recs, "allgather", "plain"), _back(recs, "allgather", "router fp32")
    assert plain["cross_out"]["n_differ"] == 2 and plain["cross_dx"]["n_differ"] == 2  # forward and gradient
    assert fp32["cross_out"]["bitwise_equal"] and not fp32["cross_dx"]["bitwise_equal"]  # the forward only
    assert fp32["cross_router_grad"]["bitwise_equal"] and fp32["rerun_dx"]["bitwise_equal"]
    # the backward's token-gradient reduce-scatter runs in bf16: that is where it first differs
    assert plain["backward_first_divergent"] == "dispatch.pre.tokens"
    assert ("reduce_scatter_tensor", "bfloat16") in {(c["op"], c["dtype"]) for c in plain["backward_ledger"]}
    assert all(r["cross_dx"]["numel"] == 128 * 256 for r in (plain, fp32))


def test_an_fp32_gradient_reduce_makes_the_ranks_agree(recs):
    fix = _back(recs, "allgather", "router fp32 + fp32 grad reduce")
    assert fix["cross_out"]["bitwise_equal"] and fix["cross_dx"]["bitwise_equal"] and fix["cross_router_grad"]["bitwise_equal"]
    assert ("reduce_scatter_tensor", "float32") in {(c["op"], c["dtype"]) for c in fix["backward_ledger"]}
    assert fix["backward_first_divergent"] is None and fix["cost"]["rounds"] == 2


def test_expert_weight_gradients_and_routing_replay(recs):
    """The weight gradient reduces over the rows M: on CPU too it changes when zeroed rows are added (4 elements in
    every trial on the CI machine's CPU GEMM; the count depends on its blocking), and routing replay — every expert
    gets the rows it had — makes it bitwise equal."""
    plain = _back(recs, "allgather", "plain")
    # Whether the plain weight gradient changes under truncation is the CPU GEMM's M-blocking (4 elements on the CI
    # machine inside the full suite; equal when this module runs alone, at 722d763 too): a CPU bitwise result, so it
    # is reported, not asserted. The control that this check can fail is the combined setting's cross_dx below.
    print("plain experts_truncation:", plain["experts_truncation"]["n_mismatch"], "of",
          plain["experts_truncation"]["numel"])
    for d in ("allgather", "alltoall"):
        replay = _back(recs, d, "routing replay")
        assert replay["experts_truncation"]["bitwise_equal"] and replay["experts_rerun"]["bitwise_equal"]
        assert replay["truncation_dx"]["bitwise_equal"] and replay["truncation_out"]["bitwise_equal"]
    # every remedy at once (the routing replayed and the lab's toggles entered together): the same, and it ran
    both = _back(recs, "allgather", "deterministic + ordered_combine+no_splitk + routing replay")
    assert both["available"] and both["remedy"] == "routing_replay+ordered_combine+no_splitk" and both["deterministic"]
    assert both["experts_truncation"]["bitwise_equal"] and both["truncation_dx"]["bitwise_equal"]
    assert not both["cross_dx"]["bitwise_equal"]  # the control: the backward's bf16 reduce-scatter still differs
    every = _back(recs, "allgather", "deterministic + ordered_combine+no_splitk + routing replay + fp32 grad reduce")
    assert every["available"] and compound.grads_agree(every)


def test_unavailable_options_are_findings_not_crashes(recs):
    for setting, why in (("batch_invariant_mode", "GPU only"), ("moe_permute_fusion", "fused_permute")):
        r = _back(recs, "allgather", setting)
        assert r["available"] is False and (why in r["reason"] or "triton" in r["reason"]), r["reason"]
    v = compound.verdict(recs)
    assert "batch_invariant_mode: not run here" in v
    # a setting whose forward agrees across ranks while its input gradients do not is said so (the bf16 backward
    # reduce-scatter of the allgather dispatcher)
    assert any("router fp32: still:" in line and "cross dx" in line and "cross out" not in line
               for line in v.splitlines()), v


def test_depth_records_per_layer(recs):
    rows = [r for r in recs if r["kind"] == "depth" and r["dispatcher"] == "allgather"]
    same = sorted((r for r in rows if r["stack"] == "the same layer x4"), key=lambda r: r["layer"])
    distinct = sorted((r for r in rows if r["stack"] == "3 distinct layers"), key=lambda r: r["layer"])
    assert [r["layer"] for r in same] == [1, 2, 3, 4] and [r["layer"] for r in distinct] == [1, 2, 3]
    fr = [r["cross_out"]["mismatch_frac"] for r in same]
    assert fr[0] > 0 and fr[-1] > fr[0]  # EP-order differences grow with depth
    assert all(r["truncation_out"]["bitwise_equal"] and r["rerun_out"]["bitwise_equal"] for r in same)
    assert all(r["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16" for r in rows)  # pinned, and said so
    a2a = [r for r in recs if r["kind"] == "depth" and r["dispatcher"] == "alltoall"]
    assert all(r["cross_out"]["bitwise_equal"] and r["cross_grad"]["bitwise_equal"] for r in a2a)
    assert "outputs across ranks differ from after layer 1 on" in compound.verdict(recs)
