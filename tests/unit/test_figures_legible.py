"""The figures can be read: colours from the colour-blind-safe palette, exact zeros marked (not only coloured), ULP
bins labelled by their range with empty bins kept, notebook 06's runs faceted with bitwise-equal runs drawn once and
said to be equal (decided from the records), no empty routing-flip panels, and an alt text built from the data on every
figure — carried into the `alt` of the notebook's HTML page. Drawn from the published reports' records where they
hold the case, from `records_factory` where a property needs a case they lack; every check has a control that shows it
catching the fault it looks for."""

from __future__ import annotations

import base64
import copy
import glob
import html
import inspect
import math
import re
from functools import lru_cache
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import numpy as np  # noqa: E402
import pandas as pd  # noqa: E402
import pytest  # noqa: E402
from matplotlib.collections import Collection, QuadMesh  # noqa: E402
from matplotlib.colors import ListedColormap, to_rgb  # noqa: E402

from moe_lab import questions, results  # noqa: E402
from moe_lab.reporting import plots  # noqa: E402
from moe_lab.questions.reproduce import figures as reproduce_figures  # noqa: E402
from moe_lab.questions.training import figures as training_figures  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = sorted(Path(p).parent for p in glob.glob(str(ROOT / "reports/published/*/results.json.xz")))
LOCAL = sorted(Path(p).parent for p in glob.glob(str(ROOT / "reports/cpu-*/results.json")))
"""A full cpu report where this checkout has one (not in CI): the figures of a question no published report holds."""
DRAWN_FROM = {("01", "layout_heatmap"): "layouts"}
"""The experiment whose records a figure draws, where it is not the question's first (as its notebook passes them)."""
NOT_FIGURES = {("01", "pair_table"), ("01", "ulp_bins"), ("09", "frame"), ("08", "frame"), ("06", "bitwise_twins")}
"""Functions of a figures module that take the records and return data, not a figure."""
NBCONVERT_DEFAULT = "No description has been provided for this image"


@lru_cache(maxsize=None)
def _load(folder: Path) -> tuple:
    return tuple(results.load(folder / "results.json"))


def published_records(question, experiment: str) -> list[dict]:
    """The question's records of `experiment` from the latest published report that holds them, else from a local cpu
    report ([] if none)."""
    for folder in list(reversed(PUBLISHED)) + list(reversed(LOCAL)):
        recs = [r for r in questions.of_question(list(_load(folder)), question) if r.get("experiment") == experiment]
        if recs:
            return copy.deepcopy(recs)
    return []


def _question(number: str):
    return next(q for q in questions.QUESTIONS if q.number == number)


def _figures():
    out = []
    for q in questions.QUESTIONS:
        mod = q.figures_module()
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or name.startswith("_") or (q.number, name) in NOT_FIGURES:
                continue
            if next(iter(inspect.signature(fn).parameters), None) == "records":
                out.append((q, name))
    return out


FIGURES = _figures()


def _figure(result):
    return plots.figure_of(result)


# --- colours ------------------------------------------------------------------------------------------------------

def _grey(rgb) -> bool:
    return max(rgb) - min(rgb) < 0.02


def _allowed(rgb) -> bool:
    """A colour of the palette, or a neutral grey (black, white, the n/a and reference-line greys)."""
    return _grey(rgb) or any(np.allclose(rgb, to_rgb(c), atol=0.01) for c in plots.PALETTE)


def _line_colours(line) -> list:
    """The colours a line shows: its stroke where it has one, its markers' edge (and face, for a filled marker)."""
    from matplotlib.markers import MarkerStyle

    out = [line.get_color()] if line.get_linestyle() not in ("None", "none", "", " ") else []
    if line.get_marker() not in (None, "None", "none", ""):
        out.append(line.get_markeredgecolor())
        if MarkerStyle(line.get_marker()).is_filled():
            out.append(line.get_markerfacecolor())
    return out


def off_palette(fig) -> list[str]:
    """Every colour the figure fills or strokes with that is neither a palette member nor a grey, and every colour
    map of its meshes that is neither SEQUENTIAL nor made of allowed colours."""
    bad = []
    for ax in fig.get_axes():
        for line in ax.get_lines():
            for c in _line_colours(line):
                if not (isinstance(c, str) and c in ("none", "auto")) and not _allowed(to_rgb(c)):
                    bad.append(f"line {line.get_label()!r}: {c}")
        for patch in ax.patches:
            face = patch.get_facecolor()
            if face[3] > 0 and not _allowed(face[:3]):
                bad.append(f"patch {patch.get_label()!r}: {face}")
        for coll in ax.collections:
            if isinstance(coll, QuadMesh) or (isinstance(coll, Collection) and coll.get_array() is not None):
                cmap = coll.get_cmap()
                ok = cmap.name == plots.SEQUENTIAL or (isinstance(cmap, ListedColormap)
                                                      and all(_allowed(to_rgb(c)) for c in cmap.colors))
                if not ok:
                    bad.append(f"colour map {cmap.name}")
                continue
            for face in list(coll.get_facecolors()) + list(coll.get_edgecolors()):
                if len(face) and face[3] > 0 and not _allowed(face[:3]):
                    bad.append(f"collection {type(coll).__name__}: {tuple(face)}")
    return bad


def test_the_palette_is_the_colour_blind_set():
    import seaborn as sns

    assert [tuple(c) for c in plots.PALETTE] == [tuple(c) for c in sns.color_palette("colorblind")]
    assert plots.SEQUENTIAL.removesuffix("_r") in ("cividis", "viridis", "mako", "rocket", "magma", "inferno")
    assert plots.PASS in plots.PALETTE and plots.FAIL in plots.PALETTE and plots.PASS != plots.FAIL


def test_the_palette_check_sees_an_off_palette_colour():
    """The control: matplotlib's default red line, a red/green bar pair and a map of seaborn's rocket are caught."""
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color="tab:red")
    ax.bar([0, 1], [1, 2], color=["#3b8a4e", plots.PALETTE[0]])
    ax.pcolormesh(np.ones((2, 2)), cmap="rocket_r")
    bad = off_palette(fig)
    plt.close(fig)
    assert any("tab:red" in b or "line" in b for b in bad)
    assert any("patch" in b for b in bad) and any("rocket_r" in b for b in bad)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1], color=plots.PALETTE[3])
    ax.axhline(1, color=plots.NEUTRAL)
    assert off_palette(fig) == []
    plt.close(fig)


# --- every notebook figure: palette and alt text --------------------------------------------------------------------

@pytest.mark.parametrize("question,name", FIGURES, ids=lambda x: getattr(x, "number", x))
def test_each_figure_uses_the_palette_and_carries_an_alt_text_from_its_data(question, name):
    recs = published_records(question, DRAWN_FROM.get((question.number, name), question.experiments[0]))
    if not recs:
        pytest.skip(f"no published report holds question {question.number}'s records")
    fn = getattr(question.figures_module(), name)
    try:
        fig = _figure(fn(recs))
        assert off_palette(fig) == []
        alt = plots.description_of(fig)
        assert alt and NBCONVERT_DEFAULT not in alt
        assert re.search(r"\d", alt), alt  # counts and values read from the records
        for ax in fig.get_axes():  # a reader can read every legend
            legend = ax.get_legend()
            if legend is not None:
                assert min(t.get_fontsize() for t in legend.get_texts()) >= plots.TEXT_PT
        for legend in fig.legends:
            assert min(t.get_fontsize() for t in legend.get_texts()) >= plots.TEXT_PT
    finally:
        plt.close("all")


def test_the_alt_text_follows_the_data():
    """Two sets of records, two alt texts: the count of exactly-0 cells is the one in the records (the control: a
    record changed to differ changes the count)."""
    recs = published_records(_question("01"), "reproduce")
    if not recs:
        pytest.skip("no published report holds question 01")
    table = reproduce_figures.pair_table(recs, "n_mismatch")
    zero = int((table == 0).sum().sum())
    ax = reproduce_figures.mismatch_by_pair(recs)
    assert f"{zero} of {table.size} cells exactly 0" in plots.description_of(ax)
    changed = copy.deepcopy(recs)
    r = next(r for r in changed if any(c["n_mismatch"] == 0 for c in r["detail"]["pairs"].values()))
    pair = next(p for p, c in r["detail"]["pairs"].items() if c["n_mismatch"] == 0)
    r["detail"]["pairs"][pair].update(n_mismatch=7, mismatch_frac=7 / r["detail"]["pairs"][pair]["numel"])
    ax2 = reproduce_figures.mismatch_by_pair(changed)
    assert f"{zero - 1} of {table.size} cells exactly 0" in plots.description_of(ax2)
    plt.close("all")


# --- exact zeros --------------------------------------------------------------------------------------------------

def test_exact_zero_cells_carry_the_hatch_and_only_they_do():
    v = pd.DataFrame([[0.0, 1e-3, np.nan], [0.2, 0.0, 0.0]], index=["a", "b"], columns=["x", "y", "z"])
    fig, ax = plt.subplots()
    plots.zero_aware_heatmap(v, ax, label="fraction")
    assert (plots.zero_marked(ax) == (v == 0).to_numpy()).all()
    patch = next(p for p in ax.patches if p.get_gid() == "exactly 0")
    assert patch.get_hatch() == plots.ZERO_HATCH
    bar = next(a for a in fig.get_axes() if a is not ax)
    assert plots.ZERO_WORDS in bar.get_ylabel()
    plt.close(fig)
    # the control: nothing is exactly 0, nothing is marked
    fig, ax = plt.subplots()
    plots.zero_aware_heatmap(v.fillna(0.5).replace(0.0, 0.1), ax, label="fraction")
    assert plots.zero_marked(ax) is None
    plt.close(fig)


def test_a_map_of_only_zeros_names_its_mark_in_a_legend():
    fig, ax = plt.subplots()
    plots.zero_aware_heatmap(pd.DataFrame(np.zeros((3, 3))), ax, annot=False, label="fraction differing")
    assert plots.zero_marked(ax).all()
    assert ax.get_legend() is not None and ax.get_legend().get_texts()[0].get_text() == "exactly 0"
    assert ax.get_legend().legend_handles[0].get_hatch() == plots.ZERO_HATCH
    plt.close(fig)


def test_the_published_pair_heatmap_marks_exactly_its_zero_cells():
    recs = published_records(_question("01"), "reproduce")
    if not recs:
        pytest.skip("no published report holds question 01")
    truth = (reproduce_figures.pair_table(recs, "n_mismatch") == 0).to_numpy()
    assert truth.any() and not truth.all()  # the report holds both kinds of cell: the check can tell them apart
    ax = reproduce_figures.mismatch_by_pair(recs)
    assert (plots.zero_marked(ax) == truth).all()
    plt.close("all")


# --- the ULP histogram ----------------------------------------------------------------------------------------------

def _ranges(labels: list[str]) -> list[tuple[int, int]]:
    sup = str.maketrans("⁰¹²³⁴⁵⁶⁷⁸⁹", "0123456789")
    out = []
    for t in labels:
        t = t.translate(sup)
        m = re.fullmatch(r"2(\d+)–2(\d+)−1", t)
        if m:
            out.append((2 ** int(m[1]), 2 ** int(m[2]) - 1))
        elif "–" in t:
            lo, hi = t.split("–")
            out.append((int(lo), int(hi)))
        else:
            out.append((int(t), int(t)))
    return out


def test_ulp_bins_are_labelled_by_their_range_and_empty_ones_kept():
    recs = published_records(_question("01"), "reproduce")
    if not recs:
        pytest.skip("no published report holds question 01")
    r = copy.deepcopy(next(r for r in recs if r["cross_rank"].get("applicable", True)))
    r["detail"]["ulp_hist"] = {"0-1": {"0": 100, "1": 5, "3": 2, "40": 1}}
    ax = reproduce_figures.ulp_histogram([r])
    labels = [t.get_text() for t in ax.get_xticklabels()]
    assert labels == ["0", "1", "2–3", "4–7", "8–15", "16–31", "32–63"]
    heights = [p.get_height() for p in ax.patches]
    assert heights == [100, 5, 2, 0, 0, 0, 1]  # the empty bins are there, at zero height
    assert ax.patches[0].get_hatch() == plots.ZERO_HATCH  # bin 0: bitwise equal elements, the exact-0 mark
    plt.close("all")


def test_published_ulp_bins_run_from_0_to_the_widest_distance_without_a_gap():
    recs = [r for r in published_records(_question("01"), "reproduce") if r["cross_rank"].get("applicable", True)]
    if not recs:
        pytest.skip("no published report holds question 01")
    widest = max(int(d) for r in recs for h in r["detail"]["ulp_hist"].values() for d in h)
    ax = reproduce_figures.ulp_histogram(recs)
    spans = _ranges([t.get_text() for t in ax.get_xticklabels() if t.get_text() != "not finite"])
    assert spans[0] == (0, 0) and spans[-1][0] <= widest <= spans[-1][1]
    assert all(b[0] == a[1] + 1 for a, b in zip(spans, spans[1:]))  # contiguous: no bin skipped
    plt.close("all")


def test_the_range_reader_sees_a_gap():
    """The control of the contiguity check: bins labelled by index, with an empty one skipped, fail it."""
    spans = _ranges(["0", "1", "2", "3", "5"])
    assert not all(b[0] == a[1] + 1 for a, b in zip(spans[1:], spans[2:]))
    assert [reproduce_figures.ulp_bin(d) for d in (0, 1, 2, 3, 4, 7, 8, 40)] == [0, 1, 2, 2, 3, 3, 4, 6]


# --- notebook 06 ----------------------------------------------------------------------------------------------------

def _panels(fig) -> dict[tuple[str, str], object]:
    """(row title, layout) → the panel's axes, read from the drawn figure."""
    out = {}
    for sub in fig.subfigs:
        row = sub.texts[0].get_text()
        for ax in sub.axes:
            if ax.axison:
                out[(row, ax.get_title().split("\n")[0])] = ax
    return out


def _data_lines(ax) -> list:
    return [line for line in ax.get_lines() if line.get_transform() == ax.transData]


def _training_records():
    from records_factory import train06

    return [train06(1, 0), train06(1, 1),  # the reference and its rerun: bitwise equal
            train06(2, 0, part_at=3), train06(2, 1, part_at=3),  # ep2: run 1 bitwise equal to run 0
            train06(4, 0, part_at=3), train06(4, 1, part_at=3, how_far=2e-3)]  # ep4: the runs differ (the control)


def test_bitwise_equal_runs_are_found_by_their_values():
    recs = _training_records()
    twins = training_figures.bitwise_twins(recs)
    assert twins[1] is recs[0] and twins[3] is recs[2]
    assert twins[5] is None  # ep4 run 1 differs from ep4 run 0: not marked
    # the same names with different values: not equal
    changed = copy.deepcopy(recs)
    changed[3]["loss_hex"][-1] = float.hex(float.fromhex(changed[3]["loss_hex"][-1]) * 1.5)
    assert training_figures.bitwise_twins(changed)[3] is None


def test_06_draws_an_equal_pair_once_and_says_so_and_a_differing_pair_twice():
    recs = _training_records()
    fig = training_figures.loss_divergence(recs)
    panels = _panels(fig)
    row = "1 layer(s), plain, det"
    equal, differ = panels[(row, "ep2")], panels[(row, "ep4")]
    assert "run 1 = run 0 (bitwise, all 6 steps)" in equal.get_title()
    assert len(_data_lines(equal)) == 1
    assert "=" not in differ.get_title() and len(_data_lines(differ)) == 2
    # the reference's rerun equals it at every step: no panel, said in the title
    assert (row, "ep1") not in panels
    assert "ep1 run 1 = run 0, the reference (bitwise, all 6 steps)" in " ".join(fig.texts[0].get_text().split())
    assert "1 run bitwise equal to another run of their layout" in plots.description_of(fig)
    plt.close("all")


def test_06_has_no_floor_exact_zeros_are_marked_and_axes_fit_the_data():
    recs = _training_records()
    fig = training_figures.loss_divergence(recs)
    ax = _panels(fig)[("1 layer(s), plain, det", "ep4")]
    drawn = [y for line in _data_lines(ax) for y in line.get_ydata() if math.isfinite(y)]
    lo, hi = ax.get_ylim()
    assert min(drawn) / lo <= 10 ** 0.5 + 1e-9 and hi / max(drawn) <= 10 ** 0.5 + 1e-9  # a half decade of margin
    assert lo > 1e-6  # not a made-up floor far below the data
    marks = [line for line in ax.get_lines() if line.get_marker() == training_figures.ZERO_MARK]
    assert marks and sorted(x for m in marks for x in m.get_xdata()) == [1, 1, 2, 2]  # steps 1 and 2, both runs
    plt.close("all")


def test_06_published_marks_the_pairs_the_records_say_are_equal_and_no_other():
    recs = [r for r in published_records(_question("06"), "training") if r.get("available")]
    if not recs:
        pytest.skip("no published report holds question 06")
    fig = training_figures.loss_divergence(recs)
    panels = _panels(fig)
    checked = {True: 0, False: 0}
    for (row, layout), ax in panels.items():
        runs = {r["run"]: r for r in recs if training_figures.layout_of(r) == layout
                and f"{r['layers']} layer(s), {r['setting']}, {'det' if r['deterministic'] else 'nondet'}" == row}
        if 0 in runs and 1 in runs and layout != runs[0].get("reference_layout"):  # run 0 here is not the reference
            equal = runs[0]["loss_hex"] == runs[1]["loss_hex"] and runs[0]["weights_fp"] == runs[1]["weights_fp"]
            assert ("run 1 = run 0 (bitwise" in ax.get_title()) == equal, (row, layout)
            assert len(_data_lines(ax)) == (1 if equal else 2)
            checked[equal] += 1
    assert checked[True] and checked[False]  # both kinds were in the report and were told apart
    plt.close("all")


def test_routing_flips_draws_no_empty_panel_and_names_rows_without_flips():
    from records_factory import train06

    recs = [train06(1, 0), train06(2, 0, part_at=3, flip_at=3),  # deterministic: ep2 flips from step 3
            train06(1, 0, det=False), train06(2, 0, det=False, part_at=3)]  # nondeterministic: no flip anywhere
    fig = training_figures.routing_flips(recs)
    panels = _panels(fig)
    assert set(panels) == {("1 layer(s), plain, det, layer 1", "ep2")}
    assert all(any(y > 0 for line in _data_lines(ax) for y in line.get_ydata()) for ax in panels.values())
    assert "no flips in any run: 1 layer(s), plain, nondet, layer 1" in fig.texts[0].get_text()
    plt.close("all")
    quiet = [train06(1, 0), train06(2, 0, part_at=3)]
    fig = training_figures.routing_flips(quiet)
    assert not fig.subfigs and "no flips in any run" in plots.description_of(fig)
    plt.close("all")


# --- alt text in the notebook's HTML --------------------------------------------------------------------------------

@pytest.fixture
def shell():
    """An in-process IPython shell with the PNG formatter of figures an inline kernel registers (no kernel)."""
    from IPython.core.interactiveshell import InteractiveShell
    from IPython.core.pylabtools import select_figure_formats
    from traitlets.config import Config

    config = Config()
    config.HistoryManager.enabled = False
    sh = InteractiveShell.instance(config=config)
    select_figure_formats(sh, {"png"})
    yield sh
    InteractiveShell.clear_instance()


def _html_alts(sh, *figs) -> list[str]:
    """The figures displayed as a kernel displays them, in a notebook converted by nbconvert's HTML exporter: the
    `alt` of each `<img>`."""
    import nbformat
    from nbconvert import HTMLExporter

    cell = nbformat.v4.new_code_cell("plots.mismatch_by_pair(records);")
    for fig in figs:
        data, md = sh.display_formatter.format(fig)
        cell.outputs.append(nbformat.v4.new_output("display_data", data=data, metadata=md))
    nb = nbformat.v4.new_notebook(cells=[cell])
    body, _ = HTMLExporter().from_notebook_node(nb)
    return [html.unescape(a) for a in re.findall(r'<img[^>]*\balt="([^"]*)"', body)]


def test_the_html_page_carries_each_figures_alt_text(shell):
    recs = published_records(_question("01"), "reproduce")
    if not recs:
        pytest.skip("no published report holds question 01")
    fig = plots.figure_of(reproduce_figures.mismatch_by_pair(recs))
    bare, ax = plt.subplots()  # the control: a figure nobody described gets nbconvert's default
    ax.plot([0, 1], [0, 1])
    alts = _html_alts(shell, fig, bare)
    assert alts == [plots.description_of(fig), NBCONVERT_DEFAULT]
    assert alts[0].startswith("Heatmap: output elements whose bits differ")
    plt.close("all")


def test_a_06_figure_reaches_the_html_with_its_alt_text(shell):
    fig = training_figures.loss_divergence(_training_records())
    assert _html_alts(shell, fig) == [plots.description_of(fig)]
    plt.close("all")


def test_a_described_figure_is_rendered_once_per_display_and_never_stale(shell, monkeypatch):
    """A described figure's text/html and image/png outputs come from one render (a 16-panel figure takes seconds to
    draw); the two carry the same PNG; a figure changed and shown again is drawn again. The control: a figure nobody
    described renders once too, by the PNG formatter alone."""
    from matplotlib.backend_bases import FigureCanvasBase

    renders = []
    original = FigureCanvasBase.print_figure

    def counted(self, *a, **k):
        renders.append(self.figure)
        return original(self, *a, **k)

    monkeypatch.setattr(FigureCanvasBase, "print_figure", counted)
    fig, ax = plt.subplots()
    ax.plot([0, 1], [0, 1])
    plots.describe(fig, "a line from 0 to 1")
    data, _ = shell.display_formatter.format(fig)
    assert len(renders) == 1 and set(data) >= {"text/html", "image/png"}
    png = data["image/png"]
    png = png if isinstance(png, str) else base64.b64encode(png).decode()
    assert f'src="data:image/png;base64,{png}"' in data["text/html"]
    ax.plot([0, 1], [1, 0])  # changed: the next display draws it again, and shows the change
    data2, _ = shell.display_formatter.format(fig)
    assert len(renders) == 2 and data2["image/png"] != data["image/png"]
    bare, bx = plt.subplots()
    bx.plot([0, 1], [0, 1])
    shell.display_formatter.format(bare)
    assert len(renders) == 3 and renders[-1] is bare
    plt.close("all")
