"""Notebook 08's figure: each run's output error to the fp64 truth (median and p99.9 of |error| in ULP), the layouts'
runs beside the planted faults, with the band the rule holds a run to. Records → matplotlib; the verdicts are the
findings' (`findings.judged`)."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from ...reporting.plots import TEXT_PT, colours, describe, message
from . import findings as found

STATISTICS = {"median": "median |error|", "p999": "p99.9 |error|"}
KINDS = ("layout (known-correct)", "planted fault: out of band", "planted fault: within band")


def frame(records: list[dict]) -> pd.DataFrame:
    rows = []
    for rec in records:
        if rec.get("kind") != "oracle" or "runs" not in rec:
            continue
        verdicts = found.judged(rec)
        for r in rec["runs"]:
            s = r["stats"].get("out/all") or {}
            kind = KINDS[0] if not r.get("fault") else KINDS[1] if not verdicts[r["label"]].in_band else KINDS[2]
            for st in STATISTICS:
                if st in s:
                    rows.append({"run": r["label"], "dispatcher": r.get("dispatcher"), "statistic": STATISTICS[st],
                                 "ULP": s[st], "kind": kind})
    return pd.DataFrame(rows)


def error_by_run(records: list[dict]):
    df = frame(records)
    if df.empty:
        return message("no oracle records: nothing to draw").figure
    stats = list(STATISTICS.values())
    runs = list(dict.fromkeys(df["run"]))
    fig, axes = plt.subplots(1, len(stats), figsize=(11, 0.28 * len(runs) + 1.6), squeeze=False, sharey=True)
    palette = dict(zip(KINDS, colours(len(KINDS))))
    markers = dict(zip(KINDS, ("o", "X", "s")))
    for ax, st in zip(axes[0], stats):
        sub = df[df["statistic"] == st]
        good = sub[sub["kind"] == KINDS[0]]["ULP"]
        if len(good):
            ax.axvspan(good.min(), good.max(), color=palette[KINDS[0]], alpha=0.15, lw=0,
                       label="layouts' range")
        for kind in KINDS:
            k = sub[sub["kind"] == kind]
            if len(k):
                ax.scatter(k["ULP"], [runs.index(x) for x in k["run"]], color=palette[kind], marker=markers[kind],
                           s=36, label=kind, zorder=3)
        ax.set_xscale("log")
        lo, hi = sub["ULP"][sub["ULP"] > 0].min(), sub["ULP"].max()
        ax.set_xlim(lo / 1.5, hi * 1.5)
        ax.set_title(f"output: {st} to the fp64 truth", fontsize=TEXT_PT + 1)
        ax.set_xlabel("ULP of the truth's bf16 value (log)")
        ax.grid(axis="x", alpha=0.3)
    axes[0][0].set_yticks(range(len(runs)), runs, fontsize=TEXT_PT)
    axes[0][0].invert_yaxis()
    handles, labels = axes[0][0].get_legend_handles_labels()
    fig.legend(handles, labels, loc="lower center", ncol=len(labels), frameon=False, fontsize=TEXT_PT + 1)
    fig.tight_layout(rect=(0, 0.06, 1, 1))
    med = df[df["statistic"] == stats[0]]
    good, bad = med[med["kind"] == KINDS[0]], med[med["kind"] == KINDS[1]]
    describe(fig, f"Dot plots, one per statistic ({', '.join(stats)}), of the output's error to the fp64 truth in ULP "
                  f"(log axis) for {len(runs)} runs: {len(good)} layout runs (median {good['ULP'].min():.3g}–"
                  f"{good['ULP'].max():.3g} ULP, shaded), {len(bad)} planted faults out of band"
                  + (f" (median {bad['ULP'].min():.3g}–{bad['ULP'].max():.3g} ULP)" if len(bad) else "")
                  + f", {int((med['kind'] == KINDS[2]).sum())} planted faults within band")
    return fig


__all__ = ["error_by_run", "frame"]
