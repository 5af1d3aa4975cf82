"""Notebook 08's rule (`moe_lab.questions.oracle.rule`), its public judge (`moe_lab.oracle.judge`) and its findings on
constructed tensors and records: a pure reordering of sums is expected, a bias of a few ULP on some tokens is not,
a flip at a near-tie is expected and one at a large margin is not, each check beside a control that shows it can
fail; the findings' words follow the rule's verdicts on generated records (hypothesis), the records that contradict
the usual story included (a correct-looking layout out of band, a planted bug in band)."""

from __future__ import annotations

import numpy as np
import pytest
import torch
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from moe_lab import oracle
from moe_lab.findings.model import FAIL, MIXED, PASS
from moe_lab.questions.oracle import findings as found
from moe_lab.questions.oracle import rule


def _product(seed: int = 0, tokens: int = 256, k: int = 64, n: int = 128):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(tokens, k, generator=g).bfloat16()
    w = (torch.randn(k, n, generator=g) * 0.1).bfloat16()
    return x, w, x.double() @ w.double()


def _summed(x, w, order, chunk: int = 16):
    """x @ w as a bf16 sum of chunk partial products, in `order`: a reordering of the same sums."""
    acc = torch.zeros(x.shape[0], w.shape[1])
    for c in order:
        part = (x[:, c * chunk:(c + 1) * chunk].float() @ w[c * chunk:(c + 1) * chunk].float()).bfloat16().float()
        acc = (acc + part).bfloat16().float()
    return acc.bfloat16()


ORDERS = ([0, 1, 2, 3], [3, 2, 1, 0], [1, 3, 0, 2], [2, 0, 3, 1])


@pytest.fixture(scope="module")
def reorderings():
    x, w, truth = _product()
    return truth, [_summed(x, w, o) for o in ORDERS]


def _plus_ulps(run: torch.Tensor, truth: torch.Tensor, ulps: float, rows: slice) -> torch.Tensor:
    out = run.double().clone()
    step = torch.from_numpy(rule.bf16_ulp(truth[rows].numpy()).reshape(truth[rows].shape))
    out[rows] += ulps * step
    return out.bfloat16()


def test_bf16_ulp_and_rounding_by_hand():
    assert rule.bf16_ulp(np.array([1.0, 1.5, 1.99, 2.0, 0.75, -3.0])).tolist() == [2 ** -7, 2 ** -7, 2 ** -7, 2 ** -6,
                                                                                  2 ** -8, 2 ** -6]
    # 1 + 2^-8 is a tie between 1 and 1 + 2^-7: to even (1); just above it rounds up
    assert rule.round_bf16(np.array([1 + 2 ** -8, 1 + 2 ** -8 + 2 ** -20])).tolist() == [1.0, 1 + 2 ** -7]
    ulp, rel = rule.errors(np.array([1.0 + 2 ** -7, 2.0]), np.array([1.0, 2.0]))
    assert ulp.tolist() == [1.0, 0.0] and rel.tolist() == [2 ** -7, 0.0]
    assert rule.bf16_ordered(np.array([1.0, 1 + 2 ** -7, -0.0, 0.0])).tolist()[:2] == [0x3F80, 0x3F81]


def test_a_pure_reordering_of_sums_is_expected_and_a_bias_on_some_tokens_is_not(reorderings):
    truth, runs = reorderings
    labels = np.repeat(np.arange(truth.shape[0]) // 32, truth.shape[1])  # 8 groups of 32 tokens
    stats = {f"order {i}": rule.error_stats(r, truth, labels) for i, r in enumerate(runs)}
    verdicts = rule.judge_runs(stats)
    assert all(v.in_band and v.judged for v in verdicts.values()), [v.departures for v in verdicts.values()]
    # the control: +2 ULP on the first 32 tokens of one reordering — out of band, in its own group first
    stats["biased"] = rule.error_stats(_plus_ulps(runs[0], truth, 2, slice(0, 32)), truth, labels)
    v = rule.judge_runs(stats, known_good=[f"order {i}" for i in range(4)])["biased"]
    assert not v.in_band and any(d.group == "0" for d in v.departures)
    assert all(d.group in ("all", "0") for d in v.departures)  # the other tokens' groups stay in band


def test_a_bias_is_judged_in_standard_errors_beside_its_control():
    """A signed mean of +1 ULP over many elements with a small spread is a bias; the same spread without the shift
    is not (the control)."""
    rng = np.random.default_rng(1)
    truth = rng.uniform(1.0, 1.9, 20000)
    runs = {f"r{i}": rule.round_bf16(truth + rng.normal(0, 0.3, truth.size) * 2 ** -7) for i in range(4)}
    stats = {k: rule.error_stats(v, truth) for k, v in runs.items()}
    shifted = rule.round_bf16(truth + (rng.normal(0, 0.3, truth.size) + 1.0) * 2 ** -7)
    stats["shifted"] = rule.error_stats(shifted, truth)
    v = rule.judge_runs(stats, known_good=list(runs))
    assert all(v[k].in_band for k in runs)
    assert not v["shifted"].in_band and any(d.statistic in (rule.BIAS, "median") for d in v["shifted"].departures)


def test_a_flip_at_a_near_tie_is_expected_and_one_at_a_large_margin_is_not(reorderings):
    truth, runs = reorderings
    stats = {f"r{i}": {**rule.error_stats(r, truth, prefix="router.logits/")} for i, r in enumerate(runs)}
    limit = rule.flip_limit(stats, "router.logits/all")
    assert limit is not None and limit > 0
    near = rule.judge_runs(stats, flipped_margins={"r0": [limit * 0.5]})
    far = rule.judge_runs(stats, flipped_margins={"r0": [limit * 4]})
    assert near["r0"].in_band
    assert not far["r0"].in_band and far["r0"].first.group == rule.ROUTING and far["r0"].first.statistic == rule.FLIP


def test_the_tolerance_a_pair_needs_passes_on_the_pair_and_none_does_not(reorderings):
    truth, runs = reorderings
    a, b = runs[0], runs[1]
    t = rule.pair_gap(a, b)
    assert 0 < t.differ < t.n and t.max_ulp >= t.p999_ulp > 0
    torch.testing.assert_close(a, b, atol=t.atol, rtol=t.rtol)
    with pytest.raises(AssertionError):  # the control: the tolerance is needed
        torch.testing.assert_close(a, b, atol=0, rtol=0)
    same = rule.pair_gap(a, a.clone())
    assert same.differ == 0 and same.atol == 0 and "0 of 32,768" in same.words()


def test_judge_on_saved_tensors_and_arrays(reorderings):
    truth, runs = reorderings
    v = oracle.judge(runs[0], runs[1], truth=truth, known_good=runs[2:])
    assert v.expected and v.judged and "expected" in str(v) and "assert_close" in str(v)
    bad = _plus_ulps(runs[1], truth, 3, slice(0, 64))
    v = oracle.judge(runs[0], bad, truth=truth, known_good=runs[2:])
    assert not v.expected and v.farther == ("b",) and "not explained by rounding" in str(v)
    # numpy arrays, no truth: the known-good runs stand in for it
    np_runs = [r.float().numpy() for r in runs]
    assert oracle.judge(np_runs[0], np_runs[1], known_good=np_runs[1:]).expected
    assert not oracle.judge(np_runs[0], bad.float().numpy(), known_good=np_runs[1:]).expected


@pytest.mark.parametrize("args, kw, says", [
    (lambda r, t: (r[0], r[1][:10]), lambda r, t: {"truth": t}, "one shape"),
    (lambda r, t: (r[0], r[1].float()), lambda r, t: {"truth": t}, "torch.float32 tensor"),
    (lambda r, t: (r[0].float().numpy() + 1e-3, r[1].float().numpy()), lambda r, t: {"truth": t}, "not bf16 values"),
    (lambda r, t: (r[0], r[1]), lambda r, t: {"truth": t[:5]}, "truth has shape"),
    (lambda r, t: (r[0], r[1]), lambda r, t: {"known_good": (r[2],)}, "at least two known-good"),
    (lambda r, t: (r[0], r[1]), lambda r, t: {"known_good": (r[2][:3], r[3])}, "known_good[0] has shape"),
])
def test_judge_refuses_bad_input_by_name(reorderings, args, kw, says):
    truth, runs = reorderings
    with pytest.raises(ValueError, match=says.replace("[", r"\[").replace("]", r"\]")):
        oracle.judge(*args(runs, truth), **kw(runs, truth))


# ---------------------------------------------------------------------------------------------- findings


HEADER = {"kind": "oracle", "experiment": "oracle", "notebook": "08", "dispatcher": "allgather",
          "megatron_core": "0.16.1", "world": 4, "backend": "gloo", "device": "cpu", "case_key": "k1",
          "config": {"hidden": 128, "num_experts": 8, "topk": 4, "ffn_hidden": 256, "seq_len": 256, "dtype": "bf16"}}
LAYOUTS = ("ep1", "ep4", "tp2,ep2")


def _record(truth, runs_by_label: dict, faults: dict[str, str], flips: dict | None = None,
            counts: dict | None = None) -> dict:
    """A record as the experiment writes it, from constructed outputs: label → (layout, fault, trial, output);
    `counts`: label → tokens routed to another number of experts than the truth's (absent: not counted, as in a
    record written before the count; given: every other run counts 0)."""
    runs = []
    for label, (layout, fault, trial, out) in runs_by_label.items():
        runs.append({"label": label, "dispatcher": "allgather", "layout": layout, "fault": fault, "trial": trial,
                     "stats": {**rule.error_stats(rule.round_bf16(truth[:8].numpy()), truth[:8],
                                                  prefix="router.logits/"),
                               **rule.error_stats(out, truth, prefix="out/")},
                     "flips": {"tokens": 256, "flipped": len((flips or {}).get(label, [])),
                               "flipped_margin_ulp": list((flips or {}).get(label, [])),
                               "margin_ulp_quantiles": {"min": 0.5, "p1": 2.0, "median": 100.0},
                               "margin_ulp_below": {},
                               **({"count_changed": counts.get(label, 0)} if counts is not None else {})}})
    outs = {k: v[3] for k, v in runs_by_label.items()}
    ref = next(k for k, v in runs_by_label.items() if v[0] == "ep1" and v[2] == 1)
    pairs = [{"a": ref, "b": k, **rule.pair_gap(outs[ref], outs[k]).asdict()} for k in outs if k != ref]
    return {**HEADER, "reference": "ep1", "layouts": list(LAYOUTS), "dispatchers": ["allgather"],
            "faults": list(faults), "trials": 2, "runs": runs, "pairs": pairs, "fp64_layouts": {}, "truth": {}}


def _story(reorderings, *, layout_bias: dict | None = None, fault_ulps: dict | None = None, flips=None,
           counts=None):
    truth, outs = reorderings
    runs = {}
    for i, lay in enumerate(LAYOUTS):
        for t in (1, 2):
            out = outs[i]
            if (layout_bias or {}).get(lay):
                out = _plus_ulps(out, truth, layout_bias[lay], slice(0, 128))
            runs[f"allgather {lay} run {t}"] = (lay, None, t, out)
    faults = {"swap_experts": "ep4", "scale_expert": "ep4"}
    for f, ulps in (fault_ulps or {"swap_experts": 40, "scale_expert": 0}).items():
        runs[f"allgather ep4 + {f}"] = ("ep4", f, 1, _plus_ulps(outs[1], truth, ulps, slice(0, 128)) if ulps
                                        else outs[3])
    return _record(truth, runs, faults, flips, counts)


def test_the_usual_story_expected_with_its_tolerance_and_the_faults_caught(reorderings):
    fs = found.findings([_story(reorderings)])
    card = next(f for f in fs if f.question == found.QUESTION)
    assert card.status == PASS and card.short.startswith("yes") and card.card
    assert "swap_experts" in card.claim and "not explained by rounding" in card.claim
    assert "below what rounding lets the oracle see" in card.claim
    tol = next(f for f in fs if f.question == found.TOLERANCE)
    assert "assert_close(a, b, atol=" in tol.claim and "ep4 vs ep1" in tol.claim


def test_a_correct_looking_layout_out_of_band_is_named(reorderings):
    fs = found.findings([_story(reorderings, layout_bias={"tp2,ep2": 3})])
    card = next(f for f in fs if f.question == found.QUESTION)
    assert card.status == FAIL and "tp2,ep2" in card.short and "not explained by rounding: tp2,ep2" in card.claim


def test_a_planted_bug_in_band_is_said_not_caught(reorderings):
    fs = found.findings([_story(reorderings, fault_ulps={"swap_experts": 0, "scale_expert": 0})])
    card = next(f for f in fs if f.question == found.QUESTION)
    assert card.status == MIXED and "NOT caught" in card.claim and "tells little" in card.claim


def test_a_flip_at_a_large_margin_on_a_layout_is_a_routing_departure(reorderings):
    rec = _story(reorderings, flips={"allgather ep4 run 1": [500.0]})
    fs = found.findings([rec])
    card = next(f for f in fs if f.question == found.QUESTION)
    flips = next(f for f in fs if f.question == found.FLIPS)
    assert card.status == FAIL and "routing" in card.claim and flips.status == FAIL and "500" in flips.claim
    ok = found.findings([_story(reorderings, flips={"allgather ep4 run 1": [0.1]})])  # the control: a near-tie
    assert next(f for f in ok if f.question == found.QUESTION).status == PASS


def test_a_fault_that_drops_tokens_at_near_ties_is_caught_by_the_count_and_not_without_it(reorderings):
    """Its outputs within the band and its flips at margins a rounding flip can have — what a capacity drop looked
    like on a 128-expert preset — the fault is caught by its tokens routed to fewer experts; the same record
    without counts (an older record) says it was not caught, as before."""
    near = {"allgather ep4 + swap_experts": [0.1, 0.2]}
    plain = {"fault_ulps": {"swap_experts": 0, "scale_expert": 0}, "flips": near}
    card = next(f for f in found.findings([_story(reorderings, counts={"allgather ep4 + swap_experts": 2}, **plain)])
                if f.question == found.QUESTION)
    assert card.status == PASS and "2 tokens routed to another number of experts" in card.claim
    assert "x its limit" not in card.claim.split("swap_experts")[1].split(";")[0]  # no ratio to a band of zero
    old = next(f for f in found.findings([_story(reorderings, **plain)]) if f.question == found.QUESTION)
    assert old.status == MIXED and "swap_experts: NOT caught" in old.claim


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(bias=st.dictionaries(st.sampled_from(LAYOUTS), st.sampled_from([0, 0, 1, 4])),
       swap=st.sampled_from([0, 2, 40]), dropped=st.sampled_from([None, 0, 3]),
       share_gib=st.sampled_from([None, 34.9, 19.9, 5.0, 0.05]))
def test_the_words_follow_the_rules_verdicts(reorderings, bias, swap, dropped, share_gib):
    """Whatever the runs measure, the card's status and words are the rule's verdicts run by run: a layout out of
    band is named (FAIL), a control in band is said not caught (MIXED), otherwise expected (PASS). A layer sized to
    the GPU (`memory`) is said with its width, and changes no verdict."""
    import dataclasses

    from moe_lab import profiles
    from moe_lab.questions.oracle import memory
    from moe_lab.questions.oracle.params import OracleParams

    counts = None if dropped is None else {"allgather ep4 + swap_experts": dropped}
    rec = _story(reorderings, layout_bias=bias, fault_ulps={"swap_experts": swap, "scale_expert": 0}, counts=counts)
    unsized = next(f for f in found.findings([rec]) if f.question == found.QUESTION)
    sizing = None
    if share_gib is not None:
        gpu = profiles.load("gpu")
        sizing = memory.size(gpu.layer, gpu.params(OracleParams), 4, share_gib)
        if sizing.words():
            rec["memory"] = dataclasses.asdict(sizing)
    verdicts = found.judged(rec)
    card = next(f for f in found.findings([rec]) if f.question == found.QUESTION)
    assert card.status == unsized.status and card.short == unsized.short
    if sizing is not None and sizing.ffn_hidden:
        assert f"sized to this GPU: expert ffn {sizing.ffn_hidden}, not the profile's 16384" in card.claim
        assert ("may run out of memory" in card.claim) == (sizing.sized_need_gib > share_gib)
    else:
        assert "sized to this GPU" not in card.claim and "may run out of memory" not in card.claim
    bad = sorted({r["layout"] for r in rec["runs"] if not r["fault"] and not verdicts[r["label"]].in_band})
    swap_caught = not verdicts["allgather ep4 + swap_experts"].in_band
    if bad:
        assert card.status == FAIL and all(lay in card.short for lay in bad)
    elif not swap_caught:
        assert card.status == MIXED and "swap_experts: NOT caught" in card.claim
    else:
        assert card.status == PASS and "expected" in card.claim
    # a planted bug is worded by what was measured, caught or not
    assert ("swap_experts" in card.claim) and (("not explained by rounding" in card.claim) or not swap_caught)


def test_bitwise_reruns_of_one_computation_are_no_band(reorderings):
    """Reruns that repeat the same bits have no spread to measure: a run held only to them is not judged; with a
    second distinct computation in its band it is (the control)."""
    truth, runs = reorderings
    stats = {"x run 1": rule.error_stats(runs[0], truth), "x run 2": rule.error_stats(runs[0].clone(), truth),
             "y": rule.error_stats(runs[1], truth)}
    assert not rule.judge_runs(stats, known_good=["x run 1", "x run 2"])["y"].judged
    stats["z"] = rule.error_stats(runs[2], truth)
    assert rule.judge_runs(stats, known_good=["x run 1", "x run 2", "z"])["y"].judged


def test_a_group_every_band_run_computes_alike_is_left_unjudged_not_flagged(reorderings):
    """Where the other correct runs are distinct computations of the whole but compute one group alike (e.g. a
    tensor only the judged layout reduces in another order), that group's band has no measured width: it is listed
    as unjudged, not flagged. The control: with a second computation of that group in the band it is judged, and a
    run off by a bias there is caught."""
    truth, runs = reorderings
    rows_a, rows_b = slice(0, 128), slice(128, 256)

    def mixed(for_a, for_b):  # rows 0-127 from one computation, 128-255 from another
        out = for_a.clone()
        out[rows_b] = for_b[rows_b]
        return out

    labels = np.repeat(np.array(["a"] * 128 + ["b"] * 128), truth.shape[1])  # per element, rows split in two
    st = lambda t: rule.error_stats(t, truth, labels)  # noqa: E731 - groups 'all', 'a', 'b'
    # band runs: group b from one computation (runs[0]) in each, group a from different ones
    stats = {"p": st(mixed(runs[1], runs[0])), "q": st(mixed(runs[2], runs[0])),
             "judged": st(mixed(runs[3], _plus_ulps(runs[0], truth, 0.3, rows_b)))}
    v = rule.judge_runs(stats, known_good=["p", "q"])["judged"]
    assert v.judged and "b" in v.unjudged_groups and not any(d.group == "b" for d in v.departures)
    stats["r"] = st(runs[3])  # group b computed another way: b now has a measured band
    v2 = rule.judge_runs(stats, known_good=["p", "q", "r"])["judged"]
    assert "b" not in v2.unjudged_groups
    stats["biased"] = st(mixed(runs[3], _plus_ulps(runs[0], truth, 3.0, rows_b)))
    assert any(d.group in ("b", "all") for d in rule.judge_runs(stats, known_good=["p", "q", "r"])["biased"].departures)


@pytest.mark.parametrize("argv, says", [
    (["--layouts", "ep1"], "at least two layouts"),
    (["--layouts", "ep1;ep3"], "layout 'ep3' on 4 ranks"),
    (["--faults", "bogus"], "each fault must be one of"),
    (["--reference", "ep2"], "oracle.reference"),
    (["--scale", "0.5"], "--scale needs --model"),
    (["--model", "qwen3-30b-a3b,deepseek-v3"], "one preset at a time"),
])
def test_the_oracle_command_refuses_bad_input_before_anything_starts(argv, says, capsys):
    """One line, exit 2, no engine: `Cluster` is never entered (the control: a good command line reaches it)."""
    from unittest import mock

    from moe_lab.cli.main import main

    with mock.patch("moe_lab.controller.cluster.Cluster.__enter__", side_effect=AssertionError("started")) as enter:
        try:
            rc = main(["oracle", "--device", "cpu", *argv])
        except SystemExit as e:
            rc = e.code
        assert rc == 2 and not enter.called
        err = capsys.readouterr().err.strip()
        assert says in err and len(err.splitlines()) == 1, err
        with pytest.raises(AssertionError, match="started"):
            main(["oracle", "--device", "cpu", "--layouts", "ep1;ep4", "--faults", "none"])


def test_top_k_differences_between_runs_from_their_flips():
    """Two runs differ at a token where one flipped and the other did not, or both flipped to different sets; both
    flipped the same way is no difference (the control)."""
    a = {"flipped_topk": {"3": [0, 1], "7": [2, 5]}}
    b = {"flipped_topk": {"3": [0, 1], "9": [4, 6]}}
    assert found.topk_differences(a, b) == {7, 9} and found.topk_differences(a, a) == set()


# ---------------------------------------------------------------------------------------------- on the engines' device


def _same_stats(a: dict, b: dict, path: str = "") -> list[str]:
    """Where two error_stats results differ: quantiles and counts exactly, means and standard errors to 1e-12."""
    out = []
    for k in sorted(set(a) | set(b)):
        x, y, here = a.get(k), b.get(k), f"{path}/{k}"
        if isinstance(x, dict) and isinstance(y, dict):
            out += _same_stats(x, y, here)
        elif k in ("mean", "mean_se"):
            if not (x == y or (np.isnan(x) and np.isnan(y))
                    or (np.isfinite(x) and abs(x - y) <= 1e-12 * max(abs(x), abs(y), 1e-300))):
                out.append(f"{here}: {x} vs {y}")
        elif not (x == y or (isinstance(x, float) and np.isnan(x) and np.isnan(y))):
            out.append(f"{here}: {x} vs {y}")
    return out


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(1, 700), st.sampled_from([1, 3, 8]), st.booleans())
def test_the_engines_statistics_are_the_rules(seed, n, experts, with_zeros):
    """rule_torch.error_stats (what the engines compute, on their device) against rule.error_stats (numpy, the
    reference) on random bf16 runs of an fp64 truth with labels, overlapping masks and a keep mask: every quantile,
    count and noise equal, means and standard errors to float64 rounding. The control: a run one bf16 step off at one
    element is told apart."""
    from moe_lab.questions.oracle import rule_torch

    g = torch.Generator().manual_seed(seed)
    truth = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** float(seed % 5 - 2)
    if with_zeros:
        truth[::7] = 0.0
    run = (truth + torch.randn(n, generator=g, dtype=torch.float64) * truth.abs() * 2 ** -8).bfloat16()
    labels = torch.randint(-1, experts, (n,), generator=g)
    masks = {"even": np.arange(n) % 2 == 0, "first": torch.arange(n) < n // 3}
    keep = torch.rand(n, generator=g) > 0.1
    want = rule.error_stats(run, truth, labels.numpy(), prefix="x.", masks=masks, keep=keep.numpy())
    got = rule_torch.error_stats(run, truth, labels, prefix="x.", masks=masks, keep=keep)
    assert _same_stats(want, got) == []
    off = run.clone()
    i = int(torch.argmax(truth.abs() * keep))  # a kept element: the control must reach the statistics
    off[i] = (off[i].float() * (1 + 2 ** -7)).bfloat16()  # the next bf16 value away from zero
    if bool(keep.any()) and not torch.equal(off, run):
        assert _same_stats(want, rule_torch.error_stats(off, truth, labels, prefix="x.", masks=masks, keep=keep))


@settings(max_examples=25, deadline=None, suppress_health_check=[HealthCheck.too_slow])
@given(st.integers(0, 10_000), st.integers(1, 700), st.sampled_from(["bf16", "fp32", "same"]))
def test_the_engines_pair_gap_is_the_rules(seed, n, kind):
    """rule_torch.pair_gap (on the engines' device) against rule.pair_gap (numpy): bf16 runs, fp32 gradients, and
    two equal runs (no gap). The control: a gap one element wider is told apart."""
    from moe_lab.questions.oracle import rule_torch

    g = torch.Generator().manual_seed(seed)
    b = torch.randn(n, generator=g, dtype=torch.float64) * 10.0 ** float(seed % 5 - 2)
    a = b + torch.randn(n, generator=g, dtype=torch.float64) * b.abs() * 2 ** -7
    if kind == "bf16":
        a, b = a.bfloat16(), b.bfloat16()
    elif kind == "fp32":
        a, b = a.float(), b.float()
    else:
        a = b = b.bfloat16()
    want, got = rule.pair_gap(a, b), rule_torch.pair_gap(a, b)
    assert want == got, (want, got)
    wider = a.clone()
    i = int(torch.argmax(b.abs()))
    wider[i] = wider[i] * 2 + 1
    assert rule_torch.pair_gap(wider, b) != want


def test_tokens_routed_to_fewer_experts_are_not_rounding_at_any_margin(reorderings):
    """A capacity drop routes a token to fewer experts than the truth; rounding only reorders a token's scores. The
    dropped tokens' margins are planted small (what a flip by rounding has), so the flip rule alone passes them: the
    count must catch them. Controls: the same run with its count equal to the band's is in band; a band whose
    correct runs differ in count widens the limit; a record without counts is not judged on them."""
    truth, runs = reorderings
    stats = {f"r{i}": rule.error_stats(r, truth, prefix="router.logits/") for i, r in enumerate(runs)}
    stats["dropped"] = stats["r1"]
    limit = rule.flip_limit(stats, "router.logits/all")
    small = {"dropped": [limit * 0.25] * 3}
    known = [k for k in stats if k != "dropped"]
    caught = rule.judge_runs(stats, known, flipped_margins=small,
                             routed_counts={**{k: 0 for k in known}, "dropped": 3})
    assert not caught["dropped"].in_band and caught["dropped"].first.statistic == rule.COUNT
    assert "3 tokens routed to another number of experts" in caught["dropped"].first.words()
    assert caught["dropped"].excess_words() == ""  # no ratio to a band of zero
    assert all(caught[k].in_band for k in known)
    same = rule.judge_runs(stats, known, flipped_margins=small, routed_counts={k: 0 for k in stats})
    assert same["dropped"].in_band
    wide = rule.judge_runs(stats, known, routed_counts={"r0": 0, "r1": 2, "r2": 0, "r3": 1, "dropped": 3})
    assert wide["dropped"].in_band  # limit 2 + (2 - 0) = 4
    unknown = rule.judge_runs(stats, known, flipped_margins=small,
                              routed_counts={**{k: None for k in known}, "dropped": 3})
    assert unknown["dropped"].in_band


def test_the_oracle_runs_each_layout_once_the_reference_first_and_lists_its_runs_as_always():
    """The engine's jobs (truths, runs, faults) run layout-major: the reference layout's state first, each other
    state once, each state's jobs in their own order."""
    from moe_lab.layout import Layout
    from moe_lab.questions.oracle.experiment import layout_major

    layouts = ["ep4", "ep1", "tp2,ep2", "tp2,ep2,etp1"]
    jobs = [("truth", None, s, None, 1) for s in layouts]
    jobs += [("run", d, s, None, t) for d in ("allgather", "alltoall") for s in layouts for t in (1, 2)]
    jobs += [("fault", d, s, f, 1) for d in ("allgather", "alltoall")
             for f, s in (("swap_experts", "ep4"), ("etp_shard", "tp2,ep2"), ("capacity_drop", "tp2,ep2,etp1"))]

    def state(job):
        return Layout.parse(job[2]).on(4).parallel_state

    order = layout_major(jobs, "ep1", 4)
    assert sorted(order) == sorted(jobs) and order[0] == ("truth", None, "ep1", None, 1)
    runs = [state(j) for j in order]
    assert sum(a != b for a, b in zip(runs, runs[1:])) == 3  # 4 states, each entered once
    assert sum(a != b for a, b in zip(map(state, jobs), map(state, jobs[1:]))) > 3  # control: the listed order
    for s in set(runs):
        assert [j for j in order if state(j) == s] == [j for j in jobs if state(j) == s]
