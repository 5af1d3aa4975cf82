"""Notebook 05's records → figures: which comparisons (forward, gradients) each setting makes bitwise equal, where the
backward first differs, and how differences grow with depth. No numerics here; no torch."""

from __future__ import annotations

import matplotlib.pyplot as plt
import pandas as pd
import seaborn as sns

from ...findings.labels import FWD_CMPS, GRAD_CMPS
from .findings import frac
from ... import stats
from ...reporting.plots import NEUTRAL, TEXT_PT, ZERO_WORDS, colours, count_words, describe, heatmap_words, \
    message, stage_heatmap, zero_aware_heatmap

LABELS = {"cross_out": "out ranks", "rerun_out": "out rerun", "truncation_out": "out trunc.",
          "cross_dx": "dx ranks", "rerun_dx": "dx rerun", "truncation_dx": "dx trunc.",
          "cross_router_grad": "router grad ranks", "rerun_router_grad": "router grad rerun",
          "truncation_router_grad": "router grad trunc.", "experts_rerun": "expert grads rerun",
          "experts_truncation": "expert grads trunc."}


def effect_grid(records: list[dict]):
    """Setting (rows) x comparison (columns), one panel per dispatcher: the mismatch fraction (worst trial; input
    gradients over the elements of the loss's tokens, weights over every element), hatched = bitwise equal in every
    trial, grey = not applicable or not run here (the reason is in the verdict)."""
    back = [r for r in records if r.get("kind") == "backward"]
    disps = list(dict.fromkeys(r["dispatcher"] for r in back))
    cols = [LABELS[k] for k in FWD_CMPS + GRAD_CMPS]
    fig, axes = plt.subplots(1, len(disps), figsize=(8.5 * len(disps), 0.42 * len(back) / max(1, len(disps)) + 2.8),
                             squeeze=False)
    tables = {}
    for ax, d in zip(axes[0], disps):
        rows, ann = {}, {}
        for r in (x for x in back if x["dispatcher"] == d):
            name = r["setting"]
            if not r.get("available", True) or "skipped" in r:
                rows[name] = {c: float("nan") for c in cols}
                ann[name] = {c: "n/a" for c in cols}
                continue
            vals, txt = {}, {}
            for k in FWD_CMPS + GRAD_CMPS:
                c = r[k]
                if not c.get("applicable", True):
                    vals[LABELS[k]], txt[LABELS[k]] = float("nan"), "n/a"
                else:
                    vals[LABELS[k]] = frac(r, k)  # input gradients: over the loss's tokens (questions.compound.findings)
                    txt[LABELS[k]] = "0" if c["bitwise_equal"] else f"{frac(r, k):.1e}\n{c['n_differ']}/{c['trials']}"
            rows[name], ann[name] = vals, txt
        v = pd.DataFrame(rows).T[cols]
        tables[d] = v
        zero_aware_heatmap(v, ax, annot=pd.DataFrame(ann).T[cols], label="mismatch fraction")
        ax.set_title(f"{d}: forward and gradients ({ZERO_WORDS}, bitwise equal in every trial)", fontsize=10)
        ax.tick_params(axis="x", rotation=60, labelsize=8)
        ax.tick_params(axis="y", labelsize=8)
    fig.tight_layout()
    describe(fig, f"Heatmaps, one per dispatcher ({', '.join(disps)}): mismatch fraction (worst trial) per setting "
                  f"(rows) and comparison of forward outputs and gradients ({len(cols)} columns: {', '.join(cols)}); "
                  + "; ".join(f"{d}: {heatmap_words(v, '.1e')}" for d, v in tables.items()))
    return fig


def backward_stages(records: list[dict], settings=("plain", "router fp32")):
    """The gradient reaching each forward stage, in backward order: where the ranks (or copies) stop agreeing."""
    back = [r for r in records if r.get("kind") == "backward" and r.get("backward_stages") and r["setting"] in settings]
    if not back:
        return message("no backward capture").figure
    fig, axes = plt.subplots(1, len(back), figsize=(6.0 * len(back), 0.34 * len(back[0]["backward_stages"]) / 2 + 3),
                             squeeze=False)
    for ax, r in zip(axes[0], back):
        df = pd.DataFrame(r["backward_stages"]).dropna(subset=["mismatch_frac"])
        if df.empty:
            ax.text(0.5, 0.5, "nothing compared (one rank)", ha="center", va="center")
            ax.set_axis_off()
            continue
        stage_heatmap(df, ax=ax, title=f"{r['dispatcher']}, {r['setting']}: gradient at each stage (backward order)")
        ax.tick_params(axis="y", labelsize=7)
    fig.tight_layout()
    parts = []
    for r in back:
        df = pd.DataFrame(r["backward_stages"]).dropna(subset=["mismatch_frac"])
        first = df[df["mismatch_frac"] > 0].sort_values("order")["stage"] if not df.empty else df
        parts.append(f"{r['dispatcher']}, {r['setting']}: " + ("nothing compared" if df.empty else
                     f"first differs at {first.iloc[0]}" if len(first) else "every stage bitwise equal"))
    describe(fig, f"Heatmaps, one per case ({len(back)}): bitwise mismatch fraction of the gradient reaching each "
                  f"forward stage, in backward order, per comparison (log colour scale, {ZERO_WORDS}); "
                  + "; ".join(parts))
    return fig


def depth_growth(records: list[dict]):
    """Mismatch fraction after each layer (symlog: 0 is drawn at the bottom), per comparison; one panel per
    dispatcher x setting, line style = the stack (one layer repeated, or distinct layers). One denominator per axis:
    outputs over every output element, gradients over the elements of the loss's first `cut` tokens (which alone
    carry a gradient), in two rows of panels."""
    depth = [r for r in records if r.get("kind") == "depth" and "layer" in r]
    if not depth:
        return message("no depth case").figure
    rows = []
    for r in depth:
        for k, name, unit in (("cross_out", "outputs across ranks", "out"), ("rerun_out", "outputs, rerun", "out"),
                              ("truncation_out", "first tokens, truncation", "out"),
                              ("cross_grad", "input gradient across ranks", "grad"),
                              ("rerun_grad", "input gradient, rerun", "grad"),
                              ("truncation_grad", "first tokens' gradient, truncation", "grad")):
            c = r.get(k)
            if c and c.get("applicable", True):
                rows.append({"panel": f"{r['dispatcher']}, {r['setting']}", "layer": r["layer"], "comparison": name,
                             "unit": unit, "stack": r["stack"], "mismatch fraction": frac(r, k)})
    df = pd.DataFrame(rows)
    panels = list(dict.fromkeys(df["panel"]))
    units = [u for u in ("out", "grad") if (df["unit"] == u).any()]
    fig, axes = plt.subplots(len(units), len(panels), figsize=(5.2 * len(panels), 3.6 * len(units)), squeeze=False,
                             sharey=True)
    ylab = {"out": "fraction of output elements", "grad": "fraction of the loss tokens'\ngradient elements"}
    comparisons = list(dict.fromkeys(df["comparison"]))
    palette = dict(zip(comparisons, colours(len(comparisons))))
    for i, u in enumerate(units):
        for ax, p in zip(axes[i], panels):
            sub = df[(df.panel == p) & (df.unit == u)]
            if not sub.empty:
                sns.lineplot(sub, x="layer", y="mismatch fraction", hue="comparison", style="stack", markers=True,
                             ax=ax, legend=ax is axes[i][-1], palette=palette)
                ax.set_xticks(sorted(sub["layer"].unique()))
            ax.set_yscale("symlog", linthresh=1e-5)
            ax.set_ylim(-1e-6, 1.2)
            ax.set_title(p, fontsize=10)
            ax.set_ylabel(ylab[u])
        if axes[i][-1].get_legend():
            axes[i][-1].legend(fontsize=TEXT_PT, loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False)
    fig.suptitle("Growth with depth (0 = bitwise equal, drawn at the bottom)", fontsize=10)
    fig.tight_layout()
    deepest = df[df["layer"] == df["layer"].max()]
    zero = int((df["mismatch fraction"] == 0).sum())
    worst = deepest.loc[deepest["mismatch fraction"].idxmax()]
    describe(fig, f"Line charts, one per dispatcher and setting ({len(panels)}) and unit (outputs, gradients): "
                  f"mismatch fraction after each layer (1 to {int(df['layer'].max())}, symlog axis, 0 at the bottom) "
                  f"per comparison ({len(comparisons)}); {count_words(zero, len(df), 'points exactly 0')}; at the "
                  f"deepest layer the largest is {worst['mismatch fraction']:.2%} ({worst['panel']}, "
                  f"{worst['comparison']}, {worst['stack']})")
    return fig


def cost_bars(records: list[dict], ax=None):
    """Forward+backward step time of each setting relative to the plain step (paired rounds, the median with its
    interval: `stats.interval_name`)."""
    back = [r for r in records if r.get("kind") == "backward" and r.get("cost")]
    if not back:
        return message("no cost measured", ax)
    ax = ax or plt.subplots(figsize=(11, 3.8))[1]
    disps = list(dict.fromkeys(r["dispatcher"] for r in back))
    settings = list(dict.fromkeys(r["setting"] for r in back))
    w = 0.8 / len(disps)
    for i, (d, colour) in enumerate(zip(disps, colours(len(disps)))):
        by = {r["setting"]: r["cost"] for r in back if r["dispatcher"] == d}
        xs = [j + (i - (len(disps) - 1) / 2) * w for j, s in enumerate(settings) if s in by]
        c = [by[s] for s in settings if s in by]
        ax.bar(xs, [x["ratio"] for x in c], width=w, label=d, color=colour, error_kw=dict(ecolor=NEUTRAL),
               yerr=[[x["ratio"] - x["ci"][0] for x in c], [x["ci"][1] - x["ratio"] for x in c]], capsize=2)
    ax.set_xticks(range(len(settings)), settings, rotation=45, ha="right", fontsize=8)
    ax.axhline(1.0, color=NEUTRAL, lw=0.8, ls="--")
    ax.set_ylabel("step time / plain step")
    ax.legend(fontsize=TEXT_PT, loc="upper left", bbox_to_anchor=(1.01, 1), frameon=False)
    ci = stats.interval_name(x["cost"].get("rounds") for x in back)
    ax.set_title(f"Cost of a forward+backward step (median of paired rounds, {ci}; plain = A/A noise floor)")
    slow = max(back, key=lambda r: r["cost"]["ratio"])
    describe(ax, f"Bar chart: forward+backward step time of each setting ({len(settings)}) relative to the plain "
                 f"step, per dispatcher ({', '.join(disps)}), median with its {ci}; slowest "
                 f"{slow['cost']['ratio']:.2f}× ({slow['dispatcher']}, {slow['setting']})")
    return ax
