"""reports/published/FINDINGS.md is the published reports' findings: it is regenerated from their records and must
match; the control shows the same check failing when one record changes. Every published report renders through
`moe-lab findings` (no torch), the committed two-day comparison is what `moe-lab compare` says of the two folders'
records, and what reports/ tracks stays within its budget."""

import json
import lzma
import shutil
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lab import questions
from moe_lab.reporting import published as readme

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / readme.PUBLISHED
BUDGET = 12 * 1024 * 1024
"""Bytes git may track under reports/ in all: the published GPU evidence, nothing else."""


def test_the_published_folders_are_found():
    names = readme.folders(ROOT)
    assert "gpu-h200x1-2026-12-01" in names and "gpu-h200x1-2026-12-02/layouts-deterministic" in names, names


@pytest.fixture(scope="module")
def published_text() -> str:
    """FINDINGS.md as the published records give it now (rendered once: every published report's findings)."""
    return readme.text(ROOT)


def test_findings_md_matches_the_published_reports(published_text):
    assert (ROOT / readme.FILE).read_text() == published_text, \
        "reports/published/FINDINGS.md drifted: run `moe-lab findings --published`"


def test_control_a_changed_record_changes_the_findings(tmp_path, published_text):
    dst = tmp_path / readme.PUBLISHED
    shutil.copytree(PUBLISHED, dst, ignore=shutil.ignore_patterns("*.html", "*.css"))
    first = dst / "gpu-h200x1-2026-12-01" / "results.json.xz"
    recs = json.loads(lzma.decompress(first.read_bytes()))
    r = next(x for x in recs if x.get("notebook") == "01" and x.get("router_dtype") == "none"
             and x["cross_rank"]["bitwise_equal"] is False)
    r["cross_rank"].update(bitwise_equal=True, n_mismatch=0, n_differ=0, mismatch_frac=0.0)
    assert readme.text(tmp_path) == published_text  # the copy alone says the same
    first.write_bytes(lzma.compress(json.dumps(recs).encode()))
    assert readme.text(tmp_path) != published_text


@pytest.mark.parametrize("name", readme.folders(ROOT))
def test_every_published_report_renders_through_findings_without_torch(name):
    code = ("import sys; from moe_lab.cli.main import main; rc = main(['findings', '--json', sys.argv[1]]); "
            "assert 'torch' not in sys.modules, 'torch imported'; sys.exit(rc)")
    p = subprocess.run([sys.executable, "-c", code, str(PUBLISHED / name)], cwd=ROOT, capture_output=True, text=True,
                       timeout=300)
    assert p.returncode == 0, p.stderr
    out = json.loads(p.stdout)
    assert out["records"] > 0 and any(out["findings"].values())
    assert set(out["findings"]) == {q.number for q in questions.QUESTIONS}


def test_findings_of_no_report_is_one_line():
    bad = subprocess.run([sys.executable, "-m", "moe_lab.cli", "findings", str(ROOT / "nowhere")], cwd=ROOT,
                         capture_output=True, text=True, timeout=120)
    assert bad.returncode == 2 and len(bad.stderr.strip().splitlines()) == 1 and "no results.json" in bad.stderr


def test_the_committed_two_day_comparison_is_the_records():
    """reports/published/gpu-h200x1-2026-12-03/compare-with-2026-12-02.txt and the README's sentence on it are what
    `moe-lab compare` says of the two published folders' records today (the 06 line: on the H200s deterministic runs
    equal across the two cards, the runs without deterministic mode not)."""
    from moe_lab.cli.main import load_report
    from moe_lab.reporting import compare

    a, b = (load_report(str(PUBLISHED / f"gpu-h200x1-{day}"))[1] for day in ("2026-12-02", "2026-12-03"))
    text = compare.summary(a, b)
    assert (PUBLISHED / "gpu-h200x1-2026-12-03/compare-with-2026-12-02.txt").read_text().strip() == text.strip()
    line = next(x for x in text.splitlines() if x.startswith("06: "))
    det, nondet = (x.split(" ")[-3:] for x in line.rstrip(".").split("; "))
    sentence = f"deterministic runs {det[0]} of {det[2]} equal, the rest {nondet[0]} of {nondet[2]}"
    assert sentence in " ".join((ROOT / "README.md").read_text().split()), sentence


def _tracked_sizes() -> dict[str, int]:
    p = subprocess.run(["git", "ls-files", "-z", "reports"], cwd=ROOT, capture_output=True, timeout=60)
    if p.returncode:  # no git checkout (an sdist): what is there
        return {str(f.relative_to(ROOT)): f.stat().st_size for f in (ROOT / "reports").rglob("*") if f.is_file()}
    return {n: (ROOT / n).stat().st_size for n in p.stdout.decode().split("\0") if n and (ROOT / n).is_file()}


def _within_budget(sizes: dict[str, int]) -> bool:
    return sum(sizes.values()) <= BUDGET and all(n.startswith("reports/published/") for n in sizes)


def test_what_reports_tracks_is_within_its_budget():
    sizes = _tracked_sizes()
    assert sizes and _within_budget(sizes), f"{sum(sizes.values()):,} bytes tracked under reports/ (budget {BUDGET:,})"


def test_control_the_budget_fails_over_it():
    sizes = _tracked_sizes()
    assert not _within_budget({**sizes, "reports/published/big.html": BUDGET - sum(sizes.values()) + 1})
    assert not _within_budget({**sizes, "reports/cpu-2099-01-01/results.json": 1})


README_LINES = 150


def _guide_ok(text: str) -> bool:
    """The README is a guide: at most README_LINES lines, the question table between its markers."""
    i, j = text.find("<!-- questions:begin -->"), text.find("<!-- questions:end -->")
    return len(text.splitlines()) <= README_LINES and 0 <= i < j


def test_the_readme_is_a_short_guide_with_its_question_table():
    text = (ROOT / "README.md").read_text()
    assert _guide_ok(text), f"README.md: {len(text.splitlines())} lines (at most {README_LINES}) or no question table"
    table = text[text.find("<!-- questions:begin -->"):text.find("<!-- questions:end -->")]
    for nb in sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")):
        assert f"| {nb.name[:2]} | `{nb.stem}` |" in table, nb.name
    assert "make reports" in text and "make test" in text


def test_control_a_longer_readme_or_one_without_the_table_fails():
    text = (ROOT / "README.md").read_text()
    assert not _guide_ok(text + "\n" * (README_LINES + 1))
    assert not _guide_ok(text.replace("<!-- questions:begin -->", ""))


def test_the_docs_link_no_report_folder_that_is_gone():
    import re

    for doc in [ROOT / "README.md", *(ROOT / "docs").glob("*.md"), ROOT / "tests" / "README.md",
                PUBLISHED / "README.md"]:
        for m in re.finditer(r"\]\(([^)#]+)\)", doc.read_text()):
            target = m.group(1)
            if "://" not in target:
                assert (doc.parent / target).exists(), f"{doc.name} links {target}, which is not in the tree"


def test_the_readmes_question_table_is_the_registrys():
    """The README's table is `questions.table()`, one row per registered question (09 too); the control: a question
    worded otherwise would make it differ, and rewriting puts the registry's back."""
    text = (ROOT / "README.md").read_text()
    assert readme.readme_table(text) == questions.table()
    assert all(f"| {q.number} | `{q.notebook}` |" in text for q in questions.QUESTIONS)
    assert readme.readme_table(text.replace(questions.QUESTIONS[0].text, "Another question?")) != questions.table()


def test_the_readme_table_is_rewritten_from_the_registry(tmp_path):
    stale = tmp_path / "README.md"
    stale.write_text("# x\n\n<!-- questions:begin -->\n| old |\n<!-- questions:end -->\n")
    assert readme.update_readme_table(stale) is True
    assert readme.readme_table(stale.read_text()) == questions.table()
    assert readme.update_readme_table(stale) is False


def test_published_pages_say_what_the_findings_say():
    """Each published notebook page's verdict (and recommendations) is what the findings say of its folder's records
    today (`moe-lab findings --published` re-words them); the figures and tables stay the run's."""
    pages = readme.pages(ROOT)
    assert len(pages) >= 15
    assert {str(p.relative_to(ROOT)): readme.stale(p) for p in pages if readme.stale(p)} == {}


def test_a_page_that_says_more_than_the_findings_is_caught(tmp_path):
    """The control: a published page whose verdict keeps an old sentence is stale until re-worded."""
    import shutil

    src = ROOT / "reports" / "published" / "gpu-h200x1-2026-12-01"
    dst = tmp_path / "r"
    shutil.copytree(src, dst)
    page = dst / "02_isolate_probs_allgather.html"
    text = page.read_text()
    shown = readme.page_blocks(text)["verdict"]
    first = shown.splitlines()[1]
    page.write_text(text.replace(first.replace("'", "&#x27;") if first not in text else first,
                                 first.replace("[MIXED]", "[FAIL]").replace("[PASS]", "[FAIL]") + " as the ranks "
                                 "always differ", 1))
    assert readme.stale(page) == ["verdict"]
    assert readme.refresh_page(page) and readme.stale(page) == []
