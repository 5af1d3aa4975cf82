"""`moe-lab bench`: its options, and its result as a table on stdout (the measuring is moe_lab.tools.bench)."""

from __future__ import annotations

import argparse
import json
import sys
from pathlib import Path

from ..config import MoEConfig
from ..fsio import check_writable_file
from .argtypes import count as _count, seconds as _seconds
from ..tools.bench import capture_overhead, run


def _mb(n) -> str:
    if n is None:
        return "—"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def format_table(result: dict) -> str:
    """The bench result as a markdown table, with the machine and load it was measured on."""
    m, st, rd, sw, cap, mem = (result[k] for k in ("machine", "settings", "ready", "sweep", "capture", "memory"))
    cfg = st["config"]
    tgt = {t["name"]: t for t in result["targets"]}

    def verdict(name):
        t = tgt[name]
        return f"{t['rule']}: {'met' if t['met'] else 'MISSED'}"

    load = result["load_1min"]
    lines = [
        f"moe_lab bench: {st['device']}, {st['world']} ranks ({st['backend']}), hidden {cfg['hidden']} / "
        f"{cfg['num_experts']} experts / top-{cfg['topk']} / ffn {cfg['ffn_hidden']} / {cfg['seq_len']} tokens, "
        f"{cfg['dtype']}; medians of {st['repeats']}{' (quick)' if st['quick'] else ''}",
        f"{m['host']}, {m['cores']} cores, {m['gpu'] or 'no GPU'}; Python {m['python']}, torch {m['torch']}, "
        f"megatron-core {m['megatron_core']}; {m['date']}; load average (1 min) {load['start']:.1f} at start, "
        f"{load['end']:.1f} at end",
        "",
        "| what | lab (warm cluster) | usual way (fresh spawn) | fresh / lab | target |",
        "| --- | --- | --- | --- | --- |",
        f"| ready: {st['world']} processes + process group + parallel_state + health all-reduce | "
        f"{rd['cluster_median_s']:.1f} s | {rd['fresh_median_s']:.1f} s "
        + ("(in the sweep's spawns) " if st["quick"] else f"({rd['fresh_total_median_s']:.1f} s to exit) ")
        + f"| {rd['ratio']:.2f}x | |",
        f"| sweep of {sw['n_configs']} configs, results equal: {'yes' if sw['results_equal'] else 'NO'}"
        + (f" ({sw.get('n_compared', sw['n_configs'])} deterministic configs held equal)"
           if sw.get("n_compared", sw["n_configs"]) != sw["n_configs"] else "") + " | "
        f"{sw['warm_median_s']:.1f} s ({sw['warm_per_config_s']:.2f} s/config) | {sw['fresh_median_s']:.1f} s "
        f"({sw['fresh_per_config_s']:.1f} s/config) | {sw['ratio']:.1f}x | {verdict('sweep_speedup')} |",
        f"| the same sweep, cluster start included | {rd['cluster_median_s'] + sw['warm_median_s']:.1f} s | "
        f"{sw['fresh_median_s']:.1f} s | {sw['ratio_incl_start']:.1f}x | |",
        f"| forward ({cap['config']}), plain (median of {cap['rounds']} paired rounds) | "
        f"{cap['forward_ms']['plain']:.2f} ms | | | |",
    ]
    names = {"fingerprint": "+ fingerprint capture (moe.out, fingerprinted)",
             "capture": f"+ full capture ({cap['stages']} stages + collective ledger)",
             "capture_fingerprints": "+ full capture + every stage fingerprinted"}
    for mode, text in names.items():
        lo, hi = cap["overhead_ci_pct"][mode]
        lines.append(f"| {text} | {cap['forward_ms'][mode]:.2f} ms ({cap['overhead_pct'][mode]:+.1f} %, 95 % CI "
                     f"{lo:+.1f} … {hi:+.1f} %) | | | "
                     + (verdict("fingerprint_overhead_pct") if mode == "fingerprint" else "") + " |")
    for key, what in (("seed_shape", "compare one output across ranks (seed shape)"),
                      ("bench_shape", "compare one output across ranks (this layer)")):
        b = result["bytes"][key]
        lines.append(f"| {what}: [{' x '.join(map(str, b['shape']))}] {b['dtype']}, {b['world']} ranks | "
                     f"{b['fingerprint_bytes']} B (fingerprints) | {_mb(b['full_bytes'])} (full tensors) | "
                     f"{b['pct']:.4f} % | " + (verdict("compare_bytes_pct") if key == "seed_shape" else "") + " |")
    lines.append(f"| peak memory per engine (max over ranks): RSS after the sweep, after capture | "
                 f"{_mb(mem['max_rss_bytes'])}, {_mb(mem['with_capture']['max_rss_bytes'])} | "
                 f"{_mb(mem['fresh_max_rss_bytes'])} | | |")
    if mem["cuda_max_allocated_bytes"]:
        lines.append(f"| peak CUDA memory allocated per engine: after the sweep, after capture | "
                     f"{_mb(mem['cuda_max_allocated_bytes'])}, {_mb(mem['with_capture']['cuda_max_allocated_bytes'])} "
                     "| | | |")
    missed = [t for t in result["targets"] if not t["met"]]
    noted = [t for t in result["targets"] if t["met"] and t.get("note")]
    if missed or noted or sw["mismatches"] or sw.get("run_to_run"):
        lines.append("")
    for t in missed:
        lines.append(f"- {t['name']} {t['rule']} missed ({t['value']:.3g}): {t['reason']}")
    for t in noted:
        lines.append(f"- {t['name']} {t['rule']} met ({t['value']:.3g}), but {t['note']}")
    for mm in sw["mismatches"]:
        lines.append(f"- results differ: {mm}")
    for mm in sw.get("run_to_run", []):
        lines.append(f"- not held equal (no deterministic mode on GPU: every run is a sample): {mm}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `moe-lab bench`."""
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--engines", type=_count(), default=None, help="default: one per GPU (cuda) or 4 (cpu)")
    p.add_argument("--seed-report", action="store_true",
                   help="the seed report's layer (default on cuda; on cpu the small layer of MoEConfig())")
    p.add_argument("--repeats", type=_count(), default=3, help="every figure is the median of this many runs")
    p.add_argument("--quick", action="store_true",
                   help="2 configs (allgather, router none and fp32), 1 repeat, the small layer unless "
                        "--seed-report (CI; a short GPU run)")
    p.add_argument("--cut", type=int, default=90, help="truncation test: first CUT tokens must not change")
    p.add_argument("--timeout", type=_seconds, default=300.0, help="seconds for every engine call and collective")
    p.add_argument("--capture-only", type=_count(), default=None, metavar="ROUNDS",
                   help="only the capture overhead, from ROUNDS paired rounds (no fresh spawns)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                   help="write the result as JSON to OUT ('-': stdout, the table then goes to stderr)")
    return p


def cmd(a: argparse.Namespace) -> int:
    """Run the bench for parsed arguments: table on stdout, JSON to --json; exit 1 if the two paths disagree."""
    config = MoEConfig.seed_report() if a.seed_report else None
    if a.json_out and a.json_out != "-":  # before minutes of measuring: a path that cannot take the JSON, one line
        check_writable_file(a.json_out, "--json")
    if a.capture_only is not None:
        res = capture_overhead(device=a.device, engines=a.engines, config=config, rounds=a.capture_only,
                               timeout_s=a.timeout)
        text = json.dumps(res, indent=2, default=str)
        cap = res["capture"]
        for mode, pct in cap["overhead_pct"].items():
            lo, hi = cap["overhead_ci_pct"][mode]
            print(f"{mode:22s} {cap['forward_ms'][mode]:9.2f} ms  {pct:+8.1f} % (95 % CI {lo:+.1f} … {hi:+.1f} %), "
                  f"{res['rounds']} paired rounds, {cap['config']}")
        print(f"plain                  {cap['forward_ms']['plain']:9.2f} ms")
        if a.json_out == "-":
            print(text)
        elif a.json_out:
            _write_json(a.json_out, text)
        return 0
    res = run(device=a.device, engines=a.engines, config=config, repeats=a.repeats, quick=a.quick, cut=a.cut,
              timeout_s=a.timeout)
    table = format_table(res)
    text = json.dumps(res, indent=2, default=str)
    if a.json_out == "-":
        print(table, file=sys.stderr)
        print(text)
    else:
        print(table)
        if a.json_out:
            _write_json(a.json_out, text)
        else:
            print()
            print(text)
    return 0 if res["sweep"]["results_equal"] else 1


def _write_json(path: str, text: str) -> None:
    """The result into --json; if the path stopped taking writes while the bench ran (checked before it), the JSON
    goes to stdout instead, so the figures are not lost, and the failure is one line (exit 2)."""
    try:
        Path(path).write_text(text + "\n")
    except OSError as e:
        print(text)
        raise ValueError(f"--json {path}: cannot be written ({e.strerror or type(e).__name__}); the result is on "
                         "stdout above") from None
