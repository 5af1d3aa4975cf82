"""The cpu profile sized for this CPU (`reporting.budget`): the prediction is each notebook's line through its two
calibration runs, and the layer is cut only as far as the prediction needs, in the order STEPS gives."""

import pytest
from hypothesis import given, settings, strategies as st

from moe_lab.reporting import budget

CAL = {"machine": "test", "gemm_ms": (1.0, 3.0), "start_s": 10.0,
       "notebooks": {"01": (20.0, 40.0), "05": (80.0, 180.0), "06": (50.0, 45.0), "07": (30.0, 150.0)}}
LAYER = {"ffn_hidden": 512, "seq_len": 128, "cut": 90, "seq_lens": [64, 128, 256]}


def test_the_prediction_goes_through_both_calibration_runs():
    assert budget.predict(1.0, ["01", "05"], CAL) == pytest.approx(10 + 20 + 80)
    assert budget.predict(3.0, ["01", "05"], CAL) == pytest.approx(10 + 40 + 180)
    # 07's line would cross zero at 0.75 ms (60 s per ms, 30 s at 1 ms): taken through the origin and its slow run
    assert budget.predict(1.5, ["07"], CAL) == pytest.approx(10 + 150 / 3 * 1.5)
    # 06 ran faster with the slower GEMM (noise): no GEMM part, its first run's time at any speed
    assert budget.predict(30.0, ["06"], CAL) == pytest.approx(10 + 50)
    # a notebook without calibration (added since) is left out; the GEMM part scales with the work
    assert budget.predict(3.0, ["01", "99"], CAL, work=0.5) == pytest.approx(10 + (20 - 10) + 10 * 3 * 0.5)


def test_a_fast_cpu_runs_the_profiles_layer_and_says_so():
    s = budget.size(1.0, 2.0, LAYER, ["01", "05"], budget_s=300, calibration=CAL)
    assert s.overrides == {} and s.held and s.predicted_s == s.predicted_full_s == pytest.approx(110)
    assert "it ran at the profile's layer." in s.words() and "0.5x its fp32 GEMM" in s.words()


def test_a_slow_cpu_gets_the_first_cuts_that_hold_the_budget():
    # at 9 ms: 10 + (10 + 10 * 9) + (30 + 50 * 9) = 590 s at the profile's layer; 320 s with half the work
    full = budget.predict(9.0, ["01", "05"], CAL)
    s = budget.size(9.0, 0.5, LAYER, ["01", "05"], budget_s=350, calibration=CAL)
    assert full == pytest.approx(590) and s.predicted_full_s == pytest.approx(full)
    assert s.overrides == {"ffn_hidden": 256} and s.held and s.predicted_s == pytest.approx(320)
    assert "so it ran a smaller layer (ffn_hidden 256): predicted 320 s." in s.words() and "--budget 0" in s.words()
    # the control: a tighter budget takes the tokens too, with the cut and 09's lengths halved alongside
    t = budget.size(9.0, 0.5, LAYER, ["01", "05"], budget_s=300, calibration=CAL)
    assert t.overrides == {"ffn_hidden": 256, "seq_len": 64, "cut": 45, "seq_lens": [32, 64, 128]}


def test_a_budget_no_cut_can_hold_is_said_not_pretended():
    s = budget.size(1000.0, 1.0, LAYER, ["05"], budget_s=100, calibration=CAL)
    assert not s.held and s.overrides == {"ffn_hidden": 64, "seq_len": 32, "cut": 22, "seq_lens": [16, 32, 64]}
    assert (f"the smallest layer the sizing cuts to (ffn_hidden 64, seq_len 32, cut 22, seq_lens [16, 32, 64]): "
            f"predicted {s.predicted_s:.0f} s, still over the budget.") in s.words()


@pytest.mark.parametrize("bad", [0, -1, float("nan"), "300"])
def test_a_budget_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="budget"):
        budget.size(1.0, 1.0, LAYER, ["01"], budget_s=bad, calibration=CAL)


@settings(max_examples=200, deadline=None)
@given(gemm=st.floats(0.01, 1e4), b=st.floats(1, 1e4))
def test_sizing_cuts_only_as_far_as_the_prediction_needs(gemm, b):
    s = budget.size(gemm, 1.0, LAYER, ["01", "05", "06"], budget_s=b, calibration=CAL)
    steps = ({512: 0, 256: 1, 128: 2, 64: 3}[s.overrides.get("ffn_hidden", 512)]
             + {128: 0, 64: 1, 32: 2}[s.overrides.get("seq_len", 128)])
    assert s.predicted_s <= s.predicted_full_s + 1e-9
    assert s.held == (s.predicted_s <= b)
    if s.overrides:  # one cut fewer would not have held: the prediction before the last cut is over the budget
        fewer = budget.predict(gemm, ["01", "05", "06"], CAL, work=2.0 ** -(steps - 1))
        assert fewer > b
    else:
        assert s.held or steps == 0


def test_the_calibration_covers_every_notebook_that_runs_on_the_cpu_profile():
    from moe_lab.questions import QUESTIONS

    missing = {q.number for q in QUESTIONS} - budget.CALIBRATION["notebooks"].keys()
    assert not missing, f"notebooks without a calibration line: {sorted(missing)} (docs/bench.md's runs)"


@pytest.mark.parametrize("bad", [-1, float("nan"), float("inf"), "300", True])
def test_run_all_refuses_a_bad_budget_before_anything_starts(bad, tmp_path):
    from moe_lab.reporting import runner

    with pytest.raises(ValueError, match=r"budget .* must be a number of seconds >= 0"):
        runner.run_all(profile="cpu", out=str(tmp_path / "out"), budget=bad)
    assert not (tmp_path / "out").exists()


def test_every_questions_cases_build_at_the_smallest_layer_the_sizing_cuts_to():
    """A sized run hands its cuts to every notebook: each question's cases must take them (a case that kept a fixed
    cut of 90 tokens against 32 would fail in the notebook); the control: the same cuts with the cut left at 90
    are refused."""
    from moe_lab import profiles
    from moe_lab.questions import QUESTIONS

    s = budget.size(1000.0, 1.0, LAYER, ["05"], budget_s=1, calibration=CAL)
    config = profiles.load("cpu", s.overrides)
    for q in QUESTIONS:
        for m in q.run_modules():
            cases = m.cases(config)
            assert all(c.cut < c.moe.seq_len for c in cases), (q.number, m.__name__)
    with pytest.raises(ValueError, match="cut"):
        profiles.load("cpu", {k: v for k, v in s.overrides.items() if k != "cut"})
