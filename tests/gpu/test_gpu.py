"""On >= 2 CUDA GPUs (the device machine): NCCL cluster, the seed report's layer, the probe's record."""

import pytest

from moe_lab.experiments import probe
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


def test_restart_engines_switches_release_on_gpus(gpu_cluster):
    """#5 on NCCL: switching megatron-core release restarts only the engines (same controller), one per GPU."""
    import os
    from pathlib import Path

    from moe_lab import compat, sweep

    wheels = Path(os.environ.get("MOE_LAB_RELEASES", ".whl/releases"))
    other = next((v for v in ("0.19.2", "0.12.3") if any(wheels.glob(f"megatron_core-{v}*"))), None)
    if other is None:
        pytest.skip(f"no other megatron-core release in {wheels} (set MOE_LAB_RELEASES)")
    controller, cold = gpu_cluster._ipp, gpu_cluster.timings["ready_s"]
    gpu_cluster.restart_engines(extra_path=sweep.release_path(other, str(wheels)))
    try:
        assert gpu_cluster.summary()["megatron_core"] == other and gpu_cluster._ipp is controller
        assert {i["backend"] for i in gpu_cluster.info} == {"nccl"}
        rec = probe.run_case(gpu_cluster, MoEConfig.seed_report(dispatcher="alltoall"), repeats=1)
        assert rec["megatron_core"] == other and rec["cross_rank"]["numel"] == 1024 * 4096
        t = gpu_cluster.timings
        print(f"restart to {other}: {t['restart_s']:.1f} s (engines registered {t['engines_s']:.1f} s, process group "
              f"{t['process_group_s']:.1f} s); the cold start took {cold:.1f} s")
    finally:
        gpu_cluster.restart_engines(extra_path=())
    assert gpu_cluster.summary()["megatron_core"] == compat.installed_version()


def test_no_splitk_makes_the_expert_gemms_batch_invariant(gpu_cluster):
    """#6: the seed layer's expert fc1/fc2 rows inside M rows vs alone, plain cuBLAS vs split-K forbidden."""
    from moe_lab import batch_invariance, truncation

    if not batch_invariance.splitk_control_available():
        pytest.skip("this torch cannot forbid split-K")
    cfg = MoEConfig.seed_report(router_dtype="fp64")
    states = [{"emulation": "none", "remedy": r, "tile": None} for r in ("none", "no_splitk")]
    rows = gpu_cluster.run(truncation.engine_kernel, cfg.asdict(), ms=[16, 64, 96, 192, 256, 384, 1024, 4096],
                           states=states, cut=90)[0]
    for r in rows:
        print(r["linear"], r["remedy"], r["M"], r["kernel"]["n_mismatch"])
    assert all(r["kernel"]["bitwise_equal"] for r in rows if r["remedy"] == "no_splitk")
