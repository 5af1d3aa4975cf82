"""Notebook 06 in two reports: each training run both hold (same configuration) is held whole — its trajectory's
bits (loss bits and weight fingerprints, every step: equal, or the step after which they part and where) and its
layout's weight divergence from its reference at step K."""

from __future__ import annotations

from . import QUESTION
from ...findings.common import within_factor
from .findings import first_difference, reference_of, weight_divergence, where_parted


def _train_key(r: dict) -> tuple:
    return (r["label"], r["steps"], r["tokens"], r["precision"], r.get("megatron_core"))


def _drift(r: dict, pool: list[dict]) -> float:
    """||Δw|| / ||w|| at the last step of run `r` against its reference layout's run in `pool` (0 for the reference)."""
    ref = reference_of(r, pool)
    return 0.0 if ref is None or ref is r else weight_divergence(r, ref)[-1]


def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    """Notebook 06: per training run both sets hold with the same configuration, its trajectory's bits (equal, or
    the step after which they part and where), and its weight divergence from its reference layout at step K."""
    ra = [r for r in a if r.get("notebook") == QUESTION.number and r.get("kind") == "train" and r.get("available")]
    rb = [r for r in b if r.get("notebook") == QUESTION.number and r.get("kind") == "train" and r.get("available")]
    ka, kb = {_train_key(r): r for r in ra}, {_train_key(r): r for r in rb}
    rows = []
    for k in sorted(set(ka) & set(kb), key=str):
        x, y = ka[k], kb[k]
        if x.get("config") != y.get("config"):
            continue
        t = first_difference(x, y)
        det = "deterministic" if x["deterministic"] else "not deterministic"
        why = "" if t is None else (f"parts after step {t} of {x['steps']} (in {where_parted(x, y, t)})"
                                    + ("" if x["deterministic"] else "; without deterministic mode one machine's "
                                       "reruns may part too"))
        da, db = _drift(x, ra), _drift(y, rb)
        rows.append({"notebook": QUESTION.number, "case": k[0], "what": f"trajectory bits, {det}",
                     "a": f"loss at step {x['steps']} {x['loss'][-1]:.6g}, ||Δw||/||w|| vs reference {da:.2g}",
                     "b": f"loss at step {y['steps']} {y['loss'][-1]:.6g}, ||Δw||/||w|| vs reference {db:.2g}",
                     "agree": t is None, "within_factor": within_factor(da, db, factor), "why": why,
                     "deterministic": bool(x["deterministic"])})
    return rows
