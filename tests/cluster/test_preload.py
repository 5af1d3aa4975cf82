"""Engines forked from a preload server (controller.preloaded, engine.preload): they compute what engines started as
processes of their own compute, bit for bit; they are the server's children and start with its imports; a restart
for another environment gets a server of its own, and an engine is never prepared for two; a server that cannot
serve leaves the engines to start the usual way, said in the log."""

import logging
import os

import psutil
import pytest

from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.controller import preloaded
from moe_lab.controller.cluster import Cluster, ClusterError
from moe_lab.engine import dist, layer
from moe_lab.engine.preload import ENGINE_NAME, MARK

pytestmark = pytest.mark.cluster

CFG = MoEConfig(seq_len=32, hidden=64, ffn_hidden=128, num_experts=4, topk=2).asdict()


def _parent_cmdline(pid: int) -> str:
    return " ".join(psutil.Process(pid).parent().cmdline())


def _what_engines_do(c: Cluster) -> list[dict]:
    return [dict(w, **o) for w, o in zip(c.run(layer.weights_fingerprint, CFG, rebuild=True),
                                         c.run(layer.output_fingerprint, CFG))]


def test_forked_engines_compute_what_engines_of_their_own_compute(monkeypatch):
    """The control is the same cluster with MOE_LAB_PRELOAD=0: engines that are not the server's children, which
    import torch and megatron-core themselves. Weights (seeded at build) and the forward's output are bitwise the
    same on both, rank by rank."""
    monkeypatch.delenv(preloaded.PRELOAD_ENV, raising=False)
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        forked = _what_engines_do(c)
        pids = [p["pid"] for p in c.placement]
        assert all(MARK in _parent_cmdline(pid) for pid in pids), [_parent_cmdline(pid) for pid in pids]
        assert all(psutil.Process(pid).name() == ENGINE_NAME for pid in pids)
        timings = dict(c.timings)
    monkeypatch.setenv(preloaded.PRELOAD_ENV, "0")
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        own = _what_engines_do(c)
        pids = [p["pid"] for p in c.placement]
        assert not any(MARK in _parent_cmdline(pid) for pid in pids)
        assert all("ipyparallel.engine" in " ".join(psutil.Process(pid).cmdline()) for pid in pids)
        own_timings = dict(c.timings)
    print(f"TIME forked engines: {timings}\nTIME engines of their own: {own_timings}")
    assert forked == own
    # The control of the comparison: the fingerprints tell apart what differs (each rank holds other experts).
    fc1 = "experts.local_experts.0.linear_fc1.weight"
    assert forked[0][fc1] != forked[1][fc1]


def test_a_restart_for_another_environment_gets_its_own_server_and_an_engine_is_prepared_once(caplog):
    caplog.set_level(logging.INFO, logger="moe_lab.controller.cluster")
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        first = {p["pid"] for p in c.placement}
        with pytest.raises(Exception, match="was prepared for device cpu.*cannot be prepared for"):
            c.run(dist.prepare, device="cpu", extra_path=("/elsewhere",))
        c.restart_engines(env={"MOE_LAB_TEST_PRELOAD": "1"})
        assert len(c.state.preload_servers) == 2
        pids = [p["pid"] for p in c.placement]
        assert not first & set(pids)
        assert all(MARK in _parent_cmdline(pid) for pid in pids)
        assert c.run(os.getenv, "MOE_LAB_TEST_PRELOAD") == ["1", "1"]
        servers = [s.proc.pid for s in c.state.preload_servers.values()]
        assert {psutil.Process(pid).ppid() for pid in pids} <= set(servers)
    assert not [p for p in servers if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]
    assert sum("imported torch and megatron-core" in r.getMessage() for r in caplog.records) == 2


def test_without_its_server_a_restart_starts_engines_of_their_own_and_says_why(caplog):
    caplog.set_level(logging.INFO, logger="moe_lab.controller.cluster")
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        (server,) = c.state.preload_servers.values()
        server.proc.kill()
        server.proc.wait()
        c.restart_engines()
        pids = [p["pid"] for p in c.placement]
        assert all("ipyparallel.engine" in " ".join(psutil.Process(pid).cmdline()) for pid in pids)
        assert [h["ok"] for h in c.health_check()] == [True, True]
    said = [r.getMessage() for r in caplog.records if "preload server" in r.getMessage()]
    assert any("starting the engine as a process of its own" in m for m in said), said


def test_a_forked_engine_killed_in_a_call_is_named_with_its_signal():
    """Its exit code comes from the server that reaped it (psutil has none for a process that is not ours)."""
    from moe_lab.engine import faults

    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=60)) as c:
        pid = c.placement[1]["pid"]
        with pytest.raises(ClusterError, match=rf"rank 1 \(engine \d+, pid {pid}\) died during kill_on "
                                               r"\(killed by SIGKILL\)"):
            c.run(faults.kill_on, 1)
