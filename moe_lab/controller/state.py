"""Controller side: what a running cluster is — its config, ipyparallel controller and client, engines in rank order,
their processes, the rendezvous, the spare engine set and the timings — as one plain object. `Cluster` owns one
and composes the parts that work on it (`calls`, `bring_up`, `spares`, `restart`, `attached`, `diagnosis`); they
import this module, never `cluster`, and none of them imports one that imports it back."""

from __future__ import annotations

from ..config import ClusterConfig

SHARED_CLUSTER_ENV = "MOE_LAB_SHARED_CLUSTER"
"""Names a `moe-lab run`'s shared cluster file to its notebook kernels (`controller.shared`); here, where the parts
that only ask whether there is one (`spares`) read it without importing `shared`."""


class ClusterState:
    """The state of one cluster (all of it public: the parts of the controller read and write it)."""

    def __init__(self, config: ClusterConfig):
        self.config = config
        self.ipp = None  # ipyparallel's Cluster: the controller and the engine sets it launched
        self.client = None
        self.view = None
        self.engine_ids: list[int] = []  # engine_ids[rank] is the ipyparallel id of that rank's engine
        self.info: list[dict] = []
        self.timings: dict[str, float] = {}
        self.rendezvous: tuple[str, int] | None = None  # (address, port) of the process group's TCPStore
        self.port = 0  # preferred rendezvous port; 0 (or a busy one) lets the OS pick a free one
        self.procs: list[dict] = []  # per rank: pid, node, main_thread, stack_file (dist.identify)
        self.profile_dir: str | None = None  # the private ipyparallel profile; its processes carry IPP_PROFILE_DIR
        self.reaper = None  # the watchdog process (processes.start_watchdog)
        self.attached = False  # a client of a run's shared cluster (controller.shared): stop() detaches
        self.spare: dict | None = None  # the next engine set, launched before it is needed (spares.spare)
        self.engine_set = None  # ipyparallel's id of the current engine set
        self.launched_at = 0.0
        self.preload_servers: dict = {}  # per engine start (release path, environment): its preload server

    @property
    def world(self) -> int:
        return len(self.engine_ids)

    def engine_sets(self) -> tuple[list, object]:
        """ipyparallel's engine sets this cluster launched, and the current one (None before start)."""
        es = self.ipp.engines if self.ipp is not None else {}
        return list(es.values()), es.get(self.engine_set) if self.engine_set is not None else None

    def close_client(self) -> None:
        if self.client is not None:
            try:
                self.client.close()
            except Exception:  # noqa: BLE001 - closing is best effort; the processes are ended by profile
                pass

    def summary(self) -> dict:
        i0 = self.info[0] if self.info else {}
        return {k: i0.get(k) for k in ("device", "gpu", "backend", "world", "tp", "ep", "torch", "megatron_core",
                                          "nccl", "python")}


__all__ = ["ClusterState"]
