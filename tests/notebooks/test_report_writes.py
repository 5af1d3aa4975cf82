"""A report folder that stops taking writes during `moe-lab run` — every finished record and page is kept,
the run stops there and says in one line which file it could not write, exit 3 (a failure mid-run); no traceback on
stderr (it is in --log).

Tests run as root, where chmod 555 stops nothing, so the failures are real ones root meets too:
- the folder made read-only after notebook 01: a read-only bind mount of `--out` onto itself (what a file system
  remounted read-only does: EROFS for every new write; the run's lock, opened before, stays open). Needs mount
  permission (CAP_SYS_ADMIN), skipped with the reason elsewhere;
- a file the run must write is a directory (`--out/02_t.ipynb`): IsADirectoryError, anywhere.
- the disk filling up: the run's file size limit (`ulimit -f`, RLIMIT_FSIZE) reached by notebook 02's record
  (EFBIG, naming no file where the write fails), a real failure of the write layer that needs no root;
The control: the same notebooks into a folder that stays writable run to the end, exit 0 (and after the directory is
removed, or the limit lifted, the failed run's folder takes the rerun).

A notebook kernel SIGSTOPped mid-cell: the cell times out and the index row says so in words — the kernel stopped,
which cell, after how long — never papermill's `CellTimeoutError: -------------------`.

Three small notebooks, no cluster (MOE_LAB_SHARE_CLUSTER=0): 01 and 03 append a record, 02 waits for `go` (outside
the folder) and then appends its own; one notebook at a time (MOE_LAB_OVERLAP=0), so that 01's files are all the
folder holds when it breaks (two at a time, which notebook writes first is a race; a notebook beside a failing one:
tests/cluster/test_overlap.py). Each test prints `TIME <what>: <seconds>`; docs/faults.md quotes them.
"""

import json
import os
import shutil
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import pytest

from moe_lab.records import SCHEMA

pytestmark = pytest.mark.notebook

RUN = ("import sys; from pathlib import Path; from moe_lab import cli; from moe_lab.reporting import runner; "
       "runner.run_all.__kwdefaults__['nb_dir'] = Path(sys.argv[1]); "
       "sys.exit(cli.main(['--log', sys.argv[3], 'run', '--profile', 'cpu', '--out', sys.argv[2]]))")
RECORD = """
    import os, time
    from moe_lab import results
    while not os.path.exists({go!r}):
        time.sleep(0.1)
    results.append(os.path.join(out_dir, "results.json"), [{{"x": {n}}}], notebook="t{n}")
    print("{n} done")
"""


def _setup(tmp_path: Path) -> tuple[Path, Path, Path]:
    import nbformat

    nbs, out, go = tmp_path / "nbs", tmp_path / "out", tmp_path / "go"
    nbs.mkdir()
    out.mkdir()
    for n in (1, 2, 3):
        nb = nbformat.v4.new_notebook()
        wait = str(go) if n == 2 else str(nbs)  # only 02 waits: the others' path exists
        nb.cells = [nbformat.v4.new_markdown_cell(f"# nb {n}"),
                    nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'",
                                              metadata={"tags": ["parameters"]}),
                    nbformat.v4.new_code_cell(textwrap.dedent(RECORD.format(go=wait, n=n)).strip(),
                                              metadata={"tags": ["verdict"]})]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, nbs / f"0{n}_t.ipynb")
    return nbs, out, go


def _start(nbs: Path, out: Path, log: Path) -> subprocess.Popen:
    return subprocess.Popen([sys.executable, "-c", RUN, str(nbs), str(out), str(log)], stdout=subprocess.DEVNULL,
                            stderr=subprocess.PIPE, text=True,
                            env={**os.environ, "MOE_LAB_SHARE_CLUSTER": "0", "MOE_LAB_OVERLAP": "0",
                                 "MOE_LAB_TEST_MARK": str(out)})


def _left(out: Path) -> list[int]:
    """Processes still running that the run started (its kernels carry the run's environment)."""
    import psutil

    time.sleep(0.5)
    found = []
    for q in psutil.process_iter(["pid"]):
        try:
            if q.pid != os.getpid() and q.environ().get("MOE_LAB_TEST_MARK") == str(out) and \
                    q.status() != psutil.STATUS_ZOMBIE:
                found.append(q.pid)
        except psutil.Error:
            continue
    return found


def _rows(out: Path) -> dict:
    return {r["notebook"]: r for r in json.loads((out / "index.json").read_text())["notebooks"]}


def _after_01(p: subprocess.Popen, out: Path) -> dict:
    """Wait until notebook 01's row is in the index (01 finished, 02 started); its files' bytes."""
    deadline = time.monotonic() + 240
    while True:
        try:
            if "01" in _rows(out):
                break
        except (OSError, ValueError):
            pass
        assert p.poll() is None, p.stderr.read()[-3000:]
        assert time.monotonic() < deadline, "notebook 01 did not finish"
        time.sleep(0.1)
    return {f: (out / f).read_bytes() for f in ("results.json", "01_t.ipynb", "01_t.html", "index.json")}


def _check_failure(p, out, log, kept, bad: str, why: str, t0: float, label: str) -> None:
    rc = p.wait(timeout=120)
    dt = time.monotonic() - t0
    err = p.stderr.read()
    last = err.strip().splitlines()[-1]
    print(f"TIME {label} → exit {rc}: {dt:.1f} s\n{last}")
    assert rc == 3, err[-3000:]
    assert last == (f"moe-lab run: failed: cannot write {out / bad} ({why}) during the run, so it stopped there; "
                    f"notebook(s) 01 finished and their records are kept in {out / 'results.json'}; make the folder "
                    "writable (a read-only or full file system, a directory where the file goes) or give another "
                    f"--out, and run again: finished cases are reused (traceback: {log})"), err[-3000:]
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.startswith("moe-lab")] == [last], err
    assert {f: (out / f).read_bytes() for f in kept} == kept  # every finished record and page as it was
    assert json.loads(kept["results.json"]) == [{"notebook": "t1", "x": 1, "schema": SCHEMA}]  # written typed
    assert "ReportWriteError" in log.read_text()
    assert _left(out) == []  # 02's kernel included


def test_a_report_folder_made_read_only_mid_run_keeps_what_finished_and_says_which_file(tmp_path):
    if shutil.which("mount") is None:
        pytest.skip("no mount(8) to make the folder read-only")
    nbs, out, go = _setup(tmp_path)
    probe = tmp_path / "probe"
    probe.mkdir()
    r = subprocess.run(["mount", "--bind", str(probe), str(probe)], capture_output=True, text=True)
    if r.returncode != 0:
        pytest.skip(f"a read-only bind mount needs mount permission: {r.stderr.strip()}")
    subprocess.run(["umount", str(probe)], check=True)
    log = tmp_path / "error.log"
    p = _start(nbs, out, log)
    mounted = False
    try:
        kept = _after_01(p, out)
        subprocess.run(["mount", "--bind", str(out), str(out)], check=True)
        mounted = True
        subprocess.run(["mount", "-o", "remount,ro,bind", str(out)], check=True)
        with pytest.raises(OSError):  # the fault is real: root cannot write there either
            (out / "written-by-root").write_text("x")
        t0 = time.monotonic()
        go.touch()  # 02 goes on: its record and its page cannot be written
        _check_failure(p, out, log, kept, "02_t.ipynb", "Read-only file system", t0, "--out read-only after 01")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
        if mounted:
            subprocess.run(["umount", "-l", str(out)])
    assert _rows(out)["01"]["status"] == "ok"


def test_a_report_file_that_is_a_directory_stops_the_run_in_one_line_and_the_rerun_works(tmp_path):
    nbs, out, go = _setup(tmp_path)
    go.touch()
    log = tmp_path / "error.log"
    (out / "02_t.ipynb").mkdir()  # where notebook 02's executed copy goes
    p = _start(nbs, out, log)
    kept = _after_01(p, out)
    t0 = time.monotonic()
    _check_failure(p, out, log, kept, "02_t.ipynb", "Is a directory", t0, "--out/02_t.ipynb a directory")
    # the control: the same folder, once the directory is gone, takes the rerun to the end
    (out / "02_t.ipynb").rmdir()
    p = _start(nbs, out, log)
    assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    assert [_rows(out)[n]["verdict"] for n in ("01", "02", "03")] == ["1 done", "2 done", "3 done"]


PADDED = """
    import os
    from moe_lab import results
    path = os.path.join(out_dir, "results.json")
    if not any(r.get("x") == {n} for r in results.load(path)):  # a rerun reuses what was written
        results.append(path, [{{"x": {n}, "pad": "p" * {pad}}}], notebook="t{n}")
    print("{n} done")
"""


def test_a_disk_that_fills_up_mid_run_is_exit_3_naming_results_json_and_the_resume_completes(tmp_path):
    """The run under a file size limit of 1.5 MB: notebook 01's record (1 MB of padding) fits, 02's makes results.json
    2 MB and its write fails (EFBIG, File too large: what a full disk is to the writer). Exit 3, the one line names
    results.json, 01's record and pages kept byte for byte, nothing left running. With the limit lifted, the same
    command completes the report (exit 0, each record once)."""
    import nbformat
    import resource

    nbs, out = tmp_path / "nbs", tmp_path / "out"
    nbs.mkdir()
    for n in (1, 2, 3):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'",
                                              metadata={"tags": ["parameters"]}),
                    nbformat.v4.new_code_cell(textwrap.dedent(PADDED.format(n=n, pad=1_000_000)).strip(),
                                              metadata={"tags": ["verdict"]})]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, nbs / f"0{n}_t.ipynb")
    log = tmp_path / "error.log"
    limit = 1_500_000

    def limited():
        resource.setrlimit(resource.RLIMIT_FSIZE, (limit, limit))

    t0 = time.monotonic()
    p = subprocess.Popen([sys.executable, "-c", RUN, str(nbs), str(out), str(log)], stdout=subprocess.DEVNULL,
                         stderr=subprocess.PIPE, text=True, preexec_fn=limited,
                         env={**os.environ, "MOE_LAB_SHARE_CLUSTER": "0", "MOE_LAB_OVERLAP": "0",
                              "MOE_LAB_TEST_MARK": str(out)})
    rc = p.wait(timeout=300)
    dt = time.monotonic() - t0
    err = p.stderr.read()
    last = err.strip().splitlines()[-1]
    print(f"TIME file size limit reached by 02's record → exit {rc}: {dt:.1f} s (whole run)\n{last}")
    assert rc == 3, err[-3000:]
    assert last == (f"moe-lab run: failed: cannot write {out / 'results.json'} (File too large) during the run, so it "
                    f"stopped there; notebook(s) 01 finished and their records are kept in {out / 'results.json'}; "
                    "make the folder writable (a read-only or full file system, a directory where the file goes) or "
                    f"give another --out, and run again: finished cases are reused (traceback: {log})"), err[-3000:]
    assert "Traceback" not in err and [ln for ln in err.splitlines() if ln.startswith("moe-lab")] == [last], err
    assert [r["x"] for r in json.loads((out / "results.json").read_text())] == [1]
    assert _rows(out)["01"]["status"] == "ok" and "02" not in _rows(out)
    assert _left(out) == []
    # space freed (the limit lifted): the same command resumes and completes
    p = _start(nbs, out, log)
    assert p.wait(timeout=300) == 0, p.stderr.read()[-3000:]
    assert sorted(r["x"] for r in json.loads((out / "results.json").read_text())) == [1, 2, 3]
    assert [_rows(out)[n]["verdict"] for n in ("01", "02", "03")] == ["1 done", "2 done", "3 done"]


SLEEPS = """
    import pathlib, time
    pathlib.Path({mark!r}).touch()
    time.sleep(120)
    print("slept")
"""


def test_a_stopped_kernel_is_said_in_words_on_the_index(tmp_path):
    """Notebook 01's kernel SIGSTOPped in its cell: with --timeout 8 the cell times out and its index row reads
    'kernel stopped: … pid N … cell 3 of 3 (`import pathlib, time`) timed out after 8 s …'; exit 1 (a failed
    notebook), nothing left running. The control is the row of a cell that merely runs long (`_timed_out`'s unit
    test)."""
    import nbformat
    import psutil

    nbs, out = tmp_path / "nbs", tmp_path / "out"
    nbs.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'",
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(textwrap.dedent(SLEEPS.format(mark=str(tmp_path / "in-cell"))).strip(),
                                          metadata={"tags": ["verdict"]})]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nbs / "01_t.ipynb")
    code = RUN.replace("'--out', sys.argv[2]]", "'--out', sys.argv[2], '--timeout', '8']")
    assert code != RUN
    p = subprocess.Popen([sys.executable, "-c", code, str(nbs), str(out), str(tmp_path / "error.log")],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True,
                         env={**os.environ, "MOE_LAB_SHARE_CLUSTER": "0", "MOE_LAB_TEST_MARK": str(out)})
    try:
        deadline, kernel = time.monotonic() + 120, None
        while kernel is None:  # the kernel, once its cell runs (the cell touches `in-cell` first)
            assert p.poll() is None and time.monotonic() < deadline, p.stderr.read()[-3000:] if p.poll() else ""
            kids = [k for k in psutil.Process(p.pid).children() if any("ipykernel" in a for a in k.cmdline())]
            if kids and (tmp_path / "in-cell").exists():
                kernel = kids[0]
            time.sleep(0.2)
        kernel.send_signal(signal.SIGSTOP)
        t0 = time.monotonic()
        rc = p.wait(timeout=120)
        print(f"TIME kernel SIGSTOPped mid-cell, --timeout 8 → exit {rc}: {time.monotonic() - t0:.1f} s")
    finally:
        if p.poll() is None:
            p.kill()
            p.wait()
    row = _rows(out)["01"]
    print(f"index row: {row['error']}")
    assert rc == 1, p.stderr.read()[-3000:]
    assert row["status"] == "failed" and row["error"] == (
        f"kernel stopped: the notebook's kernel (pid {kernel.pid}) is stopped (process state 'stopped': SIGSTOP, "
        "Ctrl-Z or a debugger), so cell 3 of 3 (`import pathlib, time`) timed out after 8 s; the kernel was ended — "
        "run the notebook again (finished cases are reused)"), row
    assert "-----" not in row["error"]
    assert _left(out) == []
