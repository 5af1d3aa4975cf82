"""Controller side: a warm MoE lab — ipyparallel engines, one torch.distributed rank each — started, called with a
timeout on every call, restarted (another megatron-core release), and torn down. Where the engines go is
`placement`, how they are launched `launchers`, why a call failed `diagnosis`, their OS processes `processes`."""

from __future__ import annotations

import logging
import os
import shutil
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from ..config import ClusterConfig
from . import diagnosis, processes
from .diagnosis import ClusterError
from .launchers import assign_ranks, launcher_rank, launcher_settings, profile_parent
from .placement import default_config

logger = logging.getLogger(__name__)

PROFILE_PREFIX = "moe_lab_ipp_"
DETACH_TIMEOUT_S = 10.0  # how long engines of a shared cluster get to drop their cached layers when a notebook leaves
LIVENESS_EVERY_S = 0.5  # how often a waiting call checks that every engine process still exists (#7)
COLLECTIVE_GRACE_S = 3.0  # after one rank's collective fails, how long to wait for the others' answers; and
# how much longer than the process-group timeout a call waits by default


class Cluster:
    """A warm MoE lab: `engines` ipyparallel engines, each one torch.distributed rank with parallel_state set.

    with Cluster(ClusterConfig(engines=4)) as c:
        c.run(fn, *args)   # fn runs on every rank at once → one result per rank, in rank order

    Every call watches the engine processes: a dead engine, a hung collective or Ctrl-C ends in a ClusterError
    (or the KeyboardInterrupt) with the engines stopped, and `start()` brings the cluster back (#7).
    """

    def __init__(self, config: ClusterConfig | None = None, **kw):
        self.config = config or default_config(**kw)
        self._ipp = None
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []  # engine_ids[rank] is the ipyparallel id of that rank's engine
        self.info: list[dict] = []
        self.timings: dict[str, float] = {}
        self.rendezvous: tuple[str, int] | None = None  # (address, port) of the process group's TCPStore
        self.port = 0  # preferred rendezvous port; 0 (or a busy one) lets the OS pick a free one
        self._procs: list[dict] = []  # per rank: pid, node, main_thread, stack_file (dist.identify)
        self._profile_dir: str | None = None
        self._reaper = None  # the watchdog process (processes.start_watchdog)
        self.attached = False  # a client of a run's shared cluster (controller.shared): stop() detaches
        self._spare: dict | None = None  # the next engine set, launched before it is needed (prestart, launch)
        self._engine_set = None  # ipyparallel's id of the current engine set
        self._launched_at = 0.0

    @property
    def profile_dir(self) -> str | None:
        """The private ipyparallel profile of this cluster; its processes carry it as IPP_PROFILE_DIR."""
        return self._profile_dir

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # After Ctrl-C or an engine failure the engines may be mid-collective: don't wait on them.
        self.stop(graceful=exc_type is None or not issubclass(exc_type, (KeyboardInterrupt, ClusterError)))

    def start(self) -> "Cluster":
        if self.client is not None and self.engine_ids:
            return self
        t0 = time.perf_counter()
        try:
            if self.client is None:
                self.launch()
            else:  # launched early (protocol: the next group's cluster): its engines may have registered already
                t0 = self._launched_at
            self._take_spare()
            self.timings["engines_s"] = time.perf_counter() - t0
            self._bring_up()
            self.timings["ready_s"] = time.perf_counter() - t0
            logger.info("cluster ready in %.1f s (engines registered %.1f s, imports + process group %.1f s): %s",
                        self.timings["ready_s"], self.timings["engines_s"], self.timings["process_group_s"],
                        self.summary())
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    def launch(self) -> "Cluster":
        """Start the controller and the engine processes without waiting for them: `start()` later finds them
        registered (and, after `warm()`, their imports done). protocol.run launches the next group's cluster this
        way while the current one works."""
        import ipyparallel as ipp

        if self.client is not None:
            return self
        cfg = self.config
        settings = launcher_settings(cfg)  # a bad launcher option is refused before anything starts
        self._launched_at = time.perf_counter()
        self.info, self.timings, self._procs, self.rendezvous = [], {}, [], None
        # A private profile per cluster: two notebooks (or users) never share connection files or ports.
        self._profile_dir = tempfile.mkdtemp(prefix=PROFILE_PREFIX, dir=profile_parent(cfg))
        try:
            self._reaper = processes.start_watchdog(os.getpid(), self._profile_dir)
            # ipyparallel logs to the notebook's stdout by default, engine output included when they are
            # stopped by signal; route it to our logger (quiet unless debugging) so reports stay readable.
            ipp_log = logging.getLogger("moe_lab.ipyparallel")
            if ipp_log.level == logging.NOTSET:
                ipp_log.setLevel(logging.ERROR)
            self._ipp = ipp.Cluster(n=cfg.engines, profile_dir=self._profile_dir, log=ipp_log,
                                    engine_timeout=int(cfg.start_timeout_s), delay=0.1, **settings)
            logger.info("starting %d %s engines (launcher %s)", cfg.engines, cfg.device, cfg.launcher)
            self._ipp.start_cluster_sync(n=cfg.engines)
            self.client = self._ipp.connect_client_sync()
            self._spare = {"set": next(iter(self._ipp.engines), None), "previous": set(), "ids": None,
                           "warmed": None}
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    # ------------------------------------------------------------------ a run's shared cluster (controller.shared)
    def handle(self) -> dict:
        """What a client in another process needs to attach to this cluster (`connect`): controller, engines, ranks."""
        return {"profile_dir": self._profile_dir, "cluster_id": getattr(self._ipp, "cluster_id", ""),
                "engine_ids": list(self.engine_ids), "info": self.info, "procs": self._procs,
                "rendezvous": list(self.rendezvous or ())}

    @classmethod
    def connect(cls, config: ClusterConfig, handle: dict, *, timeout: float) -> "Cluster":
        """A client of a running cluster of another process (its `handle()` plus `client_file`): the same controller,
        engines, process group and parallel_state. It is `attached`: stop() detaches, and it is never restarted."""
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

    def _detach(self, graceful: bool) -> None:
        """Leave an attached cluster: graceful — its engines drop their cached layers and stay up for the next
        notebook; otherwise (a fault, Ctrl-C) its engines are ended, so nothing runs on engines in an unknown state."""
        from ..engine import dist

        if graceful and self.client is not None and self.engine_ids:
            try:
                self.run(dist.release_caches, what="dropping cached layers", timeout=DETACH_TIMEOUT_S)
            except Exception as e:  # noqa: BLE001 - the engines are ended below instead
                logger.warning("the shared cluster's engines did not drop their layers (%s); ending them", e)
                graceful = False
        if not graceful and self._profile_dir:
            processes.kill_engines(self._profile_dir)
        self._close_client()
        self.client = self.view = None
        self.engine_ids, self._profile_dir = [], None

    def _close_client(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the processes are ended by profile
                pass

    def restart_engines(self, **changes) -> "Cluster":
        """New engines under the same controller and client, with `changes` applied to the config (the fields the
        engines read at start: extra_path, deterministic, env, timeout_s, tp). The way to switch megatron-core
        release: a process imports it once, so only the engines go; the controller, its profile and the watchdog
        stay. Not running yet: plain start() with the new config. Timings: restart_s (+ engines_s, ready_s).
        """
        if self.attached:
            raise ValueError("a run's shared cluster cannot be restarted from a notebook: start a cluster of its own")
        fixed = {k: v for k, v in changes.items() if k in ("engines", "device") and v != getattr(self.config, k)}
        if fixed and self.client is not None:
            raise ValueError(f"restart_engines cannot change {sorted(fixed)} (the engine set and its devices): "
                             "stop() the cluster and start one with the new config")
        if changes:
            self.config = self.config.replace(**changes)
        if self.client is None:
            return self.start()
        t0 = time.perf_counter()
        spare = self._spare if self._spare and self._spare["warmed"] in (None, self._prepare_args()) else None
        old = _registered(self.client, self.engine_ids)
        self._teardown_engines()
        try:
            logger.info("restarting %d %s engines%s%s", self.config.engines, self.config.device,
                        f" with {self.config.extra_path[0]} first on their path" if self.config.extra_path else "",
                        " (launched early)" if spare else "")
            if spare:  # the next engine set is already up: end only the current one
                processes.kill_engines(self._profile_dir, only=[p["pid"] for p in self._procs])
                if self._engine_set is not None:
                    self._ipp.stop_engines_sync(self._engine_set)
            else:
                # Process groups are torn down: end the engines at once (SIGTERM costs seconds per engine with
                # torch loaded), then let ipyparallel reap them and forget their engine set.
                processes.kill_engines(self._profile_dir)
                self._ipp.stop_engines_sync()
                # Killed engines stay registered until the hub's heartbeat drops them: every engine known now is old.
                old |= _registered(self.client)
                self._spare = {"set": self._ipp.start_engines_sync(n=self.config.engines), "previous": old,
                               "ids": None, "warmed": None}
            self.info, self._procs, self.rendezvous, self.engine_ids, self.view = [], [], None, [], None
            self._take_spare()
            self.timings["engines_s"] = time.perf_counter() - t0
            self._bring_up()
        except BaseException:
            self.stop(graceful=False)
            raise
        self.timings["restart_s"] = self.timings["ready_s"] = time.perf_counter() - t0
        logger.info("engines restarted in %.1f s (registered %.1f s, imports + process group %.1f s): %s",
                    self.timings["restart_s"], self.timings["engines_s"], self.timings["process_group_s"],
                    self.summary())
        return self

    def _teardown_engines(self) -> None:
        """dist.teardown on every engine still registered (process groups destroyed cleanly); never raises."""
        from ..engine import dist

        try:
            alive = [e for e in self.engine_ids if e in set(self.client.ids)]
            for ar in [self.client[e].apply_async(dist.teardown) for e in alive]:
                ar.get(timeout=min(10.0, self.config.timeout_s))
        except Exception as e:  # noqa: BLE001 - the engines are stopped next whatever happened here
            logger.warning("teardown on engines did not finish cleanly (%s); stopping them anyway", e)

    # ------------------------------------------------------------------ the next engine set, launched early
    def prestart(self) -> bool:
        """Launch the engine set the next `restart_engines` will use, now, while the current engines work: it then
        finds them registered and, after `warm(**changes)` with the same changes, their imports done. The first
        ~20 s of a restart on a GPU node (registration, torch + megatron-core imports) are hidden. Local engines
        only, where the cores allow (`prestart_wanted`); True if a spare set is up or on its way."""
        if self.client is None or self.attached or self.config.launcher != "local":
            return False
        if self._spare is None:
            previous = _registered(self.client)
            self._spare = {"set": self._ipp.start_engines_sync(n=self.config.engines), "previous": previous,
                           "ids": None, "warmed": None}
            logger.info("launched %d spare engines for the next restart", self.config.engines)
        return True

    def warm(self, **changes) -> bool:
        """Non-blocking: once the spare engines have registered, start their slow imports for the config
        `changes` gives (what `restart_engines(**changes)`, or `start()` of a launched cluster, will ask for).
        Call it between cases; True once the imports are on their way."""
        sp = self._spare
        if sp is None or self.client is None:
            return False
        if sp["warmed"] is not None:
            return True
        new = sorted(eid for eid, _ in _registered(self.client) - sp["previous"])
        if len(new) < self.config.engines:
            return False
        from ..engine import dist

        sp["ids"] = new[: self.config.engines]
        sp["warmed"] = self._prepare_args(self.config.replace(**changes) if changes else self.config)
        for eid in sp["ids"]:
            self.client[eid].apply_async(dist.prepare, **dict(sp["warmed"]))
        return True

    def _prepare_args(self, cfg: ClusterConfig | None = None) -> tuple:
        cfg = cfg or self.config
        return (("device", cfg.device), ("extra_path", tuple(cfg.extra_path)), ("env", dict(cfg.env)),
                ("deterministic", cfg.deterministic))

    def _take_spare(self) -> None:
        """Make the spare engine set (launched by launch, prestart or restart_engines) the cluster's engines."""
        sp, self._spare = self._spare, None
        self._engine_set = sp["set"]
        self._attach_engines(previous=sp["previous"])

    def _attach_engines(self, previous: set) -> None:
        """Wait (start timeout) for `engines` new engines to register, (id, uuid) not in `previous`; ranks follow in
        _bring_up, once each engine has said which node it is on.

        An engine is known by (id, uuid), not by id: engines started by mpiexec ask for their MPI rank as id, so a
        restarted engine can get the id of one that the hub has dropped since.
        """
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        next_look = time.monotonic() + 0.5
        while True:
            new = sorted(eid for eid, _ in _registered(self.client) - previous)
            if len(new) >= cfg.engines:  # old ids may linger until the hub's heartbeat drops them: never targeted
                break
            if time.monotonic() > next_look:  # an engine that died before registering: said now, not at the deadline
                next_look = time.monotonic() + 0.5
                ended = diagnosis.ended_engines(self)
                if ended:
                    raise ClusterError(f"{len(ended)} of {cfg.engines} engine process(es) ended before registering "
                                       f"({'; '.join(ended)}), {len(new)} registered; run one by hand to see why: "
                                       f"{sys.executable} -m ipyparallel.engine", kind="died")
            if time.monotonic() > deadline:
                raise ClusterError(f"{len(new)} of {cfg.engines} engines registered within "
                                   f"{cfg.start_timeout_s:.0f} s; raise start_timeout_s, or see why they fail with "
                                   "logging.getLogger('moe_lab.ipyparallel').setLevel('DEBUG')", kind="timeout")
            time.sleep(0.05)
        self.engine_ids = new[: cfg.engines]  # in id order; _place sets rank order and the view

    def _bring_up(self) -> None:
        """On fresh engines: locate them, import torch + megatron-core, rendezvous, process group, parallel_state."""
        from ..engine import dist

        cfg = self.config
        t1 = time.perf_counter()
        stacks = Path(self._profile_dir, "stacks")
        ids = list(self.engine_ids)  # id order until each engine has said where it runs
        procs = self.run(dist.identify, per_rank=lambda i: dict(stack_file=str(stacks / f"engine{ids[i]}.txt")),
                         what="locating the engines", timeout=cfg.start_timeout_s)
        self._place(procs)
        env = dict(cfg.env)
        # The slow imports (torch + megatron-core) first, under the start timeout: engines finish them at
        # different times, and the rendezvous below must not wait that long under timeout_s.
        took = self.run(dist.prepare, device=cfg.device, extra_path=tuple(cfg.extra_path), env=env,
                        deterministic=cfg.deterministic, what="importing torch and megatron-core",
                        timeout=cfg.start_timeout_s)
        self.timings["imports_s"] = max(took)  # ~0 where `warm` had the engines import already
        # Rendezvous on rank 0's host (MASTER_ADDR in env overrides its address, for a host with several networks);
        # rank 0 holds the port from the moment the OS gives it.
        single_host = len({p["node"] for p in self._procs}) == 1
        addr = "127.0.0.1" if single_host else (env.get("MASTER_ADDR") or self._procs[0]["address"])
        port = self._call(0, dist.open_store, world=cfg.engines, timeout_s=cfg.timeout_s, port=self.port,
                          what="opening the rendezvous store")
        self.rendezvous = (addr, port)
        self.info = self.run(dist.setup, per_rank=lambda r: dict(
            rank=r, world=cfg.engines, master_addr=addr, master_port=port, device=cfg.device, tp=cfg.tp,
            timeout_s=cfg.timeout_s, extra_path=tuple(cfg.extra_path), env=env,
            deterministic=cfg.deterministic, local_rank=self._procs[r]["local_rank"],
            local_world=self._procs[r]["local_world"], ranks_per_gpu=cfg.ranks_per_gpu),
            what="init_process_group + parallel_state")
        self.timings["process_group_s"] = time.perf_counter() - t1
        self.health_check()

    def _place(self, procs: list[dict]) -> None:
        """Ranks from where the engines run (`procs[i]` is engine `engine_ids[i]`'s dist.identify): one node's ranks
        contiguous, each engine's local rank (its GPU) its index on its node. Reorders engine_ids, the view and
        the process table into rank order."""
        placed = assign_ranks([(eid, p["node"]) for eid, p in zip(self.engine_ids, procs)],
                              {eid: r for eid, p in zip(self.engine_ids, procs)
                               if (r := launcher_rank(p.get("launcher_env") or {})) is not None})
        by_id = dict(zip(self.engine_ids, procs))
        self.engine_ids = [pl["engine"] for pl in placed]
        self._procs = [dict(by_id[pl["engine"]], **pl) for pl in placed]
        self.view = self.client.direct_view(targets=self.engine_ids)
        self.view.block = True
        nodes = Counter(p["node"] for p in self._procs)
        if len(nodes) > 1:
            logger.info("engines on %d nodes: %s", len(nodes), ", ".join(f"{n} ({k})" for n, k in nodes.items()))

    @property
    def placement(self) -> list[dict]:
        """Per rank: engine id, node, local_rank (its GPU on cuda), local_world (engines on its node), address, pid,
        and `launcher_env` (what the launcher told the process: OMPI_COMM_WORLD_RANK, SLURM_PROCID, ...)."""
        keys = ("rank", "engine", "node", "local_rank", "local_world", "address", "pid", "launcher_env")
        return [{k: p.get(k) for k in keys} for p in self._procs]

    def health_check(self) -> list[dict]:
        from ..engine import dist

        return self.run(dist.health_check, what="health all-reduce")

    def stop(self, graceful: bool = True) -> None:
        """Destroy process groups, stop engines and controller, remove the private profile. Idempotent.

        graceful=False skips the teardown call on the engines (they may be busy or mid-collective) and ends them.
        Whatever happens, no process of this cluster outlives it: leftovers are killed.
        """
        if self.attached:
            return self._detach(graceful)
        t0 = time.perf_counter()
        if graceful and self.client is not None and self.engine_ids:
            self._teardown_engines()
            # Process groups are destroyed: nothing of the engines is needed any more, and ipyparallel's SIGTERM
            # shutdown takes seconds per engine with torch loaded (7 s for 4 CPU engines): end them at once.
            processes.kill_engines(self._profile_dir)
        elif self._profile_dir:
            # Busy engines (mid-collective, or in C code) ignore SIGTERM for ipyparallel's 5 s grace, one by one;
            # their state is lost anyway, so end them at once.
            processes.kill_engines(self._profile_dir)
        self._close_client()
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as e:  # noqa: BLE001
                logger.warning("stopping the ipyparallel cluster failed: %s", e)
        if self._profile_dir:
            left = processes.kill_cluster_processes(self._profile_dir, exclude=(self._reaper.pid,) if self._reaper else ())
            if left:
                logger.info("killed %d leftover process(es) of the cluster: %s", len(left), left)
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        if self._reaper is not None:  # nothing left to watch; wait for it so no zombie stays behind
            self._reaper.terminate()
            self._reaper.wait()
        self._ipp = self.client = self.view = self._reaper = None
        self._spare = self._engine_set = None
        self.engine_ids = []
        self._profile_dir = None
        self.timings["stop_s"] = time.perf_counter() - t0

    @property
    def world(self) -> int:
        return len(self.engine_ids)

    def activate(self, suffix: str = "") -> None:
        """Register %px / %%px magics on this cluster's engines (rank order) in the running IPython."""
        self.view.activate(suffix)

    def _call(self, rank: int, fn: Callable, *args, what: str = "", timeout: float | None = None, **kwargs):
        if self.client is None:
            raise ClusterError("the cluster is not running: use `with Cluster(...) as c:` or call start()")
        ar = self.client[self.engine_ids[rank]].apply_async(fn, *args, **kwargs)
        return self._get([ar], [rank], what or fn.__name__, timeout)[0]

    def run(self, fn: Callable, *args, per_rank: Callable[[int], dict] | None = None, what: str = "",
            timeout: float | None = None, **kwargs) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank at once (plus `per_rank(rank)` kwargs); results in rank order.

        Every call has a timeout (default: the cluster's), so a hung collective or a dead engine ends in a
        ClusterError naming the ranks, never in an endless wait.
        """
        if self.client is None:
            raise ClusterError("the cluster is not running: use `with Cluster(...) as c:` or call start()")
        ars, ranks = [], []
        for rank, eid in enumerate(self.engine_ids):
            kw = dict(kwargs)
            if per_rank is not None:
                kw.update(per_rank(rank))
            ars.append(self.client[eid].apply_async(fn, *args, **kw))
            ranks.append(rank)
        return self._get(ars, ranks, what or getattr(fn, "__name__", str(fn)), timeout)

    def _get(self, ars, ranks, what: str, timeout: float | None):
        # By default a little longer than the process-group timeout, so that ranks stuck in a collective report
        # their own timeout (naming it) before we give up on them.
        timeout = self.config.timeout_s + COLLECTIVE_GRACE_S if timeout is None else timeout
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
                    diagnosis.raise_if_dead(self, what, errors)
                    next_check = now + LIVENESS_EVERY_S
                if errors:
                    if any(not diagnosis.is_collective_error(e) for e in errors.values()):
                        diagnosis.raise_failed(self, what, ranks, errors, pending)  # a plain exception: report it at once
                    # A collective failed: give the other ranks the grace to report the same failure (its victims
                    # are still formatting their own timeout), then name the cause (#16: never a victim).
                    if grace_until is None:
                        grace_until = min(now + COLLECTIVE_GRACE_S, deadline)
                    if not pending or now >= grace_until:
                        diagnosis.raise_collective(self, what, ranks, results, errors, pending, now - t0)
                if not pending:
                    break
                if now > deadline:
                    diagnosis.raise_timeout(self, what, ranks, results, pending, timeout)
                next(iter(pending.values())).wait(0.05)
        except KeyboardInterrupt:
            logger.warning("interrupted during %s: stopping the engines (start the cluster again to go on)", what)
            self.stop(graceful=False)
            raise
        return [results[i] for i in range(len(ars))]

    # ------------------------------------------------------------------ what failure reports read
    @property
    def procs(self) -> list[dict]:
        """Per rank: pid, node, main_thread, stack_file (dist.identify) — what `diagnosis` names a rank by."""
        return self._procs

    def engine_sets(self) -> tuple[list, object]:
        """ipyparallel's engine sets this cluster launched, and the current one (None before start)."""
        es = self._ipp.engines if self._ipp is not None else {}
        return list(es.values()), es.get(self._engine_set) if self._engine_set is not None else None

    def summary(self) -> dict:
        i0 = self.info[0] if self.info else {}
        return {k: i0.get(k) for k in ("device", "gpu", "backend", "world", "tp", "ep", "torch", "megatron_core",
                                          "nccl", "python")}


def prestart_wanted(cfg: ClusterConfig) -> bool:
    """Whether to launch a cluster's next engines while the current ones work (Cluster.prestart, protocol.run):
    local engines on a GPU node, or on a CPU machine with a core for every engine of both sets — on fewer cores the
    early imports would slow the measuring engines. MOE_LAB_PRESTART=1 / 0 forces it on / off."""
    forced = os.environ.get("MOE_LAB_PRESTART", "").strip()
    if forced in ("0", "1"):
        return forced == "1" and cfg.launcher == "local"
    return cfg.launcher == "local" and (cfg.device == "cuda" or (os.cpu_count() or 1) >= 2 * cfg.engines)


def _registered(client, ids=None) -> set[tuple[int, str]]:
    """(engine id, uuid) of the engines registered now (or of `ids`): an id alone can come back (mpiexec engines ask
    for their MPI rank) once the hub has dropped the engine that had it."""
    engines = getattr(client, "_engines", {})
    return {(eid, str(engines.get(eid, ""))) for eid in (client.ids if ids is None else ids)}


def env_pairs(d: dict | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (d or {}).items()))


__all__ = ["Cluster", "ClusterError", "default_config", "env_pairs", "prestart_wanted"]
