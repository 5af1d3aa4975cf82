"""Shared fixtures: one warm 4-engine gloo cluster for the whole session (tests/cluster); GPU markers skip where
the GPUs are missing, with the reason (`gpu`: one CUDA GPU; `multigpu`: two or more)."""

import pytest


@pytest.fixture(scope="session")
def cpu_cluster():
    from moe_lab.config import ClusterConfig
    from moe_lab.controller.cluster import Cluster

    with Cluster(ClusterConfig(device="cpu", engines=4, timeout_s=180)) as c:
        yield c


def pytest_collection_modifyitems(config, items):
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skips = {"gpu": (n < 1, "needs a CUDA GPU (run on the device machine: pytest -m gpu)"),
             "multigpu": (n < 2, f"needs >= 2 CUDA GPUs, {n} visible (pytest -m multigpu on a multi-GPU machine)")}
    for item in items:
        for marker, (skip, why) in skips.items():
            if skip and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
