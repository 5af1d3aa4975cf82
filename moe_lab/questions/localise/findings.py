"""Notebook 02's findings: per dispatcher and probs-path variant, the first stage that diverges across ranks (or across
identical copies within a rank), the collective and dtype it runs in; whether the gathered probs are bitwise equal;
which variants make every stage agree."""

from __future__ import annotations

from ...findings.common import groups, guarded
from ...findings.model import FAIL, MIXED, NA, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "localise"
PLAIN = "bf16 (nothing)"
COPIES = ("copies", "copies/expert")


def _first_row(records: list[dict], case: dict) -> dict | None:
    rows = [r for r in records if r.get("kind") == "stage" and r.get("case_key") == case.get("case_key")
            and r.get("stage") == case["first_divergent_stage"] and r.get("bitwise_equal") is False]
    return max(rows, key=lambda r: (r.get("n_differ") or 0, r.get("mismatch_frac") or 0), default=None)


def collective_of(case: dict) -> str | None:
    """The collective the first divergent stage is: the combine's (combine.comm) or the dispatch's (dispatch.comm.*)."""
    st = case.get("first_divergent_stage") or ""
    if st.startswith("combine.comm"):
        return f"{case.get('combine_op')} in {case.get('combine_dtype')}"
    if st.startswith("dispatch.comm.probs"):
        return f"the probs' dispatch collective in {case.get('probs_gather_dtype')}"
    return None


def stage_words(where: str, collective: str | None, inside: bool, trials_: tuple[int, int] | None) -> str:
    """'combine.comm (reduce_scatter_tensor in bfloat16), 3/3 trials' — a location, in a few words."""
    return (where + (f" ({collective})" if collective else "") + (", within one rank" if inside else "")
            + (f", in {trials_[0]}/{trials_[1]} trials" if trials_ else ""))


def _case(records: list[dict], c: dict) -> Finding:
    v = c["variant"]
    subj = subject_of(c, variant=v)
    where = c["first_divergent_stage"]
    travel = (f"probs travel in {c.get('probs_gather_dtype') or 'no collective'}, the combine "
              f"({c.get('combine_op')}) runs in {c.get('combine_dtype')}")
    ev = Evidence(records=case_keys([c]), notes=[travel])
    n = int(c.get("trials", 1) or 1)
    if not c.get("cross_rank_applicable", True):
        return Finding(EXPERIMENT, "first divergent stage", subj, NA,
                       f"{c['dispatcher']}, {v}: one rank — no stage compared across ranks or copies", ev,
                       card=v == PLAIN, commits=commits_of([c]), short="one rank: nothing compared")
    if where is None:
        return Finding(EXPERIMENT, "first divergent stage", subj, PASS,
                       f"{c['dispatcher']}, {v}: every stage agrees across ranks and across copies within a rank, in "
                       f"all {n} trial(s)", ev, card=v == PLAIN, commits=commits_of([c]),
                       short=f"no stage differs, in all {n} trials")
    row = _first_row(records, c)
    k = row.get("n_differ") if row else None
    ev.trials = (int(k), int(row.get("trials") or n)) if row and k is not None else None
    inside = c.get("first_divergent_kind") in COPIES
    coll = collective_of(c)
    claim = (f"{c['dispatcher']}, {v}: first divergent stage {where}"
             + (f" ({row.get('unit')}" + (f", in {k} of {row.get('trials')} trials" if k is not None else "") + ")"
                if row else "")
             + (" — identical copies of a token differ within one rank there" if inside else "")
             + (f"; it is the collective {coll}" if coll else "")
             + (f"; output: {c['out_mismatch_frac']:.3g} of elements differ, max {c['out_max_ulp']:.0f} ULP"
                if c.get("out_mismatch_frac") is not None else ""))
    # as notebook 01 says it: a divergence in some trials only is MIXED, in every trial FAIL
    status = MIXED if ev.trials is not None and 0 < ev.trials[0] < ev.trials[1] else FAIL
    f = Finding(EXPERIMENT, "first divergent stage", subj, status, claim, ev, card=v == PLAIN, commits=commits_of([c]),
                short=stage_words(where, coll, inside, ev.trials))
    f.subject["first_stage"], f.subject["collective"] = where, coll
    return f


def _gather(records: list[dict], d: str, sub: list[dict]) -> Finding | None:
    """The probs all-gather copies bits? The replicated dispatch.comm.probs stage across ranks, every trial."""
    keys = {c.get("case_key") for c in sub}
    rows = [r for r in records if r.get("kind") == "stage" and r.get("stage") == "dispatch.comm.probs"
            and r.get("stage_kind") == "replicated" and r.get("case_key") in keys]
    if not rows:
        return None
    ok = all(r.get("bitwise_equal") for r in rows)
    return Finding(EXPERIMENT, "probs all-gather", subject_of(sub[0]), PASS if ok else FAIL,
                   f"{d}: the gathered probs are " + ("bitwise equal on every rank in every trial and variant "
                                                      f"({len(rows)} rank-pair comparisons)" if ok else
                                                      "NOT bitwise equal across ranks in "
                                                      f"{sum(not r.get('bitwise_equal') for r in rows)} of {len(rows)} "
                                                      "rank-pair comparisons"),
                   Evidence(records=sorted(keys - {None})), commits=commits_of(sub))


def _variants(d: str, sub: list[dict]) -> Finding | None:
    by = {c["variant"]: c for c in sub}
    plain = by.get(PLAIN)
    if plain is None or plain["first_divergent_stage"] is None or not plain.get("cross_rank_applicable", True):
        return None
    fixed = [v for v, c in by.items() if v != PLAIN and c["first_divergent_stage"] is None]
    kept = [v for v, c in by.items() if v != PLAIN and c["first_divergent_stage"] is not None]
    claim = (f"{d}: plain bf16 diverges from {plain['first_divergent_stage']}; "
             + (f"{' and '.join(fixed)} make(s) every stage agree" if fixed else "no probs-path variant removes it")
             + (f"; {' and '.join(kept)} do(es) not" if kept and fixed else ""))
    return Finding(EXPERIMENT, "probs-path variants", subject_of(plain), PASS if fixed else FAIL, claim,
                   Evidence(records=case_keys(sub)), remedy=fixed[0] if fixed else None, commits=commits_of(sub))


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict)]
    cases = [r for r in recs if r.get("kind") == "case"]
    out: list[Finding] = []
    for _key, sub in groups(cases).items():
        def build(sub=sub):
            fs = [_case(recs, c) for c in sub]
            d = sub[0]["dispatcher"]
            fs += [f for f in (_gather(recs, d, sub), _variants(d, sub)) if f is not None]
            return fs
        out += guarded(EXPERIMENT, "first divergent stage", sub, build)
    return out


__all__ = ["findings", "collective_of", "EXPERIMENT", "PLAIN"]
