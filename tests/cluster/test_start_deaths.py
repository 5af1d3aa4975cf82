"""An engine that dies before it registers is said within seconds — its pid and how it ended — not after
the whole start timeout as "3 of 4 engines registered". The fault: a sitecustomize on the engines' PYTHONPATH that
ends the first engine to start (exit code 7, or SIGKILL) before it can register — the first `ipyparallel.engine`
process, or the first engine a preload server forks; the other engines, the nannies and the controller start
normally. The control: the same cluster without it starts."""

import os
import textwrap
import time

import pytest

from moe_lab.config import ClusterConfig
from moe_lab.controller.cluster import Cluster, ClusterError
from marked import still_running

pytestmark = pytest.mark.cluster

SITE = textwrap.dedent("""
    import os, signal

    def _die():
        try:
            os.close(os.open(os.environ["MOE_LAB_TEST_DIE_MARK"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            return  # only the first engine dies
        if os.environ.get("MOE_LAB_TEST_DIE_HOW", "exit") == "kill":
            os.kill(os.getpid(), signal.SIGKILL)
        os._exit(7)

    try:
        cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    except OSError:
        cmd = []
    if os.environ.get("MOE_LAB_TEST_DIE_MARK"):
        if b"ipyparallel.engine" in cmd:
            _die()
        elif any(b"moe_lab.engine.preload" in a for a in cmd):  # a preload server: the engines it forks
            os.register_at_fork(after_in_child=_die)
""")

STARTS = {"own process": "0", "forked": "1"}
"""An engine started as a process of its own, or forked from the cluster's preload server (MOE_LAB_PRELOAD)."""


@pytest.mark.parametrize("start", STARTS)
@pytest.mark.parametrize("how,said", [("exit", "exit code 7"), ("kill", "killed by SIGKILL")])
def test_an_engine_dead_before_registering_is_named_in_seconds(how, said, start, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    monkeypatch.setenv("MOE_LAB_TEST_DIE_MARK", str(tmp_path / "died"))
    monkeypatch.setenv("MOE_LAB_TEST_DIE_HOW", how)
    monkeypatch.setenv("MOE_LAB_PRELOAD", STARTS[start])
    c = Cluster(ClusterConfig(device="cpu", engines=2, start_timeout_s=120, timeout_s=30))
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        c.start()
    took = time.monotonic() - t0
    msg = str(e.value)
    print(f"TIME engine ({start}) {how} before registering: {took:.1f} s: {msg}")
    assert (tmp_path / "died").exists()  # the fault fired
    assert e.value.kind == "died" and "ended before registering" in msg and said in msg and "pid " in msg, msg
    assert took < 60, f"took {took:.1f} s of the 120 s start timeout"  # the whole start, engines' imports included
    assert c.client is None and not _left(str(tmp_path / "died")), "processes left after the failed start"


def _left(mark: str) -> list:
    """Processes still running that were started with this test's fault environment (engines, nannies, controller)."""
    return still_running("MOE_LAB_TEST_DIE_MARK", mark, settle_s=1.0)


@pytest.mark.parametrize("start", STARTS)
def test_control_the_same_cluster_without_the_fault_starts(start, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("MOE_LAB_PRELOAD", STARTS[start])
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    monkeypatch.delenv("MOE_LAB_TEST_DIE_MARK", raising=False)
    with Cluster(ClusterConfig(device="cpu", engines=2, start_timeout_s=120, timeout_s=30)) as c:
        assert len(c.engine_ids) == 2
