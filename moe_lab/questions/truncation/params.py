"""Notebook 04's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import MAX_DIM
from ...params import Flat, as_tuple, strs

REMEDY_NAMES = ("deterministic", "padding_mask", "tiled_experts", "ordered_combine", "no_splitk",
                "batch_invariant_mode")
"""The remedies notebook 04 can apply (experiments.remedies.REMEDIES, which imports torch, says what each one does; a
test holds the two lists equal). A remedy of `truncation_remedies` is 'none' or '+'-joined names from these."""


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
            if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and 0 < x <= MAX_DIM
                                                   for x in v):
                raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a list of positive "
                                 f"integers <= {MAX_DIM}, e.g. [1, 4]")
        strs(self, "truncation_remedies", empty_ok=True)
        for spec in self.truncation_remedies:
            parts = [x for x in spec.split("+") if x and x != "none"]
            if [x for x in parts if x not in REMEDY_NAMES] or len(set(parts)) != len(parts):
                raise ValueError(f"truncation_remedies entry ({spec!r}) must be 'none' or '+'-joined names from "
                                 f"{', '.join(REMEDY_NAMES)}, each once, e.g. deterministic+tiled_experts")

    def check_world(self, config, ccfg) -> None:
        """Each world of `truncation_engines` is one the run's layout splits the layer over and (CPU engines) one
        this machine starts."""
        for w in self.truncation_engines:
            try:
                if ccfg.device == "cpu":
                    ccfg.replace(engines=w)
                config.layout.on(w).check_layer(config.layer)
            except ValueError as e:
                raise ValueError(f"truncation_engines entry {w}: {e}") from None
