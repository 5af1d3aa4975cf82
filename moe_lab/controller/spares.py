"""Controller side: a cluster's next engine set, launched before it is needed (by `Cluster.launch`, `prestart` or
`Cluster.restart_engines`): its engines register while the current ones work, `warm` starts their slow imports, and
`bring_up.take_spare` makes them the cluster's engines. `state` is the cluster's ClusterState; its spare set is
`state.spare`."""

from __future__ import annotations

import logging
import os
import sys
from .. import switches
from ..config import ClusterConfig
from .state import ClusterState

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work


def spare(engine_set, previous: set, preloaded: tuple | None = None, launch: dict | None = None) -> dict:
    """A spare set: ipyparallel's id of the engine set (None until it is launched), the engines registered before it
    (never its own), the ids of its engines once registered (`warm`), the `prepare_args` its imports were started
    with, those it was forked with from a preload server (None: engines of their own, which import what `warm`
    asks), and, until it is launched, what ipyparallel's start_engines will be given (`launch_deferred`)."""
    return {"set": engine_set, "previous": previous, "ids": None, "warmed": None, "preloaded": preloaded,
            "launch": launch}


def launch_deferred(state: ClusterState, *, block: bool) -> bool:
    """Launch the spare set's engines where they wait for it: at once if they are forked from no preload server or
    from one whose imports are done, else once they are (`block`: wait for them; without it, False until then — a
    set launched early is forked later, between cases, instead of the controller waiting ~12 s for a new server's
    imports on a GPU node while the current engines stand idle). True once the set is launched."""
    sp = state.spare
    if sp is None:
        return False
    if sp["set"] is not None:
        return True
    kw = sp["launch"] or {}
    server = kw.get("server")
    if not block and server is not None and not server.settled():
        return False
    sp["set"], sp["launch"] = state.ipp.start_engines_sync(n=state.config.engines, **kw), None
    return True


def prestart(state: ClusterState, /, **changes) -> bool:
    """Launch the engine set the next `restart_engines(**changes)` will use, now (Cluster.prestart); with `changes`
    known, forked from a preload server for them where the cluster forks its engines (`controller.preloaded`). True
    if a spare set is up or on its way."""
    from . import preloaded

    if state.client is None or state.attached or state.config.launcher != "local":
        return False
    if state.spare is None:
        previous = registered(state.client)
        target = state.config.replace(**changes) if changes else None
        kw = preloaded.engine_kwargs(state, target) if target is not None else {}
        forked = prepare_args(target) if kw.get("server") is not None else None
        state.spare = spare(None, previous, forked, launch=kw)
        launch_deferred(state, block=False)
        logger.info("launched %d spare engines for the next restart%s", state.config.engines,
                    (" (forked from a preload server" + ("" if state.spare["set"] is not None else
                                                         ", once its imports are done") + ")") if forked else "")
    return True


def usable(sp: dict | None, cfg: ClusterConfig) -> bool:
    """Whether spare set `sp` can serve engines started as `cfg`: nothing imported yet, or imported for cfg."""
    args = prepare_args(cfg)
    return sp is not None and sp["warmed"] in (None, args) and sp.get("preloaded") in (None, args)


def warm(state: ClusterState, /, **changes) -> bool:
    """Non-blocking: the spare engines' imports for the config `changes` gives, once they have registered
    (Cluster.warm); True once the imports are on their way."""
    sp = state.spare
    if sp is None or state.client is None:
        return False
    if sp["warmed"] is not None:
        return True
    if not launch_deferred(state, block=False):  # its preload server is still importing
        return False
    target = state.config.replace(**changes) if changes else state.config
    if not usable(sp, target):  # forked for another configuration: never imported for this one
        return False
    new = sorted(eid for eid, _ in registered(state.client) - sp["previous"])
    if len(new) < state.config.engines:
        return False
    from ..engine import dist

    sp["ids"] = new[: state.config.engines]
    sp["warmed"] = prepare_args(target)
    for eid in sp["ids"]:
        state.client[eid].apply_async(dist.prepare, **dict(sp["warmed"]))
    return True


def prepare_args(cfg: ClusterConfig) -> tuple:
    """What `dist.prepare` (the slow imports) is called with for `cfg`; a spare set warmed with others is not used."""
    return (("device", cfg.device), ("extra_path", tuple(cfg.extra_path)), ("env", dict(cfg.env)),
            ("deterministic", cfg.deterministic))


def prestart_wanted(cfg: ClusterConfig) -> bool:
    """Whether to launch a cluster's next engines while the current ones work (Cluster.prestart, protocol.run):
    local engines on a GPU node, or on a CPU machine with a core for every engine of both sets — on fewer cores the
    early imports would slow the measuring engines. MOE_LAB_PRESTART=1 / 0 forces it on / off."""
    forced = switches.forced("MOE_LAB_PRESTART")
    if forced is not None:
        return forced and cfg.launcher == "local"
    return cfg.launcher == "local" and (cfg.device == "cuda" or (os.cpu_count() or 1) >= 2 * cfg.engines)


def keep_wanted(cfg: ClusterConfig) -> bool:
    """Whether a run's own cluster is kept for the same process's next run (`engine_sets.keep`): local engines in a
    notebook kernel (whose next cell may ask for the same engines) where launching early is wanted, and not on a GPU
    that a `moe-lab run`'s shared cluster uses too: there the other notebook's cases run beside the kept engines, which
    hold GPU memory even with their layers dropped (each its CUDA context and what its allocator keeps), and the
    gpu profile's seed layers fill an 80 GB GPU with four ranks (`shared_gpu_run`). MOE_LAB_KEEP_ENGINES=1 / 0 forces
    it on / off."""
    forced = switches.forced("MOE_LAB_KEEP_ENGINES")
    if forced is not None:
        return forced and cfg.launcher == "local"
    return in_notebook_kernel() and prestart_wanted(cfg) and not shared_gpu_run(cfg)


def shared_gpu_run(cfg: ClusterConfig) -> bool:
    """Whether cfg's engines would use GPUs in a run whose notebooks share a cluster (`controller.shared`, named to the
    kernels in its environment variable)."""
    from .state import SHARED_CLUSTER_ENV

    return cfg.device == "cuda" and bool(os.environ.get(SHARED_CLUSTER_ENV))


def in_notebook_kernel() -> bool:
    """Whether this process is a running IPython kernel (a notebook's), not a command or a test that imported
    ipykernel through ipyparallel."""
    app = sys.modules.get("ipykernel.kernelapp")
    return app is not None and app.IPKernelApp.initialized()


def registered(client, ids=None) -> set[tuple[int, str]]:
    """(engine id, uuid) of the engines registered now (or of `ids`): an id alone can come back (mpiexec engines ask
    for their MPI rank) once the hub has dropped the engine that had it."""
    engines = getattr(client, "_engines", {})
    return {(eid, str(engines.get(eid, ""))) for eid in (client.ids if ids is None else ids)}
