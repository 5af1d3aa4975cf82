"""Notebook 09's findings (does the divergence across EP ranks depend on the sequence length?), fed stories that
agree with the usual one (EP order at every length) and stories that contradict it (equal at one length only,
nondeterminism at one length, one rank): the status and every sentence follow the records."""

from __future__ import annotations

import pytest
from hypothesis import given, settings, strategies as st
from records_factory import ENV, cmp, rec01

from moe_lab import profiles, questions
from moe_lab.findings import FAIL, MIXED, NA, PASS
from moe_lab.findings.common import groups
from moe_lab.questions.seq_len import QUESTION, findings as found
from moe_lab.questions.seq_len.params import SeqLenParams

STORIES = {  # a length's story: (cross-rank mismatching elements, trials that differ, rerun mismatching elements)
    "ep": (300, 5, 0), "equal": (0, 0, 0), "nondeterminism": (300, 5, 300), "mixed": (300, 2, 0)}


def rec09(n: int, story: str, d: str = "allgather", world: int = 4) -> dict:
    cross_n, differ, rerun_n = STORIES[story]
    r = rec01(d, "none", cmp(cross_n, n_differ=differ), cmp(rerun_n))
    r.update(notebook=QUESTION.number, experiment="seq_len", case_key=f"09/{d}/{n}/{story}", world=world,
             config=dict(ENV["config"], seq_len=n))
    if world == 1:
        r["cross_rank"] = {"applicable": False, "reason": "one rank"}
    return r


def test_the_same_verdict_at_every_length_is_one_finding_across_the_lengths():
    fs = found.findings([rec09(n, "ep") for n in (64, 128, 256)])
    assert [f.status for f in fs] == [FAIL]
    assert "the ranks differ at every length measured (64, 128, 256 tokens), each time by EP order" in fs[0].claim
    assert "tokens" not in fs[0].subject["layer"]  # the length is an axis, not part of the subject
    fs = found.findings([rec09(n, "equal") for n in (64, 128)])
    assert [f.status for f in fs] == [PASS] and "bitwise equal" in fs[0].claim


def test_the_length_is_an_axis_only_where_the_question_says_so():
    """The control: the same records grouped without the axis fall apart into one subject per length."""
    recs = [rec09(n, "ep") for n in (64, 128, 256)]
    assert len(groups(recs, "router_dtype", axes=QUESTION.axes)) == 1
    assert len(groups(recs, "router_dtype")) == 3


@pytest.mark.parametrize("stories, head, says", [
    (("equal", "equal", "ep"), "it depends on the length",
     "the ranks differ at 256 tokens in every trial (beyond their reruns) and are bitwise equal at 64, 128 tokens"),
    (("nondeterminism", "equal", "equal"), "not told apart",
     "the ranks differ at 64 tokens and are bitwise equal at 128, 256 tokens, but where they differ it is not shown "
     "to be more than run-to-run"),
    (("mixed", "equal", "equal"), "not told apart", "more trials would tell whether the length decides it"),
])
def test_ranks_equal_at_some_lengths_only_is_mixed(stories, head, says):
    """A length effect is claimed only where the differing lengths differ beyond their reruns in every trial; a
    difference that reruns show too (or some trials only) is not told apart from run-to-run (the control)."""
    fs = found.findings([rec09(n, s) for n, s in zip((64, 128, 256), stories)])
    assert [f.status for f in fs] == [MIXED]
    assert head in fs[0].claim and says in fs[0].claim
    assert ("it depends on the length" in fs[0].claim) == (head == "it depends on the length")


@pytest.mark.parametrize("stories, says", [
    (("ep", "nondeterminism", "ep"), "128 tokens: run-to-run nondeterminism"),
    (("ep", "ep", "mixed"), "256 tokens: differ in some trials only"),
])
def test_ranks_that_differ_everywhere_for_other_reasons_say_why_varies(stories, says):
    """As on one H200 (virtual EP): allgather's ranks differ at every length, by EP order alone at one length and
    with run-to-run noise beside it at the others — the answer (they differ) does not depend on the length, the
    reason does, and the finding says both."""
    fs = found.findings([rec09(n, s) for n, s in zip((64, 128, 256), stories)])
    assert [f.status for f in fs] == [FAIL]
    assert "why varies with the length" in fs[0].claim and says in fs[0].claim


def test_one_rank_claims_nothing_across_ranks():
    fs = found.findings([rec09(n, "ep", world=1) for n in (64, 128)])
    assert [f.status for f in fs] == [NA]


def test_dispatchers_never_share_a_finding():
    recs = [rec09(64, "ep"), rec09(128, "ep"), rec09(64, "equal", "alltoall"), rec09(128, "equal", "alltoall")]
    fs = found.findings(recs)
    assert sorted(f.status for f in fs) == sorted([FAIL, PASS])


@settings(max_examples=60, deadline=None)
@given(st.lists(st.sampled_from(sorted(STORIES)), min_size=2, max_size=5))
def test_the_status_follows_the_lengths_verdicts(stories):
    """Whatever each length shows: PASS only where every length is bitwise equal, FAIL where every length differs,
    MIXED exactly where some lengths are equal and others not; a reason that varies is said; every length is named."""
    lengths = [64 * (i + 1) for i in range(len(stories))]
    fs = found.findings([rec09(n, s) for n, s in zip(lengths, stories)])
    assert len(fs) == 1
    f = fs[0]
    equal = [s == "equal" for s in stories]
    assert f.status == (PASS if all(equal) else FAIL if not any(equal) else MIXED)
    differing = {s for s in stories if s != "equal"}
    assert ("why varies with the length" in f.claim) == (not any(equal) and len(differing) > 1)
    for n in lengths:
        assert f"{n} tokens:" in f.claim


def test_registry_routes_09s_records_to_it():
    recs = [rec09(n, "ep") for n in (64, 128)]
    by_nb = questions.findings(recs)
    assert [f.status for f in by_nb[QUESTION.number]] == [FAIL]
    assert all(not fs for nb, fs in by_nb.items() if nb != QUESTION.number)


@pytest.mark.parametrize("value", [[64], [64, 64], [64, 0], "64,x", 128, [64, True]])
def test_bad_lengths_are_refused_when_the_profile_loads(value):
    profiles.load("cpu", {"seq_lens": [64, 128]})  # the control
    with pytest.raises(ValueError, match="seq_lens"):
        profiles.load("cpu", {"seq_lens": value})


def test_a_p_string_of_lengths_is_the_list_it_means():
    assert SeqLenParams.of(profiles.load("cpu", {"seq_lens": "64,96"})).seq_lens == (64, 96)
