"""Controller side: a warm MoE lab — ipyparallel engines, one torch.distributed rank each — started, called with a
timeout on every call, restarted (another megatron-core release), and torn down. Where the engines go is
`placement`, how they are launched `launchers`, why a call failed `diagnosis`, their OS processes `processes`; the
calls themselves are `calls`, bringing fresh engines up `bring_up`, the next engine set `spares`, a restart
`restart`, and a client of another process's cluster `attached` — functions of the cluster's state (`state.
ClusterState`), which the Cluster owns and composes them on. Imports run one way: this module imports the parts,
they import `state`, never this module."""

from __future__ import annotations

import logging
import os
import shutil
import tempfile
import time
from typing import Any, Callable

from .. import bytecode
from ..config import ClusterConfig
from . import attached, bring_up, calls, processes, restart, spares
from .diagnosis import ClusterError
from .launchers import check_devices, controller_settings, launcher_settings, profile_parent
from .placement import default_config, visible_gpus
from .state import ClusterState

logger = logging.getLogger(__name__)

PROFILE_PREFIX = "moe_lab_ipp_"


def _shared(name: str, doc: str = "") -> property:
    """A field of the cluster's state, read and written through the Cluster (c.client, c.config, ...)."""
    return property(lambda self: getattr(self.state, name), lambda self, v: setattr(self.state, name, v), doc=doc)


class Cluster:
    """A warm MoE lab: `engines` ipyparallel engines, each one torch.distributed rank with parallel_state set.

    with Cluster(ClusterConfig(engines=4)) as c:
        c.run(fn, *args)   # fn runs on every rank at once → one result per rank, in rank order

    Every call watches the engine processes: a dead engine, a hung collective or Ctrl-C ends in a ClusterError
    (or the KeyboardInterrupt) with the engines stopped, and `start()` brings the cluster back.
    Its state (`state`, a ClusterState) is what the parts of the controller work on.
    """

    config = _shared("config")
    client = _shared("client")
    view = _shared("view")
    engine_ids = _shared("engine_ids", "engine_ids[rank] is the ipyparallel id of that rank's engine")
    info = _shared("info")
    timings = _shared("timings")
    rendezvous = _shared("rendezvous", "(address, port) of the process group's TCPStore")
    port = _shared("port", "preferred rendezvous port; 0 (or a busy one) lets the OS pick a free one")
    attached = _shared("attached", "a client of a run's shared cluster (controller.shared): stop() detaches")

    def __init__(self, config: ClusterConfig | None = None, **kw):
        self.state = ClusterState(config or default_config(**kw))

    @property
    def profile_dir(self) -> str | None:
        """The private ipyparallel profile of this cluster; its processes carry it as IPP_PROFILE_DIR."""
        return self.state.profile_dir

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, exc_type, exc, tb) -> None:
        # After Ctrl-C or an engine failure the engines may be mid-collective: don't wait on them.
        self.stop(graceful=exc_type is None or not issubclass(exc_type, (KeyboardInterrupt, ClusterError)))

    def start(self) -> "Cluster":
        st = self.state
        if st.client is not None and st.engine_ids:
            return self
        t0 = time.perf_counter()
        try:
            if st.client is None:
                self.launch()
            else:  # launched early (protocol: the next group's cluster): its engines may have registered already
                t0 = st.launched_at
            bring_up.take_spare(st)
            st.timings["engines_s"] = time.perf_counter() - t0
            bring_up.bring_up(st)
            st.timings["ready_s"] = time.perf_counter() - t0
            logger.info("cluster ready in %.1f s (engines registered %.1f s, imports + process group %.1f s): %s",
                        st.timings["ready_s"], st.timings["engines_s"], st.timings["process_group_s"],
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

        from . import preloaded

        st = self.state
        if st.client is not None:
            return self
        cfg = st.config
        if cfg.device == "cuda" and cfg.launcher == "local":  # more ranks than GPUs: refused with the fix, first
            check_devices(cfg, visible_gpus())
        settings = launcher_settings(cfg)  # a bad launcher option is refused before anything starts
        bytecode.use_for_started_processes()  # where every process would compile torch's imports again
        st.launched_at = time.perf_counter()
        st.info, st.timings, st.procs, st.rendezvous = [], {}, [], None
        # A private profile per cluster: two notebooks (or users) never share connection files or ports.
        st.profile_dir = tempfile.mkdtemp(prefix=PROFILE_PREFIX, dir=profile_parent(cfg))
        try:
            st.reaper = processes.start_watchdog(os.getpid(), st.profile_dir)
            # ipyparallel logs to the notebook's stdout by default, engine output included when they are
            # stopped by signal; route it to our logger (quiet unless debugging) so reports stay readable.
            ipp_log = logging.getLogger("moe_lab.ipyparallel")
            if ipp_log.level == logging.NOTSET:
                ipp_log.setLevel(logging.ERROR)
            # Engines forked from a preload server (its imports made once, while the controller starts), where
            # that applies; else each engine a process of its own.
            server = preloaded.server_for(st, cfg)
            if server is not None:
                settings = dict(settings, engines=preloaded.PreloadedEngineSetLauncher)
            st.ipp = ipp.Cluster(n=cfg.engines, profile_dir=st.profile_dir, log=ipp_log,
                                 engine_timeout=int(cfg.start_timeout_s), delay=0.1,
                                 **controller_settings(settings, cfg))
            logger.info("starting %d %s engines (launcher %s%s)", cfg.engines, cfg.device, cfg.launcher,
                        ", forked from a preload server" if server is not None else "")
            st.ipp.start_controller_sync()
            # the engines are forked once the server's imports are done: now if they are, else between the
            # current group's cases (`warm`) or when `start()` needs them — launching never waits for them
            st.spare = spares.spare(None, previous=set(), launch=preloaded.engine_kwargs(st, cfg))
            spares.launch_deferred(st, block=False)
            st.client = st.ipp.connect_client_sync()
        except BaseException:
            self.stop(graceful=False)
            raise
        return self

    # ------------------------------------------------------------------ a run's shared cluster (controller.shared)
    def handle(self) -> dict:
        """What a client in another process needs to attach to this cluster (`connect`): controller, engines, ranks."""
        return attached.handle(self.state)

    @classmethod
    def connect(cls, config: ClusterConfig, handle: dict, *, timeout: float) -> "Cluster":
        """A client of a running cluster of another process (its `handle()` plus `client_file`): the same controller,
        engines, process group and parallel_state. It is `attached`: stop() detaches, and it is never restarted."""
        c = cls(config)
        attached.connect(c.state, handle, timeout=timeout)
        try:
            c.health_check()
        except BaseException:
            c.state.close_client()
            raise
        return c

    def restart_engines(self, **changes) -> "Cluster":
        """New engines under the same controller and client, with `changes` applied to the config (the fields the
        engines read at start: extra_path, deterministic, env, timeout_s, tp). The way to switch megatron-core
        release: a process imports it once, so only the engines go; the controller, its profile and the watchdog
        stay. Not running yet: plain start() with the new config. Timings: restart_s (+ engines_s, ready_s).
        """
        st = self.state
        restart.apply_changes(st, changes)
        if st.client is None:
            return self.start()
        t0 = time.perf_counter()
        spare, old = restart.retire_engines(st)
        try:
            restart.replace_engines(st, spare, old)
            bring_up.take_spare(st)
            st.timings["engines_s"] = time.perf_counter() - t0
            bring_up.bring_up(st)
        except BaseException:
            self.stop(graceful=False)
            raise
        restart.log_restart(st, t0)
        return self

    # ------------------------------------------------------------------ the next engine set, launched early
    def prestart(self, **changes) -> bool:
        """Launch the engine set the next `restart_engines(**changes)` will use, now, while the current engines
        work: it then finds them registered and, after `warm(**changes)` with the same changes, their imports done
        (with `changes` given where the cluster forks its engines from a preload server, they are forked with them
        done). The first ~20 s of a restart on a GPU node (registration, torch + megatron-core imports) are hidden.
        Local engines only, where the cores allow (`prestart_wanted`); True if a spare set is up or on its way."""
        return spares.prestart(self.state, **changes)

    def warm(self, **changes) -> bool:
        """Non-blocking: once the spare engines have registered, start their slow imports for the config
        `changes` gives (what `restart_engines(**changes)`, or `start()` of a launched cluster, will ask for).
        Call it between cases; True once the imports are on their way."""
        return spares.warm(self.state, **changes)

    @property
    def placement(self) -> list[dict]:
        """Per rank: engine id, node, local_rank (its GPU on cuda), local_world (engines on its node), address, pid,
        and `launcher_env` (what the launcher told the process: OMPI_COMM_WORLD_RANK, SLURM_PROCID, ...)."""
        keys = ("rank", "engine", "node", "local_rank", "local_world", "address", "pid", "launcher_env")
        return [{k: p.get(k) for k in keys} for p in self.state.procs]

    def health_check(self) -> list[dict]:
        from ..engine import dist

        return self.run(dist.health_check, what="health all-reduce")

    def stop(self, graceful: bool = True) -> None:
        """Destroy process groups, stop engines and controller, remove the private profile. Idempotent.

        graceful=False skips the teardown call on the engines (they may be busy or mid-collective) and ends them.
        Whatever happens, no process of this cluster outlives it: leftovers are killed.
        """
        st = self.state
        if st.attached:
            return attached.detach(st, graceful)
        t0 = time.perf_counter()
        if graceful and st.client is not None and st.engine_ids:
            restart.teardown_engines(st)
            # Process groups are destroyed: nothing of the engines is needed any more, and ipyparallel's SIGTERM
            # shutdown takes seconds per engine with torch loaded (7 s for 4 CPU engines): end them at once.
            processes.kill_engines(st.profile_dir)
        elif st.profile_dir:
            # Busy engines (mid-collective, or in C code) ignore SIGTERM for ipyparallel's 5 s grace, one by one;
            # their state is lost anyway, so end them at once.
            processes.kill_engines(st.profile_dir)
        st.close_client()
        if st.ipp is not None:
            try:
                st.ipp.stop_cluster_sync()
            except Exception as e:  # noqa: BLE001
                logger.warning("stopping the ipyparallel cluster failed: %s", e)
        if st.preload_servers:  # after their engines ended: a server reaps the engines it forked
            from . import preloaded

            preloaded.close_servers(st)
        if st.profile_dir:
            left = processes.kill_cluster_processes(st.profile_dir, exclude=(st.reaper.pid,) if st.reaper else ())
            if left:
                logger.info("killed %d leftover process(es) of the cluster: %s", len(left), left)
            shutil.rmtree(st.profile_dir, ignore_errors=True)
        if st.reaper is not None:  # nothing left to watch; wait for it so no zombie stays behind
            st.reaper.terminate()
            st.reaper.wait()
        st.ipp = st.client = st.view = st.reaper = None
        st.spare = st.engine_set = None
        st.engine_ids = []
        st.profile_dir = None
        st.timings["stop_s"] = time.perf_counter() - t0

    @property
    def world(self) -> int:
        return self.state.world

    def activate(self, suffix: str = "") -> None:
        """Register %px / %%px magics on this cluster's engines (rank order) in the running IPython."""
        self.state.view.activate(suffix)

    def run(self, fn: Callable, *args, per_rank: Callable[[int], dict] | None = None, what: str = "",
            timeout: float | None = None, **kwargs) -> list[Any]:
        """Call `fn(*args, **kwargs)` on every rank at once (plus `per_rank(rank)` kwargs); results in rank order.

        Every call has a timeout (default: the cluster's), so a hung collective or a dead engine ends in a
        ClusterError naming the ranks, never in an endless wait. Where the process group cannot go on (the error
        says `stopped`) or on Ctrl-C, the engines are stopped before the error reaches the caller.
        """
        try:
            return calls.run(self.state, fn, *args, per_rank=per_rank, what=what, timeout=timeout, **kwargs)
        except ClusterError as e:
            if e.stopped:
                self.stop(graceful=False)
            raise
        except KeyboardInterrupt:
            self.stop(graceful=False)
            raise

    # ------------------------------------------------------------------ what failure reports read
    @property
    def procs(self) -> list[dict]:
        """Per rank: pid, node, main_thread, stack_file (dist.identify) — what `diagnosis` names a rank by."""
        return self.state.procs

    def engine_sets(self) -> tuple[list, object]:
        """ipyparallel's engine sets this cluster launched, and the current one (None before start)."""
        return self.state.engine_sets()

    def summary(self) -> dict:
        return self.state.summary()


def env_pairs(d: dict | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (d or {}).items()))


__all__ = ["Cluster", "ClusterError", "default_config", "env_pairs"]
