"""The files of a report under hostile conditions: a disk that fills up mid-run, a results file that is a FIFO, two
runs into one folder, files of another shape in --out, an unwritable --json, a stopped or dead controller. Each
fault is one line naming the file (or the process) and what to do, never a traceback and never a wait; each test has
its control (the same call on a sound file or process goes through), so a check that refused everything would fail.
"""

from __future__ import annotations

import errno
import json
import logging
import os
import signal
import subprocess
import sys
import textwrap
import threading
import time
from pathlib import Path

import pytest

from moe_lab import cli, fsio, results
from moe_lab.fsio import ReportWriteError
from moe_lab.records import SCHEMA
from moe_lab.reporting import runner
from moe_lab.results import ResultsFileError

from records_factory import cmp, rec01


def _within(seconds: float, fn, *args, **kw):
    """fn(*args) in a thread; fails the test if it has not returned within `seconds` (a read that blocks)."""
    out: dict = {}

    def go():
        try:
            out["value"] = fn(*args, **kw)
        except BaseException as e:  # noqa: BLE001 - handed to the test
            out["error"] = e

    t = threading.Thread(target=go, daemon=True)
    t.start()
    t.join(seconds)
    assert not t.is_alive(), f"{getattr(fn, '__name__', fn)} did not return within {seconds} s (it blocks)"
    if "error" in out:
        raise out["error"]
    return out.get("value")


def _one_line(capsys) -> str:
    err = capsys.readouterr().err.strip()
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    return err


# ---------------------------------------------------------------------------------------------- a full disk


def _enospc_after(monkeypatch, n: int) -> list:
    """fsio.write_atomic (the one writer of results.json and the run lists) fails with ENOSPC from its n+1-th call,
    as a write on a full disk does: an OSError naming no file."""
    calls, real = [], fsio.write_atomic

    def write(path, data):
        calls.append(str(path))
        if len(calls) > n:
            raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC))
        return real(path, data)

    monkeypatch.setattr(fsio, "write_atomic", write)
    return calls


def test_a_full_disk_mid_append_names_results_json_and_keeps_every_finished_record(tmp_path, monkeypatch):
    p = tmp_path / "results.json"
    _enospc_after(monkeypatch, 2)
    results.append(p, [{"x": 1}], notebook="t")
    results.append(p, [{"x": 2}], notebook="t")
    before = p.read_bytes()
    with pytest.raises(OSError) as e:
        results.append(p, [{"x": 3}], notebook="t")
    assert e.value.errno == errno.ENOSPC and e.value.filename == str(p), e.value
    assert p.read_bytes() == before and [r["x"] for r in results.load(p)] == [1, 2]
    assert sorted(os.listdir(tmp_path)) == ["results.json"]  # no temporary or lock file left
    # the run's mapping: exit 3 naming results.json (ReportWriteError), the records kept
    with pytest.raises(ReportWriteError) as w:
        runner._raise_if_write_failed(e.value, tmp_path)
    assert w.value.path == str(p) and "(No space left on device)" in str(w.value)
    monkeypatch.undo()  # the control, and the resume once space is free: the next append completes
    results.append(p, [{"x": 3}], notebook="t")
    assert [r["x"] for r in results.load(p)] == [1, 2, 3]


def test_write_atomic_names_the_report_file_whatever_write_failed(tmp_path, monkeypatch):
    """The real writer: a failed fsync (what a full disk or quota does once data reaches it) is the OSError with
    the report file as its name, and leaves the old file and no temporary file."""
    p = tmp_path / "cases-01.json"
    fsio.write_atomic(p, "old")

    def full(fd):
        raise OSError(errno.EDQUOT, os.strerror(errno.EDQUOT))

    monkeypatch.setattr(os, "fsync", full)
    with pytest.raises(OSError) as e:
        fsio.write_atomic(p, "new")
    assert (e.value.errno, e.value.filename) == (errno.EDQUOT, str(p)) and p.read_text() == "old"
    assert os.listdir(tmp_path) == ["cases-01.json"]
    monkeypatch.undo()
    fsio.write_atomic(p, "new")  # the control
    assert p.read_text() == "new" and oct(p.stat().st_mode & 0o777) == oct(0o666 & ~_umask())


def _umask() -> int:
    m = os.umask(0)
    os.umask(m)
    return m


OVER_THE_LIMIT = textwrap.dedent("""
    import resource, sys
    from pathlib import Path
    from moe_lab.fsio import ReportWriteError
    from moe_lab.reporting import runner
    out = Path(sys.argv[1])
    resource.setrlimit(resource.RLIMIT_FSIZE, (4096, 4096))  # `ulimit -f`: a write past 4 KiB fails (EFBIG)
    try:
        (out / "02_t.html").write_text("x" * 100_000)
    except OSError as e:
        print(e.errno, e.filename)
        try:
            runner._raise_if_write_failed(e, out)
        except ReportWriteError as w:
            print(w.path)
            print(w)
""")


def test_a_write_past_the_file_size_limit_names_the_file_it_was_writing(tmp_path):
    """A real write failure that names no file (EFBIG, past `ulimit -f`: the open succeeds, the write fails): the run
    names the page from the writing frame and ends with ReportWriteError (exit 3). The control: any other OSError
    without a file stays the notebook's own failure."""
    r = subprocess.run([sys.executable, "-c", OVER_THE_LIMIT, str(tmp_path)], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]
    lines = r.stdout.splitlines()
    assert lines[:2] == [f"{errno.EFBIG} None", str(tmp_path / "02_t.html")], r.stdout
    assert lines[2].startswith(f"cannot write {tmp_path / '02_t.html'} (File too large) during the run"), r.stdout
    runner._raise_if_write_failed(OSError(errno.ENOENT, "No such file or directory"), tmp_path)  # control: no raise


class _KernelError(Exception):
    """What papermill raises for a notebook cell's exception: the kernel's exception name and value as text."""

    def __init__(self, ename, evalue):
        super().__init__(f"{ename}: {evalue}")
        self.ename, self.evalue = ename, evalue


def test_a_record_the_notebook_kernel_could_not_write_ends_the_run_naming_results_json(tmp_path):
    target = tmp_path / "results.json"
    e = _KernelError("OSError", f"[Errno 28] No space left on device: '{target}'")
    with pytest.raises(ReportWriteError) as w:
        runner._raise_if_write_failed(e, tmp_path)
    assert w.value.path == str(target) and "(No space left on device)" in str(w.value)
    # the controls: a kernel's error that is no refused write, or a path outside the folder, is the notebook's own
    runner._raise_if_write_failed(_KernelError("FileNotFoundError", f"[Errno 2] No such file: '{target}'"), tmp_path)
    runner._raise_if_write_failed(_KernelError("OSError", "[Errno 28] No space left on device: '/elsewhere/x'"),
                                  tmp_path)
    runner._raise_if_write_failed(_KernelError("ValueError", "bad"), tmp_path)


# ---------------------------------------------------------------------------------------------- FIFOs


def test_a_results_file_that_is_a_fifo_is_refused_at_once(tmp_path):
    fifo = tmp_path / "results.json"
    os.mkfifo(fifo)
    with pytest.raises(ResultsFileError) as e:
        _within(5, results.load, fifo)
    assert str(e.value) == (f"{fifo} cannot be read (not a regular file: a FIFO (named pipe)); fix or move it, or "
                            "give another --out")
    with pytest.raises(ResultsFileError, match="cases-06.json cannot be read .not a regular file: a FIFO"):
        os.mkfifo(tmp_path / "cases-06.json")
        _within(5, results.read_cases, tmp_path / "cases-06.json")
    os.mkfifo(tmp_path / "index.json")
    with pytest.raises(ValueError, match="index.json cannot be read .not a regular file: a FIFO"):
        _within(5, runner._check_index, tmp_path / "index.json")
    # the control: the same files as regular files are read
    for name in ("results.json", "cases-06.json", "index.json"):
        (tmp_path / name).unlink()
    results.append(fifo, [{"x": 1}])
    (tmp_path / "cases-06.json").write_text('{"keys": ["k"]}')
    (tmp_path / "index.json").write_text('{"notebooks": []}')
    assert results.load(fifo)[0]["x"] == 1 and results.read_cases(tmp_path / "cases-06.json") == {"keys": ["k"]}
    runner._check_index(tmp_path / "index.json")


def test_findings_on_a_fifo_is_one_line_and_exit_2(tmp_path, capsys):
    os.mkfifo(tmp_path / "results.json")
    assert _within(20, cli.main, ["findings", str(tmp_path)]) == 2
    assert _one_line(capsys) == (f"moe-lab findings: error: {tmp_path / 'results.json'} cannot be read (not a regular "
                                 "file: a FIFO (named pipe)); fix or move it, or give another --out")


# ---------------------------------------------------------------------------------------------- two runs, one folder

HOLD = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from moe_lab.reporting import runner
    with runner._run_lock(Path(sys.argv[1])):
        print("held", flush=True)
        time.sleep(300)
""")
APPEND = "import sys; from moe_lab import results; results.append(sys.argv[1], [{'x': 1}], notebook='t')"


def test_the_run_lock_is_the_folder_s_own_and_ends_with_its_process(tmp_path):
    """A second run is refused naming the holder's pid and command — also once every file in the folder is removed
    (the lock is no file to delete); the holder's notebooks still append (no deadlock on the folder); SIGKILL of the
    holder frees the folder at once. The control: with no holder the lock is taken."""
    out = tmp_path / "report"
    out.mkdir()
    with runner._run_lock(out):  # the control: nobody holds it
        assert json.loads((out / runner.RUN_HOLDER).read_text())["pid"] == os.getpid()
    assert not (out / runner.RUN_HOLDER).exists()
    holder = subprocess.Popen([sys.executable, "-c", HOLD, str(out)], stdout=subprocess.PIPE, text=True)
    try:
        assert holder.stdout.readline().strip() == "held"
        for remove in (False, True):
            if remove:  # what a stale-lock message would invite: every file in the folder removed
                for f in out.iterdir():
                    f.unlink()
            with pytest.raises(ValueError) as e:
                with runner._run_lock(out):
                    pass
            msg = str(e.value)
            assert msg.startswith(f"another moe-lab run (pid {holder.pid}: {sys.executable} -c ") and \
                msg.endswith(f"is writing into {out}: wait for it to finish (its lock ends with it), or give this run "
                             "another --out") and "\n" not in msg.strip(), msg
        # the holder's notebook kernels append under its lock
        r = subprocess.run([sys.executable, "-c", APPEND, str(out / "results.json")], timeout=60)
        assert r.returncode == 0 and [x["x"] for x in results.load(out / "results.json")] == [1]
        holder.send_signal(signal.SIGKILL)
        holder.wait(timeout=30)
        t0 = time.monotonic()
        with runner._run_lock(out):
            assert time.monotonic() - t0 < 1
    finally:
        if holder.poll() is None:
            holder.kill()
            holder.wait()


def _measured_twice(p: Path) -> list[dict]:
    """Two runs of notebook 01 into one folder at once: every case appended twice, one run's then the other's."""
    pairs = {"0-1": {"n_mismatch": 2, "mismatch_frac": 0.002}}
    for t, n in (("2026-12-04T10:00:00+00:00", 1), ("2026-12-04T10:00:05+00:00", 2)):
        for d in ("allgather", "alltoall"):
            results.append(p, [rec01(d, "none", cmp(n), cmp(0), time=t, case_wall_s=1.5, detail={"pairs": pairs})])
    return json.loads(p.read_text())


def test_a_case_measured_twice_is_read_once_the_latest_said_once(tmp_path, caplog):
    from moe_lab.questions.reproduce.figures import pair_table

    p = tmp_path / "results.json"
    raw = _measured_twice(p)
    with pytest.raises(ValueError, match="Index contains duplicate entries"):  # what every later run of it met
        pair_table(raw)
    with caplog.at_level(logging.WARNING, logger="moe_lab.results"):
        got = results.load(p)
        assert results.load(p) == got
    assert [(r["dispatcher"], r["time"][-11:-6]) for r in got] == [("allgather", "00:05"), ("alltoall", "00:05")]
    assert pair_table(got).shape == (1, 2)
    said = [r.getMessage() for r in caplog.records if "measured more than once" in r.getMessage()]
    assert said == [f"{p}: 2 case(s) were measured more than once (e.g. case 01/allgather/none; two runs wrote into "
                    "this folder, or the file was joined by hand): the latest measurement of each is read, 2 earlier "
                    "record(s) left out"], said
    # the control: one run's records are read as written, nothing said
    q = tmp_path / "one" / "results.json"
    results.append(q, raw[2:])
    caplog.clear()
    assert len(results.load(q)) == 2 and not caplog.records


# ---------------------------------------------------------------------------------------------- files of another shape

BAD_INDEX = {
    "not JSON": ("{", "index.json is not valid JSON"),
    "not UTF-8": (b"\xff\xfe{}", "index.json is not UTF-8 text"),
    "a list": ("[]", "index.json must hold a JSON object, found list"),
    "rows not a list": ('{"notebooks": {}}', 'index.json must hold its rows as a list under "notebooks", found dict'),
    "a row of numbers": ('{"notebooks": [1]}', "index.json row 0 is not an index row (int)"),
    "a row without fields": ('{"notebooks": [{"notebook": "01"}]}',
                             "index.json row 0 lacks status, title, error, verdict, seconds"),
}
GOOD_ROW = {"notebook": "01", "file": "01_x.ipynb", "status": "ok", "error": "", "seconds": 3.0, "title": "t",
            "verdict": "v"}


@pytest.mark.parametrize("what", sorted(BAD_INDEX))
def test_an_index_of_another_shape_is_refused_naming_it(what, tmp_path):
    text, said = BAD_INDEX[what]
    p = tmp_path / "index.json"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    with pytest.raises(ValueError) as e:
        runner._check_index(p)
    assert said in str(e.value) and str(e.value).endswith("move it away or delete it (this run writes a new one, "
                                                          "without the rows of notebooks it does not run)")
    p.write_text(json.dumps({"meta": {}, "notebooks": [GOOD_ROW]}))  # the control
    runner._check_index(p)


BAD_CASES = {
    "a list": ("[]", "cases-06.json must be a JSON object with the run's case keys (\"keys\"), found list"),
    "keys a string": ('{"keys": "abc"}', "cases-06.json must hold the run's case keys as a list of strings"),
    "counts not integers": ('{"keys": [], "measured": "3"}', "cases-06.json has counts (measured, reused)"),
    "not UTF-8": (b'{"keys": ["\xff"]}', "cases-06.json is not UTF-8 text"),
    "not JSON": ('{"keys": [', "cases-06.json is not valid JSON"),
}


@pytest.mark.parametrize("what", sorted(BAD_CASES))
def test_findings_on_a_run_list_of_another_shape_is_one_line_naming_it(what, tmp_path, capsys):
    text, said = BAD_CASES[what]
    results.append(tmp_path / "results.json", [rec01("allgather", "none", cmp(1), cmp(0), notebook="06")])
    p = tmp_path / "cases-06.json"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    assert cli.main(["findings", str(tmp_path)]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"moe-lab findings: error: {tmp_path}/") and said in err, err
    assert err.endswith("move it away or delete it (every record of notebook 06 is then read, and its next run writes "
                        "a new one)"), err
    p.write_text(json.dumps({"keys": ["01/allgather/none"]}))  # the control
    assert cli.main(["findings", str(tmp_path)]) == 0


@pytest.mark.parametrize("text, said", [
    ('[{"notebook": ["01"]}]', "record 0 has notebook ['01'] (list)"),
    (b'[{"notebook": "\xff"}]', "results.json is not UTF-8 text"),
    (json.dumps([{**rec01("allgather", "none", cmp(1), cmp(0)), "layout": 3}]),
     "its records cannot be read into findings (TypeError: "),
], ids=["notebook a list", "not UTF-8", "a layout of another shape"])
def test_findings_on_a_record_of_another_shape_is_one_line_naming_the_file(text, said, tmp_path, capsys):
    p = tmp_path / "results.json"
    (p.write_bytes if isinstance(text, bytes) else p.write_text)(text)
    assert cli.main(["findings", str(tmp_path)]) == 2
    err = _one_line(capsys)
    assert str(p) in err and said in err, err


def test_records_of_another_layout_are_said_once_and_read_as_not_measured(tmp_path, caplog, capsys):
    p = tmp_path / "results.json"
    p.write_text(json.dumps([{"notebook": "01", "kind": "case", "schema": 2}, {"notebook": "01", "kind": "case"}]))
    with caplog.at_level(logging.WARNING, logger="moe_lab.results"):
        assert cli.main(["findings", str(tmp_path)]) == 0
        assert cli.main(["findings", str(tmp_path)]) == 0
    said = [r.getMessage() for r in caplog.records if "lack fields" in r.getMessage()]
    assert said == [f"{p}: 2 of 2 record(s) lack fields every moe-lab record carries in schemas 1-{SCHEMA} (e.g. "
                    "record 0 has no config, dispatcher, router_dtype, device, world, megatron_core): written by another "
                    "tool or edited by hand; no finding reads them, so their cases show as NOT MEASURED"], said
    assert "NOT MEASURED" in capsys.readouterr().out
    caplog.clear()  # the control: the lab's own records are read without a word
    q = tmp_path / "own" / "results.json"
    results.append(q, [rec01("allgather", "none", cmp(1), cmp(0))])
    with caplog.at_level(logging.WARNING, logger="moe_lab.results"):
        assert cli.main(["findings", str(q.parent)]) == 0
    assert not caplog.records


@pytest.mark.parametrize("name, text, said", [
    ("index.json", '{"notebooks": [1]}', "index.json row 0 is not an index row (int)"),
    ("cases-06.json", "[]", "cases-06.json must be a JSON object"),
    ("results.json", None, "results.json cannot be read (not a regular file: a FIFO (named pipe))"),
    ("01_reproduce_ep_divergence.html", None, "01_reproduce_ep_divergence.html is a FIFO (named pipe), where this "
                                              "run writes a file"),
])
def test_run_refuses_a_bad_file_in_out_before_anything_starts(name, text, said, tmp_path, capsys, monkeypatch):
    """`run --out DIR` with a file of another shape (or a FIFO) there: exit 2, one line naming it, no notebook and no
    cluster started (run_one and the shared cluster fail the test if called), DIR's files as they were."""
    def started(*a, **k):
        raise AssertionError("a notebook or cluster started")

    monkeypatch.setattr(runner, "run_one", started)
    monkeypatch.setattr(runner, "_shared_cluster", started)
    out = tmp_path / "r"
    out.mkdir()
    if text is None:
        os.mkfifo(out / name)
    else:
        (out / name).write_text(text)
    before = sorted(p.name for p in out.iterdir())
    assert _within(120, cli.main, ["run", "--profile", "cpu", "--only", "01", "--out", str(out)]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"moe-lab run: error: {out / name}") and said in err, err
    assert sorted(p.name for p in out.iterdir()) == before


# ---------------------------------------------------------------------------------------------- bench --json


@pytest.mark.parametrize("where", ["/proc/x/bench.json", "a FIFO", "a folder"])
def test_bench_refuses_an_unwritable_json_before_measuring(where, tmp_path, capsys, monkeypatch):
    from moe_lab.cli import bench

    class Measuring(Exception):
        pass

    def measure(**kw):
        raise Measuring

    monkeypatch.setattr(bench, "run", measure)
    path = {"a FIFO": tmp_path / "fifo", "a folder": tmp_path}.get(where, Path(where))
    if where == "a FIFO":
        os.mkfifo(path)
    t0 = time.monotonic()
    assert cli.main(["bench", "--quick", "--json", str(path)]) == 2
    assert time.monotonic() - t0 < 5
    err = _one_line(capsys)
    assert err.startswith(f"moe-lab bench: error: --json {path}"), err
    with pytest.raises(Measuring):  # the control: a writable path goes on to measure (and leaves no file yet)
        cli.main(["bench", "--quick", "--json", str(tmp_path / "ok.json")])
    assert not (tmp_path / "ok.json").exists()


# ---------------------------------------------------------------------------------------------- a timed-out cell


def _executed(tmp_path: Path, started: int) -> Path:
    import nbformat

    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(f"step_{i}()\n") for i in range(4)]
    for i, c in enumerate(nb.cells[:started]):
        c.metadata["papermill"] = {"start_time": "2026-12-04T10:00:00", "status": "completed"}
    p = tmp_path / "01_t.ipynb"
    nbformat.write(nb, p)
    return p


def test_a_timed_out_cell_is_said_in_words_with_the_cell(tmp_path):
    dst = _executed(tmp_path, started=3)
    assert runner._timed_out(dst, 5, {"pid": 42, "state": None}) == (
        "cell timed out: cell 3 of 4 (`step_2()`) ran longer than the notebook timeout (5 s, --timeout) and the kernel "
        "was ended; give a longer --timeout (or fewer cases) and run again: finished cases are reused")
    stopped = "stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger)"
    assert runner._timed_out(dst, 5, {"pid": 42, "state": stopped}) == (
        f"kernel stopped: the notebook's kernel (pid 42) is {stopped}, so cell 3 of 4 (`step_2()`) timed out after "
        "5 s; the kernel was ended — run the notebook again (finished cases are reused)")
    assert runner._timed_out(tmp_path / "missing.ipynb", 5, {}).startswith("cell timed out: a cell ran longer")


# ---------------------------------------------------------------------------------------------- the controller


class _Launcher:
    def __init__(self, process):
        self.process, self.stop_data = process, {}


class _State:
    def __init__(self, process):
        self.ipp = type("Ipp", (), {"controller": _Launcher(process)})()
        self.profile_dir = None


def test_the_controller_is_checked_first_stopped_or_gone():
    import psutil

    from moe_lab.controller.diagnosis import ClusterError, controller_down, raise_if_dead, raise_timeout

    proc = psutil.Popen([sys.executable, "-c", "import time; time.sleep(300)"])
    state = _State(proc)
    try:
        assert controller_down(state) is None  # the control: a running controller
        proc.send_signal(signal.SIGSTOP)
        deadline = time.monotonic() + 5
        while proc.status() != psutil.STATUS_STOPPED and time.monotonic() < deadline:
            time.sleep(0.02)
        assert controller_down(state, stopped=False) is None  # the liveness check waits for the timeout
        with pytest.raises(ClusterError) as e:
            raise_timeout(state, "probe x", [0, 1, 2, 3], {}, {0: 0, 1: 1, 2: 2, 3: 3}, 13)
        assert e.value.kind == "timeout" and e.value.ranks == [] and str(e.value) == (
            f"probe x: rank(s) [0, 1, 2, 3] did not answer within 13 s because the cluster's controller "
            f"(pid {proc.pid}) is stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger): calls reach the engines and their "
            f"answers come back only through it, so no rank is to blame; `kill -CONT {proc.pid}` (and its scheduler "
            "processes) resumes it, or stop the cluster and start it again")
        proc.kill()
        proc.wait(10)
        with pytest.raises(ClusterError) as e:
            raise_if_dead(state, "probe x", {})
        assert e.value.kind == "died" and e.value.stopped and e.value.ranks == [] and str(e.value) == (
            f"the cluster's controller (pid {proc.pid}) is gone (killed by SIGKILL) during probe x: calls reach the "
            "engines and their answers come back only through it; the engines were stopped: start the cluster again")
    finally:
        if proc.poll() is None:
            proc.kill()
            proc.wait()


# ---------------------------------------------------------------------------------------------- versions, wheelhouse


@pytest.mark.parametrize("cache", ["/proc/x", "/etc/passwd"])
def test_versions_install_into_an_unusable_cache_is_one_line(cache, tmp_path, capsys, monkeypatch, no_subprocess):
    monkeypatch.setenv("MOE_LAB_CACHE", cache)
    assert cli.main(["versions", "install", "0.13.0"]) == 2
    err = _one_line(capsys)
    assert err.startswith(f"moe-lab versions: error: MOE_LAB_CACHE ({cache}/megatron-core/") and \
        err.endswith("choose another MOE_LAB_CACHE"), err
    assert no_subprocess == []
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "cache"))  # the control: a usable cache goes on to pip
    with pytest.raises(AssertionError, match="a subprocess ran"):
        cli.main(["versions", "install", "0.13.0"])


def test_wheelhouse_without_a_release_or_with_a_full_folder_is_one_line(tmp_path, capsys, monkeypatch):
    from moe_lab.tools import wheelhouse

    assert cli.main(["wheelhouse", "-o", str(tmp_path / "wh"), "--megatron", ",,"]) == 2
    assert _one_line(capsys).endswith("--megatron ',,' names no release; give one or more, e.g. --megatron "
                                      "0.16.1,0.12.3")
    got = {}

    def full(out, **kw):
        got.update(kw)
        raise OSError(errno.ENOSPC, os.strerror(errno.ENOSPC), str(Path(out) / "numpy.whl"))

    monkeypatch.setattr(wheelhouse, "build", full)
    assert cli.main(["--log", str(tmp_path / "error.log"), "wheelhouse", "-o", str(tmp_path / "wh"), "--megatron",
                     "0.16.1"]) == 3
    err = _one_line(capsys)
    assert err.startswith(f"moe-lab wheelhouse: failed: gathering wheels into {tmp_path / 'wh'}: No space left on "
                          f"device ({tmp_path / 'wh' / 'numpy.whl'}); free space or give another -o"), err
    assert got["megatron_versions"] == ("0.16.1",)  # the control: a release given reaches the build
