"""Fault injection for the reliability tests: engine-side functions that hang, skip collectives, or die."""

from __future__ import annotations

import os
import signal
import time


def _all_reduce() -> float:
    import torch
    import torch.distributed as tdist

    from .dist import STATE

    x = torch.ones(1, device=STATE["torch_device"], dtype=torch.float64)
    tdist.all_reduce(x)
    return float(x.item())


def sleep_on(rank: int, seconds: float, *, collective: bool = True) -> dict:
    """Rank `rank` sleeps `seconds` (a stuck rank); then every rank joins an all-reduce (if `collective`)."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    if me == rank:
        time.sleep(seconds)
    return {"rank": me, "sum": _all_reduce() if collective else None}


def skip_collective_on(rank: int) -> dict:
    """An all-reduce on every rank except `rank`, which returns at once: the others wait for it in vain."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    return {"rank": me, "sum": None if me == rank else _all_reduce()}


def raise_on(rank: int) -> dict:
    """Rank `rank` raises RuntimeError; the others enter an all-reduce it never joins."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    if me == rank:
        raise RuntimeError(f"injected failure on rank {rank}")
    return {"rank": me, "sum": _all_reduce()}


def exit_on(rank: int, code: int = 1, *, after_s: float = 0.0, others_s: float | None = None) -> dict:
    """Rank `rank` leaves with `os._exit(code)` after `after_s`; the others enter an all-reduce it never joins,
    or sleep `others_s` seconds if given (so only a liveness check, not the collective, can notice the death)."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    if me == rank:
        time.sleep(after_s)
        os._exit(code)
    if others_s is not None:
        time.sleep(others_s)
        return {"rank": me, "sum": None}
    return {"rank": me, "sum": _all_reduce()}


def kill_on(rank: int, sig: int = signal.SIGKILL, *, after_s: float = 0.0, others_s: float | None = None) -> dict:
    """Like `exit_on`, but rank `rank` is killed by signal `sig` (default SIGKILL: no Python cleanup at all)."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    if me == rank:
        time.sleep(after_s)
        os.kill(os.getpid(), sig)
        time.sleep(60)  # a signal the engine handles must not let this rank carry on
    if others_s is not None:
        time.sleep(others_s)
        return {"rank": me, "sum": None}
    return {"rank": me, "sum": _all_reduce()}


def pid() -> int:
    return os.getpid()


def stop_on(rank: int, *, collective: bool = True) -> dict:
    """Rank `rank` stops itself with SIGSTOP (a hung process: it cannot even dump its stack); the others enter an
    all-reduce it never joins (if `collective`). SIGCONT lets it go on."""
    import torch.distributed as tdist

    me = tdist.get_rank()
    if me == rank:
        os.kill(os.getpid(), signal.SIGSTOP)
    return {"rank": me, "sum": _all_reduce() if collective else None}
