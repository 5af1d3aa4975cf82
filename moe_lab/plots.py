"""DataFrame/records → seaborn figures. No numerics here: every number comes from moe_lab.metrics via records."""

from __future__ import annotations

import math

import matplotlib


import matplotlib.pyplot as plt  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402


def _case(r: dict) -> str:
    return f"{r['dispatcher']}\nrouter {r['router_dtype']}" + (" det" if r.get("deterministic") else "")


def pair_table(records: list[dict], metric: str = "mismatch_frac") -> pd.DataFrame:
    """Rows: rank pairs; columns: cases; values: `metric` of the cross-rank comparison."""
    rows = []
    for r in records:
        for pair, c in r["detail"]["pairs"].items():
            rows.append({"case": _case(r), "pair": f"rank {pair}", metric: c[metric]})
    return pd.DataFrame(rows).pivot(index="pair", columns="case", values=metric)


def mismatch_by_pair(records: list[dict], ax=None):
    """Heatmap: fraction of bitwise-different output elements per rank pair (rank 0 vs r) and case."""
    t = pair_table(records, "mismatch_frac")
    ax = ax or plt.subplots(figsize=(1.6 * t.shape[1] + 2, 0.6 * t.shape[0] + 1.8))[1]
    sns.heatmap(t, annot=True, fmt=".2%", cmap="rocket_r", vmin=0, vmax=max(1e-9, float(t.values.max())),
                cbar_kws={"label": "bitwise mismatch fraction"}, ax=ax)
    ax.set_title("Cross-rank output mismatch (same tokens on every rank)")
    ax.set_xlabel("")
    ax.set_ylabel("")
    return ax


def ulp_histogram(records: list[dict], ax=None):
    """Distribution of ULP distances of differing elements, all pairs pooled, one line per case (log axes)."""
    rows = []
    for r in records:
        for hist in r["detail"]["ulp_hist"].values():
            for d, n in hist.items():
                d = int(d)
                if d != 0:
                    rows.append({"case": _case(r).replace("\n", " / "), "ulp": d if d > 0 else math.inf, "count": n})
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
    """Where in the [tokens x hidden] output the differences sit, for one case and rank pair."""
    maps = record["detail"]["mismatch_map"]
    pair = pair or max(maps, key=lambda k: record["detail"]["pairs"][k]["mismatch_frac"])
    m = maps[pair]
    ax = ax or plt.subplots(figsize=(6, 4))[1]
    sns.heatmap(pd.DataFrame(m["frac"]), cmap="mako_r", vmin=0, vmax=1, ax=ax, xticklabels=False, yticklabels=False,
                cbar_kws={"label": "fraction differing"})
    ax.set_xlabel(f"hidden ({m['hidden_per_bin']:.0f} per cell)")
    ax.set_ylabel(f"token ({m['tokens_per_bin']:.0f} per cell)")
    ax.set_title(f"{_case(record).replace(chr(10), ', ')}: rank {pair}")
    return ax


def mismatch_maps(records: list[dict]):
    """One mismatch map per case, side by side."""
    n = len(records)
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(n / cols)), squeeze=False)
    for ax, r in zip(axes.flat, records):
        mismatch_map(r, ax=ax)
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.tight_layout()
    return fig
