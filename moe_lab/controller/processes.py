"""Controller side: the OS processes of a cluster — find them by profile, end them, and the watchdog that ends a
cluster whose owner died without stopping it."""

from __future__ import annotations

import os
import shutil
import signal
import subprocess
import sys
import time
from pathlib import Path

def is_engine(p) -> bool:
    """An ipyparallel engine: started as `python -m ipyparallel.engine`, or forked by a preload server (its command
    line is the server's; it names itself ENGINE_NAME — the server itself is not an engine)."""
    from ..engine.preload import ENGINE_NAME, MARK

    cmd = p.info.get("cmdline") or ()
    if any("ipyparallel.engine" in a for a in cmd):
        return True
    if not any(MARK in a for a in cmd):
        return False
    try:
        return p.name() == ENGINE_NAME
    except Exception:  # noqa: BLE001 - gone
        return False

def pid_gone(pid: int) -> str | None:
    """None while `pid` runs; otherwise how it ended, as far as this process can tell."""
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return "process exited"
        return None
    except psutil.NoSuchProcess:
        return "process gone"
    except psutil.Error:
        return None

def describe_exit(code) -> str:
    if isinstance(code, int) and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"

def cluster_processes(profile_dir: str, exclude: tuple[int, ...] = ()) -> list:
    """psutil processes of the cluster at `profile_dir`: controller, schedulers, engines and their nannies (ipyparallel
    gives them IPP_PROFILE_DIR) and the watchdog (the path is on its command line). Zombies are left out."""
    import psutil

    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] in (me, *exclude):
            continue
        try:
            ours = any(profile_dir in arg for arg in p.info["cmdline"] or ())
            if not ours and any("ipyparallel" in a for a in p.info["cmdline"] or ()):
                ours = p.environ().get("IPP_PROFILE_DIR") == profile_dir
            if ours and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:  # gone, or another user's process
            continue
    return out

def kill_cluster_processes(profile_dir: str, exclude: tuple[int, ...] = (), term_wait_s: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process of the cluster at `profile_dir`; returns the pids that were found."""
    import psutil

    procs = cluster_processes(profile_dir, exclude)
    for p in procs:
        try:  # engines only hold lost state, and a busy one ignores SIGTERM for seconds: kill them outright
            p.kill() if is_engine(p) else p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=term_wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)
    return [p.pid for p in procs]

def _reap(owner_pid: int, profile_dir: str, poll_s: float = 0.5) -> None:
    """The cluster's watchdog (its own process): once the owner is gone without having stopped the cluster,
    end its controller and engines and remove the profile. Exits as soon as the profile is removed."""
    import psutil

    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None
    while os.path.isdir(profile_dir):
        try:
            if owner is None or not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    else:
        return
    kill_cluster_processes(profile_dir)
    shutil.rmtree(profile_dir, ignore_errors=True)


def start_watchdog(owner_pid: int, profile_dir: str) -> subprocess.Popen:
    """The watchdog process, outside the owner's session: if the owner dies without stop() (SIGKILL, SIGTERM, a dead
    kernel), it ends the controller and engines, which ipyparallel starts in sessions of their own."""
    code = ("import sys; sys.path.insert(0, sys.argv[3]); from moe_lab.controller.processes import _reap; "
            "_reap(int(sys.argv[1]), sys.argv[2])")
    pkg_parent = str(Path(__file__).resolve().parents[2])
    return subprocess.Popen([sys.executable, "-c", code, str(owner_pid), profile_dir, pkg_parent],
                            stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL,
                            start_new_session=True)


def kill_engines(profile_dir: str, only=None) -> None:
    """SIGKILL every engine process of the cluster at `profile_dir` (their state is lost anyway); with `only` (pids),
    just those engines and the processes they started (their nannies)."""
    procs = [p for p in cluster_processes(profile_dir) if is_engine(p)]
    if only is not None:
        keep = {int(x) for x in only}
        procs = [p for p in procs if p.pid in keep or _ppid(p) in keep]
    for p in procs:
        try:
            p.kill()
        except Exception:  # noqa: BLE001 - already gone
            pass


def _ppid(p) -> int | None:
    try:
        return p.ppid()
    except Exception:  # noqa: BLE001 - gone
        return None


__all__ = ["cluster_processes", "kill_cluster_processes", "kill_engines", "start_watchdog", "pid_gone",
           "describe_exit", "is_engine"]
