"""Notebook 01 in two reports, per case `moe_lab.reporting.compare` matched: do the ranks agree (the finding's status
and its attribution: EP order, run-to-run nondeterminism, equal), and does a layout change the bits. The magnitude is
the count behind the verdict: the output elements that differ across ranks (worst trial, worst rank pair), or
against the reference layout; a layout finding over several layouts has none of its own."""

from __future__ import annotations

from typing import Callable

from ...findings.model import Count

DETAILS = ("attribution",)
"""Subject fields that are the verdict's words (why the ranks differ), not the case's identity."""

CROSS_RANK = "output elements differing across ranks (worst trial, worst rank pair)"
VS_REFERENCE = "output elements differing from the reference layout (worst trial)"


def comparison_count(c, what: str) -> Count | None:
    """A comparison's worst-trial mismatch count over its elements, as the record states them (an impossible count
    stays as it is, for the comparison to show invalid); None where no comparison was made."""
    if not isinstance(c, dict) or not c.get("applicable", True) or "numel" not in c:
        return None
    return Count(c.get("n_mismatch"), c.get("numel"), what)


def magnitude(case: dict) -> tuple[str, Count | None]:
    f, recs = case["finding"], case["records"]
    if len(recs) != 1:
        return "", None
    if f.experiment == "layouts":
        return VS_REFERENCE, comparison_count(recs[0].get("vs_reference"), VS_REFERENCE)
    return CROSS_RANK, comparison_count(recs[0].get("cross_rank"), CROSS_RANK)


def side_by_side(magnitude: Callable[[dict], tuple[str, object]]) -> Callable[[list, list, float], list[dict]]:
    """The `rows` of a question whose matched cases are held side by side by one magnitude each (`magnitude(case)
    -> (what it measures, Count | number | None)`): per pair (a[i], b[i]: {'finding', 'records'}), the measure and
    the two magnitudes; `moe_lab.reporting.compare` holds them against the factor and renders an invalid one as
    invalid."""

    def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
        out = []
        for x, y in zip(a, b):
            (what_a, ma), (what_b, mb) = magnitude(x), magnitude(y)
            out.append({"what": what_a or what_b, "a": ma, "b": mb})
        return out

    return rows


rows = side_by_side(magnitude)
