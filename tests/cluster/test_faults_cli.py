"""The CLI's one error contract, end to end in subprocesses of `python -m moe_lab.cli`:

- bad input → one stderr line, exit 2, before any engine or kernel starts;
- a cluster fault (a dead engine) → one line naming rank, engine, pid, what it was doing and the signal, exit 3;
  the traceback only in the log file (and on stderr with --debug);
- Ctrl-C → exit 130, one line with the true count of the processes it started and stopped, nothing left (start-up
  and SIGTERM: tests/cluster/test_signals.py);
- a second `moe-lab run` into a report directory in use → one line, exit 2, the first run's files untouched;
  report files get ordinary permissions (0644 under umask 022).

Each test prints `TIME <fault>: <seconds>`; docs/faults.md quotes them.
"""

import json
import os
import re
import signal
import subprocess
import sys
import textwrap
import time
from pathlib import Path

import psutil
import pytest

from marked import still_running
from moe_lab.records import SCHEMA

CLI = [sys.executable, "-m", "moe_lab.cli"]
SMALL = ["--device", "cpu", "--engines", "2", "--hidden", "32", "--experts", "4", "--topk", "2", "--ffn", "64",
         "--seq", "16", "--cut", "8", "--trials", "1"]


def _umask022():
    os.umask(0o022)


def _cli(*args, timeout=120, **kw):
    return subprocess.run([*CLI, *args], capture_output=True, text=True, timeout=timeout, preexec_fn=_umask022,
                          **kw)


def _lines(text: str) -> list[str]:
    return [ln for ln in text.strip().splitlines() if ln.strip()]


# ---------------------------------------------------------------------------------------------- bad input → exit 2
def test_zero_engines_is_one_line_and_exit_2():
    """`probe --engines 0`: exactly one stderr line, exit 2, nothing on stdout, well before any engine could start."""
    t0 = time.monotonic()
    r = _cli("probe", "--engines", "0", timeout=60)
    dt = time.monotonic() - t0
    print(f"TIME probe --engines 0 → message: {dt:.1f} s")
    assert r.returncode == 2, r.stderr
    assert _lines(r.stderr) == ["moe-lab probe: error: argument --engines: 0 must be >= 1 (see moe-lab probe -h)"]
    assert r.stdout == ""
    assert dt < 30


def test_an_unwritable_out_is_one_line_and_exit_2():
    """`run --out /proc/forbidden`: one stderr line that names --out, exit 2, before any kernel starts."""
    t0 = time.monotonic()
    r = _cli("run", "--profile", "cpu", "--out", "/proc/forbidden", timeout=60)
    dt = time.monotonic() - t0
    print(f"TIME run --out /proc/forbidden → message: {dt:.1f} s")
    assert r.returncode == 2, r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1, r.stderr
    assert lines[0].startswith("moe-lab run: error: --out (/proc/forbidden) is not a writable directory"), lines
    assert dt < 30


def test_a_corrupt_results_file_is_refused_in_one_line_and_left_as_it_was(tmp_path):
    """`run --out DIR` with a corrupt DIR/results.json: one line naming the file, exit 2, fast (no kernel started:
    nothing but the file is in DIR afterwards), and the file byte for byte as it was."""
    out = tmp_path / "report"
    out.mkdir()
    bad = out / "results.json"
    bad.write_bytes(b'[{"notebook": "01", "max_ulp": 3},\n{"truncated')
    before = bad.read_bytes(), bad.stat().st_mtime_ns
    t0 = time.monotonic()
    r = _cli("run", "--profile", "cpu", "--out", str(out), timeout=60)
    dt = time.monotonic() - t0
    print(f"TIME run with a corrupt results.json → message: {dt:.1f} s")
    assert r.returncode == 2, r.stderr
    lines = _lines(r.stderr)
    assert len(lines) == 1 and lines[0].startswith(f"moe-lab run: error: {bad} is not valid JSON"), r.stderr
    assert "it was not overwritten" in lines[0]
    assert (bad.read_bytes(), bad.stat().st_mtime_ns) == before
    assert sorted(p.name for p in out.iterdir()) == ["results.json"]  # no lock, no index, no executed notebook
    assert dt < 30


# ---------------------------------------------------------------------------------------------- cluster fault → exit 3
# The probe of two cases (router dtype none, then fp32), its engine side replaced on the controller by a function
# that runs the real probe for the first case and SIGKILLs rank 1 before the others' all-reduce in the second: the
# CLI's real path (cmd_probe → protocol → Cluster.run) meets a dead engine after one finished record.
DEAD_ENGINE_PROBE = textwrap.dedent("""
    import sys

    import ipyparallel

    from moe_lab import cli
    from moe_lab.experiments import probe


    @ipyparallel.interactive
    def rank1_is_killed_in_the_fp32_case(payload):
        from moe_lab.engine import faults
        from moe_lab.experiments import probe

        if payload["moe"]["router_dtype"] == "fp32":
            return faults.kill_on(1)
        return probe.on_engine(payload)


    @ipyparallel.interactive
    def rank1_hangs_in_the_fp32_case(payload):
        from moe_lab.engine import faults
        from moe_lab.experiments import probe

        if payload["moe"]["router_dtype"] == "fp32":
            return faults.sleep_on(1, 120)
        return probe.on_engine(payload)


    fault = sys.argv.pop(1)
    probe.on_engine = {"kill": rank1_is_killed_in_the_fp32_case, "hang": rank1_hangs_in_the_fp32_case}[fault]
    sys.exit(cli.main(sys.argv[1:]))
""")

FAULT_LINE = re.compile(r"^moe-lab probe: cluster fault: rank 1 \(engine (\d+), pid (\d+)\) died during probe "
                        r"allgather/fp32 \(killed by SIGKILL\); the other engines were stopped")


def _dead_engine_probe(tmp_path, *flags, fault="kill", timeout_s=60):
    """Run it → (CompletedProcess, log file, seconds from the first case's record on stdout to the exit)."""
    log, script, err = tmp_path / "error.log", tmp_path / "dead_engine_probe.py", tmp_path / "stderr.txt"
    script.write_text(DEAD_ENGINE_PROBE)
    cmd = [sys.executable, str(script), fault, "--log", str(log), *flags, "probe", *SMALL, "--router-dtype",
           "none,fp32", "--json", "--timeout", str(timeout_s)]
    with open(err, "w") as stderr:
        p = subprocess.Popen(cmd, stdout=subprocess.PIPE, stderr=stderr, text=True,
                             env={**os.environ, MARK: str(tmp_path)})
        try:
            out = [p.stdout.readline()]  # the first case's record: the second case (the fault) starts now
            t0 = time.monotonic()
            out.append(p.stdout.read())
            rc = p.wait(timeout=300)
            dt = time.monotonic() - t0
        finally:
            if p.poll() is None:
                p.kill()
                p.wait()
    return subprocess.CompletedProcess(cmd, rc, "".join(out), err.read_text()), log, dt


@pytest.mark.cluster
def test_a_dead_engine_under_probe_is_one_line_exit_3_and_the_traceback_is_in_the_log(tmp_path):
    """Rank 1's engine is SIGKILLed in the probe's second case: exit 3, one stderr line 'moe-lab probe: cluster fault:
    rank 1 (engine E, pid P) died during probe allgather/fp32 (killed by SIGKILL)', no traceback on stderr; the log
    file has the traceback; the first case's record is kept (its JSON line on stdout); no process of it is left."""
    r, log, dt = _dead_engine_probe(tmp_path)
    print(f"TIME probe, engine of rank 1 SIGKILLed → exit 3: {dt:.1f} s after the first record\n{r.stderr}")
    assert r.returncode == 3, r.stderr[-3000:]
    faults_lines = [ln for ln in _lines(r.stderr) if ln.startswith("moe-lab probe:")]
    assert len(faults_lines) == 1, r.stderr
    assert FAULT_LINE.match(faults_lines[0]), faults_lines[0]
    assert faults_lines[0].endswith(f"(traceback: {log})")
    assert "Traceback" not in r.stderr
    logged = log.read_text()
    assert "moe-lab probe" in logged and "Traceback (most recent call last)" in logged
    assert "ClusterError: rank 1 (engine" in logged
    records = [json.loads(ln) for ln in r.stdout.splitlines() if ln.strip()]
    assert [(x["dispatcher"], x["router_dtype"]) for x in records] == [("allgather", "none")]
    assert _left_of(tmp_path) == []


MARK = "MOE_LAB_TEST_MARK"
"""In the probe's environment, which every process it starts inherits (controller, preload server, engines): how
this test tells its own processes from those of tests running beside it."""


def _left_of(tmp_path) -> list[int]:
    """The processes the probe marked with tmp_path that still run."""
    return still_running(MARK, str(tmp_path))


@pytest.mark.cluster
def test_with_debug_the_dead_engine_traceback_is_shown_and_the_exit_code_is_still_3(tmp_path):
    """--debug adds the full traceback on stderr; the one line and exit 3 stay (scripts can rely on the code)."""
    r, log, dt = _dead_engine_probe(tmp_path, "--debug")
    print(f"TIME probe --debug, engine of rank 1 SIGKILLed → exit 3: {dt:.1f} s after the first record")
    assert r.returncode == 3, r.stderr[-3000:]
    assert "Traceback (most recent call last)" in r.stderr
    assert "moe_lab.controller.diagnosis.ClusterError: rank 1 (engine" in r.stderr
    assert FAULT_LINE.match(_lines(r.stderr)[-1]), r.stderr[-2000:]
    assert "Traceback (most recent call last)" in log.read_text()


@pytest.mark.cluster
def test_a_hung_collective_under_probe_is_one_line_naming_the_busy_rank_and_exit_3(tmp_path):
    """Rank 1 sleeps in the probe's second case while rank 0 waits in the all-reduce (--timeout 8, the process-group
    timeout too): exit 3 within the timeout + 10 s, one stderr line naming rank 1 (engine, pid) as the cause and where
    it is, never rank 0; no traceback on stderr; the first case's record is kept."""
    r, log, dt = _dead_engine_probe(tmp_path, fault="hang", timeout_s=8)
    print(f"TIME probe, rank 1 hangs before the all-reduce (timeout 8 s) → exit 3: {dt:.1f} s after the first "
          f"record\n{r.stderr}")
    assert r.returncode == 3, r.stderr[-3000:]
    lines = [ln for ln in _lines(r.stderr) if ln.startswith("moe-lab probe:")]
    assert len(lines) == 1, r.stderr
    assert re.match(r"^moe-lab probe: cluster fault: probe allgather/fp32: collective all_reduce in _all_reduce at "
                    r"faults.py:\d+ failed on rank\(s\) \[0\] after [\d.]+ s \(RuntimeError: .*Timed out waiting", lines[0])
    assert re.search(r"the cause: rank\(s\) \[1\] did not join it \(rank 1 is still busy in sleep_on at faults.py:\d+ "
                     r"\(engine \d+, pid \d+\)\)", lines[0]), lines[0]
    assert "Traceback" not in r.stderr and "Traceback (most recent call last)" in log.read_text()
    assert [json.loads(ln)["router_dtype"] for ln in r.stdout.splitlines() if ln.strip()] == ["none"]
    assert dt < 8 + 10  # seconds, not minutes: 11-14 s on the 2-core AVX2 machine (the hang timeout is 8 s)


# ---------------------------------------------------------------------------------------------- Ctrl-C → exit 130
@pytest.mark.cluster
def test_ctrl_c_during_probe_is_exit_130_with_the_true_count_and_nothing_left():
    """Ctrl-C (SIGINT to the CLI's process group, as a terminal sends it) while the probe computes: exit 130, the
    last stderr line 'interrupted (Ctrl-C); stopped N process(es) in S s, none left running' with N the number of
    processes under the CLI when the signal came (controller, schedulers, engines, nannies, the watchdog), no
    traceback, and none of them left."""
    p = subprocess.Popen([*CLI, "probe", "--device", "cpu", "--engines", "2", "--trials", "200", "--timeout", "300"],
                         stdout=subprocess.DEVNULL, stderr=subprocess.PIPE, text=True, start_new_session=True)
    err = []
    try:
        for line in p.stderr:  # progress lines until the cluster is up
            err.append(line)
            if line.startswith("# cluster ready"):
                break
        assert p.poll() is None, "".join(err)
        time.sleep(1.0)  # into the probe's first call
        everything = psutil.Process(p.pid).children(recursive=True)
        t0 = time.monotonic()
        os.killpg(p.pid, signal.SIGINT)
        rc = p.wait(timeout=60)
        dt = time.monotonic() - t0
        err.append(p.stderr.read())
    finally:
        if p.poll() is None:
            os.killpg(p.pid, signal.SIGKILL)
            p.wait()
    stderr = "".join(err)
    print(f"TIME Ctrl-C during probe → exit 130: {dt:.1f} s ({len(everything)} processes)\n{stderr}")
    assert rc == 130, stderr[-3000:]
    assert len(everything) >= 6, [q.cmdline() for q in everything]  # controller, 2 engines, 2 nannies, watchdog
    last = _lines(stderr)[-1]
    assert re.fullmatch(rf"moe-lab probe: interrupted \(Ctrl-C\); stopped {len(everything)} process\(es\) in "
                        r"[\d.]+ s, none left running", last), stderr[-3000:]
    assert "Traceback" not in stderr
    assert [q.pid for q in everything if q.is_running() and q.status() != psutil.STATUS_ZOMBIE] == []


# ---------------------------------------------------------------------------------------------- one run per report dir
RUN = ("import sys; from pathlib import Path; from moe_lab import cli; from moe_lab.reporting import runner; "
       "runner.run_all.__kwdefaults__['nb_dir'] = Path(sys.argv[1]); "
       "sys.exit(cli.main(['run', '--profile', 'cpu', '--out', sys.argv[2]]))")


def _notebook_dir(nb_dir: Path) -> Path:
    """One notebook that writes a record (of no real notebook) into results.json, then waits for `go` in the report dir (at most 120 s)."""
    import nbformat

    nb_dir.mkdir(parents=True)
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_markdown_cell("# waits for go"),
                nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'",
                                          metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell(textwrap.dedent("""
                    import os, time
                    from moe_lab import results
                    results.append(os.path.join(out_dir, "results.json"), [{"x": 1}], notebook="t")
                    t0 = time.monotonic()
                    while not os.path.exists(os.path.join(out_dir, "go")) and time.monotonic() - t0 < 120:
                        time.sleep(0.1)
                    print("first run done")
                """).strip(), metadata={"tags": ["verdict"]})]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nb_dir / "01_wait.ipynb")
    return nb_dir


def test_a_second_run_into_the_same_dir_refuses_in_one_line_and_report_files_are_0644(tmp_path):
    """Two `moe-lab run` into one directory at once: the second exits 2 with one line 'another moe-lab run (pid N:
    COMMAND) is writing into DIR' (N the first run's pid, COMMAND its command line) and changes nothing; the first
    finishes normally, and every report file it wrote (results.json, index, HTML, executed notebook) is 0644 under
    umask 022."""
    nbs, out = _notebook_dir(tmp_path / "nbs"), tmp_path / "report"
    first = subprocess.Popen([sys.executable, "-c", RUN, str(nbs), str(out)], stdout=subprocess.DEVNULL,
                             stderr=subprocess.PIPE, text=True, preexec_fn=_umask022, start_new_session=True)
    try:
        deadline = time.monotonic() + 120
        while not (out / "results.json").exists():  # the first run's notebook is running
            assert first.poll() is None, first.stderr.read()[-3000:]
            assert time.monotonic() < deadline, "the first run's notebook did not start"
            time.sleep(0.2)
        snapshot = {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()}
        t0 = time.monotonic()
        second = _cli("run", "--profile", "cpu", "--out", str(out), timeout=60)
        dt = time.monotonic() - t0
        print(f"TIME second run into a busy report dir → message: {dt:.1f} s")
        assert second.returncode == 2, second.stderr
        lines = _lines(second.stderr)
        assert len(lines) == 1 and lines[0].startswith(
            f"moe-lab run: error: another moe-lab run (pid {first.pid}: {sys.executable} -c ") and lines[0].endswith(
            f") is writing into {out}: wait for it to finish (its lock ends with it), or give this run another --out"), \
            lines
        assert {p.name: (p.read_bytes(), p.stat().st_mtime_ns) for p in out.iterdir() if p.is_file()} == snapshot
        (out / "go").touch()
        rc = first.wait(timeout=120)
        assert rc == 0, first.stderr.read()[-3000:]
    finally:
        if first.poll() is None:
            os.killpg(first.pid, signal.SIGKILL)
            first.wait()
    rows = json.loads((out / "index.json").read_text())["notebooks"]
    assert [(r["notebook"], r["status"], r["verdict"]) for r in rows] == [("01", "ok", "first run done")]
    # written typed
    assert json.loads((out / "results.json").read_text()) == [{"notebook": "t", "x": 1, "schema": SCHEMA}]
    modes = {p.name: oct(p.stat().st_mode & 0o777) for p in out.iterdir() if p.is_file() and p.name != "go"}
    assert {"results.json", "index.html", "index.json", "01_wait.ipynb", "01_wait.html"} <= set(modes)
    assert set(modes.values()) == {"0o644"}, modes
