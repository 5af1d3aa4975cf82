"""Notebook 01 in two reports: per dispatcher x router dtype both hold, the cross-rank verdict (EP order,
nondeterminism, equal) and its mismatch fraction."""

from __future__ import annotations

from . import QUESTION
from ...findings import labels
from ...findings.common import within_factor

WHY_NCCL = ("NCCL's own reduction order (ring/tree) and NVLink are exercised only with one rank per GPU; "
            "gloo reduces on the host in one fixed order")


def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    ka = {(r["dispatcher"], r["router_dtype"]): r for r in a if r.get("notebook") == QUESTION.number}
    kb = {(r["dispatcher"], r["router_dtype"]): r for r in b if r.get("notebook") == QUESTION.number}
    out = []
    for k in sorted(set(ka) & set(kb)):
        ra, rb = ka[k], kb[k]
        va, vb = (labels.attribution(r["cross_rank"], r["rerun"]) for r in (ra, rb))
        fa, fb = ra["cross_rank"].get("mismatch_frac", 0.0), rb["cross_rank"].get("mismatch_frac", 0.0)
        out.append({"notebook": QUESTION.number, "case": f"{k[0]}/router {k[1]}", "what": "cross-rank verdict",
                    "a": f"{va} ({fa:.3g})", "b": f"{vb} ({fb:.3g})", "agree": va == vb,
                    "within_factor": within_factor(fa, fb, factor), "why": "" if va == vb else WHY_NCCL})
    return out
