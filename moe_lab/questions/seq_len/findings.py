"""Notebook 09's findings: per subject (release, dispatcher, placement, layer without its length), how the ranks
compare at each sequence length, and whether the answer depends on the length. Torch-free."""

from __future__ import annotations

from . import QUESTION as _Q
from ...findings.common import count, groups, guarded, trials_text
from ...findings.labels import attribution
from ...findings.model import FAIL, MIXED, NA, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "seq_len"
QUESTION = "depends on sequence length"
WORDS = {"equal": "bitwise equal", "ep": "EP order", "ep+nondeterminism": "EP order (+ run-to-run nondeterminism)",
         "nondeterminism": "run-to-run nondeterminism", "mixed": "differ in some trials only", "n/a": "one rank"}


def _length(r: dict) -> int:
    return int((r.get("config") or {}).get("seq_len") or 0)


def _one(sub: list[dict]) -> list[Finding]:
    """Whether the ranks differ is the answer per length (any trial, any rank pair); why they differ (01's
    attribution: EP order, run-to-run nondeterminism, ...) is said per length and, where it varies while the answer
    does not, said so — the two are never merged into one verdict."""
    sub = sorted(sub, key=_length)
    kinds = {_length(r): attribution(r["cross_rank"], r["rerun"]) for r in sub}
    measured = {n: k for n, k in kinds.items() if k != "n/a"}
    differ = [n for n, k in measured.items() if k != "equal"]
    equal = [n for n, k in measured.items() if k == "equal"]
    if not measured:
        status = NA
    elif differ and equal:
        status = MIXED
    else:
        status = FAIL if differ else PASS
    parts = []
    ev = Evidence(records=case_keys(sub))
    for r in sub:
        n, c = _length(r), r["cross_rank"]
        parts.append(f"{n} tokens: {WORDS[kinds[n]]}" + ("" if kinds[n] in ("equal", "n/a") else
                                                          f" ({c['mismatch_frac']:.3g} of the output elements "
                                                          f"{trials_text(c)}, max {c['max_ulp']:.0f} ULP)"))
        if kinds[n] not in ("equal", "n/a"):
            ev.counts.append(count(c, f"output elements at {n} tokens (worst trial, worst rank pair)"))
    lengths = ", ".join(str(n) for n in kinds)
    why = {measured[n] for n in differ}
    if status == NA:
        head = "one rank: nothing to compare across ranks"
    elif status == MIXED and all(measured[n] in ("ep", "ep+nondeterminism") for n in differ):
        head = (f"it depends on the length: the ranks differ at {', '.join(map(str, differ))} tokens in every trial "
                f"(beyond their reruns) and are bitwise equal at {', '.join(map(str, equal))} tokens")
    elif status == MIXED:  # a difference that reruns or some trials show too is no control for a length effect
        head = (f"not told apart: the ranks differ at {', '.join(map(str, differ))} tokens and are bitwise equal at "
                f"{', '.join(map(str, equal))} tokens, but where they differ it is not shown to be more than run-to-run "
                "(reruns differ too, or only some trials do) — more trials would tell whether the length decides it")
    elif status == PASS:
        head = f"no: the ranks are bitwise equal at every length measured ({lengths} tokens)"
    elif len(why) == 1:
        head = f"no: the ranks differ at every length measured ({lengths} tokens), each time by {WORDS[why.pop()]}"
    else:
        head = (f"no: the ranks differ at every length measured ({lengths} tokens); why varies with the length "
                f"({' / '.join(sorted(WORDS[k] for k in why))})")
    r0 = sub[0]
    subj = subject_of(r0, axes=_Q.axes, router_dtype=r0.get("router_dtype"))
    subj["seq_lens"] = lengths
    claim = f"{r0['dispatcher']}, router {r0.get('router_dtype')}: {head} — " + "; ".join(parts)
    return [Finding(EXPERIMENT, QUESTION, subj, status, claim, ev, card=False, commits=commits_of(sub))]


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict) and r.get("kind", "case") == "case" and "skipped" not in r]
    out: list[Finding] = []
    for _key, sub in groups(recs, "router_dtype", axes=_Q.axes).items():
        out += guarded(EXPERIMENT, QUESTION, sub, lambda sub=sub: _one(sub))
    return out


__all__ = ["findings", "EXPERIMENT", "QUESTION"]
