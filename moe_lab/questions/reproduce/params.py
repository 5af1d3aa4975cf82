"""Notebook 01's layouts parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import ROUTER_DTYPES
from ...params import Flat, bools, strs


@dataclass(frozen=True, kw_only=True)
class LayoutParams(Flat):
    """Notebook 01's second question: the same layer under other parallel layouts, element by element
    against a reference layout."""

    NOTEBOOK = "01"
    SPLIT = {"layouts": ";", "layout_router_dtypes": ","}

    layouts: tuple[str, ...] = ("ep1", "ep4", "tp2,ep2", "tp2,ep2,etp1", "tp2,ep2,sp")
    """Layouts compared (`layout.Layout` specs: tp, ep, etp, sp); `-p 'layouts=ep1;ep4;tp2,ep2'`."""
    layout_reference: str = "ep1"
    """The layout every other one is compared with (run first; added if `layouts` lacks it)."""
    layout_router_dtypes: tuple[str, ...] = ("none", "fp32")
    """moe_router_dtype settings each layout runs with."""
    layout_deterministic: tuple[bool, ...] = (False,)
    """torch deterministic algorithms off / on for every layout and its reference (on GPUs also NCCL_ALGO=Ring and
    CUBLAS_WORKSPACE_CONFIG=:4096:8): with it on, a GPU's reference repeats itself and a difference is the layout's."""

    def __post_init__(self):
        from ...layout import Layout

        strs(self, "layouts")
        if len(set(self.layouts)) != len(self.layouts):
            raise ValueError(f"layouts ({list(self.layouts)!r}) must be a non-empty list of distinct layouts, e.g. "
                             "[\"ep1\", \"ep4\", \"tp2,ep2\"] (or -p 'layouts=ep1;ep4;tp2,ep2')")
        for spec in self.layouts + (self.layout_reference,):
            try:
                Layout.parse(spec)
            except ValueError as e:
                raise ValueError(f"layouts entry: {e}") from None
        strs(self, "layout_router_dtypes", ROUTER_DTYPES)
        bools(self, "layout_deterministic")

    def check_world(self, config, ccfg) -> None:
        """Every layout (the reference too) fits the run's world and splits its layer."""
        from ...layout import Layout

        for spec in self.order():
            try:
                Layout.parse(spec).on(ccfg.engines).check_layer(config.layer)
            except ValueError as e:
                raise ValueError(f"layouts entry {spec!r} on {ccfg.engines} ranks: {e}") from None

    def order(self) -> list[str]:
        """The reference first, then the other layouts as listed."""
        return [self.layout_reference] + [s for s in self.layouts if s != self.layout_reference]
