"""The numbered notebooks end to end through the real runner, on the notebook tier's profile (notebook_tier.json:
the cpu profile's layer and cluster with the smallest grids that reach every verdict), at the layer for this CPU's
bf16 GEMM (`cpu_layer`: where it is a slow path, the cpu profile's own sizing cuts); assertions read results.json.
The cpu profile itself is the main job's (`make reports`): its length is docs/bench.md's benchmark, not a test's."""

import json
import os
import socket
import subprocess
import sys
import time
import urllib.request
from pathlib import Path

import pytest

from tests.conftest import BF16_FAST

RUN_TIMEOUT_S = 3000
"""The notebook tier's hang guard: a run of the tier's profile takes minutes where the CPU has bf16 instructions and
longer on an AVX2-only CPU (its bf16 GEMM is a slow path: `cpu_gemm.slowdown()`, which `cpu_layer` cuts the layer
for); the session fixture's setup is charged to the first test, hence the module's own pytest-timeout, above CI's
per-test --timeout."""
BUDGET_S = 360
"""The tier profile's run (all notebooks, cluster start included) on 2 cores, at the layer for the CPU's bf16 GEMM:
about twice what it takes on the quiet development machine (docs/bench.md)."""
TRAINING_BUDGET_S = 60
"""Notebook 06's cases on the tier's profile, as the run's budget."""

pytestmark = [pytest.mark.notebook, pytest.mark.timeout(RUN_TIMEOUT_S + 600)]

ROOT = Path(__file__).resolve().parents[2]
TIER = Path(__file__).with_name("notebook_tier.json")
"""The notebook tier's profile (absolute: the notebook kernels run in notebooks/)."""


def tier(overrides: dict | None = None):
    from moe_lab import profiles

    return profiles.load(str(TIER), overrides or {})


def notebook_01_cases(P) -> tuple[int, int]:
    """Notebook 01's cases under `P`: (cross-rank cases, layout cases)."""
    from moe_lab.questions.reproduce import experiment as reproduce, layouts

    return len(reproduce.cases(P)), len(layouts.cases(P))


def run_tier(layer, *args: str, timeout: float = 900) -> subprocess.CompletedProcess:
    """`moe-lab run --profile TIER` at `layer` (`cpu_layer`) with `args`."""
    return subprocess.run([sys.executable, "-m", "moe_lab.cli", "run", "--profile", str(TIER),
                           *layer.p_args(str(TIER)), *args], capture_output=True, text=True, timeout=timeout)


@pytest.fixture(scope="session")
def cpu_report(tmp_path_factory, cpu_layer):
    """`moe-lab run` of every numbered notebook on the tier's profile, on CPU engines, into a folder of its own, at
    the layer for this CPU's bf16 GEMM."""
    out = tmp_path_factory.mktemp("report")
    t0 = time.monotonic()
    r = run_tier(cpu_layer, "--out", str(out), timeout=RUN_TIMEOUT_S)
    elapsed = time.monotonic() - t0
    index = json.loads((out / "index.json").read_text()) if (out / "index.json").exists() else None
    return {"rc": r.returncode, "stderr": r.stderr, "out": out, "index": index, "elapsed": elapsed, "layer": cpu_layer,
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


def test_the_tier_profile_is_the_cpu_profile_with_smaller_grids():
    """What the tier shows holds for the cpu profile's code paths: the same layer, cluster, dispatchers, trials, cut
    and training layer, and every grid a part of the cpu profile's (the notebooks' own defaults where the cpu profile
    leaves one out). The control: a grid the cpu profile does not have is caught."""
    from moe_lab import profiles
    from moe_lab.questions.truncation import experiment as truncation

    cpu, small = profiles.load("cpu"), tier()

    def part_of(a, b):
        return set(a) <= set(b) and len(a) > 0

    assert small.layer == cpu.layer and small.cluster == cpu.cluster and small.run.trials == cpu.run.trials
    assert small.run.dispatchers == cpu.run.dispatchers and small.run.cut == cpu.run.cut
    assert part_of(small.run.router_dtypes, cpu.run.router_dtypes)
    q, c = small.question, cpu.question
    assert part_of(q("promotion").releases, c("promotion").releases)
    assert part_of(q("promotion").router_dtypes(small), c("promotion").router_dtypes(cpu))
    assert part_of(q("promotion").probs_fp32_gather, c("promotion").probs_fp32_gather)
    assert part_of(q("promotion").deterministic, c("promotion").deterministic)
    assert part_of(q("reproduce").layouts, c("reproduce").layouts + ("tp2,ep2,etp1,sp",))  # etp1 and sp at once
    assert part_of(q("reproduce").layout_router_dtypes, c("reproduce").layout_router_dtypes)
    assert part_of(q("compound").compound_settings, c("compound").compound_settings)
    assert part_of(q("compound").depth_settings, c("compound").depth_settings)
    assert q("compound").depth_layers <= c("compound").depth_layers
    assert part_of(q("seq_len").seq_lens, c("seq_len").seq_lens)
    assert part_of(q("truncation").truncation_remedies, truncation.DEFAULT_REMEDIES)
    t, tc = q("training"), c("training")
    for field in ("tokens", "hidden", "ffn_hidden", "topk", "num_experts", "dispatcher", "lr"):
        assert getattr(t, field) == getattr(tc, field), field
    assert t.steps <= tc.steps and part_of(t.eps, tc.eps) and part_of(t.settings, tc.settings)
    assert part_of(t.layouts, tc.layouts) and part_of(t.stacks, tc.stacks) and t.reruns == tc.reruns
    pr, pc = q("presets"), c("presets")
    assert part_of(pr.models, pc.models) and pr.scale == pc.scale and part_of(pr.router_dtypes, pc.router_dtypes)
    o, oc = q("oracle"), c("oracle")
    assert part_of(o.layouts, oc.layouts) and o.reference == oc.reference and set(o.faults) <= set(oc.faults)
    assert not part_of(("ep8",), c("reproduce").layouts)  # the control
    # Cut for a slow bf16 GEMM, the tier's layer is the cpu profile's at the same cuts, as a sized `make reports` runs.
    from tests.conftest import MAX_TEST_CUTS, CpuLayer

    for n in range(1, MAX_TEST_CUTS + 1):
        at = CpuLayer(ratio=BF16_FAST * 2 ** n, cuts=n)
        cut_tier, cut_cpu = tier(at.overrides(str(TIER))), profiles.load("cpu", at.overrides("cpu"))
        assert cut_tier.layer == cut_cpu.layer != cpu.layer and cut_tier.run.cut == cut_cpu.run.cut, n


def test_the_notebook_tier_keeps_its_budget(cpu_report, cpu_gemm):
    """The tier's run ends in BUDGET_S on the 2-core machine — a budget stated for CPUs whose bf16 GEMM is at most
    BF16_FAST times their fp32 GEMM, which the layer's cuts (`cpu_layer`) bring an AVX2-only CPU's slow path to
    where they can. Where the slowdown the cuts leave is more, the run's length says what the CPU does, not what the
    lab does: skipped, with both figures."""
    layer, slow = cpu_report["layer"], cpu_gemm.slowdown()
    said = (f"the tier's profile took {cpu_report['elapsed']:.0f} s (budget {BUDGET_S} s) at {layer.words(str(TIER))};"
            f" measured at the profile's expert shapes: {slow}")
    print(said)
    if layer.left_ratio > BF16_FAST:
        pytest.skip(f"budget not applicable: {said}")
    assert cpu_report["elapsed"] < BUDGET_S, said


def test_index_answers_say_what_the_notebooks_say(cpu_report):
    """Every finding behind the index's answer table is one the notebook's own verdict states (same status and
    claim), rendered from the same results.json; `moe-lab findings` gives the same headlines without engines or
    torch."""
    index = cpu_report["index"]
    verdicts = {r["notebook"]: r["verdict"] for r in index["notebooks"]}
    from moe_lab import questions

    nb_of = {name: q.number for q in questions.QUESTIONS for name in q.experiments}
    assert index["answers"]
    for row in index["answers"]:
        assert row["placement"] and row["layer"] and row["cells"]
        for f in row["findings"]:
            assert f"[{f['status']}] {f['claim']}" in verdicts[nb_of[f["experiment"]]], f
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "findings", "--json", str(cpu_report["out"])],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr
    heads = json.loads(r.stdout)["headlines"]
    assert {row["notebook"]: row["finding"] for row in index["notebooks"]} == {k: v[0] for k, v in heads.items()}


def test_timing_says_where_the_run_went_from_its_folder(cpu_report, capsys):
    """`moe-lab timing`: every notebook's papermill phases and its cases' own seconds, the shared cluster's start and
    the command's seconds, from the folder alone (the numbers are the run's; here only that they are there and add
    up: a notebook's cases cannot take longer than the cells that ran them)."""
    from moe_lab.reporting import timing

    rows, meta = timing.table(cpu_report["out"])
    assert [t.notebook for t in rows] == [r["notebook"] for r in cpu_report["index"]["notebooks"]]
    for t in rows:
        assert t.cases > 0 and None not in (t.kernel_s, t.setup_s, t.case_cells_s, t.figures_s), t
        assert t.cases_s <= t.case_cells_s + 0.5, t  # rounding of case_wall_s
    assert meta["cluster_timings"]["ready_s"] > 0 and 0 < meta["elapsed_s"] <= cpu_report["elapsed"]
    gaps, span = timing.idle_gaps(rows)  # the idle stretches and the cases fit inside the cases' span
    assert span is not None and sum(g.seconds for g in gaps) + sum(t.cases_s for t in rows) <= span + len(gaps) + 2
    from moe_lab.cli import main as cli_main  # the function moe_lab.cli.main, which the package re-exports

    assert cli_main(["timing", str(cpu_report["out"])]) == 0
    text = capsys.readouterr().out
    assert "Shared cluster: ready in" in text and "Engines idle between cases" in text


def test_the_run_shares_one_cluster_between_the_notebooks_that_need_it(cpu_report):
    """controller.shared: 01, 02, 04, 05, 06 and 07 run on the run's cluster (the installed release, 4 engines); 03
    begins on other releases, so those start a cluster of its own (the control: cases that cannot attach do not), and
    its installed-release cells go back to the run's cluster (controller.engine_sets) instead of restarting it."""
    from moe_lab import releases

    by_nb: dict = {}
    for r in cpu_report["results"]:
        if "skipped" not in r:  # a setting the release lacks: a record made without any cluster
            by_nb.setdefault(r["notebook"], set()).add(r.get("shared_cluster"))
    shared = ("01", "02", "04", "05", "06", "07")
    assert {nb: by_nb.get(nb) for nb in shared} == {nb: {True} for nb in shared}
    here = releases.installed_version()
    by_release: dict = {}
    for r in cpu_report["results"]:
        if r["notebook"] == "03" and "skipped" not in r:
            by_release.setdefault(r["megatron_core"] == here, set()).add(r.get("shared_cluster"))
    assert by_release == {False: {False}, True: {True}}


def test_01_records_the_divergence(cpu_report):
    P = tier()
    recs = [r for r in cpu_report["results"] if r["notebook"] == "01" and r.get("kind", "case") == "case"]
    assert {(r["dispatcher"], r["router_dtype"]) for r in recs} == {
        (d, t) for d in P.run.dispatchers for t in P.run.router_dtypes}
    for r in recs:
        for key in ("notebook", "dispatcher", "router_dtype", "megatron_core", "device", "world"):
            assert r[key] not in (None, ""), key
        for cmp in ("cross_rank", "rerun", "truncation"):
            assert {"mismatch_frac", "max_ulp"} <= set(r[cmp])
    by = {(r["dispatcher"], r["router_dtype"]): r for r in recs}
    assert by[("allgather", "none")]["cross_rank"]["mismatch_frac"] > 0  # the seed report, EP=4, bf16
    for t in set(P.run.router_dtypes) - {"none"}:
        assert by[("allgather", t)]["cross_rank"]["mismatch_frac"] == 0


def test_01_compares_every_layout_with_the_reference(cpu_report):
    """Every layout of the tier's profile x dispatcher x router dtype measured against EP=1, the
    case's own layout on its record; the reference against itself is the control (equal); allgather at EP=4 sums a
    token's expert outputs in another order than EP=1 (the gloo combine), so it differs from it."""
    recs = [r for r in cpu_report["results"] if r["notebook"] == "01" and r.get("kind") == "layout"]
    p = tier()
    lp = p.question("reproduce")
    assert len(recs) == len(lp.layouts) * len(p.run.dispatchers) * len(lp.layout_router_dtypes)
    by = {(r["dispatcher"], r["router_dtype"], r["layout"]): r for r in recs}
    for d in p.run.dispatchers:
        assert by[(d, "none", "tp 1 × ep 1")]["vs_reference"]["bitwise_equal"]  # the control
        tp2 = by[(d, "none", "tp 2 × ep 2")]
        assert (tp2["tp"], tp2["ep"], tp2["etp"]) == (2, 2, 2) and tp2["grad_enabled"] is False
        assert "grad_vs_nograd" in tp2 and tp2["stages_vs_reference"]["router.routing_map"]["numel"] > 0
    assert not by[("allgather", "none", "tp 1 × ep 4")]["vs_reference"]["bitwise_equal"]


def test_a_rerun_with_another_layer_parameter_reuses_nothing(cpu_report):
    """Notebook 01 again into the same report directory at seq_len 96: every case is measured anew (the resume
    key covers the layer), the old records stay in results.json, and the notebook shows only the new ones."""
    out = cpu_report["out"]
    before = [r for r in json.loads((out / "results.json").read_text()) if r["notebook"] == "01"]
    r = run_tier(cpu_report["layer"], "--only", "01", "-p", "seq_len=96", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    after = [r for r in json.loads((out / "results.json").read_text()) if r["notebook"] == "01"]
    assert len(after) == len(before) + sum(notebook_01_cases(tier()))  # every cross-rank and layout case, anew
    ran = {x["config"]["seq_len"] for x in before}
    assert len(ran) == 1 and sorted({x["config"]["seq_len"] for x in after}) == sorted({96, *ran})
    row = next(x for x in json.loads((out / "index.json").read_text())["notebooks"] if x["notebook"] == "01")
    hidden = tier().layer.hidden
    assert f"of {96 * hidden:,} output elements" in row["verdict"]  # the new records only
    assert f"of {ran.pop() * hidden:,}" not in row["verdict"]


def test_a_failing_notebook_gets_html_and_a_nonzero_exit(tmp_path, monkeypatch):
    import nbformat

    monkeypatch.setenv("MOE_LAB_SHARE_CLUSTER", "0")  # the planted notebooks use no engines: none are started

    from moe_lab.reporting import runner as report

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
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "run", "--only", "99", "--out", str(tmp_path / "y")],
                       capture_output=True, text=True, timeout=120)
    assert r.returncode == 2 and "no notebook" in r.stderr and not (tmp_path / "y").exists()


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


def test_a_rerun_with_the_same_parameters_says_it_reused_every_case(cpu_report):
    """Notebook 01 again into the same report with the tier profile's own parameters: nothing is measured, and
    the terminal, the notebook (and so its HTML) and the index all say 0 measured, every case reused. The control is
    the seq_len=96 rerun above: it measured its cases."""
    out = cpu_report["out"]
    r = run_tier(cpu_report["layer"], "--only", "01", "--out", str(out))
    assert r.returncode == 0, r.stderr[-3000:]
    cross, lays = notebook_01_cases(tier())
    assert f"01_reproduce_ep_divergence.ipynb: 0 case(s) measured, {cross + lays} reused from results.json" in r.stderr
    row = next(x for x in json.loads((out / "index.json").read_text())["notebooks"] if x["notebook"] == "01")
    assert (row["measured"], row["reused"]) == (0, cross + lays)  # the cross-rank cases + the layout cases
    for said in (f"reproduce: 0 case(s) measured now, {cross} reused from results.json",
                 f"layouts: 0 case(s) measured now, {lays} reused from results.json"):
        assert said in (out / "01_reproduce_ep_divergence.ipynb").read_text()
        assert said in (out / row["shared_html"]).read_text()
    assert f"0 measured, {cross + lays} reused" in (out / "index.html").read_text()


def test_02_finds_the_combine_not_the_gather(cpu_report):
    cases = [r for r in cpu_report["results"] if r["notebook"] == "02" and r.get("kind") == "case"]
    by = {(c["dispatcher"], c["variant"]): c for c in cases}
    plain = by[("allgather", "bf16 (nothing)")]
    assert plain["first_divergent_stage"] == "combine.comm" and plain["probs_gather_dtype"] == "bfloat16"
    assert by[("allgather", "probs fp32 before gather (reporter's fix)")]["first_divergent_stage"] is None
    assert by[("allgather", "moe_router_dtype=fp32")]["combine_dtype"] == "float32"
    stages = [r for r in cpu_report["results"] if r["notebook"] == "02" and r.get("kind") == "stage"]
    gathered = [r for r in stages if r["stage"] == "dispatch.comm.probs" and r["dispatcher"] == "allgather"]
    assert gathered and all(r["bitwise_equal"] for r in gathered)  # the all-gather copies bits
    ledger = [r for r in cpu_report["results"] if r["notebook"] == "02" and r.get("kind") == "collective"]
    assert {"op", "dtype", "role"} <= set(ledger[0])


def test_03_router_fp32_removes_the_allgather_divergence_from_0_12_on(cpu_report):
    """Every release of the profile from 0.12 on (moe_router_dtype exists): plain bf16 ranks differ, a wider router
    makes them agree; 0.11.0 has no router dtype (its cells say so) and the reporter's fp32 cast leaves them apart."""
    P = tier()
    cells = [r for r in cpu_report["results"] if r["notebook"] == "03"]
    releases = {r["megatron_core"] for r in cells}
    assert "0.11.0" in releases and len(releases) == len(P.question("promotion").releases)
    ran = [r for r in cells if "skipped" not in r]
    for v in releases - {"0.11.0"}:
        def cell(router, pf32=False, det=False, d="allgather"):
            return next(r for r in ran if (r["megatron_core"], r["dispatcher"], r["router_dtype"], r["probs_fp32_gather"],
                                           r["deterministic"]) == (v, d, router, pf32, det))
        assert cell("none")["cross_rank"]["mismatch_frac"] > 0
        wider = set(P.question("promotion").router_dtypes(P)) - {"none"}
        assert wider and all(cell(t)["cross_rank"]["bitwise_equal"] for t in wider)
        assert cell("fp32")["combine_dtype"] == "float32" and cell("fp32")["out_dtype"] == "bfloat16"
        assert cell("none", pf32=True)["cross_rank"]["bitwise_equal"]
    # 0.11 has no moe_router_dtype: those cells are n/a; the reporter's fix leaves an fp32 output that still differs.
    old = [r for r in cells if r["megatron_core"] == "0.11.0"]
    assert all("skipped" in r for r in old if r["router_dtype"] != "none")
    fix = next(r for r in old if r["dispatcher"] == "allgather" and r["router_dtype"] == "none" and r["probs_fp32_gather"]
               and not r["deterministic"])
    assert fix["out_dtype"] == "float32" and fix["combine_dtype"] == "float32"
    assert fix["cross_rank"]["mismatch_frac"] > 0
    assert all(r["t_forward_s"] > 0 for r in ran)


def test_04_truncation_reproduced_explained_and_fixed_under_emulation(cpu_report, cpu_gemm, truncation_story):
    """The real layer as this CPU's bf16 GEMM makes it at the layer's expert shapes (measured apart: batch invariant
    → it passes; oneDNN's AMX kernels → it fails and the kernel probe shows the real GEMM batch variant); the
    EMULATION fails and is fixed."""
    recs = [r for r in cpu_report["results"] if r["notebook"] == "04"]
    cases = [r for r in recs if r["kind"] == "case" and r["available"]]
    for r in recs:
        for k in ("remedy", "emulated", "dispatcher", "router_dtype", "megatron_core", "device", "world"):
            assert r[k] not in (None, ""), k
    by = {(r["dispatcher"], r["emulation"], r["remedy"]): r for r in cases}
    for d in ("allgather", "alltoall"):
        assert not by[(d, "none", "none")]["emulated"]
        assert by[(d, "splitk+atomics", "none")]["emulated"]
        assert not by[(d, "splitk+atomics", "none")]["truncation"]["bitwise_equal"]
        fix = by[(d, "splitk+atomics", "deterministic+tiled_experts")]
        assert fix["truncation"]["bitwise_equal"] and fix["rerun"]["bitwise_equal"]
    truncation_story(recs, cpu_gemm.invariant(shapes=cpu_report["layer"].shapes(str(TIER))))
    measured = [r for r in recs if "skipped" not in r]
    assert measured and all(r["cpu"]["model"] and r["cpu"]["capability"] for r in measured)  # the CPU that measured it


def test_a_relative_out_dir_keeps_results_json_beside_the_html(tmp_path, monkeypatch):
    import nbformat

    from moe_lab.reporting import runner as report

    nb_dir = tmp_path / "nbs"
    nb_dir.mkdir()
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell("profile = 'cpu'\nparams = {}\nout_dir = '.'", metadata={"tags": ["parameters"]}),
                nbformat.v4.new_code_cell("from pathlib import Path\nfrom moe_lab import results\n"
                                          "results.append(Path(out_dir) / 'results.json', [{'x': 1}], notebook='01')")]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    nbformat.write(nb, nb_dir / "01_t.ipynb")
    monkeypatch.chdir(tmp_path)
    assert report.run_all(profile="cpu", out="rel/out", nb_dir=nb_dir) == 0
    assert (tmp_path / "rel/out/results.json").exists() and (tmp_path / "rel/out/01_t.html").exists()
    assert not (nb_dir / "rel").exists()


def test_05_gradients_and_depth(cpu_report):
    P = tier()
    recs = [r for r in cpu_report["results"] if r["notebook"] == "05"]
    back = {(r["dispatcher"], r["setting"]): r for r in recs if r["kind"] == "backward"}
    assert ("allgather", "plain") in back and ("alltoall", "routing replay") in back
    plain = back[("allgather", "plain")]
    trials = P.run.trials
    assert plain["cross_dx"]["trials"] == trials and plain["cross_dx"]["n_differ"] == trials  # gradients differ
    assert back[("allgather", "router fp32")]["cross_out"]["bitwise_equal"]
    assert back[("allgather", "router fp32 + fp32 grad reduce")]["cross_dx"]["bitwise_equal"]
    assert back[("allgather", "batch_invariant_mode")]["available"] is False  # GPU only: said, not crashed
    depth = [r for r in recs if r["kind"] == "depth"]
    n = P.question("compound").depth_layers
    assert {r["stack"] for r in depth} == {"the same layer x4", f"{n} distinct layers"}
    assert max(r["layer"] for r in depth) == max(4, n)  # a record per layer of each stack


def test_06_training_layouts_reruns_and_the_budget_share(cpu_report, cpu_gemm):
    """Every layout of the tier's profile (EPs, and TP 2 x EP 2 at ETP 1 with sequence parallelism) trained K steps
    from the same global weights, each with its data-parallel sizes (DP = world / TP, expert DP = world / (EP x ETP));
    in deterministic mode the reruns are bitwise equal (CPU kernels) while the layouts part (the control that the
    comparison can fail); the notebook's cases stay within TRAINING_BUDGET_S where the CPU's bf16 GEMM is not a slow
    path (as the run's budget)."""
    from moe_lab.questions.training import experiment as training, findings as ft

    tp = tier().question("training")
    recs = [r for r in cpu_report["results"] if r["notebook"] == "06"]
    assert recs and all(r["available"] for r in recs), [r.get("reason") for r in recs if not r.get("available")]
    want = {(lay.spec(), 4 // lay.tp, 4 // (lay.ep * lay.expert_tp)) for lay in training.layouts_of(tp)}
    assert {("ep1", 4, 4), ("ep4", 4, 1), ("tp2,ep2,etp1,sp", 2, 2)} <= want  # the sizes worked out by hand
    assert {(ft.layout_of(r), r["dp"], r["expert_dp"]) for r in recs} == want
    assert all(r["shares"] == 4 and len(r["loss"]) == tp.steps for r in recs)
    assert len({r["weights_fp"][0] for r in recs if r["layers"] == 1}) == 1  # the same global initial weights
    det = [r for r in recs if r["setting"] == "plain" and r["deterministic"] and r["layers"] == 1]
    ref = next(r for r in det if ft.layout_of(r) == "ep1" and r["run"] == 0)
    for r in det:
        if r["run"] == 1:
            run0 = next(x for x in det if ft.layout_of(x) == ft.layout_of(r) and x["run"] == 0)
            assert ft.first_difference(r, run0) is None
        elif r is not ref:
            assert ft.first_difference(r, ref) is not None  # the control: the layouts part
    share = sum(r["case_wall_s"] for r in recs)
    slow = cpu_gemm.slowdown()
    print(f"notebook 06: {len(recs)} runs in {share:.0f} s of cases (bf16 GEMM {slow['worst_ratio']:.1f}x fp32)")
    if slow["worst_ratio"] <= BF16_FAST:
        assert share < TRAINING_BUDGET_S


def test_07_answers_for_each_scaled_preset(cpu_report):
    """The profile's presets scaled to 1/8, each labelled so; per preset the allgather's plain bf16 ranks part at
    EP=4 (the combine's reduce-scatter order over gloo, as notebook 01 shows for the seed layer) and the findings name
    where and what fixes it; every preset x dispatcher has its row."""
    from moe_lab.questions.presets import findings as found

    P = tier()
    pp = P.question("presets")
    recs = [r for r in cpu_report["results"] if r["notebook"] == "07"]
    models = {r["config"]["model"] for r in recs}
    assert models == {f"{m} x0.125 (scaled)" for m in pp.models} and pp.scale == 0.125
    assert len(recs) == len(pp.models) * len(P.run.dispatchers) * len(pp.router_dtypes) * len(pp.deterministic)
    assert all("skipped" not in r for r in recs)
    for m in models:
        plain = next(r for r in recs if r["config"]["model"] == m and r["dispatcher"] == "allgather"
                     and r["router_dtype"] == "none")
        assert plain["cross_rank"]["n_mismatch"] > 0 and plain["first_divergent_stage"] == "combine.comm"
    rows = found.rows(recs)
    assert {(r["model"], r["dispatcher"]) for r in rows} == {(m, d) for m in models for d in ("allgather", "alltoall")}
    assert all(r["first divergent stage"].startswith("combine.comm") for r in rows if r["dispatcher"] == "allgather")


def test_08_layouts_expected_and_the_planted_sharding_bugs_caught(cpu_report):
    """Notebook 08 on the tier's layer: one record with every dispatcher x layout of the profile's oracle section
    against the fp64 truth; every layout within the band on each dispatcher (PASS) and each planted sharding bug
    out of it, the scale below rounding said as such."""
    from moe_lab.findings.model import PASS
    from moe_lab.questions.oracle import findings as found

    P = tier()
    op = P.question("oracle")
    recs = [r for r in cpu_report["results"] if r.get("notebook") == "08" and r.get("kind") == "oracle"]
    assert len(recs) == 1 and recs[0]["dispatchers"] == list(P.run.dispatchers)
    rec = recs[0]
    assert len([r for r in rec["runs"] if not r["fault"]]) == (
        len(op.layouts) * len(P.run.dispatchers) * op.runs(P.run.trials))
    verdicts = found.judged(rec)
    for r in rec["runs"]:
        if r["fault"] != "scale_expert":  # planted below rounding: said either way, asserted in neither
            caught = not verdicts[r["label"]].in_band
            assert caught == (r["fault"] in ("swap_experts", "capacity_drop", "etp_shard")), r["label"]
    cards = [f for f in found.findings(recs) if f.question == found.QUESTION]
    assert [f.status for f in cards] == [PASS] * len(P.run.dispatchers)
    assert all("below what rounding lets the oracle see" in f.claim or "seen although planted below rounding"
               in f.claim for f in cards)
