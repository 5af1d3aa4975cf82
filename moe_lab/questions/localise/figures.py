"""Notebook 02's figures: per stage of the forward, how many elements differ across ranks, and how the difference grows along the stages. Records → seaborn figures; no numerics here."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...reporting.plots import TEXT_PT, colours, count_words, describe, fraction_words, message, stage_heatmap


def stage_heatmaps(stage_rows: pd.DataFrame, by=("dispatcher", "variant")):
    """One stage heatmap per case (dispatcher x variant), in a grid."""
    if "mismatch_frac" not in stage_rows or stage_rows["mismatch_frac"].dropna().empty:
        return message("no stage could be compared (one rank: no other rank and no copies)").figure
    groups = list(stage_rows.groupby(list(by), sort=False))
    cols = 3 if len(groups) > 2 else len(groups)
    rows = math.ceil(len(groups) / cols)
    n_stages = stage_rows["stage"].nunique()
    fig, axes = plt.subplots(rows, cols, figsize=(6.2 * cols, (0.33 * n_stages + 2.2) * rows), squeeze=False)
    nz = stage_rows["mismatch_frac"][stage_rows["mismatch_frac"] > 0]
    scale = (float(nz.min()), float(nz.max())) if len(nz) else None  # one colour scale for every panel
    for ax, (key, g) in zip(axes.flat, groups):
        stage_heatmap(g, ax=ax, title=" / ".join(map(str, key)), scale=scale)
    for ax in list(axes.flat)[len(groups):]:
        ax.set_axis_off()
    fig.tight_layout()
    firsts = []
    for key, g in groups:
        d = g.dropna(subset=["mismatch_frac"])
        first = d[d["mismatch_frac"] > 0].sort_values("order")["stage"]
        firsts.append(f"{' / '.join(map(str, key))}: " + (f"first differs at {first.iloc[0]}" if len(first)
                                                          else "every stage bitwise equal"))
    cells = stage_rows.dropna(subset=["mismatch_frac"]).groupby(list(by) + ["stage", "unit"])["mismatch_frac"].max()
    describe(fig, f"Heatmaps, one per case ({len(groups)}): bitwise mismatch fraction per forward stage "
                  f"({n_stages} stages, execution order) and comparison (rank pairs, copies), one log colour scale, "
                  f"hatched = exactly 0; {count_words(int((cells == 0).sum()), len(cells), 'cells exactly 0')}; "
                  f"{'; '.join(firsts)}")
    return fig


def divergence_growth(stage_rows: pd.DataFrame, ax=None):
    """Worst mismatch fraction per stage, in execution order, one line per case: how divergence grows."""
    if "mismatch_frac" not in stage_rows or stage_rows["mismatch_frac"].dropna().empty:
        return message("no stage could be compared", ax)
    df = stage_rows.dropna(subset=["mismatch_frac"]).copy()
    df["case"] = df["dispatcher"] + " / " + df["variant"]
    g = df.groupby(["case", "order", "stage"], as_index=False)["mismatch_frac"].max().sort_values("order")
    ax = ax or plt.subplots(figsize=(10, 4))[1]
    cases = list(dict.fromkeys(g["case"]))
    sns.lineplot(g, x="order", y="mismatch_frac", hue="case", style="case", marker="o", ax=ax,
                 palette=dict(zip(cases, colours(len(cases)))))
    ticks = g.drop_duplicates("order")
    ax.set_xticks(ticks["order"], ticks["stage"], rotation=60, ha="right", fontsize=8)
    ax.set_xlabel("")
    ax.set_ylabel("worst bitwise mismatch fraction")
    ax.set_title("Divergence stage by stage")
    ax.legend(fontsize=TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    last = g.sort_values("order").groupby("case")["mismatch_frac"].last()
    describe(ax, f"Line chart: worst bitwise mismatch fraction across ranks at each forward stage ({len(ticks)} "
                 f"stages, execution order), one line per case ({len(cases)}); at the last stage "
                 + "; ".join(f"{c}: {fraction_words(v)}" for c, v in last.items()))
    return ax
