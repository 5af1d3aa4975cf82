"""Notebook 05 in two reports, per case `moe_lab.reporting.compare` matched: do the gradients agree, does each setting
make the forward and every gradient bitwise equal, which one is the fix (the remedy it names), and how differences
grow over stacked layers. The magnitude is the plain backward's: the input-gradient elements of the loss's tokens that
differ across ranks."""

from __future__ import annotations

from ..reproduce.compare import side_by_side
from ...findings.model import Count
from .findings import carrying

WHAT = "input-gradient elements of the loss's tokens differing across ranks"


def magnitude(case: dict):
    f, recs = case["finding"], case["records"]
    if f.question != "gradients agree" or len(recs) != 1:
        return "", None
    c = recs[0].get("cross_dx")
    if not isinstance(c, dict) or not c.get("applicable", True) or "numel" not in c:
        return "", None
    try:
        of = carrying(recs[0], "cross_dx")
    except (TypeError, ValueError):
        of = c.get("numel")
    return WHAT, Count(c.get("n_mismatch"), of, WHAT)


rows = side_by_side(magnitude)
