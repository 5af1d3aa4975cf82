"""Notebook 08's gradients and training on 4 gloo engines: the fp64 truth (the same stack from the same bf16 weights
and batches, upcast) is the same at every layout to fp64 rounding; every correct layout's one-step input and weight
gradients are what rounding gives (inside the band of the others); expert gradients divided by the expert-DP size
instead of DP are "not explained by rounding", off by the factor DP / expert-DP (×2 at EP 2, ×4 at EP 4), and a no-op
where the two sizes agree (EP 1: the control); over K training steps every correct layout stays inside the band of
the others at every step while the planted bug leaves it from step 1 (and at EP 1 it does not)."""

import pytest

from moe_lab import profiles
from moe_lab.experiments import protocol
from moe_lab.questions.oracle import gradients, gradients_findings as gf, rule, trajectory
from moe_lab.questions.oracle.gradients_params import OracleTrainingParams

pytestmark = pytest.mark.cluster

DEFAULT = OracleTrainingParams()
PARAMS = OracleTrainingParams(mistake_layouts=("ep1", "ep2", "ep4"))
"""The default runs, and the planted bug also at EP 1 (where it changes nothing: the control) and EP 4."""


@pytest.fixture(scope="module")
def runs(cpu_cluster):
    P = profiles.load("cpu")
    out = {}
    for mod in (gradients, trajectory):
        recs = protocol.run(mod, P, cluster=cpu_cluster, cases=mod.cases(P, PARAMS))
        assert all(r["available"] for r in recs), [r.get("reason") for r in recs]
        out[mod.NAME] = {gf.name_of(r): r for r in recs}
    default = {gradients.run_name(lay.spec(), run, m) for lay, run, m in DEFAULT.runs()}
    for name, by in out.items():  # what the default runs cost on this cluster (the notebook's share)
        walls = [by[n]["case_wall_s"] for n in default]
        print(f"{name}: {len(walls)} default case(s), {sum(walls):.1f} s in all (each {min(walls):.2f}-"
              f"{max(walls):.2f} s)")
    return out


def _rel(sa, sb, nb):
    d = (sum((x - y) ** 2 for x, y in zip(sa, sb)) / len(sa)) ** 0.5
    return d / nb


def test_fp64_truth_is_the_same_at_every_layout(runs):
    g, t = runs[gradients.NAME], runs[trajectory.NAME]
    ref = g["ep1"]
    assert set(ref["truth_sketch"]) == set(gradients.GROUPS)
    for n, r in g.items():
        for grp in gradients.GROUPS:
            assert _rel(r["truth_sketch"][grp], ref["truth_sketch"][grp], ref["truth_norm"][grp]) <= gf.FP64_AGREE, \
                (n, grp)
    tref = t["ep1"]["steps_compared"]
    for n, r in t.items():
        for k, s in enumerate(r["steps_compared"]):
            for grp, sk in s["truth_sketch"].items():
                assert _rel(sk, tref[k]["truth_sketch"][grp], tref[k]["truth_norm"][grp]) <= gf.FP64_AGREE, (n, k, grp)
    # the control: the same measure tells the truth's weights after step 1 from those after step K
    first, last = tref[0], tref[-1]
    assert _rel(last["truth_sketch"]["weights.experts"], first["truth_sketch"]["weights.experts"],
                first["truth_norm"]["weights.experts"]) > 1e6 * gf.FP64_AGREE
    fs = gf.findings(list(g.values()) + list(t.values()))
    truth = [f for f in fs if f.question == gf.Q_TRUTH]
    assert len(truth) == 2 and all(f.status == "PASS" for f in truth), [f.claim for f in truth]


def _verdicts(by: dict, prefixes) -> dict:
    good = [n for n, r in by.items() if not gf.planted(r)]
    return gf.judge({n: r["stats"] for n, r in by.items()}, good, prefixes, gf.reruns_of(by))


def test_every_correct_layout_gradient_is_expected_and_the_planted_bug_is_not(runs):
    by = runs[gradients.NAME]
    correct = [n for n, r in by.items() if not gf.planted(r)]
    assert set(correct) == {"ep1", "ep2", "ep4", "tp2,ep2,sp", "tp2,ep2,etp1,sp", "tp2,ep1,sp", "ep4 run 1"}
    for part, prefixes in gf.GRADIENT_PARTS.items():
        v = _verdicts(by, prefixes)
        for n in correct:
            assert v[n].judged and v[n].in_band, (part, n, v[n].first and v[n].first.words())
        for n in ("ep2 + planted expert_dp", "ep4 + planted expert_dp"):
            if part == "input gradient":  # the mistake is in the reduce of the expert weight gradients only
                assert v[n].in_band, (n, v[n].first.words())
            else:
                assert not v[n].in_band and v[n].first.group.startswith("experts."), n
                assert v[n].excess() > 10, (n, v[n].excess())
    for n, factor in (("ep2 + planted expert_dp", 2.0), ("ep4 + planted expert_dp", 4.0)):
        r = by[n]
        assert r["dp"] / r["expert_dp"] == factor
        assert r["scale"]["experts.all"] == pytest.approx(factor, rel=1e-2), n
        assert r["scale"]["router.all"] == pytest.approx(1.0, rel=1e-2), n  # the router's reduce is not touched
        print(f"{n}: expert gradients x{r['scale']['experts.all']:.4f} the truth's, median error "
              f"{r['stats']['experts.all']['median']:.0f} ULP; correct ep2's {by['ep2']['stats']['experts.all']['median']:.2f}")
    # the control: where expert-DP equals DP the same mistake changes nothing — bitwise the correct run, in band
    no_op = by["ep1 + planted expert_dp"]
    assert no_op["fingerprints"] == by["ep1"]["fingerprints"]
    assert _verdicts(by, gf.GRADIENT_PARTS["weight gradients"])["ep1 + planted expert_dp"].in_band
    words = {f.subject.get("run"): f for f in gf.findings(list(by.values())) if f.question == gf.Q_GRAD}
    assert "×2" in words["ep2 + planted expert_dp"].claim and "×4" in words["ep4 + planted expert_dp"].claim
    assert words["ep1 + planted expert_dp"].status == "PASS"  # said to be inside the band, not pretended caught
    card = next(f for f in gf.findings(list(by.values())) if f.card and f.experiment == gradients.NAME)
    assert "7 of 7 correct run(s) inside" in card.claim and "2 of 3 planted bug(s)" in card.claim, card.claim
    assert "inside the band although planted: ep1 + planted expert_dp" in card.claim


def test_each_run_is_paired_with_the_first_layout_with_the_gap_a_test_needs(runs):
    """On the engines each run is paired with the first correct run (ep1): a correct layout's pair is expected, with
    the gap its tensors measured and the assert_close the rule derives from it; the planted bug's pair is not
    explained by rounding, its expert-gradient gap far wider than any layout's. ep1 itself has no pair; the control
    of the gap is the planted bug where it is a no-op (EP 1): no element differs from ep1."""
    by = runs[gradients.NAME]
    assert by["ep1"]["pair"].get("first") and by["ep1"]["pair"]["with"] is None
    pairs = {f.subject.get("run"): f for f in gf.findings(list(by.values())) if f.question == gf.Q_PAIR}
    for n, r in by.items():
        if n == "ep1":
            continue
        assert r["pair"]["with"] == "ep1", (n, r["pair"])
        assert set(r["pair"]["gaps"]) == set(gradients.GROUPS)
    for n in ("ep2", "ep4", "tp2,ep2,sp", "tp2,ep2,etp1,sp", "tp2,ep1,sp", "ep4 run 1"):
        assert pairs[n].status == "PASS" and "expected" in pairs[n].claim, pairs[n].claim
        for g, t in by[n]["pair"]["gaps"].items():
            assert t["atol"] >= 0 and t["rtol"] >= 2.0 ** -7 or t["differ"] == 0, (n, g, t)
    for n in ("ep2 + planted expert_dp", "ep4 + planted expert_dp"):
        assert pairs[n].status == "FAIL" and f"{n} departs" in pairs[n].claim, pairs[n].claim
        bug = by[n]["pair"]["gaps"]["experts"]["max_abs"]
        assert bug > 10 * max(by[c]["pair"]["gaps"]["experts"]["max_abs"] for c in ("ep2", "ep4", "tp2,ep2,sp"))
    assert pairs["ep1 + planted expert_dp"].status == "PASS"  # the no-op: bitwise ep1, no gap at all
    assert all(t["differ"] == 0 for t in by["ep1 + planted expert_dp"]["pair"]["gaps"].values())


def test_reruns_are_bitwise_equal_and_layouts_are_not(runs):
    by = runs[gradients.NAME]
    assert by["ep4 run 1"]["fingerprints"] == by["ep4"]["fingerprints"]
    assert by["ep2"]["fingerprints"]["experts"] != by["ep4"]["fingerprints"]["experts"]  # the control


def test_trajectory_correct_layouts_stay_in_band_and_the_planted_bug_leaves_it(runs):
    by = runs[trajectory.NAME]
    K = PARAMS.steps
    assert all(len(r["steps_compared"]) == K for r in by.values())
    per_step = gf.step_verdicts(by)
    correct = [n for n, r in by.items() if not gf.planted(r)]
    for t in range(K):
        for part in gf.TRAJECTORY_PARTS:
            for n in correct:
                v = per_step[t][part][n]
                assert v.judged and v.in_band, (t + 1, part, n, v.first and v.first.words())
    for n in ("ep2 + planted expert_dp", "ep4 + planted expert_dp"):
        out = [t + 1 for t in range(K) if not all(per_step[t][p][n].in_band for p in gf.TRAJECTORY_PARTS)]
        assert out and out[0] == 1, (n, out)
        grads_out = [t + 1 for t in range(K) if not per_step[t]["gradients"][n].in_band]
        assert grads_out == list(range(1, K + 1)), (n, grads_out)
        print(f"{n}: out of band at steps {out}; step 1 "
              f"{per_step[0]['gradients'][n].first.words()} ({per_step[0]['gradients'][n].excess():.0f}x its limit)")
    # the control: at EP 1 the mistake is a no-op, inside the band at every step
    assert all(per_step[t][p]["ep1 + planted expert_dp"].in_band for t in range(K) for p in gf.TRAJECTORY_PARTS)
    fs = {f.subject.get("run"): f for f in gf.findings(list(by.values())) if f.question == gf.Q_TRAIN}
    assert fs["ep2 + planted expert_dp"].claim.split(": ", 1)[1].startswith(f"leaves the band at step 1 of {K}")
    assert all(f"at every one of its {K} steps" in fs[n].claim for n in correct)
    assert rule.ALL == "all"
