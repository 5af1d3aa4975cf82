"""`moe-lab compare A B`: the two sides' cases matched by their full subject, each verdict the one `moe-lab findings`
gives, what differs between the sides named on every row, another layer or release refused unless allowed, every
case held by one side only listed, no cause stated. Each check has its control: a differing case is reported, not
only equal ones agreeing."""

import json

import pytest
from records_factory import ENV, cmp, lay01, rec01, train06

from moe_lab import cli, questions
from moe_lab.reporting import compare

NCCL = dict(ranks_per_gpu=1, backend="nccl", placement="one rank per GPU", gpu_uuid="aaaa1111-0000")
CANNED = ("NCCL's own reduction order", "gloo reduces", "GEMMs are the same kernels", "may part too", "because")


def nccl01(d, r, cross, rerun, **kw):
    return rec01(d, r, cmp(cross), cmp(rerun), **{**NCCL, **kw})


def virt01(d, r, cross, rerun, **kw):
    return rec01(d, r, cmp(cross), cmp(rerun), **kw)


def by_case(c: compare.Comparison) -> dict:
    return {r["case"]: r for r in c.rows}


AG = "01 ranks agree — allgather, tp 1 × ep 4, router dtype none"
A2A = AG.replace("allgather", "alltoall")


def test_a_placement_comparison_reports_the_differing_verdict_and_names_the_placement():
    """One rank per GPU over NCCL against virtual EP: allgather is EP order on both (agree, magnitudes within 2x);
    alltoall is run-to-run nondeterminism on A and EP order on B — that row says both verdicts and nothing else."""
    a = [nccl01("allgather", "none", 300, 0), nccl01("alltoall", "none", 2, 2)]
    b = [virt01("allgather", "none", 320, 0), virt01("alltoall", "none", 9, 0)]
    c = compare.compare(a, b)
    rows = by_case(c)
    assert set(rows) == {AG, A2A}
    assert rows[AG]["agree"] and rows[AG]["within_factor"] and rows[AG]["a"] == "FAIL (attribution ep)"
    x = rows[A2A]
    assert not x["agree"] and x["a"] == "FAIL (attribution nondeterminism)" and x["b"] == "FAIL (attribution ep)"
    assert x["within_factor"] is False and x["magnitude_a"] == "2 of 1,000 (0.002)"
    assert all("placement" in r["differs"] and "machine" in r["differs"] for r in c.rows)  # allowed, and named
    s = compare.text(c)
    assert "Verdicts agree in 1 of 2 cases held by both" in s and "they disagree in 1" in s
    assert "placement: A 4 rank(s), one per GPU (NVIDIA H200), over nccl vs B 4 ranks share one GPU" in s
    assert f"≠ {A2A}: A FAIL (attribution nondeterminism), B FAIL (attribution ep)" in s
    assert not any(w in s for w in CANNED) and not any("why" in r for r in c.rows)


def test_the_same_placement_through_another_transport_is_matched_and_named():
    a = [virt01("allgather", "none", 300, 0)]
    b = [virt01("allgather", "none", 300, 0, transport="CUDA IPC")]
    c = compare.compare(a, b)
    assert [r["case"] for r in c.rows] == [AG] and c.rows[0]["agree"]
    assert "placement" in c.rows[0]["differs"]
    assert "B 4 ranks share one GPU (NVIDIA H200) over gloo, all-to-alls through CUDA IPC — virtual EP" in \
        compare.text(c)
    same = compare.compare(a, [virt01("allgather", "none", 300, 0)])  # the control: one transport on both sides
    assert "placement" not in same.rows[0]["differs"]


def test_each_verdict_is_the_one_findings_gives():
    a = [virt01("allgather", "none", 300, 0), virt01("alltoall", "fp32", 2, 2)]
    c = compare.compare(a, a)
    said = {f"{f.status} (attribution {f.subject['attribution']})" for f in questions.findings(a)["01"]}
    assert {r["a"] for r in c.rows} == said == {"FAIL (attribution ep)", "FAIL (attribution nondeterminism)"}
    assert all(r["agree"] and not r["differs"] for r in c.rows)


def test_reproduce_and_layout_records_of_one_dispatcher_are_their_own_cases():
    """01 holds the ranks' records and the layouts' records under the same dispatcher and router dtype: each is its
    own case, the ranks' verdict read from the ranks' record (a layout record never stands in for it)."""
    recs = [virt01("allgather", "none", 300, 0), lay01("allgather", "tp 1 × ep 1", cmp()),
            lay01("allgather", "tp 1 × ep 4", cmp(5))]
    c = compare.compare(recs, recs)
    rows = by_case(c)
    assert rows[AG]["a"] == "FAIL (attribution ep)"
    assert "01 layout changes the bits — allgather, tp 1 × ep 4, deterministic False, router dtype none" in rows
    assert len(c.rows) == len(questions.findings(recs)["01"]) and not c.only_a and not c.only_b


def test_cases_held_by_one_side_are_listed_and_counted():
    a = [virt01("allgather", "none", 300, 0), virt01("alltoall", "none", 9, 0), virt01("alltoall", "fp32", 9, 0)]
    b = [virt01("allgather", "none", 300, 0), virt01("allgather", "fp64", 0, 0)]
    c = compare.compare(a, b)
    assert [r["case"] for r in c.rows] == [AG]
    assert sorted(x.name for x in c.only_a) == [A2A.replace("none", "fp32"), A2A]
    assert [x.name for x in c.only_b] == [AG.replace("none", "fp64")]
    s = compare.text(c)
    assert "Verdicts agree in 1 of 1 cases held by both" in s
    assert "Only in A: 2 case(s) (01: 2); only in B: 1 case(s) (01: 1)." in s
    assert f"- {A2A}: FAIL (attribution ep)" in s and f"- {AG.replace('none', 'fp64')}: PASS (attribution equal)" in s


def test_another_layer_or_release_is_refused_unless_allowed_then_marked_on_every_row():
    a = [virt01("allgather", "none", 300, 0), virt01("alltoall", "none", 9, 0)]
    b = [virt01("allgather", "none", 300, 0, config=dict(ENV["config"], hidden=4096)),
         virt01("alltoall", "none", 9, 0, config=dict(ENV["config"], hidden=4096))]
    with pytest.raises(compare.UnlikeReports) as e:
        compare.compare(a, b)
    msg = str(e.value)
    assert msg.startswith("A and B hold different layers (hidden 64, 8 experts") and "vs hidden 4096" in msg
    assert "in 2 of the 2 cases they both hold" in msg and "--allow-unlike" in msg and "\n" not in msg
    c = compare.compare(a, b, allow_unlike=True)
    assert len(c.rows) == 2 and all(r["differs"] == ["layer"] for r in c.rows)
    assert all(line.endswith("differs: layer") for line in compare.text(c).splitlines() if line[:2] in ("= ", "≠ "))
    rel = [virt01("allgather", "none", 300, 0, megatron_core="0.19.2")]
    with pytest.raises(compare.UnlikeReports, match=r"different releases \(0.16.1 vs 0.19.2\)"):
        compare.compare(a[:1], rel)
    assert compare.compare(a, a).rows  # the control: like sides are compared


def test_a_side_holding_two_releases_is_matched_release_by_release():
    """A holds the case under 0.16.1 and 0.19.2, B under 0.16.1: the 0.16.1 cases match; 0.19.2 is A's alone (no
    refusal: nothing was matched across releases)."""
    a = [virt01("allgather", "none", 300, 0), virt01("allgather", "none", 0, 0, megatron_core="0.19.2")]
    c = compare.compare(a, [virt01("allgather", "none", 300, 0)])
    assert [r["a"] for r in c.rows] == ["FAIL (attribution ep)"] and not c.rows[0]["differs"]
    assert [x.sides["release"] for x in c.only_a] == ["0.19.2"]


def test_invalid_values_are_shown_invalid_never_compared():
    """A comparison of no trial is NOT MEASURED (its finding says so); a count larger than its denominator is
    rendered invalid and its magnitude is not held against the factor."""
    zero = virt01("allgather", "none", 300, 0)
    zero["cross_rank"].update(trials=0, n_differ=0)
    big = virt01("allgather", "none", 300, 0)
    big["cross_rank"]["n_mismatch"] = 10**6
    c = compare.compare([zero], [big])
    r = c.rows[0]
    assert r["a"] == r["b"] == "NOT MEASURED" and r["magnitude_b"] == "invalid (1000000 of 1000)"
    assert r["within_factor"] is None
    assert "(1 of them not measured or not applicable on at least one side)" in compare.text(c)


def test_factor_must_be_a_finite_number_above_one():
    for bad in (float("nan"), float("inf"), 1.0, 0.5, -2, True, "2"):
        with pytest.raises(ValueError, match="--factor"):
            compare.check_factor(bad)
    assert compare.check_factor(2) == 2.0 and compare.check_factor(1.5) == 1.5


def test_the_page_escapes_everything_and_answers_first():
    evil = "<script>alert('x')</script>&"
    a = [virt01(evil, "none", 300, 0)]
    b = [virt01(evil, "none", 0, 0)]
    page = compare.page(compare.compare(a, b))
    assert evil not in page and "&lt;script&gt;alert(&#x27;x&#x27;)&lt;/script&gt;&amp;" in page
    assert page.index("Verdicts agree in 0 of 1") < page.index("<table>")


def run06(ep, **kw):
    return train06(ep, config={"hidden": 8}, **kw)


def rows06(c):
    return {r["case"]: r for r in c.rows if r["notebook"] == "06"}


LAYOUTS = "06 layouts agree — allgather, mode deterministic, setting plain, stack 1 layer(s)"


def test_training_runs_held_bit_for_bit_across_the_two_sides():
    """06 on two machines: equal trajectories are the same bits; the controls — B's ep2 run with other weights after
    step 2 (its losses equal), then with its loss parting at step 1 — are caught with the step and where; a weight
    divergence 100x larger is not within the factor, one 3x larger is (inside the sketches' own band)."""
    a = [run06(1), run06(2, part_at=2, how_far=1e-3)]
    c = compare.compare(a, [run06(1), run06(2, part_at=2, how_far=1e-3)])
    r = rows06(c)[LAYOUTS]
    assert r["agree"] and r["within_factor"] and "the same bits on both sides in 2 of 2 run(s)" in r["bits"]
    assert c.lines == ["06: runs held by both whose trajectories (every step's loss bits and weight fingerprints) are "
                       "the same bits in A and B — with deterministic mode 2 of 2."]

    b = [run06(1), run06(2, part_at=2, how_far=1e-3, tag="other machine")]
    r = rows06(compare.compare(a, b))[LAYOUTS]
    assert r["agree"] and "in 1 of 2 run(s)" in r["bits"]
    assert "ep2 run 0 after step 2 of 6 (in the backward or the gradient reduce" in r["bits"]
    b = [run06(1), run06(2, part_at=1, how_far=1e-3, tag="other machine")]
    assert "ep2 run 0 after step 1 of 6 (in the forward: step 1's loss bits" in \
        rows06(compare.compare(a, b))[LAYOUTS]["bits"]

    assert rows06(compare.compare(a, [run06(1), run06(2, part_at=2, how_far=1e-1)]))[LAYOUTS]["within_factor"] is False
    assert rows06(compare.compare(a, [run06(1), run06(2, part_at=2, how_far=3e-3)]))[LAYOUTS]["within_factor"] is True


def write_report(folder, records, cases=None):
    folder.mkdir(parents=True, exist_ok=True)
    (folder / "results.json").write_text(json.dumps(records))
    for nb, keys in (cases or {}).items():
        (folder / f"cases-{nb}.json").write_text(json.dumps(keys))


def test_the_latest_run_of_a_case_is_the_one_compared(tmp_path):
    """A report whose 01 ran twice (an equal record, then EP order under another key): cases-01.json names the
    latest, and that is the verdict compared. The control: without the file both records are findings of one
    subject, so the case is ambiguous on A — listed as A's, never silently matched to one of them."""
    old = virt01("allgather", "none", 0, 0, case_key="old-run")
    new = virt01("allgather", "none", 300, 0, case_key="new-run")
    write_report(tmp_path / "a", [old, new], {"01": {"keys": ["new-run"]}})
    write_report(tmp_path / "b", [virt01("allgather", "none", 300, 0)])
    (_, ra), (_, rb) = compare.load(tmp_path / "a"), compare.load(tmp_path / "b")
    assert [r["a"] for r in compare.compare(ra, rb).rows] == ["FAIL (attribution ep)"]
    (tmp_path / "a" / "cases-01.json").unlink()
    c = compare.compare(compare.load(tmp_path / "a")[1], rb)
    assert not c.rows and len(c.only_a) == 2 and len(c.only_b) == 1


def test_cli_compare_prints_the_comparison_and_writes_the_page(tmp_path, capsys):
    write_report(tmp_path / "a", [nccl01("allgather", "none", 300, 0)])
    write_report(tmp_path / "b", [virt01("allgather", "none", 310, 0)])
    page = tmp_path / "cmp.html"
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b" / "results.json"), "--html", str(page)]) == 0
    out = capsys.readouterr().out
    assert "Verdicts agree in 1 of 1 cases held by both" in out and f"HTML page: {page}" in out
    assert page.read_text().startswith("<!DOCTYPE html>")


BAD = {
    "no report": (None, "no results.json there"),
    "malformed JSON": ("[{", "is not valid JSON"),
    "not a list": ('{"notebook": "01"}', "must hold a JSON list of records"),
    "notebook a list": ('[{"notebook": ["01"]}]', "record 0 has notebook ['01'] (list)"),
    "config a string": ('[{"notebook": "01", "config": "hidden 8"}]', "record 0 has config of type str"),
    "cases file []": ('[{"notebook": "01", "case_key": "k"}]', "cases-01.json must be a JSON object"),
}


@pytest.mark.parametrize("what", sorted(BAD))
def test_a_report_that_cannot_be_read_is_one_line_and_exit_2(what, tmp_path, capsys):
    text, said = BAD[what]
    write_report(tmp_path / "good", [virt01("allgather", "none", 300, 0)])
    bad = tmp_path / "bad"
    if text is not None:
        bad.mkdir()
        (bad / "results.json").write_text(text)
        if what == "cases file []":
            (bad / "cases-01.json").write_text("[]")
    assert cli.main(["compare", str(tmp_path / "good"), str(bad)]) == 2
    err = capsys.readouterr().err.strip()
    assert said in err and len(err.splitlines()) == 1 and "Traceback" not in err, err


@pytest.mark.parametrize("factor", ["nan", "inf", "1", "0", "-3"])
def test_a_bad_factor_is_refused_before_any_report_is_read(factor, tmp_path, capsys):
    assert cli.main(["compare", str(tmp_path / "nowhere"), str(tmp_path / "nowhere"), "--factor", factor]) == 2
    err = capsys.readouterr().err.strip()
    assert "--factor" in err and "must be a finite number above 1" in err and "results.json" not in err


def test_cli_refuses_unlike_layers_in_one_line_and_compares_them_when_allowed(tmp_path, capsys):
    write_report(tmp_path / "a", [virt01("allgather", "none", 300, 0)])
    write_report(tmp_path / "b", [virt01("allgather", "none", 300, 0, config=dict(ENV["config"], hidden=4096))])
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 2
    err = capsys.readouterr().err.strip()
    assert "different layers" in err and "--allow-unlike" in err and len(err.splitlines()) == 1
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b"), "--allow-unlike"]) == 0
    assert "differs: layer" in capsys.readouterr().out


def test_a_question_without_a_compare_module_is_said_not_compared(monkeypatch):
    """A question may leave `compare` unset: its findings are then counted and said not compared, never dropped.
    The control: with its module, the same records are rows."""
    import dataclasses

    recs = [virt01("allgather", "none", 300, 0)]
    assert compare.compare(recs, recs).rows
    plain = tuple(dataclasses.replace(q, compare=None) if q.number == "01" else q for q in questions.QUESTIONS)
    monkeypatch.setattr(questions, "QUESTIONS", plain)
    c = compare.compare(recs, recs)
    assert not c.rows and c.not_compared == {"01": (1, 1)}
    assert "01: not compared — the question has no compare module (1 finding(s) in A, 1 in B)." in compare.text(c)


def test_the_training_line_counts_only_runs_of_one_layer():
    """Runs of another layer are other runs, whatever their bits: with --allow-unlike their rows are marked 'layer',
    and the line over the runs held by both leaves them out. The control: the same runs on one layer."""
    a = [run06(1), run06(2, part_at=2, how_far=1e-3)]
    b = [train06(ep, config={"hidden": 16}, **kw) for ep, kw in ((1, {}), (2, {"part_at": 2, "how_far": 1e-3}))]
    c = compare.compare(a, b, allow_unlike=True)
    assert c.rows and all("layer" in r["differs"] for r in c.rows) and c.lines == []
    assert compare.compare(a, a).lines
