"""Notebook 01: the same tokens on every EP rank — do the MoE outputs agree? (dispatcher x router dtype, probe cases)

Attribution rule: a cross-rank difference is EP-order divergence only if the ranks differ in EVERY trial and a
rerun on one rank is bitwise equal in EVERY trial. If reruns differ too, the ranks disagree because each forward is
run-to-run nondeterministic; anything in between is reported as what it is (k of N trials).
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from . import QUESTION
from ...experiments import probe
from ...findings import labels
from ...experiments.probe import on_engine  # noqa: F401 - the engine side of 01 is the probe's

NAME = "reproduce"
NOTEBOOK = QUESTION.number


def cases(config: RunConfig):
    base = config.layer
    return [probe.case(base.replace(dispatcher=d, router_dtype=r), cut=config.run.cut, detail=True,
                       trials=config.run.trials, experiment=NAME, release=config.release, layout=config.layout)
            for d in config.run.dispatchers for r in config.run.router_dtypes]


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
    """Notebook 01's verdict: its findings (moe_lab.questions.reproduce.findings), rendered."""
    from ...findings import render
    from . import findings as found

    return render.verdict(found.findings(records), title=where(records[0]) + ", same tokens on every rank:"
                          if records else "")


__all__ = ["cases", "on_engine", "records", "verdict", "attribution"]
