"""Notebook 08 in two reports, per case `moe_lab.reporting.compare` matched: is the gap expected (the finding's
status). The magnitude is the count behind the tolerance where the finding has one: the output elements whose bits
differ between the first non-reference layout and the reference, or a gradient pair's expert-gradient elements. A
run's own gradients or training steps against fp64 are held side by side by their expert gradients' p99 |error| to
the truth in ULP (the statistic a planted gradient-scale bug departs at), the trajectory's at its last step; a
finding over several runs has none of its own."""

from __future__ import annotations

import math

from ..reproduce.compare import side_by_side

GRADIENT_P99 = "expert-gradient p99 |error| to fp64 (ULP)"
LAST_STEP_P99 = "expert-gradient p99 |error| to fp64 at the last step (ULP)"


def _p99(stats, group: str):
    s = stats.get(group) if isinstance(stats, dict) else None
    v = s.get("p99") if isinstance(s, dict) else None
    return float(v) if isinstance(v, (int, float)) and not isinstance(v, bool) and math.isfinite(v) else None


def magnitude(case: dict):
    counts = case["finding"].evidence.counts
    if counts:
        return counts[0].what, counts[0]
    recs = case["records"]
    if len(recs) != 1:
        return "", None
    r = recs[0]
    if r.get("kind") == "gradients":
        v = _p99(r.get("stats"), "experts.all")
        return (GRADIENT_P99, v) if v is not None else ("", None)
    if r.get("kind") == "trajectory":
        steps = r.get("steps_compared")
        last = steps[-1] if isinstance(steps, list) and steps and isinstance(steps[-1], dict) else {}
        v = _p99(last.get("stats"), "grad.experts.all")
        return (LAST_STEP_P99, v) if v is not None else ("", None)
    return "", None


rows = side_by_side(magnitude)
