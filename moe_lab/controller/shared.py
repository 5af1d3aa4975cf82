"""Controller side: one warm cluster for all the notebooks of a `moe-lab run`.

Starting a cluster is most of a short notebook's wall time (one H200, virtual EP=4: ~22 s of 01's 55 s, and nine
starts in 01-04). The runner starts the cluster its notebooks' cases begin on, writes where it is (`publish`) and tells
the notebook kernels through MOE_LAB_SHARED_CLUSTER. A kernel whose cases need exactly that cluster config attaches to
it (`attach`: a client of the same controller, the same engines, process group and parallel_state); any other config
(another megatron-core release, EP=1, a deterministic environment) starts a cluster of its own as before. When the
kernel is done it detaches (`Cluster.stop` of an attached cluster): the engines drop their cached layers and stay up
for the next notebook. A fault on an attached cluster ends its engines, so the next notebook starts its own. The
runner stops the cluster at the end. This module imports `cluster`, never the other way round.
"""

from __future__ import annotations

import contextlib
import dataclasses
import json
import logging
import os
from pathlib import Path

from ..config import ClusterConfig
from .state import SHARED_CLUSTER_ENV as ENV

logger = logging.getLogger(__name__)
ATTACH_TIMEOUT_S = 10.0


def _key(config: ClusterConfig) -> str:
    return json.dumps(dataclasses.asdict(config), sort_keys=True, default=str)


def publish(cluster, path: Path) -> None:
    """Write where `cluster` is and what it is (config, engines, ranks) to `path`, for kernels to attach."""
    files = sorted(Path(cluster.profile_dir, "security").glob("ipcontroller-*client.json"))  # one controller per profile
    if len(files) != 1:
        raise RuntimeError(f"{cluster.profile_dir}: expected one controller connection file, found {len(files)}")
    d = {"config": _key(cluster.config), "client_file": str(files[0]), **cluster.handle(), "owner_pid": os.getpid()}
    tmp = path.with_suffix(".tmp")
    tmp.write_text(json.dumps(d, default=str))
    os.replace(tmp, path)


@contextlib.contextmanager
def for_run(config: ClusterConfig, path: Path):
    """A cluster of `config` for the block, published at `path` and named in MOE_LAB_SHARED_CLUSTER (which the
    notebook kernels inherit); stopped, unpublished and unnamed afterwards, whatever happened. If it cannot start,
    the block runs without one (None): each notebook then starts its own and reports what went wrong in its page."""
    from .cluster import Cluster

    cluster = Cluster(config)
    try:
        cluster.start()
        publish(cluster, path)
    except Exception as e:  # noqa: BLE001 - Ctrl-C propagates; anything else is each notebook's to report
        logger.warning("no shared cluster for this run (%s: %s); each notebook starts its own", type(e).__name__, e)
        cluster.stop(graceful=False)
        yield None
        return
    ok = False
    try:
        os.environ[ENV] = str(path)
        logger.info("one cluster for the run's notebooks: %s", cluster.summary())
        yield cluster
        ok = True
    finally:
        os.environ.pop(ENV, None)
        try:
            path.unlink(missing_ok=True)
        except OSError as e:  # a report folder made read-only mid-run: the cluster is stopped all the same
            logger.info("could not remove %s (%s)", path, e.strerror or e)
        cluster.stop(graceful=ok)


def _published() -> dict | None:
    where = os.environ.get(ENV)
    if not where:
        return None
    try:
        return json.loads(Path(where).read_text())
    except (OSError, ValueError) as e:
        logger.info("no shared cluster to attach to (%s: %s)", where, e)
        return None


def serves(config: ClusterConfig) -> bool:
    """Whether the run's shared cluster (if there is one) has exactly `config`: no connection made."""
    d = _published()
    return d is not None and d.get("config") == _key(config)


def attach(config: ClusterConfig):
    """The run's shared cluster as a Cluster of this process if MOE_LAB_SHARED_CLUSTER names one whose config is
    `config` and whose engines answer a health all-reduce; else None (the caller starts its own)."""
    d = _published()
    if d is None:
        return None
    if d.get("config") != _key(config):
        logger.info("the run's shared cluster has another config than these cases need: starting one of their own")
        return None
    from .cluster import Cluster

    try:
        cluster = Cluster.connect(config, d, timeout=ATTACH_TIMEOUT_S)
    except Exception as e:  # noqa: BLE001 - any failure: this notebook starts its own cluster
        logger.warning("could not attach to the run's shared cluster (%s: %s); starting one", type(e).__name__, e)
        return None
    logger.info("attached to the run's shared cluster: %s", cluster.summary())
    return cluster
