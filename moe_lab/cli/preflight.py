"""`moe-lab preflight`: what a preset on a layout will run, what is left out, memory per rank and GPU — no engines,
no torch (the plan is moe_lab.tools.preflight)."""

from __future__ import annotations

import json

from ..config import MAX_DIM
from .argtypes import count, layout, model, number, scale


def add_arguments(p):
    from ..config import DISPATCHERS, ROUTER_DTYPES

    p.add_argument("--model", type=model, default=None, help="a preset: mixtral-8x7b, qwen3-30b-a3b, qwen3-235b-a22b, "
                                                             "deepseek-v3, moonlight-16b-a3b, gpt-oss-20b")
    p.add_argument("--scale", type=scale, default=1.0, help="shrink hidden and ffn by this factor (e.g. 0.125)")
    p.add_argument("--layout", type=layout, default=None, help="e.g. ep4, tp2,ep4, tp2,ep2,etp1,sp (default ep4)")
    p.add_argument("--world", type=count(), default=None, help="ranks (default the layout's smallest world)")
    p.add_argument("--gpus", type=count(), default=None, help="GPUs; fewer than ranks = ranks share them (virtual EP)")
    p.add_argument("--device", choices=("cpu", "cuda"), default="cuda")
    p.add_argument("--seq", type=count(2, MAX_DIM), default=None, help="tokens per rank (default the layer's)")
    p.add_argument("--dispatcher", default="allgather,alltoall", help="comma list")
    p.add_argument("--router-dtype", default="none", help="comma list: none,fp32,fp64")
    p.add_argument("--gpu-memory", type=number("GiB per GPU", above=0, most=2**20), default=None,
                   help="GiB per GPU: say whether it fits (exit 2 if not)")
    p.add_argument("--json", action="store_true")
    p.set_defaults(_choices=(DISPATCHERS, ROUTER_DTYPES))


def cmd(a) -> int:
    from ..layout import Layout
    from ..tools import preflight

    dispatchers, router_dtypes = _csv(a.dispatcher, a._choices[0], "--dispatcher"), _csv(
        a.router_dtype, a._choices[1], "--router-dtype")
    cfg, preset = preflight.layer_for(a.model, a.scale, a.seq)
    plan = preflight.plan(cfg, a.layout or Layout(ep=4), preset=preset, world=a.world, gpus=a.gpus, device=a.device,
                          dispatchers=dispatchers, router_dtypes=router_dtypes, gpu_memory_gib=a.gpu_memory)
    print(json.dumps(plan.to_dict()) if a.json else plan.text())
    if plan.fits is False:
        raise ValueError(f"does not fit in {a.gpu_memory:g} GiB per GPU (see the memory lines above): use a larger EP, "
                         "more GPUs or --scale")
    return 0


def _csv(s: str, allowed, flag: str) -> list[str]:
    vals = [v.strip() for v in s.split(",") if v.strip()]
    if not vals or any(v not in allowed for v in vals):
        raise ValueError(f"{flag} ({s!r}): each value must be one of {', '.join(allowed)}")
    return vals
