"""The controller's one owner of engine sets for a run of cases: which cluster serves the next group of
cases, which is launched early for the group after it, and which are stopped at the end.

Three kinds of cluster pass through it:
- the caller's (given to `EngineSets`): used, restarted in place when a group needs other engines, never stopped;
- the run's shared cluster (`controller.shared`, what `moe-lab run` starts once for every notebook): attached and
  detached, never restarted nor stopped — a group that needs other engines gets a cluster of its own, and a later
  group that fits the shared cluster again goes back to it (no restart back);
- clusters of its own: started, restarted for the next group, stopped at `close()`.

`experiments.protocol.run` asks `launch_ahead(config)` for its first group before it waits for the engines' turn (a
cluster of its own then registers and imports while another notebook's cases hold the engines), `ensure(config)`
for each group, `prefetch(config)` for the one after it, calls `tick()` between cases and while it waits for the turn
(the early set's imports start once its engines have registered) and `close()` at the end.

A run that ends well on a cluster of its own keeps it, its cached layers dropped, for the same process's next run
(`KEEP_S`; in a notebook kernel where launching early is wanted: `spares.keep_wanted`): a notebook's next cell often
asks for the same engines (06's routing replay after its training cases, on the deterministic environment), which
would otherwise start cold (16–20 s on one GPU: a preload server's imports). The next run takes it where its first
own cluster would start as it was started, and stops it otherwise; so do the end of `KEEP_S` and the process's exit.
"""

from __future__ import annotations

import atexit
import logging
import threading

from ..config import ClusterConfig

logger = logging.getLogger(__name__)

KEEP_S = 120.0
"""How long a run's own cluster waits, idle and without cached layers, for the same process's next run."""

_kept: dict = {}  # "cluster", "timer": at most one kept cluster per process
_kept_lock = threading.Lock()


def keep(cluster, seconds: float = KEEP_S) -> None:
    """Hold `cluster` (started, its caches dropped) for the next run; stopped after `seconds` if nobody takes it.
    A cluster kept before it is stopped now."""
    timer = threading.Timer(seconds, _expire, args=(cluster, seconds))
    timer.daemon = True
    with _kept_lock:
        before = _kept.pop("cluster", None)
        if "timer" in _kept:
            _kept.pop("timer").cancel()
        _kept.update(cluster=cluster, timer=timer)
    if before is not None and before is not cluster:
        before.stop()
    timer.start()


def take_kept():
    """The kept cluster, now the caller's (None if there is none)."""
    with _kept_lock:
        c = _kept.pop("cluster", None)
        if "timer" in _kept:
            _kept.pop("timer").cancel()
    return c


def kept():
    """The kept cluster, still kept (None if there is none)."""
    return _kept.get("cluster")


def _expire(cluster, seconds: float) -> None:
    with _kept_lock:
        if _kept.get("cluster") is not cluster:
            return
        _kept.pop("cluster")
        _kept.pop("timer", None)
    logger.info("stopping the engines kept from the last run: no run asked for them in %.0f s", seconds)
    cluster.stop()


def stop_kept(graceful: bool = True) -> None:
    """Stop the kept cluster, if there is one (nobody will ask for it)."""
    c = take_kept()
    if c is not None:
        c.stop(graceful=graceful)


@atexit.register
def _stop_kept_at_exit() -> None:  # idle engines: nothing of their state is needed, so no teardown call
    stop_kept(graceful=False)

START_FIELDS = ("extra_path", "env", "deterministic")
"""What a group of cases may need its engines to start with (release path, engine environment, deterministic start):
the fields `Cluster.restart_engines` changes."""


def changes(current: ClusterConfig, target: ClusterConfig) -> dict:
    """The start fields `target` has other than `current`: empty when the running engines serve it."""
    return {k: getattr(target, k) for k in START_FIELDS if getattr(current, k) != getattr(target, k)}


class EngineSets:
    """One run's engine sets: `ensure`, `prefetch`, `tick`, `close`, and the last run's kept cluster (see the module
    docstring)."""

    def __init__(self, cluster=None):
        self.current = cluster
        self._given = cluster
        self._pending = None  # a cluster of its own for the next group, launched while the shared one works
        self._warming = None  # (cluster, changes): the early set whose imports `tick` starts
        self._closed = False
        self._kept = take_kept() if cluster is None else None  # the last run's own cluster, if it kept one

    def _take_kept(self, target: ClusterConfig):
        """The last run's own cluster where it started as `target` asks; else it is stopped (None)."""
        k, self._kept = self._kept, None
        if k is None:
            return None
        if k.config == target and k.client is not None:
            logger.info("using the engines kept from this process's last run")
            return k
        k.stop()
        return None

    def _mine(self, c) -> bool:
        return c is not None and c is not self._given and not getattr(c, "attached", False)

    def ensure(self, target: ClusterConfig):
        """A running cluster whose engines start as `target` says (the group's release, environment, ...)."""
        from . import shared
        from .cluster import Cluster

        self._warming = None
        c = self.current
        if c is None:
            self.current = shared.attach(target) or self._take_pending(target) or self._take_kept(target) or \
                Cluster(target).start()
            return self.current
        if c.client is None:  # the caller's cluster, not started yet: it starts as the group needs
            c.config = target
            return c.start()
        need = changes(c.config, target)
        if not need:
            return c
        if self._mine(c):
            back = shared.attach(target) if shared.serves(target) else None
            if back is not None:  # the run's shared cluster serves this group: the detour's own cluster ends
                logger.info("back on the run's shared cluster; stopping this run's own engines")
                c.stop()
                self.current = back
                return back
            return c.restart_engines(**need)
        if getattr(c, "attached", False):  # the shared cluster stays as it is for the next notebook
            c.stop()  # detaches
            self.current = self._take_pending(target) or self._take_kept(target) or Cluster(target).start()
            return self.current
        return c.restart_engines(**need)  # the caller's cluster: restarted in place, as the caller asked

    def _take_pending(self, target: ClusterConfig):
        p, self._pending = self._pending, None
        if p is None:
            return None
        if p.config == target:
            return p.start()
        p.stop(graceful=False)  # launched for a group that turned out to need something else
        return None

    def launch_ahead(self, target: ClusterConfig) -> bool:
        """Before the engines' turn: launch the first group's cluster of its own (e.g. notebook 04's EP 1 engine on
        one GPU) so it registers and imports while the other notebook's cases hold the engines; its process group
        and warm-up wait for the turn (`ensure`). Nothing where a cluster was given, the run's shared cluster serves
        the group, or launching early is not wanted (`prestart_wanted`). True if launched."""
        from . import shared
        from .cluster import Cluster
        from .spares import prestart_wanted

        if self.current is not None or self._pending is not None or shared.serves(target) or \
                not prestart_wanted(target) or self._kept_serves(target):
            return False
        logger.info("launching this run's own cluster before its turn on the engines")
        self._pending = Cluster(target).launch()
        self._warming = (self._pending, {})
        return True

    def prefetch(self, target: ClusterConfig) -> None:
        """Get the engines of the group after this one going while this one runs (where `prestart_wanted`): a
        cluster of its own when the current one is the shared cluster, else the current cluster's spare set."""
        from . import shared
        from .cluster import Cluster
        from .spares import prestart_wanted

        c = self.current
        need = changes(c.config, target)
        if not need or not prestart_wanted(c.config) or shared.serves(target):
            return
        if getattr(c, "attached", False):
            if self._kept_serves(target):  # `ensure` takes it
                return
            if self._pending is None:
                logger.info("launching the next group's own cluster now (this one is the run's shared cluster)")
                self._pending = Cluster(target).launch()
            self._warming = (self._pending, {})
        elif c.prestart(**need):
            self._warming = (c, need)

    def _kept_serves(self, target: ClusterConfig) -> bool:
        return self._kept is not None and self._kept.config == target

    def tick(self) -> None:
        """Between cases: the early engine set starts its imports once its engines have registered."""
        if self._warming is not None:
            cluster, need = self._warming
            cluster.warm(**need)

    def close(self, error: BaseException | None = None) -> None:
        """Stop what this run started (the early set, its own clusters) and detach from the shared cluster; the
        caller's cluster stays. After Ctrl-C or an engine failure engines may be mid-collective: no waiting. A
        second call does nothing."""
        from .cluster import ClusterError

        if self._closed:
            return
        self._closed = True
        graceful = error is None or not isinstance(error, (KeyboardInterrupt, ClusterError))
        p, self._pending, self._warming = self._pending, None, None
        if p is not None:
            p.stop(graceful=error is None)  # launched for a group that did not need it, or after a failure
        k, self._kept = self._kept, None
        if k is not None:  # the last run's, not needed by this one
            k.stop(graceful=error is None)
        c = self.current
        if c is not None and c is not self._given:
            if error is None and self._mine(c) and self._keepable(c):
                keep(c)
                return
            c.stop(graceful=graceful)

    @staticmethod
    def _keepable(c) -> bool:
        """Whether `c` (this run's own, the run ended well) is kept for the next run: where `keep_wanted`, and once
        its engines have dropped their cached layers (which another cluster's cases may need the memory of
        meanwhile)."""
        from ..engine import dist
        from .attached import DETACH_TIMEOUT_S
        from .spares import keep_wanted

        if not keep_wanted(c.config) or c.client is None:
            return False
        try:
            c.run(dist.release_caches, what="dropping cached layers", timeout=DETACH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - not kept: stopped as usual
            logger.warning("the engines did not drop their cached layers (%s); stopping them", e)
            return False
        return True
