"""DataFrame/records → seaborn figures. No numerics here: every number comes from moe_lab.metrics via records.

Conventions (#14): an exact zero (bitwise equal) has its own colour, never the low end of the scale; counts and
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


def _case(r: dict) -> str:
    return f"{r['dispatcher']}\nrouter {r['router_dtype']}" + (" det" if r.get("deterministic") else "")


def pair_table(records: list[dict], metric: str = "mismatch_frac") -> pd.DataFrame:
    """Rows: rank pairs; columns: cases; values: `metric` of the cross-rank comparison."""
    rows = []
    for r in records:
        for pair, c in r["detail"]["pairs"].items():
            rows.append({"case": _case(r), "pair": f"rank {pair}", metric: c[metric]})
    return pd.DataFrame(rows).pivot(index="pair", columns="case", values=metric)


def not_applicable(records: list[dict], ax=None, what: str = "cross-rank comparison"):
    """An axis that says why there is nothing to draw (one rank: nothing to compare across ranks)."""
    ax = ax or plt.subplots(figsize=(7, 1.6))[1]
    reason = next((r["cross_rank"].get("reason") for r in records if not r["cross_rank"].get("applicable", True)),
                  "nothing to compare")
    ax.text(0.5, 0.5, f"{what}: not applicable — {reason}", ha="center", va="center", fontsize=10)
    ax.set_axis_off()
    return ax


def _applicable(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("cross_rank", {}).get("applicable", True) and "skipped" not in r]


def mismatch_by_pair(records: list[dict], ax=None):
    """Heatmap: differing output elements per rank pair (rank 0 vs r) and case (worst trial); green = bitwise equal."""
    if not _applicable(records):
        return not_applicable(records, ax)
    recs = _applicable(records)
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
    if not _applicable(records):
        return not_applicable(records, ax, "ULP distances across ranks")
    records = _applicable(records)
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
    ax.set_title(f"{_case(record).replace(chr(10), ', ')}: rank {pair}"
                 + (" — bitwise equal" if not n else f" — {n:,} differ"), fontsize=9)
    return ax


def mismatch_maps(records: list[dict]):
    """One mismatch map per case, side by side."""
    if not _applicable(records):
        return not_applicable(records, None, "where ranks differ").figure
    records = _applicable(records)
    n = len(records)
    cols = min(n, 3)
    fig, axes = plt.subplots(math.ceil(n / cols), cols, figsize=(5 * cols, 3.6 * math.ceil(n / cols)), squeeze=False)
    for ax, r in zip(axes.flat, records):
        mismatch_map(r, ax=ax)
    for ax in list(axes.flat)[n:]:
        ax.set_axis_off()
    fig.tight_layout()
    return fig


def stage_heatmap(stage_rows: pd.DataFrame, ax=None, title: str = "", scale: tuple[float, float] | None = None):
    """Stage (execution order) x comparison unit: bitwise mismatch fraction (worst trial), green = bitwise equal,
    grey = not compared."""
    df = stage_rows.dropna(subset=["mismatch_frac"])
    order = df.drop_duplicates("stage").sort_values("order")
    t = df.pivot_table(index="stage", columns="unit", values="mismatch_frac", aggfunc="max").reindex(order["stage"])
    t = t[sorted(t.columns, key=lambda u: (not u.startswith("rank"), u))]  # rank pairs first, then copies
    labels = [f"{s}  [{k}]" for s, k in zip(order["stage"], order["kind"])]
    ax = ax or plt.subplots(figsize=(1.3 * t.shape[1] + 4, 0.36 * t.shape[0] + 1.5))[1]
    zero_aware_heatmap(t, ax, annot=t.map(lambda x: "" if pd.isna(x) else ("0" if x == 0 else f"{x:.1%}")),
                       label="bitwise mismatch fraction", scale=scale)
    ax.set_yticks([i + 0.5 for i in range(len(labels))], labels, rotation=0)
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title(title or "Where ranks stop agreeing")
    return ax


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
                                         else f"{r[metric]['mismatch_frac']:.1%}")
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
    ax.set_title(f"{metric}: ✓ = ranks and rerun bitwise equal in every trial; green = 0; grey = n/a", fontsize=10)
    return ax


def cost_bars(cost_df: pd.DataFrame, ax=None):
    """Forward time of each setting relative to the plain bf16 forward (same release and dispatcher), from paired
    rounds: the median ratio with its 95 % interval; the plain cell is the A/A noise floor."""
    df = cost_df.copy()
    ax = ax or plt.subplots(figsize=(11, 4))[1]
    if df.empty:
        ax.text(0.5, 0.5, "no cost measured", ha="center", va="center")
        ax.set_axis_off()
        return ax
    df["setting"] = ("router " + df["router_dtype"] + df["probs_fp32_gather"].map({True: " +pf32", False: ""})
                     + df["deterministic"].map({True: " +det", False: ""}))
    df["release / dispatcher"] = df["megatron_core"] + " / " + df["dispatcher"]
    groups = list(dict.fromkeys(df["release / dispatcher"]))
    settings = list(dict.fromkeys(df["setting"]))
    width = 0.8 / max(1, len(groups))
    for gi, g in enumerate(groups):
        sub = df[df["release / dispatcher"] == g].set_index("setting").reindex(settings)
        x = [i + (gi - (len(groups) - 1) / 2) * width for i in range(len(settings))]
        err = [sub["relative_time"] - sub["ci_low"], sub["ci_high"] - sub["relative_time"]]
        ax.bar(x, sub["relative_time"], width=width, yerr=err, capsize=2, label=g)
    ax.set_xticks(range(len(settings)), settings, rotation=45, ha="right")
    ax.axhline(1.0, color="k", lw=0.8, ls="--")
    ax.set_ylabel("forward time / plain bf16 forward")
    ax.legend(fontsize=8)
    ax.set_title("Cost of each setting: median of paired rounds, 95 % interval (router none = A/A noise floor)")
    return ax


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
