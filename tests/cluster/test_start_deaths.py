"""An engine that dies before it registers is said within seconds — its pid and how it ended — not after
the whole start timeout as "3 of 4 engines registered". The fault: a sitecustomize on the engines' PYTHONPATH that
ends the first `ipyparallel.engine` process to start (exit code 7, or SIGKILL) before it can register; the other
engines, the nannies and the controller start normally. The control: the same cluster without it starts."""

import os
import textwrap
import time

import pytest

from moe_lab.config import ClusterConfig
from moe_lab.controller.cluster import Cluster, ClusterError

pytestmark = pytest.mark.cluster

SITE = textwrap.dedent("""
    import os, signal
    try:
        cmd = open("/proc/self/cmdline", "rb").read().split(b"\\0")
    except OSError:
        cmd = []
    if b"ipyparallel.engine" in cmd and os.environ.get("MOE_LAB_TEST_DIE_MARK"):
        try:
            os.close(os.open(os.environ["MOE_LAB_TEST_DIE_MARK"], os.O_CREAT | os.O_EXCL))
        except FileExistsError:
            pass  # only the first engine dies
        else:
            how = os.environ.get("MOE_LAB_TEST_DIE_HOW", "exit")
            if how == "kill":
                os.kill(os.getpid(), signal.SIGKILL)
            os._exit(7)
""")


@pytest.mark.parametrize("how,said", [("exit", "exit code 7"), ("kill", "killed by SIGKILL")])
def test_an_engine_dead_before_registering_is_named_in_seconds(how, said, tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    monkeypatch.setenv("MOE_LAB_TEST_DIE_MARK", str(tmp_path / "died"))
    monkeypatch.setenv("MOE_LAB_TEST_DIE_HOW", how)
    c = Cluster(ClusterConfig(device="cpu", engines=2, start_timeout_s=120, timeout_s=30))
    t0 = time.monotonic()
    with pytest.raises(ClusterError) as e:
        c.start()
    took = time.monotonic() - t0
    msg = str(e.value)
    print(f"TIME engine {how} before registering: {took:.1f} s: {msg}")
    assert (tmp_path / "died").exists()  # the fault fired
    assert e.value.kind == "died" and "ended before registering" in msg and said in msg and "pid " in msg, msg
    assert took < 60, f"took {took:.1f} s of the 120 s start timeout"  # the whole start, engines' imports included
    assert c.client is None and not _left(str(tmp_path / "died")), "processes left after the failed start"


def _left(mark: str) -> list:
    """Processes still running that were started with this test's fault environment (engines, nannies, controller)."""
    import psutil

    time.sleep(1.0)
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get("MOE_LAB_TEST_DIE_MARK") == mark and \
                    p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out


def test_control_the_same_cluster_without_the_fault_starts(tmp_path, monkeypatch):
    (tmp_path / "sitecustomize.py").write_text(SITE)
    monkeypatch.setenv("PYTHONPATH", os.pathsep.join([str(tmp_path), os.environ.get("PYTHONPATH", "")]).rstrip(":"))
    monkeypatch.delenv("MOE_LAB_TEST_DIE_MARK", raising=False)
    with Cluster(ClusterConfig(device="cpu", engines=2, start_timeout_s=120, timeout_s=30)) as c:
        assert len(c.engine_ids) == 2
