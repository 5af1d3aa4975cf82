"""Notebook 01's layout findings (questions.reproduce.layouts_findings) on constructed records: the words follow the records, a layout
whose own reruns differ says so, nothing measured is NOT MEASURED, and the registry keeps 01's two questions apart."""

from hypothesis import given, settings, strategies as st

from moe_lab.questions.reproduce import layouts_findings as layouts
from moe_lab import questions
from moe_lab.findings.model import FAIL, MIXED, NOT_MEASURED, PASS
from tests.unit.records_factory import cmp, lay01, rec01

REF = "tp 1 × ep 1"


def test_a_layout_that_changes_the_bits_fails_and_one_that_does_not_passes():
    recs = [lay01("alltoall", REF, cmp(0)), lay01("alltoall", "tp 1 × ep 4", cmp(0)),
            lay01("alltoall", "tp 2 × ep 2", cmp(120, numel=32768))]
    fs = layouts.findings(recs)
    summary, per = fs[0], {f.subject["layout"]: f for f in fs[1:]}
    assert summary.card and summary.status == FAIL and "1 of 2 layout(s)" in summary.claim
    assert "tp 2 × ep 2" in summary.claim and "tp 1 × ep 4)" not in summary.claim
    assert per["tp 1 × ep 4"].status == PASS
    bad = per["tp 2 × ep 2"]
    assert bad.status == FAIL and "120 of 32,768 output elements" in bad.claim
    assert any("only the arithmetic's order moved" in n for n in bad.evidence.notes)
    assert REF not in per  # the reference is the control, not a finding of its own
    assert any("reference against its own stored output" in n for n in summary.evidence.notes)


def test_moved_routing_and_rerun_nondeterminism_are_said():
    rec = lay01("allgather", "tp 1 × ep 4", cmp(50), rerun=cmp(7, n_differ=2), routing=3)
    f = layouts.findings([lay01("allgather", REF, cmp(0)), rec])[1]
    assert "first divergent stage router.routing_map" in f.claim
    assert any("routing itself moved" in n for n in f.evidence.notes)
    assert any("run-to-run nondeterminism is part of it" in n for n in f.evidence.notes)


def test_some_trials_only_is_mixed_and_only_the_reference_is_not_measured():
    f = layouts.findings([lay01("allgather", REF, cmp(0)), lay01("allgather", "tp 1 × ep 4", cmp(4, n_differ=2))])
    assert f[0].status == MIXED and f[1].status == MIXED
    only_ref = layouts.findings([lay01("allgather", REF, cmp(0))])
    assert [x.status for x in only_ref] == [NOT_MEASURED]
    assert layouts.findings([]) == []


def test_notebook_01_renders_both_questions_and_neither_reads_the_others_records():
    recs = [rec01("allgather", "none", cmp(9), cmp(0)), lay01("allgather", REF, cmp(0)),
            lay01("allgather", "tp 1 × ep 4", cmp(9))]
    fs = questions.findings(recs)["01"]
    assert {f.experiment for f in fs} == {"reproduce", "layouts"}
    assert sum(f.experiment == "reproduce" for f in fs) == 1  # a layout record is not a cross-rank case


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(st.sampled_from(["tp 1 × ep 4", "tp 2 × ep 2", "tp 2 × ep 2 (etp 1)"]),
                          st.integers(0, 3), st.integers(0, 3)), min_size=0, max_size=3, unique_by=lambda t: t[0]))
def test_every_status_is_backed_by_its_records(rows):
    """Generated records: a PASS only where every trial was bitwise equal, FAIL only where every trial differed and
    the control (the layout's own rerun) repeated — a rerun that differs (here 1 element against 5: no dominance)
    leaves it not told apart (MIXED)."""
    recs = [lay01("allgather", REF, cmp(0))] + [
        lay01("allgather", lay, cmp(5 if k else 0, trials=3, n_differ=k), rerun=cmp(1 if rk else 0, trials=3,
                                                                                   n_differ=rk))
        for lay, k, rk in rows]
    fs = layouts.findings(recs)
    per = {f.subject["layout"]: f for f in fs[1:]}
    for lay, k, rk in rows:
        assert per[lay].status == (PASS if k == 0 else FAIL if k == 3 and rk == 0 else MIXED)
    if not rows:
        assert fs[0].status == NOT_MEASURED
    else:
        assert fs[0].status == (PASS if all(k == 0 for _, k, _ in rows) else fs[0].status)
        assert fs[0].status != PASS or all(k == 0 for _, k, _ in rows)


def test_the_grad_mode_finding_counts_only_layouts_whose_forward_repeats():
    """A grad-enabled forward that differs is the grad mode's effect only where the layout's no-grad
    reruns are bitwise equal (the control); where they differ too the note says it cannot tell them apart."""
    from moe_lab.questions.reproduce.layouts_findings import grad_mode_note

    steady_moved = lay01("allgather", "tp 1 × ep 4", cmp(40), grad_vs_nograd=cmp(553, trials=1))
    steady_same = lay01("allgather", "tp 2 × ep 2", cmp(40), grad_vs_nograd=cmp(0, trials=1))
    noisy_moved = lay01("allgather", "tp 2 × ep 2 (etp 1)", cmp(40), rerun=cmp(9, n_differ=3),
                        grad_vs_nograd=cmp(28, trials=1))
    note = grad_mode_note([steady_moved, steady_same, noisy_moved])
    assert "differs in 1 of 2 layout(s) whose no-grad forward repeats bit for bit (tp 1 × ep 4: 553 elements)" in note
    assert "in the other 1 the reruns differ" in note and "etp 1): 28" not in note
    # the control: the same records with nothing moving say 0, and a set where no layout repeats claims nothing
    calm = grad_mode_note([steady_same, lay01("allgather", "tp 1 × ep 4", cmp(40), grad_vs_nograd=cmp(0, trials=1))])
    assert "differs in 0 of 2 layout(s)" in calm and "training job sees" not in calm
    assert "not told apart" in grad_mode_note([noisy_moved]) and "differs in" not in grad_mode_note([noisy_moved])
    assert grad_mode_note([lay01("allgather", "tp 1 × ep 4", cmp(40))]) is None  # not measured: no sentence


def test_deterministic_layout_cases_are_their_own_group_with_their_own_claim():
    """The layouts question with deterministic mode on (GPU profile): the same layouts again, engines started with
    the deterministic environment on GPUs only; their findings never merge with the plain ones."""
    from moe_lab import profiles
    from moe_lab.questions.reproduce import layouts
    from moe_lab.questions.reproduce import layouts_findings as found

    p = profiles.load("cpu", {"dispatchers": ["allgather"], "layout_router_dtypes": ["none"],
                              "layouts": ["ep1", "ep4"], "layout_deterministic": [False, True]})
    cs = layouts.cases(p)
    assert [(c.moe.deterministic, c.deterministic_env) for c in cs] == [(False, False)] * 2 + [(True, False)] * 2
    plain = [lay01("allgather", REF, cmp(0)), lay01("allgather", "tp 1 × ep 4", cmp(30))]
    det = [dict(r, deterministic=True, case_key=r["case_key"] + "/det") for r in
           (lay01("allgather", REF, cmp(0)), lay01("allgather", "tp 1 × ep 4", cmp(0)))]
    summaries = [f for f in found.findings(plain + det) if "layout(s) change" in f.claim]
    assert sorted(f.claim for f in summaries) == [
        "allgather, router none, deterministic: 0 of 1 layout(s) change the output bits against tp 1 × ep 1",
        "allgather, router none: 1 of 1 layout(s) change the output bits against tp 1 × ep 1 (tp 1 × ep 4)"]


def test_a_layout_is_not_said_to_change_the_bits_when_the_reference_does_not_repeat_itself():
    """The control first: the reference against its stored output differs as much as the layout does — not told
    apart from run-to-run (MIXED, said so); where the layout's difference dominates the control's (>= 100x) it is
    the layout's (FAIL, said so); with the controls equal, FAIL (the check can fail)."""
    noisy_ref = lay01("alltoall", REF, cmp(40, trials=3))  # the reference vs its own stored output: 40 differ
    near = layouts.findings([noisy_ref, lay01("alltoall", "tp 1 × ep 4", cmp(60, trials=3))])[1]
    assert near.status == MIXED and any("not told apart" in n for n in near.evidence.notes)
    far = layouts.findings([noisy_ref, lay01("alltoall", "tp 1 × ep 4", cmp(40 * 100, trials=3, numel=10**6))])[1]
    assert far.status == FAIL and any(">= 100x" in n for n in far.evidence.notes)
    steady = layouts.findings([lay01("alltoall", REF, cmp(0, trials=3)),
                               lay01("alltoall", "tp 1 × ep 4", cmp(60, trials=3))])[1]
    assert steady.status == FAIL  # the control: equal controls, every trial differs
    no_ref = layouts.findings([lay01("alltoall", "tp 1 × ep 4", cmp(60, trials=3))])
    assert all(f.status != FAIL for f in no_ref)  # no reference record: no control, never FAIL
