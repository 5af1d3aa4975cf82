"""Notebook 05's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import check_positive
from ...params import Flat, strs


@dataclass(frozen=True, kw_only=True)
class CompoundParams(Flat):
    """Notebook 05's parameters: the settings whose gradients are compared, and the depth stacks."""

    NOTEBOOK = "05"
    SPLIT = {"compound_settings": ",", "depth_settings": ","}

    compound_settings: tuple[str, ...] = ()
    """Settings compared at one layer (questions.compound.experiment.SETTINGS); empty: all of them."""
    depth_settings: tuple[str, ...] = ("plain", "router fp32")
    """Settings of the depth stacks."""
    depth_layers: int = 8
    """Distinct layers of the depth stack."""
    depth_ffn_hidden: int = 0
    """Expert ffn of the depth stack's layers (0: the profile's layer's)."""

    def __post_init__(self):
        strs(self, "compound_settings", empty_ok=True)
        strs(self, "depth_settings")
        check_positive("depth_layers", self.depth_layers)
        if not isinstance(self.depth_ffn_hidden, int) or isinstance(self.depth_ffn_hidden, bool) \
                or self.depth_ffn_hidden < 0:
            raise ValueError(f"depth_ffn_hidden ({self.depth_ffn_hidden!r}) must be 0 (the layer's) or a positive "
                             "integer")
