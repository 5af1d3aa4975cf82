"""Notebook 06's records → figures: |Δloss|/loss and weight divergence against step, and routing flips per layer
against step. One small panel per layout (columns) and per stack, setting and mode (rows), the runs of one layout in
its panel; the divergences' log axes are one for every panel, the flips' linear axes one per row. A run whose loss
bits and weights equal another run's at every step is drawn once and its panel's title says so (decided by comparing
the two records, `findings.first_difference`); a step where a difference is exactly 0 is a marker at the bottom of its
panel, not a point on a made-up floor of a log axis. The numbers come from `questions.training.findings`; no numerics
here, no torch."""

from __future__ import annotations

import math
from dataclasses import dataclass, field
from textwrap import fill

import matplotlib.pyplot as plt
from matplotlib.lines import Line2D
from matplotlib.ticker import LogLocator, NullLocator

from ...reporting.plots import NEUTRAL, TEXT_PT, colours, describe, message
from .findings import first_difference, frame, layout_of, reference_of

ZERO_MARK = "v"
"""The marker of a step whose difference is exactly 0 (drawn at the bottom of the panel)."""
ONCE_MARK = "o"
"""The marker of a line that stands for several bitwise-equal runs."""
RUN_DASHES = ("-", "--", ":", "-.")


@dataclass
class Run:
    """A run in its panel: the record, the run it equals bit for bit at every step (None: none before it), and the
    values drawn for it (step → value against the reference)."""

    record: dict
    twin: dict | None
    values: dict[int, float] = field(default_factory=dict)

    @property
    def name(self) -> str:
        return f"{layout_of(self.record)} run {self.record['run']}"


@dataclass
class Panel:
    """The runs of one layout in one row (stack, setting, mode; a layer for routing flips), against `ref`."""

    row: str
    layout: str
    runs: list[Run]
    ref: dict


def _mode(r: dict) -> str:
    return "det" if r["deterministic"] else "nondet"


def _row(r: dict) -> str:
    return f"{r['layers']} layer(s), {r['setting']}, {_mode(r)}"


def _steps(r: dict) -> int:
    return len(r.get("loss_hex") or [])


def bitwise_twins(runs: list[dict]) -> list[dict | None]:
    """For each run, the first run before it in `runs` whose loss bits and weight fingerprints are equal to its own at
    every step of both (same number of steps; `findings.first_difference` finds no step); None where no run before it
    is. Decided from the records' values, never from their names."""
    out = []
    for i, r in enumerate(runs):
        out.append(next((s for s in runs[:i] if _steps(s) == _steps(r) and first_difference(r, s) is None), None))
    return out


def _groups(records: list[dict]) -> list[tuple[str, dict, list[dict]]]:
    """(row title, reference run, the group's runs with the reference first) per stack, setting and mode, in the
    records' order."""
    recs = [r for r in records if isinstance(r, dict) and r.get("kind") == "train" and r.get("available")]
    by: dict[str, list[dict]] = {}
    for r in recs:
        by.setdefault(_row(r), []).append(r)
    out = []
    for row, rs in by.items():
        ref = reference_of(rs[0], rs)
        if ref is not None:
            out.append((row, ref, [ref] + [r for r in rs if r is not ref]))
    return out


def _panels(records: list[dict], value: str, layer: int | None = None, setting: str | None = None,
            rows: list[dict] | None = None) -> list[Panel]:
    """The panels of one quantity (`value`: a column of `findings.frame`, whose `rows` may be given; `layer`: routing
    flips of that layer)."""
    series: dict[tuple, dict[int, float]] = {}
    for x in frame(records) if rows is None else rows:
        if x["layer"] == layer and value in x:
            key = (x["layers"], x["setting"], x["deterministic"], x["layout"], x["run"])
            series.setdefault(key, {})[x["step"]] = x[value]
    panels = []
    for row, ref, rs in _groups(records):
        if setting is not None and ref["setting"] != setting:
            continue
        if layer is not None and layer > ref["layers"]:
            continue
        twins = bitwise_twins(rs)
        runs = [Run(r, t, series.get((r["layers"], r["setting"], bool(r["deterministic"]), layout_of(r), r["run"]),
                                     {}))
                for r, t in zip(rs, twins) if r is not ref]
        for lay in dict.fromkeys(layout_of(r.record) for r in runs):
            mine = sorted((r for r in runs if layout_of(r.record) == lay), key=lambda r: r.record["run"])
            panels.append(Panel(row if layer is None else f"{row}, layer {layer}", lay, mine, ref))
    return panels


def _equal_words(run: Run, ref: dict | None) -> str:
    """'run 1 = run 0 (bitwise, all 50 steps)': which run a drawn-once run equals, said from its twin."""
    t = run.twin
    same_layout = layout_of(t) == layout_of(run.record)
    other = (f"run {t['run']}" if same_layout else f"{layout_of(t)} run {t['run']}")
    if ref is not None and t is ref:
        other += ", the reference"
    return f"run {run.record['run']} = {other} (bitwise, all {_steps(run.record)} steps)"


@dataclass
class Drawn:
    """What a faceted figure drew, for its legend and its alt text."""

    panels: int = 0
    rows: list[str] = field(default_factory=list)
    layouts: list[str] = field(default_factory=list)
    drawn_once: list[str] = field(default_factory=list)
    equal_elsewhere: list[str] = field(default_factory=list)
    equal_to_reference: list[str] = field(default_factory=list)
    zero_steps: int = 0
    styles: dict[str, Line2D] = field(default_factory=dict)
    largest: tuple[float, str] | None = None


def _plan(p: Panel) -> tuple[list[tuple[Run, list[Run]]], list[str]]:
    """What a panel draws: a line per run (with the runs bitwise equal to it, drawn once with it), and the words of its
    title: which runs equal which. A run equal to the reference has a difference of 0 at every step: no line."""
    here = {id(r.record): r for r in p.runs}
    lines = [(r, []) for r in p.runs if r.twin is None or (r.twin is not p.ref and id(r.twin) not in here)]
    notes = []
    for r in p.runs:
        if r.twin is None:
            continue
        notes.append(_equal_words(r, p.ref))
        if r.twin is not p.ref and id(r.twin) in here:
            next(merged for line, merged in lines if line.record is r.twin).append(r)
    return lines, notes


def _draw_panel(ax, p: Panel, log: bool, drawn: Drawn) -> None:
    """The runs of one layout in one panel: each run its colour and line style, runs bitwise equal to each other drawn
    once (a thicker line with markers; the title names them), exactly-0 steps as markers at the bottom."""
    lines, notes = _plan(p)
    for r in p.runs:
        if r.twin is p.ref:
            drawn.equal_to_reference.append(f"{p.row}: {r.name}")
        elif r.twin is not None and r.twin in [line.record for line, _ in lines]:
            drawn.drawn_once.append(f"{p.row}: {r.name}")
        elif r.twin is not None:
            drawn.equal_elsewhere.append(f"{p.row}: {r.name}")
    for r, merged in lines:
        k = int(r.record["run"])
        colour, dash = colours(k + 1)[k], RUN_DASHES[k % len(RUN_DASHES)]
        steps = sorted(r.values)
        ys = [r.values[t] for t in steps]
        shown = [y if (math.isfinite(y) and (y > 0 or not log)) else math.nan for y in ys]
        style = dict(color=colour, ls=dash, lw=2.2 if merged else 1.3)
        if merged:
            style.update(marker=ONCE_MARK, markevery=max(1, len(steps) // 8), markersize=4)
        ax.plot(steps, shown, **style)
        key = "bitwise equal runs, drawn once (the title names them)" if merged else f"run {k}"
        drawn.styles.setdefault(key, Line2D([], [], **{**style, "color": NEUTRAL if merged else colour}))
        if log:
            zeros = [t for t, y in zip(steps, ys) if y == 0]
            if zeros:
                ax.plot(zeros, [0.03] * len(zeros), ls="", marker=ZERO_MARK, color=colour, markersize=5,
                        transform=ax.get_xaxis_transform(), clip_on=False)
                drawn.zero_steps += len(zeros)
                drawn.styles.setdefault("exactly 0 at this step (bitwise equal)",
                                        Line2D([], [], ls="", marker=ZERO_MARK, color=NEUTRAL, markersize=6))
        bad = sum(1 for y in ys if not math.isfinite(y))
        if bad:
            notes.append(f"run {k}: not finite at {bad} steps")
        finite = [(y, t) for t, y in zip(steps, ys) if math.isfinite(y)]
        if finite:
            y, t = max(finite)
            if drawn.largest is None or y > drawn.largest[0]:
                drawn.largest = (y, f"{p.row}, {r.name}, step {t}")
    if not log and lines and all(v == 0 for r, _ in lines for v in r.values.values()):
        notes.append("no flips in any run")
    ax.set_title(p.layout + "".join(f"\n{n}" for n in notes), fontsize=TEXT_PT)
    drawn.panels += 1


def _facets(panels: list[Panel], ylabel: str, title: str, *, log: bool) -> tuple:
    """A figure of one row of small panels per stack/setting/mode (a subfigure titled by it) and one column per
    layout (the same layout in the same column). A panel with nothing to draw (its every run bitwise equal to the
    reference) is left out and named in a line under the title. Log axes: one y range for every panel, fitted to the
    values drawn; linear axes (fractions from 0): one per row, whose panels share it."""
    empty = [p for p in panels if not _plan(p)[0]]
    panels = [p for p in panels if _plan(p)[0]]
    said: dict[str, list[str]] = {}
    for p in empty:
        for n in _plan(p)[1]:
            said.setdefault(f"{p.layout} {n}", []).append(p.row)
    rows = list(dict.fromkeys(p.row for p in panels))
    cols = list(dict.fromkeys(p.layout for p in panels))
    width = 3.3 * max(1, len(cols)) + 0.8
    if said:
        title += "\n" + fill("not drawn (equal to the reference at every step): " + "; ".join(
            f"{what} in {', '.join(rows)}" for what, rows in said.items()), int(width * 72 / (0.55 * TEXT_PT)))
    longest = max((len(_plan(p)[1]) for p in panels), default=0)
    height = 2.3 + 0.16 * longest
    fig = plt.figure(figsize=(width, height * max(1, len(rows)) + 1.0 + 0.15 * title.count("\n")),
                     layout="constrained")
    drawn = Drawn(rows=rows, layouts=cols, equal_to_reference=[f"{p.row}: {r.name}" for p in empty for r in p.runs])
    firsts = []
    for sub, row in zip(fig.subfigures(max(1, len(rows)), 1, squeeze=False)[:, 0], rows):
        # Axes are shared within a row; across rows (subfigures) each row's axes get the same limits instead, as
        # sharing across subfigures redraws the whole figure on every limit change.
        axes = sub.subplots(1, len(cols), squeeze=False, sharex=True, sharey=True)[0]
        sub.suptitle(row, fontsize=TEXT_PT + 1, ha="left", x=0.01, fontweight="bold")
        for ax, lay in zip(axes, cols):
            p = next((p for p in panels if p.row == row and p.layout == lay), None)
            if p is None:
                ax.set_axis_off()
                continue
            if log:
                ax.set_yscale("log")
                # a few labelled decades, no minor ticks: a tick costs layout time on each of the many small panels
                ax.yaxis.set_major_locator(LogLocator(numticks=4))
                ax.yaxis.set_minor_locator(NullLocator())
            _draw_panel(ax, p, log, drawn)
            ax.set_xlabel("step", fontsize=TEXT_PT)
            ax.tick_params(labelsize=TEXT_PT - 1, labelleft=True)
        shown = [ax for ax in axes if ax.axison]
        shown[0].set_ylabel(ylabel, fontsize=TEXT_PT)
        firsts.append(shown)
    every = [line for row in firsts for ax in row for line in ax.get_lines() if line.get_transform() == ax.transData]
    for row in firsts:
        mine = [line for ax in row for line in ax.get_lines() if line.get_transform() == ax.transData]
        _fit(row[0], [line.get_ydata() for line in (every if log else mine)], log)
        # a step's margin each side: a marker on the first or last step stays off the spine
        xs = [x for line in every for x in line.get_xdata()]
        row[0].set_xlim(min(xs, default=1) - 1, max(xs, default=1) + 1)
    fig.suptitle(title, fontsize=TEXT_PT + 2)
    if drawn.styles:
        keys = sorted(drawn.styles, key=lambda k: (not k.startswith("run "), k))  # run 0, run 1, then the marks
        fig.legend([drawn.styles[k] for k in keys], keys, loc="outside lower center",
                   ncol=min(4, len(drawn.styles)), frameon=False, fontsize=TEXT_PT + 1)
    return fig, drawn


def _fit(ax, ys, log: bool) -> None:
    """The y axis fitted to the values drawn (to the half decade on a log axis), nothing made up below them."""
    vals = [float(y) for line in ys for y in line if math.isfinite(float(y))]
    if log:
        vals = [y for y in vals if y > 0]
        if vals:
            lo, hi = min(vals), max(vals)
            ax.set_ylim(10 ** (math.floor(math.log10(lo) * 2) / 2), 10 ** (math.ceil(math.log10(hi) * 2) / 2))
    elif vals:
        ax.set_ylim(0, max(vals) * 1.08 or 1.0)


def _n(n: int, word: str) -> str:
    return f"{n} {word}" + ("" if n == 1 else "s")


def _words(what: str, drawn: Drawn, fmt: str = ".2g") -> str:
    words = [f"{what}, against step, in {_n(drawn.panels, 'small panel')}, one per layout ({', '.join(drawn.layouts)})"
             f" and {_n(len(drawn.rows), 'row')} of stack, setting and mode ({'; '.join(drawn.rows)})"]
    if drawn.drawn_once:
        words.append(f"{_n(len(drawn.drawn_once), 'run')} bitwise equal to another run of their layout, drawn once "
                     f"with it")
    if drawn.equal_elsewhere:
        words.append(f"{_n(len(drawn.equal_elsewhere), 'run')} bitwise equal to a run of another layout "
                     f"({'; '.join(drawn.equal_elsewhere)})")
    if drawn.equal_to_reference:
        words.append(f"{_n(len(drawn.equal_to_reference), 'run')} bitwise equal to the reference at every step, not "
                     f"drawn ({'; '.join(drawn.equal_to_reference)})")
    if drawn.zero_steps:
        words.append(f"{_n(drawn.zero_steps, 'step')} exactly 0, marked at the bottom")
    if drawn.largest:
        words.append(f"largest {drawn.largest[0]:{fmt}} ({drawn.largest[1]})")
    return "; ".join(words)


def _divergence(records: list[dict], value: str, ylabel: str, what: str):
    panels = _panels(records, value)
    if not panels:
        return message("no training runs to compare").figure
    refs = " / ".join(sorted({f"{layout_of(p.ref)} run {p.ref['run']}" for p in panels}))
    fig, drawn = _facets(panels, ylabel, f"{what.capitalize()} against {refs} (log scale)", log=True)
    describe(fig, "Line charts: " + _words(f"{what} against {refs} (log scale)", drawn))
    return fig


def loss_divergence(records: list[dict]):
    """|loss − loss_ref| / loss_ref against step, log axis; a panel per layout and stack/setting/mode, its runs in it."""
    return _divergence(records, "rel_loss", "|Δloss| / loss", "relative loss difference")


def weight_divergence(records: list[dict]):
    """||w − w_ref|| / ||w_ref|| against step (estimated from random projections); panels as `loss_divergence`."""
    return _divergence(records, "weight_div", "||Δw|| / ||w||", "weight divergence")


def routing_flips(records: list[dict], setting: str = "plain"):
    """Fraction of top-k slots that changed against the reference, per step; one row of panels per stack, mode and
    layer of `setting` (y scale per row), one panel per layout. A row where no run flips a slot at any step is not
    drawn: a line under the title names it."""
    recs = [r for r in records if isinstance(r, dict) and r.get("kind") == "train" and r.get("available")
            and r.get("setting") == setting]
    layers = max((int(r["layers"]) for r in recs), default=0)
    rows = frame(recs)
    panels = [p for layer in range(1, layers + 1)
              for p in _panels(recs, "flips", layer=layer, setting=setting, rows=rows)]
    if not panels:
        return message(f"no {setting} training runs to compare").figure
    flipped = {p.row for p in panels if any(v > 0 for r in p.runs for v in r.values.values())}
    empty = list(dict.fromkeys(p.row for p in panels if p.row not in flipped))
    shown = [p for p in panels if p.row in flipped]
    what = f"Routing flips against the reference layout, {setting}"
    if not shown:
        n_runs = len({id(r.record) for p in panels for r in p.runs})
        steps = max((_steps(r.record) for p in panels for r in p.runs), default=0)
        return message(f"{what}: no flips in any run ({n_runs} runs, {steps} steps, {len(empty)} rows of stack, "
                       f"mode and layer)").figure
    if empty:  # rows with nothing to draw: a line, not a row of empty panels
        what += "\n" + fill(f"no flips in any run: {'; '.join(empty)}", 120)
    fig, drawn = _facets(shown, "flipped fraction of\ntop-k slots", what, log=False)
    words = _words(f"fraction of top-k routing slots flipped ({setting}; y scale per row)", drawn, ".1%")
    describe(fig, "Line charts: " + words + (f"; no flips in any run: {'; '.join(empty)}" if empty else ""))
    return fig


__all__ = ["bitwise_twins", "loss_divergence", "weight_divergence", "routing_flips"]
