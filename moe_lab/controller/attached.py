"""Controller side: a Cluster that is a client of another process's cluster (a run's shared cluster, `shared`):
what attaching needs (`handle`), attaching (`connect`: the Cluster checks the engines' health) and leaving
(`detach`). `state` is the cluster's ClusterState."""

from __future__ import annotations

import logging
from . import calls, processes
from .state import ClusterState

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work

DETACH_TIMEOUT_S = 10.0  # how long engines of a shared cluster get to drop their cached layers when a notebook leaves


def handle(state: ClusterState) -> dict:
    """What a client in another process needs to attach to the cluster (`connect`): controller, engines, ranks."""
    return {"profile_dir": state.profile_dir, "cluster_id": getattr(state.ipp, "cluster_id", ""),
            "engine_ids": list(state.engine_ids), "info": state.info, "procs": state.procs,
            "rendezvous": list(state.rendezvous or ())}


def connect(state: ClusterState, handle: dict, *, timeout: float) -> None:
    """Make `state` (a cluster not started) a client of the running cluster that `handle` (plus `client_file`)
    describes (Cluster.connect, which then checks the engines' health); its client is closed if that fails here."""
    import ipyparallel as ipp

    state.client = ipp.Client(handle["client_file"], profile_dir=handle["profile_dir"],
                              cluster_id=handle["cluster_id"], timeout=timeout)
    try:
        missing = sorted(set(handle["engine_ids"]) - set(state.client.ids))
        if missing:
            raise RuntimeError(f"engines {missing} of the shared cluster are gone")
        state.engine_ids, state.info, state.procs = list(handle["engine_ids"]), handle["info"], handle["procs"]
        state.rendezvous = tuple(handle["rendezvous"]) or None
        state.profile_dir, state.attached = handle["profile_dir"], True
        state.view = state.client.direct_view(targets=state.engine_ids)
        state.view.block = True
    except BaseException:
        state.client.close()
        raise


def detach(state: ClusterState, graceful: bool) -> None:
    """Leave an attached cluster: graceful — its engines drop their cached layers and stay up for the next
    notebook; otherwise (a fault, Ctrl-C) its engines are ended, so nothing runs on engines in an unknown state."""
    from ..engine import dist

    if graceful and state.client is not None and state.engine_ids:
        try:
            calls.run(state, dist.release_caches, what="dropping cached layers", timeout=DETACH_TIMEOUT_S)
        except Exception as e:  # noqa: BLE001 - the engines are ended below instead
            logger.warning("the shared cluster's engines did not drop their layers (%s); ending them", e)
            graceful = False
        except KeyboardInterrupt:  # Ctrl-C while they drop their layers: they are in an unknown state
            _leave(state, graceful=False)
            raise
    _leave(state, graceful)


def _leave(state: ClusterState, graceful: bool) -> None:
    if not graceful and state.profile_dir:
        processes.kill_engines(state.profile_dir)
    state.close_client()
    state.client = state.view = None
    state.engine_ids, state.profile_dir = [], None
