"""The findings' invariants, held by property-based tests: hypothesis generates record sets that contradict the
usual story — missing fields, NaN/inf/0 costs, world 1, EP=2, mixed layer configs and placements, old schemas, only
emulated cases, every cell skipped — and every finding built from them must still keep the rules."""

import math
import os

from hypothesis import HealthCheck, given, settings, strategies as st
from records_factory import ENV, back05, case02, case04, cell, cmp, kernel04, preset07, rec01, train06

from moe_lab import questions
from moe_lab.findings import NOT_MEASURED, PASS, Cost, render
from moe_lab.findings.common import choose
from moe_lab.findings.model import Finding

SETTINGS = settings(max_examples=int(os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES", 100)), deadline=None,
                    derandomize=not os.environ.get("MOE_LAB_HYPOTHESIS_EXAMPLES"),
                    suppress_health_check=[HealthCheck.too_slow])
floats = st.one_of(st.floats(allow_nan=True, allow_infinity=True), st.floats(0.5, 3.0))
counts = st.integers(0, 1000)


IMPOSSIBLE = {"no trial": {"trials": 0, "n_differ": 0}, "more trials differ than ran": {"n_differ": 9},
              "nan ULP": {"max_ulp": math.nan, "max_abs": math.nan},
              "more mismatches than elements": {"n_mismatch": 10**6}, "negative count": {"n_mismatch": -1}}
"""Values no measurement can give (a corrupt or hand-edited record): each must become NOT MEASURED or be worded as
invalid, never rendered as a result ('in all 1 trial(s)', 'max nan ULP', '1,000,000 of 1,000')."""


@st.composite
def comparison(draw, trials=5, numel=1000):
    n = draw(counts)
    k = draw(st.integers(0, trials)) if n else 0
    c = cmp(n if k else 0, trials=trials, n_differ=k, numel=numel)
    broken = draw(st.sampled_from([None] * 8 + sorted(IMPOSSIBLE)))
    if broken:
        c.update(IMPOSSIBLE[broken], bitwise_equal=False)
    return c


@st.composite
def cost(draw):
    lo, hi = sorted([draw(floats), draw(floats)], key=lambda x: (math.isnan(x), x))
    return {"ratio": draw(floats), "ci": [lo, hi], "t_with_s": 0.01}


@st.composite
def subject(draw):
    world = draw(st.sampled_from([1, 2, 4]))
    return {"world": world, "megatron_core": draw(st.sampled_from(["0.12.3", "0.16.1"])),
            "config": dict(ENV["config"], hidden=draw(st.sampled_from([64, 128]))),
            "ranks_per_gpu": draw(st.sampled_from([1, world])), "backend": draw(st.sampled_from(["gloo", "nccl"]))}


@st.composite
def records(draw):
    out = []
    for _ in range(draw(st.integers(0, 4))):
        s = draw(subject())
        d = draw(st.sampled_from(["allgather", "alltoall"]))
        kind = draw(st.sampled_from(["01", "02", "03", "04", "05", "06", "07", "k", "skip"]))
        cross = draw(comparison()) if s["world"] > 1 else {"applicable": False, "reason": "world size 1", "trials": 5}
        if kind == "01":
            out.append(rec01(d, draw(st.sampled_from(["none", "fp32"])), cross, draw(comparison()), **s))
        elif kind == "02":
            first = draw(st.sampled_from([None, "combine.comm", "router.logits", "dispatch.comm.probs"]))
            out.append(case02(d, draw(st.sampled_from(["bf16 (nothing)", "moe_router_dtype=fp32"])), first, **s))
        elif kind == "03":
            for r in ("none", "fp32", "fp64"):
                c = cell(d, r, cross=0, **s)
                c.update(cross_rank=draw(comparison()) if s["world"] > 1 else cross, rerun=draw(comparison()),
                         cost=draw(cost()))
                out.append(c)
        elif kind == "04":
            emu = draw(st.sampled_from(["none", "splitk+atomics"]))
            for rem in ("none", "no_splitk", "ordered_combine+no_splitk"):
                c = case04(d, rem, draw(comparison(numel=23040)), draw(comparison()), emu=emu,
                           **{k: v for k, v in s.items() if k != "world"}, world=s["world"])
                c["cost"] = draw(cost())
                out.append(c)
        elif kind == "05":
            for setting in ("plain", "router fp32"):
                bad = draw(st.sets(st.sampled_from(["cross_out", "cross_dx", "rerun_dx", "experts_truncation"])))
                out.append(back05(d, setting, bad=tuple(bad), **s) | {"cost": draw(cost())})
        elif kind == "06":
            det = draw(st.booleans())
            for ep in draw(st.sampled_from([[1], [1, 2], [1, 2, 4]])):
                part = None if ep == 1 else draw(st.sampled_from([None, 2]))
                out.append(train06(ep, det=det, part_at=part, **s))
                if draw(st.booleans()):
                    out.append(train06(ep, 1, det=det, part_at=draw(st.sampled_from([None, 1])), tag="rerun", **s))
        elif kind == "07":  # a preset's grid: any cell may be missing, the plain one too
            model = draw(st.sampled_from(["qwen3-30b-a3b", "deepseek-v3 x0.125 (scaled)"]))
            for r, det in draw(st.sets(st.sampled_from([("none", False), ("fp32", False), ("none", True)]))):
                c = preset07(model, d, r, det=det, first=draw(st.sampled_from([None, "combine.comm"])), **s)
                c.update(cross_rank=draw(comparison()) if s["world"] > 1 else cross, rerun=draw(comparison()),
                         cost=draw(cost()))
                out.append(c)
        elif kind == "k":
            out.append(kernel04(draw(st.sampled_from(["fc1", "fc2"])), draw(st.sampled_from([128, 256])),
                                draw(st.booleans()), **{k: v for k, v in s.items() if k != "world"}))
        else:
            out.append(dict(ENV, notebook="03", kind="case", skipped="router_dtype needs megatron-core >= 0.12.0"))
    # old or partial layouts: drop fields, null them
    for r in out:
        for key in draw(st.sets(st.sampled_from(sorted(r)), max_size=2)):
            if draw(st.booleans()):
                del r[key]
            else:
                r[key] = None
    return out


def all_findings(recs) -> list[Finding]:
    return [f for fs in questions.findings(recs).values() for f in fs]


@SETTINGS
@given(records())
def test_findings_never_raise_and_every_pass_rests_on_a_measured_record(recs):
    by_nb = questions.findings(recs)  # never raises, whatever the records lack
    keys = {r.get("case_key") for r in recs if isinstance(r, dict)}
    for nb, fs in by_nb.items():
        for f in fs:
            assert f.status != PASS or (f.evidence.records and all(k in keys or k.startswith("unkeyed:")
                                                                    for k in f.evidence.records)), f
        st_, text = render.headline(fs)
        if st_ == PASS:
            assert any(f.status == PASS for f in fs)
        if not fs:
            assert st_ == NOT_MEASURED
        assert "0 of 0" not in text


@SETTINGS
@given(records())
def test_impossible_values_are_never_rendered_as_results(recs):
    """A comparison of no trial, NaN ULPs, or more mismatches (trials) than elements (trials run): no page says
    'in all 1 trial(s)' of a trial-less record, 'nan ULP', or a count above its denominator."""
    text = "\n".join(render.verdict(fs) for fs in questions.findings(recs).values())
    assert "nan ULP" not in text and "max nan" not in text and "in all 0 trial" not in text
    for f in all_findings(recs):
        for c in f.evidence.counts:
            assert 0 <= c.n <= c.of or c.of == 0, c
        k_n = f.evidence.trials
        assert k_n is None or 0 <= k_n[0] <= k_n[1], f


@SETTINGS
@given(records())
def test_card_and_notebook_verdict_render_the_same_findings(recs):
    by_nb = questions.findings(recs)
    verdicts = {nb: render.verdict(fs) for nb, fs in by_nb.items()}
    for card in render.cards(by_nb):
        for f in card["findings"]:
            nb = questions.by_experiment(f.experiment).number
            assert f.text() in verdicts[nb]  # same status, claim and remedy as the notebook says
            # findings about different releases, placements or layer configs never share a card
            assert f.card_key() == (card["release"], card["dispatcher"], card["placement"], card["layer"])


@SETTINGS
@given(records())
def test_every_count_has_its_denominator_and_gradient_counts_fit_the_loss_tokens(recs):
    for f in all_findings(recs):
        for c in f.evidence.counts:
            assert c.of >= 0 and f" of {c.of:,} " in c.text() or "denominator 0" in c.text()
            assert c.n <= c.of or c.of == 0
            if "loss's tokens" in c.what:
                assert c.of == 90 * 64  # cut x hidden of the factory's layer, never the whole sequence


@SETTINGS
@given(st.lists(st.tuples(st.sampled_from(list("ABCDE")), floats, floats, floats), min_size=1, max_size=5),
       st.tuples(floats, floats))
def test_nothing_is_cheapest_inside_overlapping_intervals_and_invalid_costs_are_never_free(cands, floor):
    costs = {}
    for name, r, a, b in cands:
        costs[name] = Cost(ratio=r, ci=tuple(sorted([a, b], key=lambda x: (math.isnan(x), x))),
                           floor_ci=tuple(sorted(floor, key=lambda x: (math.isnan(x), x))))
    ch = choose(list(costs.items()), lambda n: (n,))
    for c in costs.values():
        if not c.valid:
            assert "no measurable cost" not in c.text() and c.resolved is None
        if "no measurable cost" in c.text():  # said only where the interval lies within the floor's
            assert c.floor_ci[0] <= c.ci[0] and c.ci[1] <= c.floor_ci[1], c
    if ch["basis"] == "free":  # named free only when its interval lies within the floor's
        assert costs[ch["name"]].inside_floor and all(costs[n].inside_floor for n in ch["tied"])
    if ch["basis"] == "cheapest":
        best = costs[ch["name"]]
        for n, c in costs.items():
            if n != ch["name"] and c.valid:
                assert c.ci[0] > best.ci[1] or c.ci[1] < best.ci[0], (ch, costs)
    if ch["basis"] in ("free", "tied", "cheapest"):
        assert costs[ch["name"]].valid


@st.composite
def truncation_records(draw):
    """Notebook 04's records over several subjects at once — two dispatchers, router dtypes, devices and releases —
    each failing or passing on its own, with routing rows and kernel probes of their own device."""
    out = []
    cpu = {"device": "cpu", "gpu": None, "ranks_per_gpu": None, "cpu": {"model": "EPYC", "isa": ["avx512f"]}}
    for i in range(draw(st.integers(1, 4))):
        d = draw(st.sampled_from(["allgather", "alltoall"]))
        rd = draw(st.sampled_from(["none", "fp64"]))
        dev = draw(st.sampled_from(["gpu", "cpu"]))
        rel = draw(st.sampled_from(["0.12.3", "0.16.1"]))
        s = dict(router_dtype=rd, megatron_core=rel, **(cpu if dev == "cpu" else {}))
        tag = f"{i}/{d}/{rd}/{dev}/{rel}"
        out.append(case04(d, "none", draw(comparison(numel=23040)), draw(comparison()), case_key=f"{tag}/none", **s))
        out.append(case04(d, "no_splitk", draw(comparison(numel=23040)), cmp(), ratio=1.1, ci=(1.05, 1.15),
                          case_key=f"{tag}/fix", **s))
        if draw(st.booleans()):
            flips = draw(st.booleans())
            rt = {"notebook": "04", "kind": "routing", "dispatcher": d, "case_key": f"{tag}/routing", "cut": 90,
                  "routing": {"routing_map_equal": not flips, "probs": {"bitwise_equal": not flips},
                              "probs_dtype": "bf16"},
                  "rows_per_expert": {"full": [1, 2], "truncated": [1, 2]},
                  "zero_tokens": {"max_abs_logit": 0.0, "expert_sets": [[0, 1]]}}
            out.append({**ENV, **s, **rt})
        if draw(st.booleans()):
            for M in (128, 256):
                out.append(kernel04("fc1", M, draw(st.booleans()), case_key=f"{tag}/k{M}", **s,
                                    **({} if dev == "cpu" else {"device": "cuda"})))
    return out


@SETTINGS
@given(truncation_records())
def test_truncation_evidence_is_never_pooled_across_subjects(recs):
    """Every 04 finding rests on records of its own subject: a 'why' on its release, device, layer, dispatcher and
    router dtype; a truncation or fix finding on its setting's own (router dtype included); a kernel finding on one
    device and release — one dispatcher's routing never explains another's failure, a CPU probe never an H200's."""
    from moe_lab.questions.truncation import findings as t04

    by_key = {r["case_key"]: r for r in recs}
    for f in t04.findings(recs):
        ev = [by_key[k] for k in f.evidence.records if k in by_key]
        assert ev, f
        if f.question == "why truncation fails":
            assert len({t04.device_key(r) + (r["dispatcher"], r["router_dtype"]) for r in ev}) == 1, f
            other = [r for r in recs if r.get("kind") == "routing" and not t04._same(ev[0], r)]
            if "routing of the first tokens itself changes" in f.claim:  # said only from its own routing rows
                assert any(r.get("kind") == "routing" and t04._same(ev[0], r)
                           and not r["routing"]["routing_map_equal"] for r in recs), (f, other)
        elif f.question in (t04.QUESTION, t04.FIX):
            assert len({(t04.device_key(r), r["dispatcher"], r["router_dtype"]) for r in ev}) == 1, f
            assert f.status == NOT_MEASURED or f.subject.get("router_dtype") == ev[0]["router_dtype"]
        elif f.question == "expert GEMM batch invariance":
            assert len({t04.device_key(r) for r in ev}) == 1, f
