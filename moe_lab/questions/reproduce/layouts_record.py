"""The record of a notebook-01 layout case (`questions.reproduce.layouts`): one layout against the reference layout on the same
weights and tokens — the output, per stage, rerun, across ranks, and with autograd on against off."""

from __future__ import annotations

from dataclasses import dataclass

from ...records import ABSENT, Body, Comparison, NotCompared, parse_comparison


@dataclass(frozen=True)
class LayoutRecord(Body):
    COMPARISONS = ("vs_reference", "rerun", "cross_rank", "grad_vs_nograd")

    layout: str
    reference_layout: str
    is_reference: bool
    etp: int
    sequence_parallel: bool
    vs_reference: Comparison | NotCompared
    rerun: Comparison | NotCompared
    cross_rank: Comparison | NotCompared
    stages_vs_reference: dict
    """Stage name → its comparison against the reference layout (over trials)."""
    first_divergent_stage: str | None
    grad_vs_nograd: Comparison | NotCompared = ABSENT
    """The output with autograd on against off (records before it was measured have none)."""

    @classmethod
    def from_dict(cls, d):
        rec = super().from_dict(d)
        stages = {k: parse_comparison(v) for k, v in (rec.stages_vs_reference or {}).items()}
        return cls(**{**rec.__dict__, "stages_vs_reference": stages})


__all__ = ["LayoutRecord"]
