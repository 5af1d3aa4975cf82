"""On the device machine: the lab's training step (engine/train.py: megatron DDP's gradient arithmetic and
optimizer semantics written out, because over gloo and on CPU megatron's own cannot run) against megatron-core's own
DistributedDataParallel + get_megatron_optimizer — bf16 params, fp32 main weights, Adam — for a few steps at world 1
(NCCL, one rank on one GPU), plus the control: the lab's step with another learning rate must be told apart."""

import pytest

from moe_lab.config import MoEConfig
from moe_lab.controller.cluster import Cluster
from moe_lab.controller.placement import default_config
from moe_lab.engine import train

pytestmark = pytest.mark.gpu

LAYER = MoEConfig(hidden=1024, num_experts=16, topk=4, ffn_hidden=1024, seq_len=256)
STEPS = 5


@pytest.fixture(scope="module")
def one_rank():
    with Cluster(default_config(device="cuda", engines=1, gpus=1, timeout_s=600)) as c:
        yield c


def _run(cluster, **kw):
    payload = {"moe": LAYER.asdict(), "layers": 2, "steps": STEPS, "tokens": 256, "lr": 1e-3, **kw}
    (res,) = cluster.run(train.versus_megatron, payload, what="lab step vs megatron DDP + optimizer")
    for t, (a, b) in enumerate(zip(res["lab"], res["megatron"]), start=1):
        print(f"step {t}: loss lab {a['loss']!r} megatron {b['loss']!r}; grad norm lab {a['grad_norm']!r} "
              f"megatron {b['grad_norm']!r}")
    worst = max(res["weights"].values(), key=lambda c: (c["mismatch_frac"], c["max_ulp"]))
    print("weights after", STEPS, "steps, worst tensor:", {k: worst[k] for k in ("numel", "n_mismatch", "max_ulp",
                                                                                  "max_abs", "max_rel")})
    return res, worst


def _gaps(res) -> dict:
    return {"loss": max(abs(a["loss"] - b["loss"]) / b["loss"] for a, b in zip(res["lab"], res["megatron"])),
            "grad_norm": max(abs(a["grad_norm"] - b["grad_norm"]) / b["grad_norm"]
                             for a, b in zip(res["lab"], res["megatron"]))}


LOSS_TOL, NORM_TOL = 3e-4, 3e-3
"""Measured on one H200 (2026-12-02, call 10): without deterministic mode the bf16 forward is not repeatable on the
GPU — the step-1 loss of the same weights and batch read 1.4271264, 1.4271013, 1.4271142 (lab) and 1.4270933,
1.4271040, 1.4271061 (megatron) in three runs, ~2e-5 apart — so no bitwise claim is made at step 1. Over 5 steps the
lab and megatron stayed within 5.8e-5 (loss) and 6.4e-4 (gradient norm), while the control parted by 3.4e-2 and 5.1e-2.
bf16 weights are reported, not asserted: Adam turns a run-to-run flip of a near-zero gradient into a full +-lr step,
so most elements differ after 5 steps in every run (70-78 % here, 99 % for the control)."""


@pytest.mark.parametrize("grad_reduce_fp32", [False, True])
def test_the_lab_step_matches_megatrons_ddp_and_optimizer(one_rank, grad_reduce_fp32):
    """To rounding: over 5 steps the losses within LOSS_TOL and the gradient norms within NORM_TOL relative of
    megatron's DistributedDataParallel + get_megatron_optimizer (bf16 params, fp32 main weights, Adam). Every figure is
    printed for the log; the control below shows the same check failing for a step that is not megatron's."""
    res, worst = _run(one_rank, grad_reduce_fp32=grad_reduce_fp32)
    gaps = _gaps(res)
    print("gaps", gaps)
    assert gaps["loss"] < LOSS_TOL and gaps["grad_norm"] < NORM_TOL, gaps


def test_control_another_learning_rate_is_told_apart(one_rank):
    """The control: the lab's step with twice megatron's learning rate fails both bounds by far."""
    res, worst = _run(one_rank, lr_factor=2.0)
    gaps = _gaps(res)
    print("control gaps", gaps)
    assert gaps["loss"] > 10 * LOSS_TOL and gaps["grad_norm"] > 3 * NORM_TOL, gaps
