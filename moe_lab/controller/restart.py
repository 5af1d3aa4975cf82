"""Controller side: a cluster's engines restarted under the same controller and client (another megatron-core
release, environment or deterministic start): the changes checked and applied to its config (`apply_changes`), the
current engines ended and the next set found or launched (`replace_engines`: its spare set where one was launched
early, `spares`), and the clean end of the current engines' process groups (`teardown_engines`). `Cluster.
restart_engines` composes them with `bring_up` (and stops the engines if that fails); `state` is the cluster's
ClusterState."""

from __future__ import annotations

import logging
import time

from . import processes, spares
from .state import ClusterState

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work


def apply_changes(state: ClusterState, changes: dict) -> None:
    """Check `changes` (Cluster.restart_engines) against the running cluster and apply them to its config."""
    if state.attached:
        raise ValueError("a run's shared cluster cannot be restarted from a notebook: start a cluster of its own")
    fixed = {k: v for k, v in changes.items() if k in ("engines", "device") and v != getattr(state.config, k)}
    if fixed and state.client is not None:
        raise ValueError(f"restart_engines cannot change {sorted(fixed)} (the engine set and its devices): "
                         "stop() the cluster and start one with the new config")
    if changes:
        state.config = state.config.replace(**changes)


def retire_engines(state: ClusterState) -> tuple[dict | None, set]:
    """Before a restart: the spare set to use (None if there is none, or it was warmed for another config), the
    engines registered now, and the current engines' process groups torn down."""
    cfg, sp = state.config, state.spare
    spare = sp if spares.usable(sp, cfg) else None
    old = spares.registered(state.client, state.engine_ids)
    teardown_engines(state)
    return spare, old


def replace_engines(state: ClusterState, spare: dict | None, old: set) -> None:
    """End the current engines and have the next set as the cluster's spare (launched now where `spare` is None);
    the engines' state is cleared for `bring_up`."""
    from . import preloaded

    cfg = state.config
    logger.info("restarting %d %s engines%s%s", cfg.engines, cfg.device,
                f" with {cfg.extra_path[0]} first on their path" if cfg.extra_path else "",
                " (launched early)" if spare else "")
    if spare:  # the next set is up, or take_spare forks it once its server has imported: end the current one only
        processes.kill_engines(state.profile_dir, only=[p["pid"] for p in state.procs])
        if state.engine_set is not None:
            state.ipp.stop_engines_sync(state.engine_set)
    else:
        # Process groups are torn down: end the engines at once (SIGTERM costs seconds per engine with
        # torch loaded), then let ipyparallel reap them and forget their engine set.
        processes.kill_engines(state.profile_dir)
        state.ipp.stop_engines_sync()
        # Killed engines stay registered until the hub's heartbeat drops them: every engine known now is old.
        old |= spares.registered(state.client)
        state.spare = spares.spare(state.ipp.start_engines_sync(n=cfg.engines,
                                                                **preloaded.engine_kwargs(state, cfg)), previous=old)
    state.info, state.procs, state.rendezvous, state.engine_ids, state.view = [], [], None, [], None


def log_restart(state: ClusterState, t0: float) -> None:
    state.timings["restart_s"] = state.timings["ready_s"] = time.perf_counter() - t0
    logger.info("engines restarted in %.1f s (registered %.1f s, imports + process group %.1f s): %s",
                state.timings["restart_s"], state.timings["engines_s"], state.timings["process_group_s"],
                state.summary())


def teardown_engines(state: ClusterState) -> None:
    """dist.teardown on every engine still registered (process groups destroyed cleanly); never raises."""
    from ..engine import dist

    try:
        alive = [e for e in state.engine_ids if e in set(state.client.ids)]
        for ar in [state.client[e].apply_async(dist.teardown) for e in alive]:
            ar.get(timeout=min(10.0, state.config.timeout_s))
    except Exception as e:  # noqa: BLE001 - the engines are stopped next whatever happened here
        logger.warning("teardown on engines did not finish cleanly (%s); stopping them anyway", e)
