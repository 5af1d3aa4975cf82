"""The record of a notebook-07 cell (`questions.presets.experiment`): notebook 03's cell on a model preset's layer,
so 03's record type under 07's name (a preset's question adds its fields here)."""

from __future__ import annotations

from dataclasses import dataclass

from ..promotion.record import PromotionRecord


@dataclass(frozen=True)
class PresetRecord(PromotionRecord):
    pass


__all__ = ["PresetRecord"]
