"""Notebook 01's figures: where and how far the ranks differ (per rank pair, in ULPs, per token and column), and how far each layout is from the reference. Records → seaborn figures; no numerics here."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd

from ...reporting.plots import (NEUTRAL, TEXT_PT, ZERO, ZERO_HATCH, ZERO_INK, ZERO_WORDS, applicable, case_label,
                                colours, count_words, describe, heatmap_words, message, not_applicable,
                                zero_aware_heatmap)


def pair_table(records: list[dict], metric: str = "mismatch_frac") -> pd.DataFrame:
    """Rows: rank pairs; columns: cases; values: `metric` of the cross-rank comparison."""
    rows = []
    for r in records:
        for pair, c in r["detail"]["pairs"].items():
            rows.append({"case": case_label(r), "pair": f"rank {pair}", metric: c[metric]})
    return pd.DataFrame(rows).pivot(index="pair", columns="case", values=metric)


def mismatch_by_pair(records: list[dict], ax=None):
    """Heatmap: differing output elements per rank pair (rank 0 vs r) and case (worst trial); hatched = bitwise equal."""
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
    describe(ax, f"Heatmap: output elements whose bits differ between rank 0 and rank r ({t.shape[0]} rank pairs, "
                 f"rows) per case ({t.shape[1]} cases, columns), worst trial; {heatmap_words(t, ',.0f')}")
    return ax


def ulp_bin(distance: int) -> int:
    """The histogram bin of a ULP distance: 0 for 0 (bitwise equal), b ≥ 1 for distances 2^(b-1) … 2^b − 1."""
    return 0 if distance == 0 else int(distance).bit_length()


def ulp_bin_label(b: int) -> str:
    """A bin's range in ULP: '0', '1', '2–3', '4–7', … (past 8192 as powers of two, '2¹⁴–2¹⁵−1', to stay short)."""
    if b <= 1:
        return str(b)
    lo, hi = 2 ** (b - 1), 2 ** b - 1
    return f"{lo}–{hi}" if hi < 16384 else f"2{_superscript(b - 1)}–2{_superscript(b)}−1"


def _superscript(n: int) -> str:
    return str(n).translate(str.maketrans("0123456789", "⁰¹²³⁴⁵⁶⁷⁸⁹"))


def ulp_bins(records: list[dict]) -> pd.DataFrame:
    """Elements per (case, ULP bin), every rank pair pooled; a column per bin from 0 to the widest distance measured,
    empty bins kept (0 elements); an 'inf' column where a distance was not finite (a NaN or inf on one side)."""
    rows = []
    for r in records:
        for hist in r["detail"]["ulp_hist"].values():
            for d, n in hist.items():
                d = int(d)
                rows.append({"case": case_label(r).replace("\n", " / "), "bin": "inf" if d < 0 else ulp_bin(d),
                             "count": int(n)})
    if not rows:
        return pd.DataFrame()
    df = pd.DataFrame(rows)
    top = max((b for b in df["bin"] if b != "inf"), default=0)
    cols = list(range(top + 1)) + (["inf"] if (df["bin"] == "inf").any() else [])
    t = df.pivot_table(index="case", columns="bin", values="count", aggfunc="sum", sort=False)
    return t.reindex(columns=cols).fillna(0).astype(int)


def ulp_histogram(records: list[dict], ax=None):
    """Elements per ULP distance (bins 0, 1, 2–3, 4–7, …; every bin up to the widest distance drawn, an empty one at
    zero height), all rank pairs pooled, one bar colour per case that has a differing element (log axis); the 0 bin
    (bitwise equal elements) is hatched. Cases whose every element is equal are named, not drawn."""
    if not applicable(records):
        return not_applicable(records, ax, "ULP distances across ranks")
    t = ulp_bins(applicable(records))
    differing = t[(t.drop(columns=[0]) > 0).any(axis=1)] if not t.empty else t
    equal = [c for c in t.index if c not in differing.index]
    if differing.empty:
        return message(f"no differing elements: every pair bitwise equal ({len(equal)} cases)", ax)
    ax = ax or plt.subplots(figsize=(max(7.0, 0.55 * differing.shape[1] + 2.5), 4.2))[1]
    w = 0.8 / len(differing)
    for i, (case, row) in enumerate(differing.iterrows()):
        xs = [j + (i - (len(differing) - 1) / 2) * w for j in range(len(row))]
        bars = ax.bar(xs, row.to_numpy(), width=w, color=colours(len(differing))[i], label=case)
        bars[0].set_hatch(ZERO_HATCH)  # bin 0: bitwise equal elements, marked as every exact 0 is
        bars[0].set_edgecolor(ZERO_INK)
    labels = [ulp_bin_label(b) if b != "inf" else "not finite" for b in differing.columns]
    ax.set_xticks(range(len(labels)), labels, rotation=45 if len(labels) > 8 else 0, ha="right" if len(labels) > 8
                  else "center", fontsize=TEXT_PT)
    ax.set_yscale("log")
    ax.set_xlabel("ULP distance between rank 0 and rank r (bin range; 0 = bitwise equal, hatched)")
    ax.set_ylabel("elements (log scale; an empty bin has no bar)")
    ax.set_title("How far apart the elements are")
    from matplotlib.patches import Patch

    handles = ax.get_legend_handles_labels()[0] + [Patch(facecolor=ZERO, hatch=ZERO_HATCH, edgecolor=ZERO_INK,
                                                         label="0 ULP: bitwise equal")]
    ax.legend(handles=handles, fontsize=TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    if equal:
        ax.text(1.01, 0.0, "bitwise equal in every pair\n(only bin 0, not drawn):\n" + "\n".join(equal),
                transform=ax.transAxes, fontsize=TEXT_PT, va="bottom", color=NEUTRAL)
    empty = [labels[j] for j, c in enumerate(differing.columns) if not differing[c].any()]
    per_case = "; ".join(f"{case}: {int(row.drop(0).sum()):,} of {int(row.sum()):,} elements differ, widest bin "
                         f"{labels[max(j for j, v in enumerate(row) if v)]} ULP" for case, row in differing.iterrows())
    describe(ax, f"Bar chart: elements per ULP-distance bin ({labels[0]} to {labels[-1]}, {len(labels)} bins"
                 + (f", {len(empty)} of them empty: {', '.join(empty)}" if empty else "")
                 + f"), rank pairs pooled, log scale; {per_case}"
                 + (f"; bitwise equal in every pair: {', '.join(equal)}" if equal else ""))
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
    describe(ax, f"Heatmap: where in the tokens × hidden output rank {pair} differ for "
                 f"{case_label(record).replace(chr(10), ', ')} ({df.shape[0]} × {df.shape[1]} cells of "
                 f"{m['tokens_per_bin']:.0f} tokens × {m['hidden_per_bin']:.0f} hidden each); "
                 + ("bitwise equal" if not n else f"{n:,} elements differ; {heatmap_words(df, '.1%')}"))
    return ax


def mismatch_maps(records: list[dict]):
    """One mismatch map per case, side by side."""
    if not applicable(records):
        return not_applicable(records, None, "where ranks differ").figure
    records = applicable(records)
    n = len(records)
    worst = [max(r["detail"]["mismatch_map"], key=lambda k: r["detail"]["pairs"][k]["mismatch_frac"]) for r in records]
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(n / cols)), squeeze=False)
    for ax, r in zip(axes.flat, records):
        mismatch_map(r, ax=ax)
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.tight_layout()
    equal = [case_label(r).replace("\n", " ") for r, p in zip(records, worst)
             if not r["detail"]["pairs"][p].get("n_mismatch", 0)]
    differ = [f"{case_label(r).replace(chr(10), ' ')}: {r['detail']['pairs'][p]['n_mismatch']:,} elements differ "
              f"(rank {p})" for r, p in zip(records, worst) if r["detail"]["pairs"][p].get("n_mismatch", 0)]
    describe(fig, f"Heatmaps, one per case ({n}): where in the tokens × hidden output rank 0 and its most different "
                  f"rank differ, fraction of each cell's elements (log colour scale, {ZERO_WORDS}); "
                  + count_words(len(equal), n, "cases bitwise equal") + (f"; {'; '.join(differ)}" if differ else ""))
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
    describe(ax, f"Heatmap: fraction of output elements that differ from the reference layout "
                 f"{recs[0]['reference_layout']}, per case ({table.shape[0]} rows) and layout ({table.shape[1]} "
                 f"columns: {', '.join(map(str, table.columns))}), worst trial; {heatmap_words(table, '.2%')}")
    return ax
