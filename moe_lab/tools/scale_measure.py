"""The scale plan checked against the real layer (`moe-lab scale --measure`): engine side `measure_layer`, controller
side `measured` and `compare_measured` (calculated vs measured, per rank)."""

from __future__ import annotations

from ..config import MoEConfig, check_cut
from .scale import forward_peak, param_bytes, persistent_bytes, check_ep
from .scale_plan import plan


def measure_layer(cfg_dict: dict, *, cut: int = 90) -> dict:
    """Engine side: build the layer through the lab's own path (`engine.toolkit.setup`) and measure it.

    Returns the parameter bytes (exact), rows per local expert seen by this rank for the plain and the truncated
    input, and the forward's peak allocation above what was allocated before it: `torch.cuda.max_memory_allocated`
    on GPUs; on CPU the allocator events of the torch profiler (exact for tensors torch allocates; gloo's own
    buffers are not in it). A warm-up forward runs first, so allgather's global buffer is already allocated.
    """
    import torch
    import torch.distributed as tdist

    from ..engine import toolkit
    from ..engine.dist import STATE
    from ..experiments import probe

    s = toolkit.setup(cfg_dict)
    cfg, layer = s.cfg, s.layer
    dev = STATE["torch_device"]
    params = {n: p.numel() * p.element_size() for n, p in layer.named_parameters()}
    buffers = sum(b.numel() * b.element_size() for b in layer.buffers())
    tokens = s.tokens
    trunc = s.truncated(cut)
    ep = s.layout.ep
    local = list(layer.local_expert_indices)

    def counts(x):  # the same tokens on every rank: this rank's experts see EP copies of their rows
        with torch.no_grad():
            _, rmap = layer.router(x)
        per = rmap.reshape(-1, cfg.num_experts).sum(dim=0)
        return [int(ep * per[e]) for e in local]

    with toolkit.deterministic(cfg.deterministic):
        toolkit.forward(layer, tokens)  # warm-up: global buffer, cuBLAS handles, router weight placement
        res = {"rank": tdist.get_rank(), "device": STATE["device"], "param_bytes": sum(params.values()),
               "param_bytes_by_name": params, "buffer_bytes": buffers, "local_experts": local,
               "counts": counts(tokens), "counts_truncation": counts(trunc)}
        for key, x in (("forward", tokens), ("forward_truncation", trunc)):
            res[key] = _peak(lambda x=x: toolkit.forward(layer, x), STATE["device"], dev)
        del tokens, trunc, s  # the probe makes its own
        if STATE["device"] == "cuda":
            torch.cuda.synchronize(dev)
            res["allocated_bytes"] = torch.cuda.memory_allocated(dev)
            torch.cuda.reset_peak_memory_stats(dev)
            probe.on_engine(probe.case(cfg, cut=cut, repeats=1).payload(tdist.get_world_size()))
            torch.cuda.synchronize(dev)
            res["run_case_peak_bytes"] = torch.cuda.max_memory_allocated(dev)
            res["run_case_allocated_after_bytes"] = torch.cuda.memory_allocated(dev)
    return res


def _peak(fn, device: str, dev) -> dict:
    """Peak bytes allocated while `fn` runs, above what was allocated when it started; and what stays after."""
    import torch

    if device == "cuda":
        torch.cuda.synchronize(dev)
        before = torch.cuda.memory_allocated(dev)
        torch.cuda.reset_peak_memory_stats(dev)
        out = fn()
        torch.cuda.synchronize(dev)
        peak, after = torch.cuda.max_memory_allocated(dev), torch.cuda.memory_allocated(dev)
        del out
        return {"peak_bytes": peak - before, "kept_bytes": after - before}
    return _cpu_peak(fn)


def _cpu_peak(fn) -> dict:
    """CPU: the torch profiler's allocator events ('Total Allocated' runs on across profiler sessions, so the
    baseline is the first event's total minus its own size). They include what other threads of the process
    allocate meanwhile (gloo's worker threads: allgather's 4 MiB staging at the test layer), whose overlap with the
    peak depends on timing: `other_threads_bytes` says how much that was, and `own_peak_bytes` is the peak of the
    calling thread's allocations alone (the same on every run of the same kernels)."""
    import json
    import os
    import tempfile
    import threading

    from torch.profiler import ProfilerActivity, profile

    with profile(activities=[ProfilerActivity.CPU], profile_memory=True) as prof:
        out = fn()  # kept past the profile, as on GPU: kept_bytes includes the output
    fd, path = tempfile.mkstemp(suffix=".json")
    os.close(fd)
    try:
        prof.export_chrome_trace(path)
        with open(path) as f:
            trace = [e for e in json.load(f)["traceEvents"] if e.get("name") == "[memory]"]
    finally:
        os.remove(path)
    del out
    events = [e["args"] for e in trace]
    if not events:
        return {"peak_bytes": 0, "kept_bytes": 0, "own_peak_bytes": 0, "other_threads_bytes": 0}
    me = threading.get_native_id()
    base = events[0]["Total Allocated"] - events[0]["Bytes"]
    own = other = peak = 0
    for e in trace:
        if e.get("tid") in (me, None):
            own += e["args"]["Bytes"]
            peak = max(peak, own)
        else:
            other += max(e["args"]["Bytes"], 0)
    return {"peak_bytes": max(e["Total Allocated"] for e in events) - base,
            "kept_bytes": events[-1]["Total Allocated"] - base, "own_peak_bytes": peak, "other_threads_bytes": other}


def compare_measured(cfg: MoEConfig, ep: int, per_rank: list[dict], *, device: str, cut: int = 90) -> dict:
    """Measured (`measure_layer` on every rank) against calculated, with the measured rows per expert fed in.

    Parameters must agree exactly. Forward peaks are the allocation above what was allocated before the forward
    (the global buffer already there), so the calculation subtracts `persistent_bytes`. On GPUs `run_case` is also
    measured whole (absolute `max_memory_allocated`) against the plan's lab peak.
    """
    pers = persistent_bytes(cfg, ep)
    calc_params = param_bytes(cfg, ep)["total"]
    ranks = []
    for m in per_rank:
        r = {"rank": m["rank"], "param_bytes": m["param_bytes"], "param_bytes_calc": calc_params,
             "buffer_bytes": m["buffer_bytes"], "counts": m["counts"], "counts_truncation": m["counts_truncation"]}
        for key, ck in (("forward", "counts"), ("forward_truncation", "counts_truncation")):
            calc = forward_peak(cfg, ep, counts=m[ck], device=device)
            r[key] = m[key]["peak_bytes"]
            r[key + "_own"] = m[key].get("own_peak_bytes")  # CPU: the forward's own thread alone
            r[key + "_other_threads"] = m[key].get("other_threads_bytes")  # CPU: allocated by other threads meanwhile
            r[key + "_calc"] = calc["bytes"] - pers
            r[key + "_step"] = calc["step"]
            r[key + "_ratio"] = r[key] / r[key + "_calc"]
        if "run_case_peak_bytes" in m:
            p = plan(cfg, ep, counts=m["counts"], counts_truncation=m["counts_truncation"], cut=cut, device=device)
            r.update(run_case_peak=m["run_case_peak_bytes"], run_case_peak_calc=p["lab_peak_bytes"],
                     run_case_step_calc=p["lab_step"], allocated_before=m["allocated_bytes"],
                     run_case_ratio=m["run_case_peak_bytes"] / p["lab_peak_bytes"])
        ranks.append(r)
    return {"config": cfg.asdict(), "ep": ep, "device": device, "cut": cut,
            "params_equal": all(r["param_bytes"] == r["param_bytes_calc"] for r in ranks), "ranks": ranks}


def measured(cfgs: list[MoEConfig], *, device: str | None = None, engines: int | None = None, cut: int = 90,
             timeout_s: float = 600.0) -> list[dict]:
    """Controller side: start a cluster (EP = engines) and `compare_measured` every config on it."""
    from ..controller.cluster import Cluster
    from ..controller.placement import default_config

    ccfg = default_config(device=device, engines=engines, timeout_s=timeout_s)
    ep = ccfg.engines
    for cfg in cfgs:
        check_ep(cfg, ep)
        check_cut(cut, cfg.seq_len)
    out = []
    with Cluster(ccfg) as c:
        for cfg in cfgs:
            per_rank = c.run(measure_layer, cfg.asdict(), cut=cut, what=f"scale {cfg.dispatcher}/{cfg.router_dtype}")
            out.append(compare_measured(cfg, ep, per_rank, device=ccfg.device, cut=cut))
    return out
