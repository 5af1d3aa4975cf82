"""Shared fixtures: one warm 4-engine gloo cluster for the whole session (tests/cluster)."""

import pytest


@pytest.fixture(scope="session")
def cpu_cluster():
    from moe_lab.controller.cluster import Cluster
    from moe_lab.config import ClusterConfig

    with Cluster(ClusterConfig(device="cpu", engines=4, timeout_s=180)) as c:
        yield c


def pytest_collection_modifyitems(config, items):
    import torch

    if torch.cuda.is_available() and torch.cuda.device_count() >= 2:
        return
    skip = pytest.mark.skip(reason="needs >= 2 CUDA GPUs (run on the device machine: pytest -m gpu)")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)
