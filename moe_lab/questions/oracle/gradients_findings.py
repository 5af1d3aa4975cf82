"""Notebook 08's gradient and training findings, from records only (`gradients`, `trajectory`): is each run's gap to
the fp64 truth what rounding gives (the rule's verdict, `rule.judge_runs`: the known-correct runs are the runs
without a planted bug, each judged against the others — leaving out itself and its own reruns — and every planted run
against all of them)?

Gradients (one step): per run, the input gradient (`input.*`) and the weight gradients (`router.*`, `experts.*`, the
experts also one by one) judged apart; a departure is named with the rule's words, how far past its limit, and the
run's least-squares scale against the truth in that group (a gradient scaled by a wrong factor shows the factor).
Training (K steps): per run and per step, the per-element error of the weights after the step (`weights.router.all`,
`weights.experts.all`) and of the gradient the step took (`grad.router.all`, `grad.experts.all`) judged against the
other correct runs at that step; the step each run first leaves the band, by how much, and the steps it is out.
Besides: the fp64 truths of every run compared across layouts (their random projections), reruns against run 0
(fingerprints), and the loss and gradient norm of each run against the truth's. Pure Python: no torch."""

from __future__ import annotations

import math

from ...findings.common import groups, guarded
from ...findings.model import FAIL, MIXED, NA, PASS, Count, Evidence, Finding, case_keys, commits_of
from ...findings.model import subject_of as _subject_of
from ...layout import Layout
from . import rule

GRADIENTS = "oracle_gradients"
TRAJECTORY = "oracle_trajectory"
Q_GRAD = "gradients vs fp64"
Q_TRAIN = "training vs fp64"
Q_TRUTH = "fp64 truth across layouts"
Q_RERUN = "gradient reruns"
Q_PAIR = "gradient gap between two runs"
PAIR_GROUPS = {"input": "input gradient", "output": "output", "router": "router gradient",
               "experts": "expert gradients"}
"""The tensors of a pair's gap (`gradients.pair_with_first`), as a reader calls them."""
PAIR_ELEMENTS = {"input": "input-gradient elements", "output": "output elements",
                 "router": "router-gradient elements", "experts": "expert-gradient elements"}
GRADIENT_PARTS = {"input gradient": ("input.",), "weight gradients": ("router.", "experts.")}
"""What one step's verdict judges, part by part: the groups (by prefix) of each part."""
TRAJECTORY_PARTS = {"weights": ("weights.router.all", "weights.experts.all"),
                    "gradients": ("grad.router.all", "grad.experts.all")}
"""What a training step's verdict judges: the weights the step leaves and the gradient it took, each tensor whole."""
UNJUDGED = "not judged (fewer than two distinct known-correct computations besides it: bitwise reruns count once)"
FP64_AGREE = 1e-12
"""fp64 truths of two layouts must agree to this relative distance (their projections): sums in another order move
an fp64 value by a few of its ULPs (2.2e-16 each), a bf16 ULP is 2**-8 relative — nine orders of magnitude apart."""


def _alike_words(v) -> str:
    """The groups a verdict left unjudged because every other correct run computed them alike."""
    g = getattr(v, "unjudged_groups", ())
    if not g:
        return ""
    shown = ", ".join(g[:4]) + (f" and {len(g) - 4} more" if len(g) > 4 else "")
    return f"; not judged at {shown}: every other correct run computes {'it' if len(g) == 1 else 'them'} alike"


def subject_of(rec: dict, **extra) -> dict:
    """A run's subject: its layer with the tokens of a step's global batch (not the profile's seq_len)."""
    cfg = rec.get("config") if isinstance(rec, dict) else None
    if isinstance(cfg, dict) and isinstance(rec.get("tokens"), int):
        rec = {**rec, "config": {**cfg, "seq_len": rec["tokens"]}}
    return _subject_of(rec, **extra)


def layout_of(r: dict) -> str:
    return Layout(tp=r.get("tp", 1) or 1, ep=r["ep"], etp=r.get("etp", 0) or 0,
                  sequence_parallel=bool(r.get("sequence_parallel", False))).spec()


def name_of(r: dict) -> str:
    """A run's name: its layout, its rerun, its planted bug (the case's `run_name` where the record has it)."""
    if r.get("run_name"):
        return str(r["run_name"])
    m = r.get("mistake") or "none"
    return layout_of(r) + (f" run {r['run']}" if r.get("run") else "") + (f" + planted {m}" if m != "none" else "")


def planted(r: dict) -> bool:
    return (r.get("mistake") or "none") != "none"


def _select(stats: dict, prefixes) -> dict:
    return {g: s for g, s in stats.items() if any(g == p or (p.endswith(".") and g.startswith(p)) for p in prefixes)}


def judge(stats_by_run: dict[str, dict], good: list[str], prefixes,
          leave_out: dict[str, list[str]] | None = None) -> dict[str, rule.RunVerdict]:
    """The rule's verdict on every run for the groups named by `prefixes` (a prefix ending in '.' takes every group
    under it; otherwise the group itself), against the known-correct runs `good`, each run's band leaving out
    `leave_out[run]` besides the run itself (`reruns_of`)."""
    return rule.judge_runs({n: _select(s, prefixes) for n, s in stats_by_run.items()}, good, leave_out=leave_out)


def reruns_of(runs: dict[str, dict]) -> dict[str, list[str]]:
    """Per run, the other runs of its layout and planted bug (its reruns): a layout is held to the other layouts,
    not to copies of itself."""
    key = {n: (layout_of(r), r.get("mistake") or "none") for n, r in runs.items()}
    return {n: [m for m in runs if m != n and key[m] == key[n]] for n in runs}


def _fmt(x) -> str:
    return f"{x:.3g}" if isinstance(x, (int, float)) and math.isfinite(x) else str(x)


def _in_band_words(stats: dict, group: str) -> str:
    s = stats.get(group) or {}
    return (f"{group}: median {_fmt(s.get('median'))}, p99 {_fmt(s.get('p99'))}, max {_fmt(s.get('max'))} ULP"
            if s else group)


def _departure(v: rule.RunVerdict, scale: dict) -> str:
    d = v.first
    sc = scale.get(d.group)
    tail = f"; scale against the truth there ×{sc:.3g}" if isinstance(sc, (int, float)) and math.isfinite(sc) else ""
    return (f"not explained by rounding — first departs at {d.words()}; worst ULP statistic {v.excess():.3g}× its "
            f"limit, {len(v.departures)} group statistic(s) out of band{tail}")


def _rel(a, b) -> float:
    return abs(a - b) / abs(b) if b else (0.0 if a == b else math.inf)


# ---------------------------------------------------------------------------------------------- one step


def _gradients(sub: list[dict]) -> list[Finding]:
    runs = {name_of(r): r for r in sub}
    good = [n for n, r in runs.items() if not planted(r)]
    stats = {n: r["stats"] for n, r in runs.items()}
    r0 = sub[0]
    subj = subject_of(r0)
    out: list[Finding] = []
    verdicts = {part: judge(stats, good, pre, reruns_of(runs)) for part, pre in GRADIENT_PARTS.items()}
    story_ok = []
    for n, r in runs.items():
        parts, ok = [], True
        for part, pre in GRADIENT_PARTS.items():
            v = verdicts[part][n]
            if not v.judged:
                parts.append(f"{part}: {UNJUDGED}")
                ok = None if ok is not False else ok
                continue
            if v.in_band:
                first = f"{pre[0]}all"
                parts.append(f"{part}: expected (inside the band of {len(v.band_runs)} known-correct run(s); "
                             f"{_in_band_words(r['stats'], first)}){_alike_words(v)}")
            else:
                ok = False
                parts.append(f"{part}: {_departure(v, r.get('scale') or {})}")
        status = NA if ok is None else PASS if ok else FAIL
        norm = (f"gradient norm {_fmt(r['grad_norm'])} vs the truth's {_fmt(r['grad_norm_truth'])} "
                f"(×{r['grad_norm'] / r['grad_norm_truth']:.4g})" if r.get("grad_norm_truth") else "")
        role = "planted bug" if planted(r) else "correct run"
        claim = f"{n} ({role}, dp {r['dp']}, expert dp {r['expert_dp']}): " + "; ".join(parts)
        out.append(Finding(GRADIENTS, Q_GRAD, {**subj, "run": n}, status, claim,
                           Evidence(records=case_keys([r]), notes=[norm] if norm else []), commits=commits_of([r])))
        story_ok.append((n, planted(r), ok))
    out.append(_summary(GRADIENTS, Q_GRAD, sub, subj, story_ok, "one step's gradients"))
    out += _pairs(runs, {n: ok for n, _, ok in story_ok}, subj)
    out += _truths(GRADIENTS, sub, subj, lambda r: [(g, r["truth_sketch"][g], r["truth_norm"][g])
                                                    for g in sorted(r["truth_sketch"])])
    out += _reruns(GRADIENTS, sub, subj, lambda r: [r["fingerprints"]])
    return out


def _pairs(runs: dict[str, dict], ok: dict[str, bool | None], subj: dict) -> list[Finding]:
    """Each run against the first correct run it was paired with on the engines: expected (both inside the band) with
    the gap a test of the two needs, per tensor as `assert_close`; not explained by rounding where either departs
    (naming it); not judged where either has no verdict; said where no pair was measured."""
    out = []
    for n, r in runs.items():
        p = r.get("pair")
        if not isinstance(p, dict) or p.get("first"):
            continue
        b = p.get("with")
        if not b:
            out.append(Finding(GRADIENTS, Q_PAIR, {**subj, "run": n}, NA,
                               f"{n}: no gap to another run measured — {p.get('reason')}",
                               Evidence(records=case_keys([r])), commits=commits_of([r])))
            continue
        gaps = {g: rule.Tolerance(**t) for g, t in (p.get("gaps") or {}).items()}
        order = [g for g in PAIR_GROUPS if g in gaps] + [g for g in sorted(gaps) if g not in PAIR_GROUPS]
        gap = "; ".join(f"{PAIR_GROUPS.get(g, g)}: {gaps[g].words()}" for g in order)
        mine, theirs = ok.get(n), ok.get(b)
        departs = [x for x, o in ((n, mine), (b, theirs)) if o is False]
        if departs:
            status = FAIL
            head = (f"not explained by rounding — {' and '.join(departs)} departs from the truth (its verdict); "
                    "a tolerance as wide as this gap would pass it")
        elif mine is None or theirs is None:
            status = NA
            head = "not judged — " + (f"{b} is not among this layer's runs" if b not in runs else UNJUDGED)
        else:
            status = PASS
            head = "expected (both inside the band of the known-correct runs); the gap a test of the two needs"
        rel = [r] + ([runs[b]] if b in runs else [])
        # the bits that differ, tensor by tensor (the expert gradients first: where layouts part), each with its
        # denominator — what a comparison of two reports holds side by side
        counts = [Count(gaps[g].differ, gaps[g].n, f"{PAIR_ELEMENTS.get(g, g + ' elements')} differing, {n} vs {b}")
                  for g in sorted(order, key=lambda g: g != "experts")]
        out.append(Finding(GRADIENTS, Q_PAIR, {**subj, "run": n}, status, f"{n} vs {b}: {head} — {gap}",
                           Evidence(records=case_keys(rel), counts=counts), commits=commits_of(rel)))
    return out


def _summary(exp: str, question: str, sub: list[dict], subj: dict, story: list[tuple], what: str) -> Finding:
    """The card: how many correct runs are expected and how many planted bugs are caught — the counts as measured,
    whichever way they fall."""
    correct = [(n, ok) for n, p, ok in story if not p]
    bugs = [(n, ok) for n, p, ok in story if p]
    c_in = [n for n, ok in correct if ok]
    c_out = [n for n, ok in correct if ok is False]
    b_out = [n for n, ok in bugs if ok is False]
    b_in = [n for n, ok in bugs if ok]
    unjudged = [n for n, _, ok in story if ok is None]
    parts = [f"{len(c_in)} of {len(correct)} correct run(s) inside the band of the others"]
    if c_out:
        parts.append(f"outside it: {', '.join(c_out)}")
    if bugs:
        parts.append(f"{len(b_out)} of {len(bugs)} planted bug(s) not explained by rounding"
                     + (f" ({', '.join(b_out)})" if b_out else ""))
        if b_in:
            parts.append(f"inside the band although planted: {', '.join(b_in)}")
    if unjudged:
        parts.append(f"not judged: {', '.join(unjudged)}")
    judged = [ok for _, _, ok in story if ok is not None]
    if not judged:
        status = NA
    elif not c_out and not b_in:
        status = PASS
    elif c_in or b_out:
        status = MIXED
    else:
        status = FAIL
    short = (f"{len(c_in)}/{len(correct)} layouts as rounding gives"
             + (f"; {len(b_out)}/{len(bugs)} planted bugs caught" if bugs else ""))
    return Finding(exp, question, subj, status, f"{what} against fp64: " + "; ".join(parts),
                   Evidence(records=case_keys(sub)), card=True, commits=commits_of(sub), short=short)


def _truths(exp: str, sub: list[dict], subj: dict, tensors) -> list[Finding]:
    """The fp64 truths of every run against the first run's (their projections: the same random directions at every
    layout): the largest relative distance over tensors (and steps)."""
    ref = sub[0]
    worst, where = 0.0, ""
    for r in sub[1:]:
        for (g, sa, na), (_, sb, nb) in zip(tensors(r), tensors(ref)):
            d = math.sqrt(sum((x - y) ** 2 for x, y in zip(sa, sb)) / len(sa)) if sa else 0.0
            rel = d / nb if nb else (0.0 if d == 0 else math.inf)
            if rel > worst or not where:
                worst, where = max(worst, rel), f"{name_of(r)}, {g}"
    if len(sub) < 2:
        return []
    ok = worst <= FP64_AGREE
    claim = (f"the fp64 truths of {len(sub)} runs at {len({layout_of(r) for r in sub})} layout(s) agree with "
             f"{name_of(ref)}'s to {worst:.2g} relative at most ({where}), "
             + ("within" if ok else "beyond") + f" fp64 rounding ({FP64_AGREE:g})")
    return [Finding(exp, Q_TRUTH, subj, PASS if ok else FAIL, claim, Evidence(records=case_keys(sub)),
                    commits=commits_of(sub))]


def _reruns(exp: str, sub: list[dict], subj: dict, fingerprints) -> list[Finding]:
    """Every rerun (run > 0) against run 0 of its layout and bug: bitwise equal in every tensor compared, or not."""
    out = []
    base = {(layout_of(r), r.get("mistake") or "none"): r for r in sub if not r.get("run")}
    for r in sub:
        if not r.get("run"):
            continue
        r0 = base.get((layout_of(r), r.get("mistake") or "none"))
        if r0 is None:
            continue
        fa, fb = fingerprints(r), fingerprints(r0)
        differ = sorted({k for x, y in zip(fa, fb) for k in set(x) | set(y) if x.get(k) != y.get(k)})
        n = len({k for x in fa for k in x}) * 1
        claim = (f"{name_of(r)} against run 0: " + ("bitwise equal in every tensor compared" if not differ else
                                                    f"differs in {len(differ)} tensor(s) ({', '.join(differ[:4])})")
                 + f" ({n} tensor(s)" + (f" over {len(fa)} step(s))" if len(fa) > 1 else ")"))
        out.append(Finding(exp, Q_RERUN, {**subj, "run": name_of(r)}, PASS if not differ else MIXED, claim,
                           Evidence(records=case_keys([r, r0])), commits=commits_of([r, r0])))
    return out


# ---------------------------------------------------------------------------------------------- K steps


def step_verdicts(runs: dict[str, dict]) -> list[dict[str, dict[str, rule.RunVerdict]]]:
    """Per step (0-based) and part of `TRAJECTORY_PARTS`: every run's verdict against the correct runs at that step."""
    good = [n for n, r in runs.items() if not planted(r)]
    K = min(len(r["steps_compared"]) for r in runs.values())
    out = []
    for t in range(K):
        stats = {n: r["steps_compared"][t]["stats"] for n, r in runs.items()}
        out.append({part: judge(stats, good, groups_, reruns_of(runs)) for part, groups_ in TRAJECTORY_PARTS.items()})
    return out


def _steps_text(steps: list[int]) -> str:
    if not steps:
        return "none"
    spans, start = [], steps[0]
    for a, b in zip(steps, steps[1:] + [None]):
        if b != a + 1:
            spans.append(f"{start}" if start == a else f"{start}–{a}")
            start = b
    return ", ".join(spans)


def _trajectory(sub: list[dict]) -> list[Finding]:
    runs = {name_of(r): r for r in sub}
    per_step = step_verdicts(runs)
    K = len(per_step)
    r0 = sub[0]
    subj = subject_of(r0)
    out, story = [], []
    for n, r in runs.items():
        judged = all(per_step[t][p][n].judged for t in range(K) for p in TRAJECTORY_PARTS)
        outside = {p: [t + 1 for t in range(K) if not per_step[t][p][n].in_band] for p in TRAJECTORY_PARTS}
        steps_out = sorted({t for ts in outside.values() for t in ts})
        role = "planted bug" if planted(r) else "correct run"
        norm = [s["grad_norm"] / s["grad_norm_truth"] for s in r["steps_compared"][:K] if s["grad_norm_truth"]]
        loss = [_rel(s["loss"], s["loss_truth"]) for s in r["steps_compared"][:K]]
        ctx = (f"over the {K} steps: loss within {max(loss):.2g} of the truth's (relative), gradient norm "
               f"×{min(norm):.4g}–×{max(norm):.4g} the truth's" if K and norm else "")
        if not steps_out and not judged:  # a departure measured at some step stands; else no band, no verdict
            status, head = NA, UNJUDGED
        elif not steps_out:
            status, head = PASS, f"inside the band of the other correct runs at every one of its {K} steps"
        else:
            t1 = steps_out[0]
            parts = []
            for p in TRAJECTORY_PARTS:
                v = per_step[t1 - 1][p][n]
                if not v.in_band:
                    sc = r["steps_compared"][t1 - 1].get("scale", {}).get(v.first.group)
                    tail = f", scale against the truth ×{sc:.3g}" if isinstance(sc, (int, float)) else ""
                    parts.append(f"{p}: {v.first.words()} ({v.excess():.3g}× its limit{tail})")
            each = "; ".join(f"{p} out at step(s) {_steps_text(ts)}" for p, ts in outside.items())
            status = FAIL
            head = (f"leaves the band at step {t1} of {K} — " + "; ".join(parts) + f"; out of band at step(s) "
                    f"{_steps_text(steps_out)} ({each})")
        claim = f"{n} ({role}): {head}"
        out.append(Finding(TRAJECTORY, Q_TRAIN, {**subj, "run": n}, status, claim,
                           Evidence(records=case_keys([r]), notes=[ctx] if ctx else []), commits=commits_of([r])))
        story.append((n, planted(r), False if steps_out else None if not judged else True))
    out.append(_summary(TRAJECTORY, Q_TRAIN, sub, subj, story, f"{K} training steps (weights and gradients, per step)"))
    out += _truths(TRAJECTORY, sub, subj,
                   lambda r: [(f"step {t + 1} {g}", s["truth_sketch"][g], s["truth_norm"][g])
                              for t, s in enumerate(r["steps_compared"][:K]) for g in sorted(s["truth_sketch"])])
    out += _reruns(TRAJECTORY, sub, subj, lambda r: [s["fingerprints"] for s in r["steps_compared"][:K]])
    return out


# ---------------------------------------------------------------------------------------------- entry


def findings(records: list[dict]) -> list[Finding]:
    out: list[Finding] = []
    for exp, build, q in ((GRADIENTS, _gradients, Q_GRAD), (TRAJECTORY, _trajectory, Q_TRAIN)):
        recs = [r for r in records if isinstance(r, dict) and r.get("experiment") == exp and "skipped" not in r]
        bad = [r for r in recs if r.get("available") is False]
        recs = [r for r in recs if r.get("available", True)]
        for _key, sub in groups(recs, axes=()).items():
            out += guarded(exp, q, sub, lambda sub=sub, build=build: build(sub))
        if bad:
            out.append(Finding(exp, q, subject_of(bad[0]), NA,
                               f"{len(bad)} run(s) did not run: " + "; ".join(sorted({str(r.get('reason'))[:160]
                                                                                      for r in bad})),
                               Evidence(records=case_keys(bad)), commits=commits_of(bad)))
    return out


__all__ = ["findings", "judge", "reruns_of", "step_verdicts", "name_of", "layout_of", "planted", "GRADIENT_PARTS",
           "TRAJECTORY_PARTS", "GRADIENTS", "TRAJECTORY", "Q_GRAD", "Q_TRAIN", "Q_TRUTH", "Q_RERUN", "Q_PAIR",
           "PAIR_GROUPS", "FP64_AGREE"]
