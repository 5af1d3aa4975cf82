"""Controller side: start ipyparallel engines (one per GPU, or N on CPU), map them to ranks, run, tear down."""

from __future__ import annotations

import logging
import shutil
import tempfile
import time
from typing import Any, Callable

from .config import ClusterConfig

logger = logging.getLogger(__name__)


class ClusterError(RuntimeError):
    """An engine failed or timed out; the message names the rank(s) and what they were doing."""


def visible_gpus() -> int:
    """GPUs torch can see from the controller (0 without CUDA). Imports torch lazily."""
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def default_config(device: str | None = None, engines: int | None = None, **kw) -> ClusterConfig:
    """One engine per visible GPU on cuda; 4 CPU engines otherwise. Refuses more engines than GPUs."""
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
    """

    def __init__(self, config: ClusterConfig | None = None, **kw):
        self.config = config or default_config(**kw)
        self._ipp = None
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []  # engine_ids[rank] is the ipyparallel id of that rank's engine
        self.info: list[dict] = []
        self.timings: dict[str, float] = {}
        self._profile_dir: str | None = None

    # ------------------------------------------------------------------ lifecycle
    def __enter__(self) -> "Cluster":
        return self.start()

    def __exit__(self, *exc) -> None:
        self.stop()

    def start(self) -> "Cluster":
        import ipyparallel as ipp

        from . import dist

        cfg = self.config
        t0 = time.perf_counter()
        # A private profile per cluster: two notebooks (or users) never share connection files or ports.
        self._profile_dir = tempfile.mkdtemp(prefix="moe_lab_ipp_")
        try:
            # ipyparallel logs to the notebook's stdout by default, engine output included when they are
            # stopped by signal; route it to our logger (quiet unless debugging) so reports stay readable.
            ipp_log = logging.getLogger("moe_lab.ipyparallel")
            if ipp_log.level == logging.NOTSET:
                ipp_log.setLevel(logging.ERROR)
            self._ipp = ipp.Cluster(n=cfg.engines, profile_dir=self._profile_dir, log=ipp_log,
                                    engine_timeout=int(cfg.start_timeout_s), delay=0.1)
            logger.info("starting %d %s engines", cfg.engines, cfg.device)
            self.client = self._ipp.start_and_connect_sync(n=cfg.engines)
            self.client.wait_for_engines(cfg.engines, timeout=cfg.start_timeout_s)
            self.engine_ids = sorted(self.client.ids)[: cfg.engines]
            self.view = self.client.direct_view(targets=self.engine_ids)
            self.view.block = True
            self.timings["engines_s"] = time.perf_counter() - t0

            t1 = time.perf_counter()
            # Rendezvous on engine 0's host, on a port that host says is free.
            addr = self._call(0, dist.host_address, what="finding the rendezvous address")
            if cfg.engines == 1 or self._single_host():
                addr = "127.0.0.1"
            port = self._call(0, dist.free_port, what="picking a rendezvous port")
            env = dict(cfg.env)
            self.info = self.run(dist.setup, per_rank=lambda r: dict(
                rank=r, world=cfg.engines, master_addr=addr, master_port=port, device=cfg.device, tp=cfg.tp,
                timeout_s=cfg.timeout_s, extra_path=tuple(cfg.extra_path), env=env,
                deterministic=cfg.deterministic), what="init_process_group + parallel_state")
            self.timings["process_group_s"] = time.perf_counter() - t1
            self.health_check()
            self.timings["ready_s"] = time.perf_counter() - t0
            logger.info("cluster ready in %.1f s: %s", self.timings["ready_s"], self.summary())
        except BaseException:
            self.stop()
            raise
        return self

    def _single_host(self) -> bool:
        from . import dist

        hosts = set(self.run(dist.host_address, what="listing hosts"))
        return len(hosts) == 1

    def health_check(self) -> list[dict]:
        from . import dist

        return self.run(dist.health_check, what="health all-reduce")

    def stop(self) -> None:
        """Destroy process groups, stop engines and controller, remove the private profile. Idempotent."""
        from . import dist

        if self.client is not None and self.engine_ids:
            try:
                ars = [self.client[e].apply_async(dist.teardown) for e in self.engine_ids]
                for ar in ars:
                    ar.get(timeout=min(10.0, self.config.timeout_s))
            except Exception as e:  # noqa: BLE001 - engines are stopped below whatever happened here
                logger.warning("teardown on engines did not finish cleanly (%s); stopping them anyway", e)
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
            shutil.rmtree(self._profile_dir, ignore_errors=True)
        self._ipp = self.client = self.view = None
        self.engine_ids = []
        self._profile_dir = None

    # ------------------------------------------------------------------ calls
    @property
    def world(self) -> int:
        return len(self.engine_ids)

    def activate(self, suffix: str = "") -> None:
        """Register %px / %%px magics on this cluster's engines (rank order) in the running IPython."""
        self.view.activate(suffix)

    def _call(self, rank: int, fn: Callable, *args, what: str = "", timeout: float | None = None, **kwargs):
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
        timeout = self.config.timeout_s if timeout is None else timeout
        deadline = time.monotonic() + timeout
        results = [None] * len(ars)
        pending = dict(enumerate(ars))
        while pending:
            for i, ar in list(pending.items()):
                if ar.ready():
                    try:
                        results[i] = ar.get()
                    except Exception as e:  # noqa: BLE001 - re-raised with the rank named
                        raise ClusterError(f"rank {ranks[i]} (engine {self.engine_ids[ranks[i]]}) failed in {what}: "
                                           f"{_remote_message(e)}") from e
                    del pending[i]
            if not pending:
                break
            if time.monotonic() > deadline:
                missing = sorted(ranks[i] for i in pending)
                raise ClusterError(f"{what}: rank(s) {missing} did not answer within {timeout:.0f} s "
                                   f"(hung collective or dead engine); stop the cluster and start it again")
            next(iter(pending.values())).wait(0.05)
        return results

    def summary(self) -> dict:
        i0 = self.info[0] if self.info else {}
        return {k: i0.get(k) for k in ("device", "gpu", "backend", "world", "tp", "ep", "torch", "megatron_core",
                                          "nccl", "python")}


def _remote_message(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    evalue = getattr(e, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(e).__name__}: {e}"


def env_pairs(d: dict | None) -> tuple[tuple[str, str], ...]:
    return tuple(sorted((str(k), str(v)) for k, v in (d or {}).items()))


__all__ = ["Cluster", "ClusterError", "default_config", "visible_gpus", "env_pairs"]
