"""Controller side: a cluster's fresh engine set brought into service — its engines registered (`take_spare`,
`attach_engines`), located and put in rank order (`place`), torch + megatron-core imported, the rendezvous, process
group and parallel_state set up (`bring_up`). Where ranks go is `launchers.assign_ranks`; `state` is the cluster's
ClusterState (the Cluster stops its engines if bringing them up fails)."""

from __future__ import annotations

import logging
import sys
import time
from collections import Counter
from pathlib import Path

from . import calls, diagnosis
from .diagnosis import ClusterError
from .launchers import assign_ranks, launcher_rank
from .spares import launch_deferred, registered
from .state import ClusterState

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work


def take_spare(state: ClusterState) -> None:
    """Make the spare engine set (launched by launch, prestart or restart_engines) the cluster's engines."""
    launch_deferred(state, block=True)  # a set launched early whose server was still importing: forked now
    sp, state.spare = state.spare, None
    state.engine_set = sp["set"]
    attach_engines(state, previous=sp["previous"])


def attach_engines(state: ClusterState, previous: set) -> None:
    """Wait (start timeout) for `engines` new engines to register, (id, uuid) not in `previous`; ranks follow in
    bring_up, once each engine has said which node it is on.

    An engine is known by (id, uuid), not by id: engines started by mpiexec ask for their MPI rank as id, so a
    restarted engine can get the id of one that the hub has dropped since.
    """
    cfg = state.config
    deadline = time.monotonic() + cfg.start_timeout_s
    next_look = time.monotonic() + 0.5
    while True:
        new = sorted(eid for eid, _ in registered(state.client) - previous)
        if len(new) >= cfg.engines:  # old ids may linger until the hub's heartbeat drops them: never targeted
            break
        if time.monotonic() > next_look:  # an engine that died before registering: said now, not at the deadline
            next_look = time.monotonic() + 0.5
            ended = diagnosis.ended_engines(state)
            if ended:
                raise ClusterError(f"{len(ended)} of {cfg.engines} engine process(es) ended before registering "
                                   f"({'; '.join(ended)}), {len(new)} registered; run one by hand to see why: "
                                   f"{sys.executable} -m ipyparallel.engine", kind="died")
        if time.monotonic() > deadline:
            raise ClusterError(f"{len(new)} of {cfg.engines} engines registered within "
                               f"{cfg.start_timeout_s:.0f} s; raise start_timeout_s, or see why they fail with "
                               "logging.getLogger('moe_lab.ipyparallel').setLevel('DEBUG')", kind="timeout")
        time.sleep(0.05)
    state.engine_ids = new[: cfg.engines]  # in id order; place sets rank order and the view


def bring_up(state: ClusterState) -> None:
    """On fresh engines: locate them, import torch + megatron-core, rendezvous, process group, parallel_state."""
    from ..engine import dist

    cfg = state.config
    t1 = time.perf_counter()
    stacks = Path(state.profile_dir, "stacks")
    ids = list(state.engine_ids)  # id order until each engine has said where it runs
    procs = calls.run(state, dist.identify, per_rank=lambda i: dict(stack_file=str(stacks / f"engine{ids[i]}.txt")),
                      what="locating the engines", timeout=cfg.start_timeout_s)
    place(state, procs)
    env = dict(cfg.env)
    # The slow imports (torch + megatron-core) first, under the start timeout: engines finish them at
    # different times, and the rendezvous below must not wait that long under timeout_s.
    took = calls.run(state, dist.prepare, device=cfg.device, extra_path=tuple(cfg.extra_path), env=env,
                     deterministic=cfg.deterministic, what="importing torch and megatron-core",
                     timeout=cfg.start_timeout_s)
    state.timings["imports_s"] = max(took)  # ~0 where `warm` had the engines import already
    # Rendezvous on rank 0's host (MASTER_ADDR in env overrides its address, for a host with several networks);
    # rank 0 holds the port from the moment the OS gives it.
    single_host = len({p["node"] for p in state.procs}) == 1
    addr = "127.0.0.1" if single_host else (env.get("MASTER_ADDR") or state.procs[0]["address"])
    port = calls.call(state, 0, dist.open_store, world=cfg.engines, timeout_s=cfg.timeout_s, port=state.port,
                      what="opening the rendezvous store")
    state.rendezvous = (addr, port)
    state.info = calls.run(state, dist.setup, per_rank=lambda r: dict(
        rank=r, world=cfg.engines, master_addr=addr, master_port=port, device=cfg.device,
        timeout_s=cfg.timeout_s, extra_path=tuple(cfg.extra_path), env=env,
        deterministic=cfg.deterministic, local_rank=state.procs[r]["local_rank"],
        local_world=state.procs[r]["local_world"], ranks_per_gpu=cfg.ranks_per_gpu),
        what="init_process_group + parallel_state")
    state.timings["process_group_s"] = time.perf_counter() - t1
    calls.run(state, dist.health_check, what="health all-reduce")


def place(state: ClusterState, procs: list[dict]) -> None:
    """Ranks from where the engines run (`procs[i]` is engine `engine_ids[i]`'s dist.identify): one node's ranks
    contiguous, each engine's local rank (its GPU) its index on its node. Reorders engine_ids, the view and
    the process table into rank order."""
    placed = assign_ranks([(eid, p["node"]) for eid, p in zip(state.engine_ids, procs)],
                          {eid: r for eid, p in zip(state.engine_ids, procs)
                           if (r := launcher_rank(p.get("launcher_env") or {})) is not None})
    by_id = dict(zip(state.engine_ids, procs))
    state.engine_ids = [pl["engine"] for pl in placed]
    state.procs = [dict(by_id[pl["engine"]], **pl) for pl in placed]
    state.view = state.client.direct_view(targets=state.engine_ids)
    state.view.block = True
    nodes = Counter(p["node"] for p in state.procs)
    if len(nodes) > 1:
        logger.info("engines on %d nodes: %s", len(nodes), ", ".join(f"{n} ({k})" for n, k in nodes.items()))
