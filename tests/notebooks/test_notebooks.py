"""The numbered notebooks on the cpu profile, through the real runner; assertions read results.json."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

pytestmark = pytest.mark.notebook

ROOT = Path(__file__).resolve().parents[2]


@pytest.fixture(scope="session")
def cpu_report(tmp_path_factory):
    out = tmp_path_factory.mktemp("report")
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "run", "--profile", "cpu", "--out", str(out)],
                       capture_output=True, text=True, timeout=1800)
    elapsed = time.monotonic() - t0
    index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() else None
    return {"rc": r.returncode, "stderr": r.stderr, "out": out, "index": index, "elapsed": elapsed,
            "results": json.loads((out / "results.json").read_text()) if (out / "results.json").exists() else []}


def test_all_notebooks_ran_and_rendered(cpu_report):
    assert cpu_report["rc"] == 0, cpu_report["stderr"][-4000:]
    rows = cpu_report["index"]["notebooks"]
    assert rows and all(r["status"] == "ok" for r in rows)
    for r in rows:
        assert r["verdict"], f"{r['file']}: empty verdict"
        for key in ("html", "shared_html"):
            html = (cpu_report["out"] / r[key]).read_text()
            assert "<img" in html or "image/png" in html, f"{r[key]}: no figure"
        shared = (cpu_report["out"] / r["shared_html"]).read_text()
        assert "from moe_lab import" not in shared  # code hidden in the shared variant
    assert (cpu_report["out"] / "index.html").exists()
    print(f"cpu profile: {len(rows)} notebooks in {cpu_report['elapsed']:.0f} s")
    assert cpu_report["elapsed"] < 600  # the cpu profile's budget on the 2-core machine


def test_01_records_the_divergence(cpu_report):
    recs = [r for r in cpu_report["results"] if r["notebook"] == "01"]
    assert {(r["dispatcher"], r["router_dtype"]) for r in recs} == {
        (d, t) for d in ("allgather", "alltoall") for t in ("none", "fp32", "fp64")}
    for r in recs:
        for key in ("notebook", "dispatcher", "router_dtype", "megatron_core", "device", "world"):
            assert r[key] not in (None, ""), key
        for cmp in ("cross_rank", "rerun", "truncation"):
            assert {"mismatch_frac", "max_ulp"} <= set(r[cmp])
    by = {(r["dispatcher"], r["router_dtype"]): r for r in recs}
    assert by[("allgather", "none")]["cross_rank"]["mismatch_frac"] > 0  # the seed report, EP=4, bf16
    assert by[("allgather", "fp32")]["cross_rank"]["mismatch_frac"] == 0
    assert by[("allgather", "fp64")]["cross_rank"]["mismatch_frac"] == 0


def test_a_failing_notebook_gets_html_and_a_nonzero_exit(tmp_path):
    import nbformat

    from moe_lab import report

    nb_dir = tmp_path / "nbs"
    nb_dir.mkdir()
    for num, src in (("01", "raise RuntimeError('planted failure')"), ("02", "print('second ran')")):
        nb = nbformat.v4.new_notebook()
        nb.cells = [nbformat.v4.new_markdown_cell(f"# nb {num}"),
                    nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'", metadata={"tags": ["parameters"]}),
                    nbformat.v4.new_code_cell(src, metadata={"tags": ["verdict"]})]
        nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
        nbformat.write(nb, nb_dir / f"{num}_t.ipynb")
    out = tmp_path / "out"
    rc = report.run_all(profile="cpu", out=str(out), nb_dir=nb_dir)
    assert rc == 1
    index = json.loads((out / "index.json").read_text())
    s = {r["notebook"]: r for r in index["notebooks"]}
    assert s["01"]["status"] == "failed" and "planted failure" in s["01"]["error"]
    assert "planted failure" in (out / s["01"]["html"]).read_text()  # the failing cell is visible
    assert s["02"]["status"] == "ok" and s["02"]["verdict"] == "second ran"  # the rest still ran
    assert "FAILED" in (out / "index.html").read_text()


def test_bad_profile_parameters_fail_before_anything_runs(tmp_path):
    t0 = time.monotonic()
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "run", "--profile", "cpu", "-p", "dispatchers=[\"flex\"]",
                        "--out", str(tmp_path / "x")], capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "dispatchers" in r.stderr and "allgather" in r.stderr
    assert not (tmp_path / "x").exists() and time.monotonic() - t0 < 30
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "run", "--only", "07"], capture_output=True, text=True,
                       timeout=120)
    assert r.returncode == 2 and "no notebook" in r.stderr


def test_lab_serves_the_notebooks():
    with socket.socket() as s:
        s.bind(("127.0.0.1", 0))
        port = s.getsockname()[1]
    env = dict(os.environ, JUPYTER_RUNTIME_DIR=str(ROOT / ".pytest-jupyter-runtime"))
    proc = subprocess.Popen([sys.executable, "-m", "moe_lab.cli", "lab", "--port", str(port), "--no-browser", "--",
                             "--ServerApp.token=moe-lab-test", "--ServerApp.ip=127.0.0.1"],
                            stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, env=env, start_new_session=True)
    try:
        deadline = time.monotonic() + 90
        body = None
        while time.monotonic() < deadline:
            try:
                with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/contents?token=moe-lab-test", timeout=5) as r:
                    body = json.loads(r.read())
                    break
            except OSError:
                time.sleep(1)
        assert body is not None, "jupyter lab did not answer within 90 s"
        names = {c["name"] for c in body["content"]}
        assert "01_reproduce_ep_divergence.ipynb" in names
        with urllib.request.urlopen(f"http://127.0.0.1:{port}/api/kernelspecs?token=moe-lab-test", timeout=10) as r:
            specs = json.loads(r.read())
        assert "python3" in specs["kernelspecs"]
    finally:
        os.killpg(proc.pid, 15)
        proc.wait(timeout=30)
