"""Notebook 04 in two reports: per dispatcher x remedy (measured, not emulated) both hold, does the remedy keep
the first tokens bitwise invariant in every trial, and the truncation mismatch fraction."""

from __future__ import annotations

from . import QUESTION
from ...findings import labels
from ...findings.common import within_factor


def _cases(records: list[dict]) -> dict:
    return {(r["dispatcher"], r["remedy"], r.get("tile")): r for r in records if r.get("notebook") == QUESTION.number
            and r.get("kind") == "case" and r.get("available") and not r.get("emulated")}


def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    ta, tb = _cases(a), _cases(b)
    out = []
    for k in sorted(set(ta) & set(tb), key=str):
        ha = ta[k]["truncation"]["bitwise_equal"] and ta[k]["rerun"]["bitwise_equal"]
        hb = tb[k]["truncation"]["bitwise_equal"] and tb[k]["rerun"]["bitwise_equal"]
        fa, fb = ta[k]["truncation"]["mismatch_frac"], tb[k]["truncation"]["mismatch_frac"]
        out.append({"notebook": QUESTION.number, "case": f"{k[0]}/{labels.rem_label(k[1], k[2])}",
                    "what": "holds in every trial",
                    "a": str(ha), "b": str(hb), "agree": ha == hb, "within_factor": within_factor(fa, fb, factor),
                    "why": "" if ha == hb else "the combine's collectives differ (see 02); GEMMs are the same kernels"})
    return out
