"""Notebook 01: the same tokens on every EP rank — do the MoE outputs agree? (dispatcher x router dtype, probe cases)

Attribution rule (#14): a cross-rank difference is EP-order divergence only if the ranks differ in EVERY trial and a
rerun on one rank is bitwise equal in EVERY trial. If reruns differ too, the ranks disagree because each forward is
run-to-run nondeterministic; anything in between is reported as what it is (k of N trials).
"""

from __future__ import annotations

from . import probe
from . import labels
from .labels import describe_cmp
from .probe import on_engine  # noqa: F401 - the engine side of 01 is the probe's

NAME = "reproduce"
NOTEBOOK = "01"


def cases(params: dict):
    from .. import profiles

    base = profiles.base_moe(params)
    return [probe.case(base.replace(dispatcher=d, router_dtype=r), cut=params["cut"], detail=True,
                       trials=profiles.trials(params), experiment=NAME, release=profiles.release(params))
            for d in params["dispatchers"] for r in params["router_dtypes"]]


def records(case, per_rank):
    return probe.records(case, per_rank)


def attribution(rec: dict) -> str:
    """'equal' | 'ep' | 'ep+nondeterminism' | 'nondeterminism' | 'mixed' | 'n/a' for one record's cross-rank
    comparison (labels.attribution)."""
    return labels.attribution(rec["cross_rank"], rec["rerun"])


def where(rec: dict) -> str:
    return (f"megatron-core {rec['megatron_core']}, {rec['world']} EP rank(s) on {rec.get('gpu') or rec['device']} "
            f"({rec['backend']}; {rec.get('placement', '')})")


def verdict(records: list[dict]) -> str:
    """Plain-language verdict of notebook 01 from its records (no numbers typed in by hand)."""
    if not records:
        return "No case ran."
    lines = [where(records[0]) + ", same tokens on every rank:"]
    groups: dict[str, list[str]] = {}
    for r in records:
        c, rr = r["cross_rank"], r["rerun"]
        name = f"{r['dispatcher']}/router {r['router_dtype']}"
        kind = attribution(r)
        groups.setdefault(kind, []).append(name)
        line = f"- {name}: ranks {describe_cmp(c)}"
        if kind in ("ep", "ep+nondeterminism", "mixed", "nondeterminism"):
            line += f"; allclose(1e-3) {'passes' if c['allclose_1e3'] else 'fails'}"
            line += f"; a rerun on one rank: {describe_cmp(rr)}"
        lines.append(line)
    if "n/a" in groups:
        lines.append(f"Verdict: with {records[0]['world']} rank there is nothing to compare across ranks "
                     f"({records[0]['cross_rank'].get('reason')}); reruns and truncation are measured above.")
    if "ep" in groups:
        lines.append(f"Verdict: the seed report's EP divergence reproduces for {', '.join(groups['ep'])}: the ranks "
                     "differ in every trial while each rank reproduces its own output bit for bit.")
    if "ep+nondeterminism" in groups:
        lines.append(f"Verdict: the seed report's EP divergence reproduces for {', '.join(groups['ep+nondeterminism'])}"
                     f": the ranks differ in every trial, in at least {labels.EP_DOMINANCE}x the elements that a rerun "
                     "on one rank changes — EP order, with some run-to-run nondeterminism on top (notebook 03 measures "
                     "deterministic mode against it).")
    if "nondeterminism" in groups:
        lines.append(f"Verdict: {', '.join(groups['nondeterminism'])} differ across ranks because each forward is "
                     "run-to-run nondeterministic (a rerun on the same rank differs too), not because of EP order "
                     "(notebook 03: deterministic mode).")
    if "mixed" in groups:
        lines.append(f"Verdict: {', '.join(groups['mixed'])}: the ranks differ in some trials only while reruns "
                     "agree — neither a stable EP-order effect nor rerun nondeterminism; run more trials.")
    if set(groups) <= {"equal"}:
        lines.append("Verdict: no cross-rank divergence on this setup for any case run.")
    return "\n".join(lines)


__all__ = ["cases", "on_engine", "records", "verdict", "attribution"]
