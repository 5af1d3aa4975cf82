"""Notebook 02's figures: per stage of the forward, how many elements differ across ranks, and how the difference grows along the stages. Records → seaborn figures; no numerics here."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...reporting.plots import stage_heatmap


def stage_heatmaps(stage_rows: pd.DataFrame, by=("dispatcher", "variant")):
    """One stage heatmap per case (dispatcher x variant), in a grid."""
    if "mismatch_frac" not in stage_rows or stage_rows["mismatch_frac"].dropna().empty:
        ax = plt.subplots(figsize=(7, 1.6))[1]
        ax.text(0.5, 0.5, "no stage could be compared (one rank: no other rank and no copies)", ha="center",
                va="center")
        ax.set_axis_off()
        return ax.figure
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
    return fig


def divergence_growth(stage_rows: pd.DataFrame, ax=None):
    """Worst mismatch fraction per stage, in execution order, one line per case: how divergence grows."""
    if "mismatch_frac" not in stage_rows or stage_rows["mismatch_frac"].dropna().empty:
        ax = ax or plt.subplots(figsize=(7, 1.6))[1]
        ax.text(0.5, 0.5, "no stage could be compared", ha="center", va="center")
        ax.set_axis_off()
        return ax
    df = stage_rows.dropna(subset=["mismatch_frac"]).copy()
    df["case"] = df["dispatcher"] + " / " + df["variant"]
    g = df.groupby(["case", "order", "stage"], as_index=False)["mismatch_frac"].max().sort_values("order")
    ax = ax or plt.subplots(figsize=(10, 4))[1]
    sns.lineplot(g, x="order", y="mismatch_frac", hue="case", marker="o", ax=ax)
    ticks = g.drop_duplicates("order")
    ax.set_xticks(ticks["order"], ticks["stage"], rotation=60, ha="right", fontsize=8)
    ax.set_xlabel("")
    ax.set_ylabel("worst bitwise mismatch fraction")
    ax.set_title("Divergence stage by stage")
    return ax
