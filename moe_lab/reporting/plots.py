"""DataFrame/records → seaborn figures. No numerics here: every number comes from moe_lab.metrics via records.

Conventions, one place for every question's figures:
- colours: categories from PALETTE (seaborn's "colorblind" set), magnitudes on the SEQUENTIAL map ("cividis", made
  for colour-vision deficiency), so that no finding rests on telling red from green;
- an exact zero (bitwise equal) is a mark, not a shade: hatched cells in heatmaps (ZERO_HATCH, named in the colour
  bar's label), a hatched bar in histograms, a marker or a sentence in line charts — never the low end of a scale or a
  made-up floor on a log axis;
- counts and fractions of differing elements are on log scales with labelled colour bars; a map with nothing to show
  says why;
- every figure a notebook displays carries an alt text built from its data (`describe`): the notebook's HTML page
  puts it on the image's `alt`, where nbconvert otherwise writes "No description has been provided for this image".
"""

from __future__ import annotations

import base64
import html
import io
import math
import sys
import weakref

import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import seaborn as sns  # noqa: E402
from matplotlib.figure import Figure


PALETTE = tuple(sns.color_palette("colorblind"))
"""Colours of categories (cases, runs, settings): seaborn's colour-blind-safe set of ten, in its order."""
SEQUENTIAL = "cividis_r"
"""Colour map of magnitudes: light (few differ) to dark (many differ), legible under colour-vision deficiency."""
PASS, FAIL = PALETTE[0], PALETTE[3]
"""A check that holds / fails: blue and vermillion (told apart under deuteranopia, unlike green and red)."""
NEUTRAL = "0.35"
"""Reference lines and notes that are not a category (a noise floor, a bound)."""
ZERO = "white"
"""Face of an exactly-0 cell, under its hatch."""
ZERO_HATCH = "///"
ZERO_INK = "0.55"
"""The hatch's colour."""
ZERO_WORDS = "hatched = exactly 0"
NA = "#e6e6e6"  # not applicable / not measured
TEXT_PT = 9
"""Smallest type of a legend or a note a reader must read."""
TICKED = 40
"""A heatmap axis numbered 0, 1, … of at most this many cells gets a labelled tick per cell (a named one always)."""


def colours(n: int) -> list:
    """`n` category colours from PALETTE (repeating past ten: the figure then tells them apart by line style too)."""
    return [PALETTE[i % len(PALETTE)] for i in range(n)]


def figure_of(where) -> Figure:
    """The figure holding `where`: a Figure, an Axes, or an array/list of axes."""
    if isinstance(where, Figure):
        return where
    if hasattr(where, "figure") and not isinstance(where, (list, tuple, np.ndarray)):
        return where.figure
    return figure_of(np.asarray(where, dtype=object).flat[0])


_DESCRIPTIONS: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()


def describe(where, text: str):
    """Gives the figure holding `where` its alt text — what it shows, in words built from the figure's data — and
    returns `where`. In an IPython kernel, the figure then displays as an `<img>` carrying that alt text (`figure_html`,
    a text/html formatter registered here) next to its usual PNG: nbconvert's HTML pages render the text/html and keep
    the alt, where the PNG alone gets nbconvert's "No description has been provided for this image" (its lab template
    does not read an image output's `alt` metadata). The last call on a figure wins: a figure of several panels
    describes itself after its panels did."""
    _DESCRIPTIONS[figure_of(where)] = " ".join(str(text).split())
    _serve_alt_text()
    return where


def description_of(where) -> str | None:
    """The alt text `describe` gave the figure holding `where`, None if none."""
    return _DESCRIPTIONS.get(figure_of(where))


def figure_html(fig: Figure) -> str | None:
    """A described figure as `<img src="data:image/png;base64,…" alt="…">` (the PNG the kernel's own PNG formatter
    makes, so the inline backend's size and resolution settings hold); None for a figure without alt text, which then
    displays as matplotlib has it."""
    text = _DESCRIPTIONS.get(fig)
    if text is None:
        return fig._repr_html_()  # matplotlib's own HTML (WebAgg figures), None for the others
    data, size = _png_of(fig)
    attrs = "".join(f' {k}="{int(v)}"' for k, v in size.items() if k in ("width", "height"))
    return f'<img src="data:image/png;base64,{data}" alt="{html.escape(text, quote=True)}"{attrs}/>'


_RENDERED: weakref.WeakKeyDictionary = weakref.WeakKeyDictionary()
"""A described figure's PNG, as the kernel's PNG formatter returned it while its text/html was made: the same
display's image/png output is that PNG (`_png_once`), so each display renders the figure once, not twice (a figure of
many panels takes seconds to draw, and bbox_inches='tight' draws it twice more)."""


def _png_of(fig: Figure) -> tuple[str, dict]:
    """The figure's PNG as base64 text and its display size ({} where the PNG has its natural size); the formatter's
    PNG is held for the image/png output of the same display (`_RENDERED`)."""
    shell = _shell()
    _RENDERED.pop(fig, None)  # one held from a display that made no image/png is stale: render afresh
    png, size = (shell.display_formatter.formatters["image/png"](fig) if shell else None), {}
    if png:
        _RENDERED[fig] = png
    if isinstance(png, tuple):  # a retina PNG comes with the size to display it at
        png, size = png
    if not png:  # no PNG formatter for figures (an SVG-only kernel): render one
        buf = io.BytesIO()
        fig.savefig(buf, format="png", bbox_inches="tight")
        png = buf.getvalue()
    if isinstance(png, bytes):
        png = base64.b64encode(png).decode("ascii")
    return png, dict(size or {})


def _shell():
    """The running IPython shell, None outside one (IPython is not imported for a script that never started it)."""
    if "IPython" not in sys.modules:
        return None
    from IPython import get_ipython

    return get_ipython()


def _serve_alt_text() -> None:
    """Register `figure_html` as the running shell's text/html formatter of figures (again on every call: cheap, and
    a shell started after the first figure gets it too), and its image/png formatter of figures as `_png_once` over
    the one it had."""
    shell = _shell()
    if shell is not None:
        formatters = shell.display_formatter.formatters
        formatters["text/html"].for_type(Figure, figure_html)
        png = formatters["image/png"]
        current = png.type_printers.get(Figure)
        if current is not None and not getattr(current, "renders_once", False):
            png.for_type(Figure, _png_once(current))


def _png_once(render):
    """An image/png formatter of figures: the PNG `figure_html` just made for this figure's display where there is
    one (taken, so the next display renders afresh), else `render`'s."""
    def png(fig):
        held = _RENDERED.pop(fig, None)
        return held if held is not None else render(fig)

    png.renders_once = True
    return png


def count_words(n: int, of: int, what: str) -> str:
    """'3 of 12 cells' — a count against its whole, as the alt texts say it."""
    return f"{n:,} of {of:,} {what}"


def fraction_words(v: float) -> str:
    """A fraction as the alt texts say it: 'exactly 0', '32.1%', or '3.1e-05' (a share too small for percent)."""
    return "exactly 0" if v == 0 else f"{v:.1%}" if v >= 1e-3 else f"{v:.1e}"


def heatmap_words(values: pd.DataFrame, fmt: str = ".3g") -> str:
    """What a heatmap's cells hold, from its values: how many are exactly 0, not measured, and which is largest."""
    v = values.astype(float)
    n = int(v.size)
    zero, na = int((v == 0).sum().sum()), int(v.isna().sum().sum())
    words = [count_words(zero, n, "cells exactly 0")]
    if na:
        words.append(f"{na:,} not measured")
    pos = v.where(v > 0)
    if pos.notna().any().any():
        *row, col = pos.stack().idxmax()  # rows of several levels come as a longer tuple
        words.append(f"largest {pos.stack().max():{fmt}} at {' / '.join(map(_flat, row))}, {_flat(col)}")
    return "; ".join(words)


def _flat(label) -> str:
    return " ".join(str(label).split())


def zero_aware_heatmap(values: pd.DataFrame, ax, *, annot=None, label: str = "", cmap: str = SEQUENTIAL,
                       fmt: str = "", scale: tuple[float, float] | None = None):
    """Heatmap whose exact zeros are hatched white cells (ZERO_HATCH, said in the colour bar's label) and whose
    non-zero values sit on a log colour scale (labelled); NaN cells are grey. `annot`: a DataFrame of cell texts
    (default: the values), or False for none (a fine grid such as a 64 x 64 mismatch map: thousands of empty texts and
    cell borders only cost time — seconds per figure). `scale`: the (lowest, highest) non-zero value of the colour
    scale, to share one scale across panels.

    Cell texts are placed here, not by seaborn's `annot`: seaborn draws the whole figure once per annotated call to
    pick text colours, which made a six-panel figure take ~7 s on the 2-core machine."""
    from matplotlib.colors import LogNorm

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
    if zero.any():  # the zero layer: a hatch, told apart from the palest colour by its mark, not its shade
        ax.add_artist(_zero_patch(zero, lw))  # not add_patch: its data-limit walk over every cell takes seconds
    bar = f"{label} (log scale)"
    if pos.any():
        mesh = ax.pcolormesh(np.ma.masked_where(~pos, v.to_numpy()), cmap=cm, norm=norm, **edge)
        cb = ax.figure.colorbar(mesh, ax=ax, label=f"{label} (log scale; {ZERO_WORDS})" if zero.any() else bar)
        cb.outline.set_linewidth(0)
    elif zero.any():  # nothing non-zero: no colour bar to name the hatch, a legend does
        from matplotlib.patches import Patch

        # short, in the colour bar's place: a wide legend here would squeeze every panel of a tight layout
        ax.legend(handles=[Patch(facecolor=ZERO, hatch=ZERO_HATCH, edgecolor=ZERO_INK, label="exactly 0")],
                  loc="center left", bbox_to_anchor=(1.01, 0.5), frameon=False, fontsize=TEXT_PT, handlelength=1.2,
                  handletextpad=0.4, borderaxespad=0)
    _matrix_axes(ax, v)
    if texts:
        _cell_texts(ax, v, ann, cm, norm)
    return ax


def _zero_patch(zero: np.ndarray, lw: float):
    """One hatched patch over every exactly-0 cell (row i, column j → the unit square at (j, i)): a single path, so a
    64 x 64 map of zeros draws as fast as one cell."""
    from matplotlib.patches import PathPatch
    from matplotlib.path import Path

    cells = np.argwhere(zero)
    square = np.array([[0, 0], [1, 0], [1, 1], [0, 1], [0, 0]], dtype=float)
    verts = (cells[:, None, ::-1] + square[None]).reshape(-1, 2)
    codes = np.tile([Path.MOVETO, Path.LINETO, Path.LINETO, Path.LINETO, Path.CLOSEPOLY], len(cells))
    patch = PathPatch(Path(verts, codes), facecolor=ZERO, hatch=ZERO_HATCH, edgecolor="white" if lw else "none",
                      linewidth=lw, gid="exactly 0")
    patch.set_hatchcolor(ZERO_INK)
    return patch


def zero_marked(ax) -> np.ndarray | None:
    """Which cells of a `zero_aware_heatmap` on `ax` carry the exactly-0 mark (a boolean rows x columns array; None if
    none does) — read back from the drawn patch, for the tests."""
    patch = next((p for p in ax.patches if p.get_gid() == "exactly 0"), None)
    if patch is None:
        return None
    rows = int(round(abs(ax.get_ylim()[0] - ax.get_ylim()[1])))
    cols = int(round(abs(ax.get_xlim()[1] - ax.get_xlim()[0])))
    path = patch.get_path()
    return np.array([[path.contains_point((j + 0.5, i + 0.5)) for j in range(cols)] for i in range(rows)])


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
    # A label per named cell, or per numbered one where a reader can read them; a fine numbered grid (a 64 x 64 map)
    # keeps matplotlib's few ticks, as a tick per cell costs a second per axis and its callers replace them
    if len(xl) <= TICKED or not isinstance(v.columns, pd.RangeIndex):
        ax.set_xticks(np.arange(len(xl)) + 0.5, xl, rotation=90 if longest * 5.5 > width else 0)
    if v.shape[0] <= TICKED or not isinstance(v.index, pd.RangeIndex):
        ax.set_yticks(np.arange(v.shape[0]) + 0.5, [str(i) for i in v.index], rotation=0, va="center")
    if v.columns.name:
        ax.set_xlabel(v.columns.name)
    if v.index.name:
        ax.set_ylabel(v.index.name)


def _cell_texts(ax, v: pd.DataFrame, ann: pd.DataFrame, cmap, norm) -> None:
    """One text per cell that has one, dark on light cells and white on dark ones (seaborn's luminance rule); a text
    on a hatched zero cell sits on a white box, readable over the hatch."""
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
            box = dict(boxstyle="square,pad=0.1", facecolor=ZERO, edgecolor="none") if x == 0 else None
            ax.text(j + 0.5, i + 0.5, str(text), ha="center", va="center", fontsize=7,
                    color="w" if lum < .408 else ".15", bbox=box)


def case_label(r: dict) -> str:
    return f"{r['dispatcher']}\nrouter {r['router_dtype']}" + (" det" if r.get("deterministic") else "")


def message(text: str, ax=None, figsize=(7, 1.6)):
    """An axis that says `text` (why there is nothing to draw), described by the same words."""
    ax = ax or plt.subplots(figsize=figsize)[1]
    ax.text(0.5, 0.5, text, ha="center", va="center", fontsize=10)
    ax.set_axis_off()
    describe(ax, f"No chart: {text}")
    return ax


def not_applicable(records: list[dict], ax=None, what: str = "cross-rank comparison"):
    """An axis that says why there is nothing to draw (one rank: nothing to compare across ranks)."""
    reason = next((r["cross_rank"].get("reason") for r in records if not r["cross_rank"].get("applicable", True)),
                  "nothing to compare")
    return message(f"{what}: not applicable — {reason}", ax)


def applicable(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("cross_rank", {}).get("applicable", True) and "skipped" not in r]


def stage_heatmap(stage_rows: pd.DataFrame, ax=None, title: str = "", scale: tuple[float, float] | None = None):
    """Stage (execution order) x comparison unit: bitwise mismatch fraction (worst trial), hatched = bitwise equal,
    grey = not compared."""
    df = stage_rows.dropna(subset=["mismatch_frac"])
    order = df.drop_duplicates("stage").sort_values("order")
    t = df.pivot_table(index="stage", columns="unit", values="mismatch_frac", aggfunc="max").reindex(order["stage"])
    t = t[sorted(t.columns, key=lambda u: (not u.startswith("rank"), u))]  # rank pairs first, then copies
    labels = [f"{s}  [{k}]" for s, k in zip(order["stage"], order["stage_kind"])]
    ax = ax or plt.subplots(figsize=(1.3 * t.shape[1] + 4, 0.36 * t.shape[0] + 1.5))[1]
    zero_aware_heatmap(t, ax, annot=t.map(lambda x: "" if pd.isna(x) else ("0" if x == 0 else fraction_words(x))),
                       label="bitwise mismatch fraction", scale=scale)
    ax.set_yticks([i + 0.5 for i in range(len(labels))], labels, rotation=0)
    ax.set_xlabel("")
    ax.set_ylabel("")
    ax.set_title(title or "Where ranks stop agreeing")
    first = next((s for s in t.index if (t.loc[s] > 0).any()), None)
    describe(ax, f"Heatmap: bitwise mismatch fraction per forward stage ({t.shape[0]} rows, execution order) and "
                 f"comparison ({', '.join(map(str, t.columns))}); {heatmap_words(t, '.1%')}; "
                 + (f"first stage that differs: {first}" if first else "no stage differs"))
    return ax
