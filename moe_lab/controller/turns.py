"""Controller side: the engines' turns when notebooks run two at a time.

`moe-lab run` executes the next notebook while the current one draws its figures and pages (`reporting.runner`):
two kernels at once, one set of engines. Every case a notebook measures goes through `experiments.protocol.run`,
which takes the engines' turn (`engines_turn`) for all its groups: one kernel's cases at a time, each case's calls
whole on every rank (two kernels' calls interleaved on the engines would pair one rank's collective with another
case's), and a cluster of a notebook's own (another release, EP=1) never beside the shared one. The turn is an
exclusive `flock` on the file MOE_LAB_ENGINE_TURN names, so it is released by the kernel's exit too: a kernel that
dies holding it blocks nobody. Without that variable (a notebook run by hand, a test) a turn is taken at once.

With MOE_LAB_ENGINE_TURN_WHOLE=1 as well (the runner sets it where the ranks share a GPU too small for two
notebooks' state, `reporting.runner`), a kernel keeps the turn from its first case until it exits: the next notebook
starts meanwhile — its kernel, set-up and first cluster of its own launched ahead — and runs its first case once
the one before it has ended and left nothing on the engines (its clusters stopped, the shared cluster's layers
dropped, its process gone).

Records say how many notebooks ran at once (`notebooks_at_once`): a cost measured on a CPU then shared its cores
with the other kernel's figures.
"""

from __future__ import annotations

import contextlib
import fcntl
import logging
import os
import threading
import time
from typing import Callable

logger = logging.getLogger("moe_lab.controller.cluster")

ENV = "MOE_LAB_ENGINE_TURN"
WHOLE_ENV = "MOE_LAB_ENGINE_TURN_WHOLE"
AT_ONCE = 2
"""Notebooks `moe-lab run` executes at once where it has several and MOE_LAB_OVERLAP is not 0 (`reporting.runner`)."""
POLL_S = 0.05
NOTE_AFTER_S = 1.0  # a wait longer than this is said in the log

_held = threading.local()
_whole: dict = {}  # "path", "fd": the turn file this process holds until it exits (WHOLE_ENV)


def notebooks_at_once() -> int:
    """How many notebooks this run executes at once: AT_ONCE where the runner set the engines' turn file, else 1."""
    return AT_ONCE if os.environ.get(ENV) else 1


@contextlib.contextmanager
def engines_turn(what: str = "", waiting: Callable[[], object] | None = None):
    """Hold the engines for the block (see the module docstring); yields the seconds waited. Re-entrant in a thread;
    Ctrl-C while waiting raises KeyboardInterrupt as anywhere else. `waiting` is called while the turn is another
    kernel's, every POLL_S (non-blocking work: a launched cluster's imports started once it has registered)."""
    path = os.environ.get(ENV)
    if not path or getattr(_held, "depth", 0) or _whole.get("path") == path:
        _held.depth = getattr(_held, "depth", 0) + 1
        try:
            yield 0.0
        finally:
            _held.depth -= 1
        return
    try:
        fd = os.open(path, os.O_RDWR | os.O_CREAT, 0o644)
    except OSError as e:
        raise OSError(e.errno, f"the engines' turn file ({ENV}) cannot be opened: {e.strerror}; unset {ENV} to "
                               "run without turns (one notebook at a time)", path) from e
    try:
        t0 = time.monotonic()
        while True:
            try:
                fcntl.flock(fd, fcntl.LOCK_EX | fcntl.LOCK_NB)
                break
            except BlockingIOError:
                if waiting is not None:
                    waiting()
                time.sleep(POLL_S)
        waited = time.monotonic() - t0
        if waited > NOTE_AFTER_S:
            logger.info("%swaited %.1f s for the engines (the other notebook's %s)", f"{what}: " if what else "",
                        waited, "run" if whole() else "cases ran")
        if whole():  # kept until this process exits, which releases it
            _whole.update(path=path, fd=fd)
            fd = None
            yield waited
            return
        _held.depth = 1
        try:
            yield waited
        finally:
            _held.depth = 0
    finally:
        if fd is not None:
            os.close(fd)  # releases the lock


def whole() -> bool:
    """Whether a kernel keeps the engines' turn from its first case until it exits (WHOLE_ENV set to 1)."""
    return os.environ.get(WHOLE_ENV, "") == "1"


__all__ = ["AT_ONCE", "ENV", "WHOLE_ENV", "engines_turn", "notebooks_at_once", "whole"]
