"""Notebook 01's second question: the same weights and tokens under another layout — do the bits change,
from which stage, and is it the layout or run-to-run nondeterminism? A layout is said to change the bits (FAIL) only
next to its controls — its own rerun and the reference against its stored output — by the same rule as the ranks of
notebook 01 (`labels.attribution`): the controls repeat in every trial, or the layout's difference dominates theirs
(>= EP_DOMINANCE times the elements); otherwise it is not told apart from run-to-run nondeterminism (MIXED)."""

from __future__ import annotations

from ...findings.common import applicable, count, describe, groups, guarded, trials
from ...findings.labels import EP_DOMINANCE, attribution
from ...findings.model import FAIL, MIXED, NOT_MEASURED, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "layouts"
QUESTION = "layout changes the bits"


def _who(r: dict) -> str:
    """'allgather, router none' (+ ', deterministic' where deterministic mode was on)."""
    return f"{r['dispatcher']}, router {r['router_dtype']}" + (", deterministic" if r.get("deterministic") else "")


def _noise(r: dict, ref: dict | None) -> dict:
    """The worst run-to-run control of a layout: its own rerun, the reference's rerun and the reference against its
    stored output (the comparison with the most differing elements; equal if every one repeats)."""
    controls = [r["rerun"]] + ([ref["rerun"], ref["vs_reference"]] if ref is not None and ref is not r else [])
    controls = [c for c in controls if applicable(c)]
    return max(controls, key=lambda c: (not c["bitwise_equal"], c.get("n_mismatch") or 0))


def _one(r: dict, ref: dict | None) -> Finding:
    c, rr = r["vs_reference"], r["rerun"]
    k, n = trials(c)
    rerun_k, _ = trials(rr)
    noise = _noise(r, ref)
    why = attribution(c, noise)
    first = r.get("first_divergent_stage")
    subj = subject_of(r, router_dtype=r["router_dtype"], layout=r["layout"], deterministic=bool(r.get("deterministic")))
    ev = Evidence(records=case_keys([r]), trials=(k, n))
    claim = f"{_who(r)}, {r['layout']} vs {r['reference_layout']}: "
    if k == 0:
        status = PASS
        claim += f"output {describe(c)}"
    else:
        # FAIL only beside a control: the reruns repeat, or the layout's difference dominates them
        status = FAIL if why in ("ep", "ep+nondeterminism") and ref is not None else MIXED
        claim += f"{describe(c, 'output elements')}; first divergent stage {first or 'out'}"
        ev.counts.append(count(c, "output elements"))
        if ref is None:
            ev.notes.append("the reference layout's own repeat was not measured: no control, not told apart from "
                            "run-to-run nondeterminism")
        elif why == "ep+nondeterminism":
            ev.notes.append(f"the controls differ too, but in every trial the layout changes >= {EP_DOMINANCE}x the "
                            f"elements of the worst control ({describe(noise, 'output elements')})")
        elif why == "nondeterminism":
            ev.notes.append(f"not told apart from run-to-run nondeterminism: a control differs about as much "
                            f"({describe(noise, 'output elements')})")
        routing = r["stages_vs_reference"].get("router.routing_map", {})
        if applicable(routing):
            rk, _ = trials(routing)
            ev.notes.append("the routing map is the reference's in every trial: only the arithmetic's order moved"
                            if rk == 0 else
                            f"the routing itself moved: {describe(routing, 'routing-map entries')}")
    g = r.get("grad_vs_nograd")
    if applicable(g) and not g.get("bitwise_equal", True):
        ev.notes.append(f"with grad enabled (a training step's forward) the output differs from the no-grad forward "
                        f"compared here: {describe(g, 'output elements')} — "
                        + ("a training job sees the grad-enabled one" if not rerun_k else
                           "not told apart from run-to-run nondeterminism: this layout's reruns differ too"))
    if rerun_k:
        ev.notes.append(f"a rerun of this layout differs too ({rerun_k} of {n} trials): run-to-run nondeterminism is "
                        "part of it")
    return Finding(EXPERIMENT, QUESTION, subj, status, claim, ev, commits=commits_of([r]))


def _summary(sub: list[dict], per: list[Finding]) -> list[Finding]:
    others = [f for f in per if f.subject.get("layout") != sub[0].get("reference_layout")]
    r0 = sub[0]
    subj = subject_of(r0, router_dtype=r0["router_dtype"], deterministic=bool(r0.get("deterministic")))
    ref = next((r for r in sub if r.get("is_reference")), None)
    if not others:
        return [Finding(EXPERIMENT, QUESTION, subj, NOT_MEASURED,
                        f"{_who(r0)}: no layout other than the reference "
                        f"{r0['reference_layout']} "
                        "was measured — nothing is claimed about layouts", Evidence(records=case_keys(sub)),
                        card=r0["router_dtype"] == "none", commits=commits_of(sub), short="no other layout measured")]
    differ = [f for f in others if f.status != PASS]
    status = PASS if not differ else FAIL if all(f.status == FAIL for f in differ) else MIXED
    names = ", ".join(f.subject["layout"] for f in differ)
    untold = [f for f in differ if f.status != FAIL]
    claim = (f"{_who(r0)}: {len(differ)} of {len(others)} layout(s) change the "
             f"output bits against {r0['reference_layout']}" + (f" ({names})" if differ else ""))
    if untold:  # the words say no more than the controls allow
        claim = (f"{_who(r0)}: {len(differ)} of {len(others)} layout(s) give other output bits than "
                 f"{r0['reference_layout']} ({names}); {len(differ) - len(untold)} of them told apart from run-to-run "
                 "nondeterminism by their controls (own rerun, the reference's repeat)")
    ev = Evidence(records=case_keys(sub))
    if ref is not None:  # the control: the reference against itself, run again
        ev.notes.append(f"the reference against its own stored output: {describe(ref['vs_reference'])}")
    note = grad_mode_note(sub)
    if note:
        ev.notes.append(note)
    short = (f"layouts: {len(others)} equal to {r0['reference_layout']}" if not differ else
             f"layouts: {len(differ)} of {len(others)} differ from {r0['reference_layout']}"
             + (f" ({len(untold)} not told apart from run-to-run)" if untold else ""))
    return [Finding(EXPERIMENT, QUESTION, subj, status, claim, ev, card=r0["router_dtype"] == "none",
                    commits=commits_of(sub), short=short)]


def grad_mode_note(sub: list[dict]) -> str | None:
    """Does a training step's forward (grad enabled) see other bits than the no-grad forward compared here? Told only
    where the layout's no-grad forward repeats bit for bit in every trial (the control); elsewhere a difference is
    not told apart from run-to-run nondeterminism, and the note says how many layouts that leaves out."""
    measured = [r for r in sub if applicable(r.get("grad_vs_nograd"))]
    if not measured:
        return None
    steady = [r for r in measured if trials(r["rerun"])[0] == 0]
    moved = [r for r in steady if not r["grad_vs_nograd"]["bitwise_equal"]]
    if not steady:
        return (f"forwards compared with grad disabled; the no-grad forward of none of the {len(measured)} layout(s) "
                "repeats bit for bit, so whether a training step's forward (grad enabled) sees other bits is not told "
                "apart from run-to-run nondeterminism")
    text = (f"forwards compared with grad disabled; with grad enabled (a training step's forward) the output differs "
            f"in {len(moved)} of {len(steady)} layout(s) whose no-grad forward repeats bit for bit")
    if moved:
        text += (" (" + ", ".join(f"{r['layout']}: {r['grad_vs_nograd']['n_mismatch']:,} elements" for r in moved)
                 + ") — there a training job sees other bits than these forwards")
    if len(steady) < len(measured):
        text += (f"; in the other {len(measured) - len(steady)} the reruns differ, so a grad-mode difference is not "
                 "told apart from run-to-run nondeterminism")
    return text


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict) and r.get("experiment") == EXPERIMENT
            and r.get("kind") == "layout" and "skipped" not in r]
    out: list[Finding] = []
    for _key, sub in groups(recs, "router_dtype", "deterministic").items():
        def build(sub=sub):
            ref = next((r for r in sub if r.get("is_reference")), None)
            per = [_one(r, ref) for r in sub]
            return _summary(sub, per) + [f for f in per if not f.subject.get("layout") == sub[0]["reference_layout"]]
        out += guarded(EXPERIMENT, QUESTION, sub, build)
    return out


__all__ = ["findings", "grad_mode_note", "EXPERIMENT", "QUESTION"]
