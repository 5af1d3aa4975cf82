"""`moe-lab scale`: its options and tables (the calculation is moe_lab.tools.scale and scale_plan, the measurement
scale_measure)."""

from __future__ import annotations

import argparse
import json

from ..config import MAX_DIM
from ..tools.scale import (DEEPSEEK_V3_MOE_LAYERS, DEFAULT_RESERVE_BYTES, DEFAULT_TFLOPS, GIB, H200_USABLE_BYTES,
                           check_ep, presets)
from ..tools.scale_measure import measured
from ..tools.scale_plan import min_ep, plan
from .argtypes import count, number


def _gib(b) -> str:
    return f"{b / GIB:.2f}"


def format_plan(rows, *, title: str | None = None) -> str:
    """A markdown table of `plan` rows (a DataFrame or a list of dicts), GiB per GPU."""
    recs = rows.to_dict("records") if hasattr(rows, "to_dict") else list(rows)
    if not recs:
        return ""
    r0 = recs[0]
    head = title or (f"hidden {r0['hidden']}, {r0['num_experts']} experts, top-{r0['topk']}, expert ffn "
                     f"{r0['ffn_hidden']}{' (gated: fc1 x2)' if r0['gated'] else ''}, {r0['seq_len']} tokens per "
                     f"rank, {r0['dtype']}, router dtype {r0['router_dtype']}")
    budget = r0["usable_bytes"] - r0["reserve_bytes"]
    lines = [
        head,
        "",
        f"GiB per GPU (busiest rank); fits = lab peak <= {_gib(r0['usable_bytes'])} usable - "
        f"{_gib(r0['reserve_bytes'])} reserve = {_gib(budget)} GiB; time: ESTIMATE at {r0['tflops']:g} TFLOP/s",
        "",
        "| dispatcher | EP | local experts | params | tokens seen | rows (trunc.) | forward | forward, trunc. input "
        "| layer peak | lab peak | fits | layers fit | expert GFLOP | est. ms |",
        "| --- | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | ---: | --- | ---: | ---: | ---: |",
    ]
    for r in recs:
        fwd = r["forward_bytes"] + r["persistent_bytes"]
        fwd_t = r["forward_truncation_bytes"] + r["persistent_bytes"]
        lines.append(
            f"| {r['dispatcher']} | {r['ep']} | {r['local_experts']} | {_gib(r['param_bytes'])} | {r['tokens_seen']} "
            f"| {r['rows']} ({r['rows_truncation']}) | {_gib(fwd)} | {_gib(fwd_t)} | {_gib(r['layer_peak_bytes'])} "
            f"| {_gib(r['lab_peak_bytes'])} | {'yes' if r['fits'] else 'NO'} | {r['moe_layers_fit']} "
            f"| {r['expert_flops'] / 1e9:.1f} | {r['est_ms']:.2f} |")
    lines += [
        "",
        "forward: activations of one plain forward incl. allgather's kept token buffer (balanced routing); "
        "trunc. input: the lab's truncated tokens (zeros route to experts 0..topk-1 on one rank); layer peak: "
        "params + input + forward; lab peak: the probe (`experiments.probe.on_engine`, one trial) (3 kept outputs, compare, fingerprint); layers fit: "
        "how many such layers' params fit beside one forward.",
    ]
    return "\n".join(lines)


def _mib(b) -> str:
    return f"{b / 2**20:.1f}"


def format_measured(records: list[dict]) -> str:
    """Measured vs calculated, one line per config (the rank whose forward peaks highest), MiB."""
    lines = ["| layer | dispatcher / router | EP | device | params: measured = calculated | forward MiB: measured / "
             "calculated | truncated input MiB: measured / calculated | run_case peak MiB: measured / calculated |",
             "| --- | --- | ---: | --- | --- | --- | --- | --- |"]
    for rec in records:
        c = rec["config"]
        w = max(rec["ranks"], key=lambda r: r["forward_truncation"])
        f = max(rec["ranks"], key=lambda r: r["forward"])
        rc = max(rec["ranks"], key=lambda r: r.get("run_case_peak", 0))
        run = (f"{_mib(rc['run_case_peak'])} / {_mib(rc['run_case_peak_calc'])} ({rc['run_case_ratio']:.3f})"
               if "run_case_peak" in rc else "—")
        lines.append(
            f"| {c['hidden']}/{c['num_experts']}e/top-{c['topk']}/ffn {c['ffn_hidden']}/{c['seq_len']} tok "
            f"| {c['dispatcher']} / {c['router_dtype']}{' / det' if c['deterministic'] else ''} | {rec['ep']} "
            f"| {rec['device']} | {_mib(f['param_bytes'])} MiB: {'yes' if rec['params_equal'] else 'NO'} "
            f"| {_mib(f['forward'])} / {_mib(f['forward_calc'])} ({f['forward_ratio']:.3f}, {f['forward_step']}) "
            f"| {_mib(w['forward_truncation'])} / {_mib(w['forward_truncation_calc'])} "
            f"({w['forward_truncation_ratio']:.3f}, {w['forward_truncation_step']}) | {run} |")
    return "\n".join(lines)


def _ints(s: str) -> list[int]:
    try:
        vals = [int(v) for v in s.split(",") if v.strip()]
    except ValueError:
        vals = []
    if not vals or any(v < 1 for v in vals):
        raise argparse.ArgumentTypeError(f"{s!r}: expected a comma list of positive integers, e.g. 8,16,32")
    return vals


DEFAULT_EPS = {"seed": [2, 4, 8], "deepseek-v3": [8, 16, 32, 64]}


def add_arguments(p):
    """The options of `moe-lab scale`."""
    from ..config import DISPATCHERS, ROUTER_DTYPES

    p.add_argument("--preset", choices=tuple(DEFAULT_EPS), default="seed",
                   help="seed: the seed report's layer; deepseek-v3: hidden 7168, 256 experts, top-8, ffn 2048")
    p.add_argument("--ep", type=_ints, default=None, help="comma list (default: seed 2,4,8; deepseek-v3 8,16,32,64)")
    p.add_argument("--seq", type=count(2, MAX_DIM), default=None,
                   help="tokens per rank (default: seed 1024, deepseek-v3 4096)")
    p.add_argument("--dispatcher", default="allgather,alltoall", help="comma list: " + ",".join(DISPATCHERS))
    p.add_argument("--router-dtype", choices=ROUTER_DTYPES, default="none")
    p.add_argument("--gated", action="store_true", help="fc1 x2 (SwiGLU, as DeepSeek-V3; the lab builds gelu)")
    p.add_argument("--imbalance", type=number("the busiest rank's share", least=1, most=1e6), default=1.0,
                   help="rows of the busiest rank / seq x topk (>= 1)")
    p.add_argument("--cut", type=count(1), default=90, help="the truncation test's cut (tokens[cut:] = 0)")
    p.add_argument("--capture", action="store_true", help="count full stage capture (capture.run_with_capture)")
    p.add_argument("--tflops", type=number("TFLOP/s", above=0, most=1e6), default=DEFAULT_TFLOPS,
                   help="sustained TFLOP/s for the time ESTIMATE")
    p.add_argument("--reserve-gib", type=number("GiB held back", least=0, most=H200_USABLE_BYTES / GIB),
                   default=DEFAULT_RESERVE_BYTES / GIB,
                   help="GiB held back from the 139 GiB of an H200 for CUDA context, NCCL, fragmentation")
    p.add_argument("--json", action="store_true", help="JSON records on stdout instead of the table")
    p.add_argument("--measure", action="store_true",
                   help="also build the layer on engines (EP = engines) and compare measured with calculated")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="--measure: default cuda if a GPU is visible")
    p.add_argument("--engines", type=count(), default=None, help="--measure: default one per GPU (cuda) or 4 (cpu)")
    return p


def cmd(a) -> int:
    """`moe-lab scale`: the plan table (or JSON) for a preset; with --measure, measured against calculated."""
    from ..config import DISPATCHERS

    disps = [v.strip() for v in a.dispatcher.split(",") if v.strip()]
    bad = [v for v in disps if v not in DISPATCHERS]
    if bad or not disps:
        raise ValueError(f"--dispatcher {a.dispatcher!r}: each value must be one of {', '.join(DISPATCHERS)}")
    cfg = presets()[a.preset].replace(router_dtype=a.router_dtype)
    if a.seq is not None:
        cfg = cfg.replace(seq_len=a.seq)
    eps = a.ep or DEFAULT_EPS[a.preset]
    for ep in eps:
        check_ep(cfg, ep)
    kw = dict(gated=a.gated, imbalance=a.imbalance, cut=a.cut, capture=a.capture, tflops=a.tflops,
              reserve_bytes=int(a.reserve_gib * GIB))
    moe_layers = DEEPSEEK_V3_MOE_LAYERS if a.preset == "deepseek-v3" else None
    rows = [plan(cfg, ep, dispatcher=d, moe_layers=moe_layers, **kw) for d in disps for ep in eps]
    recs = None
    if a.measure:
        recs = measured([cfg.replace(dispatcher=d) for d in disps], device=a.device, engines=a.engines, cut=a.cut)
    if a.json:
        print(json.dumps({"plan": rows, "measured": recs}, indent=2))
        return 0
    print(format_plan(rows))
    if moe_layers:
        need = {d: min_ep(cfg, moe_layers, dispatcher=d, **kw) for d in disps}
        print(f"\n{moe_layers} MoE layers (DeepSeek-V3) of this shape: parameters + one forward fit one GPU from EP = "
              + ", ".join(f"{n if n else 'none'} ({d})" for d, n in need.items()))
    if recs:
        print()
        print(format_measured(recs))
    return 0
