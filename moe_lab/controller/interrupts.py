"""Controller side: Ctrl-C, SIGTERM and SIGHUP under every moe-lab command.

The first signal raises KeyboardInterrupt in the main thread, so clusters, the runner and the notebooks' kernels clean
up exactly as for Ctrl-C; before that it notes every process this one has started (its descendants: kernels,
controllers, schedulers, engines, nannies, watchdogs). Later signals are ignored while it stops, which is bounded:
`finish()` ends whatever of those is still running `BUDGET_S` after the signal and returns the true count — under a
container runtime's 10 s between SIGTERM and SIGKILL. asyncio's reports of the tasks the interrupt abandoned
("Task was destroyed but it is pending", "Task exception was never retrieved: KeyboardInterrupt") are silenced from
the signal on: they describe the interrupt itself, and every process is accounted for by `finish()`.

Exit codes follow the shell: 128 + the signal (SIGINT 130, SIGTERM 143, SIGHUP 129); a KeyboardInterrupt that came
without a signal (in-process tests) counts as Ctrl-C.
"""

from __future__ import annotations

import contextlib
import logging
import os
import shutil
import signal
import threading
import time

BUDGET_S = 8.0  # from the signal to the CLI's last line
SIGNALS = tuple(s for s in (signal.SIGINT, signal.SIGTERM, getattr(signal, "SIGHUP", None)) if s)

_state: dict = {"signal": None, "at": None, "procs": {}}


def _descendants() -> dict:
    import psutil

    try:
        return {p.pid: p for p in psutil.Process().children(recursive=True)}
    except psutil.Error:
        return {}


def _handler(signum, frame):
    if _state["signal"] is not None:  # already stopping (a second Ctrl-C, SIGTERM after Ctrl-C): bounded, let it end
        return
    _state["signal"], _state["at"] = signal.Signals(signum), time.monotonic()
    logging.getLogger("asyncio").setLevel(logging.CRITICAL + 1)
    _state["procs"] = _descendants()
    raise KeyboardInterrupt("" if signum == signal.SIGINT else signal.Signals(signum).name)


def install() -> None:
    """Handle SIGINT, SIGTERM and SIGHUP as above (main thread only: a no-op elsewhere)."""
    if threading.current_thread() is threading.main_thread():
        for s in SIGNALS:
            signal.signal(s, _handler)


@contextlib.contextmanager
def handling():
    """`install()` for a block, the previous handlers restored afterwards (the runner called as a function)."""
    if threading.current_thread() is not threading.main_thread():
        yield
        return
    old = {s: signal.getsignal(s) for s in SIGNALS}
    reset()  # a new command in a long-lived process (a run started from a notebook): no earlier signal counts
    install()
    try:
        yield
    finally:
        for s, h in old.items():
            signal.signal(s, h)


def interrupted() -> str | None:
    """'SIGTERM', 'SIGINT', ... once a signal came (None before)."""
    return _state["signal"].name if _state["signal"] is not None else None


def exit_code() -> int:
    return 128 + int(_state["signal"] or signal.SIGINT)


def deadline() -> float:
    """time.monotonic() by which everything must be stopped (the signal + BUDGET_S; from now without a signal)."""
    return (_state["at"] or time.monotonic()) + BUDGET_S


def alive(p) -> bool:
    import psutil

    try:
        return p.is_running() and p.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False


def wait_descendants_gone(pid: int, until: float) -> bool:
    """Wait (until `until`) for every process under `pid` to end; True if none is left."""
    import psutil

    try:
        root = psutil.Process(pid)
    except psutil.Error:
        return True
    seen = {}
    while True:
        try:
            seen.update({p.pid: p for p in root.children(recursive=True)})
        except psutil.Error:
            pass
        if not any(alive(p) for p in seen.values()):
            return True
        if time.monotonic() > until:
            return False
        time.sleep(0.1)


def _watchdog_profile(p) -> str | None:
    """The profile directory a cluster watchdog (processes.start_watchdog) guards, from its command line."""
    try:
        cmd = p.cmdline()
    except Exception:  # noqa: BLE001 - gone
        return None
    if len(cmd) >= 5 and cmd[1] == "-c" and "_reap" in cmd[2]:
        return cmd[4]
    return None


def finish() -> tuple[int, list[int], float]:
    """End every process noted at the signal, and every descendant there is now: let them end by themselves until
    shortly before the deadline (watchdogs last: they clean up after a dead owner), then SIGKILL what is left and
    remove the profiles of watchdogs killed on the way. Returns (processes stopped, pids still running, seconds
    since the signal)."""
    import psutil

    procs = {**_state["procs"], **_descendants()}
    procs = {pid: p for pid, p in procs.items() if pid != os.getpid()}
    profiles = {pid: _watchdog_profile(p) for pid, p in procs.items()}
    until = deadline() - 1.5
    while time.monotonic() < until and any(alive(p) for p in procs.values()):
        time.sleep(0.1)
    rest = [p for p in procs.values() if alive(p)]
    for p in sorted(rest, key=lambda q: profiles.get(q.pid) is not None):  # watchdogs after what they watch
        with contextlib.suppress(psutil.Error):
            p.kill()
    psutil.wait_procs(rest, timeout=1.0)
    for p in rest:
        if profiles.get(p.pid) and os.path.basename(profiles[p.pid]).startswith("moe_lab_ipp_"):
            shutil.rmtree(profiles[p.pid], ignore_errors=True)
    left = sorted(p.pid for p in procs.values() if alive(p))
    took = time.monotonic() - (_state["at"] or time.monotonic())
    return len(procs) - len(left), left, took


def reset() -> None:
    """Forget a signal: a new command in the same process (`handling`), tests that interrupt in-process."""
    _state.update(signal=None, at=None, procs={})


__all__ = ["install", "handling", "interrupted", "exit_code", "deadline", "wait_descendants_gone", "finish", "reset",
           "BUDGET_S"]
