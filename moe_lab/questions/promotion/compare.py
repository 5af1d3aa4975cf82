"""Notebook 03 in two reports, per case `moe_lab.reporting.compare` matched: do the plain bf16 ranks agree, and which
setting of the grid makes ranks and reruns bitwise equal (the finding's status and the remedy it names). The
magnitude is the plain cell's: the output elements that differ across ranks (worst trial, worst rank pair)."""

from __future__ import annotations

from ..reproduce.compare import CROSS_RANK, comparison_count, side_by_side
from .findings import is_plain


def axes(finding, records: list[dict]) -> dict:
    """A 'not applicable' finding is one per reason its release gave (the records' `skipped`)."""
    reasons = sorted({str(r.get("skipped")) for r in records if "skipped" in r})
    return {"not applicable because": "; ".join(reasons)} if reasons else {}


def _plain(records: list[dict]) -> dict | None:
    try:
        plain = [r for r in records if "skipped" not in r and is_plain(r)]
    except (KeyError, TypeError):  # a cell without its grid fields: its finding says it was not read
        return None
    return plain[0] if len(plain) == 1 else None


def magnitude(case: dict):
    plain = _plain(case["records"])
    return (f"plain cell: {CROSS_RANK}", comparison_count(plain.get("cross_rank"), CROSS_RANK)) \
        if plain is not None else ("", None)


rows = side_by_side(magnitude)
