"""compound.remedy_entered: a setting's remedy string enters what it names, and only that."""

import contextlib

import pytest

from moe_lab.engine import compat
from moe_lab.questions.compound import experiment as compound
from moe_lab.experiments import remedies


@pytest.fixture
def entered(monkeypatch):
    log = []

    def ctx(name):
        @contextlib.contextmanager
        def cm(*a, **k):
            log.append((name, a[1:], k))
            yield
        return cm

    monkeypatch.setattr(compat, "routing_replay", ctx("routing_replay"))
    monkeypatch.setattr(compat, "batch_invariant_mode", ctx("batch_invariant_mode"))
    monkeypatch.setattr(compat, "fp32_gather_grad_reduce", ctx("fp32_grad_reduce"))
    monkeypatch.setattr(remedies, "toggles", ctx("toggles"))
    return log


@pytest.mark.parametrize("remedy, phase, want", [
    ("none", "full", []),
    ("routing_replay", "full", [("routing_replay", ("record",), {})]),
    ("routing_replay", "truncated", [("routing_replay", ("replay",), {})]),
    ("routing_replay+ordered_combine+no_splitk", "truncated",
     [("routing_replay", ("replay",), {}), ("toggles", (), {"remedy": "ordered_combine+no_splitk"})]),
    ("routing_replay+fp32_grad_reduce+ordered_combine+no_splitk", "full",
     [("routing_replay", ("record",), {}), ("fp32_grad_reduce", (), {}),
      ("toggles", (), {"remedy": "ordered_combine+no_splitk"})]),
    ("ordered_combine+no_splitk", "full", [("toggles", (), {"remedy": "ordered_combine+no_splitk"})]),
    ("batch_invariant_mode", "full", [("batch_invariant_mode", (), {})]),
    ("fp32_grad_reduce", "full", [("fp32_grad_reduce", (), {})]),
])
def test_a_remedy_enters_what_it_names(entered, remedy, phase, want):
    with compound.remedy_entered(object(), remedy, phase):
        pass
    assert entered == want


def test_every_setting_names_a_remedy_that_enters_something_or_nothing_on_purpose(entered):
    for name, (_, remedy) in compound.SETTINGS.items():
        entered.clear()
        with compound.remedy_entered(object(), remedy, "truncated"):
            pass
        assert bool(entered) == (remedy != "none"), name


def test_one_rank_never_says_the_gradients_agree_across_ranks():
    """With one rank the cross-rank comparisons are not applicable: the plain backward's PASS says what it covers
    (reruns and truncation) and that ranks were not compared (the control: four ranks say 'across ranks')."""
    from records_factory import back05

    from moe_lab.findings.labels import GRAD_CMPS
    from moe_lab.questions.compound import findings as f05

    four = back05("allgather", "plain")
    one = {**four, **{k: {"applicable": False, "reason": "world size 1", "trials": 3}
                      for k in (*GRAD_CMPS, "cross_out") if k.startswith("cross")}, "world": 1}
    claim = lambda r: next(f for f in f05.findings([r]) if f.question == f05.QUESTION).claim  # noqa: E731
    assert "across ranks, reruns and truncation" in claim(four)
    assert "across ranks: not applicable, one rank" in claim(one) and "across ranks, reruns" not in claim(one)


def test_job_lines_carry_the_router_dtype_the_setting_ran_with():
    """A setting measured with moe_router_dtype=fp32 (ordered_combine+no_splitk, batch invariant mode) puts the router
    line in the job too; a setting whose name says it is not doubled; 'router none' adds nothing (the control)."""
    from moe_lab.findings.jobs import job_lines

    lines = job_lines("ordered_combine+no_splitk", "fp32")
    assert lines[0].startswith('TransformerConfig(moe_router_dtype="fp32")') and len(lines) == 4
    assert job_lines("router fp32 + fp32 grad reduce", "fp32").count(lines[0]) == 1
    bim = job_lines("batch_invariant_mode, router fp64", "fp64")
    assert sum('moe_router_dtype="fp64"' in x for x in bim) == 1 and not any(x.startswith("# batch") for x in bim)
    assert not any("moe_router_dtype" in x for x in job_lines("deterministic", "none"))
