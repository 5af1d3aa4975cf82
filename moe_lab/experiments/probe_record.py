"""The record of a probe case (`moe-lab probe`, notebook 01's `reproduce`): the three comparisons over ranks and trials,
the forward time, the cross-rank fingerprints and, when the case asked for it, the figures' detail."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from moe_lab.records import ABSENT, Body, Comparison, NotCompared


@dataclass(frozen=True)
class ProbeRecord(Body):
    COMPARISONS = ("cross_rank", "rerun", "truncation")

    cross_rank: Comparison | NotCompared
    """The same tokens on every rank: rank 0 against every other, worst pair per trial, over trials."""
    rerun: Comparison | NotCompared
    """The same input twice on one rank (worst rank per trial), over trials."""
    truncation: Comparison | NotCompared
    """The first `cut` tokens with and without the rest zeroed (worst rank per trial), over trials."""
    t_forward_s: float | None
    fingerprints: Any = ABSENT
    bytes_compared: Any = ABSENT
    detail: Any = ABSENT
    """ULP histograms, per-token mismatch and maps of the worst trial (a case with `detail`)."""


__all__ = ["ProbeRecord"]
