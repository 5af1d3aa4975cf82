"""Every finding follows its records: records that contradict the CPU story (fp32 does not help, a remedy
fails in one trial, EP=2 where a+b=b+a, costs inside the noise, one rank, only emulated cases) and the status, claim
and remedy that must follow them — the same findings the notebooks' verdicts and the index cards render."""

import pytest
from records_factory import ENV, back05, case02, case04, cell, cmp, kernel04, rec01

from moe_lab.findings import FAIL, MIXED, NA, NOT_MEASURED, PASS, headline
from moe_lab.questions.compound import findings as compound
from moe_lab.questions.localise import findings as localise
from moe_lab.questions.promotion import findings as promotion
from moe_lab.questions.reproduce import findings as reproduce
from moe_lab.findings import render
from moe_lab.questions.truncation import findings as truncation
from moe_lab.questions.reproduce import experiment as reproduce_nb


def by(fs, question=None, **subject):
    return [f for f in fs if (question is None or f.question == question)
            and all(f.subject.get(k) == v for k, v in subject.items())]


# ---------------------------------------------------------------------------------------------- 01


def test_01_ep_order_only_when_ranks_differ_in_every_trial_and_reruns_never():
    recs = [rec01("allgather", "none", cmp(300), cmp()),  # EP order
            rec01("allgather", "fp32", cmp(300), cmp()),  # fp32 does NOT help here
            rec01("alltoall", "none", cmp(5), cmp(6)),  # atomics: reruns differ as much
            rec01("alltoall", "fp32", cmp(5, n_differ=2), cmp())]  # some trials only
    fs = reproduce.findings(recs)
    kinds = {(f.subject["dispatcher"], f.subject["router_dtype"]): (f.status, f.subject["attribution"]) for f in fs}
    assert kinds == {("allgather", "none"): (FAIL, "ep"), ("allgather", "fp32"): (FAIL, "ep"),
                     ("alltoall", "none"): (FAIL, "nondeterminism"), ("alltoall", "fp32"): (MIXED, "mixed")}
    f = by(fs, dispatcher="allgather", router_dtype="none")[0]
    assert "300 of 1,000 output elements" in f.claim and "in 5 of 5 trial(s)" in f.claim and "EP order" in f.claim
    assert f.evidence.counts[0].of == 1000 and f.evidence.trials == (5, 5) and f.card
    assert "run more trials" in by(fs, dispatcher="alltoall", router_dtype="fp32")[0].claim
    v = reproduce_nb.verdict(recs)  # the notebook renders exactly these findings
    assert all(f.claim in v for f in fs) and "Verdict: [FAIL]" in v


def test_01_ep_order_with_a_little_rerun_noise_on_top_is_still_ep_order():
    big, noise = cmp(1_347_732, numel=4_194_304), cmp(91, n_differ=2, numel=4_194_304)
    f = reproduce.findings([rec01("allgather", "none", big, noise)])[0]
    assert f.subject["attribution"] == "ep+nondeterminism" and f.status == FAIL
    assert "a rerun on one rank: 91 of 4,194,304 output elements" in f.claim
    under = cmp(100 * 91 - 1, numel=4_194_304)
    assert reproduce.findings([rec01("allgather", "none", under, noise)])[0].subject["attribution"] == "nondeterminism"


def test_01_at_ep2_nothing_diverges_and_world_1_is_not_applicable():
    recs = [rec01(d, r, cmp(), cmp(), world=2) for d in ("allgather", "alltoall") for r in ("none", "fp32")]
    fs = reproduce.findings(recs)
    assert {f.status for f in fs} == {PASS} and headline(fs)[0] == PASS
    one = rec01("allgather", "none", {"applicable": False, "reason": "world size 1", "trials": 5}, cmp(), world=1)
    f = reproduce.findings([one])[0]
    assert f.status == NA and headline([f])[0] == NA


# ---------------------------------------------------------------------------------------------- 02


def test_02_a_variant_that_still_diverges_is_not_called_a_fix():
    recs = [case02("allgather", "bf16 (nothing)", "combine.comm"),
            case02("allgather", "probs fp32 before gather (reporter's fix)", "combine.comm"),
            case02("allgather", "moe_router_dtype=fp32", None)]
    v = by(localise.findings(recs), "probs-path variants")[0]
    assert v.status == PASS and v.remedy == "moe_router_dtype=fp32"
    assert "moe_router_dtype=fp32 make(s) every stage agree; probs fp32 before gather (reporter's fix) do(es) not" \
        in v.claim
    recs[2] = case02("allgather", "moe_router_dtype=fp32", "combine.comm")
    v = by(localise.findings(recs), "probs-path variants")[0]
    assert v.status == FAIL and "no probs-path variant removes it" in v.claim and v.remedy is None


def test_02_the_first_stage_names_its_collective_and_no_clause_is_hard_wired():
    f = by(localise.findings([case02("allgather", "bf16 (nothing)", "combine.comm")]), "first divergent stage")[0]
    assert f.subject["collective"] == "reduce_scatter_tensor in bfloat16"
    router = by(localise.findings([case02("allgather", "bf16 (nothing)", "router.logits")]), "first divergent stage")[0]
    assert router.subject["collective"] is None and "after the dispatch" not in router.claim
    copies = by(localise.findings([case02("alltoall", "bf16 (nothing)", "combine.pre", kind="copies")]),
                "first divergent stage")[0]
    assert "within one rank" in copies.claim
    assert "within one rank" not in f.claim


def test_02_one_rank_is_not_a_pass():
    f = localise.findings([case02("allgather", "bf16 (nothing)", None, world=1) | {"cross_rank_applicable": False}])
    assert [x.status for x in f] == [NA] and headline(f)[0] == NA


# ---------------------------------------------------------------------------------------------- 03


def test_03_fp32_that_does_not_help_is_not_recommended():
    recs = [cell(cross=300), cell(r="fp32", cross=280, ratio=1.02), cell(det=True, ratio=2.0, ci=(1.9, 2.1))]
    f = promotion.findings(recs)[0]
    assert f.status == PASS and f.remedy == "router none + deterministic" and "1 of 2 other settings" in f.claim
    assert "cheapest, resolved from the others: router none + deterministic (2.00x" in f.claim
    assert any("use_deterministic_algorithms" in line for line in f.lines)


def test_03_a_setting_bitwise_in_4_of_5_trials_does_not_count():
    f = promotion.findings([cell(cross=300), cell(r="fp32", cross=1, cross_differ=1)])[0]
    assert f.status == FAIL and f.remedy is None and "no setting of the grid does" in f.claim


def test_03_costs_inside_the_noise_floor_are_not_ranked():
    recs = [cell(cross=300, ci=(0.9, 1.1)), cell(r="fp32", ratio=1.03, ci=(0.97, 1.08)),
            cell(r="fp64", ratio=1.01, ci=(0.95, 1.09))]
    f = promotion.findings(recs)[0]
    assert "at no measurable cost" in f.claim and "router fp32" in f.claim and "router fp64" in f.claim
    assert "cheapest" not in f.claim and f.remedy == "router fp32"  # tied: the simplest named, said as such


def test_03_overlapping_intervals_are_tied_not_ranked():
    """One H200: router fp32 + cast + deterministic 1.16x (1.14-1.22) against router fp32 1.20x (1.15-1.27)."""
    recs = [cell(cross=300, ci=(0.99, 1.01)), cell(r="fp32", ratio=1.20, ci=(1.15, 1.27)),
            cell(r="fp32", pf32=True, det=True, ratio=1.16, ci=(1.14, 1.22))]
    f = promotion.findings(recs)[0]
    assert "tied on cost" in f.claim and "cheapest" not in f.claim and f.remedy == "router fp32"
    apart = [cell(cross=300, ci=(0.99, 1.01)), cell(r="fp32", ratio=1.40, ci=(1.35, 1.45)),
             cell(r="fp32", pf32=True, det=True, ratio=1.16, ci=(1.14, 1.22))]
    g = promotion.findings(apart)[0]
    assert "cheapest, resolved" in g.claim and g.remedy == "router fp32 + probs fp32 gather + deterministic"


def test_03_plain_already_agreeing_needs_nothing_and_all_skipped_is_not_measured():
    f = promotion.findings([cell(world=2), cell(r="fp32", world=2)])[0]
    assert f.status == PASS and "nothing to set" in f.claim and f.remedy is None
    skipped = [dict(ENV, notebook="03", kind="case", skipped="needs megatron-core >= 0.12.0")] * 3
    fs = promotion.findings(skipped)
    assert headline(fs)[0] == NOT_MEASURED
    assert "0 of 0" not in headline(fs)[1]


def test_03_nan_zero_and_inf_costs_are_invalid_never_free():
    for bad in (float("nan"), 0.0, float("inf"), -1.0):
        recs = [cell(cross=300), cell(r="fp32", ratio=bad, ci=(bad, bad))]
        f = promotion.findings(recs)[0]
        assert "no measurable cost" not in f.claim and "no valid cost" in f.claim


# ---------------------------------------------------------------------------------------------- 04


def test_04_a_remedy_not_bitwise_in_one_trial_is_never_named():
    recs = []
    for d in ("allgather", "alltoall"):
        recs += [case04(d, "none", cmp(900), cmp(40)),
                 case04(d, "ordered_combine", cmp(9, n_differ=1) if d == "alltoall" else cmp(), ratio=1.01,
                        ci=(0.99, 1.02)),
                 case04(d, "ordered_combine+no_splitk", cmp(), ratio=1.08, ci=(1.05, 1.12))]
    fix = {f.subject["dispatcher"]: f for f in truncation.findings(recs) if f.question == truncation.FIX}
    assert fix["alltoall"].remedy == "ordered_combine+no_splitk"
    assert fix["allgather"].remedy == "ordered_combine"  # it holds there, in every trial


def test_04_each_workspace_and_ep_is_its_own_finding_and_card_line():
    recs = []
    for ws, cost in (("unset", 1.05), (":4096:8", 2.0)):
        recs += [case04("allgather", "none", cmp(900), ws=ws, ci=(0.99, 1.01)),
                 case04("allgather", "ordered_combine+no_splitk", cmp(), ws=ws, ratio=cost, ci=(cost - .02, cost + .02))]
    recs += [case04("allgather", "none", cmp(5), world=1, ci=(0.99, 1.01), ranks_per_gpu=1, backend="nccl"),
             case04("allgather", "no_splitk", cmp(5), world=1, ratio=1.1, ci=(1.0, 1.2), ranks_per_gpu=1,
                    backend="nccl")]
    fs = truncation.findings(recs)
    trunc = by(fs, truncation.QUESTION)
    assert len(trunc) == 3 and {f.status for f in trunc} == {FAIL}
    fixes = by(fs, truncation.FIX)
    assert sorted(f.status for f in fixes) == [FAIL, PASS, PASS]
    ws8 = next(f for f in fixes if f.subject["workspace"] == ":4096:8")
    assert "2.00x" in ws8.claim and "export CUBLAS_WORKSPACE_CONFIG=:4096:8" in ws8.lines
    unset = next(f for f in fixes if f.subject["workspace"] == "unset" and f.status == PASS)
    assert not any("CUBLAS_WORKSPACE_CONFIG" in line for line in unset.lines)
    cards = render.cards({"04": fs})
    assert len(cards) == 2  # EP=1 (one rank per GPU) and EP=4 (virtual) never share a card
    ep1 = next(c for c in cards if "1 rank" in c["placement"])
    assert [f.status for f in ep1["findings"]] == [FAIL, FAIL]


def test_04_only_emulated_cases_do_not_claim_the_real_layer():
    recs = [case04("allgather", "none", cmp(900), emu="splitk+atomics"),
            case04("allgather", "no_splitk", cmp(), emu="splitk+atomics", ratio=1.0)]
    fs = truncation.findings(recs)
    real = [f for f in fs if f.card]
    assert [f.status for f in real] == [NOT_MEASURED] and "only EMULATED" in real[0].claim
    assert headline(fs)[0] == NOT_MEASURED
    assert all("passes bitwise on the real layer" not in f.claim for f in fs)


def test_04_a_batch_variant_cpu_gemm_is_named_with_the_cpu_and_its_isa():
    cpu = {"model": "Intel Xeon Platinum 8480+", "isa": ["amx_bf16", "amx_tile", "avx512f"], "capability": "AVX512"}
    recs = [kernel04("fc2", 128, True, cpu=cpu), kernel04("fc2", 256, False, cpu=cpu), kernel04("fc2", 512, False, cpu=cpu),
            case04("allgather", "none", cmp(1, numel=23040), device="cpu", cpu=cpu, ranks_per_gpu=None)]
    fs = truncation.findings(recs)
    k = by(fs, "expert GEMM batch invariance")[0]
    assert k.status == FAIL and "from M = 256" in k.claim or "first at M = 256" in k.claim
    assert "Intel Xeon Platinum 8480+" in k.claim and "amx_bf16" in k.claim
    why = by(fs, "why truncation fails")[0]
    assert "batch variant" in why.claim and "CPU GEMMs" not in why.claim
    inv = truncation.findings([kernel04("fc2", 128, True), kernel04("fc2", 256, True)])
    assert inv[0].status == PASS and "model and ISA not recorded" in inv[0].claim


# ---------------------------------------------------------------------------------------------- 05


def test_05_a_setting_that_fixes_the_forward_only_is_said_so():
    recs = [back05("allgather", "plain", bad=("cross_out", "cross_dx")),
            back05("allgather", "router fp32", bad=("cross_dx",)),
            back05("allgather", "moe_permute_fusion", available=False)]
    fs = compound.findings(recs)
    assert by(fs, compound.QUESTION)[0].status == FAIL
    assert by(fs, "setting", setting="router fp32")[0].status == FAIL
    assert by(fs, "setting", setting="moe_permute_fusion")[0].status == NA
    assert by(fs, compound.FIX)[0].status == FAIL
    recs.append(back05("allgather", "fp32 grad reduce"))
    fix = by(compound.findings(recs), compound.FIX)[0]
    assert fix.status == PASS and fix.remedy == "fp32 grad reduce"


def test_05_input_gradient_fractions_count_the_loss_tokens_only():
    """The loss is over out[:90] of 1024 tokens: 90 x 64 elements carry an input gradient, not 1024 x 64."""
    r = back05("allgather", "plain", bad=("cross_dx", "cross_router_grad", "truncation_dx"))
    assert compound.carrying(r, "cross_dx") == 90 * 64
    assert compound.carrying(r, "cross_router_grad") == 1024 * 64  # a weight gradient: every element
    f = compound.findings([r])[0]
    assert "7 of 5,760 input-gradient elements of the loss's tokens" in f.claim
    assert any(c.of == 5760 for c in f.evidence.counts)


def test_05_without_the_plain_setting_nothing_is_claimed():
    fs = compound.findings([back05("allgather", "router fp32")])
    assert by(fs, compound.QUESTION)[0].status == NOT_MEASURED and headline(fs)[0] == NOT_MEASURED


def test_03_a_remedy_that_brings_its_own_engine_environment_says_so():
    """On GPUs deterministic cells run on engines with CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring, the plain
    cell without: the cost of the named remedy includes them, and the claim says which, from the records' env. The
    control: the same records without an env difference say nothing of it."""
    ws = {"CUBLAS_WORKSPACE_CONFIG": ":4096:8", "NCCL_ALGO": "Ring"}
    recs = [cell(cross=300, env={}), cell(r="fp32", cross=280, env={}), cell(r="fp32", det=True, ratio=1.3,
                                                                            ci=(1.2, 1.4), env=ws)]
    f = promotion.findings(recs)[0]
    assert f.remedy == "router fp32 + deterministic"
    assert ("its engines ran with CUBLAS_WORKSPACE_CONFIG=:4096:8, NCCL_ALGO=Ring, the plain cell's with "
            "CUBLAS_WORKSPACE_CONFIG unset, NCCL_ALGO unset: the cost includes that") in f.claim
    same = [cell(cross=300, env=ws), cell(r="fp32", cross=280, env=ws), cell(r="fp32", det=True, ratio=1.3,
                                                                             ci=(1.2, 1.4), env=ws)]
    g = promotion.findings(same)[0]
    assert g.remedy == f.remedy and "its engines ran with" not in g.claim


# ---------------------------------------------------------------------------------------------- impossible values


@pytest.mark.parametrize("change, needle", [
    ({"trials": 0, "n_differ": 0}, "trials (0)"),
    ({"trials": 3, "n_differ": 4}, "n_differ (4) exceeds trials (3)"),
    ({"n_mismatch": 30_000, "numel": 23_040}, "n_mismatch (30,000) exceeds its denominator (23,040"),
    ({"n_mismatch": -1}, "n_mismatch (-1) is not a count"),
    ({"trials": 2.5}, "trials (2.5) is not a count"),
])
def test_an_impossible_comparison_is_refused_by_name_not_rendered(change, needle):
    """The words of a comparison (`describe`) never render a trial-less 'in all 1 trial(s)' or a fraction above 1:
    the value is named (ValueError), which `guarded` turns into a NOT MEASURED finding. The control: the same
    comparison without the change renders."""
    from moe_lab.findings.common import describe

    c = cmp(7, trials=3, numel=23_040)
    assert describe(c).startswith("7 of 23,040 elements")  # control
    with pytest.raises(ValueError) as e:
        describe({**c, **change})
    assert needle in str(e.value)


def test_a_nan_ulp_is_worded_as_not_finite():
    from moe_lab.findings.common import describe

    c = cmp(7, trials=3)
    text = describe({**c, "max_ulp": float("nan"), "max_abs": None})
    assert "max ULP not finite (nan)" in text and "max abs not recorded" in text and "nan ULP" not in text


def test_a_record_with_no_trial_is_not_measured_in_every_question():
    """Notebook 01's record whose comparisons ran no trial: NOT MEASURED, naming the field (the control: as measured,
    the same record gives a verdict)."""
    from moe_lab.questions.reproduce import findings as f01

    ok = rec01("allgather", "none", cmp(5), cmp())
    assert all(f.status != NOT_MEASURED for f in f01.findings([ok]))
    bad = rec01("allgather", "none", {**cmp(5), "trials": 0, "n_differ": 0}, cmp())
    fs = f01.findings([bad])
    assert fs and all(f.status == NOT_MEASURED for f in fs) and "trials (0)" in fs[0].claim
