"""Notebook 05's records (`questions.compound.experiment`): a `backward` case (forward output, input gradient, router gradient
and the experts' gradients compared rerun, truncated and across ranks; the first divergent backward stage; cost) and
one `depth` record per layer of a stack."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...records import ABSENT, Body, Comparison, NotCompared

Cmp = Comparison | NotCompared


@dataclass(frozen=True)
class BackwardRecord(Body):
    COMPARISONS = ("rerun_out", "truncation_out", "cross_out", "rerun_dx", "truncation_dx", "cross_dx",
                   "rerun_router_grad", "truncation_router_grad", "cross_router_grad", "experts_rerun",
                   "experts_truncation")

    rerun_out: Cmp
    truncation_out: Cmp
    cross_out: Cmp
    rerun_dx: Cmp
    truncation_dx: Cmp
    cross_dx: Cmp
    rerun_router_grad: Cmp
    truncation_router_grad: Cmp
    cross_router_grad: Cmp
    experts_rerun: Cmp
    experts_truncation: Cmp
    backward_first_divergent: Any = ABSENT
    backward_stages: Any = ABSENT
    backward_ledger: Any = ABSENT
    cost: Any = ABSENT
    available: bool = True

    def asdict(self) -> dict:
        return {"available": self.available, **{k: v for k, v in super().asdict().items() if k != "available"}}


@dataclass(frozen=True)
class DepthRecord(Body):
    COMPARISONS = ("rerun_out", "truncation_out", "rerun_grad", "truncation_grad", "cross_out", "cross_grad")

    layer: int
    """1 is the first layer of the stack."""
    abs_out: Any
    rerun_out: Cmp
    truncation_out: Cmp
    rerun_grad: Cmp
    truncation_grad: Cmp
    cross_out: Cmp
    cross_grad: Cmp


__all__ = ["BackwardRecord", "DepthRecord"]
