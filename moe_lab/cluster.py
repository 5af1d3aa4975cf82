"""Controller side: start ipyparallel engines (one per GPU, or N on CPU), map them to ranks, run, tear down."""

from __future__ import annotations

import logging
import os
import platform
import re
import shutil
import signal
import subprocess
import sys
import tempfile
import time
from collections import Counter
from pathlib import Path
from typing import Any, Callable

from .config import ClusterConfig

logger = logging.getLogger(__name__)

PROFILE_PREFIX = "moe_lab_ipp_"
SHARED_PROFILE_ROOT = "~/.moe_lab/ipp"  # default for launchers that start engines elsewhere: home is shared on clusters
LIVENESS_EVERY_S = 0.5  # how often a waiting call checks that every engine process still exists (#7)
COLLECTIVE_GRACE_S = 3.0  # after one rank's collective fails, how long to wait for the others' answers; and
# how much longer than the process-group timeout a call waits by default


class ClusterError(RuntimeError):
    """An engine failed, died or timed out; the message names the rank(s) and what they were doing.

    `kind` is one of 'failed' (an exception on a rank), 'died' (an engine process is gone), 'collective' (a
    collective failed or hung: `ranks` did not join it), 'timeout' (ranks did not answer in time).
    """

    def __init__(self, message: str, *, kind: str = "failed", ranks: list[int] | None = None, stopped: bool = False):
        super().__init__(message)
        self.kind, self.ranks, self.stopped = kind, list(ranks or []), stopped


def visible_gpus() -> int:
    """GPUs torch can see from the controller (0 without CUDA). Imports torch lazily."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_config(device: str | None = None, engines: int | None = None, **kw) -> ClusterConfig:
    """One engine per visible GPU on cuda; 4 CPU engines otherwise. Refuses more engines than GPUs.

    With a launcher other than 'local' the engines run elsewhere and this machine cannot count their GPUs, so
    device and engines must be given; each node then checks its own GPUs when its engines join (dist.setup).
    """
    if kw.get("launcher", "local") != "local":
        if device is None or not engines:
            raise ValueError(f"launcher ({kw['launcher']!r}) starts engines on other machines: give device "
                             f"({device!r}) and engines ({engines!r}) explicitly, e.g. device='cuda', engines=16")
        return ClusterConfig(device=device, engines=engines, **kw)
    n_gpu = visible_gpus() if device in (None, "cuda") else 0
    if device is None:
        device = "cuda" if n_gpu else "cpu"
    if device == "cuda":
        if n_gpu == 0:
            raise ValueError("device ('cuda') needs a GPU, but torch sees none; use device='cpu'")
        engines = engines or n_gpu
        if engines > n_gpu:
            raise ValueError(f"engines ({engines}) must be <= visible GPUs ({n_gpu}): one engine per GPU")
    else:
        engines = engines or 4
    return ClusterConfig(device=device, engines=engines, **kw)


class Cluster:
    """A warm MoE lab: `engines` ipyparallel engines, each one torch.distributed rank with parallel_state set.

    with Cluster(ClusterConfig(engines=4)) as c:
        c.run(moe_lab.measure.run_case, cfg.asdict())   # → one result per rank, in rank order

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
        self._reaper: subprocess.Popen | None = None

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
        import ipyparallel as ipp

        if self.client is not None:
            return self
        cfg = self.config
        settings = launcher_settings(cfg)  # a bad launcher option is refused before anything starts
        t0 = time.perf_counter()
        self.info, self.timings, self._procs, self.rendezvous = [], {}, [], None
        # A private profile per cluster: two notebooks (or users) never share connection files or ports.
        self._profile_dir = tempfile.mkdtemp(prefix=PROFILE_PREFIX, dir=profile_parent(cfg))
        try:
            self._start_reaper()
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
            self._attach_engines(previous=set())
            self.timings["engines_s"] = time.perf_counter() - t0
            self._bring_up()
            self.timings["ready_s"] = time.perf_counter() - t0
            logger.info("cluster ready in %.1f s: %s", self.timings["ready_s"], self.summary())
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    def restart_engines(self, **changes) -> "Cluster":
        """New engines under the same controller and client, with `changes` applied to the config (the fields the
        engines read at start: extra_path, deterministic, env, timeout_s, tp). The way to switch megatron-core
        release: a process imports it once, so only the engines go; the controller, its profile and the watchdog
        stay. Not running yet: plain start() with the new config. Timings: restart_s (+ engines_s, ready_s).
        """
        fixed = {k: v for k, v in changes.items() if k in ("engines", "device") and v != getattr(self.config, k)}
        if fixed and self.client is not None:
            raise ValueError(f"restart_engines cannot change {sorted(fixed)} (the engine set and its devices): "
                             "stop() the cluster and start one with the new config")
        if changes:
            self.config = self.config.replace(**changes)
        if self.client is None:
            return self.start()
        t0 = time.perf_counter()
        old = _registered(self.client, self.engine_ids)
        self._teardown_engines()
        try:
            # Process groups are torn down: end the engines at once (SIGTERM costs seconds per engine with torch
            # loaded), then let ipyparallel reap them and forget their engine set.
            self._kill_engines()
            self._ipp.stop_engines_sync()
            self.info, self._procs, self.rendezvous, self.engine_ids, self.view = [], [], None, [], None
            logger.info("restarting %d %s engines%s", self.config.engines, self.config.device,
                        f" with {self.config.extra_path[0]} first on their path" if self.config.extra_path else "")
            # Killed engines stay registered until the hub's heartbeat drops them: every engine known now is old.
            old |= _registered(self.client)
            self._ipp.start_engines_sync(n=self.config.engines)
            self._attach_engines(previous=old)
            self.timings["engines_s"] = time.perf_counter() - t0
            self._bring_up()
        except BaseException:
            self.stop(graceful=False)
            raise
        self.timings["restart_s"] = self.timings["ready_s"] = time.perf_counter() - t0
        logger.info("engines restarted in %.1f s: %s", self.timings["restart_s"], self.summary())
        return self

    def _teardown_engines(self) -> None:
        """dist.teardown on every engine still registered (process groups destroyed cleanly); never raises."""
        from . import dist

        try:
            alive = [e for e in self.engine_ids if e in set(self.client.ids)]
            for ar in [self.client[e].apply_async(dist.teardown) for e in alive]:
                ar.get(timeout=min(10.0, self.config.timeout_s))
        except Exception as e:  # noqa: BLE001 - the engines are stopped next whatever happened here
            logger.warning("teardown on engines did not finish cleanly (%s); stopping them anyway", e)

    def _kill_engines(self) -> None:
        """SIGKILL every engine process of this cluster's profile (their state is lost anyway)."""
        for p in (p for p in cluster_processes(self._profile_dir) if _is_engine(p)):
            try:
                p.kill()
            except Exception:  # noqa: BLE001 - already gone
                pass

    def _attach_engines(self, previous: set) -> None:
        """Wait (start timeout) for `engines` new engines to register, (id, uuid) not in `previous`; ranks follow in
        _bring_up, once each engine has said which node it is on.

        An engine is known by (id, uuid), not by id: engines started by mpiexec ask for their MPI rank as id, so a
        restarted engine can get the id of one that the hub has dropped since.
        """
        cfg = self.config
        deadline = time.monotonic() + cfg.start_timeout_s
        while True:
            new = sorted(eid for eid, _ in _registered(self.client) - previous)
            if len(new) >= cfg.engines:  # old ids may linger until the hub's heartbeat drops them: never targeted
                break
            if time.monotonic() > deadline:
                raise ClusterError(f"{len(new)} of {cfg.engines} engines registered within "
                                   f"{cfg.start_timeout_s:.0f} s; raise start_timeout_s, or see why they fail with "
                                   "logging.getLogger('moe_lab.ipyparallel').setLevel('DEBUG')", kind="timeout")
            time.sleep(0.05)
        self.engine_ids = new[: cfg.engines]  # in id order; _place sets rank order and the view

    def _bring_up(self) -> None:
        """On fresh engines: locate them, import torch + megatron-core, rendezvous, process group, parallel_state."""
        from . import dist

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
        self.run(dist.prepare, device=cfg.device, extra_path=tuple(cfg.extra_path), env=env,
                 deterministic=cfg.deterministic, what="importing torch and megatron-core",
                 timeout=cfg.start_timeout_s)
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
            local_world=self._procs[r]["local_world"]), what="init_process_group + parallel_state")
        self.timings["process_group_s"] = time.perf_counter() - t1
        self.health_check()

    def _place(self, procs: list[dict]) -> None:
        """Ranks from where the engines run (`procs[i]` is engine `engine_ids[i]`'s dist.identify): one node's ranks
        contiguous, each engine's local rank (its GPU) its index on its node. Reorders engine_ids, the view and
        the process table into rank order."""
        placed = assign_ranks([(eid, p["node"]) for eid, p in zip(self.engine_ids, procs)],
                              {eid: r for eid, p in zip(self.engine_ids, procs)
                               if (r := _launcher_rank(p.get("launcher_env") or {})) is not None})
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
        from . import dist

        return self.run(dist.health_check, what="health all-reduce")

    def stop(self, graceful: bool = True) -> None:
        """Destroy process groups, stop engines and controller, remove the private profile. Idempotent.

        graceful=False skips the teardown call on the engines (they may be busy or mid-collective) and ends them.
        Whatever happens, no process of this cluster outlives it: leftovers are killed.
        """
        t0 = time.perf_counter()
        if graceful and self.client is not None and self.engine_ids:
            self._teardown_engines()
        elif self._profile_dir:
            # Busy engines (mid-collective, or in C code) ignore SIGTERM for ipyparallel's 5 s grace, one by one;
            # their state is lost anyway, so end them at once.
            self._kill_engines()
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001
                pass
        if self._ipp is not None:
            try:
                self._ipp.stop_cluster_sync()
            except Exception as e:  # noqa: BLE001
                logger.warning("stopping the ipyparallel cluster failed: %s", e)
        if self._profile_dir:
            left = kill_cluster_processes(self._profile_dir, exclude=(self._reaper.pid,) if self._reaper else ())
            if left:
                logger.info("killed %d leftover process(es) of the cluster: %s", len(left), left)
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        if self._reaper is not None:  # nothing left to watch; wait for it so no zombie stays behind
            self._reaper.terminate()
            self._reaper.wait()
        self._ipp = self.client = self.view = self._reaper = None
        self.engine_ids = []
        self._profile_dir = None
        self.timings["stop_s"] = time.perf_counter() - t0

    def _start_reaper(self) -> None:
        # A watchdog process outside our session: if this process dies without stop() (SIGKILL, SIGTERM, a dead
        # kernel), it ends the controller and engines, which ipyparallel starts in sessions of their own.
        code = ("import sys; sys.path.insert(0, sys.argv[3]); from moe_lab.cluster import _reap; "
                "_reap(int(sys.argv[1]), sys.argv[2])")
        pkg_parent = str(Path(__file__).resolve().parents[1])
        self._reaper = subprocess.Popen([sys.executable, "-c", code, str(os.getpid()), self._profile_dir, pkg_parent],
                                        stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL,
                                        stderr=subprocess.DEVNULL, start_new_session=True)

    # ------------------------------------------------------------------ calls
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
                    self._raise_if_dead(what, errors)
                    next_check = now + LIVENESS_EVERY_S
                if errors:
                    coll = {i: e for i, e in errors.items() if _is_collective_error(e)}
                    if len(coll) < len(errors):  # a plain exception: report it at once
                        self._raise_failed(what, ranks, errors, pending)
                    if grace_until is None:
                        grace_until = min(now + COLLECTIVE_GRACE_S, deadline)
                        if not any(c for c, _ in self._where([ranks[i] for i in pending]).values()):
                            grace_until = now  # nobody else is in a collective: no answer is coming
                    if not pending or now >= grace_until:
                        self._raise_collective(what, ranks, results, errors, pending, now - t0)
                if not pending:
                    break
                if now > deadline:
                    self._raise_timeout(what, ranks, results, pending, timeout)
                next(iter(pending.values())).wait(0.05)
        except KeyboardInterrupt:
            logger.warning("interrupted during %s: stopping the engines (start the cluster again to go on)", what)
            self.stop(graceful=False)
            raise
        return [results[i] for i in range(len(ars))]

    # ------------------------------------------------------------------ failure reports
    def _dead_ranks(self) -> dict[int, str]:
        """rank → how its engine ended, for every engine whose process is gone (or that left the controller)."""
        dead = {}
        here = platform.node()
        try:
            registered = set(self.client.ids) if self.client is not None else set()
        except Exception:  # noqa: BLE001 - a closed client: pids below still tell
            registered = set(self.engine_ids)
        for rank, eid in enumerate(self.engine_ids):
            proc = self._procs[rank] if rank < len(self._procs) else None
            if proc and proc["node"] == here:
                how = _pid_gone(proc["pid"])
                if how is not None:
                    dead[rank] = self._exit_status(proc["pid"]) or how
                    continue
            if eid not in registered:
                dead[rank] = "unregistered from the controller"
        return dead

    def _exit_status(self, pid: int) -> str:
        """'exit code N' / 'killed by SIGKILL' for an engine this process started (ipyparallel waits on it)."""
        for es in (self._ipp.engines.values() if self._ipp is not None else ()):
            for launcher in list(getattr(es, "launchers", {}).values()):
                proc = getattr(launcher, "process", None)
                if proc is None or proc.pid != pid:
                    continue
                # ipyparallel's launcher thread reaps its engines and psutil caches the code; when the check here
                # races that thread (zombie not yet reaped, or reaped under us), give it a moment, then retry.
                deadline = time.monotonic() + 2.0
                while True:
                    try:
                        code = proc.wait(timeout=0)
                    except Exception:  # noqa: BLE001 - still exiting, or being reaped by the launcher thread
                        code = getattr(proc, "returncode", None)
                    if code is not None or time.monotonic() > deadline:
                        return _describe_exit(code) if code is not None else ""
                    time.sleep(0.05)
        return ""

    def _raise_if_dead(self, what: str, errors: dict) -> None:
        from ipyparallel.error import EngineError

        dead = self._dead_ranks()
        if not dead and not any(isinstance(e, EngineError) for e in errors.values()):
            return
        if not dead:  # the hub saw it die before we did
            dead = {r: "the controller lost it" for r, eid in enumerate(self.engine_ids)
                    if any(isinstance(e, EngineError) and str(eid) in str(e) for e in errors.values())}
        parts = []
        for rank, how in sorted(dead.items()):
            pid = self._procs[rank]["pid"] if rank < len(self._procs) else "?"
            parts.append(f"rank {rank} (engine {self.engine_ids[rank]}, pid {pid}) died during {what} ({how})")
        self.stop(graceful=False)
        raise ClusterError("; ".join(parts) + "; the other engines were stopped: start the cluster again",
                           kind="died", ranks=sorted(dead), stopped=True)

    def _raise_failed(self, what, ranks, errors, pending) -> None:
        i = min(i for i, e in errors.items() if not _is_collective_error(e))
        msg = f"rank {ranks[i]} (engine {self.engine_ids[ranks[i]]}) failed in {what}: {_remote_message(errors[i])}"
        where = self._where([ranks[j] for j in pending])
        waiting = sorted(r for r, (c, _) in where.items() if c)
        if not waiting:
            raise ClusterError(msg, kind="failed", ranks=[ranks[i]]) from errors[i]
        # The others wait for it in a collective that can only time out and break the process group.
        msg += (f"; rank(s) {waiting} are {where[waiting[0]][1]} for it, which can only time out: the engines were "
                "stopped, start the cluster again")
        self.stop(graceful=False)
        raise ClusterError(msg, kind="failed", ranks=[ranks[i]], stopped=True) from errors[i]

    def _raise_collective(self, what, ranks, results, errors, pending, elapsed) -> None:
        failed = sorted(ranks[i] for i in errors)
        first = errors[min(errors)]
        coll, caller = _collective_of(_remote_frames(first))
        where = self._where([ranks[i] for i in pending])
        missing = [r for i, r in enumerate(ranks) if i not in errors]
        notes = []
        for r in missing:
            i = ranks.index(r)
            if i in results:
                notes.append(f"rank {r} returned without calling it")
            else:
                notes.append(f"rank {r} is still busy {where[r][1] if r in where else 'elsewhere'}")
        msg = (f"{what}: collective {coll or '(unknown)'}{f' in {caller}' if caller else ''} failed on rank(s) "
               f"{failed} after {elapsed:.1f} s ({_remote_message(first)})")
        if missing:
            msg += f"; rank(s) {missing} did not join it ({'; '.join(notes)})"
        msg += ". The process group is broken: the engines were stopped, start the cluster again"
        self.stop(graceful=False)
        raise ClusterError(msg, kind="collective", ranks=missing, stopped=True) from first

    def _raise_timeout(self, what, ranks, results, pending, timeout) -> None:
        waiting = sorted(ranks[i] for i in pending)
        where = self._where(waiting)
        msg = f"{what}: rank(s) {waiting} did not answer within {timeout:.0f} s"
        in_coll = [r for r in waiting if r in where and where[r][0]]
        if where:
            msg += " (" + "; ".join(f"rank {r} is {where[r][1]}" for r in waiting if r in where) + ")"
        if in_coll:
            absent = [r for r in ranks if r not in in_coll]
            msg += (f"; hung collective {where[in_coll[0]][0]}: rank(s) {absent} did not join it. The engines were "
                    "stopped, start the cluster again")
            self.stop(graceful=False)
            raise ClusterError(msg, kind="collective", ranks=absent, stopped=True)
        msg += "; they keep running and later calls wait behind them: stop the cluster and start it again if they hang"
        raise ClusterError(msg, kind="timeout", ranks=waiting)

    def _where(self, ranks: list[int], wait_s: float = 1.0) -> dict[int, tuple[str | None, str]]:
        """rank → (collective or None, 'waiting in <collective> (<caller>)' or 'in <function> at <file:line>'), from a
        SIGUSR1 stack dump of each engine on this host (dist.identify registers the handler)."""
        here = platform.node()
        todo = {}
        for r in ranks:
            p = self._procs[r] if r < len(self._procs) else None
            if not p or p["node"] != here or not p.get("stack_file"):
                continue
            try:
                size = os.path.getsize(p["stack_file"])
                os.kill(p["pid"], signal.SIGUSR1)
                todo[r] = (p, size)
            except OSError:
                continue
        out = {}
        deadline = time.monotonic() + wait_s
        seen = {r: -1 for r in todo}
        while todo and time.monotonic() < deadline:
            time.sleep(0.03)
            for r, (p, size) in list(todo.items()):
                try:
                    now_size = os.path.getsize(p["stack_file"])
                except OSError:
                    continue
                if now_size == size or now_size != seen[r]:  # nothing yet, or still being written
                    seen[r] = now_size
                    continue
                with open(p["stack_file"]) as f:
                    f.seek(size)
                    frames = _dump_frames(f.read(), p["main_thread"])
                if frames is None:
                    continue
                coll, caller = _collective_of(frames)
                if coll:
                    out[r] = (coll, f"waiting in {coll}" + (f" ({caller})" if caller else ""))
                else:
                    out[r] = (None, f"in {_innermost(frames)}")
                del todo[r]
        return out

    def summary(self) -> dict:
        i0 = self.info[0] if self.info else {}
        return {k: i0.get(k) for k in ("device", "gpu", "backend", "world", "tp", "ep", "torch", "megatron_core",
                                          "nccl", "python")}


# ---------------------------------------------------------------------- helpers (pure, or processes by profile)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")
_COLLECTIVE_PATTERNS = re.compile(
    r"Timed out waiting|pair closure|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"DistBackendError|DistNetworkError|NCCL|collective operation timeout|Socket Timeout", re.I)


def _remote_message(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    evalue = getattr(e, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(e).__name__}: {e}"


def _is_collective_error(e: BaseException) -> bool:
    return bool(_COLLECTIVE_PATTERNS.search(_remote_message(e)))


def _remote_frames(e: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of a remote traceback, outermost first (IPython's or Python's format)."""
    tb = _ANSI.sub("", getattr(e, "traceback", None) or "")
    frames = []
    for m in re.finditer(r'File "?([^",\n]+?)"?(?::(\d+)|, line (\d+)),? in (\w[\w.<>]*)', tb):
        frames.append((m.group(1), int(m.group(2) or m.group(3)), m.group(4)))
    return frames


def _dump_frames(text: str, main_thread: int) -> list[tuple[str, int, str]] | None:
    """The main thread's frames from a faulthandler dump, outermost first; None until the dump is complete."""
    want = f"0x{main_thread:016x}"
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if want in line and ("Thread" in line or "thread" in line):
            frames = []
            for fl in lines[k + 1:]:
                m = re.match(r'\s+File "([^"]+)", line (\d+) in (\S+)', fl)
                if not m:
                    break
                frames.append((m.group(1), int(m.group(2)), m.group(3)))
            return frames[::-1]  # faulthandler lists the most recent call first
    return None


def _collective_of(frames: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    """The outermost torch.distributed call in `frames` (outermost first) and the frame that made it."""
    for k, (file, _, fn) in enumerate(frames):
        if "torch/distributed/" in file.replace("\\", "/") and file.endswith("distributed_c10d.py"):
            caller = next(((f, ln, name) for f, ln, name in reversed(frames[:k])
                           if "torch/distributed/" not in f.replace("\\", "/")), None)
            return fn, (f"{caller[2]} at {os.path.basename(caller[0])}:{caller[1]}" if caller else None)
    return None, None


_PLUMBING = ("/ipyparallel/", "/ipykernel/", "/tornado/", "/asyncio/", "/traitlets/", "<string>", "<frozen")


def _innermost(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame (not the engine's own plumbing), and the innermost of our own code (moe_lab) under it."""
    frames = [f for f in frames if not any(s in f[0].replace("\\", "/") for s in _PLUMBING)]
    if not frames:
        return "native code called directly (no Python frame of its own)"
    ours = [f for f in frames if "/moe_lab/" in f[0].replace("\\", "/")]

    def name(f):
        return f"{f[2]} at {os.path.basename(f[0])}:{f[1]}"

    if ours and ours[-1] != frames[-1]:
        return f"{name(frames[-1])} (called from {name(ours[-1])})"
    return name(frames[-1])


def _is_engine(p) -> bool:
    return any("ipyparallel.engine" in a for a in p.info.get("cmdline") or ())


def _pid_gone(pid: int) -> str | None:
    """None while `pid` runs; otherwise how it ended, as far as this process can tell."""
    import psutil

    try:
        if psutil.Process(pid).status() == psutil.STATUS_ZOMBIE:
            return "process exited"
        return None
    except psutil.NoSuchProcess:
        return "process gone"
    except psutil.Error:
        return None


def _describe_exit(code) -> str:
    if isinstance(code, int) and code < 0:
        try:
            return f"killed by {signal.Signals(-code).name}"
        except ValueError:
            return f"killed by signal {-code}"
    return f"exit code {code}"


def cluster_processes(profile_dir: str, exclude: tuple[int, ...] = ()) -> list:
    """psutil processes of the cluster at `profile_dir`: controller, schedulers, engines and their nannies (ipyparallel
    gives them IPP_PROFILE_DIR) and the watchdog (the path is on its command line). Zombies are left out."""
    import psutil

    out = []
    me = os.getpid()
    for p in psutil.process_iter(["pid", "cmdline"]):
        if p.info["pid"] in (me, *exclude):
            continue
        try:
            ours = any(profile_dir in arg for arg in p.info["cmdline"] or ())
            if not ours and any("ipyparallel" in a for a in p.info["cmdline"] or ()):
                ours = p.environ().get("IPP_PROFILE_DIR") == profile_dir
            if ours and p.status() != psutil.STATUS_ZOMBIE:
                out.append(p)
        except psutil.Error:  # gone, or another user's process
            continue
    return out


def kill_cluster_processes(profile_dir: str, exclude: tuple[int, ...] = (), term_wait_s: float = 3.0) -> list[int]:
    """SIGTERM, then SIGKILL, every process of the cluster at `profile_dir`; returns the pids that were found."""
    import psutil

    procs = cluster_processes(profile_dir, exclude)
    for p in procs:
        try:  # engines only hold lost state, and a busy one ignores SIGTERM for seconds: kill them outright
            p.kill() if _is_engine(p) else p.terminate()
        except psutil.Error:
            pass
    _, alive = psutil.wait_procs(procs, timeout=term_wait_s)
    for p in alive:
        try:
            p.kill()
        except psutil.Error:
            pass
    psutil.wait_procs(alive, timeout=2)
    return [p.pid for p in procs]


def _reap(owner_pid: int, profile_dir: str, poll_s: float = 0.5) -> None:
    """The cluster's watchdog (its own process): once the owner is gone without having stopped the cluster,
    end its controller and engines and remove the profile. Exits as soon as the profile is removed."""
    import psutil

    try:
        owner = psutil.Process(owner_pid)
    except psutil.NoSuchProcess:
        owner = None
    while os.path.isdir(profile_dir):
        try:
            if owner is None or not owner.is_running() or owner.status() == psutil.STATUS_ZOMBIE:
                break
        except psutil.NoSuchProcess:
            break
        time.sleep(poll_s)
    else:
        return
    kill_cluster_processes(profile_dir)
    shutil.rmtree(profile_dir, ignore_errors=True)


def assign_ranks(engines: list[tuple[int, str]], launcher_ranks: dict[int, int] | None = None) -> list[dict]:
    """Rank order for engines given as (engine id, node): the ranks of one node are contiguous, the node of the first
    engine comes first (so that engine is rank 0, as on one machine), the other nodes by name, and engines keep their
    order within a node. local_rank is the engine's index on its node (its GPU there), local_world the engines on
    that node.

    "Order" is the engine id, or the rank the launcher gave each process (`launcher_ranks`: engine id → MPI rank or
    SLURM_PROCID) when every engine has a distinct one: ids follow registration, and an engine that asks for its MPI
    rank as id gets another one while the hub still holds an engine of that id (after a restart).
    """
    if not engines:
        return []
    lr = launcher_ranks or {}
    use_lr = len({lr.get(eid) for eid, _ in engines} - {None}) == len(engines)

    def order(e):
        return (lr[e[0]], e[0]) if use_lr else (e[0],)

    first = min(engines, key=order)[1]
    counts = Counter(node for _, node in engines)
    seen: Counter = Counter()
    placed = []
    for rank, (eid, node) in enumerate(sorted(engines, key=lambda e: (e[1] != first, e[1], order(e)))):
        placed.append(dict(rank=rank, engine=eid, node=node, local_rank=seen[node], local_world=counts[node]))
        seen[node] += 1
    return placed


def _launcher_rank(env: dict) -> int | None:
    """The rank mpiexec (Open MPI, PMIx, MPICH/PMI) or srun gave a process, from dist.launcher_env; None if none."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if str(env.get(key, "")).isdigit():
            return int(env[key])
    return None


def _registered(client, ids=None) -> set[tuple[int, str]]:
    """(engine id, uuid) of the engines registered now (or of `ids`): an id alone can come back (mpiexec engines ask
    for their MPI rank) once the hub has dropped the engine that had it."""
    engines = getattr(client, "_engines", {})
    return {(eid, str(engines.get(eid, ""))) for eid in (client.ids if ids is None else ids)}


def profile_parent(cfg: ClusterConfig) -> str | None:
    """Directory for the private profile: cfg.profile_root, else the temp dir on one machine and ~/.moe_lab/ipp
    for launchers whose engines run elsewhere (a Slurm node's /tmp is its own; home is shared)."""
    if not cfg.profile_root and cfg.launcher == "local":
        return None
    root = os.path.expanduser(cfg.profile_root or SHARED_PROFILE_ROOT)
    os.makedirs(root, exist_ok=True)
    return root


_LAUNCHER_COMMAND = {"mpi": ("mpi_cmd", "install Open MPI or MPICH (e.g. apt-get install openmpi-bin) or set "
                                        "launcher_options['mpi_cmd']"),
                     "slurm": ("submit_command", "run on a Slurm login node, or set launcher_options['submit_command']"),
                     "ssh": ("ssh_cmd", "install an ssh client, or set launcher_options['ssh_cmd']")}


def launcher_settings(cfg: ClusterConfig) -> dict:
    """Keyword arguments of ipyparallel's Cluster for cfg.launcher: engines=<launcher>, a traitlets Config from
    launcher_options, and, for engines on other hosts, a controller listening on every interface.

    Each option is checked against the traits of the class it names (traitlets would ignore a misspelt name), and
    the launcher's command (mpiexec, sbatch, ssh) must be on PATH: bad input fails here, before anything starts.
    """
    from ipyparallel.cluster import launcher as ipl
    from traitlets.config import Config

    engine_cls = ipl.find_launcher_class(cfg.launcher, "engine")
    conf = Config()
    for key, value in cfg.launcher_options.items():
        cls_name, _, trait = key.rpartition(".")
        cls = _ipp_class(cls_name, key) if cls_name else engine_cls
        traits = cls.class_traits(config=True)
        if trait not in traits:
            raise ValueError(f"launcher_options[{key!r}]: {cls.__name__} has no setting {trait!r}; "
                             f"its settings are {', '.join(sorted(traits))}")
        conf[cls.__name__][trait] = value
    mine = conf[engine_cls.__name__] if engine_cls.__name__ in conf else {}
    if cfg.launcher in _LAUNCHER_COMMAND:
        trait, fix = _LAUNCHER_COMMAND[cfg.launcher]
        cmd = mine.get(trait) or engine_cls.class_traits()[trait].default()
        if not shutil.which(cmd[0]):
            raise ValueError(f"launcher ({cfg.launcher!r}) runs {cmd[0]!r}, which is not on PATH: {fix}")
    if cfg.launcher == "mpi":
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError("launcher ('mpi') starts `ipengine --mpi`, which imports mpi4py: "
                             f"{sys.executable} -m pip install mpi4py")
    if cfg.launcher == "ssh":
        _check_ssh_hosts(mine.get("engines"), cfg.engines)
    kwargs: dict = dict(engines=cfg.launcher, config=conf)
    if cfg.launcher != "local" and not ("Cluster" in conf and "controller_ip" in conf["Cluster"]):
        kwargs["controller_ip"] = "*"  # engines on other hosts connect to it; the key in the profile signs messages
    return kwargs


def _ipp_class(name: str, key: str):
    import ipyparallel as ipp
    from ipyparallel.cluster import launcher as ipl

    cls = ipp.Cluster if name == "Cluster" else getattr(ipl, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "class_traits"):
        raise ValueError(f"launcher_options[{key!r}]: {name!r} is neither ipyparallel's Cluster nor one of its "
                         "launcher classes (e.g. 'Cluster.controller_ip', 'MPILauncher.mpi_args')")
    return cls


def _check_ssh_hosts(hosts, engines: int) -> None:
    """ipyparallel's ssh launcher starts engines only where launcher_options['engines'] puts them."""
    if not isinstance(hosts, dict) or not hosts:
        raise ValueError("launcher ('ssh') needs launcher_options['engines'] = {host: engines on it}, "
                         "e.g. {'gpu-a': 8, 'gpu-b': 8}")
    placed = 0
    for host, n in hosts.items():
        n = n.get("n", 1) if isinstance(n, dict) else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"launcher_options['engines'][{host!r}] ({n!r}) must be a positive number of engines")
        placed += n
    if placed != engines:
        raise ValueError(f"launcher_options['engines'] places {placed} engines on {len(hosts)} host(s), "
                         f"but engines is {engines}: make them equal")


def env_pairs(d: dict | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (d or {}).items()))


__all__ = ["Cluster", "ClusterError", "default_config", "visible_gpus", "env_pairs", "cluster_processes",
           "kill_cluster_processes", "assign_ranks", "launcher_settings"]
