"""On >= 2 CUDA GPUs (the device machine): NCCL cluster, the seed report's layer, the probe's record."""

import pytest

from moe_lab import probe
from moe_lab.cluster import Cluster, default_config
from moe_lab.config import MoEConfig

pytestmark = pytest.mark.gpu


@pytest.fixture(scope="module")
def gpu_cluster():
    with Cluster(default_config(device="cuda", timeout_s=600)) as c:
        yield c


def test_one_engine_per_gpu_on_nccl(gpu_cluster):
    import torch

    info = gpu_cluster.info
    assert len(info) == torch.cuda.device_count()
    assert {i["backend"] for i in info} == {"nccl"} and all(i["gpu"] for i in info)
    assert all(i["nccl"] for i in info)
    assert all(c["ok"] for c in gpu_cluster.health_check())
    print("GPU cluster ready in", round(gpu_cluster.timings["ready_s"], 1), "s", gpu_cluster.summary())


@pytest.mark.parametrize("dispatcher", ["allgather", "alltoall"])
def test_seed_report_layer_runs_and_is_compared_in_full(gpu_cluster, dispatcher):
    cfg = MoEConfig.seed_report(dispatcher=dispatcher, router_dtype="fp64")
    rec = probe.run_case(gpu_cluster, cfg, repeats=1)
    assert rec["cross_rank"]["numel"] == 1024 * 4096
    assert rec["truncation"]["numel"] == 90 * 4096
    assert rec["device"] == "cuda" and rec["backend"] == "nccl"
    print(probe.headline(rec))
