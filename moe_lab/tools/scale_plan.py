"""The scale plan: per-GPU memory and compute of one MoE layer forward at an EP, from the layer model of
`tools.scale` (`plan`); its tables (`plan_table`, `min_ep`); and the placement check that refuses ranks that do not
fit in GPU memory before any engine starts (`check_memory`).

Compute: 2 x rows x hidden x ffn x (2, or 3 if gated) FLOPs for the expert GEMMs of the busiest rank, and
2 x seq x hidden x experts for the router; the time is an **estimate** at a sustained `tflops` (default 600 TFLOP/s,
H200 dense bf16 GEMMs sustain ~790 on large square shapes; small per-expert GEMMs get less).
"""

from __future__ import annotations

from ..config import ClusterConfig, MoEConfig
from ..layout import WORLD, Layout
from .scale import (DEFAULT_RESERVE_BYTES, DEFAULT_TFLOPS, FINGERPRINT_TABLE_BYTES, H200_USABLE_BYTES, capture_bytes,
                    check_ep, dtype_bytes, forward_peak, lab_phases, param_bytes, persistent_bytes, rows_per_expert)


def plan(cfg: MoEConfig, ep: int, *, dispatcher: str | None = None, gated: bool | None = None, imbalance: float = 1.0,
         cut: int = 90, capture: bool = False, tflops: float = DEFAULT_TFLOPS,
         usable_bytes: int = H200_USABLE_BYTES, reserve_bytes: int = DEFAULT_RESERVE_BYTES,
         moe_layers: int | None = None, counts: list[int] | None = None,
         counts_truncation: list[int] | None = None, device: str = "cuda") -> dict:
    """Per-GPU memory and compute of one MoE layer forward at EP=`ep` (TP=1) for the busiest rank, as a flat dict.

    Memory (bytes): parameters + persistent (allgather's buffer) + input tokens + the fingerprint's table + the
    largest of the lab's steps (`lab_phases`), each the forward's own peak plus what the lab holds then.
    `layer_peak_bytes` is one plain (balanced) forward alone: what a model pays per MoE layer in inference.
    Fits: lab peak <= usable - reserve. `moe_layers_fit`: how many such layers' parameters fit beside one forward;
    with `moe_layers`, `model_fits` says whether that many do.
    counts / counts_truncation: measured rows per local expert (else `rows_per_expert`'s scenarios).
    """
    if dispatcher is not None:
        cfg = cfg.replace(dispatcher=dispatcher)
    check_ep(cfg, ep)
    gated = cfg.gated if gated is None else gated
    if not isinstance(tflops, (int, float)) or isinstance(tflops, bool) or not tflops > 0:
        raise ValueError(f"tflops ({tflops!r}) must be a positive number")
    d, r = dtype_bytes(cfg)
    prm = param_bytes(cfg, ep, gated=gated)
    pers = persistent_bytes(cfg, ep)
    inp = cfg.seq_len * cfg.hidden * d
    fp_cache = FINGERPRINT_TABLE_BYTES
    counts_b = counts or rows_per_expert(cfg, ep, scenario="balanced", imbalance=imbalance)
    counts_t = counts_truncation or rows_per_expert(cfg, ep, scenario="truncation", cut=cut)
    fp_b = forward_peak(cfg, ep, counts=counts_b, gated=gated, device=device)
    fp_t = forward_peak(cfg, ep, counts=counts_t, gated=gated, device=device)
    # forward_peak includes the persistent buffer: subtract it so that it is counted once
    fwd_b, fwd_t = fp_b["bytes"] - pers, fp_t["bytes"] - pers
    cap = capture_bytes(cfg, ep, counts_b)
    phases = lab_phases(cfg, ep, fwd_plain=fwd_b, fwd_trunc=fwd_t, cut=cut, capture=capture, cap_bytes=cap,
                        device=device)
    lab_step, lab_extra = max(phases, key=lambda p: p[1])
    total = prm["total"] + pers + inp + fp_cache + lab_extra
    layer_peak = prm["total"] + pers + inp + fwd_b
    budget = usable_bytes - reserve_bytes
    act = layer_peak - prm["total"]  # one forward's activations (+ buffer, input), beside the parameters
    fit_layers = max(0, (budget - act) // prm["total"])
    R_b, R_t = sum(counts_b), sum(counts_t)
    mult = 3 if gated else 2
    fl_experts = 2 * R_b * cfg.hidden * cfg.ffn_hidden * mult
    fl_router = 2 * cfg.seq_len * cfg.hidden * cfg.num_experts
    if cfg.dispatcher == "allgather":  # received: all-gather of the other ranks' tokens, reduce-scatter (probs dtype)
        comm = (ep - 1) * cfg.seq_len * cfg.hidden * (d + r)
    else:  # all-to-all both ways: the rows that come from other ranks, (EP-1)/EP of them when balanced
        comm = 2 * (R_b * (ep - 1) // ep) * cfg.hidden * d
    row = {
        "hidden": cfg.hidden, "num_experts": cfg.num_experts, "topk": cfg.topk, "ffn_hidden": cfg.ffn_hidden,
        "seq_len": cfg.seq_len, "dtype": cfg.dtype, "router_dtype": cfg.router_dtype, "dispatcher": cfg.dispatcher,
        "deterministic": cfg.deterministic, "gated": gated, "ep": ep, "local_experts": prm["local_experts"],
        "imbalance": imbalance, "cut": cut, "capture": capture,
        "tokens_seen": cfg.seq_len * ep if cfg.dispatcher == "allgather" else cfg.seq_len,
        "rows": R_b, "rows_max_expert": max(counts_b), "rows_truncation": R_t,
        "rows_max_expert_truncation": max(counts_t),
        "param_router_bytes": prm["router"], "param_experts_bytes": prm["experts"], "param_bytes": prm["total"],
        "persistent_bytes": pers, "input_bytes": inp, "fingerprint_cache_bytes": fp_cache,
        "forward_bytes": fwd_b, "forward_step": fp_b["step"],
        "forward_truncation_bytes": fwd_t, "forward_truncation_step": fp_t["step"],
        "capture_bytes": cap if capture else 0,
        "lab_step": lab_step, "lab_extra_bytes": lab_extra,
        "layer_peak_bytes": layer_peak, "lab_peak_bytes": total,
        "usable_bytes": usable_bytes, "reserve_bytes": reserve_bytes,
        "fits": total <= budget, "headroom_bytes": budget - total, "moe_layers_fit": int(fit_layers),
        "comm_bytes": comm,
        "expert_flops": fl_experts, "router_flops": fl_router, "tflops": float(tflops),
        "est_ms": 1e3 * (fl_experts + fl_router) / (tflops * 1e12),
        "expert_flops_truncation": 2 * R_t * cfg.hidden * cfg.ffn_hidden * mult,
        "est_ms_truncation": 1e3 * (2 * R_t * cfg.hidden * cfg.ffn_hidden * mult + fl_router) / (tflops * 1e12),
    }
    if moe_layers is not None:
        row["moe_layers"] = moe_layers
        row["model_fits"] = moe_layers * prm["total"] + act <= budget
    return row


def check_memory(moe_cfgs, ccfg: ClusterConfig, *, cut: int = 90, free: list[int] | None = None,
                 layout: Layout = WORLD) -> dict | None:
    """Refuse a placement whose ranks do not fit in GPU memory, before any engine starts (the scale model: weights
    + the lab's peak activations of the busiest rank, times the ranks sharing a GPU, the layers split as `layout`).
    Returns the check's numbers, or None on CPU or at TP > 1 (the scale model counts TP 1). `free` overrides the
    measured free bytes per GPU (tests)."""
    if ccfg.device != "cuda" or ccfg.launcher != "local":
        return None
    from ..controller.placement import gpu_free_bytes

    gpus = ccfg.engines // ccfg.ranks_per_gpu
    free = free if free is not None else gpu_free_bytes(gpus)
    if layout.tp != 1 or layout.expert_tp != 1:
        return None  # the scale model counts TP=1 only
    ep = layout.on(ccfg.engines).ep
    worst = None
    for cfg in moe_cfgs:
        row = plan(cfg, ep, cut=cut, usable_bytes=1 << 62, reserve_bytes=0)
        need = row["lab_peak_bytes"] * ccfg.ranks_per_gpu
        if worst is None or need > worst["need_bytes"]:
            worst = {"need_bytes": need, "per_rank_bytes": row["lab_peak_bytes"], "config": cfg}
    if worst is None:
        return None
    worst.update(free_bytes=min(free), ranks_per_gpu=ccfg.ranks_per_gpu, gpus=gpus)
    if worst["need_bytes"] > min(free):
        gib = 2**30
        c = worst["config"]
        raise ValueError(
            f"{ccfg.ranks_per_gpu} rank(s) per GPU need {worst['need_bytes'] / gib:.1f} GiB each GPU "
            f"({worst['per_rank_bytes'] / gib:.1f} GiB per rank for hidden {c.hidden}, {c.num_experts} experts, "
            f"ffn {c.ffn_hidden}, {c.seq_len} tokens at EP={ep}), but only {min(free) / gib:.1f} GiB is free: "
            "use fewer ranks per GPU (engines), more GPUs, or a smaller layer (seq_len, ffn_hidden)")
    return worst


def plan_table(cfg: MoEConfig, eps, *, dispatchers=("allgather", "alltoall"), **kw):
    """`plan` for every EP x dispatcher, as a pandas DataFrame (one row each)."""
    import pandas as pd

    return pd.DataFrame([plan(cfg, ep, dispatcher=disp, **kw) for disp in dispatchers for ep in eps])


def min_ep(cfg: MoEConfig, moe_layers: int, *, dispatcher: str = "alltoall", **kw) -> int | None:
    """The smallest EP (a divisor of num_experts) at which `moe_layers` layers' parameters fit beside one forward."""
    for ep in [e for e in range(1, cfg.num_experts + 1) if cfg.num_experts % e == 0]:
        if plan(cfg, ep, dispatcher=dispatcher, moe_layers=moe_layers, **kw)["model_fits"]:
            return ep
    return None
