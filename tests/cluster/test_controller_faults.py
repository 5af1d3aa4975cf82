"""The cluster's controller stopped or gone: every call and answer passes through it, so no rank is to blame. The
diagnosis checks the controller's process first — gone: said at the next liveness check (0.5 s), not after the
call's timeout; stopped (it and its schedulers SIGSTOPped): said at the call's timeout, naming the controller and
`kill -CONT`, never the ranks that wait for work. The control: the same call with the controller running answers.

A 2-engine cluster of its own, timeout_s=10 (call timeout 13 s). Each test prints `TIME <fault>: <seconds>` (from
the call to the end of the `with` block, the cluster's stop included); docs/faults.md quotes them.
"""

import os
import signal
import time

import psutil
import pytest

from moe_lab.config import ClusterConfig
from moe_lab.controller.cluster import Cluster, ClusterError
from moe_lab.controller.diagnosis import controller_pid
from moe_lab.controller.processes import cluster_processes

pytestmark = pytest.mark.cluster

TIMEOUT_S = 10


def _controller_processes(c: Cluster) -> list[psutil.Process]:
    """The controller and its scheduler processes (its children)."""
    ctl = psutil.Process(controller_pid(c.state))
    return [ctl] + ctl.children(recursive=True)


def _wait_nothing_left(profile: str, within_s: float = 10.0) -> list:
    deadline = time.monotonic() + within_s
    while (left := cluster_processes(profile)) and time.monotonic() < deadline:
        time.sleep(0.2)
    return left


@pytest.mark.parametrize("fault", ["stopped", "killed"])
def test_a_stopped_or_dead_controller_is_named_and_no_rank_is(fault):
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=TIMEOUT_S)) as c:
        assert c.run(abs, -3) == [3, 3]  # the control: with the controller running, the call answers
        procs = _controller_processes(c)
        pid, profile = procs[0].pid, c.profile_dir
        assert len(procs) > 1, "the controller has scheduler processes"
        for p in procs:
            p.send_signal(signal.SIGSTOP if fault == "stopped" else signal.SIGKILL)
        t0 = time.monotonic()
        with pytest.raises(ClusterError) as info:
            try:
                c.run(abs, -3)
            finally:
                dt_call = time.monotonic() - t0
                if fault == "stopped":
                    for p in procs:  # leave nothing stopped behind for the cluster's stop
                        p.send_signal(signal.SIGCONT)
    dt = time.monotonic() - t0
    e = info.value
    print(f"TIME controller {fault} → ClusterError: {dt_call:.1f} s, with the stop: {dt:.1f} s — {e}")
    assert e.ranks == [] and "rank(s) [0, 1] did not join" not in str(e) and "is still busy" not in str(e), str(e)
    if fault == "stopped":
        assert e.kind == "timeout", str(e)
        assert (f"abs: rank(s) [0, 1] did not answer within 13 s because the cluster's controller (pid {pid}) is "
                "stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger): calls reach the engines and their "
                f"answers come back only through it, so no rank is to blame; `kill -CONT {pid}`") in str(e), str(e)
        assert 13 <= dt_call < 13 + 3
    else:
        assert e.kind == "died" and e.stopped, str(e)
        assert str(e).startswith(f"the cluster's controller (pid {pid}) is gone (killed by SIGKILL) during abs: "
                                 "calls reach the engines and their answers come back only through it"), str(e)
        assert dt_call < 3
    assert _wait_nothing_left(profile) == []
