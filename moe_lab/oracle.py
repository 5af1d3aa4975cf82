"""Judge outputs you saved from your own runs with notebook 08's rule: is the gap between two bf16 outputs what
rounding gives, and what tolerance does a test of them need?

    from moe_lab import oracle
    v = oracle.judge(out_ep4, out_ep1, truth=out_fp64)          # or known_good=(rerun1, rerun2, other_layout)
    print(v)                                                     # expected / not explained by rounding, and why
    v.expected, v.tolerance.assert_close(), v.why

Torch-free: tensors are read through their own methods; numpy arrays work as they are. The rule is
`moe_lab.questions.oracle.rule` (the page of notebook 08 states it)."""

from __future__ import annotations

from .questions.oracle.rule import PairVerdict, RunVerdict, Tolerance, error_stats, judge, judge_runs, pair_gap

__all__ = ["judge", "PairVerdict", "RunVerdict", "Tolerance", "error_stats", "judge_runs", "pair_gap"]
