"""Router and expert features of production MoE models on 4 gloo engines, EP=4: each one reaches megatron's real
MoELayer (its output and routing differ from the same layer without it — the control that the check can fail),
the weights stay a function of (seed, global expert) alone, and the probe's three comparisons run on it."""

import pytest

from moe_lab.config import MoEConfig
from moe_lab.engine import layer
from moe_lab.experiments import probe

pytestmark = pytest.mark.cluster

BASE = MoEConfig(num_experts=8, topk=4)
FEATURES = {
    "sigmoid": dict(score_function="sigmoid"),
    "sigmoid+expert_bias": dict(score_function="sigmoid", expert_bias=True),
    "group-limited": dict(num_groups=4, group_topk=2),
    "topk_scaling": dict(topk_scaling_factor=2.5),
    "pre_softmax": dict(pre_softmax=True),
    "shared_expert": dict(shared_ffn=256),
    "gated": dict(gated=True),
    "capacity": dict(capacity_factor=0.5),
    "capacity+position": dict(capacity_factor=0.5, drop_policy="position"),
}


def _run(cluster, cfg):
    return cluster.run(layer.output_fingerprint, cfg.asdict())


@pytest.fixture(scope="module")
def plain(cpu_cluster):
    return _run(cpu_cluster, BASE)


@pytest.mark.parametrize("name", list(FEATURES))
def test_each_feature_reaches_the_layer(cpu_cluster, plain, name):
    cfg = BASE.replace(**FEATURES[name])
    got = _run(cpu_cluster, cfg)
    assert [g["out"] for g in got] != [p["out"] for p in plain], f"{name}: the output did not change"
    if name.startswith("capacity"):  # tokens over an expert's capacity are dropped: fewer (token, expert) pairs
        assert sum(g["routed"] for g in got) < sum(p["routed"] for p in plain)
    elif name in ("group-limited", "sigmoid+expert_bias", "sigmoid", "pre_softmax", "topk_scaling"):
        assert sum(g["routed"] for g in got) == sum(p["routed"] for p in plain)  # still top-k per token
    if name == "topk_scaling":  # the routing weights are scaled: their sum grows by the factor
        assert sum(g["probs_sum"] for g in got) == pytest.approx(2.5 * sum(p["probs_sum"] for p in plain), rel=1e-2)
    if name in ("sigmoid+expert_bias", "group-limited"):  # these change which experts win, not only the weights
        ref = _run(cpu_cluster, BASE.replace(score_function="sigmoid") if name.startswith("sigmoid") else BASE)
        assert [g["routing_map"] for g in got] != [r["routing_map"] for r in ref]


def test_shared_expert_and_bias_are_seeded_the_same_on_every_rank(cpu_cluster):
    cfg = BASE.replace(shared_ffn=256, score_function="sigmoid", expert_bias=True, gated=True).asdict()
    fps = cpu_cluster.run(layer.weights_fingerprint, cfg, rebuild=True)
    for name in ("shared_experts.linear_fc1.weight", "shared_experts.linear_fc2.weight", "router.weight"):
        assert len({fp[name] for fp in fps}) == 1, f"{name} differs across ranks"  # replicated over EP
    assert len({fp["experts.local_experts.0.linear_fc1.weight"] for fp in fps}) == 4  # each rank its own expert
    again = cpu_cluster.run(layer.weights_fingerprint, cfg, rebuild=True)
    assert again == fps  # a rebuild seeds the same bits


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_probe_runs_a_deepseek_like_router(cpu_cluster, dispatcher):
    cfg = BASE.replace(dispatcher=dispatcher, score_function="sigmoid", expert_bias=True, num_groups=4, group_topk=2,
                       topk_scaling_factor=2.5, shared_ffn=256, gated=True)
    rec = probe.run(cpu_cluster, cfg, repeats=0)
    assert rec["config"]["expert_bias"] and rec["config"]["shared_ffn"] == 256
    for c in ("cross_rank", "rerun", "truncation"):
        assert rec[c]["numel"] > 0  # measured, whatever it found
    assert rec["rerun"]["bitwise_equal"]  # gloo on CPU: a rerun on one rank is deterministic
