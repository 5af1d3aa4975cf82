"""Notebook 06's records → figures: |Δloss|/loss and weight divergence against step per layout, rerun and setting;
routing flips per layer against step. The numbers come from `questions.training.findings.frame`; no numerics here, no torch."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from .findings import frame

FLOOR = 1e-12
"""Where a bitwise-equal step (0) is drawn on the log axes: below every measured difference (the title says so)."""


def _empty(text: str):
    ax = plt.subplots(figsize=(7, 1.5))[1]
    ax.text(0.5, 0.5, text, ha="center", va="center")
    ax.set_axis_off()
    return ax.figure


def _panels(df: pd.DataFrame, y: str, ylabel: str, title: str):
    """One panel per (stack, setting, mode), a line per run (hue: layout and run), y on a log axis with 0 at FLOOR."""
    df = df.assign(panel=df["layers"].astype(str) + " layer(s), " + df["setting"] + ", "
                   + df["deterministic"].map({True: "det", False: "nondet"}),
                   y=df[y].clip(lower=FLOOR))
    panels = list(dict.fromkeys(df["panel"]))
    cols = min(3, len(panels))
    rows = -(-len(panels) // cols)
    fig, axes = plt.subplots(rows, cols, figsize=(5.2 * cols, 3.4 * rows), squeeze=False, sharey=True)
    for ax, p in zip(axes.flat, panels):
        sub = df[df["panel"] == p]
        sns.lineplot(data=sub, x="step", y="y", hue="what", style="what", ax=ax, markers=False, linewidth=1.2,
                     errorbar=None)
        ax.set_yscale("log")
        ax.set_title(p, fontsize=9)
        ax.set_ylabel(ylabel)
        ax.legend(fontsize=7, title=None)
    for ax in list(axes.flat)[len(panels):]:
        ax.set_axis_off()
    fig.suptitle(f"{title} (against {df['reference'].iloc[0]} run 0; bitwise equal drawn at {FLOOR:g})",
                 fontsize=10)
    fig.tight_layout()
    return fig


def loss_divergence(records: list[dict]):
    """|loss − loss_ref| / loss_ref against step, log axis, per layout and rerun; a panel per stack, setting, mode."""
    df = pd.DataFrame([r for r in frame(records) if r["layer"] is None])
    if df.empty:
        return _empty("no training runs to compare")
    return _panels(df, "rel_loss", "|Δloss| / loss", "Relative loss difference")


def weight_divergence(records: list[dict]):
    """||w − w_ref|| / ||w_ref|| against step (estimated from random projections), per layout and rerun."""
    df = pd.DataFrame([r for r in frame(records) if r["layer"] is None])
    if df.empty:
        return _empty("no training runs to compare")
    return _panels(df, "weight_div", "||Δw|| / ||w||", "Weight divergence")


def routing_flips(records: list[dict], setting: str = "plain"):
    """Fraction of top-k slots that changed against the reference, per layer (columns) against step; one row of
    panels per stack and mode of `setting`."""
    df = pd.DataFrame([r for r in frame(records) if r["layer"] is not None and r["setting"] == setting])
    if df.empty:
        return _empty(f"no {setting} training runs to compare")
    mode = df["deterministic"].map({True: "det", False: "nondet"})
    df = df.assign(row=df["layers"].astype(str) + " layer(s), " + mode)
    rows_ = list(dict.fromkeys(df["row"]))
    L = int(df["layer"].max())
    fig, axes = plt.subplots(len(rows_), L, figsize=(4.6 * L, 3.0 * len(rows_)), squeeze=False, sharey=True)
    for i, rw in enumerate(rows_):
        for j in range(L):
            ax = axes[i][j]
            sub = df[(df["row"] == rw) & (df["layer"] == j + 1)]
            if sub.empty:
                ax.set_axis_off()
                continue
            sns.lineplot(data=sub, x="step", y="flips", hue="what", ax=ax, linewidth=1.2, errorbar=None)
            of = int(sub["of"].iloc[0])
            ax.set_title(f"{rw}: layer {j + 1} (of {of} top-k slots)", fontsize=9)
            ax.set_ylabel("flipped fraction")
            ax.legend(fontsize=7, title=None)
    fig.suptitle(f"Routing flips against the reference layout, {setting}", fontsize=10)
    fig.tight_layout()
    return fig


__all__ = ["loss_divergence", "weight_divergence", "routing_flips"]
