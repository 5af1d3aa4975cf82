"""Notebook 08 in two reports, per case `moe_lab.reporting.compare` matched: is the gap expected (the finding's
status). The magnitude is the count behind the tolerance: the output elements whose bits differ between the first
non-reference layout and the reference (the finding's first count), where the finding has one."""

from __future__ import annotations

from ..reproduce.compare import side_by_side


def magnitude(case: dict):
    counts = case["finding"].evidence.counts
    return (counts[0].what, counts[0]) if counts else ("", None)


rows = side_by_side(magnitude)
