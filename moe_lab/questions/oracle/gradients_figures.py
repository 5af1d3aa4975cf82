"""Notebook 08's gradient and training figures, from records only (`gradients`, `trajectory`): each run's error to the
fp64 truth in ULPs of the truth's bf16 value — per tensor for one step's gradients, per step for the trajectory — the
correct runs' range shaded, every planted run drawn on its own. No numerics beyond reading the records; no torch.

The notebook draws them with

    from moe_lab.questions.oracle import gradients_figures
    gradients_figures.gradient_errors(records)      # one step: input, router and expert gradients
    gradients_figures.trajectory_errors(records)    # K steps: the weights and the gradient of each step
"""

from __future__ import annotations

import math

import matplotlib.pyplot as plt

from ...reporting.plots import NEUTRAL, PALETTE, TEXT_PT, describe, message
from .gradients_findings import GRADIENTS, TRAJECTORY, name_of, planted

CORRECT, BUG = PALETTE[0], PALETTE[3]
TENSORS = {"input.all": "input gradient", "router.all": "router gradient", "experts.all": "expert gradients"}
STATISTICS = ("median", "p99", "max")
TRAJECTORY_GROUPS = {"weights.experts.all": "expert weights after the step",
                     "grad.experts.all": "expert gradients of the step",
                     "weights.router.all": "router weights after the step",
                     "grad.router.all": "router gradient of the step"}


def _runs(records: list[dict], experiment: str) -> dict[str, dict]:
    return {name_of(r): r for r in records if isinstance(r, dict) and r.get("experiment") == experiment
            and r.get("available", True) and "skipped" not in r}


def _positive(v) -> float | None:
    """A value a log axis can show (exact zeros are drawn at the bottom with their own marker, not floored)."""
    return v if isinstance(v, (int, float)) and math.isfinite(v) and v > 0 else None


def gradient_errors(records: list[dict]):
    """One panel per statistic (median, p99, max |error| in ULP): per tensor, every run's value; the correct runs'
    range shaded; planted runs in their own colour and marker."""
    runs = _runs(records, GRADIENTS)
    if not runs:
        return message("no gradient records: nothing to draw").figure
    fig, axes = plt.subplots(1, len(STATISTICS), figsize=(4.2 * len(STATISTICS), 3.6), sharey=False)
    tensors = [t for t in TENSORS if all(t in r["stats"] for r in runs.values())]
    words = []
    for ax, stat in zip(axes, STATISTICS):
        for i, t in enumerate(tensors):
            good = [r["stats"][t][stat] for r in runs.values() if not planted(r)]
            if good:
                ax.fill_between([i - 0.3, i + 0.3], min(good), max(good), color=NEUTRAL, alpha=0.25, lw=0)
            for k, (n, r) in enumerate(runs.items()):
                v = r["stats"][t][stat]
                x = i - 0.25 + 0.5 * k / max(len(runs) - 1, 1)
                bug = planted(r)
                y = _positive(v)
                ax.plot([x], [y if y is not None else float("nan")], "x" if bug else "o", color=BUG if bug else CORRECT,
                        ms=6 if bug else 4, label=("planted bug" if bug else "correct run"))
                if y is None:
                    ax.annotate("0", (x, 0), xycoords=("data", "axes fraction"), ha="center", va="bottom",
                                fontsize=TEXT_PT)
            if stat == "p99" and good:
                bugs = [f"{n} {r['stats'][t][stat]:.3g}" for n, r in runs.items() if planted(r)]
                words.append(f"{TENSORS[t]}: correct runs {min(good):.3g}–{max(good):.3g} ULP"
                             + (f", planted {'; '.join(bugs)} ULP" if bugs else ""))
        ax.set_yscale("log")
        ax.set_xticks(range(len(tensors)), [TENSORS[t] for t in tensors], fontsize=TEXT_PT, rotation=15)
        ax.set_title(f"{stat} |error| to the fp64 gradient", fontsize=TEXT_PT + 1)
        ax.set_ylabel("ULP of the truth's bf16 value", fontsize=TEXT_PT)
    handles, labels = axes[0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=len(seen), frameon=False, fontsize=TEXT_PT + 1)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    describe(fig, f"Dot charts, one per statistic ({', '.join(STATISTICS)}): one step's gradient error to the fp64 "
                  f"gradient in ULPs, per tensor, for {len(runs)} runs ({sum(planted(r) for r in runs.values())} "
                  f"with a planted bug), the correct runs' range shaded. p99: " + "; ".join(words))
    return fig


def trajectory_errors(records: list[dict], groups=("weights.experts.all", "grad.experts.all"), stat: str = "median"):
    """One panel per group: `stat` |error| in ULP against the step, the correct runs' range at each step shaded and
    each run a line (planted runs dashed, in their own colour)."""
    runs = _runs(records, TRAJECTORY)
    if not runs:
        return message("no trajectory records: nothing to draw").figure
    K = min(len(r["steps_compared"]) for r in runs.values())
    steps = list(range(1, K + 1))
    fig, axes = plt.subplots(1, len(groups), figsize=(5.2 * len(groups), 3.6), squeeze=False)
    words = []
    for ax, g in zip(axes[0], groups):
        series = {n: [r["steps_compared"][t]["stats"].get(g, {}).get(stat) for t in range(K)] for n, r in runs.items()}
        good = [v for n, v in series.items() if not planted(runs[n])]
        if good:
            lo = [min(v[t] for v in good) for t in range(K)]
            hi = [max(v[t] for v in good) for t in range(K)]
            ax.fill_between(steps, lo, hi, color=NEUTRAL, alpha=0.25, lw=0, label="correct runs' range")
        for n, v in series.items():
            bug = planted(runs[n])
            ys = [_positive(x) for x in v]
            ax.plot(steps, [y if y is not None else float("nan") for y in ys], "--x" if bug else "-o",
                    color=BUG if bug else CORRECT, lw=1.4 if bug else 0.8, ms=5 if bug else 3,
                    label="planted bug" if bug else "correct run")
        ax.set_yscale("log")
        ax.set_xticks(steps)
        ax.set_xlabel("step", fontsize=TEXT_PT)
        ax.set_ylabel(f"{stat} |error|, ULP of the truth's bf16 value", fontsize=TEXT_PT)
        ax.set_title(TRAJECTORY_GROUPS.get(g, g), fontsize=TEXT_PT + 1)
        if good:
            bugs = [f"{n} {series[n][0]:.3g}–{series[n][-1]:.3g}" for n in series if planted(runs[n])]
            words.append(f"{TRAJECTORY_GROUPS.get(g, g)}: correct runs {min(lo):.3g}–{max(hi):.3g} ULP over the steps"
                         + (f", planted (step 1 to {K}) {'; '.join(bugs)} ULP" if bugs else ""))
    handles, labels = axes[0][0].get_legend_handles_labels()
    seen = dict(zip(labels, handles))
    fig.legend(seen.values(), seen.keys(), loc="lower center", ncol=len(seen), frameon=False, fontsize=TEXT_PT + 1)
    fig.tight_layout(rect=(0, 0.08, 1, 1))
    describe(fig, f"Line charts, one per tensor: the {stat} error to the fp64 trajectory in ULPs against the step "
                  f"(1–{K}) for {len(runs)} runs ({sum(planted(r) for r in runs.values())} with a planted bug), "
                  "the correct runs' range shaded. " + "; ".join(words))
    return fig


__all__ = ["gradient_errors", "trajectory_errors"]
