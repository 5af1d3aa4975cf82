"""Controller side: a cluster's engines restarted under the same controller and client (`restart_engines`: another
megatron-core release, environment or deterministic start), on its spare set where one was launched early (`spares`),
and the clean end of the current engines' process groups (`teardown_engines`). `cluster` is a Cluster."""

from __future__ import annotations

import logging
import time
from typing import TYPE_CHECKING

from . import bring_up, processes, spares

if TYPE_CHECKING:
    from .cluster import Cluster

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work


def restart_engines(cluster: Cluster, /, **changes) -> Cluster:
    """New engines for `cluster`, with `changes` applied to its config (Cluster.restart_engines)."""
    if cluster.attached:
        raise ValueError("a run's shared cluster cannot be restarted from a notebook: start a cluster of its own")
    fixed = {k: v for k, v in changes.items() if k in ("engines", "device") and v != getattr(cluster.config, k)}
    if fixed and cluster.client is not None:
        raise ValueError(f"restart_engines cannot change {sorted(fixed)} (the engine set and its devices): "
                         "stop() the cluster and start one with the new config")
    if changes:
        cluster.config = cluster.config.replace(**changes)
    if cluster.client is None:
        return cluster.start()
    cfg, sp = cluster.config, cluster._spare
    t0 = time.perf_counter()
    spare = sp if sp and sp["warmed"] in (None, spares.prepare_args(cfg)) else None
    old = spares.registered(cluster.client, cluster.engine_ids)
    teardown_engines(cluster)
    try:
        logger.info("restarting %d %s engines%s%s", cfg.engines, cfg.device,
                    f" with {cfg.extra_path[0]} first on their path" if cfg.extra_path else "",
                    " (launched early)" if spare else "")
        if spare:  # the next engine set is already up: end only the current one
            processes.kill_engines(cluster.profile_dir, only=[p["pid"] for p in cluster.procs])
            if cluster._engine_set is not None:
                cluster._ipp.stop_engines_sync(cluster._engine_set)
        else:
            # Process groups are torn down: end the engines at once (SIGTERM costs seconds per engine with
            # torch loaded), then let ipyparallel reap them and forget their engine set.
            processes.kill_engines(cluster.profile_dir)
            cluster._ipp.stop_engines_sync()
            # Killed engines stay registered until the hub's heartbeat drops them: every engine known now is old.
            old |= spares.registered(cluster.client)
            cluster._spare = spares.spare(cluster._ipp.start_engines_sync(n=cfg.engines), previous=old)
        cluster.info, cluster._procs, cluster.rendezvous, cluster.engine_ids, cluster.view = [], [], None, [], None
        bring_up.take_spare(cluster)
        cluster.timings["engines_s"] = time.perf_counter() - t0
        bring_up.bring_up(cluster)
    except BaseException:
        cluster.stop(graceful=False)
        raise
    cluster.timings["restart_s"] = cluster.timings["ready_s"] = time.perf_counter() - t0
    logger.info("engines restarted in %.1f s (registered %.1f s, imports + process group %.1f s): %s",
                cluster.timings["restart_s"], cluster.timings["engines_s"], cluster.timings["process_group_s"],
                cluster.summary())
    return cluster


def teardown_engines(cluster: Cluster) -> None:
    """dist.teardown on every engine still registered (process groups destroyed cleanly); never raises."""
    from ..engine import dist

    try:
        alive = [e for e in cluster.engine_ids if e in set(cluster.client.ids)]
        for ar in [cluster.client[e].apply_async(dist.teardown) for e in alive]:
            ar.get(timeout=min(10.0, cluster.config.timeout_s))
    except Exception as e:  # noqa: BLE001 - the engines are stopped next whatever happened here
        logger.warning("teardown on engines did not finish cleanly (%s); stopping them anyway", e)
