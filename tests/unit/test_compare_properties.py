"""`moe-lab compare`'s invariants, held by property-based tests: hypothesis builds a report's records for every question
that has a compare module, then a second report from it that contradicts it — verdicts flipped, cases dropped or
added, another layer or release for some cases, another placement, other trial counts, NaN and zero-trial values —
and every comparison must still keep the rules: each verdict is the one `moe-lab findings` gives, every case is a row
or listed as one side's, unlike layers and releases are refused or marked on every row, no cause is stated, every
value in the page is escaped."""

import copy
import math
import os
from collections import Counter

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st
from records_factory import (ENV, back05, case02, case04, cell, cmp, kernel04, lay01, preset07, rec01, rec08,
                             train06)

from moe_lab import questions
from moe_lab.reporting import compare

SETTINGS = settings(max_examples=int(os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES", 60)), deadline=None,
                    derandomize=not os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES"),
                    suppress_health_check=[HealthCheck.too_slow, HealthCheck.data_too_large])
COMPARED = [q for q in questions.QUESTIONS if q.compare]
NUMBERS = [q.number for q in COMPARED]
EVIL = "<b>all&gather</b>"
CANNED = ("NCCL's own reduction order", "gloo reduces", "GEMMs are the same kernels", "may part too", "because")
dispatchers = st.sampled_from(["allgather", "alltoall", EVIL])


@st.composite
def comparison(draw, trials=5, numel=1000):
    n = draw(st.sampled_from([0, 3, 300]))
    k = draw(st.integers(1, trials)) if n else 0
    return cmp(n, trials=trials, n_differ=k, numel=numel)


def rec09(n, d, cross, rerun):
    r = rec01(d, "none", cross, rerun)
    r.update(notebook="09", experiment="seq_len", case_key=f"09/{d}/{n}", config=dict(ENV["config"], seq_len=n))
    return r


@st.composite
def question_records(draw, number: str) -> list[dict]:
    d = draw(dispatchers)
    if number == "01":
        out = [rec01(d, r, draw(comparison()), draw(comparison())) for r in draw(st.sets(st.sampled_from(
            ["none", "fp32"]), min_size=1))]
        if draw(st.booleans()):
            out += [lay01(d, lay, draw(comparison())) for lay in ("tp 1 × ep 1", "tp 1 × ep 4", "tp 2 × ep 2")]
        return out
    if number == "02":
        return [case02(d, v, draw(st.sampled_from([None, "combine.comm"])))
                for v in ("bf16 (nothing)", "moe_router_dtype=fp32")]
    if number == "03":
        return [cell(d, r, det=det, cross=draw(st.sampled_from([0, 300])), rerun=draw(st.sampled_from([0, 3])))
                for r, det in (("none", False), ("fp32", False), ("none", True))]
    if number == "04":
        out = [case04(d, rem, draw(comparison(numel=23040)), draw(comparison()))
               for rem in ("none", "no_splitk")]
        return out + [kernel04("fc1", m, draw(st.booleans()), device="cuda") for m in (128, 256)]
    if number == "05":
        return [back05(d, s, bad=tuple(draw(st.sets(st.sampled_from(["cross_out", "cross_dx", "rerun_dx"])))))
                for s in ("plain", "router fp32")]
    if number == "06":
        det = draw(st.booleans())
        return [train06(ep, det=det, part_at=None if ep == 1 else draw(st.sampled_from([None, 2])), dispatcher=d)
                for ep in (1, 2)]
    if number == "07":
        return [preset07("qwen3-30b-a3b", d, r, det=det, cross=draw(st.sampled_from([0, 300])))
                for r, det in (("none", False), ("fp32", False))]
    if number == "08":
        return [rec08(d, layout_bias=draw(st.sampled_from([0.0, 3.0])), swap_ulps=draw(st.sampled_from([0.0, 40.0])))]
    if number == "09":
        return [rec09(n, d, draw(comparison()), draw(comparison())) for n in (64, 128)]
    raise AssertionError(f"question {number} has a compare module but no records here: add its builder")


@st.composite
def report(draw) -> list[dict]:
    out = []
    for number in draw(st.lists(st.sampled_from(NUMBERS), min_size=1, max_size=3, unique=True)):
        out += draw(question_records(number))
    return out


def _flip(c: dict) -> None:
    if isinstance(c, dict) and "numel" in c:
        n = 0 if c.get("n_mismatch") else 7
        c.update(n_mismatch=n, bitwise_equal=n == 0, n_differ=c.get("trials", 1) if n else 0,
                 mismatch_frac=n / c["numel"], per_trial=[n] * c.get("trials", 1))


def _mutate(r: dict, how: str, draw) -> dict | None:
    r = copy.deepcopy(r)
    if how == "verdict":
        for k in ("cross_rank", "rerun", "truncation", "vs_reference", "cross_dx", "kernel"):
            _flip(r.get(k))
        if "first_divergent_stage" in r:
            r["first_divergent_stage"] = None if r["first_divergent_stage"] else "combine.comm"
        if "weights_fp" in r and r.get("ep") != 1:
            r["weights_fp"] = [x + "-moved" if t >= 3 else x for t, x in enumerate(r["weights_fp"])]
    elif how == "drop":
        return None
    elif how == "layer":
        r["config"] = dict(r.get("config") or {}, hidden=4096)
    elif how == "release":
        r["megatron_core"] = "0.19.2"
    elif how == "placement":
        r.update(ranks_per_gpu=1, backend="nccl", gpu_uuid="ffff0000")
    elif how == "trials":
        for c in (v for v in r.values() if isinstance(v, dict) and "trials" in v):
            c.update(trials=c["trials"] + 2, n_differ=min(c.get("n_differ") or 0, c["trials"] + 2))
    elif how == "invalid":
        c = next((v for v in r.values() if isinstance(v, dict) and "numel" in v), None)
        if c is not None:
            c.update(draw(st.sampled_from([{"n_mismatch": math.nan}, {"trials": 0, "n_differ": 0},
                                           {"n_mismatch": 10**7}, {"numel": 0}])))
    return r


HOW = ["same", "verdict", "drop", "layer", "release", "placement", "trials", "invalid"]


@st.composite
def pair(draw):
    """(A, B, the mutations used): B is A with each record mutated one way, plus possibly another question's
    records of its own (cases only B holds)."""
    a = draw(report())
    b, used = [], set()
    for r in a:
        how = draw(st.sampled_from(HOW))
        used.add(how)
        m = r if how == "same" else _mutate(r, how, draw)
        if m is not None:
            b.append(m)
    if draw(st.booleans()):
        b += draw(report())
    return a, b, used


def _findings_of_compared(records):
    by = questions.findings(records)
    return Counter((q.number, f.status, f.claim) for q in COMPARED for f in by[q.number])


def _refused(rows):
    return [r for r in rows if set(r["differs"]) & set(compare.REFUSED)]


@SETTINGS
@given(pair())
def test_every_case_is_a_row_or_one_sides_and_every_verdict_is_the_findings(ab):
    a, b, _ = ab
    c = compare.compare(a, b, allow_unlike=True)
    side_a = Counter((r["notebook"], r["a"].split(" (")[0], r["claim_a"]) for r in c.rows)
    side_a += Counter((x.number, x.finding.status, x.finding.claim) for x in c.only_a)
    side_b = Counter((r["notebook"], r["b"].split(" (")[0], r["claim_b"]) for r in c.rows)
    side_b += Counter((x.number, x.finding.status, x.finding.claim) for x in c.only_b)
    assert side_a == _findings_of_compared(a) and side_b == _findings_of_compared(b)
    s = compare.text(c)
    assert f"Verdicts agree in {c.agree} of {len(c.rows)} cases held by both" in s
    assert f"Only in A: {len(c.only_a)} case(s)" in s and f"only in B: {len(c.only_b)} case(s)" in s
    for x in c.only_a + c.only_b:
        assert f"- {x.name}: {x.verdict_text()}" in s


@SETTINGS
@given(pair())
def test_unlike_layers_and_releases_are_refused_or_marked_on_every_row(ab):
    a, b, _ = ab
    allowed = compare.compare(a, b, allow_unlike=True)
    unlike = _refused(allowed.rows)
    if unlike:
        with pytest.raises(compare.UnlikeReports) as e:
            compare.compare(a, b)
        msg = str(e.value)
        assert msg.startswith("A and B hold different ") and "--allow-unlike" in msg and "\n" not in msg
        assert all(compare.WORDS[k] in msg for k in {k for r in unlike for k in r["differs"]}
                   if k in compare.REFUSED)
    else:
        assert compare.compare(a, b).rows == allowed.rows
    lines = {line for line in compare.text(allowed).splitlines() if line[:2] in ("= ", "≠ ")}
    for r in allowed.rows:
        differ = [k for k in r["sides_a"] if r["sides_a"][k] != r["sides_b"].get(k)]
        assert sorted(r["differs"]) == sorted(differ)
        if differ:
            assert any(line.startswith(("= " if r["agree"] else "≠ ") + r["case"] + ":")
                       and line.endswith("differs: " + ", ".join(r["differs"])) for line in lines)


@SETTINGS
@given(pair())
def test_a_row_says_both_verdicts_and_no_cause_and_invalid_values_stay_invalid(ab):
    a, b, _ = ab
    c = compare.compare(a, b, allow_unlike=True)
    s = compare.text(c)
    assert not any(w in s for w in CANNED)
    for r in c.rows:
        assert "why" not in r
        assert r["agree"] == (r["a"] == r["b"])
        if not r["agree"]:
            assert f": A {r['a']}, B {r['b']}" in s
        for m in (r["magnitude_a"], r["magnitude_b"]):
            assert m == "—" or m.startswith("invalid (") or " of " in m or _finite(m), m
        if r["magnitude_a"].startswith("invalid") or r["magnitude_b"].startswith("invalid"):
            assert r["within_factor"] is None


def _finite(text: str) -> bool:
    try:
        return math.isfinite(float(text))
    except ValueError:
        return False


@SETTINGS
@given(pair())
def test_the_page_escapes_every_value(ab):
    a, b, _ = ab
    page = compare.page(compare.compare(a, b, allow_unlike=True))
    assert EVIL not in page and "<b>" not in page
    if any(r.get("dispatcher") == EVIL for r in a + b):
        assert "&lt;b&gt;all&amp;gather&lt;/b&gt;" in page


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(["allgather", "alltoall"]), st.sampled_from(["none", "fp32", "fp64"]),
                          st.integers(1, 5)), min_size=1, max_size=4, unique_by=lambda x: x[:2]))
def test_a_flipped_verdict_is_always_a_disagreeing_row(cases):
    """The control of agreement: B's ranks differ in every trial where A's are equal (and the reverse) — every such
    case is a row that disagrees, its magnitudes side by side."""
    a = [rec01(d, r, cmp(0, trials=t), cmp(0, trials=t)) for d, r, t in cases]
    b = [rec01(d, r, cmp(300, trials=t), cmp(0, trials=t)) for d, r, t in cases]
    for x, y in ((a, b), (b, a)):
        c = compare.compare(x, y)
        assert len(c.rows) == len(cases) and not c.only_a and not c.only_b
        assert all(not r["agree"] and r["within_factor"] is False for r in c.rows)
        assert {r["a"] for r in c.rows} | {r["b"] for r in c.rows} == {"PASS (attribution equal)",
                                                                       "FAIL (attribution ep)"}
