"""The answer table: one row per subject (release x dispatcher x layer or model x placement), one column per thing a
user asks — does it diverge, where, the fix, its cost, truncation, gradients, training — each cell the few words of
the card findings that fill it (`Finding.short`, chosen by each question's `answers`), its status kept for the mark.
Every word is a finding's; the full claims stay with the findings (the evidence block of the row)."""

from __future__ import annotations

import re
from dataclasses import dataclass, field

from .. import stats
from ..questions.spec import ANSWER_COLUMNS as COLUMNS
from .model import FAIL, MIXED, NA, NOT_MEASURED, PASS, Cost, Finding
HEADERS = {"diverges": "diverges?", "where": "where (first stage)", "fix": "fix", "cost": "cost of the fix",
           "truncation": "truncation", "gradients": "gradients", "training": "training",
           "expected": "gap expected? (fp64 truth)"}
_PRESET = re.compile(r"; preset ([\w.+-]+)")


@dataclass
class Cell:
    status: str
    text: str
    finding: Finding | None = None


@dataclass
class Row:
    release: str
    dispatcher: str
    placement: str
    layer: str
    layouts: list[str] = field(default_factory=list)
    cells: dict[str, list[Cell]] = field(default_factory=dict)
    findings: list[Finding] = field(default_factory=list)

    @property
    def model(self) -> str:
        """The preset's name where the layer is one, else the layer in its own words."""
        m = _PRESET.search(self.layer)
        return m.group(1) if m else self.layer

    @property
    def diverges(self) -> str | None:
        """'yes' where a diverges finding is FAIL, 'mixed' where MIXED (none FAIL), 'no' where all PASS, else None."""
        st = {c.status for c in self.cells.get("diverges", [])}
        return "yes" if FAIL in st else "mixed" if MIXED in st else "no" if st == {PASS} else None

    @property
    def fix(self) -> str | None:
        """'found' / 'none found' / 'nothing to fix' from the fix column's findings (None: no fix finding)."""
        fs = [c.finding for c in self.cells.get("fix", []) if c.finding is not None]
        if not fs:
            return None
        if any(f.status == FAIL for f in fs):
            return "none found"
        if any(f.remedy for f in fs):
            return "found"
        return "nothing to fix" if all(f.status == PASS for f in fs) else None


def cost_cell(c: Cost | None) -> Cell | None:
    """'1.06x (1.03–1.18), above the noise floor' — a fix's cost in a few words, by the one floor rule."""
    if c is None:
        return None
    if not c.valid:
        return Cell(NOT_MEASURED, "cost invalid: not ranked")
    text = f"{c.ratio:.2f}x ({c.ci[0]:.2f}–{c.ci[1]:.2f})" + (" in compute" if c.figure == "compute" else "")
    rel = c.against_floor
    words = {stats.INSIDE: "inside the noise floor", stats.OVERLAPS: "not told apart from noise",
             stats.ABOVE: "above the noise floor", stats.BELOW: "faster than plain"}
    return Cell(PASS if rel in (stats.INSIDE, stats.BELOW) else MIXED if rel == stats.OVERLAPS else FAIL
                if rel == stats.ABOVE else NA, text + (", " + words[rel] if rel in words else ", no noise floor"))


def _key(f: Finding) -> tuple:
    s = f.subject
    return s.get("release", "?"), s.get("dispatcher", "?"), s.get("placement", "?"), s.get("layer", "?")


def _place(row: Row, col: str, f: Finding) -> None:
    row.cells.setdefault(col, []).append(Cell(f.status, f.short or f.status.lower(), f))
    if col == "fix":
        row.cells.setdefault("cost", []).append(
            (cost_cell(f.evidence.cost) or Cell(NOT_MEASURED, "not measured")) if f.remedy else Cell(NA, "no fix to cost"))


def table(by_nb: dict[str, list[Finding]], columns_by_nb: dict[str, dict[str, str]],
          fallback_by_nb: dict[str, dict[str, str]] | None = None) -> list[Row]:
    """Rows in the order subjects first appear (the registry's question order). `columns_by_nb`: notebook number →
    its question's `answers` (card findings → column); `fallback_by_nb`: its `fallback_answers` (findings that fill
    a column only where nothing else did for that subject)."""
    rows: dict[tuple, Row] = {}
    for nb, fs in by_nb.items():
        cols = columns_by_nb.get(nb, {})
        for f in fs:
            if not f.card:
                continue
            row = rows.setdefault(_key(f), Row(*_key(f)))
            row.findings.append(f)
            lay = f.subject.get("layout")
            if lay and lay not in row.layouts:
                row.layouts.append(lay)
            col = cols.get(f.question)
            if col is not None:
                _place(row, col, f)
    for nb, fs in by_nb.items():
        for f in fs:
            col = (fallback_by_nb or {}).get(nb, {}).get(f.question)
            row = rows.get(_key(f))
            if col is None or row is None or any(c.finding is not None and c.finding.experiment != f.experiment
                                                  for c in row.cells.get(col, [])):
                continue
            row.findings.append(f)
            _place(row, col, f)
    return list(rows.values())


def banner(rows: list[Row]) -> dict[str, int]:
    """Counts over the rows, like a test run's summary: subjects, how many diverge / agree / are mixed, fix found /
    none found, and rows with nothing measured on divergence."""
    d = [r.diverges for r in rows]
    f = [r.fix for r in rows]
    return {"subjects": len(rows), "diverge": d.count("yes"), "mixed": d.count("mixed"), "agree": d.count("no"),
            "divergence not measured": d.count(None), "fix found": f.count("found"),
            "no fix found": f.count("none found")}


def banner_text(counts: dict[str, int]) -> str:
    return " · ".join(f"{v} {k}" for k, v in counts.items() if v or k == "subjects")


__all__ = ["COLUMNS", "HEADERS", "Cell", "Row", "table", "banner", "banner_text", "cost_cell"]
