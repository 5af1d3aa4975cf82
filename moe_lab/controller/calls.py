"""Controller side: calls on a cluster's engines — one rank (`call`) or every rank at once (`run`) — and the wait for
their answers (`get`): a timeout on every call, the engine processes watched while it waits (#7), and a failed
collective's cause named, never a victim (#16). Why a call failed is `diagnosis`; `cluster` is a Cluster."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING, Any, Callable

from . import diagnosis
from .diagnosis import ClusterError

if TYPE_CHECKING:
    from .cluster import Cluster

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work

LIVENESS_EVERY_S = 0.5  # how often a waiting call checks that every engine process still exists (#7)
COLLECTIVE_GRACE_S = 3.0  # after one rank's collective fails, how long to wait for the others' answers; and
# how much longer than the process-group timeout a call waits by default


def _running(cluster: Cluster) -> None:
    if cluster.client is None:
        raise ClusterError("the cluster is not running: use `with Cluster(...) as c:` or call start()")


def call(cluster: Cluster, /, rank: int, fn: Callable, *args, what: str = "", timeout: float | None = None, **kwargs):
    """`fn(*args, **kwargs)` on one rank; its result."""
    _running(cluster)
    ar = cluster.client[cluster.engine_ids[rank]].apply_async(fn, *args, **kwargs)
    return get(cluster, [ar], [rank], what or fn.__name__, timeout)[0]


def run(cluster: Cluster, /, fn: Callable, *args, per_rank: Callable[[int], dict] | None = None, what: str = "",
        timeout: float | None = None, **kwargs) -> list[Any]:
    """`fn(*args, **kwargs)` on all ranks at once, plus `per_rank(rank)` kwargs; results in rank order (Cluster.run)."""
    _running(cluster)
    ars, ranks = [], []
    for rank, eid in enumerate(cluster.engine_ids):
        kw = dict(kwargs)
        if per_rank is not None:
            kw.update(per_rank(rank))
        ars.append(cluster.client[eid].apply_async(fn, *args, **kw))
        ranks.append(rank)
    return get(cluster, ars, ranks, what or getattr(fn, "__name__", str(fn)), timeout)


def get(cluster: Cluster, ars, ranks, what: str, timeout: float | None):
    """The answers of `ars` (the calls on `ranks`), in their order; a ClusterError naming the ranks otherwise."""
    # By default a little longer than the process-group timeout, so that ranks stuck in a collective report
    # their own timeout (naming it) before we give up on them.
    timeout = cluster.config.timeout_s + COLLECTIVE_GRACE_S if timeout is None else timeout
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
                diagnosis.raise_if_dead(cluster, what, errors)
                next_check = now + LIVENESS_EVERY_S
            if errors:
                if any(not diagnosis.is_collective_error(e) for e in errors.values()):
                    # a plain exception: report it at once
                    diagnosis.raise_failed(cluster, what, ranks, errors, pending)
                # A collective failed: give the other ranks the grace to report the same failure (its victims
                # are still formatting their own timeout), then name the cause (#16: never a victim).
                if grace_until is None:
                    grace_until = min(now + COLLECTIVE_GRACE_S, deadline)
                if not pending or now >= grace_until:
                    diagnosis.raise_collective(cluster, what, ranks, results, errors, pending, now - t0)
            if not pending:
                break
            if now > deadline:
                diagnosis.raise_timeout(cluster, what, ranks, results, pending, timeout)
            next(iter(pending.values())).wait(0.05)
    except KeyboardInterrupt:
        logger.warning("interrupted during %s: stopping the engines (start the cluster again to go on)", what)
        cluster.stop(graceful=False)
        raise
    return [results[i] for i in range(len(ars))]
