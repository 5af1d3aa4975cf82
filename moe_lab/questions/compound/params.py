"""Notebook 05's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import MAX_DIM, MAX_REPEATS, check_count, check_positive
from ...params import Flat, strs

SETTING_NAMES = ("plain", "router fp32", "router fp64", "probs fp32 gather", "deterministic",
                 "ordered_combine+no_splitk", "router fp32 + fp32 grad reduce", "batch_invariant_mode",
                 "batch_invariant_mode, router fp64", "routing replay", "moe_permute_fusion", "moe_router_fusion",
                 "deterministic + ordered_combine+no_splitk + routing replay",
                 "deterministic + ordered_combine+no_splitk + routing replay + fp32 grad reduce")
"""The settings notebook 05 compares (questions.compound.experiment.SETTINGS says what each one changes; a test holds
the two lists equal): here, torch-free, so that a profile naming another one is refused when it loads."""


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
        names = "settings from " + ", ".join(map(repr, SETTING_NAMES))
        strs(self, "compound_settings", SETTING_NAMES, empty_ok=True, what=names + " (empty: all of them)")
        strs(self, "depth_settings", SETTING_NAMES, what=names)
        for name in ("compound_settings", "depth_settings"):
            if len(set(getattr(self, name))) != len(getattr(self, name)):
                raise ValueError(f"{name} ({list(getattr(self, name))!r}) names a setting twice")
        check_positive("depth_layers", self.depth_layers, MAX_REPEATS)
        check_count("depth_ffn_hidden", self.depth_ffn_hidden, least=0, most=MAX_DIM, zero="the layer's")

    def check_world(self, config, ccfg) -> None:
        """The depth stacks' layer (the profile's, with depth_ffn_hidden) splits as the run's layout does."""
        if not self.depth_ffn_hidden:
            return
        try:
            config.layout.on(ccfg.engines).check_layer(config.layer.replace(ffn_hidden=self.depth_ffn_hidden))
        except ValueError as e:
            raise ValueError(f"depth_ffn_hidden ({self.depth_ffn_hidden}) on {ccfg.engines} ranks: {e}") from None
