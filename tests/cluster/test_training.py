"""Notebook 06 on 4 gloo engines (#24): the lab's data-parallel step (megatron DDP's arithmetic, written out because
megatron's DDP and optimizer cannot run over gloo / on CPU) equals EP=1 in fp64 at EP=2 and 4, and a wrong expert
gradient scale is caught by the same comparison; in bf16 every record carries its layout and the findings read them."""

import pytest

from moe_lab import profiles
from moe_lab.experiments import protocol, training
from moe_lab.findings import training as ft

pytestmark = pytest.mark.cluster

SMALL = {"tokens": 16, "hidden": 32, "ffn_hidden": 64, "topk": 2, "cost_rounds": 0}
FP64 = {**SMALL, "steps": 6, "stacks": [2], "settings": ["plain"], "deterministic": [True], "reruns": 1}
ROUNDING = 1e-12  # fp64: sums in another order differ by a few ULP (2.2e-16 each), never by 1e-12 in 6 steps


@pytest.fixture(scope="module")
def fp64(cpu_cluster):
    P = profiles.load("cpu", {"training": FP64})
    right = protocol.run(training, P, cluster=cpu_cluster, cases=training.cases(P, precision="fp64"))
    wrong = protocol.run(training, P, cluster=cpu_cluster,
                         cases=training.cases(P, precision="fp64", expert_scale="expert_dp"))
    return {r["ep"]: r for r in right}, {r["ep"]: r for r in wrong}


def _apart(a: dict, b: dict) -> dict:
    return {"loss": max(ft.rel_loss(a, b)),
            "grad_norm": max(abs(x - y) / y for x, y in zip(a["grad_norm"], b["grad_norm"])),
            "weights": max(ft.weight_divergence(a, b))}


def test_fp64_dp_arithmetic_equals_ep1_to_rounding(fp64):
    right, _ = fp64
    assert all(r["available"] for r in right.values()), [r.get("reason") for r in right.values()]
    for ep in (2, 4):
        r = right[ep]
        assert (r["dp"], r["expert_dp"], r["ep"], r["layout"]) == (4, 4 // ep, ep, f"tp 1 × ep {ep}")
        assert r["weights_fp"][0] == right[1]["weights_fp"][0]  # the same global initial weights at every EP
        assert r["weights_fp"][-1] != r["weights_fp"][0]  # ... and they trained
        gap = _apart(r, right[1])
        print(f"fp64 ep {ep} vs ep 1:", gap)
        assert all(v <= ROUNDING for v in gap.values()), (ep, gap)


def test_a_wrong_expert_gradient_scale_is_caught(fp64):
    """Control: expert gradients divided by the expert-DP size instead of DP (equal at EP=1, 2x / 4x at EP=2 / 4):
    Adam is nearly scale-invariant, but the gradient norm and the weights part far beyond rounding."""
    right, wrong = fp64
    assert _apart(wrong[1], right[1])["weights"] == 0  # EP=1: both scales are 1/4
    for ep in (2, 4):
        gap = _apart(wrong[ep], right[1])
        print(f"wrong scale ep {ep} vs ep 1:", gap)
        assert gap["grad_norm"] > 1e-3 and gap["weights"] > 1e3 * ROUNDING, (ep, gap)


def test_routing_replay_routes_every_token_where_it_is_told(cpu_cluster):
    """The replay knob drives megatron's router replay: fed top-2 = (0, 1) for every token, every layout routes every
    token to experts 0 and 1 — the control: the reference run's own routing is not that."""
    import base64
    import zlib

    P = profiles.load("cpu", {"training": {**SMALL, "steps": 2, "stacks": [1], "settings": ["plain", "routing replay"],
                                           "deterministic": [True], "reruns": 1, "eps": [1, 2]}})
    (ref,) = protocol.run(training, P, cluster=cpu_cluster,
                          cases=[c for c in training.cases(P) if c.knobs["setting"] == training.REPLAY])
    (case,) = training.replay_cases(P, [ref])
    forced = base64.b64encode(zlib.compress(bytes([0, 1] * 16))).decode()  # the engine's packing of uint8 top-k
    case = protocol.Case(**{**{f: getattr(case, f) for f in case.__dataclass_fields__},
                            "knobs": {**case.knobs, "replay": [[forced, forced]]}})
    (rec,) = protocol.run(training, P, cluster=cpu_cluster, cases=[case])
    assert rec["available"], rec.get("reason")
    assert [s["topk"] for s in rec["routing"][0]] == [forced, forced]
    assert ref["routing"][0][0]["topk"] != forced  # the control
