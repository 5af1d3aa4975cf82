"""Notebook 09's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import MAX_DIM
from ...params import as_tuple, Flat


@dataclass(frozen=True, kw_only=True)
class SeqLenParams(Flat):
    """The sequence lengths the same layer runs at; everything else is the profile's layer."""

    SPLIT = {"seq_lens": ","}

    seq_lens: tuple[int, ...] = (64, 128, 256)
    """Tokens per forward, each run on every dispatcher of the profile (router dtype 'none': the plain bf16 layer);
    `-p seq_lens=64,128,256`."""

    def __post_init__(self):
        v = as_tuple(self, "seq_lens")
        if isinstance(v, tuple) and all(isinstance(x, str) for x in v):  # `-p seq_lens=64,128` gives strings
            try:
                v = tuple(int(x) for x in v)
            except ValueError:
                pass
            object.__setattr__(self, "seq_lens", v)
        ok = (isinstance(v, tuple) and len(v) >= 2
              and all(isinstance(x, int) and not isinstance(x, bool) and 2 <= x <= MAX_DIM for x in v)
              and len(set(v)) == len(v))
        if not ok:
            raise ValueError(f"seq_lens ({list(v) if isinstance(v, tuple) else v!r}) must be a list of at least two "
                             f"distinct integers in 2..{MAX_DIM}, e.g. [64, 128, 256] (or -p seq_lens=64,128,256)")

    def check_world(self, config, ccfg) -> None:
        """At each length the run's layout splits the layer (sequence parallelism: the length over tp)."""
        for n in self.seq_lens:
            try:
                config.layout.on(ccfg.engines).check_layer(config.layer.replace(seq_len=n))
            except ValueError as e:
                raise ValueError(f"seq_lens entry {n} on {ccfg.engines} ranks: {e}") from None
