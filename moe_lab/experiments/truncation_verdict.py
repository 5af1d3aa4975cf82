"""Notebook 04's findings from its records: the summary table and the verdict — reproduction (in k of N trials),
attribution with its evidence, and the cheapest remedy that holds in every trial. Costs are paired ratios with a
95 % interval; the no-remedy case of the same setting is the A/A noise floor: a cost whose interval overlaps it is
"no measurable cost", and remedies are never ranked inside the noise. A setting is (world, CUBLAS_WORKSPACE_CONFIG,
emulation): on GPUs the remedies are measured with the workspace unset and set to ':4096:8'."""

from __future__ import annotations

from .. import stats
from .labels import rem_label
from .remedies import EMULATIONS, parse
from .truncation import COST_GOAL


def _cases(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "case" and r.get("available")]


def _setting(r: dict) -> str:
    return f"EMULATED {r['emulation']}" if r["emulated"] else "real layer"


def _ws(r: dict) -> str:
    return r.get("workspace") or "unset"


def _key(r: dict) -> tuple:
    return (r["world"], _ws(r), r["emulation"])


def _floor(cases: list[dict], r: dict) -> dict | None:
    """The A/A noise floor of r's setting: the no-remedy case of the same dispatcher, world, workspace, emulation."""
    return next((x.get("cost") for x in cases if x["remedy"] == "none" and x["dispatcher"] == r["dispatcher"]
                 and _key(x) == _key(r)), None)


def _holds(r: dict) -> bool:
    return r["truncation"]["bitwise_equal"] and r["rerun"]["bitwise_equal"]


def _trials(c: dict) -> str:
    n = c.get("trials", 1)
    return "" if n <= 1 else (f" in all {n} trials" if c["bitwise_equal"] else f" in {c['n_differ']} of {n} trials")


def _cmp(c: dict) -> str:
    if c["bitwise_equal"]:
        return "bitwise equal" + _trials(c)
    return (f"{c['n_mismatch']:,} of {c['numel']:,} elements differ{_trials(c)}, max {c['max_ulp']:.0f} ULP, "
            f"max abs {c['max_abs']:.3g}, allclose(1e-3) {'passes' if c['allclose_1e3'] else 'fails'}")


def summary_table(records: list[dict], remedy: str | None = None):
    """Cases as a readable DataFrame (one row per world x workspace x dispatcher x setting x remedy)."""
    import pandas as pd

    cases = _cases(records)
    rows = []
    for r in cases:
        if remedy is not None and r["remedy"] != remedy:
            continue
        t, rr = r["truncation"], r["rerun"]
        floor = _floor(cases, r) if r["remedy"] != "none" else None
        rows.append({"EP": r["world"], "workspace": _ws(r), "dispatcher": r["dispatcher"], "setting": _setting(r),
                     "remedy": rem_label(r["remedy"], r.get("tile")),
                     f"first {r['cut']} tokens": "bitwise equal" + _trials(t) if t["bitwise_equal"]
                     else f"{t['n_mismatch']:,} of {t['numel']:,} differ{_trials(t)}",
                     "max ULP": f"{t['max_ulp']:.0f}", "max abs": f"{t['max_abs']:.3g}",
                     "allclose 1e-3": t["allclose_1e3"],
                     "rerun": "equal" + _trials(rr) if rr["bitwise_equal"] else f"differs{_trials(rr)}",
                     "1 ULP fails allclose at": f"{r['one_ulp_fails_frac']:.1%} of outputs",
                     "time / plain (95 % CI)": ("A/A noise floor: " if r["remedy"] == "none" else "")
                     + stats.describe(r.get("cost"), floor)})
    df = pd.DataFrame(rows)
    if not df.empty and df["EP"].nunique() == 1:
        df = df.drop(columns="EP")
    if not df.empty and df["workspace"].nunique() == 1:
        df = df.drop(columns="workspace")
    return df


def _effect(sub: list[dict], remedy: str) -> str | None:
    """'deterministic → rerun equal everywhere; first tokens still differ for allgather' over the dispatchers."""
    rs = [r for r in sub if r["remedy"] == remedy]
    if not rs:
        return None
    t_bad = list(dict.fromkeys(r["dispatcher"] for r in rs if not r["truncation"]["bitwise_equal"]))
    r_bad = list(dict.fromkeys(r["dispatcher"] for r in rs if not r["rerun"]["bitwise_equal"]))
    t = "first tokens equal in every trial" if not t_bad else f"first tokens still differ for {', '.join(t_bad)}"
    rr = "rerun equal" if not r_bad else f"rerun differs for {', '.join(r_bad)}"
    return f"{rem_label(remedy, rs[0].get('tile'))} → {t}, {rr}"


def ranking(cases: list[dict]) -> dict:
    """Of one setting's cases (every dispatcher): the remedies whose every dispatcher holds in every trial, split into
    'free' (no measurable cost against the noise floor for every dispatcher) and 'costed' (sorted by the worst
    dispatcher's ratio), and whether the cheapest costed one is resolved from the next (intervals apart)."""
    groups: dict = {}
    for r in cases:
        if r["remedy"] != "none":
            groups.setdefault((r["remedy"], r.get("tile")), []).append(r)
    ok = [g for g in groups.values() if all(_holds(x) for x in g)]
    free, costed = [], []
    for g in ok:
        floors = [_floor(cases, x) for x in g]
        resolved = [stats.measurable(x.get("cost"), f) for x, f in zip(g, floors)]
        worst = max(g, key=lambda x: (x.get("cost") or {}).get("ratio") or float("inf"))
        entry = {"remedy": g[0]["remedy"], "tile": g[0].get("tile"), "cost": worst.get("cost"),
                 "floor": _floor(cases, worst), "dispatchers": [x["dispatcher"] for x in g]}
        (free if all(m is False for m in resolved) else costed).append(entry)
    costed.sort(key=lambda e: (e["cost"] or {}).get("ratio") or float("inf"))
    tie = (len(costed) > 1 and costed[0]["cost"] and costed[1]["cost"]
           and costed[1]["cost"]["ci"][0] <= costed[0]["cost"]["ci"][1])
    return {"free": free, "costed": costed, "tie": bool(tie)}


def _cheapest_text(rk: dict, device: str, emulated: bool) -> str:
    if rk["free"]:
        return ("at no measurable cost (interval inside the noise floor): "
                + ", ".join(rem_label(e["remedy"], e["tile"]) for e in rk["free"]))
    if not rk["costed"]:
        return "no remedy tried keeps the first tokens and a rerun bitwise equal for every dispatcher in every trial"
    best = rk["costed"][0]
    text = f"cheapest: {rem_label(best['remedy'], best['tile'])}, {stats.describe(best['cost'], best['floor'])}"
    if rk["tie"]:
        nxt = rk["costed"][1]
        text += f" — not resolved from {rem_label(nxt['remedy'], nxt['tile'])} ({stats.describe(nxt['cost'])})"
    if device == "cpu":
        text += " (CPU time, not a GPU cost)"
    elif not emulated:
        text += f" ({'within' if best['cost']['ratio'] <= COST_GOAL else 'above'} the {COST_GOAL}x goal)"
    return text


def verdict(records: list[dict]) -> str:
    """Plain-language verdict from the records: reproduction, attribution, and the cheapest remedy that holds."""
    cases = _cases(records)
    if not cases:
        return "No case ran."
    r0 = cases[0]
    cut = r0["cut"]
    lines = [f"megatron-core {r0['megatron_core']} on {r0.get('gpu') or r0['device']}, router {r0['router_dtype']}, "
             f"first {cut} of {r0['config']['seq_len']} tokens vs the same input with tokens {cut}+ zeroed, "
             f"EP = {', '.join(map(str, sorted({r['world'] for r in cases})))}:"]
    rts = [r for r in records if r.get("kind") == "routing"]
    for rt in rts[:1]:
        same = [r["dispatcher"] for r in rts
                if r["routing"]["routing_map_equal"] and r["routing"]["probs"]["bitwise_equal"]]
        diff = [r["dispatcher"] for r in rts if r["dispatcher"] not in same]
        rows = rt["rows_per_expert"]
        delta = [t - f for f, t in zip(rows["full"], rows["truncated"])]
        z = rt["zero_tokens"]
        lines.append(f"- Routing of the first {cut} tokens: "
                     + (f"identical (routing map and {rt['routing']['probs_dtype']} probs bitwise) for "
                        f"{', '.join(dict.fromkeys(same))}" if same else "")
                     + (f"; CHANGES for {', '.join(diff)}" if diff else "")
                     + f". Zeroed tokens have logits {z['max_abs_logit']:g} and all go to experts "
                     f"{' / '.join('{' + ', '.join(map(str, e)) + '}' for e in z['expert_sets'])}, so "
                     f"the rows per expert GEMM change by {min(delta):+d} … {max(delta):+d} (EP={rt['world']}).")
        if "truncated+padding_mask" in rows:
            keep = rows["truncated+padding_mask"] == rows["truncated"]
            lines.append(f"- padding_mask: rows per expert {'unchanged' if keep else 'changed'} by the mask — "
                         + ("this release still dispatches and computes padded tokens." if keep
                            else "padded tokens leave the experts."))
    for lin, kern in _kernel_by_linear(records, "none").items():
        bad = [r["M"] for r in kern if not r["kernel"]["bitwise_equal"]]
        fixed = {rem: all(r["kernel"]["bitwise_equal"] for r in ks)
                 for rem, ks in ((rem, _kernel_by_linear(records, rem).get(lin, [])) for rem in
                                 ("no_splitk", "tiled_experts")) if ks}
        lines.append(f"- Expert {lin} GEMM, real kernel: the first {kern[0]['m']} rows are "
                     + (f"bit-identical for every M in {[r['M'] for r in kern]} (batch invariant)." if not bad
                        else f"different when computed inside M = {bad} rows (batch variant)"
                        + ("; " + ", ".join(f"{k}: {'invariant' if v else 'still variant'}" for k, v in fixed.items())
                           if fixed else "") + "."))
    for key in sorted({_key(r) for r in cases}, key=lambda k: (k[0], k[1] != "unset", len(parse(k[2], EMULATIONS,
                                                                                                  "emulation")))):
        world, ws, emu = key
        sub = [r for r in cases if _key(r) == key]
        name = (f"EP={world}" + (f", CUBLAS_WORKSPACE_CONFIG={ws}" if ws != "unset" or r0["device"] == "cuda" else "")
                + f", {_setting(sub[0])}")
        plain = [r for r in sub if r["remedy"] == "none"]
        lines.append(f"- {name}, no remedy: " + "; ".join(
            f"{r['dispatcher']} {_cmp(r['truncation'])}, rerun {'equal' if r['rerun']['bitwise_equal'] else 'differs'}"
            + _trials(r["rerun"]) for r in plain) + ".")
        effects = [e for e in (_effect(sub, m) for m in ("deterministic", "ordered_combine", "tiled_experts",
                                                          "no_splitk", "padding_mask")) if e]
        if effects and any(not r["truncation"]["bitwise_equal"] for r in plain):
            lines.append("  alone: " + "; ".join(effects) + ".")
        if any(not _holds(r) for r in plain):
            lines.append("  " + _cheapest_text(ranking(sub), r0["device"], sub[0]["emulated"]) + ".")
        na = {rem_label(r["remedy"], r.get("tile")): r["reason"] for r in records
              if r.get("kind") == "case" and r.get("available") is False and _key(r) == key}
        if na:
            lines.append("  not run here: " + "; ".join(f"{k} ({v})" for k, v in na.items()) + ".")
    real = [r for r in cases if not r["emulated"] and r["remedy"] == "none"]
    if real and all(r["truncation"]["bitwise_equal"] for r in real):
        lines.append("Verdict: the real layer passes the truncation test bitwise in every trial here"
                     + (" (CPU GEMMs and the CPU combine are batch invariant); the failure and its remedies are shown "
                        "under EMULATION of the GPU mechanisms." if any(r["emulated"] for r in cases) else "."))
    elif real:
        lines.append("Verdict: the truncation test fails on the real layer; " + _causes(records, cases) + ".")
    return "\n".join(lines)


def _causes(records: list[dict], cases: list[dict]) -> str:
    """What the real-layer experiments support as causes, each with its evidence (no cause is assumed)."""
    real = [r for r in cases if not r["emulated"]]
    out = []
    rts = [r for r in records if r.get("kind") == "routing"]
    if any(not (r["routing"]["routing_map_equal"] and r["routing"]["probs"]["bitwise_equal"]) for r in rts):
        out.append("the routing of the first tokens itself changes")
    elif rts:
        out.append("the first tokens route identically")
    kern = [r for ks in _kernel_by_linear(records, "none").values() for r in ks]
    bad = {lin: [r["M"] for r in ks if not r["kernel"]["bitwise_equal"]]
           for lin, ks in _kernel_by_linear(records, "none").items()}
    bad = {lin: ms for lin, ms in bad.items() if ms}
    fixes = [r for r in real if ("tiled_experts" in r["remedy"] or "no_splitk" in r["remedy"])
             and r["truncation"]["bitwise_equal"]]
    gemm_fix = list(dict.fromkeys(rem_label(r["remedy"], r["tile"]) for r in fixes))
    if bad or gemm_fix:
        ev = [f"{lin}'s rows change with M = {ms}" for lin, ms in bad.items()] + \
             ([f"bitwise equal again with {', '.join(gemm_fix[:3])}"] if gemm_fix else [])
        if kern and not bad:  # the probe's M values saw no variance: say so rather than contradict it
            ev.append(f"the kernel probe at M = {[r['M'] for r in kern]} saw none, so the variance is at the layer's "
                      "own, uneven row counts per expert")
        out.append("the expert GEMMs are batch variant (" + "; ".join(ev) + ")")
    plain = [r for r in real if r["remedy"] == "none"]
    if any(not r["rerun"]["bitwise_equal"] for r in plain):
        fixed = [x for x in ("deterministic", "ordered_combine")
                 if any(r["remedy"] == x and r["rerun"]["bitwise_equal"] for r in real)]
        out.append("the combine's accumulation order changes from run to run (a rerun differs"
                   + (f"; {' and '.join(fixed)} make the rerun equal" if fixed else "") + ")")
    if not any(x != "the first tokens route identically" for x in out):
        out.append("no cause isolated by these experiments")
    return "; ".join(out)


def _kernel_by_linear(records: list[dict], remedy: str) -> dict[str, list[dict]]:
    """Real-kernel probe rows of one remedy state, by linear (fc1, fc2), of the first world probed."""
    ks = [r for r in records if r.get("kind") == "kernel" and not r["emulated"] and r["remedy"] == remedy]
    worlds = sorted({r["world"] for r in ks})
    out: dict[str, list[dict]] = {}
    for r in ks:
        if r["world"] == worlds[0]:
            out.setdefault(r.get("linear", "fc1"), []).append(r)
    return out


def setting_note(records: list[dict]) -> str:
    """What the cases ran on: the real layer, and — only where the records hold some — the EMULATED GPU mechanisms."""
    cases = _cases(records)
    emus = sorted({r["emulation"] for r in cases if r["emulated"]})
    ws = sorted({_ws(r) for r in cases})
    text = "Cases on the real layer" + (f", repeated with CUBLAS_WORKSPACE_CONFIG {' and '.join(ws)}" if len(ws) > 1
                                        else "") + "."
    if emus:
        text += (f" Also under EMULATION ({', '.join(emus)}) of the GPU mechanisms, because this device's kernels are "
                 "batch invariant: `splitk` = each expert GEMM splits its K reduction by a GPU-like heuristic on M "
                 "(fp32 partials), `atomics` = the combine adds a token's expert outputs in a random order, rounding "
                 "every add, unless deterministic mode is on (like `scatter_add_` on a GPU). Emulated rows say "
                 "EMULATED everywhere; they are never GPU results.")
    return text


def cheapest(records: list[dict]) -> dict | None:
    """The hardest setting measured (the real layer on GPU, else the most emulation), at the largest world and the
    workspace that is unset: its cheapest remedy that holds in every trial, for the summary card."""
    cases = _cases(records)
    if not cases:
        return None
    key = max({_key(r) for r in cases}, key=lambda k: (k[0], k[1] == "unset",
                                                        -1 if cases[0]["device"] == "cuda" and k[2] != "none"
                                                        else len(parse(k[2], EMULATIONS, "emulation"))))
    sub = [r for r in cases if _key(r) == key]
    rk = ranking(sub)
    best = (rk["free"] or rk["costed"] or [None])[0]
    return None if best is None else {**best, "setting": key, "free": bool(rk["free"])}


__all__ = ["summary_table", "verdict", "ranking", "cheapest", "setting_note"]
