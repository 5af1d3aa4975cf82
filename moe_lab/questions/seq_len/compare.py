"""Notebook 09 in two reports, per case `moe_lab.reporting.compare` matched: does the divergence across EP ranks
depend on the sequence length (the finding's status). The lengths each side measured are marked where they differ;
the magnitude is the worst length's: the output elements that differ across ranks there."""

from __future__ import annotations

from ..reproduce.compare import comparison_count, side_by_side

MARKED = ("seq_lens",)
"""The lengths a side measured: named where they differ, never part of the case."""


def magnitude(case: dict):
    worst = None
    for r in case["records"]:
        n = (r.get("config") or {}).get("seq_len")
        m = comparison_count(r.get("cross_rank"), f"output elements at {n} tokens differing across ranks")
        if m is not None and (worst is None or _frac(m) > _frac(worst)):
            worst = m
    return (f"worst length: {worst.what}", worst) if worst is not None else ("", None)


def _frac(m) -> float:
    try:
        return float(m.n) / float(m.of)
    except (TypeError, ValueError, ZeroDivisionError):
        return float("inf")  # an impossible count is the one shown: the comparison marks it invalid


rows = side_by_side(magnitude)
