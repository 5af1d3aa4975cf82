"""Notebook 01's findings (and `moe-lab probe`'s): per dispatcher x router dtype, do the ranks agree, and if not, is it
EP order or run-to-run nondeterminism (labels.attribution: ranks differ in every trial and a rerun never does)."""

from __future__ import annotations

from ...findings.labels import EP_DOMINANCE, attribution
from ...findings.common import count, describe, groups, guarded, trial_words, trials
from ...findings.model import FAIL, MIXED, NA, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "reproduce"
QUESTION = "ranks agree"

_KIND = {"equal": PASS, "ep": FAIL, "ep+nondeterminism": FAIL, "nondeterminism": FAIL, "mixed": MIXED, "n/a": NA}
_WHY = {"equal": "ranks agree bit for bit",
        "ep": "EP order: the ranks differ in every trial while a rerun on one rank is bitwise equal in every trial",
        "ep+nondeterminism": f"EP order (+ run-to-run nondeterminism): the ranks differ in every trial in at least "
                             f"{EP_DOMINANCE}x the elements any rerun changes",
        "nondeterminism": "run-to-run nondeterminism: a rerun on one rank differs too, so the ranks' difference is not "
                          "shown to be EP order",
        "mixed": "the ranks differ in some trials only while reruns agree — neither a stable EP-order effect nor rerun "
                 "nondeterminism; run more trials",
        "n/a": "one rank: nothing to compare across ranks"}
KIND_WORDS = {"equal": "no", "ep": "EP order", "ep+nondeterminism": "EP order (+ run-to-run nondeterminism)",
              "nondeterminism": "run-to-run nondeterminism", "mixed": "mixed", "n/a": "n/a"}


def _one(r: dict) -> Finding:
    c, rr = r["cross_rank"], r["rerun"]
    kind = attribution(c, rr)
    subj = subject_of(r, router_dtype=r["router_dtype"])
    ev = Evidence(records=case_keys([r]), trials=trials(c) if c.get("applicable", True) else None)
    claim = f"{r['dispatcher']}, router {r['router_dtype']}: "
    if kind == "n/a":
        claim += _WHY[kind]
    elif kind == "equal":
        claim += f"ranks bitwise equal {describe(c).removeprefix('bitwise equal ')}"
    else:
        claim += f"ranks: {describe(c, 'output elements (worst trial, worst rank pair)')}; a rerun on one rank: " \
                 f"{describe(rr, 'output elements')} — {_WHY[kind]}"
        ev.counts.append(count(c, "output elements (worst trial, worst rank pair)"))
    short = {"equal": "no: ranks bitwise equal", "n/a": "one rank: nothing compared"}.get(
        kind, f"yes: {KIND_WORDS[kind]}") + trial_words(ev.trials)
    f = Finding(EXPERIMENT, QUESTION, subj, _KIND[kind], claim, ev, card=r["router_dtype"] == "none",
                commits=commits_of([r]), short=short)
    f.subject["attribution"] = kind
    return f


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict) and r.get("kind", "case") == "case" and "skipped" not in r]
    out: list[Finding] = []
    for _key, sub in groups(recs, "router_dtype").items():
        out += guarded(EXPERIMENT, QUESTION, sub, lambda sub=sub: [_one(r) for r in sub])
    return out


__all__ = ["findings", "EXPERIMENT", "KIND_WORDS"]
