"""Notebook 02 in two reports, per case `moe_lab.reporting.compare` matched: the first divergent stage and the
collective it is (the finding's verdict), with the fraction of output elements that differ across ranks as its
magnitude; whether the gathered probs are bitwise equal, with how many of the rank-pair comparisons are not; which
probs-path variant makes every stage agree."""

from __future__ import annotations

from ..reproduce.compare import side_by_side
from ...findings.model import Count

DETAILS = ("first_stage", "collective")
"""Subject fields that are the verdict's words (where the ranks first part), not the case's identity."""


def magnitude(case: dict) -> tuple[str, Count | float | None]:
    f, recs = case["finding"], case["records"]
    if f.question == "first divergent stage":
        cs = [r for r in recs if r.get("kind") == "case"]
        frac = cs[0].get("out_mismatch_frac") if len(cs) == 1 else None
        return "output elements differing across ranks (fraction)", frac
    if f.question == "probs all-gather":
        rows_ = [r for r in recs if r.get("kind") == "stage" and r.get("stage") == "dispatch.comm.probs"
                 and r.get("stage_kind") == "replicated"]
        what = "rank-pair comparisons of the gathered probs not bitwise equal"
        return what, Count(sum(not r.get("bitwise_equal") for r in rows_), len(rows_), what) if rows_ else None
    return "", None


rows = side_by_side(magnitude)
