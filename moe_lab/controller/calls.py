"""Controller side: calls on a cluster's engines — one rank (`call`) or every rank at once (`run`) — and the wait for
their answers (`get`): a timeout on every call, the engine processes watched while it waits, and a failed
collective's cause named, never a victim. Why a call failed is `diagnosis`; `state` is the cluster's
ClusterState. A ClusterError with `stopped` set (the process group cannot go on), or Ctrl-C, leaves the engines to
be stopped by the cluster that made the call (`Cluster.run`)."""

from __future__ import annotations

import logging
import time
from typing import Any, Callable

from . import diagnosis
from .diagnosis import ClusterError
from .state import ClusterState

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work

LIVENESS_EVERY_S = 0.5  # how often a waiting call checks that every engine process still exists
COLLECTIVE_GRACE_S = 3.0  # after one rank's collective fails, how long to wait for the others' answers; and
# how much longer than the process-group timeout a call waits by default


def _running(state: ClusterState) -> None:
    if state.client is None:
        raise ClusterError("the cluster is not running: use `with Cluster(...) as c:` or call start()")


def call(state: ClusterState, /, rank: int, fn: Callable, *args, what: str = "", timeout: float | None = None,
         **kwargs):
    """`fn(*args, **kwargs)` on one rank; its result."""
    _running(state)
    ar = state.client[state.engine_ids[rank]].apply_async(fn, *args, **kwargs)
    return get(state, [ar], [rank], what or fn.__name__, timeout)[0]


def run(state: ClusterState, /, fn: Callable, *args, per_rank: Callable[[int], dict] | None = None, what: str = "",
        timeout: float | None = None, **kwargs) -> list[Any]:
    """`fn(*args, **kwargs)` on all ranks at once, plus `per_rank(rank)` kwargs; results in rank order (Cluster.run)."""
    _running(state)
    ars, ranks = [], []
    for rank, eid in enumerate(state.engine_ids):
        kw = dict(kwargs)
        if per_rank is not None:
            kw.update(per_rank(rank))
        ars.append(state.client[eid].apply_async(fn, *args, **kw))
        ranks.append(rank)
    return get(state, ars, ranks, what or getattr(fn, "__name__", str(fn)), timeout)


def get(state: ClusterState, ars, ranks, what: str, timeout: float | None):
    """The answers of `ars` (the calls on `ranks`), in their order; a ClusterError naming the ranks otherwise."""
    # By default a little longer than the process-group timeout, so that ranks stuck in a collective report
    # their own timeout (naming it) before we give up on them.
    timeout = state.config.timeout_s + COLLECTIVE_GRACE_S if timeout is None else timeout
    t0 = time.monotonic()
    deadline = t0 + timeout
    results: dict[int, Any] = {}
    errors: dict[int, BaseException] = {}
    pending = dict(enumerate(ars))
    next_check = t0 + LIVENESS_EVERY_S
    grace_until = None  # set when a rank's collective failed: collect the others' answers until then
    try:
        while pending:
            for i, ar in list(pending.items()):
                if ar.ready():
                    try:
                        results[i] = ar.get()
                    except Exception as e:  # noqa: BLE001 - re-raised below with the rank named
                        errors[i] = e
                    del pending[i]
            now = time.monotonic()
            if errors or now >= next_check:
                diagnosis.raise_if_dead(state, what, errors)
                next_check = now + LIVENESS_EVERY_S
            if errors:
                if any(not diagnosis.is_collective_error(e) for e in errors.values()):
                    # a plain exception: report it at once
                    diagnosis.raise_failed(state, what, ranks, errors, pending)
                # A collective failed: give the other ranks the grace to report the same failure (its victims
                # are still formatting their own timeout), then name the cause (never a victim).
                if grace_until is None:
                    grace_until = min(now + COLLECTIVE_GRACE_S, deadline)
                if not pending or now >= grace_until:
                    diagnosis.raise_collective(state, what, ranks, results, errors, pending, now - t0)
            if not pending:
                break
            if now > deadline:
                diagnosis.raise_timeout(state, what, ranks, results, pending, timeout)
            next(iter(pending.values())).wait(0.05)
    except KeyboardInterrupt:
        logger.warning("interrupted during %s: stopping the engines (start the cluster again to go on)", what)
        raise  # the cluster stops its engines (Cluster.run)
    return [results[i] for i in range(len(ars))]
