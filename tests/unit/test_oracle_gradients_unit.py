"""Notebook 08's gradient and training findings without engines: constructed records (each run's error to a truth
built element by element, then the rule's statistics) — the usual story (every correct run expected, the planted bug
caught with its factor), the story contradicted (a correct run far from the truth, a planted bug inside the band at
some step), and hypothesis-generated run sets whose words must follow the rule's verdicts on the records; the
parameters' checks."""

import os

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_lab.engine.train import MISTAKES
from moe_lab.findings.model import FAIL, MIXED, NA, PASS
from moe_lab.questions.oracle import compare as cmp08, gradients_findings as gf, rule
from moe_lab.questions.oracle.gradients_params import MISTAKE_NAMES, OracleTrainingParams

SETTINGS = settings(max_examples=int(os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES", 60)), deadline=None,
                    derandomize=not os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES"),
                    suppress_health_check=[HealthCheck.too_slow])
TRAJECTORY_SETTINGS = settings(SETTINGS, max_examples=max(SETTINGS.max_examples // 3, 10))
"""A trajectory example judges every step of every run: a third as many examples."""
SIZES = {"input": 64, "router": 32, "experts": 96}
EXPERTS = 4
LAYOUTS = ("ep1", "ep2", "ep4", "tp2,ep2,sp", "tp2,ep1,sp", "tp2,ep2,etp1,sp")
NOISES = (1.0, 1.01, 0.98, 1.02, 0.99, 1.015)
"""The story's correct runs: errors of one shape, each run's a little larger or smaller (distinct computations whose
statistics lie close together, as the cluster's layouts do)."""
HEADER = {"megatron_core": "0.16.1", "dispatcher": "allgather", "device": "cpu", "world": 4, "backend": "gloo",
          "config": {"hidden": 32, "num_experts": 8, "topk": 2, "ffn_hidden": 64, "seq_len": 128, "dtype": "bf16"},
          "tokens": 16, "available": True}


def _layout_fields(spec: str) -> dict:
    from moe_lab.layout import Layout

    lay = Layout.parse(spec)
    return {"tp": lay.tp, "ep": lay.ep, "etp": lay.etp, "sequence_parallel": lay.sequence_parallel}


def _runs(perm_seed: int, *, noise=1.0, factor=1.0) -> dict[str, tuple]:
    """One run's tensors, per group: (run, truth, labels). The truths and the multiset of errors (ULPs) fixed, the
    errors' order per run (`perm_seed`, within each expert), times `noise`; the experts' gradient times `factor`."""
    base = np.random.default_rng(7)
    rng = np.random.default_rng(perm_seed)
    out = {}
    for g, n in SIZES.items():
        t = base.standard_normal(n) * 0.01
        e = base.standard_normal(n) * 0.6
        labels = np.repeat(np.arange(EXPERTS), n // EXPERTS) if g == "experts" else None
        perm = np.concatenate([rng.permutation(np.flatnonzero(labels == k)) for k in range(EXPERTS)]) \
            if labels is not None else rng.permutation(n)
        out[g] = (t * (factor if g == "experts" else 1.0) + rule.bf16_ulp(t) * e[perm] * noise, t, labels)
    return out


def _stats(perm_seed: int, *, noise=1.0, factor=1.0, prefix="") -> tuple[dict, dict]:
    """One run's statistics (`_runs`). Equal noise and factor: equal quantiles, so correct runs coincide (a band of
    no width) — the rule's hardest case."""
    out, scale = {}, {}
    for g, (run, t, labels) in _runs(perm_seed, noise=noise, factor=factor).items():
        out.update(rule.error_stats(run, t, labels, prefix=f"{prefix}{g}."))
        scale[f"{prefix}{g}.all"] = float(run @ t / (t @ t))
    return out, scale


def grad_record(name: str, layout: str, *, mistake="none", run=0, noise=1.0, factor=1.0, seed=0,
                pair_with: tuple | None = None) -> dict:
    """pair_with: (name, seed, noise) of the first correct run this one is paired with (its gaps computed here from
    both runs' tensors, as the engine does), or "first" for that run itself."""
    stats, scale = _stats(seed, noise=noise, factor=factor)
    fps = {g: f"fp-{layout}-{noise}-{factor}" for g in SIZES}
    rec = {**HEADER, **_layout_fields(layout), "experiment": gf.GRADIENTS, "kind": "gradients", "run": run,
           "mistake": mistake, "run_name": name, "case_key": f"k-{name}", "dp": 4, "expert_dp": 2, "shares": 4,
           "stats": stats, "scale": scale, "fingerprints": fps, "truth_norm": {g: 1.0 for g in SIZES},
           "truth_sketch": {g: [0.5] * 4 for g in SIZES}, "loss": 1.0, "loss_truth": 1.0,
           "grad_norm": 0.05 * factor, "grad_norm_truth": 0.05}
    if pair_with == "first":
        rec["pair"] = {"with": None, "first": True, "reason": "the first correct run"}
    elif pair_with is not None:
        other, oseed, onoise = pair_with
        mine, ref = _runs(seed, noise=noise, factor=factor), _runs(oseed, noise=onoise)
        rec["pair"] = {"with": other, "gaps": {g: rule.pair_gap(mine[g][0], ref[g][0]).asdict() for g in SIZES}}
    return rec


def traj_record(name: str, layout: str, steps: list[tuple[float, float]], *, mistake="none", run=0, seed=0) -> dict:
    """steps: per step (noise, experts' gradient factor)."""
    per = []
    for k, (noise, factor) in enumerate(steps):
        s, sc = {}, {}
        for fam in ("grad.", "weights."):
            a, b = _stats(seed + 100 * k, noise=noise, factor=factor if fam == "grad." else 1.0, prefix=fam)
            s.update(a)
            sc.update(b)
        per.append({"stats": s, "scale": sc, "fingerprints": {"weights.experts": f"{layout}-{k}-{noise}"},
                    "truth_norm": {"weights.experts": 1.0}, "truth_sketch": {"weights.experts": [0.1 * k, 1.0]},
                    "loss": 1.0, "loss_truth": 1.0, "grad_norm": 0.05 * factor, "grad_norm_truth": 0.05})
    return {**HEADER, **_layout_fields(layout), "experiment": gf.TRAJECTORY, "kind": "trajectory", "run": run,
            "mistake": mistake, "run_name": name, "case_key": f"t-{name}", "dp": 4, "expert_dp": 2, "shares": 4,
            "steps_compared": per}


def _by_run(fs, question):
    return {f.subject.get("run"): f for f in fs if f.question == question}


def _card(fs, experiment):
    (c,) = [f for f in fs if f.card and f.experiment == experiment]
    return c


# ---------------------------------------------------------------------------------------------- one step


def _story(**bug):
    recs = [grad_record(s, s, seed=i, noise=NOISES[i]) for i, s in enumerate(LAYOUTS[:4])]
    recs.append(grad_record("ep2 + planted expert_dp", "ep2", mistake="expert_dp", factor=2.0, seed=9, **bug))
    return recs


def test_the_usual_story_is_said_with_the_factor():
    fs = gf.findings(_story())
    runs = _by_run(fs, gf.Q_GRAD)
    for s in LAYOUTS[:4]:
        assert runs[s].status == PASS and runs[s].claim.count("expected") == 2, runs[s].claim
    bug = runs["ep2 + planted expert_dp"]
    assert bug.status == FAIL
    assert "input gradient: expected" in bug.claim  # the mistake does not reach the input gradient
    assert "weight gradients: not explained by rounding — first departs at experts." in bug.claim
    assert "×2" in bug.claim, bug.claim
    card = _card(fs, gf.GRADIENTS)
    assert card.status == PASS and "4 of 4 correct run(s) inside" in card.claim
    assert "1 of 1 planted bug(s) not explained by rounding" in card.claim


def test_a_planted_bug_below_rounding_says_so():
    """Control of the story: the same planted run with factor 1 (a no-op, as expert_dp at EP 1) is inside the band,
    and the card says it is, rather than counting it caught."""
    recs = _story()
    recs[-1] = grad_record("ep1 + planted expert_dp", "ep1", mistake="expert_dp", factor=1.0, seed=9)
    fs = gf.findings(recs)
    assert _by_run(fs, gf.Q_GRAD)["ep1 + planted expert_dp"].status == PASS
    card = _card(fs, gf.GRADIENTS)
    assert card.status == MIXED and "0 of 1 planted bug(s)" in card.claim
    assert "inside the band although planted: ep1 + planted expert_dp" in card.claim


def test_a_correct_layout_far_from_the_truth_is_named():
    """Contradicting the story: a correct layout whose errors are 50x the others' is out of band and named; the control
    is the usual story, where it is not."""
    recs = _story()
    recs[1] = grad_record("ep2", "ep2", noise=50.0, seed=1)
    fs = gf.findings(recs)
    assert _by_run(fs, gf.Q_GRAD)["ep2"].status == FAIL
    card = _card(fs, gf.GRADIENTS)
    assert card.status == MIXED and "3 of 4 correct run(s) inside" in card.claim and "outside it: ep2" in card.claim
    assert "outside it" not in _card(gf.findings(_story()), gf.GRADIENTS).claim


def test_fp64_truths_and_reruns():
    recs = _story() + [grad_record("ep4 run 1", "ep4", run=1, seed=2, noise=NOISES[2])]
    fs = gf.findings(recs)
    (truth,) = [f for f in fs if f.question == gf.Q_TRUTH]
    assert truth.status == PASS and "within fp64 rounding" in truth.claim
    (rerun,) = [f for f in fs if f.question == gf.Q_RERUN]
    assert rerun.status == PASS and "bitwise equal in every tensor" in rerun.claim
    # the controls: a truth 1e-6 apart, a rerun whose fingerprints differ
    recs[1]["truth_sketch"]["experts"] = [0.5 * (1 + 1e-6)] * 4
    recs[-1]["fingerprints"] = {**recs[-1]["fingerprints"], "experts": "other"}
    fs = gf.findings(recs)
    (truth,) = [f for f in fs if f.question == gf.Q_TRUTH]
    assert truth.status == FAIL and "beyond fp64 rounding" in truth.claim and "ep2, experts" in truth.claim
    (rerun,) = [f for f in fs if f.question == gf.Q_RERUN]
    assert rerun.status == MIXED and "differs in 1 tensor(s) (experts)" in rerun.claim


def test_one_correct_run_is_not_judged():
    fs = gf.findings([grad_record("ep1", "ep1"), grad_record("ep2 + planted expert_dp", "ep2", mistake="expert_dp",
                                                             factor=2.0)])
    assert _card(fs, gf.GRADIENTS).status == NA
    assert "not judged" in _by_run(fs, gf.Q_GRAD)["ep1"].claim


def test_unreadable_and_unavailable_records_are_said():
    bad = grad_record("ep1", "ep1")
    del bad["stats"]
    fs = gf.findings([bad, {**HEADER, "experiment": gf.GRADIENTS, "available": False, "reason": "RuntimeError: x"}])
    assert [f.status for f in fs] == ["NOT MEASURED", NA]
    assert "did not run: RuntimeError: x" in fs[1].claim


RUNS = st.lists(st.tuples(st.sampled_from(LAYOUTS), st.booleans(), st.sampled_from([1.0, 1.0, 1.0, 3.0, 50.0]),
                          st.sampled_from([1.0, 2.0, 4.0])), min_size=2, max_size=6)


@SETTINGS
@given(RUNS)
def test_gradient_words_follow_the_rule_on_the_records(runs):
    """Whatever the run set (correct runs far from the truth, planted bugs below rounding): each run's status and
    words are the rule's verdict on its records, and the card counts what the runs' findings say."""
    recs = [grad_record(f"{lay} #{i}" + (" + planted expert_dp" if p else ""), lay, mistake="expert_dp" if p else "none",
                        noise=noise, factor=factor if p else 1.0, seed=i) for i, (lay, p, noise, factor) in enumerate(runs)]
    fs = gf.findings(recs)
    by = {r["run_name"]: r for r in recs}
    good = [n for n, r in by.items() if not gf.planted(r)]
    verdicts = {part: gf.judge({n: r["stats"] for n, r in by.items()}, good, pre, gf.reruns_of(by))
                for part, pre in gf.GRADIENT_PARTS.items()}
    words = _by_run(fs, gf.Q_GRAD)
    n_in = {True: 0, False: 0}
    for n, r in by.items():
        vs = [verdicts[p][n] for p in gf.GRADIENT_PARTS]
        claim = words[n].claim
        judged = [v for v in vs if v.judged]
        out = any(not v.in_band for v in judged)
        # a departure measured in one part is a departure; otherwise a part without a band leaves the run unjudged
        expect = FAIL if out else NA if len(judged) < len(vs) else PASS
        assert words[n].status == expect, claim
        assert ("not explained by rounding" in claim) == out, claim
        assert ("not judged" in claim) == (len(judged) < len(vs)), claim
        for p, v in zip(gf.GRADIENT_PARTS, vs):
            if v.judged and not v.in_band:
                assert f"{p}: not explained by rounding — first departs at {v.first.words()}" in claim
        n_in[gf.planted(r)] += expect == PASS
    card = _card(fs, gf.GRADIENTS)
    assert f"{n_in[False]} of {len(good)} correct run(s) inside" in card.claim, card.claim
    # each run against the first correct run: its pair's status follows both runs' findings
    if good:
        first = by[good[0]]
        recs2 = [dict(r, pair={"with": None, "first": True} if r is first else
                      {"with": first["run_name"], "gaps": {g: rule.pair_gap([1.0], [1.0]).asdict() for g in SIZES}})
                 for r in recs]
        fs2 = gf.findings(recs2)
        status = {n: f.status for n, f in _by_run(fs2, gf.Q_GRAD).items()}
        for n, f in _by_run(fs2, gf.Q_PAIR).items():
            pair = (status[n], status[first["run_name"]])
            assert f.status == (FAIL if FAIL in pair else NA if NA in pair else PASS), (pair, f.claim)


def _paired_story():
    first = ("ep1", 0, NOISES[0])
    recs = [grad_record(s, s, seed=i, noise=NOISES[i], pair_with="first" if i == 0 else first)
            for i, s in enumerate(LAYOUTS[:4])]
    recs.append(grad_record("ep2 + planted expert_dp", "ep2", mistake="expert_dp", factor=2.0, seed=9,
                            pair_with=first))
    return recs


def test_each_run_against_the_first_gets_its_gap_and_the_tolerance_a_test_needs():
    """The usual story: every correct layout against ep1 expected, with the gap the records hold (each tensor's
    assert_close as the rule derives it from the two runs' tensors); the planted bug's pair not explained by rounding,
    naming the planted run; no pair finding for the first run itself."""
    recs = _paired_story()
    pairs = _by_run(gf.findings(recs), gf.Q_PAIR)
    assert set(pairs) == {"ep2", "ep4", "tp2,ep2,sp", "ep2 + planted expert_dp"}
    for s in ("ep2", "ep4", "tp2,ep2,sp"):
        f = pairs[s]
        assert f.status == PASS and f.claim.startswith(f"{s} vs ep1: expected"), f.claim
        rec = next(r for r in recs if r["run_name"] == s)
        for g in SIZES:
            assert f"{gf.PAIR_GROUPS[g]}: {rule.Tolerance(**rec['pair']['gaps'][g]).words()}" in f.claim
        first = f.evidence.counts[0]  # what a comparison of two reports shows: the expert gradients' bits
        assert (first.n, first.of) == (rec["pair"]["gaps"]["experts"]["differ"], rec["pair"]["gaps"]["experts"]["n"])
        assert first.what == f"expert-gradient elements differing, {s} vs ep1"
    bug = pairs["ep2 + planted expert_dp"]
    assert bug.status == FAIL and "not explained by rounding — ep2 + planted expert_dp departs" in bug.claim
    # the expert gradients of the planted run are twice the truth: its gap to ep1 there is far wider than a layout's
    gap = lambda f: float(f.claim.split("expert gradients: ")[1].split("max ")[1].split(" ULP")[0])  # noqa: E731
    assert gap(bug) > 10 * max(gap(pairs[s]) for s in ("ep2", "ep4", "tp2,ep2,sp"))


def test_a_pair_whose_first_run_departs_names_it_and_one_without_a_pair_says_why():
    """Contradicting the story: the first run itself far from the truth — every pair with it is not explained by
    rounding, naming it, though the other run is in band; a run with no pair measured (a resumed report) says why."""
    recs = _paired_story()
    recs[0] = grad_record("ep1", "ep1", seed=0, noise=50.0, pair_with="first")
    recs[2]["pair"] = {"with": None, "reason": "no correct run of this layer was measured before it"}
    pairs = _by_run(gf.findings(recs), gf.Q_PAIR)
    assert pairs["ep2"].status == FAIL and "— ep1 departs from the truth" in pairs["ep2"].claim
    assert pairs["ep4"].status == NA and "no gap to another run measured — no correct run" in pairs["ep4"].claim


def test_the_gap_of_fp32_gradients_is_counted_in_bf16_ulps_of_b():
    """Main gradients are fp32: a gap below bf16's spacing is still a gap (counted, in fractions of a bf16 ULP);
    bf16 values keep the count of bf16 values between them. The control: equal tensors have no gap."""
    b = np.array([1.0, 0.5, -2.0], dtype=np.float32).astype(np.float64)
    a = b + np.array([2.0 ** -20, 0.0, 0.0])
    t = rule.pair_gap(a, b)
    assert t.differ == 1 and 0 < t.max_ulp < 1 and t.max_ulp == pytest.approx(2.0 ** -20 / 2.0 ** -7)
    bf = rule.pair_gap(np.array([1.0, 1.0078125]), np.array([1.0, 1.0]))  # 1 + 2**-7: the next bf16 value
    assert bf.differ == 1 and bf.max_ulp == 1.0
    assert rule.pair_gap(b, b).differ == 0


# ---------------------------------------------------------------------------------------------- K steps


def _trajectory_story(K=4, bug=None, odd=None):
    recs = [traj_record(s, s, [(NOISES[i], 1.0)] * K, seed=i) for i, s in enumerate(LAYOUTS[:4])]
    recs.append(traj_record("ep2 + planted expert_dp", "ep2", bug or [(1.0, 2.0)] * K, mistake="expert_dp", seed=9))
    if odd:
        recs[1] = traj_record("ep2", "ep2", odd, seed=1)
    return recs


def test_trajectory_story_and_a_bug_in_band_at_some_steps():
    fs = gf.findings(_trajectory_story())
    runs = _by_run(fs, gf.Q_TRAIN)
    assert all("at every one of its 4 steps" in runs[s].claim for s in LAYOUTS[:4])
    bug = runs["ep2 + planted expert_dp"]
    assert bug.status == FAIL and "leaves the band at step 1 of 4" in bug.claim and "×2" in bug.claim
    assert "out of band at step(s) 1–4" in bug.claim
    # contradicting the story: the bug below rounding at steps 1-2, out at 3-4 (first departure said at step 3)
    fs = gf.findings(_trajectory_story(bug=[(1.0, 1.0), (1.0, 1.0), (1.0, 2.0), (1.0, 2.0)]))
    bug = _by_run(fs, gf.Q_TRAIN)["ep2 + planted expert_dp"]
    assert "leaves the band at step 3 of 4" in bug.claim and "out of band at step(s) 3–4" in bug.claim
    # ... and a correct layout far from the truth at step 2 only
    fs = gf.findings(_trajectory_story(odd=[(1.0, 1.0), (50.0, 1.0), (1.0, 1.0), (1.0, 1.0)]))
    odd = _by_run(fs, gf.Q_TRAIN)["ep2"]
    assert odd.status == FAIL and "leaves the band at step 2 of 4" in odd.claim and "step(s) 2 (" in odd.claim
    card = _card(fs, gf.TRAJECTORY)
    assert card.status == MIXED and "outside it: ep2" in card.claim


STEPS = st.lists(st.tuples(st.sampled_from([1.0, 1.0, 1.0, 50.0]), st.sampled_from([1.0, 1.0, 2.0])),
                 min_size=3, max_size=3)


@TRAJECTORY_SETTINGS
@given(st.lists(st.tuples(st.sampled_from(LAYOUTS), st.booleans(), STEPS), min_size=3, max_size=5))
def test_trajectory_words_follow_the_rule_step_by_step(runs):
    recs = [traj_record(f"{lay} #{i}" + (" + planted expert_dp" if p else ""), lay, steps,
                        mistake="expert_dp" if p else "none", seed=i) for i, (lay, p, steps) in enumerate(runs)]
    fs = gf.findings(recs)
    by = {r["run_name"]: r for r in recs}
    per_step = gf.step_verdicts(by)
    words = _by_run(fs, gf.Q_TRAIN)
    for n in by:
        claim = words[n].claim
        out = [t + 1 for t in range(3) if not all(per_step[t][p][n].in_band for p in gf.TRAJECTORY_PARTS)]
        if not out and not all(per_step[t][p][n].judged for t in range(3) for p in gf.TRAJECTORY_PARTS):
            assert words[n].status == NA and "not judged" in claim, claim
        elif out:
            assert words[n].status == FAIL and f"leaves the band at step {out[0]} of 3" in claim, claim
        else:
            assert words[n].status == PASS and "at every one of its 3 steps" in claim, claim


# ---------------------------------------------------------------------------------------------- parameters


def test_params_checks_with_their_controls():
    assert set(MISTAKE_NAMES) == set(MISTAKES) - {"none"}
    p = OracleTrainingParams()
    assert [(lay.spec(), run, m) for lay, run, m in p.runs()][-2:] == [("ep4", 1, "none"), ("ep2", 0, "expert_dp")]
    for bad, words in (({"layouts": ["ep1"]}, "at least two"), ({"mistakes": ["bogus"]}, "must be among"),
                       ({"layouts": ["ep1", "tp2,ep2"]}, "sequence parallelism"),
                       ({"reruns": ["ep8"]}, "not among the layouts"), ({"steps": 0}, "steps")):
        with pytest.raises(ValueError, match=words):
            OracleTrainingParams.from_dict(bad)
    OracleTrainingParams.from_dict({"layouts": ["ep1", "tp2,ep2,sp"], "reruns": []})  # the control: accepted


# ---------------------------------------------------------------------------------------------- figures


def _palette_or_grey(fig) -> list:
    from matplotlib.colors import to_rgb

    from moe_lab.reporting import plots

    bad = []
    for ax in fig.get_axes():
        for line in ax.get_lines():
            rgb = to_rgb(line.get_color())
            if not (max(rgb) - min(rgb) < 0.02 or any(np.allclose(rgb, to_rgb(c), atol=0.01) for c in plots.PALETTE)):
                bad.append(line.get_color())
    return bad


def test_figures_draw_the_records_and_say_their_numbers():
    import matplotlib

    matplotlib.use("Agg")
    import matplotlib.pyplot as plt

    from moe_lab.questions.oracle import gradients_figures as fig_mod
    from moe_lab.reporting import plots

    recs = _story() + _trajectory_story()
    try:
        g = fig_mod.gradient_errors(recs)
        alt = plots.description_of(g)
        bug_p99 = recs[4]["stats"]["experts.all"]["p99"]
        assert f"{bug_p99:.3g}" in alt and "5 runs (1 with a planted bug)" in alt, alt
        t = fig_mod.trajectory_errors(recs)
        alt_t = plots.description_of(t)
        assert "(1–4)" in alt_t and "planted (step 1 to 4)" in alt_t, alt_t
        assert _palette_or_grey(g) == [] and _palette_or_grey(t) == []
        # the controls: no records says so; an off-palette line is seen
        assert "nothing to draw" in plots.description_of(fig_mod.gradient_errors([]))
        t.get_axes()[0].plot([1], [1], color="#ff00ff")
        assert _palette_or_grey(t) == ["#ff00ff"]
    finally:
        plt.close("all")


def test_params_are_read_where_the_profile_holds_them():
    """The registered class's, an `oracle.training` object of the oracle's parameters, or the defaults."""
    from types import SimpleNamespace

    from moe_lab.questions.oracle.gradients import params_of

    class Oracle(SimpleNamespace):
        KEY = "oracle"

    def config(*sections):
        def params(cls):
            raise KeyError(cls.__name__)
        return SimpleNamespace(params=params, questions={type(s): s for s in sections})

    assert params_of(config()) == OracleTrainingParams()
    assert params_of(config(Oracle(training={"steps": 3}))).steps == 3
    typed = OracleTrainingParams(steps=2)
    assert params_of(config(Oracle(training=typed))) is typed
    with pytest.raises(ValueError, match="oracle.training"):  # the control: a bad value is refused by name
        params_of(config(Oracle(training={"steps": 0})))


def test_two_reports_hold_each_runs_gradients_and_steps_side_by_side_with_a_magnitude():
    """`moe-lab compare` of two gradient/trajectory stories: each run's row carries its expert gradients' p99 error
    to fp64 on both sides, equal where the records are; the planted bug made four times worse on one side falls
    outside the factor (the control); the cards over several runs carry none."""
    from moe_lab.reporting.compare import compare

    a = _story() + _trajectory_story()
    b = _story() + _trajectory_story()
    rows = [r for r in compare(a, b).rows if r["magnitude"] in (cmp08.GRADIENT_P99, cmp08.LAST_STEP_P99)]
    assert len(rows) == 2 * 5 and all(r["magnitude_a"] == r["magnitude_b"] and r["within_factor"] for r in rows)
    worse = _story() + _trajectory_story(bug=[(1.0, 8.0)] * 4)
    worse[-6] = grad_record("ep2 + planted expert_dp", "ep2", mistake="expert_dp", factor=8.0, seed=9)
    out = {(r["magnitude"], r["case"]): r for r in compare(a, worse).rows if r["magnitude"]}
    bug = [r for (m, c), r in out.items() if "planted" in c and m in (cmp08.GRADIENT_P99, cmp08.LAST_STEP_P99)]
    assert len(bug) == 2 and not any(r["within_factor"] for r in bug), bug
