"""Notebook 04's findings from its records: the summary table and the verdict — reproduction (in k of N trials),
attribution with its evidence, and the cheapest remedy that holds in every trial. Costs are paired ratios with an
interval (`stats.interval_words`); the no-remedy case of the same setting is the A/A noise floor: a cost is worded by
where its interval lies against it (`stats.against_floor`: inside it is "no measurable cost"), and remedies are never
ranked inside the noise. A setting is (world, CUBLAS_WORKSPACE_CONFIG, emulation): on GPUs the remedies are measured
with the workspace unset and set to ':4096:8'."""

from __future__ import annotations

from ... import stats
from ...findings.labels import rem_label


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


def _trials(c: dict) -> str:
    n = c.get("trials", 1)
    return "" if n <= 1 else (f" in all {n} trials" if c["bitwise_equal"] else f" in {c['n_differ']} of {n} trials")


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
                     "time / plain (median, interval)": ("A/A noise floor: " if r["remedy"] == "none" else "")
                     + stats.describe(r.get("cost"), floor)})
    df = pd.DataFrame(rows)
    if not df.empty and df["EP"].nunique() == 1:
        df = df.drop(columns="EP")
    if not df.empty and df["workspace"].nunique() == 1:
        df = df.drop(columns="workspace")
    return df


def verdict(records: list[dict]) -> str:
    """Notebook 04's verdict: its findings (moe_lab.questions.truncation.findings), rendered."""
    from ...findings import render
    from . import findings as found

    cases = _cases(records)
    r0 = cases[0] if cases else None
    title = (f"megatron-core {r0['megatron_core']} on {r0.get('gpu') or r0['device']}, router {r0['router_dtype']}, "
             f"first {r0['cut']} of {r0['config']['seq_len']} tokens vs the same input with tokens {r0['cut']}+ "
             f"zeroed, EP = {', '.join(map(str, sorted({r['world'] for r in cases})))}:" if r0 else "")
    return render.verdict(found.findings(records), title=title)


def setting_note(records: list[dict]) -> str:
    """What the cases ran on: the real layer, and — only where the records hold some — the EMULATED GPU mechanisms."""
    cases = _cases(records)
    emus = sorted({r["emulation"] for r in cases if r["emulated"]})
    ws = sorted({_ws(r) for r in cases})
    text = "Cases on the real layer" + (f", repeated with CUBLAS_WORKSPACE_CONFIG {' and '.join(ws)}" if len(ws) > 1
                                        else "") + "."
    if emus:
        from . import findings as found

        kern = found.kernel_findings(records)
        why = ("; this device's own expert GEMMs " + ("were batch invariant in the kernel probe" if kern and all(
            f.status == "PASS" for f in kern) else "were not probed" if not kern else
            "are batch variant too (kernel probe), so real and emulated effects add up"))
        text += (f" Also under EMULATION ({', '.join(emus)}) of the GPU mechanisms{why}: `splitk` = each expert GEMM splits its K reduction by a GPU-like heuristic on M "
                 "(fp32 partials), `atomics` = the combine adds a token's expert outputs in a random order, rounding "
                 "every add, unless deterministic mode is on (like `scatter_add_` on a GPU). Emulated rows say "
                 "EMULATED everywhere; they are never GPU results.")
    return text


__all__ = ["summary_table", "verdict", "setting_note"]
