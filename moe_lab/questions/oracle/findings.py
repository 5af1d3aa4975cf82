"""Notebook 08's findings: per dispatcher, is every layout's gap to the fp64 truth what rounding gives (the rule of
`rule`: each run against the band of the other layouts' runs), what tolerance a test of two layouts needs, whether
the planted faults were caught, dispatcher against dispatcher, the routing flips and their margins, and the fp64
truth across layouts. Torch-free."""

from __future__ import annotations

from . import memory, rule
from ...findings.common import groups, guarded
from ...findings.model import FAIL, MIXED, NA, PASS, Count, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "oracle"
QUESTION = "gap expected"
TOLERANCE = "tolerance a test needs"
CONTROLS = "planted faults"
DISPATCHERS = "dispatcher against dispatcher"
FLIPS = "routing flips at near-ties"
TRUTH = "fp64 truth across layouts"
BELOW_ROUNDING = ("scale_expert",)
"""Faults planted to be below what rounding lets the oracle see: said as such, never counted as caught or missed."""


def judged(rec: dict) -> dict[str, rule.RunVerdict]:
    """Every run of a record judged by the rule: the known-correct set is every layout run (faults are not); a
    layout's runs are held to the other layouts' (its own reruns and itself left out of its band)."""
    runs = rec["runs"]
    stats = {r["label"]: r["stats"] for r in runs}
    good = [r["label"] for r in runs if not r.get("fault")]
    same = {r["label"]: [o["label"] for o in runs if not o.get("fault") and o["layout"] == r["layout"]
                         and o.get("dispatcher") == r.get("dispatcher")] for r in runs if not r.get("fault")}
    flips = {r["label"]: r["flips"]["flipped_margin_ulp"] for r in runs}
    counts = {r["label"]: r["flips"].get("count_changed") for r in runs}
    return rule.judge_runs(stats, known_good=good, flipped_margins=flips, leave_out=same, routed_counts=counts)


def pair_of(rec: dict, a: str, b: str) -> dict | None:
    for p in rec.get("pairs") or []:
        if {p["a"], p["b"]} == {a, b}:
            return p
    return None


def tolerance_of(p: dict) -> rule.Tolerance:
    return rule.Tolerance(**{k: p[k] for k in rule.Tolerance.__dataclass_fields__})


def _first_run(rec: dict, dispatcher: str, layout: str) -> str | None:
    return next((r["label"] for r in rec["runs"] if r.get("dispatcher") == dispatcher and r["layout"] == layout
                 and not r.get("fault") and r["trial"] == 1), None)


def _band_words(rec: dict, verdicts: dict, group: str = "out/all") -> str:
    good = [r for r in rec["runs"] if not r.get("fault")]
    med = [r["stats"][group]["median"] for r in good if group in r["stats"]]
    p999 = [r["stats"][group]["p999"] for r in good if group in r["stats"]]
    return (f"the layouts' output |error| to the truth: median {min(med):.3g}–{max(med):.3g} ULP, p99.9 "
            f"{min(p999):.3g}–{max(p999):.3g} ULP over the {len(good)} layout runs of the record (every dispatcher)")


def _fault_words(run: dict, v: rule.RunVerdict) -> str:
    f = run["fault"]
    changed = run.get("changed")
    what = f"{run['layout']} + {f}" + (f" ({changed:,} weights changed)" if changed else "")
    if f in BELOW_ROUNDING:
        scale = "(1 + 2^-12)"
        if v.in_band:
            return (f"{what}, one expert's weights scaled by {scale} before bf16 rounding: within the band — below "
                    f"what rounding lets the oracle see (neither caught nor missed)")
        return f"{what}: out of band{_by(v)} — seen although planted below rounding: {v.first.words()}"
    if v.in_band:
        return f"{what}: NOT caught — every group and statistic within the band"
    return f"{what}: not explained by rounding{_by(v)}; first departs at {v.first.words()}"


def _by(v: rule.RunVerdict) -> str:
    how = v.excess_words()
    return f", {how}" if how else ""


def topk_differences(a: dict, b: dict) -> set[int]:
    """Tokens whose top-k sets differ between two runs, from each run's flips against the truth (a token neither
    flipped has the truth's set in both)."""
    ta, tb = a.get("flipped_topk") or {}, b.get("flipped_topk") or {}
    return {int(t) for t in set(ta) | set(tb) if ta.get(t) != tb.get(t)}


def _sized_words(rec: dict) -> str:
    """'; sized to this GPU: …' where the record's layer was sized to the GPU its ranks shared (`memory`)."""
    m = rec.get("memory")
    return f"; {memory.OracleSizing(**m).words()}" if m else ""


def _one(rec: dict) -> list[Finding]:
    verdicts = judged(rec)
    out: list[Finding] = []
    ev_keys = case_keys([rec])
    commits = commits_of([rec])
    ref = rec["reference"]
    dispatchers = list(rec.get("dispatchers") or [rec.get("dispatcher")])
    for d in dispatchers:
        runs = [r for r in rec["runs"] if r.get("dispatcher") == d]
        layout_runs = [r for r in runs if not r.get("fault")]
        faults = [r for r in runs if r.get("fault")]
        subj = subject_of(rec, reference=ref)
        subj["dispatcher"] = d
        out_of_band = [r for r in layout_runs if not verdicts[r["label"]].in_band]
        unjudged = [r for r in layout_runs if not verdicts[r["label"]].judged]
        controls = [r for r in faults if r["fault"] not in BELOW_ROUNDING]
        missed = [r for r in controls if verdicts[r["label"]].in_band]
        ref_label = _first_run(rec, d, ref)
        tol_parts, ev = [], Evidence(records=ev_keys)
        for lay in rec["layouts"]:
            x = _first_run(rec, d, lay)
            if lay == ref or x is None or ref_label is None:
                continue
            p = pair_of(rec, ref_label, x)
            if p is not None:
                t = tolerance_of(p)
                tol_parts.append(f"{lay} vs {ref}: {t.words()}")
                ev.counts.append(Count(t.differ, t.n, f"output elements differing, {lay} vs {ref} ({d})"))
        reruns = [pair_of(rec, r["label"], _first_run(rec, d, r["layout"])) for r in layout_runs if r["trial"] > 1]
        reruns = [p for p in reruns if p is not None]
        rerun_words = (f"reruns: {sum(p['differ'] for p in reruns):,} of {sum(p['n'] for p in reruns):,} output "
                       f"elements differ from their first run ({len(reruns)} reruns)") if reruns else "no reruns"
        control_words = "; ".join(_fault_words(r, verdicts[r["label"]]) for r in faults) or "no fault planted"
        if not layout_runs or unjudged:
            names = sorted({r["layout"] for r in unjudged})
            status, head, short = NA, (f"not judged: {', '.join(names)} has fewer than two other distinct "
                                       "computations (layouts, or reruns that differ) to measure a band from — run "
                                       "more layouts"), "not judged"
        elif out_of_band:
            names = sorted({r["layout"] for r in out_of_band})
            worst = max(out_of_band, key=lambda r: verdicts[r["label"]].excess())
            status = FAIL
            head = (f"not explained by rounding: {', '.join(names)} measurably farther from the fp64 truth than the "
                    f"other layouts ({worst['label']}{_by(verdicts[worst['label']])}; first departs "
                    f"at {verdicts[worst['label']].first.words()})")
            short = f"no — {', '.join(names)} out of band"
        elif missed:
            status = MIXED
            head = (f"every layout within the band of the others, but the rule did not catch "
                    f"{len(missed)} of {len(controls)} planted faults ({', '.join(r['fault'] for r in missed)}), so "
                    "'within the band' here tells little")
            short = f"in band; {len(missed)}/{len(controls)} controls missed"
        else:
            status = PASS
            head = (f"expected: every layout's bf16 output is as close to the fp64 truth as the other layouts' (all "
                    f"{len(layout_runs)} runs of {len(rec['layouts'])} layouts within the band in every group and "
                    f"statistic), and {len(controls)} of {len(controls)} planted faults were caught")
            short = f"yes — {len(rec['layouts'])} layouts in band; {len(controls)}/{len(controls)} faults caught"
        claim = (f"{d}: {head} — {_band_words(rec, verdicts)}; {rerun_words}; planted: {control_words}"
                 f"{_sized_words(rec)}")
        out.append(Finding(EXPERIMENT, QUESTION, subj, status, claim, ev, card=True, commits=commits, short=short))
        if tol_parts:
            out.append(Finding(EXPERIMENT, TOLERANCE, dict(subj), PASS if status == PASS else status,
                               f"{d}: the tolerance each layout needs against {ref} (measured on the pair's outputs): "
                               + "; ".join(tol_parts), Evidence(records=ev_keys, counts=list(ev.counts)),
                               commits=commits))
        flip_parts = []
        for r in runs:
            fl = r["flips"]
            if fl["flipped"]:
                ms = ", ".join(f"{m:.3g}" for m in sorted(fl["flipped_margin_ulp"])[:6])
                flip_parts.append(f"{r['label']}: {fl['flipped']} of {fl['tokens']} tokens (margins {ms} ULP)")
        q = runs[0]["flips"]["margin_ulp_quantiles"] if runs else {}
        limit = next((dep.band.limit for r in runs for dep in verdicts[r["label"]].departures
                      if dep.statistic == rule.FLIP), None)
        lim = rule.flip_limit({r["label"]: r["stats"] for r in layout_runs}, "router.logits/all")
        flips_claim = (f"{d}: top-k sets that differ from the truth's — "
                       + ("; ".join(flip_parts) if flip_parts else f"none in {len(runs)} runs")
                       + f"; every token's margin in the truth (k-th minus (k+1)-th router logit, ULP of bf16 at the "
                         f"k-th): min {q.get('min', float('nan')):.3g}, p1 {q.get('p1', float('nan')):.3g}, median "
                         f"{q.get('median', float('nan')):.3g}"
                       + (f"; a rounding flip can have a margin up to {lim:.3g} ULP (twice the layouts' router-logit "
                          f"error limit)" if lim is not None else ""))
        between = []
        first_runs = {r["layout"]: r for r in layout_runs if r["trial"] == 1}
        ref_run = first_runs.get(ref)
        for lay, r in first_runs.items():
            if ref_run is None or lay == ref or "flipped_topk" not in r["flips"]:
                continue
            n = len(topk_differences(ref_run["flips"], r["flips"]))
            between.append(f"{lay} vs {ref}: {n} of {r['flips']['tokens']} tokens")
        if between:
            flips_claim += "; top-k sets differing between layouts: " + ", ".join(between)
        layout_flips = [r for r in layout_runs if any(dep.statistic == rule.FLIP
                                                      for dep in verdicts[r["label"]].departures)]
        out.append(Finding(EXPERIMENT, FLIPS, dict(subj), FAIL if layout_flips else PASS, flips_claim,
                           Evidence(records=ev_keys, notes=[f"flip limit {limit:.3g} ULP"] if limit else []),
                           commits=commits))
    if len(dispatchers) >= 2:
        a_d, b_d = dispatchers[0], dispatchers[1]
        parts, counts, bad = [], [], []
        for lay in rec["layouts"]:
            a, b = _first_run(rec, a_d, lay), _first_run(rec, b_d, lay)
            p = pair_of(rec, a, b) if a and b else None
            if p is None:
                continue
            t = tolerance_of(p)
            ok = verdicts[a].in_band and verdicts[b].in_band
            if not ok:
                bad.append(lay)
            parts.append(f"{lay}: {'expected' if ok else 'not explained by rounding'}, {t.words()}")
            counts.append(Count(t.differ, t.n, f"output elements differing, {a_d} vs {b_d} at {lay}"))
        if parts:
            subj = subject_of(rec, reference=ref)
            subj["dispatcher"] = f"{a_d} vs {b_d}"
            out.append(Finding(EXPERIMENT, DISPATCHERS, subj, FAIL if bad else PASS,
                               f"{a_d} against {b_d}, same layer and tokens: " + "; ".join(parts),
                               Evidence(records=ev_keys, counts=counts), commits=commits))
    fl = rec.get("fp64_layouts") or {}
    if fl:
        worst = max(v["max_abs"] for v in fl.values())
        subj = subject_of(rec, reference=ref)
        out.append(Finding(EXPERIMENT, TRUTH, subj, PASS if worst < 1e-12 and all(v["routing_equal"] for v in fl.values())
                           else FAIL,
                           f"the fp64 truth of each layout's own weights against {ref}'s: "
                           + "; ".join(f"{k}: max abs {v['max_abs']:.3g}, max rel {v['max_rel']:.3g}, routing "
                                       f"{'equal' if v['routing_equal'] else 'differs'}" for k, v in fl.items()),
                           Evidence(records=ev_keys), commits=commits))
    return out


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict) and r.get("kind") == "oracle" and "skipped" not in r]
    out: list[Finding] = []
    for _key, sub in groups(recs).items():
        for rec in sub:
            out += guarded(EXPERIMENT, QUESTION, [rec], lambda rec=rec: _one(rec))
    return out


__all__ = ["findings", "judged", "topk_differences", "EXPERIMENT", "QUESTION", "TOLERANCE", "DISPATCHERS", "FLIPS", "TRUTH"]
