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
"""

from __future__ import annotations

import logging

from ..config import ClusterConfig

logger = logging.getLogger(__name__)

START_FIELDS = ("extra_path", "env", "deterministic")
"""What a group of cases may need its engines to start with (release path, engine environment, deterministic start):
the fields `Cluster.restart_engines` changes."""


def changes(current: ClusterConfig, target: ClusterConfig) -> dict:
    """The start fields `target` has other than `current`: empty when the running engines serve it."""
    return {k: getattr(target, k) for k in START_FIELDS if getattr(current, k) != getattr(target, k)}


class EngineSets:
    """One run's engine sets: `ensure`, `prefetch`, `tick`, `close` (see the module docstring)."""

    def __init__(self, cluster=None):
        self.current = cluster
        self._given = cluster
        self._pending = None  # a cluster of its own for the next group, launched while the shared one works
        self._warming = None  # (cluster, changes): the early set whose imports `tick` starts
        self._closed = False

    def _mine(self, c) -> bool:
        return c is not None and c is not self._given and not getattr(c, "attached", False)

    def ensure(self, target: ClusterConfig):
        """A running cluster whose engines start as `target` says (the group's release, environment, ...)."""
        from . import shared
        from .cluster import Cluster

        self._warming = None
        c = self.current
        if c is None:
            self.current = shared.attach(target) or self._take_pending(target) or Cluster(target).start()
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
            self.current = self._take_pending(target) or Cluster(target).start()
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
                not prestart_wanted(target):
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
            if self._pending is None:
                logger.info("launching the next group's own cluster now (this one is the run's shared cluster)")
                self._pending = Cluster(target).launch()
            self._warming = (self._pending, {})
        elif c.prestart(**need):
            self._warming = (c, need)

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
        c = self.current
        if c is not None and c is not self._given:
            c.stop(graceful=graceful)
