"""Where a report's time went, from the folder alone: per notebook, the runner's seconds (its kernel's start and cells),
papermill's own phases from the executed notebook (kernel start, set-up cells, the cells that run cases, the cells
after them: figures and tables), and the cases' own seconds from the records the notebook's latest run measured
(`case_wall_s` of each case key once: payload out, every rank's work, records back), by experiment and kind; a case
its run reused from results.json (measured before the notebook started) is counted apart. The shared cluster's
start and the command's seconds are the index's (`cluster_timings`, `elapsed_s`, where the run wrote them). The
stretches between two measured cases when no case ran on any engines (`idle_gaps`: one case runs at a time, the
engines' turn) are where the engines stood idle — a cluster starting, a kernel starting, the turn changing hands.

`moe-lab timing FOLDER` prints it as a markdown table; `table(folder)` returns the rows. Nothing is estimated: a
phase the folder does not hold (a notebook that failed before its cells ran, an index written by an older runner)
is left empty, said so."""

from __future__ import annotations

import datetime
import json
from dataclasses import dataclass, field
from pathlib import Path

CASE_CELL = "protocol.run("
"""A notebook cell that runs cases calls the protocol (every numbered notebook does so; the cells before the first
are its set-up, those after it its figures and tables)."""


@dataclass
class NotebookTime:
    notebook: str
    status: str
    total_s: float | None = None
    """The runner's seconds for it (index.json): its kernel's start and cells, as the runner timed them (its HTML
    pages are rendered after them, apart)."""
    papermill_s: float | None = None
    kernel_s: float | None = None
    """papermill's start to its first cell's: the kernel's start."""
    setup_s: float | None = None
    case_cells_s: float | None = None
    figures_s: float | None = None
    cases_s: float | None = None
    """The sum of the cases' own seconds (`case_wall_s`, once per case key) measured by its latest run."""
    cases: int = 0
    reused: int = 0
    """Cases its latest run showed from results.json, measured before the notebook started (not in cases_s)."""
    start: datetime.datetime | None = None
    by_kind: dict[str, tuple[int, float]] = field(default_factory=dict)
    """'experiment kind' → (cases, seconds)."""
    spans: list[tuple[datetime.datetime, float, str]] = field(default_factory=list, repr=False)
    """Each measured case: (its record's time stamp — its end, to the second —, its seconds, 'experiment kind')."""

    @property
    def rest_s(self) -> float | None:
        """The runner's seconds beyond papermill's own (starting papermill, reading and writing the notebook)."""
        if self.total_s is None or self.papermill_s is None:
            return None
        return max(0.0, self.total_s - self.papermill_s)


def _time(s: str | None) -> datetime.datetime | None:
    try:
        return datetime.datetime.fromisoformat(s) if s else None
    except ValueError:
        return None


def _seconds(a, b) -> float | None:
    return None if a is None or b is None else max(0.0, (b - a).total_seconds())


def notebook_phases(nb_path: Path) -> dict:
    """papermill's phases of an executed notebook: {start, papermill_s, kernel_s, setup_s, case_cells_s, figures_s}
    (a phase it does not hold is None)."""
    import nbformat

    nb = nbformat.read(nb_path, as_version=4)
    pm = nb.metadata.get("papermill", {})
    start, end = _time(pm.get("start_time")), _time(pm.get("end_time"))
    cells = []
    for c in nb.cells:
        meta = c.get("metadata", {}).get("papermill", {})
        t0 = _time(meta.get("start_time"))
        if c.cell_type != "code" or t0 is None:
            continue
        t1 = _time(meta.get("end_time"))
        dur = meta.get("duration")
        cells.append((t0, float(dur) if isinstance(dur, (int, float)) else _seconds(t0, t1) or 0.0,
                      CASE_CELL in c.source))
    duration = pm.get("duration")
    out = {"start": start, "papermill_s": duration if isinstance(duration, (int, float)) else _seconds(start, end),
           "kernel_s": _seconds(start, cells[0][0]) if cells else None,
           "setup_s": None, "case_cells_s": None, "figures_s": None}
    runs = [i for i, (_, _, is_case) in enumerate(cells) if is_case]
    if runs:
        first, last = runs[0], runs[-1]
        out["setup_s"] = sum(d for _, d, _ in cells[:first])
        out["case_cells_s"] = sum(d for _, d, is_case in cells[first:last + 1] if is_case)
        out["figures_s"] = sum(d for _, d, is_case in cells[first:] if not is_case)
    return out


def table(folder: str | Path) -> tuple[list[NotebookTime], dict]:
    """Every notebook of the report's index with its phases and cases' seconds, and the index's meta (its
    `cluster_timings` and `elapsed_s` where the runner wrote them). A published report (no index: its records and
    case lists only) gives each listed notebook's cases, status 'published', and no phases."""
    from .. import results as results_file

    folder = Path(folder)
    idx_path = folder / "index.json"
    if idx_path.exists():
        index = json.loads(idx_path.read_text())
    else:  # a published report keeps its records and the notebooks' case lists, not the runner's index
        listed = sorted(folder.glob("cases-*.json"))
        if not listed:
            raise ValueError(f"{folder}: no index.json and no cases-NN.json (not a report folder `moe-lab run` "
                             "wrote, nor a published one)")
        index = {"notebooks": [{"notebook": p.stem.split("-", 1)[1], "status": "published"} for p in listed]}
    records = results_file.load(folder / "results.json")
    by_key: dict[str, dict] = {}
    for r in records:
        by_key.setdefault(r.get("case_key"), r)
    rows = []
    for row in index.get("notebooks", []):
        num = row["notebook"]
        t = NotebookTime(notebook=num, status=row.get("status", ""), total_s=row.get("seconds"))
        nb = folder / row.get("file", "")
        if row.get("file") and nb.exists():
            ph = notebook_phases(nb)
            t.papermill_s, t.kernel_s, t.setup_s = ph["papermill_s"], ph["kernel_s"], ph["setup_s"]
            t.case_cells_s, t.figures_s, t.start = ph["case_cells_s"], ph["figures_s"], ph["start"]
        listed = results_file.read_cases(results_file.cases_path(folder, num)) or {}
        for key in dict.fromkeys(listed.get("keys", [])):  # one key per record there: a case once
            r = by_key.get(key)
            if r is None or not isinstance(r.get("case_wall_s"), (int, float)):
                continue
            when = _time(r.get("time"))
            if t.start is not None and when is not None and when < t.start - datetime.timedelta(seconds=1):
                t.reused += 1  # its time stamp is the end of its measurement, second-rounded
                continue
            kind = f"{r.get('experiment', '?')} {r.get('kind', '?')}"
            if when is not None:
                t.spans.append((when, float(r["case_wall_s"]), kind))
            n, s = t.by_kind.get(kind, (0, 0.0))
            t.by_kind[kind] = (n + 1, s + r["case_wall_s"])
            t.cases += 1
            t.cases_s = (t.cases_s or 0.0) + r["case_wall_s"]
        rows.append(t)
    return rows, index.get("meta", {})


IDLE_MIN_S = 2.0
"""Shorter stretches between cases are not said: a record's time stamp is its case's end to the second."""


@dataclass
class Gap:
    notebook: str
    """The notebook of the case after the gap."""
    kind: str
    """'experiment kind' of the case after the gap."""
    after: str
    """'NN experiment kind' of the case before it."""
    seconds: float


def idle_gaps(rows: list[NotebookTime], min_s: float = IDLE_MIN_S) -> tuple[list[Gap], float | None]:
    """The stretches of at least `min_s` between two measured cases of the run with no case running: the next case's
    start (its time stamp minus its `case_wall_s`) minus the latest end before it. Returns them in run order and the
    seconds from the first case's start to the last case's end (None without cases)."""
    spans = sorted(((end - datetime.timedelta(seconds=wall), end, t.notebook, kind)
                    for t in rows for end, wall, kind in t.spans), key=lambda x: x[0])
    if not spans:
        return [], None
    gaps = []
    latest_end, latest_what = spans[0][1], f"{spans[0][2]} {spans[0][3]}"
    for start, end, nb, kind in spans[1:]:
        idle = (start - latest_end).total_seconds()
        if idle >= min_s:
            gaps.append(Gap(nb, kind, latest_what, idle))
        if end >= latest_end:
            latest_end, latest_what = end, f"{nb} {kind}"
    return gaps, (max(e for _, e, _, _ in spans) - spans[0][0]).total_seconds()


def _f(x: float | None) -> str:
    return "–" if x is None else f"{x:.1f}"


def markdown(folder: str | Path) -> str:
    """The table `moe-lab timing` prints: one row per notebook, a row of sums, the cases by experiment and kind, and
    the shared cluster's start."""
    rows, meta = table(folder)
    head = ("| nb | status | total | papermill | kernel | set-up | case cells | cases (n) | figures | rest |\n"
            "| --- | --- | --- | --- | --- | --- | --- | --- | --- | --- |")
    lines = [head]
    for t in rows:
        lines.append(f"| {t.notebook} | {t.status} | {_f(t.total_s)} | {_f(t.papermill_s)} | {_f(t.kernel_s)} | "
                     f"{_f(t.setup_s)} | {_f(t.case_cells_s)} | {_f(t.cases_s)} ({t.cases}"
                     f"{f', {t.reused} reused' if t.reused else ''}) | {_f(t.figures_s)} | {_f(t.rest_s)} |")

    def total(name):
        vals = [getattr(t, name) for t in rows if getattr(t, name) is not None]
        return sum(vals) if vals else None

    lines.append(f"| all | | {_f(total('total_s'))} | {_f(total('papermill_s'))} | {_f(total('kernel_s'))} | "
                 f"{_f(total('setup_s'))} | {_f(total('case_cells_s'))} | {_f(total('cases_s'))} "
                 f"({sum(t.cases for t in rows)}) | {_f(total('figures_s'))} | {_f(total('rest_s'))} |")
    out = ["Seconds per notebook (total: the runner's, of which papermill's own and the rest; cases: the sum of each "
           "case's "
           "own `case_wall_s` measured by its latest run, the cases reused from results.json counted apart; the case "
           "cells' seconds beyond their cases' are the controller's own work (engine sets started or launched) and, "
           "with two notebooks at a time, the turns a notebook waited while the other's cases ran).", "", *lines, "",
           "Cases by experiment and kind:", ""]
    out += [f"- {t.notebook} {kind}: {n} case(s), {s:.1f} s" for t in rows for kind, (n, s) in t.by_kind.items()]
    gaps, span = idle_gaps(rows)
    if span is not None:
        out += ["", f"Engines idle between cases (no case running; at least {IDLE_MIN_S:g} s, the time stamps being "
                    f"to the second): {len(gaps)} stretch(es), {sum(g.seconds for g in gaps):.1f} s of the "
                    f"{span:.1f} s from the first case's start to the last case's end", ""]
        out += [f"- {g.seconds:.1f} s before {g.notebook} {g.kind} (after {g.after})" for g in gaps]
    ct = meta.get("cluster_timings")
    out.append("")
    if ct:
        out.append("Shared cluster: ready in " + ", ".join(f"{k} {v:.1f} s" for k, v in ct.items()
                                                            if isinstance(v, (int, float))))
    elif rows and all(t.status == "published" for t in rows):
        out.append("Shared cluster: a published report keeps no index, so its start and the run's seconds are not "
                   "here (its README says them)")
    else:
        out.append("Shared cluster: its start is not in this folder's index (a single notebook's cluster starts "
                   "inside it; an older runner did not write it)")
    if isinstance(meta.get("elapsed_s"), (int, float)):
        n_at = meta.get("notebooks_at_once", 1)
        whole = ", one notebook's cases at a time: each ran its cases after the one before it ended" \
            if meta.get("whole_notebook_turns") else ""
        out.append(f"Run: {meta['elapsed_s']:.1f} s from the command's start to the last notebook's end "
                   f"({n_at} notebook(s) at a time{whole}"
                   + ("; the notebooks' seconds overlap, so they add up to more" if n_at > 1 else "") + ")")
    return "\n".join(out)


__all__ = ["NotebookTime", "Gap", "notebook_phases", "table", "idle_gaps", "markdown", "CASE_CELL", "IDLE_MIN_S"]
