"""The record of a notebook-08 case (`questions.oracle.experiment`): one dispatcher's runs against the fp64 truth."""

from __future__ import annotations

from dataclasses import dataclass

from ...records import ABSENT, Body


@dataclass(frozen=True)
class OracleRecord(Body):
    reference: str
    """The layout whose bf16 weights and tokens, upcast to fp64, are the truth."""
    layouts: list
    dispatchers: list
    """The dispatchers every layout and fault ran with (one case: dispatcher against dispatcher is a pair of runs)."""
    faults: list
    trials: int
    runs: list
    """Per run (each layout x trial, each planted fault): label, layout, fault, trial, `stats` (group → the rule's
    statistics: router.logits/…, router.probs/… on the truth's routed entries, out/… whole and per expert's tokens,
    flipped tokens left out) and `flips` (tokens whose top-k set differs from the truth's, their margins in ULP, and
    `count_changed`: tokens routed to another number of experts than the truth's)."""
    pairs: list
    """Per pair of runs: a, b and `rule.pair_gap`'s fields (bits differing of n, |A-B| in ULP and absolute, atol/rtol)."""
    fp64_layouts: dict
    """Per layout: its own fp64 truth against the reference's (max abs, max rel, routing equal)."""
    truth: dict
    memory: dict = ABSENT
    """Where the layer was sized to the GPU the ranks share (`memory.OracleSizing`: each rank's share, what the
    profile's layer needs, the ffn width run); absent where it ran the profile's layer unsized."""


__all__ = ["OracleRecord"]
