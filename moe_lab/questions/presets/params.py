"""Notebook 07's parameters: the profile's "presets" object. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import MAX_REPEATS, ROUTER_DTYPES, check_count
from ...params import Section, tuple_of


@dataclass(frozen=True, kw_only=True)
class PresetParams(Section):
    """Notebook 07's parameters (the profile's "presets" object): for each model preset, the questions of
    01-04 — do EP ranks agree, where do they first part, which setting makes them agree and at what cost — on a grid
    of dispatcher x router dtype x deterministic mode of the preset's layer."""

    KEY = "presets"

    models: tuple[str, ...] = ("qwen3-30b-a3b", "deepseek-v3")
    """Presets run (moe_lab.models); with the profile's `model` set, that one model instead."""
    scale: float = 1.0
    """Shrinks every preset's hidden and ffn (labelled as scaled); 1 is the published layer."""
    router_dtypes: tuple[str, ...] = ("none", "fp32")
    """moe_router_dtype settings of the grid ('none': plain bf16, the reference cell)."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on (on GPUs also NCCL_ALGO=Ring and CUBLAS_WORKSPACE_CONFIG=:4096:8)."""
    cost_rounds: int = 7
    """Paired timing rounds of each cell against the plain forward; 0: no cost."""

    def __post_init__(self):
        from ... import models

        mods = tuple_of(self, "models", str)
        for m in mods:
            try:
                models.get(m)
            except ValueError as e:
                raise ValueError(f"presets.models: {e}") from None
        if not isinstance(self.scale, (int, float)) or isinstance(self.scale, bool) or not 0 < self.scale <= 1:
            raise ValueError(f"presets.scale ({self.scale!r}) must be a number in (0, 1], e.g. 0.125")
        tuple_of(self, "router_dtypes", str, ROUTER_DTYPES)
        if "none" not in self.router_dtypes:
            raise ValueError(f"presets.router_dtypes ({self.router_dtypes!r}) must include 'none': the plain bf16 "
                             "cell is the reference every other setting is judged against")
        tuple_of(self, "deterministic", bool)
        if False not in self.deterministic:
            raise ValueError(f"presets.deterministic ({self.deterministic!r}) must include false (the plain cell)")
        check_count("presets.cost_rounds", self.cost_rounds, least=0, most=MAX_REPEATS, zero="no cost")

    def check_world(self, config, ccfg) -> None:
        """Each preset's layer (scaled, at the profile's seq_len) splits as the run's layout does on its world."""
        from ... import models

        for m in self.models:
            try:
                config.layout.on(ccfg.engines).check_layer(config.preset_layer(m, self.scale),
                                                           heads=models.get(m).heads)
            except ValueError as e:
                raise ValueError(f"presets.models entry {m!r} (scale {self.scale:g}) on {ccfg.engines} ranks: "
                                 f"{e}") from None
