"""Notebook 04's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...params import Flat, as_tuple, strs


@dataclass(frozen=True, kw_only=True)
class TruncationParams(Flat):
    """Notebook 04's parameters: the worlds the truncation test runs at, and the remedies and tiles it tries."""

    NOTEBOOK = "04"
    SPLIT = {"truncation_remedies": ","}

    truncation_engines: tuple[int, ...] = ()
    """Worlds to run at; empty: on one GPU EP=1 and the virtual EP of `one_gpu_engines`, else the profile's."""
    truncation_remedies: tuple[str, ...] = ()
    """Remedies tried (questions.truncation.experiment); empty: every one the device's plan has."""
    truncation_tiles: tuple[int, ...] = ()
    """Tile sizes of tiled_experts; empty: the plan's."""

    def __post_init__(self):
        for name in ("truncation_engines", "truncation_tiles"):
            v = as_tuple(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                   for x in v):
                raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a list of positive "
                                 "integers, e.g. [1, 4]")
        strs(self, "truncation_remedies", empty_ok=True)
