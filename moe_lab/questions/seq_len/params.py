"""Notebook 09's parameters (flat profile keys). Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

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
        ok = (isinstance(v, tuple) and len(v) >= 2 and len(set(v)) == len(v)
              and all(isinstance(x, int) and not isinstance(x, bool) and x >= 2 for x in v))
        if not ok:
            raise ValueError(f"seq_lens ({list(v) if isinstance(v, tuple) else v!r}) must be a list of at least two "
                             "distinct integers >= 2, e.g. [64, 128, 256] (or -p seq_lens=64,128,256)")
