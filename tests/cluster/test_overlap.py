"""`moe-lab run` executes two notebooks at a time: the next one's kernel starts while the current one is still
running (its figures and pages), their engine work takes turns (`controller.turns`), at most two run at once, and
the index keeps notebook order. The control: MOE_LAB_OVERLAP=0 runs one notebook after the other. Real kernels
(papermill); no cluster (each notebook stands for its cases with a turn of the engines and a sleep)."""

from __future__ import annotations

import json
import os
import time

import pytest

from moe_lab.controller import turns
from moe_lab.reporting import runner as report
from tests.cluster.test_reliability import _notebooks

pytestmark = [pytest.mark.cluster, pytest.mark.notebook]

# its "cases" hold the engines 1.5 s, its "figures" take 1.5 s more outside them
NB = """
    import json, os, time
    from moe_lab.controller import turns
    t = {"start": time.time(), "at_once": turns.notebooks_at_once()}
    with turns.engines_turn():
        t["turn"] = [time.time()]
        time.sleep(1.5)
        t["turn"].append(time.time())
    time.sleep(1.5)
    t["end"] = time.time()
    with open(os.path.join(out_dir, "NUM.json"), "w") as f:
        json.dump(t, f)
    print("NUM done")
"""


def _run(tmp_path, name: str, monkeypatch, overlap: str):
    monkeypatch.setenv("MOE_LAB_SHARE_CLUSTER", "0")  # no engines: the notebooks stand for their cases
    monkeypatch.setenv("MOE_LAB_OVERLAP", overlap)
    nbs = _notebooks(tmp_path / f"nbs-{name}", {n: NB.replace("NUM", n) for n in ("01", "02", "03")})
    out = tmp_path / name
    t0 = time.monotonic()
    rc = report.run_all(profile="cpu", out=str(out), nb_dir=nbs)
    wall = time.monotonic() - t0
    index = json.loads((out / "index.json").read_text())
    times = {n: json.loads((out / f"{n}.json").read_text()) for n in ("01", "02", "03")}
    return rc, wall, index, times, out


def test_two_notebooks_at_a_time_take_turns_on_the_engines_and_keep_their_order(tmp_path, monkeypatch):
    rc, wall, index, t, out = _run(tmp_path, "overlap", monkeypatch, "1")
    print(f"TIME three notebooks, two at a time: {wall:.1f} s")
    assert rc == 0
    assert [r["notebook"] for r in index["notebooks"]] == ["01", "02", "03"]
    assert [r["verdict"] for r in index["notebooks"]] == ["01 done", "02 done", "03 done"]
    assert index["meta"]["notebooks_at_once"] == 2 and all(t[n]["at_once"] == 2 for n in t)
    assert t["02"]["start"] < t["01"]["end"], "02 did not start while 01 ran"
    assert t["03"]["start"] >= t["01"]["end"], "three notebooks ran at once"
    turns_ = sorted(tuple(t[n]["turn"]) for n in t)
    assert all(a[1] <= b[0] for a, b in zip(turns_, turns_[1:])), f"two notebooks held the engines at once: {turns_}"
    assert not (out / report.TURN_FILE).exists() and turns.ENV not in os.environ
    assert "Two notebooks at a time" in (out / "index.html").read_text()


def test_control_one_notebook_at_a_time_without_overlap(tmp_path, monkeypatch):
    rc, wall, index, t, out = _run(tmp_path, "serial", monkeypatch, "0")
    print(f"TIME three notebooks, one at a time: {wall:.1f} s")
    assert rc == 0 and [r["verdict"] for r in index["notebooks"]] == ["01 done", "02 done", "03 done"]
    assert index["meta"]["notebooks_at_once"] == 1 and all(t[n]["at_once"] == 1 for n in t)
    assert t["02"]["start"] >= t["01"]["end"] and t["03"]["start"] >= t["02"]["end"]
    assert "Two notebooks at a time" not in (out / "index.html").read_text()
