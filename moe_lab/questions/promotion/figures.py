"""Notebook 03's figures (07 draws its preset cells with them too): the settings grid's mismatch per release and dispatcher, and each setting's cost against the plain forward. Records → seaborn figures; no numerics here."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd

from ... import stats
from ...reporting.plots import NEUTRAL, TEXT_PT, ZERO_WORDS, colours, describe, fraction_words, heatmap_words, \
    message, zero_aware_heatmap


def sweep_heatmap(records: list[dict], metric: str = "cross_rank", ax=None, by: str = "release"):
    """Release x dispatcher (rows; `by="model"`: model preset x dispatcher) by remedy (columns): bitwise mismatch; ✓
    marks cells where ranks are bitwise equal and a rerun is too; n/a = the release lacks the setting."""
    rows = []
    for r in records:
        first = (r.get("config") or {}).get("model") or "?" if by == "model" else r["megatron_core"]
        row = {"release / dispatcher": f"{first} / {r['dispatcher']}",
               "setting": ("router " + r["router_dtype"] + (" +pf32" if r["probs_fp32_gather"] else "")
                           + (" +det" if r["deterministic"] else ""))}
        na = "skipped" in r or not r[metric].get("applicable", True)
        row["value"] = float("nan") if na else r[metric]["mismatch_frac"]
        row["label"] = "n/a" if na else ("✓" if r[metric]["bitwise_equal"] and r["rerun"]["bitwise_equal"]
                                         else "0\nrerun differs" if r[metric]["mismatch_frac"] == 0
                                         else fraction_words(r[metric]["mismatch_frac"]))
        rows.append(row)
    df = pd.DataFrame(rows)
    t = df.pivot(index="release / dispatcher", columns="setting", values="value")
    rank = {"none": 0, "fp32": 1, "fp64": 2}
    t = t[sorted(t.columns, key=lambda c: (rank.get(c.split()[1], 9), "+pf32" in c, "+det" in c))]
    lab = df.pivot(index="release / dispatcher", columns="setting", values="label").reindex_like(t)
    ax = ax or plt.subplots(figsize=(1.05 * t.shape[1] + 3, 0.55 * t.shape[0] + 2.2))[1]
    zero_aware_heatmap(t, ax, annot=lab.fillna("n/a"), label=f"{metric} mismatch fraction (worst trial)")
    ax.set_xlabel("")
    ax.set_ylabel("model / dispatcher" if by == "model" else "")
    ax.set_title(f"{metric}: ✓ = ranks and rerun bitwise equal in every trial; {ZERO_WORDS}; grey = n/a", fontsize=10)
    ticks = int((lab == "✓").sum().sum())
    describe(ax, f"Heatmap: {metric} mismatch fraction (worst trial) per {'model' if by == 'model' else 'release'} "
                 f"and dispatcher ({t.shape[0]} rows) and setting ({t.shape[1]} columns: {', '.join(t.columns)}); "
                 f"{heatmap_words(t, '.1%')}; {ticks} cells where ranks and rerun are bitwise equal in every trial")
    return ax


def cost_bars(cost_df: pd.DataFrame, ax=None):
    """Forward time of each setting relative to the plain bf16 forward (same release and dispatcher), from paired
    rounds: the median ratio with its interval (`stats.interval_name`); the plain cell is the A/A noise floor."""
    df = cost_df.copy()
    ax = ax or plt.subplots(figsize=(11, 4))[1]
    if df.empty:
        return message("no cost measured", ax)
    df["setting"] = ("router " + df["router_dtype"] + df["probs_fp32_gather"].map({True: " +pf32", False: ""})
                     + df["deterministic"].map({True: " +det", False: ""}))
    df["release / dispatcher"] = df["megatron_core"] + " / " + df["dispatcher"]
    groups = list(dict.fromkeys(df["release / dispatcher"]))
    settings = list(dict.fromkeys(df["setting"]))
    width = 0.8 / max(1, len(groups))
    for gi, (g, colour) in enumerate(zip(groups, colours(len(groups)))):
        sub = df[df["release / dispatcher"] == g].set_index("setting").reindex(settings)
        x = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(settings))]
        err = [sub["relative_time"] - sub["ci_low"], sub["ci_high"] - sub["relative_time"]]
        ax.bar(x, sub["relative_time"], width=width, yerr=err, capsize=2, label=g, color=colour,
               error_kw=dict(ecolor=NEUTRAL))
    ax.set_xticks(range(len(settings)), settings, rotation=45, ha="right")
    ax.axhline(1.0, color=NEUTRAL, lw=0.8, ls="--")
    ax.set_ylabel("forward time / plain bf16 forward")
    ax.legend(fontsize=TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ci = stats.interval_name(df["rounds"]) if "rounds" in df else stats.interval_name([])
    ax.set_title(f"Cost of each setting: median of paired rounds, {ci} (router none = A/A noise floor)")
    hi = df.loc[df["relative_time"].idxmax()]
    describe(ax, f"Bar chart: forward time of each setting ({len(settings)}) relative to the plain bf16 forward, per "
                 f"release and dispatcher ({len(groups)}), median with its {ci}; slowest "
                 f"{hi['relative_time']:.2f}× "
                 f"({hi['setting']}, {hi['release / dispatcher']})")
    return ax
