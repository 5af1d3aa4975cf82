"""Notebook 04's records (`questions.truncation.experiment`), one type per case kind: `routing` (is the routing batch
invariant?), `kernel` (one expert GEMM's rows inside M rows vs alone, per state), `case` (a remedy x emulation run:
truncation and rerun comparisons, cost)."""

from __future__ import annotations

from dataclasses import dataclass, field, fields
from typing import Any

from ...records import ABSENT, Body, Comparison, NotCompared


@dataclass(frozen=True)
class RoutingRecord(Body):
    emulated: bool
    routing: dict
    """routing_map_equal (every rank), probs (their comparison, worst rank), probs_dtype."""
    zero_tokens: Any
    router_counts: Any
    rows_per_expert: dict


@dataclass(frozen=True)
class KernelRecord(Body):
    COMPARISONS = ("kernel",)

    emulation: Any = ABSENT
    remedy: Any = ABSENT
    tile: Any = ABSENT
    linear: Any = ABSENT
    K: Any = ABSENT
    N: Any = ABSENT
    M: Any = ABSENT
    m: Any = ABSENT
    kernel: Comparison | NotCompared = ABSENT
    splits: Any = ABSENT
    emulated: bool = ABSENT
    extra: dict = field(default_factory=dict)
    """Anything else a kernel state names (kept, after the fields above)."""

    @classmethod
    def of_row(cls, row: dict) -> "KernelRecord":
        """An engine row (the state, the linear and its sizes, the comparison) → its record."""
        names = {f.name for f in fields(cls)} - {"extra"}
        return cls(**{k: v for k, v in row.items() if k in names}, emulated=row["emulation"] != "none",
                   extra={k: v for k, v in row.items() if k not in names})


@dataclass(frozen=True)
class TruncationCase(Body):
    COMPARISONS = ("truncation", "rerun")

    remedy: str
    emulation: str
    emulated: bool
    tile: int | None
    available: bool
    reason: Any = ABSENT
    truncation: Comparison | NotCompared | None = ABSENT
    rerun: Comparison | NotCompared | None = ABSENT
    token_mismatch_frac: Any = ABSENT
    t_forward_s: float | None = ABSENT
    t_plain_s: Any = ABSENT
    cost: Any = ABSENT
    overhead: Any = ABSENT
    overhead_range: Any = ABSENT
    one_ulp_fails_frac: Any = ABSENT
    abs_quantiles: Any = ABSENT


__all__ = ["RoutingRecord", "KernelRecord", "TruncationCase"]
