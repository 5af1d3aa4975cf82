"""DataFrame/records → seaborn figures. No numerics here: every number comes from moe_lab.metrics via records.

Conventions: an exact zero (bitwise equal) has its own colour, never the low end of the scale; counts and
fractions of differing elements are on log scales with labelled colour bars; a map with nothing to show says why."""

from __future__ import annotations

import math

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402


ZERO = "#cfe8d4"  # bitwise equal: its own colour, distinct from any non-zero count
NA = "#e6e6e6"  # not applicable / not measured


def zero_aware_heatmap(values: pd.DataFrame, ax, *, annot=None, label: str = "", cmap: str = "rocket_r", fmt: str = "",
                       scale: tuple[float, float] | None = None):
    """Heatmap whose exact zeros get the ZERO colour and whose non-zero values sit on a log colour scale (labelled);
    NaN cells are grey. `annot`: a DataFrame of cell texts (default: the values), or False for none (a fine grid such
    as a 64 x 64 mismatch map: thousands of empty texts and cell borders only cost time — seconds per figure).
    `scale`: the (lowest, highest) non-zero value of the colour scale, to share one scale across panels.

    Cell texts are placed here, not by seaborn's `annot`: seaborn draws the whole figure once per annotated call to
    pick text colours, which made a six-panel figure take ~7 s on the 2-core machine."""
    from matplotlib.colors import ListedColormap, LogNorm

    v = values.astype(float)
    nz = v[v > 0]
    lo, hi = (float(nz.min().min()), float(nz.max().max())) if nz.notna().any().any() else (1e-9, 1.0)
    if scale is not None:
        lo, hi = min(lo, scale[0]), max(hi, scale[1])
    if hi <= lo:
        hi = lo * 10
    texts = annot is not False
    ann = (annot if annot is not None else v.map(lambda x: "" if pd.isna(x) else f"{x:{fmt or '.3g'}}")) if texts \
        else None
    lw = 0.5 if texts or v.size <= 400 else 0.0
    ax.set_facecolor(NA)
    norm = LogNorm(vmin=lo, vmax=hi)
    cm = sns.color_palette(cmap, as_cmap=True)
    zero = (v == 0).to_numpy()
    pos = (v > 0).to_numpy()
    edge = dict(edgecolors="white", linewidth=lw) if lw else {}
    if zero.any():  # the zero layer first, its own colour
        ax.pcolormesh(np.ma.masked_where(~zero, np.ones(v.shape)), cmap=ListedColormap([ZERO]), **edge)
    if pos.any():
        mesh = ax.pcolormesh(np.ma.masked_where(~pos, v.to_numpy()), cmap=cm, norm=norm, **edge)
        cb = ax.figure.colorbar(mesh, ax=ax, label=f"{label} (log scale; green = exactly 0)")
        cb.outline.set_linewidth(0)
    _matrix_axes(ax, v)
    if texts:
        _cell_texts(ax, v, ann, cm, norm)
    return ax


def _matrix_axes(ax, v: pd.DataFrame) -> None:
    """Rows top to bottom, one tick per row and column at the cell centres, no spines (a seaborn heatmap's look,
    without its figure draw per call to test whether tick labels overlap)."""
    ax.set(xlim=(0, v.shape[1]), ylim=(0, v.shape[0]))
    ax.invert_yaxis()
    for side in ax.spines.values():
        side.set_visible(False)
    ax.tick_params(length=0)
    xl = [str(c) for c in v.columns]
    width = ax.get_position().width * ax.figure.get_figwidth() * 72 / max(1, len(xl))  # points per column
    longest = max((max(len(line) for line in t.split("\n")) for t in xl), default=0)
    ax.set_xticks(np.arange(len(xl)) + 0.5, xl, rotation=90 if longest * 5.5 > width else 0)
    ax.set_yticks(np.arange(v.shape[0]) + 0.5, [str(i) for i in v.index], rotation=0, va="center")
    if v.columns.name:
        ax.set_xlabel(v.columns.name)
    if v.index.name:
        ax.set_ylabel(v.index.name)


def _cell_texts(ax, v: pd.DataFrame, ann: pd.DataFrame, cmap, norm) -> None:
    """One text per cell that has one, dark on light cells and white on dark ones (seaborn's luminance rule)."""
    from matplotlib.colors import to_rgba
    from seaborn.utils import relative_luminance

    zero_lum = relative_luminance(to_rgba(ZERO))
    for i, row in enumerate(v.index):
        for j, col in enumerate(v.columns):
            text = ann.loc[row, col] if (row in ann.index and col in ann.columns) else ""
            if text is None or (isinstance(text, float) and math.isnan(text)) or str(text) == "":
                continue
            x = v.loc[row, col]
            lum = zero_lum if x == 0 else (relative_luminance(cmap(norm(x))) if x > 0 else 1.0)
            ax.text(j + 0.5, i + 0.5, str(text), ha="center", va="center", fontsize=7,
                    color="w" if lum < .408 else ".15")


def case_label(r: dict) -> str:
    return f"{r['dispatcher']}\nrouter {r['router_dtype']}" + (" det" if r.get("deterministic") else "")


def not_applicable(records: list[dict], ax=None, what: str = "cross-rank comparison"):
    """An axis that says why there is nothing to draw (one rank: nothing to compare across ranks)."""
    ax = ax or plt.subplots(figsize=(7, 1.6))[1]
    reason = next((r["cross_rank"].get("reason") for r in records if not r["cross_rank"].get("applicable", True)),
                  "nothing to compare")
    ax.text(0.5, 0.5, f"{what}: not applicable — {reason}", ha="center", va="center", fontsize=10)
    ax.set_axis_off()
    return ax


def applicable(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("cross_rank", {}).get("applicable", True) and "skipped" not in r]


def stage_heatmap(stage_rows: pd.DataFrame, ax=None, title: str = "", scale: tuple[float, float] | None = None):
    """Stage (execution order) x comparison unit: bitwise mismatch fraction (worst trial), green = bitwise equal,
    grey = not compared."""
    df = stage_rows.dropna(subset=["mismatch_frac"])
    order = df.drop_duplicates("stage").sort_values("order")
    t = df.pivot_table(index="stage", columns="unit", values="mismatch_frac", aggfunc="max").reindex(order["stage"])
    t = t[sorted(t.columns, key=lambda u: (not u.startswith("rank"), u))]  # rank pairs first, then copies
    labels = [f"{s}  [{k}]" for s, k in zip(order["stage"], order["stage_kind"])]
    ax = ax or plt.subplots(figsize=(1.3 * t.shape[1] + 4, 0.36 * t.shape[0] + 1.5))[1]
    zero_aware_heatmap(t, ax, annot=t.map(lambda x: "" if pd.isna(x) else ("0" if x == 0 else f"{x:.1%}")),
                       label="bitwise mismatch fraction", scale=scale)
    ax.set_yticks([i + 0.5 for i in range(len(labels))], labels, rotation=0)
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title(title or "Where ranks stop agreeing")
    return ax


