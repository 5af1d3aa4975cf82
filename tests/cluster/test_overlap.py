"""`moe-lab run` executes two notebooks at a time: the next one's kernel starts while the current one is still
running (its figures and pages), their engine work takes turns (`controller.turns`), at most two run at once, and
the index keeps notebook order. The control: MOE_LAB_OVERLAP=0 runs one notebook after the other. Real kernels
(papermill); no cluster (each notebook stands for its cases with a turn of the engines and a sleep)."""

from __future__ import annotations

import json
import os
import subprocess
import sys
import time

import pytest

from moe_lab.controller import turns
from moe_lab.reporting import runner as report
from tests.cluster.test_reliability import _notebooks

pytestmark = [pytest.mark.cluster, pytest.mark.notebook]

# its "cases" hold the engines 1.5 s, its "figures" take FIGURES_S more outside them
NB = """
    import json, os, time
    from moe_lab.controller import spares, turns
    t = {"start": time.time(), "at_once": turns.notebooks_at_once(), "kernel": spares.in_notebook_kernel()}
    with turns.engines_turn():
        t["turn"] = [time.time()]
        time.sleep(1.5)
        t["turn"].append(time.time())
    time.sleep(FIGURES_S)
    t["end"] = time.time()
    with open(os.path.join(out_dir, "NUM.json"), "w") as f:
        json.dump(t, f)
    print("NUM done")
"""


def _run(tmp_path, name: str, monkeypatch, overlap: str, figures_s: float = 1.5):
    monkeypatch.setenv("MOE_LAB_SHARE_CLUSTER", "0")  # no engines: the notebooks stand for their cases
    monkeypatch.setenv("MOE_LAB_OVERLAP", overlap)
    nbs = _notebooks(tmp_path / f"nbs-{name}", {n: NB.replace("NUM", n).replace("FIGURES_S", str(figures_s))
                                               for n in ("01", "02", "03")})
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
    assert all(t[n]["kernel"] for n in t)  # a notebook's run keeps its own engines for its next cell (keep_wanted)
    assert t["02"]["start"] < t["01"]["end"], "02 did not start while 01 ran"
    assert t["03"]["start"] >= min(t["01"]["end"], t["02"]["end"]), "three notebooks ran at once"
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


def test_on_a_small_shared_gpu_the_next_notebook_starts_beside_and_runs_its_cases_after_the_one_before(
        tmp_path, monkeypatch):
    """Where the ranks share a GPU under SHARED_GPU_OVERLAP_MIN_GIB (its size read from the shared cluster, stood in
    for here): two kernels at a time, but a notebook keeps the engines from its first case until its kernel exits,
    so the next one starts (kernel, set-up) while the one before runs and takes the engines after it ended."""
    monkeypatch.setattr(report, "_shared_gpu_gib", lambda cluster, config: 79.2)
    monkeypatch.delenv(turns.WHOLE_ENV, raising=False)
    # the next notebook's kernel starts once the first notebook ends and must reach its first cell while the one that
    # waited for the engines runs (its cases, then its figures): on a loaded 2-core machine a kernel's start took
    # more than the 3 s those would take with 1.5 s of figures
    rc, wall, index, t, out = _run(tmp_path, "whole", monkeypatch, "", figures_s=6.0)
    print(f"TIME three notebooks, one's cases at a time: {wall:.1f} s")
    assert rc == 0 and [r["verdict"] for r in index["notebooks"]] == ["01 done", "02 done", "03 done"]
    assert index["meta"]["notebooks_at_once"] == 2 and "79 GiB" in index["meta"]["whole_notebook_turns"]
    order = sorted(t, key=lambda n: t[n]["turn"][0])  # whichever kernel reached its first case first runs first
    for a, b in zip(order, order[1:]):
        assert t[b]["start"] < t[a]["end"], f"{b} did not start while {a} ran"
        assert t[b]["turn"][0] >= t[a]["end"], f"{b}'s cases began before {a} had ended"
    assert "One notebook's cases at a time" in (out / "index.html").read_text()
    assert turns.ENV not in os.environ and turns.WHOLE_ENV not in os.environ


def test_a_short_notebook_beside_a_long_one_hands_its_place_to_the_next(tmp_path, monkeypatch):
    """01 holds the engines 1 s and draws 10 s; 02 and 03 are short: 03 starts as soon as 02 ends, while 01 still
    draws (waiting for the long one would start it only after 01's figures), never three at once, and the index keeps
    notebook order."""
    monkeypatch.setenv("MOE_LAB_SHARE_CLUSTER", "0")
    monkeypatch.setenv("MOE_LAB_OVERLAP", "1")
    timed = NB.replace("time.sleep(1.5)", "time.sleep(TURN_S)", 1).replace("FIGURES_S", "DRAW_S")
    sources = {n: timed.replace("NUM", n).replace("TURN_S", turn).replace("DRAW_S", draw)
               for n, turn, draw in (("01", "1.0", "10.0"), ("02", "0.5", "0.0"), ("03", "0.5", "0.0"))}
    out = tmp_path / "out"
    rc = report.run_all(profile="cpu", out=str(out), nb_dir=_notebooks(tmp_path / "nbs", sources))
    index = json.loads((out / "index.json").read_text())
    t = {n: json.loads((out / f"{n}.json").read_text()) for n in ("01", "02", "03")}
    assert rc == 0 and [r["notebook"] for r in index["notebooks"]] == ["01", "02", "03"]
    assert t["03"]["start"] >= t["02"]["end"], "three notebooks ran at once"
    assert t["03"]["start"] < t["01"]["end"] - 3, f"03 waited for 01 to end: {t}"


RUN = ("import sys; from pathlib import Path; from moe_lab import cli; from moe_lab.reporting import runner; "
       "runner.run_all.__kwdefaults__['nb_dir'] = Path(sys.argv[1]); "
       "sys.exit(cli.main(['--log', sys.argv[3], 'run', '--profile', 'cpu', '--out', sys.argv[2]]))")


@pytest.mark.parametrize("wait", [0.5, 1.5, 3.0], ids=["03-not-started", "03-starting", "03-in-its-cell"])
def test_a_failure_that_stops_the_run_ends_the_notebook_beside_it_quietly(tmp_path, wait):
    """02 leaves a directory where its page goes, so the run stops on a file it cannot write (exit 3, one line),
    while 03 (started as 01 ended: a 60 s cell) runs beside it, caught before, while or after its kernel starts:
    03's kernel is ended with the run — no traceback from it (a kernel killed while it started printed a ZMQError
    one), nothing left running, the run's line the last, in far less than 60 s."""
    import psutil

    nbs = _notebooks(tmp_path / f"nbs-{wait}", {
        "01": "print('01 done')",
        "02": f"import os, time\ntime.sleep({wait})\nos.mkdir(os.path.join(out_dir, '02_t.html'))\nprint('02 done')",
        "03": "import time\ntime.sleep(60)\nprint('03 done')",
    })
    out, log = tmp_path / "out", tmp_path / "error.log"
    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", RUN, str(nbs), str(out), str(log)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "MOE_LAB_SHARE_CLUSTER": "0", "MOE_LAB_OVERLAP": "1",
                              "MOE_LAB_TEST_MARK": str(out)})
    rc = p.wait(timeout=120)
    dt = time.monotonic() - t0
    err = p.stderr.read()
    print(f"TIME a failure beside a running notebook → exit {rc}: {dt:.1f} s")
    last = err.strip().splitlines()[-1]
    assert rc == 3, err[-3000:]
    assert last.startswith(f"moe-lab run: failed: cannot write {out / '02_t.html'} (Is a directory)"), err[-3000:]
    assert "Traceback" not in err and "ZMQError" not in err, err[-5000:]
    assert dt < 45, dt
    time.sleep(0.5)
    left = [q.pid for q in psutil.process_iter(["pid"]) if _marked(q, out)]
    assert left == []


def _marked(q, out) -> bool:
    import psutil

    try:
        return q.pid != os.getpid() and q.environ().get("MOE_LAB_TEST_MARK") == str(out) and \
            q.status() != psutil.STATUS_ZOMBIE
    except psutil.Error:
        return False
