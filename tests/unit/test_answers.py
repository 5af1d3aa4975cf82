"""The answer table (the index's first screen): one row per subject, each cell the few words of the findings that fill
it, worded by their status; the banner's counts add up; every cell's evidence is one click away. Held on the
published reports' records and on generated record sets that contradict the usual story (the findings' property
strategy), with controls that show each check failing."""

import html
import json
import math
import re
from pathlib import Path

import pytest
from hypothesis import given
from records_factory import cell, cmp, rec01
from test_findings_properties import SETTINGS, records

from moe_lab import questions, results
from moe_lab.findings import answers, render
from moe_lab.findings.model import FAIL, PASS, Cost, Evidence, Finding
from moe_lab.reporting import runner, summary

ROOT = Path(__file__).resolve().parents[2]
PUBLISHED = ROOT / "reports" / "published"
YES = ("yes:", "fails", "differ", "no fix found", "loss not finite")
NO = ("no:", "no stage differs", "no captured stage differs", "nothing to fix", "equal", "no layout effect")


def contradicts(status: str, short: str) -> bool:
    """A cell's words that say the opposite of its finding's status: 'no: …' on a FAIL, 'yes: …' on a PASS."""
    words = re.sub(r"^\d+ layer\(s\), [\w ,]+?: ", "", short)  # 06's stack and mode prefix
    if status == PASS:
        return words.startswith(YES)
    if status == FAIL:
        return words.startswith(NO) or words.startswith("fix found") and "no fix" not in words
    return False


def test_contradiction_check_fails_on_its_controls():
    assert contradicts(FAIL, "no: ranks bitwise equal, in all 3 trials")
    assert contradicts(PASS, "yes: EP order, in 3/3 trials")
    assert contradicts(PASS, "1 layer(s), plain, deterministic: loss not finite from step 3")
    assert not contradicts(FAIL, "yes: EP order, in 3/3 trials")
    assert not contradicts(PASS, "fix found: router fp32")


def _published(name: str) -> list[dict]:
    folder = PUBLISHED / name
    return results.latest(results.load(folder / "results.json"), folder)


def _ident(f: Finding) -> tuple:
    return f.experiment, f.question, f.status, f.claim, str(sorted(f.subject.items()))


def _check_rows(recs: list[dict]) -> list:
    by_nb = questions.findings(recs)
    rows = summary.answers(recs)
    cards = [f for fs in by_nb.values() for f in fs if f.card]
    placed = [f for r in rows for f in r.findings if f.card]
    assert sorted(map(_ident, placed)) == sorted(map(_ident, cards))  # every card finding in exactly one row
    for r in rows:
        for f in r.findings:  # a row never mixes subjects
            assert f.card_key() == (r.release, r.dispatcher, r.placement, r.layer)
        for col, cells in r.cells.items():
            assert col in answers.COLUMNS
            for c in cells:
                assert c.text and len(c.text.split()) <= 24, c.text
                if col != "cost":
                    assert c.finding in r.findings and c.status == c.finding.status
                    assert not contradicts(c.status, c.text), (c.status, c.text)
        fixes = [c.finding for c in r.cells.get("fix", [])]
        costs = r.cells.get("cost", [])
        assert len(costs) == len(fixes)  # one cost per fix, in order
        for f, c in zip(fixes, costs):
            cost = f.evidence.cost
            if "inside the noise floor" in c.text:
                assert f.remedy and cost is not None and cost.inside_floor
            if not f.remedy:
                assert c.text == "no fix to cost"
        st = {c.status for c in r.cells.get("diverges", [])}
        assert (r.diverges == "no") == (st == {PASS})
        assert (r.diverges == "yes") == (FAIL in st)
    b = answers.banner(rows)
    assert b["diverge"] + b["mixed"] + b["agree"] + b["divergence not measured"] == b["subjects"] == len(rows)
    assert b["fix found"] + b["no fix found"] <= len(rows)
    return rows


@pytest.mark.parametrize("name", ["gpu-h200x1-2026-12-01", "gpu-h200x1-2026-12-02", "gpu-h200x1-2026-12-03",
                                  "gpu-h200x2-2026-11-29"])
def test_published_reports_answer_every_card_finding_in_its_column(name):
    rows = _check_rows(_published(name))
    assert rows and all(r.cells for r in rows)


def test_every_question_names_columns_its_findings_fill():
    """Each `Question.answers` key is a question id its findings produce on the published records (a renamed finding
    would otherwise drop silently out of the table)."""
    seen = {(q.number, f.question) for name in ("gpu-h200x1-2026-12-01", "gpu-h200x1-2026-12-02")
            for q in questions.QUESTIONS for f in q.findings_of(questions.of_question(_published(name), q))}
    for q in questions.QUESTIONS:
        for key in list(q.answers) + list(q.fallback_answers):
            if q.number in {n for n, _ in seen}:
                assert (q.number, key) in seen or key in ("loss finite",), (q.number, key)


@SETTINGS
@given(records())
def test_answer_table_says_no_more_than_its_findings(recs):
    rows = _check_rows(recs)
    page = render.answer_table(rows, shared=summary.shared(rows)) + render.evidence(rows)
    for i in range(len(rows)):
        assert f"id='ev-{i}'" in page and f"href='#ev-{i}'" in page
    assert "<script" not in page.replace("<script>function openHash", "")


def _finding(status, short, question="ranks agree", card=True, **subj) -> Finding:
    s = {"release": "0.16.1", "dispatcher": "allgather", "placement": "p", "layer": "l", **subj}
    return Finding("reproduce", question, s, status, short, Evidence(), short=short, card=card)


def test_rows_split_by_subject_and_fallback_fills_only_empty_columns():
    a = _finding(FAIL, "yes: EP order, in 3/3 trials")
    b = _finding(PASS, "no: ranks bitwise equal, in all 3 trials", release="0.12.3")
    plain = Finding("promotion", "plain ranks agree", dict(a.subject), PASS, "x", short="no: plain bf16 ranks equal")
    plain_b = Finding("promotion", "plain ranks agree", dict(b.subject, release="0.11.0"), FAIL, "x",
                      short="yes: plain bf16 ranks differ")
    fix_b = Finding("promotion", "fix: ranks diverge", dict(plain_b.subject), FAIL, "x", card=True,
                    short="no fix found (3 tried)")
    rows = answers.table({"01": [a, b], "03": [plain, plain_b, fix_b]}, {"01": {"ranks agree": "diverges"},
                                                                      "03": {"fix: ranks diverge": "fix"}},
                         {"03": {"plain ranks agree": "diverges"}})
    assert [(r.release, r.diverges, r.fix) for r in rows] == [("0.16.1", "yes", None), ("0.12.3", "no", None),
                                                               ("0.11.0", "yes", "none found")]
    # 01 answered 0.16.1: 03's own plain answer (which says otherwise) is not added there
    assert [c.text for c in rows[0].cells["diverges"]] == ["yes: EP order, in 3/3 trials"]
    assert [c.text for c in rows[2].cells["diverges"]] == ["yes: plain bf16 ranks differ"]
    assert [c.text for c in rows[2].cells["cost"]] == ["no fix to cost"]


@pytest.mark.parametrize("ci, floor, words", [
    ((0.95, 1.05), (0.9, 1.1), "inside the noise floor"),
    ((1.02, 2.44), (0.76, 1.29), "not told apart from noise"),
    ((1.5, 1.7), (0.9, 1.1), "above the noise floor"),
    ((0.5, 0.7), (0.9, 1.1), "faster than plain"),
])
def test_cost_cell_is_worded_by_the_floor_rule(ci, floor, words):
    c = answers.cost_cell(Cost(ratio=sum(ci) / 2, ci=ci, floor_ci=floor))
    assert c.text.endswith(words)
    others = {"inside the noise floor", "not told apart from noise", "above the noise floor", "faster than plain"}
    assert not any(w in c.text for w in others - {words})


def test_cost_cell_of_an_impossible_cost_is_invalid():
    for ratio, ci in ((math.nan, (1.0, 1.2)), (1.1, (math.inf, 2.0)), (0.0, (0.0, 0.0))):
        assert answers.cost_cell(Cost(ratio=ratio, ci=ci, floor_ci=(0.9, 1.1))).text == "cost invalid: not ranked"


def test_index_opens_with_banner_and_table_and_links_every_file(tmp_path):
    """The index of a report folder: title with day and machine, the banner and answer table before anything else,
    each row's evidence collapsed under its anchor, a location never under a PASS/FAIL badge, every file linked."""
    recs = [rec01("allgather", "none", cmp(10), cmp(0))]
    recs += [cell("allgather", r, cross=0 if r != "none" else 5, world=4) for r in ("none", "fp32")]
    (tmp_path / "results.json").write_text(json.dumps(recs))
    (tmp_path / "compare-with-x.txt").write_text("x")
    (tmp_path / "sub").mkdir()
    (tmp_path / "sub" / "index.html").write_text("x")
    page = runner.write_index(tmp_path, [], {"profile": "cpu"}).read_text()
    body = page.split("<body>", 1)[1]
    assert body.index("class='banner'") < body.index("class='answers'") < body.index("Evidence per subject")
    assert "moe_lab report — cpu" in page
    for f in ("results.json", "compare-with-x.txt", "sub/index.html"):
        assert f'href="{f}"' in page
    table = page.split("class='answers'", 1)[1].split("</table>", 1)[0]
    text = re.sub(r"<[^>]+>", " ", table)
    assert "PASS" not in text and "FAIL" not in text  # cells carry words and marks, not badges
    saved = json.loads((tmp_path / "index.json").read_text())
    assert saved["answers"] and saved["answers"][0]["cells"]["diverges"][0]["status"] == FAIL


def test_a_location_or_a_fix_carries_no_status_mark():
    """'where' is a place and 'fix' a remedy: neither is a test, so neither cell is marked (the diverges cell, a
    test, is — the control)."""
    fs = [_finding(FAIL, "yes: EP order, in 3/3 trials"),
          _finding(FAIL, "combine.comm (reduce_scatter_tensor in bfloat16)", question="first divergent stage"),
          _finding(PASS, "fix found: router fp32", question="fix: ranks diverge")]
    rows = answers.table({"01": fs}, {"01": {"ranks agree": "diverges", "first divergent stage": "where",
                                             "fix: ranks diverge": "fix"}})
    tds = render.answer_table(rows, shared={}).split("<td")[2:]
    cols = [c for c in answers.COLUMNS if rows[0].cells.get(c)]
    by_col = dict(zip(cols, tds))
    assert "class='mk FAIL'" in by_col["diverges"]
    assert "class='mk" not in by_col["where"] and "class='mk" not in by_col["fix"]
    ev = render.evidence(rows)
    assert "fix found: router fp32</span> <b>fix: ranks diverge</b>" in ev and "PASS" not in ev
    assert "FAIL</span> <b>ranks agree</b>" in ev  # the test keeps its badge (the control)


def test_cells_beyond_three_link_to_the_evidence():
    fs = [_finding(FAIL if i % 2 else PASS, f"{i} layer(s), plain, deterministic: no layout effect" if i % 2 == 0
                   else f"{i} layer(s), plain, deterministic: the layout's own effect (reruns equal)",
                   question="layout vs run-to-run") for i in range(5)]
    rows = answers.table({"06": fs}, {"06": {"layout vs run-to-run": "training"}})
    html_ = render.answer_table(rows, shared={})
    assert "+2 more" in html_ and "href='#ev-0'" in html_
    shown = html_.split("<td>", 1)[1]
    assert shown.index("the layout&#x27;s own effect") < shown.index("no layout effect")  # failures first


def test_index_says_what_the_profile_runs_and_leaves_out(tmp_path):
    """The profile's own description (its `_doc`) is on the index under the answers, marked as the profile as
    written where the run overrode keys; a run with no description shows no such line (the control)."""
    from moe_lab import profiles

    about = profiles.load("gpu").about
    assert "releases=installed,0.19.2" in about  # what the gpu profile leaves out, and how to add it back
    page = runner.write_index(tmp_path, [], {"profile": "gpu", "profile_about": about}).read_text()
    assert "<b>The gpu profile</b>: " in page and html.escape(about) in page
    page = runner.write_index(tmp_path, [], {"profile": "gpu", "profile_about": about,
                                             "overridden": ["releases", "training.steps"]}).read_text()
    assert "(as written; this run overrides releases, training.steps)" in page
    page = runner.write_index(tmp_path, [], {"profile": "x.json"}).read_text()
    assert "profile</b>" not in page
