"""`moe-lab run` writes only where git does not look: its default folder is git-ignored, and an `--out` of '', one
inside reports/published/ or one holding files git tracks is refused in one line, exit 2, before anything starts
(no folder made, no profile probed further, no notebook run)."""

import subprocess
from pathlib import Path

import pytest

from moe_lab import cli
from moe_lab.reporting import runner

ROOT = Path(__file__).resolve().parents[2]


def _git(*args, cwd=ROOT):
    return subprocess.run(["git", *args], cwd=cwd, capture_output=True, text=True, timeout=60)


needs_git = pytest.mark.skipif(_git("rev-parse", "--is-inside-work-tree").returncode != 0,
                               reason="not a git checkout")


def _refused(capsys, out: str, said: str):
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "--out", out])
    err = capsys.readouterr().err.strip().splitlines()
    assert rc == 2 and len(err) == 1 and said in err[0], err
    assert "Traceback" not in err[0]


def test_an_empty_out_is_refused(capsys):
    _refused(capsys, "", "--out '' names no folder")
    _refused(capsys, "  ", "--out '  ' names no folder")


def test_an_out_inside_the_published_reports_is_refused(capsys):
    target = runner.PUBLISHED / "cpu-2099-01-01"
    _refused(capsys, str(target), "inside reports/published/")
    assert not target.exists()
    _refused(capsys, str(runner.PUBLISHED), "inside reports/published/")


def test_an_out_holding_tracked_files_is_refused(tmp_path, capsys):
    repo = tmp_path / "repo"
    (repo / "rep").mkdir(parents=True)
    (repo / "rep" / "results.json").write_text("[]")
    assert _git("init", "-q", cwd=repo).returncode == 0
    assert _git("add", "rep/results.json", cwd=repo).returncode == 0
    _refused(capsys, str(repo / "rep"), "tracked by git (e.g. results.json)")
    _refused(capsys, str(repo), "1 file(s) tracked by git")
    assert sorted(p.name for p in (repo / "rep").iterdir()) == ["results.json"]  # nothing written there


def test_control_an_untracked_folder_in_a_work_tree_is_accepted(tmp_path):
    repo = tmp_path / "repo"
    (repo / "rep").mkdir(parents=True)
    (repo / "rep" / "results.json").write_text("[]")
    assert _git("init", "-q", cwd=repo).returncode == 0
    assert runner.check_out(str(repo / "rep")) == (repo / "rep").resolve()
    assert runner.check_out(str(tmp_path / "new" / "folder")) == (tmp_path / "new" / "folder").resolve()
    assert runner.check_out(None) is None


@needs_git
def test_the_default_report_folder_is_ignored_and_the_published_one_is_not():
    day = runner.REPORTS / "cpu-2099-01-01"
    assert _git("check-ignore", "-q", str(day / "results.json")).returncode == 0
    assert _git("check-ignore", "-q", str(day / "01_reproduce_ep_divergence.html")).returncode == 0
    assert _git("check-ignore", "-q", str(runner.PUBLISHED / "x" / "results.json.xz")).returncode == 1


@needs_git
def test_the_checkout_itself_is_refused(capsys):
    _refused(capsys, str(ROOT), "tracked by git")
    _refused(capsys, str(ROOT / "reports"), "tracked by git")


def test_results_load_reads_the_published_compressed_records(tmp_path):
    import json
    import lzma

    from moe_lab import results

    from moe_lab.records import upgrade

    raw = [{"notebook": "01", "case_key": "a"}, {"notebook": "06", "case_key": "b"}]
    (tmp_path / "results.json.xz").write_bytes(lzma.compress(json.dumps(raw).encode()))
    recs = [upgrade(r) for r in raw]  # every record is read through the one upgrade
    assert results.load(tmp_path / "results.json") == recs  # results.json absent: its .xz
    assert results.load(tmp_path / "results.json.xz") == recs
    (tmp_path / "results.json").write_text(json.dumps(raw[:1]))  # control: results.json, where there, wins
    assert results.load(tmp_path / "results.json") == recs[:1]
    (tmp_path / "results.json").unlink()
    (tmp_path / "results.json.xz").write_bytes(b"not lzma")
    with pytest.raises(results.ResultsFileError, match="not lzma-compressed JSON"):
        results.load(tmp_path / "results.json")
    assert results.load(tmp_path / "nowhere" / "results.json") == []


def test_a_report_title_names_its_day_and_machine():
    """The index's title says the profile, the day its records were measured and the machine (GPU, else CPU model);
    with no records it says so rather than inventing a day."""
    from moe_lab.reporting.summary import title

    gpu = [{"time": "2026-12-02T10:00:00+00:00", "gpu": "NVIDIA H200"}, {"time": "2026-12-02T11:00:00+00:00"}]
    assert title("gpu", gpu) == "moe_lab report — gpu · 2026-12-02 · NVIDIA H200"
    cpu = [{"time": "2026-12-03T23:59:00+00:00", "cpu": {"model": "AMD EPYC"}},
           {"time": "2026-12-04T00:01:00+00:00", "cpu": {"model": "AMD EPYC"}}]
    assert title("cpu", cpu) == "moe_lab report — cpu · 2026-12-03 … 2026-12-04 · AMD EPYC"
    assert title("cpu", []) == "moe_lab report — cpu · not measured yet"
