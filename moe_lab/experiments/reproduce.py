"""Notebook 01: the same tokens on every EP rank — do the MoE outputs agree? (dispatcher x router dtype, probe cases)

Attribution rule (#14): a cross-rank difference is EP-order divergence only if the ranks differ in EVERY trial and a
rerun on one rank is bitwise equal in EVERY trial. If reruns differ too, the ranks disagree because each forward is
run-to-run nondeterministic; anything in between is reported as what it is (k of N trials).
"""

from __future__ import annotations

from . import probe
from ..findings import labels
from .probe import on_engine  # noqa: F401 - the engine side of 01 is the probe's

NAME = "reproduce"
NOTEBOOK = "01"


def cases(params: dict):
    from .. import profiles

    base = profiles.base_moe(params)
    return [probe.case(base.replace(dispatcher=d, router_dtype=r), cut=params["cut"], detail=True,
                       trials=profiles.trials(params), experiment=NAME, release=profiles.release(params))
            for d in params["dispatchers"] for r in params["router_dtypes"]]


def records(case, per_rank):
    return probe.records(case, per_rank)


def attribution(rec: dict) -> str:
    """'equal' | 'ep' | 'ep+nondeterminism' | 'nondeterminism' | 'mixed' | 'n/a' for one record's cross-rank
    comparison (labels.attribution)."""
    return labels.attribution(rec["cross_rank"], rec["rerun"])


def where(rec: dict) -> str:
    return (f"megatron-core {rec['megatron_core']}, {rec['world']} EP rank(s) on {rec.get('gpu') or rec['device']} "
            f"({rec['backend']}; {rec.get('placement', '')})")


def verdict(records: list[dict]) -> str:
    """Notebook 01's verdict: its findings (moe_lab.findings.reproduce), rendered."""
    from ..findings import render, reproduce as found

    return render.verdict(found.findings(records), title=where(records[0]) + ", same tokens on every rank:"
                          if records else "")


__all__ = ["cases", "on_engine", "records", "verdict", "attribution"]
