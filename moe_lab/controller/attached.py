"""Controller side: a Cluster that is a client of another process's cluster (a run's shared cluster, `shared`):
what attaching needs (`handle`), attaching (`connect`) and leaving (`detach`). `cluster` is a Cluster."""

from __future__ import annotations

import logging
from typing import TYPE_CHECKING

from ..config import ClusterConfig
from . import processes

if TYPE_CHECKING:
    from .cluster import Cluster

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work

DETACH_TIMEOUT_S = 10.0  # how long engines of a shared cluster get to drop their cached layers when a notebook leaves


def handle(cluster: Cluster) -> dict:
    """What a client in another process needs to attach to `cluster` (`connect`): controller, engines, ranks."""
    return {"profile_dir": cluster.profile_dir, "cluster_id": getattr(cluster._ipp, "cluster_id", ""),
            "engine_ids": list(cluster.engine_ids), "info": cluster.info, "procs": cluster.procs,
            "rendezvous": list(cluster.rendezvous or ())}


def connect(cls: type[Cluster], config: ClusterConfig, handle: dict, *, timeout: float) -> Cluster:
    """A `cls` attached to the running cluster that `handle` (plus `client_file`) describes (Cluster.connect)."""
    import ipyparallel as ipp

    c = cls(config)
    c.client = ipp.Client(handle["client_file"], profile_dir=handle["profile_dir"],
                          cluster_id=handle["cluster_id"], timeout=timeout)
    try:
        missing = sorted(set(handle["engine_ids"]) - set(c.client.ids))
        if missing:
            raise RuntimeError(f"engines {missing} of the shared cluster are gone")
        c.engine_ids, c.info, c._procs = list(handle["engine_ids"]), handle["info"], handle["procs"]
        c.rendezvous = tuple(handle["rendezvous"]) or None
        c._profile_dir, c.attached = handle["profile_dir"], True
        c.view = c.client.direct_view(targets=c.engine_ids)
        c.view.block = True
        c.health_check()
    except BaseException:
        c.client.close()
        raise
    return c


def detach(cluster: Cluster, graceful: bool) -> None:
    """Leave an attached cluster: graceful — its engines drop their cached layers and stay up for the next
    notebook; otherwise (a fault, Ctrl-C) its engines are ended, so nothing runs on engines in an unknown state."""
    from ..engine import dist

    if graceful and cluster.client is not None and cluster.engine_ids:
        try:
            cluster.run(dist.release_caches, what="dropping cached layers", timeout=DETACH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the engines are ended below instead
            logger.warning("the shared cluster's engines did not drop their layers (%s); ending them", e)
            graceful = False
    if not graceful and cluster.profile_dir:
        processes.kill_engines(cluster.profile_dir)
    cluster._close_client()
    cluster.client = cluster.view = None
    cluster.engine_ids, cluster._profile_dir = [], None
