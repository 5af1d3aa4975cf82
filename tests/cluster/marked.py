"""A test's own processes, told apart from everything else on the machine (the other test worker's clusters too) by
a mark the test puts in the environment of what it starts: every process started from there inherits it."""

import os
import time

import psutil


def still_running(var: str, value: str, settle_s: float = 0.5) -> list[int]:
    """Pids of the processes whose environment holds var=value and that still run (zombies have ended, they are
    only not yet reaped), after `settle_s` for stops under way to finish."""
    time.sleep(settle_s)
    out = []
    for p in psutil.process_iter(["pid"]):
        try:
            if p.pid != os.getpid() and p.environ().get(var) == value and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p.pid)
        except psutil.Error:
            continue
    return out
