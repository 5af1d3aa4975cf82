"""Notebook 02's records (`questions.localise.experiment`), told apart by `kind`: one `case` record (the first divergent stage,
the output's mismatch, the dtypes the collectives run in), one `stage` record per stage x comparison unit, one
`collective` record per collective of rank 0's ledger."""

from __future__ import annotations

from dataclasses import dataclass, field
from typing import Any

from ...records import ABSENT, Body

STAGE_METRICS = ("numel", "n_mismatch", "mismatch_frac", "bitwise_equal", "max_ulp", "max_abs", "trials", "n_differ",
                 "per_trial")
"""What a stage record states of its comparison (a comparison's fields, flat, in this order)."""


@dataclass(frozen=True)
class LocaliseCase(Body):
    first_divergent_stage: str | None
    trials: int
    first_divergent_per_trial: list
    first_divergent_kind: str | None
    first_divergent_by_pair: dict
    out_mismatch_frac: float | None
    out_max_ulp: float | None
    cross_rank_applicable: bool
    probs_gather_dtype: str | None
    combine_dtype: str | None
    combine_op: str | None
    out_dtype: str | None
    bytes_compared: int
    kind: str = "case"


@dataclass(frozen=True)
class StageRecord(Body):
    """One stage x comparison unit ('rank 0-r' across ranks, or 'copies on rank r'): the stage's kind (replicated |
    copies | copies/expert) as `stage_kind`, its comparison flat (or `skipped` and why)."""

    stage: str
    order: int
    stage_kind: str
    dtype: Any
    shape: Any
    unit: str
    numel: Any = ABSENT
    n_mismatch: Any = ABSENT
    mismatch_frac: Any = ABSENT
    bitwise_equal: Any = ABSENT
    max_ulp: Any = ABSENT
    max_abs: Any = ABSENT
    trials: Any = ABSENT
    n_differ: Any = ABSENT
    per_trial: Any = ABSENT
    skipped: Any = ABSENT
    first_divergent_stage: Any = ABSENT
    kind: str = "stage"


@dataclass(frozen=True)
class CollectiveRecord(Body):
    """One collective of rank 0's ledger (seq, op, dtype, shape, bytes, group size, stage, role: as the engine saw
    it)."""

    kind: str = "collective"
    extra: dict = field(default_factory=dict)


__all__ = ["LocaliseCase", "StageRecord", "CollectiveRecord", "STAGE_METRICS"]
