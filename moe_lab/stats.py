"""Pure statistics of timings, one definition everywhere (#12, #14): a cost is the median over paired rounds of
(slowest rank's time with the change) / (slowest rank's time without it), with a distribution-free 95 % confidence
interval of that median (order statistics); an A/A run (plain against plain, same protocol) gives the noise floor.
A cost whose interval overlaps the noise floor's is "no measurable cost", and costs inside the noise are never
ranked."""

from __future__ import annotations

import math
import statistics

LEVEL = 0.95


def median_ci(xs: list[float], level: float = LEVEL) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: order statistics x(k), x(n+1-k) with the largest k
    such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2. Needs n >= 6 at 95 %; fewer give (min, max)."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return (math.nan, math.nan)
    alpha = (1 - level) / 2
    k, cdf = 0, 0.0
    for j in range(n):  # cdf = P(B < j + 1)
        cdf += math.comb(n, j) / 2**n
        if cdf > alpha:
            break
        k = j + 1
    if k == 0:
        return (s[0], s[-1])
    return (s[k - 1], s[n - k])


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per round, the slowest rank's time: a collective forward is as slow as its slowest rank."""
    return [max(r[i] for r in per_rank) for i in range(min(len(r) for r in per_rank))]


def paired(with_change: list[float], without: list[float], level: float = LEVEL) -> dict:
    """Cost of a change from paired rounds (round i: with, then without, back to back): median ratio, its CI."""
    ratios = [a / b for a, b in zip(with_change, without) if b > 0]
    if not ratios:
        return {"ratio": None, "ci": None, "rounds": 0}
    lo, hi = median_ci(ratios, level)
    return {"ratio": statistics.median(ratios), "ci": [lo, hi], "rounds": len(ratios), "ratios": ratios,
            "t_with_s": statistics.median(with_change), "t_without_s": statistics.median(without)}


def measurable(cost: dict, floor: dict | None) -> bool | None:
    """Whether a cost is resolved against the A/A noise floor: its interval does not overlap the floor's.
    None when either is missing."""
    if not cost or cost.get("ci") is None or not floor or floor.get("ci") is None:
        return None
    return cost["ci"][0] > floor["ci"][1] or cost["ci"][1] < floor["ci"][0]


def describe(cost: dict, floor: dict | None = None) -> str:
    """'1.08x (95 % CI 1.03–1.12)', with ', no measurable cost' when the interval overlaps the noise floor."""
    if not cost or cost.get("ratio") is None:
        return "n/a"
    text = f"{cost['ratio']:.2f}x (95 % CI {cost['ci'][0]:.2f}–{cost['ci'][1]:.2f})"
    if measurable(cost, floor) is False:
        text += ", no measurable cost"
    return text


__all__ = ["median_ci", "slowest", "paired", "measurable", "describe", "LEVEL"]
