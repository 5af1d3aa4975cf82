"""Notebook 03's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ROUTER_DTYPES
from ...params import Flat, bools, strs


@dataclass(frozen=True, kw_only=True)
class PromotionParams(Flat):
    """Notebook 03's parameters: the grid of router dtype x probs fp32 gather x deterministic mode, per release."""

    NOTEBOOK = "03"
    SPLIT = {"releases": ",", "sweep_router_dtypes": ","}

    releases: tuple[str, ...] = ()
    """megatron-core releases compared ('installed' or X.Y.Z, side by side); empty: the profile's release."""
    sweep_router_dtypes: tuple[str, ...] = ()
    """moe_router_dtype settings of the grid; empty: the profile's `router_dtypes`."""
    probs_fp32_gather: tuple[bool, ...] = (False, True)
    """Gather the routing probabilities in fp32 (the seed report's suggestion) off / on."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on."""

    def __post_init__(self):
        from ...releases import check_supported, parse_version

        strs(self, "releases", empty_ok=True, what="'installed' or X.Y.Z strings, e.g. [\"0.11.0\", \"installed\"] or "
                                                    "-p releases=0.11.0,installed")
        if len(set(self.releases)) != len(self.releases):
            raise ValueError(f"releases ({list(self.releases)!r}) names a release twice")
        for v in self.releases:
            if v == "installed":
                continue
            try:
                parse_version(v)
            except ValueError:
                raise ValueError(f"releases entry ({v!r}) must be 'installed' or X.Y.Z, e.g. 0.12.3") from None
            try:
                check_supported(v)
            except ValueError as e:
                raise ValueError(f"releases entry {v!r}: {e}") from None
        strs(self, "sweep_router_dtypes", ROUTER_DTYPES, empty_ok=True)
        bools(self, "probs_fp32_gather")
        bools(self, "deterministic")

    def router_dtypes(self, config) -> tuple[str, ...]:
        return self.sweep_router_dtypes or config.run.router_dtypes
