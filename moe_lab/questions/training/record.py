"""The record of a notebook-06 run (`questions.training.experiment`): its per-step series (loss, gradient norm, weights'
fingerprints, norms and sketches, routing), the data-parallel sizes, and the paired cost."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Any

from ...records import ABSENT, Body


@dataclass(frozen=True)
class TrainingRecord(Body):
    dp: int
    expert_dp: int
    loss: list
    loss_hex: list
    grad_norm: list
    weights_fp: list
    weights_norm: list
    weights_sketch: list
    weights_tensors: Any
    routing: Any
    topk: Any
    shares: Any
    cost: Any = ABSENT
    floor: Any = ABSENT
    """The paired cost of a second plain run against the first: the measurement's own noise floor."""
    available: bool = True

    def asdict(self) -> dict:
        return {"available": self.available, **{k: v for k, v in super().asdict().items() if k != "available"}}


__all__ = ["TrainingRecord"]
