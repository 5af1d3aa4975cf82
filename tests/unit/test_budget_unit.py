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


@given(gemm=st.floats(0.01, 1e4), b=st.floats(1, 1e4))
@settings(max_examples=100, deadline=None)
def test_a_chosen_number_of_cuts_is_the_layer_sizing_takes_at_that_many(gemm, b):
    """`cut(layer, n)` (the tests choose n from their own GEMM timing) gives what `size` takes when it needs n cuts."""
    s = budget.size(gemm, 1.0, LAYER, ["01", "05", "06"], budget_s=b, calibration=CAL)
    n = ({512: 0, 256: 1, 128: 2, 64: 3}[s.overrides.get("ffn_hidden", 512)]
         + {128: 0, 64: 1, 32: 2}[s.overrides.get("seq_len", 128)])
    assert budget.cut(LAYER, n) == s.overrides


def test_the_sizing_starts_from_the_profiles_own_layer():
    """What `layer_work` reads of a profile is what the sizing cuts (the cpu profile's is this file's LAYER); the
    control: an overridden width is read as given."""
    from moe_lab import profiles

    assert budget.layer_work(profiles.load("cpu")) == LAYER
    assert budget.layer_work(profiles.load("cpu", {"ffn_hidden": 384}))["ffn_hidden"] == 384


def test_cuts_stop_where_the_layer_is_too_small_to_split_and_a_bad_count_is_refused():
    assert budget.cut(LAYER, 0) == {}
    assert budget.cut(LAYER, 1) == {"ffn_hidden": 256}
    assert budget.cut(LAYER, 2) == {"ffn_hidden": 256, "seq_len": 64, "cut": 45, "seq_lens": [32, 64, 128]}
    small = {"ffn_hidden": 6, "seq_len": 128, "cut": 90, "seq_lens": []}
    assert budget.cut(small, 3) == {}  # ffn 6 would leave 3: under 2 x the factor, so no cut, and none after it
    for bad in (-1, len(budget.STEPS) + 1, 1.0, True):
        with pytest.raises(ValueError, match="steps"):
            budget.cut(LAYER, bad)


FLOOR = {"05": (1, "at two cuts its effect was gone")}


def test_a_question_that_loses_its_effect_on_a_smaller_layer_stops_at_its_own_cuts():
    """Notebook 05 here holds at most one cut: the run cuts the others twice, 05 runs at ffn 256 with the profile's
    tokens, its prediction at half the work (not a quarter), and the words say which layer it ran and why. The
    control: without the floor the same sizing gives 05 the run's layer."""
    nbs = ["01", "05"]
    free = budget.size(9.0, 0.5, LAYER, nbs, budget_s=300, calibration=CAL)
    assert free.overrides == budget.cut(LAYER, 2) and free.kept == {}
    s = budget.size(9.0, 0.5, LAYER, nbs, budget_s=300, calibration=CAL, floors=FLOOR)
    assert s.overrides == budget.cut(LAYER, 2) and s.kept == {"05": {"ffn_hidden": 256}}
    assert s.predicted_s == pytest.approx(budget.predict(9.0, nbs, CAL, 0.25, work_of={"05": 0.5}))
    assert s.predicted_s > free.predicted_s
    assert ("Notebook 05 ran at a bigger layer (ffn_hidden 256), its question's most cuts: at two cuts its effect "
            "was gone.") in s.words()
    assert "Notebook 05" not in free.words()
    # a floor of none keeps the profile's layer; a floor the run does not reach, or a notebook not run, changes nothing
    zero = budget.size(9.0, 0.5, LAYER, nbs, budget_s=300, calibration=CAL, floors={"05": (0, "why")})
    assert zero.kept == {"05": {}} and "Notebook 05 ran at the profile's layer, its question's most cuts: why." \
        in zero.words()
    assert budget.size(9.0, 0.5, LAYER, nbs, budget_s=300, calibration=CAL, floors={"05": (3, "why")}).kept == {}
    assert budget.size(9.0, 0.5, LAYER, ["01"], budget_s=300, calibration=CAL, floors=FLOOR).kept == {}


@settings(max_examples=150, deadline=None)
@given(gemm=st.floats(0.01, 1e4), b=st.floats(1, 1e4), most=st.integers(0, 4))
def test_a_floored_notebook_runs_the_layer_its_cuts_give_and_the_prediction_counts_it(gemm, b, most):
    nbs = ["01", "05", "06"]
    s = budget.size(gemm, 1.0, LAYER, nbs, budget_s=b, calibration=CAL, floors={"05": (most, "why")})
    n = ({512: 0, 256: 1, 128: 2, 64: 3}[s.overrides.get("ffn_hidden", 512)]
         + {128: 0, 64: 1, 32: 2}[s.overrides.get("seq_len", 128)])
    assert s.overrides == budget.cut(LAYER, n)
    assert s.kept.get("05", s.overrides) == budget.cut(LAYER, min(n, most)) and ("05" in s.kept) == (most < n)
    own = 2.0 ** -min(n, most)
    assert s.predicted_s == pytest.approx(budget.predict(gemm, nbs, CAL, 2.0 ** -n, work_of={"05": own}))
    assert s.held == (s.predicted_s <= b)


def test_notebook_04_holds_one_cut_with_its_reason():
    """The truncation question's floor (its emulated split-K: docs/bench.md) as the sizing reads it."""
    from moe_lab.questions import BY_NUMBER

    q = BY_NUMBER["04"]
    assert q.max_cuts == 1 and "truncation test passed bitwise" in q.max_cuts_why
    assert [n for n, q in BY_NUMBER.items() if q.max_cuts is not None] == ["04"]


@pytest.mark.parametrize("most, why", [(-1, "why"), (1.0, "why"), (True, "why"), (1, " ")])
def test_a_question_with_a_bad_floor_is_refused(most, why):
    from moe_lab.questions.spec import Question

    with pytest.raises(ValueError, match="max_cuts"):
        Question(number="98", name="x", text="x?", notebook="98_x", package="p", experiments=("x",), max_cuts=most,
                 max_cuts_why=why)
    Question(number="98", name="x", text="x?", notebook="98_x", package="p", experiments=("x",), max_cuts=1,
             max_cuts_why="why")  # the control


def test_a_sized_run_hands_a_floored_notebook_its_own_layer(tmp_path, monkeypatch):
    """`run_all` with a sizing that keeps 04 at one cut: 04's kernel gets its own parameters (the user's and its
    cuts), 03's the run's; the index says why. No cluster, no notebook: both are stand-ins here."""
    import contextlib
    import json

    from moe_lab.reporting import runner

    given = {"seed": 7}
    sized = budget.size(9.0, 0.5, LAYER, ["03", "04"], budget_s=1, calibration=CAL, floors={"04": (1, "its why")})
    assert sized.kept == {"04": {"ffn_hidden": 256}} and len(sized.overrides) == 4
    seen = {}

    class Cluster:
        timings, info = {}, []

    @contextlib.contextmanager
    def shared(*a, **k):
        yield Cluster()

    def run_one(num, src, out_dir, params, profile, timeout, **k):
        seen[num] = dict(params)
        return {**runner._row(num, src, "ok", "", 0.0), "verdict": "stand-in"}

    monkeypatch.setattr(runner, "_shared_cluster", shared)
    monkeypatch.setattr(runner, "_size_for_this_machine", lambda *a, **k: sized)
    monkeypatch.setattr(runner, "run_one", run_one)
    monkeypatch.setenv("MOE_LAB_OVERLAP", "0")
    assert runner.run_all(profile="cpu", only="03,04", overrides=dict(given), out=str(tmp_path / "out")) == 0
    assert seen == {"03": {**given, **sized.overrides}, "04": {**given, "ffn_hidden": 256}}
    meta = json.loads((tmp_path / "out" / "index.json").read_text())["meta"]
    assert "Notebook 04 ran at a bigger layer (ffn_hidden 256), its question's most cuts: its why." in meta["sizing"]


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


# ------------------------------------------------------------------ the gpu profile on ranks sharing one GPU
VCAL = {"machine": "test", "forward_ms": 100.0, "start_s": 50.0, "notebooks": {"01": 100.0, "05": 200.0, "06": 100.0}}
VLAYER = {"training.steps": 25}
NBS = ["01", "05", "06"]


def test_the_virtual_ep_prediction_scales_the_calibration_run_by_the_measured_forward():
    assert budget.predict_virtual_ep(100.0, NBS, VCAL) == pytest.approx(50 + 400)
    assert budget.predict_virtual_ep(200.0, NBS, VCAL) == pytest.approx(50 + 800)
    # half the tokens: 01's and 05's cases keep their fixed share and halve the rest; 06 (its own preset) is unmoved
    tok = budget.TOKENS_FIXED_SHARE
    assert budget.predict_virtual_ep(100.0, NBS, VCAL, tokens=0.5) == pytest.approx(
        50 + 300 * (tok + (1 - tok) / 2) + 100)
    st_ = budget.STEPS_FIXED_SHARE
    assert budget.predict_virtual_ep(100.0, NBS, VCAL, steps=0.5) == pytest.approx(50 + 300 + 100 * (st_ + (1 - st_) / 2))


def test_a_fast_transport_runs_the_profiles_work_and_says_so():
    s = budget.size_virtual_ep(50.0, 4, VLAYER, NBS, budget_s=600, calibration=VCAL)
    assert s.overrides == {} and s.held and s.predicted_s == pytest.approx(250)
    assert "4 ranks share this GPU over gloo: a plain forward" in s.words() and "it ran the profile's work." in s.words()
    assert "took 50 ms (100 ms in the calibration run" in s.words()
    ipc = budget.size_virtual_ep(50.0, 4, VLAYER, NBS, budget_s=600, calibration=VCAL, transport="CUDA IPC")
    assert "4 ranks share this GPU over gloo, all-to-alls through CUDA IPC: a plain forward" in ipc.words()


def test_a_slow_transport_cuts_06s_steps_and_never_the_tokens():
    # 450 s at the profile's work; 06's steps halved: 450 - 100 * (1 - 0.63) = 413 s
    s = budget.size_virtual_ep(100.0, 4, VLAYER, NBS, budget_s=420, calibration=VCAL)
    assert s.overrides == {"training.steps": 12} and s.held
    assert "so it ran less work (training.steps 12): predicted 413 s." in s.words() and "--budget 0" in s.words()
    # a tighter budget: 06's steps twice (no cost rounds to cut in this layer; the tokens changed an answer), and it
    # says it is still over
    t = budget.size_virtual_ep(100.0, 4, VLAYER, NBS, budget_s=100, calibration=VCAL)
    assert t.overrides == {"training.steps": 6} and not t.held and "still over the budget." in t.words()
    assert budget.VIRTUAL_EP_STEPS == (("training.steps", 2), ("cost_rounds", 3), ("training.steps", 2))


VCAL_COST = {**VCAL, "cost_share": {"01": 0.5, "05": 0.25}}
VLAYER_ROUNDS = {"training.steps": 25, "cost_rounds": 5, "training.cost_rounds": 5, "presets.cost_rounds": 7}
ROUNDS_CUT = {"01": 4 / 6, "05": 4 / 6, "06": 4 / 6}  # VLAYER_ROUNDS' rounds down to 3 (07 would keep 4 / 8)


def test_the_cost_rounds_cut_saves_their_share_of_each_notebooks_cases():
    # 3 rounds of 5 (each with its warm-up round): 4 / 6 of the rounds' time; 06 has no cost share here
    cut = {"01": 4 / 6, "05": 4 / 6, "06": 4 / 6}
    assert budget.predict_virtual_ep(100.0, NBS, VCAL_COST, rounds=cut) == pytest.approx(
        50 + 100 * (0.5 * 4 / 6 + 0.5) + 200 * (0.25 * 4 / 6 + 0.75) + 100)
    assert budget.predict_virtual_ep(100.0, NBS, VCAL_COST) == budget.predict_virtual_ep(100.0, NBS, VCAL)
    # with half the tokens the rounds' forwards are half as long too: the cut takes its share of what is left
    tok = budget.TOKENS_FIXED_SHARE
    assert budget.predict_virtual_ep(100.0, ["01"], VCAL_COST, tokens=0.5, rounds=cut) == pytest.approx(
        50 + 100 * (tok + (1 - tok) / 2) * (0.5 * 4 / 6 + 0.5))


def test_the_virtual_ep_cuts_come_in_turn_steps_then_rounds_then_steps_again():
    full = budget.predict_virtual_ep(100.0, NBS, VCAL_COST)  # 450
    one = budget.predict_virtual_ep(100.0, NBS, VCAL_COST, steps=0.5)
    two = budget.predict_virtual_ep(100.0, NBS, VCAL_COST, steps=0.5, rounds=ROUNDS_CUT)  # the top-level 5 rounds decide
    three = budget.predict_virtual_ep(100.0, NBS, VCAL_COST, steps=0.25, rounds=ROUNDS_CUT)
    assert full > one > two > three
    for b, cut in ((full, {}), ((one + two) / 2, {"training.steps": 12, "cost_rounds": 3, "training.cost_rounds": 3,
                                                  "presets.cost_rounds": 3}),
                   (one, {"training.steps": 12}), (three - 1, {"training.steps": 6, "cost_rounds": 3,
                                                               "training.cost_rounds": 3, "presets.cost_rounds": 3})):
        s = budget.size_virtual_ep(100.0, 4, VLAYER_ROUNDS, NBS, budget_s=b, calibration=VCAL_COST)
        assert s.overrides == cut, b
    # rounds already at 3 or fewer: the cut is passed over, the steps are halved twice
    few = {**VLAYER_ROUNDS, "cost_rounds": 3, "training.cost_rounds": 2, "presets.cost_rounds": 3}
    s = budget.size_virtual_ep(100.0, 4, few, NBS, budget_s=1, calibration=VCAL_COST)
    assert s.overrides == {"training.steps": 6}
    assert s.predicted_s == pytest.approx(budget.predict_virtual_ep(100.0, NBS, VCAL_COST, steps=0.25))
    s = budget.size_virtual_ep(100.0, 4, {**few, "presets.cost_rounds": 7}, NBS, budget_s=1, calibration=VCAL_COST)
    assert s.overrides == {"training.steps": 6, "presets.cost_rounds": 3}
    assert "presets.cost_rounds 3" in s.words()


def test_a_run_without_06_has_nothing_to_cut_and_says_so():
    s = budget.size_virtual_ep(100.0, 4, VLAYER, ["01", "05"], budget_s=300, calibration=VCAL)
    assert s.overrides == {} and not s.held
    assert s.words().endswith("it ran the profile's work, over the budget (nothing left to cut).")
    t = budget.size_virtual_ep(100.0, 4, VLAYER, ["06"], budget_s=100, calibration=VCAL)
    assert t.overrides == {"training.steps": 6}


@pytest.mark.parametrize("bad", [0, -5.0, float("nan"), "100"])
def test_a_measured_forward_that_is_not_a_positive_number_is_refused(bad):
    with pytest.raises(ValueError, match="measured forward"):
        budget.size_virtual_ep(bad, 4, VLAYER, NBS, budget_s=600, calibration=VCAL)


@settings(max_examples=200, deadline=None)
@given(fwd=st.floats(1, 1e4), b=st.floats(1, 1e5))
def test_virtual_ep_sizing_cuts_only_as_far_as_the_prediction_needs(fwd, b):
    s = budget.size_virtual_ep(fwd, 4, VLAYER_ROUNDS, NBS, budget_s=b, calibration=VCAL_COST)
    steps = {25: 1.0, 12: 0.5, 6: 0.25}[s.overrides.get("training.steps", 25)]
    rounds = ROUNDS_CUT if "cost_rounds" in s.overrides else None
    assert set(s.overrides) <= {"training.steps", *budget.COST_ROUND_KEYS}
    assert s.predicted_s == pytest.approx(budget.predict_virtual_ep(fwd, NBS, VCAL_COST, steps=steps, rounds=rounds))
    assert s.held == (s.predicted_s <= b) and s.predicted_s <= s.predicted_full_s + 1e-9
    if s.overrides:  # without the cut it would not have held
        assert s.predicted_full_s > b
    else:
        assert s.held
    if steps == 0.25:  # the last cut was needed: the two before it did not hold
        assert budget.predict_virtual_ep(fwd, NBS, VCAL_COST, steps=0.5, rounds=ROUNDS_CUT) > b
    if rounds:
        assert budget.predict_virtual_ep(fwd, NBS, VCAL_COST, steps=0.5) > b


def test_the_virtual_ep_calibration_covers_every_notebook_and_its_shares_are_fractions():
    from moe_lab.questions import QUESTIONS

    missing = {q.number for q in QUESTIONS} - budget.VIRTUAL_EP_CALIBRATION["notebooks"].keys()
    assert not missing, f"notebooks without a virtual-EP calibration: {sorted(missing)}"
    assert set(budget.TOKENS_SCALED) | {"06"} == {q.number for q in QUESTIONS}
    assert 0 < budget.TOKENS_FIXED_SHARE < 1 and 0 < budget.STEPS_FIXED_SHARE < 1


def test_the_virtual_ep_calibration_is_the_published_runs_records():
    """Its numbers are read off the published whole-profile run, not typed in: each notebook's cases' seconds and the
    calibrated forward (09's allgather case at the profile's 1024 tokens, router dtype none)."""
    import json
    import lzma
    from pathlib import Path

    from moe_lab.reporting import timing

    folder = Path(__file__).resolve().parents[2] / "reports/published/gpu-h200x1-2026-12-05-whole-profile"
    rows, _ = timing.table(folder)  # what `moe-lab timing` of the folder says
    per_nb = {row.notebook: row.cases_s for row in rows}
    for nb, seconds in budget.VIRTUAL_EP_CALIBRATION["notebooks"].items():
        assert per_nb[nb] == pytest.approx(seconds, abs=0.06), nb
    records = json.loads(lzma.open(folder / "results.json.xz").read())
    fwd = [r["t_forward_s"] for r in records if r["notebook"] == "09" and r["dispatcher"] == "allgather"
           and r["router_dtype"] == "none" and r["config"]["seq_len"] == 1024]
    assert len(fwd) == 1 and fwd[0] * 1e3 == pytest.approx(budget.VIRTUAL_EP_CALIBRATION["forward_ms"], abs=0.06)
    # the cost rounds' share of each notebook's cases: (rounds + 1 warm-up) x the medians of the fns a round runs
    # (06: case, plain and plain again), over the sum of its cases' seconds
    rounds_s, cases_s, seen = {}, {}, set()
    for r in records:
        key = (r["notebook"], r.get("experiment"), r.get("kind"), r.get("case_key"))
        if key in seen:
            continue
        seen.add(key)
        cases_s[r["notebook"]] = cases_s.get(r["notebook"], 0.0) + r["case_wall_s"]
        c = r.get("cost") or {}
        if c.get("t_with_s"):
            fns = 3 if r["notebook"] == "06" else 2
            rounds_s[r["notebook"]] = rounds_s.get(r["notebook"], 0.0) + (c["rounds"] + 1) * (
                c["t_with_s"] + (fns - 1) * c["t_without_s"])
    share = budget.VIRTUAL_EP_CALIBRATION["cost_share"]
    assert set(share) == set(rounds_s)
    for nb, s in rounds_s.items():
        assert share[nb] == pytest.approx(s / cases_s[nb], abs=0.001), nb


def test_a_gpu_profile_run_on_ranks_sharing_a_gpu_times_a_plain_forward_and_sizes_from_it(monkeypatch):
    """The runner's side on a cluster whose 4 ranks share a GPU: every rank times a plain allgather forward of the
    profile's layer, the slowest rank's time sizes the run. Controls: one rank per GPU, --budget 0 and an overridden
    layer are not sized, and nothing is timed."""
    from types import SimpleNamespace

    from moe_lab import profiles
    from moe_lab.controller import calls
    from moe_lab.questions.training.params import TrainParams
    from moe_lab.reporting import runner

    asked = []

    def fake_run(state, fn, cfg, layout, **kw):
        asked.append((fn, cfg, layout))
        return [0.100, 0.1596, 0.120, 0.110]

    monkeypatch.setattr(calls, "run", fake_run)
    config = profiles.load("gpu")
    nbs = list(budget.VIRTUAL_EP_CALIBRATION["notebooks"])

    def cluster(ranks_per_gpu):
        return SimpleNamespace(state=SimpleNamespace(config=SimpleNamespace(ranks_per_gpu=ranks_per_gpu),
                                                     engine_ids=[0, 1, 2, 3], info=[{"transport": "CUDA IPC"}] * 4))

    s = runner._size_for_this_machine(cluster(4), config, "gpu", {}, nbs, None)
    assert s.transport == "CUDA IPC"  # the engines' word for what carried their all-to-alls
    assert len(asked) == 1 and asked[0][0] is budget.measure_forward_on_engines
    assert asked[0][1]["dispatcher"] == "allgather" and asked[0][1]["router_dtype"] == "none"
    assert asked[0][1]["seq_len"] == config.layer.seq_len and asked[0][2]["ep"] == 4
    assert s.forward_ms == pytest.approx(159.6) and s.budget_s == budget.GPU_BUDGET_S
    assert s.predicted_full_s == pytest.approx(budget.predict_virtual_ep(159.6, nbs))
    assert s.overrides == {"training.steps": config.params(TrainParams).steps // 4, "cost_rounds": 3,
                           "training.cost_rounds": 3, "presets.cost_rounds": 3}  # the calibration's own speed: all cuts
    assert s.predicted_s <= s.predicted_full_s
    sized = profiles.load("gpu", s.overrides)  # the cut loads as a profile; the layer keeps its tokens
    assert sized.params(TrainParams).steps == s.overrides["training.steps"] and sized.layer == config.layer
    assert sized.rounds() == 3 and sized.params(TrainParams).cost_rounds == 3
    asked.clear()
    assert runner._size_for_this_machine(cluster(1), config, "gpu", {}, nbs, None) is None
    assert runner._size_for_this_machine(cluster(4), config, "gpu", {}, nbs, 0) is None
    assert runner._size_for_this_machine(cluster(4), config, "gpu", {"seq_len": 512}, nbs, None) is None
    assert runner._size_for_this_machine(cluster(4), config, "gpu", {"training.steps": 50}, nbs, None) is None
    assert runner._size_for_this_machine(cluster(4), config, "gpu", {"presets.cost_rounds": 9}, nbs, None) is None
    assert runner._size_for_this_machine(None, config, "gpu", {}, nbs, None) is None
    assert asked == []


def test_every_questions_cases_build_at_the_least_work_the_virtual_ep_sizing_cuts_to():
    from moe_lab import profiles
    from moe_lab.questions import QUESTIONS

    s = budget.size_virtual_ep(1e4, 4, VLAYER_ROUNDS, list(budget.VIRTUAL_EP_CALIBRATION["notebooks"]),
                               budget_s=1)
    assert s.overrides == {"training.steps": 6, "cost_rounds": 3, "training.cost_rounds": 3, "presets.cost_rounds": 3}
    config = profiles.load("gpu", {**s.overrides, "device": "cpu", "engines": 4})  # cases, not a GPU, are checked here
    for q in QUESTIONS:
        for m in q.run_modules():
            assert m.cases(config), (q.number, m.__name__)


def test_the_speed_share_reproduces_the_sized_run_on_another_machine_from_its_records():
    """`speed_fixed_share` was fitted on the first sized run (one H100): with it the prediction of that run's finished
    notebooks' cases, at its measured forward and its cuts, is what its records say they took; scaling whole cases by
    the forward's speed (the share at 0, the control) predicts a quarter less."""
    import json
    from pathlib import Path

    from moe_lab.reporting import timing

    folder = Path(__file__).resolve().parents[2] / "reports/published/gpu-h100x1-2026-12-05-sized"
    measured = json.loads((folder / "measured.json").read_text())
    rows, _ = timing.table(folder)
    done = {row.notebook: row.cases_s for row in rows if row.cases_s}
    assert sorted(done) == ["01", "02", "03", "04", "06", "07", "09"]
    cuts = measured["sizing_numbers"]["overrides"]
    tokens, steps = cuts["seq_len"] / 1024, cuts["training.steps"] / 25
    cal = budget.VIRTUAL_EP_CALIBRATION
    predicted = budget.predict_virtual_ep(measured["forward_ms"], list(done), tokens=tokens, steps=steps) - cal["start_s"]
    assert predicted == pytest.approx(sum(done.values()), rel=0.01)
    whole = budget.predict_virtual_ep(measured["forward_ms"], list(done), {**cal, "speed_fixed_share": 0.0},
                                      tokens=tokens, steps=steps) - cal["start_s"]
    assert whole < 0.85 * sum(done.values())


def test_the_work_the_virtual_ep_cuts_start_from_is_read_for_every_key_they_set():
    from moe_lab import profiles

    work = budget.virtual_ep_work(profiles.load("gpu"))
    assert tuple(work) == budget.VIRTUAL_EP_KEYS == ("training.steps", *budget.COST_ROUND_KEYS)
    assert work == {"training.steps": 25, "cost_rounds": 5, "training.cost_rounds": 5, "presets.cost_rounds": 5}
    assert budget.virtual_ep_work(profiles.load("gpu", {"presets.cost_rounds": 9}))["presets.cost_rounds"] == 9
