"""Every figure a notebook draws from its records draws from the published reports' records, read back through
`results.load` (so through `records.upgrade`): a figure that reads a field the current schema renamed fails here,
not after a 20-minute notebook run."""

from __future__ import annotations

import glob
import inspect
from pathlib import Path

import matplotlib

matplotlib.use("Agg")
import matplotlib.pyplot as plt  # noqa: E402
import pytest  # noqa: E402

from moe_lab import questions, results  # noqa: E402

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = sorted(Path(p).parent for p in glob.glob(str(ROOT / "reports/published/*/results.json.xz")))


def _record_figures():
    """(question, function name) for every figure function whose first parameter is the question's records."""
    out = []
    for q in questions.QUESTIONS:
        mod = q.figures_module()
        for name, fn in inspect.getmembers(mod, inspect.isfunction):
            if fn.__module__ != mod.__name__ or name.startswith("_"):
                continue
            first = next(iter(inspect.signature(fn).parameters), None)
            if first == "records":
                out.append((q, name))
    return out


FIGURES = _record_figures()
DRAWN_FROM = {("01", "layout_heatmap"): "layouts"}
"""The experiment whose records a figure draws, where it is not the question's first (as its notebook passes them)."""


def test_the_published_reports_and_figures_are_found():
    assert len(PUBLISHED) >= 4
    assert {q.number for q, _ in FIGURES} >= {"01", "03", "04", "05", "06", "07", "09"}
    assert ("05", "backward_stages") in {(q.number, n) for q, n in FIGURES}


@pytest.mark.parametrize("question,name", FIGURES, ids=lambda x: getattr(x, "number", x))
def test_each_figure_draws_from_every_published_report_holding_its_question(question, name):
    fn = getattr(question.figures_module(), name)
    drawn = 0
    for folder in PUBLISHED:
        experiment = DRAWN_FROM.get((question.number, name), question.experiments[0])
        recs = [r for r in questions.of_question(results.load(folder / "results.json"), question)
                if r.get("experiment") == experiment]
        if not recs:
            continue
        try:
            fn(recs)
        finally:
            plt.close("all")
        drawn += 1
    if not drawn:
        pytest.skip(f"no published report holds question {question.number}'s records")
