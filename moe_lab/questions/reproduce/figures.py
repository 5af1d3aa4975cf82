"""Notebook 01's figures: where and how far the ranks differ (per rank pair, in ULPs, per token and column), and how far each layout is from the reference. Records → seaborn figures; no numerics here."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...reporting.plots import applicable, case_label, not_applicable, zero_aware_heatmap


def pair_table(records: list[dict], metric: str = "mismatch_frac") -> pd.DataFrame:
    """Rows: rank pairs; columns: cases; values: `metric` of the cross-rank comparison."""
    rows = []
    for r in records:
        for pair, c in r["detail"]["pairs"].items():
            rows.append({"case": case_label(r), "pair": f"rank {pair}", metric: c[metric]})
    return pd.DataFrame(rows).pivot(index="pair", columns="case", values=metric)


def mismatch_by_pair(records: list[dict], ax=None):
    """Heatmap: differing output elements per rank pair (rank 0 vs r) and case (worst trial); green = bitwise equal."""
    if not applicable(records):
        return not_applicable(records, ax)
    recs = applicable(records)
    t = pair_table(recs, "n_mismatch")
    frac = pair_table(recs, "mismatch_frac")
    ann = pd.DataFrame([[("0" if a == 0 else f"{a:,.0f}\n{b:.2%}") if pd.notna(a) else "" for a, b in zip(rn, rf)]
                        for rn, rf in zip(t.values, frac.values)], index=t.index, columns=t.columns)
    ax = ax or plt.subplots(figsize=(1.7 * t.shape[1] + 2.5, 0.6 * t.shape[0] + 1.8))[1]
    zero_aware_heatmap(t, ax, annot=ann, label="differing elements")
    ax.set_title("Cross-rank output mismatch (same tokens on every rank; worst trial)")
    ax.set_xlabel("")
    ax.set_ylabel("")
    return ax


def ulp_histogram(records: list[dict], ax=None):
    """Distribution of ULP distances of differing elements, all pairs pooled, one line per case (log axes)."""
    if not applicable(records):
        return not_applicable(records, ax, "ULP distances across ranks")
    records = applicable(records)
    rows = []
    for r in records:
        for hist in r["detail"]["ulp_hist"].values():
            for d, n in hist.items():
                d = int(d)
                if d != 0:
                    rows.append({"case": case_label(r).replace("\n", " / "), "ulp": d if d > 0 else math.inf, "count": n})
    ax = ax or plt.subplots(figsize=(7, 3.8))[1]
    if not rows:
        ax.text(0.5, 0.5, "no differing elements: every pair bitwise equal", ha="center", va="center")
        ax.set_axis_off()
        return ax
    df = pd.DataFrame(rows)
    df = df[df.ulp != math.inf]
    df["log2 ulp bin"] = df.ulp.map(lambda u: int(math.floor(math.log2(u))))
    agg = df.groupby(["case", "log2 ulp bin"], as_index=False)["count"].sum()
    sns.barplot(agg, x="log2 ulp bin", y="count", hue="case", ax=ax)
    ax.set_yscale("log")
    ax.set_xlabel("ULP distance, log2 bin (0 = 1 ULP, 1 = 2–3, ...)")
    ax.set_ylabel("elements")
    ax.set_title("How far apart the differing elements are")
    return ax


def mismatch_map(record: dict, pair: str | None = None, ax=None):
    """Where in the [tokens x hidden] output the differences sit, for one case and rank pair (log colour scale; a
    pair that is bitwise equal is drawn in the zero colour and says so)."""
    maps = record["detail"]["mismatch_map"]
    pair = pair or max(maps, key=lambda k: record["detail"]["pairs"][k]["mismatch_frac"])
    m = maps[pair]
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    df = pd.DataFrame(m["frac"])
    zero_aware_heatmap(df, ax, annot=False, label="fraction differing")
    ax.set_xticks([])
    ax.set_yticks([])
    ax.set_xlabel(f"hidden ({m['hidden_per_bin']:.0f} per cell)")
    ax.set_ylabel(f"token ({m['tokens_per_bin']:.0f} per cell)")
    n = record["detail"]["pairs"][pair].get("n_mismatch", 0)
    ax.set_title(f"{case_label(record).replace(chr(10), ', ')}: rank {pair}"
                 + (" — bitwise equal" if not n else f" — {n:,} differ"), fontsize=9)
    return ax


def mismatch_maps(records: list[dict]):
    """One mismatch map per case, side by side."""
    if not applicable(records):
        return not_applicable(records, None, "where ranks differ").figure
    records = applicable(records)
    n = len(records)
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(n / cols)), squeeze=False)
    for ax, r in zip(axes.flat, records):
        mismatch_map(r, ax=ax)
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.tight_layout()
    return fig


def layout_heatmap(records: list[dict], ax=None):
    """Notebook 01's layout question: rows dispatcher / router dtype (/ deterministic mode), columns the layouts, each
    cell the worst trial's fraction of output elements that differ from the reference layout (bitwise equal: the zero
    colour)."""
    recs = [r for r in records if r.get("kind") == "layout" and isinstance(r.get("vs_reference"), dict)
            and "n_mismatch" in r["vs_reference"]]
    if not recs:
        return not_applicable(records, ax, "layout comparison")
    rows = pd.DataFrame([{"case": f"{r['dispatcher']} / router {r['router_dtype']}"
                                  + (" / deterministic" if r.get("deterministic") else ""), "layout": r["layout"],
                          "frac": r["vs_reference"]["mismatch_frac"]} for r in recs])
    table = rows.pivot_table(index="case", columns="layout", values="frac", aggfunc="max", sort=False)
    if ax is None:
        _, ax = plt.subplots(figsize=(1.6 + 1.7 * table.shape[1], 0.9 + 0.5 * table.shape[0]))
    zero_aware_heatmap(table, ax, label="fraction of output elements differing from the reference")
    ax.set_title(f"against {recs[0]['reference_layout']} (same weights, same tokens)")
    ax.set_xlabel("")
    ax.set_ylabel("")
    return ax
