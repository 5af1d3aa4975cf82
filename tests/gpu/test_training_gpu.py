"""On the device machine (#24): the lab's training step (engine/train.py: megatron DDP's gradient arithmetic and
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


@pytest.mark.parametrize("grad_reduce_fp32", [False, True])
def test_the_lab_step_matches_megatrons_ddp_and_optimizer(one_rank, grad_reduce_fp32):
    """To rounding: the same loss at step 1 bit for bit (same weights, same batch); over the steps the losses and
    gradient norms within 1e-3 relative and at most 0.1 % of any weight tensor's bf16 elements differing (megatron's
    norm kernel, or TE / apex FusedAdam where installed, may round the fp32 main weights differently; Adam turns a
    flipped bf16 weight into a visible change a step later). Every figure is printed for the log."""
    res, worst = _run(one_rank, grad_reduce_fp32=grad_reduce_fp32)
    assert res["lab"][0]["loss"] == res["megatron"][0]["loss"]
    gaps = _gaps(res)
    print("gaps", gaps)
    assert gaps["loss"] < 1e-3 and gaps["grad_norm"] < 1e-3, gaps
    assert worst["mismatch_frac"] <= 1e-3, worst


def test_control_another_learning_rate_is_told_apart(one_rank):
    res, worst = _run(one_rank, lr_factor=2.0)
    assert res["lab"][0]["loss"] == res["megatron"][0]["loss"]  # before the first update: equal
    assert worst["mismatch_frac"] > 0.1, worst  # Adam steps ~lr per element: twice the lr moves most weights
