"""Controller side: a cluster's next engine set, launched before it is needed (by `Cluster.launch`, `prestart` or
`Cluster.restart_engines`): its engines register while the current ones work, `warm` starts their slow imports, and
`bring_up.take_spare` makes them the cluster's engines. `cluster` is a Cluster; its spare set is `cluster._spare`."""

from __future__ import annotations

import logging
import os
from typing import TYPE_CHECKING

from ..config import ClusterConfig

if TYPE_CHECKING:
    from .cluster import Cluster

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work


def spare(engine_set, previous: set) -> dict:
    """A spare set: ipyparallel's id of the engine set, the engines registered before it (never its own), the ids of
    its engines once registered (`warm`), and the `prepare_args` its imports were started with."""
    return {"set": engine_set, "previous": previous, "ids": None, "warmed": None}


def prestart(cluster: Cluster) -> bool:
    """Launch the engine set the next `restart_engines` will use, now (Cluster.prestart); True if a spare set is up
    or on its way."""
    if cluster.client is None or cluster.attached or cluster.config.launcher != "local":
        return False
    if cluster._spare is None:
        previous = registered(cluster.client)
        cluster._spare = spare(cluster._ipp.start_engines_sync(n=cluster.config.engines), previous)
        logger.info("launched %d spare engines for the next restart", cluster.config.engines)
    return True


def warm(cluster: Cluster, /, **changes) -> bool:
    """Non-blocking: the spare engines' imports for the config `changes` gives, once they have registered
    (Cluster.warm); True once the imports are on their way."""
    sp = cluster._spare
    if sp is None or cluster.client is None:
        return False
    if sp["warmed"] is not None:
        return True
    new = sorted(eid for eid, _ in registered(cluster.client) - sp["previous"])
    if len(new) < cluster.config.engines:
        return False
    from ..engine import dist

    sp["ids"] = new[: cluster.config.engines]
    sp["warmed"] = prepare_args(cluster.config.replace(**changes) if changes else cluster.config)
    for eid in sp["ids"]:
        cluster.client[eid].apply_async(dist.prepare, **dict(sp["warmed"]))
    return True


def prepare_args(cfg: ClusterConfig) -> tuple:
    """What `dist.prepare` (the slow imports) is called with for `cfg`; a spare set warmed with others is not used."""
    return (("device", cfg.device), ("extra_path", tuple(cfg.extra_path)), ("env", dict(cfg.env)),
            ("deterministic", cfg.deterministic))


def prestart_wanted(cfg: ClusterConfig) -> bool:
    """Whether to launch a cluster's next engines while the current ones work (Cluster.prestart, protocol.run):
    local engines on a GPU node, or on a CPU machine with a core for every engine of both sets — on fewer cores the
    early imports would slow the measuring engines. MOE_LAB_PRESTART=1 / 0 forces it on / off."""
    forced = os.environ.get("MOE_LAB_PRESTART", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and cfg.launcher == "local"
    return cfg.launcher == "local" and (cfg.device == "cuda" or (os.cpu_count() or 1) >= 2 * cfg.engines)


def registered(client, ids=None) -> set[tuple[int, str]]:
    """(engine id, uuid) of the engines registered now (or of `ids`): an id alone can come back (mpiexec engines ask
    for their MPI rank) once the hub has dropped the engine that had it."""
    engines = getattr(client, "_engines", {})
    return {(eid, str(engines.get(eid, ""))) for eid in (client.ids if ids is None else ids)}
