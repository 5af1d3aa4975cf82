"""4 gloo engines: up, ranks mapped, verified, and the seed report's effect measured (not assumed)."""

import time

import pytest

from moe_lab.controller.cluster import ClusterError
from moe_lab.engine import layer
from moe_lab.experiments import probe
from moe_lab.config import MoEConfig

pytestmark = pytest.mark.cluster


def test_cluster_is_up_and_verified(cpu_cluster):
    info = cpu_cluster.info
    assert [i["rank"] for i in info] == [0, 1, 2, 3]  # results come back in rank order
    assert {i["backend"] for i in info} == {"gloo"} and {i["world"] for i in info} == {4}
    assert {i["ep"] for i in info} == {4} and sorted(i["ep_rank"] for i in info) == [0, 1, 2, 3]
    assert len({i["pid"] for i in info}) == 4  # one process per rank
    checks = cpu_cluster.health_check()
    assert all(c["ok"] and c["sum"] == 10.0 for c in checks)
    print(f"cluster ready in {cpu_cluster.timings['ready_s']:.1f} s ({cpu_cluster.timings})")


def test_the_controller_listens_only_on_ports_reserved_below_the_ephemeral_range(cpu_cluster):
    """controller.ports: every port in the controller's connection files (engines' and clients') is one it was
    handed, below the OS's ephemeral range, where no other process's bind to port 0 or outgoing connection can have
    taken it before the controller bound it; and the cluster works on them (the test above)."""
    import json
    from pathlib import Path

    from moe_lab.controller import ports

    span = ports.candidate_range()
    if span is None:
        pytest.skip("no range below this OS's ephemeral ports: ipyparallel picks its own (as the module says)")
    used = []
    for f in sorted(Path(cpu_cluster.profile_dir, "security").glob("ipcontroller-*.json")):
        info = json.loads(f.read_text())
        for k, v in info.items():
            if k.endswith("port") or k in ("registration", "control", "mux", "task", "iopub", "hb_ping", "hb_pong",
                                           "notification", "broadcast"):
                used += v if isinstance(v, list) else [v] if isinstance(v, int) else []
    assert len(used) >= 10, used
    assert all(span[0] <= p <= span[1] for p in used), (span, used)


def test_same_seed_same_weights_on_rebuild(cpu_cluster):
    cfg = MoEConfig().asdict()
    first = cpu_cluster.run(layer.weights_fingerprint, cfg, rebuild=True)
    second = cpu_cluster.run(layer.weights_fingerprint, cfg, rebuild=True)
    assert first == second
    # Router weights are replicated: identical on every rank. Experts differ rank to rank (different experts).
    routers = {fp["router.weight"] for fp in first}
    assert len(routers) == 1
    fc1 = {fp["experts.local_experts.0.linear_fc1.weight"] for fp in first}
    assert len(fc1) == 4
    other = cpu_cluster.run(layer.weights_fingerprint, MoEConfig(seed=7).asdict(), rebuild=True)
    assert other[0]["router.weight"] != first[0]["router.weight"]


def test_allgather_bf16_diverges_across_ranks_and_router_fp32_removes_it(cpu_cluster_pinned):
    """The seed report on CPU/gloo, EP=4: measured per run, never assumed. On engines with oneDNN capped below AMX,
    whose bf16 GEMMs are batch invariant on every CPU (tests/README.md: the truncation test on AMX CPUs)."""
    bf16 = probe.run(cpu_cluster_pinned, MoEConfig(dispatcher="allgather", router_dtype="none"), repeats=1)
    fp32 = probe.run(cpu_cluster_pinned, MoEConfig(dispatcher="allgather", router_dtype="fp32"), repeats=1)
    assert bf16["cross_rank"]["mismatch_frac"] > 0
    assert bf16["cross_rank"]["max_ulp"] >= 1
    assert fp32["cross_rank"]["mismatch_frac"] == 0 and fp32["cross_rank"]["bitwise_equal"]
    # These GEMMs are batch invariant and gloo is deterministic: rerun and truncation are bitwise equal here.
    for rec in (bf16, fp32):
        assert rec["rerun"]["bitwise_equal"] and rec["truncation"]["bitwise_equal"]
        assert rec["megatron_core"] and rec["device"] == "cpu" and rec["world"] == 4
        assert rec["env"]["ONEDNN_MAX_CPU_ISA"] == rec["cpu"]["env"]["ONEDNN_MAX_CPU_ISA"] == "AVX512_CORE_BF16"


def test_alltoall_runs_with_shims(cpu_cluster):
    rec = probe.run(cpu_cluster, MoEConfig(dispatcher="alltoall", router_dtype="fp64"), repeats=1)
    assert rec["cross_rank"]["numel"] == 128 * 256  # the whole [seq x hidden] output was compared
    assert rec["rerun"]["bitwise_equal"]


def test_detail_matches_headline(cpu_cluster):
    rec = probe.run(cpu_cluster, MoEConfig(dispatcher="allgather"), detail=True, repeats=1)
    d = rec["detail"]
    assert set(d["pairs"]) == {"0-1", "0-2", "0-3"}
    worst = max(p["mismatch_frac"] for p in d["pairs"].values())
    assert worst == rec["cross_rank"]["mismatch_frac"]
    for pair, hist in d["ulp_hist"].items():
        assert sum(hist.values()) == 128 * 256
        assert sum(n for u, n in hist.items() if int(u) != 0) == d["pairs"][pair]["n_mismatch"]
        assert sum(d["token_mismatch"][pair]) == d["pairs"][pair]["n_mismatch"]
    assert d["bytes_compared"] > 0


def test_a_timed_out_call_names_the_ranks(cpu_cluster):
    t0 = time.monotonic()
    with pytest.raises(ClusterError, match=r"rank\(s\) \[0, 1, 2, 3\] did not answer within 1 s"):
        cpu_cluster.run(time.sleep, 3, timeout=1)
    assert time.monotonic() - t0 < 3
    time.sleep(2.5)  # let the sleeps drain so later calls are not queued behind them
    assert all(c["ok"] for c in cpu_cluster.health_check())


def test_engine_errors_name_the_rank(cpu_cluster):
    bad = probe.case(MoEConfig(), cut=90).payload(4) | {"cut": 500}  # past the input: the engine function fails
    with pytest.raises(ClusterError, match=r"rank \d \(engine \d+, pid \d+\) failed in .*ValueError: cut \(500\)"):
        cpu_cluster.run(probe.on_engine, bad)
