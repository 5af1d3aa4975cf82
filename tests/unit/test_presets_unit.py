"""Notebook 07 without engines: the grid a profile's "presets" object makes, its checks, and findings
built from records that contradict the usual story (reruns that differ, no fix in the grid, a missing plain cell)."""

import pytest
from records_factory import preset07

from moe_lab import profiles
from moe_lab.questions.presets import experiment as presets
from moe_lab.findings import FAIL, NOT_MEASURED, PASS
from moe_lab.questions.presets import findings as found


def test_the_grid_is_preset_x_dispatcher_x_deterministic_x_router_dtype_with_the_presets_layers():
    p = profiles.load("cpu", {"presets": {"models": ["moonlight-16b-a3b"], "scale": 0.25, "deterministic": [False, True],
                                          "cost_rounds": 2}})
    cs = presets.cases(p)
    assert len(cs) == 1 * 2 * 2 * 2
    m = cs[0].moe
    assert (m.hidden, m.num_experts, m.topk, m.score_function, m.expert_bias) == (512, 64, 6, "sigmoid", True)
    assert m.model == "moonlight-16b-a3b x0.25 (scaled)" and cs[0].knobs["cost_rounds"] == 2
    assert [(c.moe.router_dtype, c.moe.deterministic) for c in cs[:4]] == [
        ("none", False), ("fp32", False), ("none", True), ("fp32", True)]
    assert not any(c.deterministic_env for c in cs)  # CPU: no engine environment to restart for
    one = presets.cases(profiles.load("cpu", {"model": "mixtral-8x7b", "scale": 0.0625}))
    assert {c.moe.model for c in one} == {"mixtral-8x7b x0.0625 (scaled)"}  # -p model=NAME narrows to that model


@pytest.mark.parametrize("bad, says", [
    ({"models": ["llama"]}, "presets.models: model ('llama') must be one of"),
    ({"models": []}, "presets.models"), ({"scale": 2}, "presets.scale (2) must be a number in (0, 1]"),
    ({"router_dtypes": ["fp32"]}, "must include 'none'"), ({"deterministic": [True]}, "must include false"),
    ({"cost_round": 3}, "presets has unknown key(s) ['cost_round']"),
])
def test_a_bad_presets_object_is_refused_when_the_profile_loads(bad, says):
    with pytest.raises(ValueError) as e:
        profiles.load("cpu", {"presets": bad})
    assert says in str(e.value)
    profiles.load("cpu", {"presets": {"models": ["qwen3-30b-a3b"]}})  # the control: a good object loads


def _by_q(fs):
    return {f.question: f for f in fs}


def test_ep_order_with_a_fix_and_its_cost():
    recs = [preset07("m", cross=300, first="combine.comm"), preset07("m", r="fp32", ratio=1.2, ci=(1.1, 1.3))]
    q = _by_q(found.findings(recs))
    assert q["ranks agree"].status == FAIL and q["ranks agree"].subject["attribution"] == "ep"
    assert q["first divergent stage"].subject["first_stage"] == "combine.comm"
    assert q["fix: ranks diverge"].status == PASS and q["fix: ranks diverge"].remedy == "router fp32"
    row = found.rows(recs)[0]
    assert row["model"] == "m" and row["fix"] == "fix found: router fp32"
    assert row["cost of the fix"].startswith("1.20x (1.10–1.30)")
    assert row["ranks diverge? (plain bf16)"].startswith("yes: EP order")


def test_reruns_that_differ_are_not_called_ep_order_and_nothing_in_the_grid_fixes_them():
    recs = [preset07("m", cross=300, rerun=280, first="combine.comm"), preset07("m", r="fp32", cross=5, rerun=5)]
    q = _by_q(found.findings(recs))
    assert q["ranks agree"].subject["attribution"] == "nondeterminism"
    assert q["fix: ranks diverge"].status == FAIL and q["fix: ranks diverge"].remedy is None
    assert found.rows(recs)[0]["fix"] == "no fix found (1 tried)"
    assert found.rows(recs)[0]["cost of the fix"] == "—"


def test_ranks_that_already_agree_need_nothing_and_a_missing_plain_cell_is_not_measured():
    q = _by_q(found.findings([preset07("m"), preset07("m", r="fp32")]))
    assert q["ranks agree"].status == PASS and q["fix: ranks diverge"].status == PASS
    assert q["first divergent stage"].status == PASS
    only_fix = found.findings([preset07("m", r="fp32")])
    assert [f.status for f in only_fix] == [NOT_MEASURED]
    fix = found.rows([preset07("m", r="fp32")])[0]["fix"]
    assert "not measured" in fix and "no fix" not in fix  # never "no fix found"


def test_two_presets_never_share_a_finding_and_the_verdict_names_each():
    recs = [preset07("a", cross=300), preset07("b")]
    fs = found.findings(recs)
    assert {f.subject["layer"].split("preset ")[-1] for f in fs} == {"a", "b"}
    v = presets.verdict(recs)
    assert v.count("Verdict:") == 2 and "preset a" in v and "preset b" in v
