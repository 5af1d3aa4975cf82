"""Notebook 02 in two reports: per dispatcher x variant both hold, the first divergent stage and the output's
mismatch fraction."""

from __future__ import annotations

from . import QUESTION
from ...findings.common import within_factor
from ..reproduce.compare import WHY_NCCL


def _cases(records: list[dict]) -> dict:
    return {(r["dispatcher"], r["variant"]): r for r in records
            if r.get("notebook") == QUESTION.number and r.get("kind") == "case"}


def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    ca, cb = _cases(a), _cases(b)
    out = []
    for k in sorted(set(ca) & set(cb)):
        sa, sb = ca[k]["first_divergent_stage"], cb[k]["first_divergent_stage"]
        fa, fb = ca[k].get("out_mismatch_frac") or 0.0, cb[k].get("out_mismatch_frac") or 0.0
        out.append({"notebook": QUESTION.number, "case": f"{k[0]}/{k[1]}", "what": "first divergent stage",
                    "a": str(sa), "b": str(sb), "agree": sa == sb, "within_factor": within_factor(fa, fb, factor),
                    "why": "" if sa == sb else WHY_NCCL})
    return out
