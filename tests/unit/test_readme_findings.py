"""The README's findings are the committed reports' findings (#26): the block is regenerated from their records and
must match; the control shows the same check failing when one record changes. `moe-lab findings` needs no torch."""

import json
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lab.findings import readme

ROOT = Path(__file__).resolve().parents[2]


def test_readme_block_matches_the_committed_reports():
    text = (ROOT / "README.md").read_text()
    assert readme.current(text) == readme.block(ROOT), "README findings drifted: run `moe-lab findings --readme`"


def test_control_a_changed_record_changes_the_block(tmp_path):
    name = readme.REPORTS[0]
    dst = tmp_path / "reports" / name
    shutil.copytree(ROOT / "reports" / name, dst, ignore=shutil.ignore_patterns("*.html", "*.ipynb"))
    for other in readme.REPORTS[1:]:
        shutil.copytree(ROOT / "reports" / other, tmp_path / "reports" / other,  # a folder inside another: once
                        ignore=shutil.ignore_patterns("*.html", "*.ipynb"), dirs_exist_ok=True)
    recs = json.loads((dst / "results.json").read_text())
    r = next(x for x in recs if x.get("notebook") == "01" and x.get("router_dtype") == "none"
             and x["cross_rank"]["bitwise_equal"] is False)
    r["cross_rank"].update(bitwise_equal=True, n_mismatch=0, n_differ=0, mismatch_frac=0.0)
    (dst / "results.json").write_text(json.dumps(recs))
    assert readme.block(tmp_path) != readme.block(ROOT)


def test_findings_cli_reads_a_report_without_torch():
    code = ("import sys; from moe_lab.cli.main import main; rc = main(['findings', '--json', 'reports/%s']); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)" % readme.REPORTS[0])
    p = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["records"] > 0 and set(out["findings"]) == {"01", "02", "03", "04", "05", "06", "07"}
    bad = subprocess.run([sys.executable, "-m", "moe_lab.cli", "findings", str(ROOT / "nowhere")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no results.json" in bad.stderr


@pytest.mark.parametrize("machine", ["gpu-h200x1", "cpu"])
def test_the_committed_two_day_comparison_is_the_records(machine):
    """reports/<machine>-2026-12-03/compare-with-2026-12-02.txt and the README's sentence on it are what
    `moe-lab compare` says of the two committed folders' records today (the 06 line: on the H200s deterministic runs
    equal across the two cards, the runs without deterministic mode not; on the CPU every run equal)."""
    from moe_lab.cli.main import load_report
    from moe_lab.reporting import compare

    a, b = (load_report(str(ROOT / "reports" / f"{machine}-{day}"))[1] for day in ("2026-12-02", "2026-12-03"))
    text = compare.summary(a, b)
    assert (ROOT / f"reports/{machine}-2026-12-03/compare-with-2026-12-02.txt").read_text().strip() == text.strip()
    line = next(x for x in text.splitlines() if x.startswith("06: "))
    det, nondet = (x.split(" ")[-3:] for x in line.rstrip(".").split("; "))
    sentence = f"deterministic runs {det[0]} of {det[2]} equal, the rest {nondet[0]} of {nondet[2]}"
    assert sentence in " ".join((ROOT / "README.md").read_text().split()), sentence
