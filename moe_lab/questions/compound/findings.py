"""Notebook 05's findings: do the gradients agree (across ranks, reruns and under truncation), which setting makes the
forward and every gradient bitwise equal in every trial, and how differences grow over stacked layers.

Denominators: the loss is sum(out[:cut] * R), so only the first `cut` tokens carry an input gradient (every token is
routed and computed on its own; the aux loss is off): an input-gradient fraction counts those tokens' elements, never
the whole sequence's, whose rest is zero by construction. Weight gradients count every element."""

from __future__ import annotations

from ...findings.labels import FWD_CMPS, GRAD_CMPS
from ...findings.common import choice_text, choose, cost, count, fix_words, groups, guarded, trials
from ...findings.model import FAIL, NA, NOT_MEASURED, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "compound"
QUESTION = "gradients agree"
FIX = "fix: gradients"
FULL_SEQUENCE_GRADS = ("cross_dx", "rerun_dx", "cross_grad", "rerun_grad")
"""Input-gradient comparisons over the whole sequence (their truncation twins compare the first `cut` tokens only)."""
WHAT = {"cross": "across ranks", "rerun": "between reruns", "truncation": "under truncation",
        "experts": "expert weight gradients"}


def carrying(rec: dict, key: str) -> int:
    """The elements of comparison `key` that carry a gradient (the denominator of its mismatch fraction)."""
    c = rec[key]
    numel = int(c["numel"])
    if key in FULL_SEQUENCE_GRADS and _loss_tokens_known(rec, key):
        seq, cut = rec["config"]["seq_len"], rec["cut"]
        return numel // seq * min(cut, seq)
    return numel


def _loss_tokens_known(rec: dict, key: str) -> bool:
    """Whether the record says which of a whole-sequence comparison's elements are the loss's tokens (its layer's
    length and cut); a record without them is counted over every element, and worded so."""
    seq, cut = (rec.get("config") or {}).get("seq_len"), rec.get("cut")
    return bool(seq and cut and int(rec[key]["numel"]) % seq == 0)


def frac(rec: dict, key: str) -> float:
    """Mismatch fraction of comparison `key` over its carrying elements (0 when not applicable)."""
    c = rec[key]
    if not c.get("applicable", True):
        return 0.0
    n = carrying(rec, key)
    return c["n_mismatch"] / n if n else 0.0


def _what(key: str, rec: dict | None = None) -> str:
    if key.endswith(("_dx", "_grad")) and "router" not in key:
        if rec is not None and key in FULL_SEQUENCE_GRADS and not _loss_tokens_known(rec, key):
            return "input-gradient elements (every token: the record holds no layer length and cut)"
        return "input-gradient elements of the loss's tokens"
    if "router" in key:
        return "router weight-gradient elements"
    if key.startswith("experts"):
        return "expert weight-gradient elements"
    return "output elements"


def _ok(c: dict) -> bool:
    return (not c.get("applicable", True)) or bool(c["bitwise_equal"])


def grads_agree(r: dict) -> bool:
    return all(_ok(r[k]) for k in GRAD_CMPS)


def all_agree(r: dict) -> bool:
    return grads_agree(r) and all(_ok(r[k]) for k in FWD_CMPS)


def fails(r: dict, keys) -> list[str]:
    """'cross dx: 6,155 of 11,520 input-gradient elements of the loss's tokens (0.534) in 3/3 trials'."""
    out = []
    for k in keys:
        if _ok(r[k]):
            continue
        kk, n = trials(r[k])
        out.append(f"{k.replace('_', ' ')}: {count(r[k], _what(k, r), carrying(r, k)).text()} in {kk}/{n} trials")
    return out


def _scope(r: dict) -> str:
    """What an 'every gradient equal' covers: across ranks only where ranks were compared (one rank: not applicable,
    and said so, never counted as equal)."""
    ranks = [k for k in GRAD_CMPS if k.startswith("cross")]
    if all(not r[k].get("applicable", True) for k in ranks):
        return "between reruns and under truncation (across ranks: not applicable, one rank)"
    return "across ranks, reruns and truncation"


def simplicity(name: str) -> tuple:
    return (name.count("+") + name.count(","), len(name))


def _backward(sub: list[dict]) -> list[Finding]:
    avail = [r for r in sub if r.get("available")]
    plain = next((r for r in avail if r["setting"] == "plain"), None)
    r0 = plain or sub[0]
    subj = subject_of(r0)
    d = r0["dispatcher"]
    commits = commits_of(sub)
    out: list[Finding] = []
    if plain is None:
        out.append(Finding(EXPERIMENT, QUESTION, subj, NOT_MEASURED, f"{d}: the plain backward was not measured — "
                           "nothing is said about the gradients", Evidence(records=case_keys(sub)), card=True,
                           commits=commits, short="plain backward not measured"))
    else:
        g, f = fails(plain, GRAD_CMPS), fails(plain, FWD_CMPS)
        led = sorted({c["op"] + " in " + c["dtype"] for c in plain.get("backward_ledger", [])
                      if c["op"].startswith(("reduce_scatter", "all_to_all"))})
        claim = (f"{d}, plain: " + (f"every gradient bitwise equal {_scope(plain)} in every trial"
                                   if not g else "gradients differ — " + "; ".join(g))
                 + ("" if not f else "; forward: " + "; ".join(f)))
        notes = ([f"the backward first differs at {plain['backward_first_divergent']}"]
                 if plain.get("backward_first_divergent") else []) + \
                ([f"the backward's reductions: {', '.join(led)}"] if led else [])
        ev = Evidence(records=case_keys([plain]), notes=notes,
                      counts=[count(plain[k], _what(k, plain), carrying(plain, k)) for k in GRAD_CMPS if not _ok(plain[k])])
        bad = [k.replace("_", " ") for k in GRAD_CMPS if not _ok(plain[k])]
        out.append(Finding(EXPERIMENT, QUESTION, subj, PASS if not g else FAIL, claim, ev, card=True, commits=commits,
                           short=f"equal {_scope(plain)}" if not g else "differ: " + ", ".join(bad)))
    for r in avail:
        if r is plain:
            continue
        bad = fails(r, FWD_CMPS + GRAD_CMPS)
        out.append(Finding(EXPERIMENT, "setting", {**subj, "setting": r["setting"]}, PASS if not bad else FAIL,
                           f"{d}, {r['setting']}: " + ("forward and every gradient bitwise equal in every trial"
                                                       if not bad else "still: " + "; ".join(bad)),
                           Evidence(records=case_keys([r]), cost=cost(r, plain, r) if plain else None),
                           commits=commits_of([r])))
    for r in (x for x in sub if x.get("available") is False):
        out.append(Finding(EXPERIMENT, "setting", {**subj, "setting": r.get("setting")}, NA,
                           f"{d}, {r.get('setting')}: not run here ({_reason(str(r.get('reason')))})",
                           Evidence(records=case_keys([r])), commits=commits_of([r])))
    if plain is not None and not all_agree(plain):
        good = [r for r in avail if r is not plain and all_agree(r)]
        costs = {r["setting"]: cost(r, plain, r) for r in good}
        ch = choose(list(costs.items()), simplicity)
        from ...findings.jobs import job_lines

        out.append(Finding(EXPERIMENT, FIX, subj, PASS if ch["name"] else FAIL,
                           f"{d}: forward and every gradient bitwise equal in every trial — " + choice_text(ch, costs),
                           Evidence(records=case_keys(good or [plain]), cost=ch["cost"]), remedy=ch["name"],
                           lines=job_lines(ch["name"], next(r for r in good if r["setting"] == ch["name"])
                                           .get("router_dtype")) if ch["name"] else [], card=True, commits=commits,
                           short=fix_words(ch["name"], len(avail) - 1)))
    return out


def growth(rows: list[dict]) -> list[str]:
    """Outputs in forward order (after layer 1 … L); gradients in backward order (at the input of layer L … 1);
    gradient fractions over the loss's tokens."""
    parts = []
    for k, what in (("cross_out", "outputs across ranks"), ("cross_grad", "input gradients across ranks"),
                    ("rerun_out", "outputs between reruns"), ("rerun_grad", "input gradients between reruns"),
                    ("truncation_out", "first tokens under truncation"),
                    ("truncation_grad", "first tokens' gradients under truncation")):
        if k not in rows[0] or not rows[0][k].get("applicable", True):
            continue
        seq = rows if k.endswith("_out") else rows[::-1]
        fr = [frac(r, k) for r in seq]
        where = "after" if k.endswith("_out") else "at the input of"
        if not any(fr):
            parts.append(f"{what} bitwise equal {where} every layer")
            continue
        first = next(i for i, f in enumerate(fr) if f)
        of = carrying(seq[-1], k)
        parts.append(f"{what} differ from {where} layer {seq[first]['layer']} on ({fr[first]:.3g} → {fr[-1]:.3g} of "
                     f"{of:,} {_what(k, seq[-1])} {where} layer {seq[-1]['layer']})")
    return parts


def _depth(depth: list[dict]) -> list[Finding]:
    out = []
    for key in dict.fromkeys((r["dispatcher"], r["setting"], r["stack"]) for r in depth):
        rows = sorted((r for r in depth if (r["dispatcher"], r["setting"], r["stack"]) == key), key=lambda r: r["layer"])
        if not rows or not rows[0].get("available", True) or "cross_out" not in rows[0]:
            continue
        differs = any(not _ok(r[k]) for r in rows for k in ("cross_out", "cross_grad") if k in r)
        na = not rows[0]["cross_out"].get("applicable", True)
        out.append(Finding(EXPERIMENT, "depth", {**subject_of(rows[0]), "setting": key[1], "stack": key[2]},
                           NA if na and not differs else (FAIL if differs else PASS),
                           f"depth, {key[0]}, {key[1]}, {key[2]}: " + "; ".join(growth(rows)),
                           Evidence(records=case_keys(rows)), commits=commits_of(rows)))
    return out


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict)]
    back = [r for r in recs if r.get("kind") == "backward"]
    depth = [r for r in recs if r.get("kind") == "depth"]
    out: list[Finding] = []
    for _key, sub in groups(back).items():
        out += guarded(EXPERIMENT, QUESTION, sub, lambda sub=sub: _backward(sub))
    for _key, sub in groups(depth).items():
        out += guarded(EXPERIMENT, "depth", sub, lambda sub=sub: _depth(sub))
    return out


def _reason(text: str) -> str:
    import re

    return re.sub(r" \((/|[A-Za-z]:\\)[^)]*\)", "", text)


__all__ = ["findings", "carrying", "frac", "grads_agree", "all_agree", "fails", "growth", "EXPERIMENT"]
