"""Notebook 06 on 4 gloo engines: the lab's data-parallel step (megatron DDP's arithmetic, written out because
megatron's DDP and optimizer cannot run over gloo / on CPU) equals EP=1 in fp64 at EP=2 and 4 and at TP 2 x EP 2
(sequence parallel; ETP 2 and ETP 1), and a wrong expert gradient scale and a missing sequence-parallel all-reduce of
the router gradient are each caught by the same comparison; in bf16 every record carries its layout and the findings
read them."""

import pytest

from moe_lab import profiles
from moe_lab.experiments import protocol
from moe_lab.questions.training import experiment as training
from moe_lab.questions.training import findings as ft

pytestmark = pytest.mark.cluster

SMALL = {"tokens": 16, "hidden": 32, "ffn_hidden": 64, "topk": 2, "cost_rounds": 0}
TP = ["tp2,ep2,sp", "tp2,ep2,etp1,sp"]
FP64 = {**SMALL, "steps": 6, "stacks": [2], "settings": ["plain"], "deterministic": [True], "reruns": 1,
        "layouts": TP}
ROUNDING = 1e-12  # fp64: sums in another order differ by a few ULP (2.2e-16 each), never by 1e-12 in 6 steps


@pytest.fixture(scope="module")
def fp64(cpu_cluster):
    P = profiles.load("cpu", {"training": FP64})
    by = lambda recs: {ft.layout_of(r): r for r in recs}  # noqa: E731
    runs = {m: by(protocol.run(training, P, cluster=cpu_cluster, cases=training.cases(P, precision="fp64", mistake=m)))
            for m in ("none", "expert_dp", "no_sp_reduce")}
    return runs


def _apart(a: dict, b: dict) -> dict:
    return {"loss": max(ft.rel_loss(a, b)),
            "grad_norm": max(abs(x - y) / y for x, y in zip(a["grad_norm"], b["grad_norm"])),
            "weights": max(ft.weight_divergence(a, b))}


def test_fp64_dp_arithmetic_equals_ep1_to_rounding(fp64):
    right = fp64["none"]
    assert all(r["available"] for r in right.values()), [r.get("reason") for r in right.values()]
    assert set(right) == {"ep1", "ep2", "ep4", *TP}
    sizes = {"ep2": (4, 2, "tp 1 × ep 2"), "ep4": (4, 1, "tp 1 × ep 4"),
             "tp2,ep2,sp": (2, 1, "tp 2 × ep 2, sequence parallel"),
             "tp2,ep2,etp1,sp": (2, 2, "tp 2 × ep 2 (etp 1), sequence parallel")}
    for spec, (dp, edp, words) in sizes.items():
        r = right[spec]
        assert (r["dp"], r["expert_dp"], r["layout"], r["shares"]) == (dp, edp, words, 4)
        assert r["weights_fp"][0] == right["ep1"]["weights_fp"][0]  # the same global initial weights everywhere
        assert r["weights_tensors"] == right["ep1"]["weights_tensors"]  # every tensor once, ETP shards made whole
        assert r["weights_fp"][-1] != r["weights_fp"][0]  # ... and they trained
        gap = _apart(r, right["ep1"])
        print(f"fp64 {spec} vs ep1:", gap)
        assert all(v <= ROUNDING for v in gap.values()), (spec, gap)


def test_a_wrong_expert_gradient_scale_is_caught(fp64):
    """Control: expert gradients divided by the expert-DP size instead of DP — the same where the two sizes agree
    (EP 1: 4 and 4; TP 2 x EP 2 at ETP 1: 2 and 2), 2x or 4x too large elsewhere: Adam is nearly scale-invariant, but
    the gradient norm and the weights part far beyond rounding."""
    right, wrong = fp64["none"], fp64["expert_dp"]
    for spec in ("ep1", "ep2", "ep4", *TP):
        r = right[spec]
        gap = _apart(wrong[spec], right["ep1"])
        print(f"wrong scale {spec} (dp {r['dp']}, expert dp {r['expert_dp']}) vs ep1:", gap)
        if r["dp"] == r["expert_dp"]:
            assert _apart(wrong[spec], r)["weights"] == 0, spec  # the mistake is a no-op here
        else:
            assert gap["grad_norm"] > 1e-3 and gap["weights"] > 1e3 * ROUNDING, (spec, gap)
    assert sum(right[s]["dp"] != right[s]["expert_dp"] for s in right) == 3  # ep2, ep4, tp2,ep2,sp


def test_a_missing_sequence_parallel_router_reduce_is_caught(fp64):
    """Control: the router gradient not summed over TP (each TP rank steps on its own half of the tokens): a no-op at
    TP 1, caught at TP 2 — the routers of the two TP ranks even part from each other, so the weights do."""
    right, wrong = fp64["none"], fp64["no_sp_reduce"]
    for spec in ("ep2", "ep4"):
        assert _apart(wrong[spec], right[spec])["weights"] == 0
    for spec in TP:
        gap = _apart(wrong[spec], right["ep1"])
        print(f"no sp reduce {spec} vs ep1:", gap)
        assert gap["grad_norm"] > 1e-3 and gap["weights"] > 1e3 * ROUNDING, (spec, gap)


def test_routing_replay_routes_every_token_where_it_is_told(cpu_cluster):
    """The replay knob drives megatron's router replay: fed top-2 = (0, 1) for every token, every layout routes every
    token to experts 0 and 1 — the control: the reference run's own routing is not that."""
    import base64
    import zlib

    P = profiles.load("cpu", {"training": {**SMALL, "steps": 2, "stacks": [1], "settings": ["plain", "routing replay"],
                                           "deterministic": [True], "reruns": 1, "eps": [1, 2],
                                           "layouts": ["tp2,ep2,sp"]}})
    (ref,) = protocol.run(training, P, cluster=cpu_cluster,
                          cases=[c for c in training.cases(P) if c.knobs["setting"] == training.REPLAY])
    case, tp_case = training.replay_cases(P, [ref])
    assert tp_case.layout.spec() == "tp2,ep2,sp" and "tp2,ep2,sp" in tp_case.label
    forced = base64.b64encode(zlib.compress(bytes([0, 1] * 16))).decode()  # the engine's packing of uint8 top-k
    told = [protocol.Case(**{**{f: getattr(c, f) for f in c.__dataclass_fields__},
                             "knobs": {**c.knobs, "replay": [[forced, forced]]}}) for c in (case, tp_case)]
    for rec in protocol.run(training, P, cluster=cpu_cluster, cases=told):  # ep2; tp2,ep2,sp: each rank its share
        assert rec["available"], rec.get("reason")
        assert [s["topk"] for s in rec["routing"][0]] == [forced, forced], ft.layout_of(rec)
    assert ref["routing"][0][0]["topk"] != forced  # the control
