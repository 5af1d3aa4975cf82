"""reporting.timing (`moe-lab timing`): where a report's time went, read from a folder the test writes by hand — the
papermill phases of an executed notebook, each case's seconds once (a case has several records), a reused case
counted apart, and a folder that is not a report refused in one line."""

import json

import nbformat
import pytest

from moe_lab.records import SCHEMA
from moe_lab.reporting import timing

START = "2026-12-05T10:00:00+00:00"


def _cell(source: str, start: str, duration: float):
    c = nbformat.v4.new_code_cell(source)
    c.metadata["papermill"] = {"start_time": start, "duration": duration}
    return c


def _folder(tmp_path, *, reused_time: str = "2026-12-04T09:00:00+00:00"):
    nb = nbformat.v4.new_notebook()
    nb.metadata["papermill"] = {"start_time": START, "end_time": "2026-12-05T10:00:20+00:00", "duration": 20.0}
    nb.cells = [_cell("profile = 'cpu'", "2026-12-05T10:00:01.500+00:00", 0.5),
                _cell("import pandas", "2026-12-05T10:00:02+00:00", 2.0),
                nbformat.v4.new_markdown_cell("## cases"),
                _cell("records = protocol.run(x, P)", "2026-12-05T10:00:04+00:00", 10.0),
                _cell("figures.a(records)", "2026-12-05T10:00:14+00:00", 1.0),
                _cell("more = protocol.run(y, P)", "2026-12-05T10:00:15+00:00", 4.0),
                _cell("print(verdict)", "2026-12-05T10:00:19+00:00", 0.75),
                nbformat.v4.new_code_cell("never ran")]
    nbformat.write(nb, tmp_path / "01_x.ipynb")
    rec = {"schema": SCHEMA, "notebook": "01", "experiment": "reproduce", "time": "2026-12-05T10:00:10+00:00"}
    records = [{**rec, "kind": "case", "case_key": "a", "case_wall_s": 3.0},
               {**rec, "kind": "case", "case_key": "a", "case_wall_s": 3.0},  # a second record of case a
               {**rec, "kind": "layout", "case_key": "b", "case_wall_s": 5.5},
               {**rec, "kind": "case", "case_key": "c", "case_wall_s": 9.0, "time": reused_time},
               {**rec, "kind": "case", "case_key": "d", "case_wall_s": 7.0}]  # not in the run's list
    (tmp_path / "results.json").write_text(json.dumps(records))
    (tmp_path / "cases-01.json").write_text(json.dumps({"keys": ["a", "a", "b", "c"], "run_id": "1"}))
    (tmp_path / "index.json").write_text(json.dumps({
        "meta": {"cluster_timings": {"ready_s": 12.5, "engines_s": 7.0}, "elapsed_s": 30.0, "notebooks_at_once": 2},
        "notebooks": [{"notebook": "01", "file": "01_x.ipynb", "status": "ok", "seconds": 21.0},
                      {"notebook": "02", "file": "02_gone.ipynb", "status": "failed", "seconds": 1.0}]}))
    return tmp_path


def test_phases_cases_once_and_reused_apart(tmp_path):
    rows, meta = timing.table(_folder(tmp_path))
    t, gone = rows
    assert (t.papermill_s, t.kernel_s, t.setup_s, t.case_cells_s, t.figures_s) == (20.0, 1.5, 2.5, 14.0, 1.75)
    assert t.rest_s == 1.0
    assert (t.cases, t.reused, t.cases_s) == (2, 1, 8.5)  # a once, b; c reused; d not in the run's list
    assert t.by_kind == {"reproduce case": (1, 3.0), "reproduce layout": (1, 5.5)}
    assert gone.status == "failed" and gone.papermill_s is None and gone.cases == 0 and gone.rest_s is None
    assert meta["cluster_timings"]["ready_s"] == 12.5
    text = timing.markdown(tmp_path)
    assert "| 01 | ok | 21.0 | 20.0 | 1.5 | 2.5 | 14.0 | 8.5 (2, 1 reused) | 1.8 | 1.0 |" in text
    assert "| 02 | failed | 1.0 | – |" in text
    assert "ready in ready_s 12.5 s, engines_s 7.0 s" in text and "30.0 s from the command's start" in text
    assert "(2 notebook(s) at a time; the notebooks' seconds overlap" in text and "cases at a time" not in text
    index = json.loads((tmp_path / "index.json").read_text())
    index["meta"]["whole_notebook_turns"] = "the 79 GiB GPU the ranks share is under 100 GiB"
    (tmp_path / "index.json").write_text(json.dumps(index))
    assert ("(2 notebook(s) at a time, one notebook's cases at a time: each ran its cases after the one before it "
            "ended; the notebooks' seconds overlap") in timing.markdown(tmp_path)


def test_a_case_measured_in_the_run_is_not_reused(tmp_path):
    """The control for the reused count: the same case stamped inside the notebook's run is counted as measured."""
    rows, _ = timing.table(_folder(tmp_path, reused_time="2026-12-05T10:00:12+00:00"))
    assert (rows[0].cases, rows[0].reused, rows[0].cases_s) == (3, 0, 17.5)


def test_a_folder_without_an_index_is_refused(tmp_path):
    with pytest.raises(ValueError, match="no index.json and no cases-NN.json"):
        timing.table(tmp_path)
    (tmp_path / "index.json").write_text(json.dumps({"notebooks": []}))
    assert "its start is not in this folder's index" in timing.markdown(tmp_path)


def _two_notebooks(tmp_path, *, second_start: str):
    """01 measures a (10:00:07–10) and b (10:00:10–13), 02 measures c, starting at `second_start` and lasting 5 s."""
    rec = {"schema": SCHEMA, "experiment": "x"}
    c_end = timing._time(second_start) + __import__("datetime").timedelta(seconds=5)
    records = [{**rec, "notebook": "01", "kind": "case", "case_key": "a", "case_wall_s": 3.0,
                "time": "2026-12-05T10:00:10+00:00"},
               {**rec, "notebook": "01", "kind": "layout", "case_key": "b", "case_wall_s": 3.0,
                "time": "2026-12-05T10:00:13+00:00"},
               {**rec, "notebook": "02", "kind": "det", "case_key": "c", "case_wall_s": 5.0,
                "time": c_end.isoformat(timespec="seconds")}]
    (tmp_path / "results.json").write_text(json.dumps(records))
    (tmp_path / "cases-01.json").write_text(json.dumps({"keys": ["a", "b"], "run_id": "1"}))
    (tmp_path / "cases-02.json").write_text(json.dumps({"keys": ["c"], "run_id": "1"}))
    (tmp_path / "index.json").write_text(json.dumps({"meta": {}, "notebooks": [
        {"notebook": "01", "status": "ok"}, {"notebook": "02", "status": "ok"}]}))
    return tmp_path


def test_a_stretch_with_no_case_running_is_said_with_the_cases_around_it(tmp_path):
    folder = _two_notebooks(tmp_path, second_start="2026-12-05T10:00:25+00:00")
    gaps, span = timing.idle_gaps(timing.table(folder)[0])
    assert [(g.notebook, g.kind, g.after, g.seconds) for g in gaps] == [("02", "x det", "01 x layout", 12.0)]
    assert span == 23.0  # 10:00:07 → 10:00:30
    assert "- 12.0 s before 02 x det (after 01 x layout)" in timing.markdown(folder)


def test_control_cases_back_to_back_leave_no_stretch(tmp_path):
    folder = _two_notebooks(tmp_path, second_start="2026-12-05T10:00:14+00:00")  # 1 s: the stamps' rounding
    gaps, span = timing.idle_gaps(timing.table(folder)[0])
    assert gaps == [] and span == 12.0
    assert "0 stretch(es), 0.0 s of the 12.0 s" in timing.markdown(folder)


def test_a_published_report_without_an_index_gives_its_cases_and_gaps(tmp_path):
    folder = _two_notebooks(tmp_path, second_start="2026-12-05T10:00:25+00:00")
    (folder / "index.json").unlink()
    rows, meta = timing.table(folder)
    assert [(t.notebook, t.status, t.cases, t.papermill_s) for t in rows] == [("01", "published", 2, None),
                                                                             ("02", "published", 1, None)]
    assert meta == {} and [g.seconds for g in timing.idle_gaps(rows)[0]] == [12.0]
    assert "a published report keeps no index" in timing.markdown(folder)
