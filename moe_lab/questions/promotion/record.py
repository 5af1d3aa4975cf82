"""The record of a notebook-03 cell (`questions.promotion.experiment`; notebook 07's presets emit the same): the probe's three
comparisons, the dtypes the collectives run in and the first divergent stage (from one captured forward), and the
paired cost against the plain forward."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...records import ABSENT, Body, Comparison, NotCompared


@dataclass(frozen=True)
class PromotionRecord(Body):
    COMPARISONS = ("cross_rank", "rerun", "truncation")

    cross_rank: Comparison | NotCompared
    rerun: Comparison | NotCompared
    truncation: Comparison | NotCompared
    t_forward_s: float | None
    """The cell's forward time (the paired cost's `t_with_s` when cost rounds ran)."""
    probs_dtype: str
    """The dtype the probs are communicated in ('not communicated' when the dispatcher does not send them)."""
    combine_op: str | None
    combine_dtype: str | None
    out_dtype: str | None
    first_divergent_stage: str | None
    first_divergent_kind: str | None
    cost: Any = ABSENT
    """stats.paired_cost of the cell against the plain forward (ratio, ci, t_with_s, ...), when cost rounds ran."""


__all__ = ["PromotionRecord"]
