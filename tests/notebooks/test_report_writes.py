"""A report folder that stops taking writes during `moe-lab run` — every finished record and page is kept,
the run stops there and says in one line which file it could not write, exit 3 (a failure mid-run); no traceback on
stderr (it is in --log).

Tests run as root, where chmod 555 stops nothing, so the failures are real ones root meets too:
- the folder made read-only after notebook 01: a read-only bind mount of `--out` onto itself (what a file system
  remounted read-only does: EROFS for every new write; the run's lock, opened before, stays open). Needs mount
  permission (CAP_SYS_ADMIN), skipped with the reason elsewhere;
- a file the run must write is a directory (`--out/02_t.ipynb`): IsADirectoryError, anywhere.
The control: the same notebooks into a folder that stays writable run to the end, exit 0 (and after the directory is
removed, the failed run's folder takes the rerun).

Three small notebooks, no cluster (MOE_LAB_SHARE_CLUSTER=0): 01 and 03 append a record, 02 waits for `go` (outside
the folder) and then appends its own. Each test prints `TIME <what>: <seconds>`; docs/faults.md quotes them.
"""

import json
import os
import shutil
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
                            env={**os.environ, "MOE_LAB_SHARE_CLUSTER": "0", "MOE_LAB_TEST_MARK": str(out)})


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
