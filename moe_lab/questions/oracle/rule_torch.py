"""The rule's statistics (`rule.error_stats`) computed with torch where an engine's tensors are: on a GPU a run's
output (millions of elements, and each expert's group of them) is sorted there instead of copied to the host and
partitioned by numpy group by group, which is most of notebook 08's time at a GPU profile's layer.

The same statistics as `rule.error_stats`, which stays the reference (and what `moe_lab.oracle.judge` runs on a
user's tensors): every quantile is numpy's 'linear' percentile formula applied to the same sorted values (equal
bits), the errors are the same IEEE operations, and only the means and standard errors are summed in another order
(a few ULPs of float64). tests/unit/test_oracle_unit.py holds the two against each other on random tensors, with a
control that tells them apart. Runs on the engines; imports torch.
"""

from __future__ import annotations

import math
from typing import Mapping

import torch

from . import rule


def round_bf16(x: torch.Tensor) -> torch.Tensor:
    """`x` rounded to the nearest bf16 value through fp32 (as `rule.round_bf16`), as float64; NaN and inf kept."""
    x = x.to(torch.float64)
    out = x.to(torch.float32).to(torch.bfloat16).to(torch.float64)
    return torch.where(torch.isfinite(x), out, x)


def bf16_ulp(truth: torch.Tensor) -> torch.Tensor:
    """`rule.bf16_ulp`: the spacing of bf16 values at the truth's bf16 value."""
    r = round_bf16(truth).abs()
    r = torch.where(torch.isfinite(r), r, torch.full_like(r, float(torch.finfo(torch.float32).max)))
    _, e = torch.frexp(r)
    e = torch.clamp_min(e.to(torch.int64) - 1, rule.BF16_MIN_NORMAL_EXP)
    return torch.ldexp(torch.ones_like(r), e - (rule.BF16_MANTISSA - 1))


def errors(run: torch.Tensor, truth: torch.Tensor) -> tuple[torch.Tensor, torch.Tensor]:
    """`rule.errors`: per element the signed error in ULPs of the truth's bf16 value, and the relative error."""
    r = run.detach().reshape(-1).to(torch.float64)
    t = torch.as_tensor(truth).detach().reshape(-1).to(r.device, torch.float64)
    if r.shape != t.shape:
        raise ValueError(f"run and truth must have as many elements: {r.numel()} vs {t.numel()}")
    d = r - t
    ulp = d / bf16_ulp(t)
    zero, inf = torch.zeros_like(d), torch.full_like(d, math.inf)
    rel = torch.where(t != 0, d / t.abs(), torch.where(d == 0, zero, inf))
    return ulp, rel


def _percentiles(a: torch.Tensor, qs) -> list[float]:
    """numpy's 'linear' percentiles of a flat float64 tensor (the virtual index (n - 1) q, its floor and the
    fraction above it, and numpy's lerp) from one sort; NaN where it is empty or holds a NaN, as numpy's."""
    n = a.numel()
    if n == 0 or bool(torch.isnan(a).any()):
        return [float("nan")] * len(qs)
    pos = []
    for p in qs:
        v = (n - 1) * (p / 100)
        lo = min(max(math.floor(v), 0), n - 1)
        pos.append((lo, min(lo + 1, n - 1), v - math.floor(v)))
    idx = torch.tensor([i for lo, hi, _ in pos for i in (lo, hi)], device=a.device)
    vals = torch.sort(a.reshape(-1)).values[idx].tolist()
    return [_lerp(vals[2 * i], vals[2 * i + 1], g) for i, (_, _, g) in enumerate(pos)]


def _lerp(a: float, b: float, g: float) -> float:
    d = b - a
    return b - d * (1 - g) if g >= 0.5 else a + d * g


def _quantiles(a: torch.Tensor) -> dict[str, float]:
    """`rule._quantiles`: the ULP statistics of a flat float64 tensor."""
    return dict(zip(rule.ULP_STATISTICS, _percentiles(a, [rule.QUANTILES[s] for s in rule.ULP_STATISTICS])))


def _one_group(ulp: torch.Tensor, rel: torch.Tensor) -> dict:
    a = ulp.abs()
    n = int(a.numel())
    stats = {"n": n, **_quantiles(a)}
    stats["mean"] = float(ulp.mean()) if n else float("nan")
    stats["mean_se"] = float(ulp.std(correction=1) / math.sqrt(n)) if n > 1 else float("inf")
    stats["noise"] = rule.split_noise(a, _quantiles)
    rq = _quantiles(rel[torch.isfinite(rel)].abs())
    stats["rel"] = {s: rq[s] for s in ("median", "p99", "max")}
    return stats


def _flags(x, n: int, device, what: str) -> torch.Tensor:
    m = torch.as_tensor(x, device=device).reshape(-1).to(torch.bool)
    if m.numel() != n:
        raise ValueError(f"{what} must give one flag per element: {m.numel()} for {n} elements")
    return m


def error_stats(run: torch.Tensor, truth: torch.Tensor, labels=None, *, prefix: str = "",
                masks: Mapping[str, object] | None = None, keep=None) -> dict[str, dict]:
    """`rule.error_stats` on `run`'s device (labels, masks and keep: numpy arrays or tensors, moved there)."""
    ulp, rel = errors(run, truth)
    dev, n = ulp.device, ulp.numel()
    kept = torch.ones(n, dtype=torch.bool, device=dev) if keep is None else _flags(keep, n, dev, "keep")
    out = {prefix + rule.ALL: _one_group(ulp[kept], rel[kept])}
    if labels is not None:
        lab = torch.as_tensor(labels, device=dev).reshape(-1)
        if lab.numel() != n:
            raise ValueError(f"labels must give one label per element: {lab.numel()} labels for {n} elements")
        labelled = kept.clone()
        if not lab.is_floating_point() and lab.dtype != torch.bool:
            labelled &= lab >= 0
        for g in sorted(set(torch.unique(lab[labelled]).tolist())):
            m = labelled & (lab == g)
            out[f"{prefix}{g}"] = _one_group(ulp[m], rel[m])
    for name, mask in (masks or {}).items():
        m = _flags(mask, n, dev, f"mask {name!r}") & kept
        out[prefix + name] = _one_group(ulp[m], rel[m])
    return out


def _all_bf16(x: torch.Tensor) -> bool:
    finite = x[torch.isfinite(x)]
    return bool(torch.equal(round_bf16(finite), finite))


def bf16_ordered(x: torch.Tensor) -> torch.Tensor:
    """`rule.bf16_ordered`: bf16 values mapped to int64 so adjacent bf16 values differ by 1."""
    b = (x.to(torch.float32).view(torch.int32).to(torch.int64) & 0xFFFFFFFF) >> 16
    mag = b & 0x7FFF
    return torch.where((b & 0x8000) != 0, -mag, mag)


def pair_gap(a: torch.Tensor, b: torch.Tensor) -> rule.Tolerance:
    """`rule.pair_gap` on `a`'s device: the gap between two runs and the tolerance it needs."""
    x = a.detach().reshape(-1).to(torch.float64)
    y = b.detach().reshape(-1).to(x.device, torch.float64)
    if x.shape != y.shape:
        raise ValueError(f"a and b must have as many elements: {x.numel()} vs {y.numel()}")
    n = int(x.numel())
    d = (x - y).abs()
    if _all_bf16(x) and _all_bf16(y):
        ulp = (bf16_ordered(x) - bf16_ordered(y)).abs().to(torch.float64)
    else:
        ulp = d / bf16_ulp(y)
    differ = int((ulp != 0).sum())
    if n == 0 or differ == 0:
        return rule.Tolerance(n=n, differ=0, p999_ulp=0.0, max_ulp=0.0, p999_abs=0.0, max_abs=0.0, max_rel=0.0,
                              atol=0.0, rtol=0.0)
    denom = torch.maximum(x.abs(), y.abs())
    rel = torch.where(denom > 0, d / denom, torch.zeros_like(d))
    (p999_ulp,) = _percentiles(ulp, [99.9])
    (median_y,) = _percentiles(y.abs(), [50.0])
    large = y.abs() >= median_y
    (p999_large,) = _percentiles(ulp[large], [99.9])
    rtol = max(p999_large, 1.0) * 2.0 ** -7
    atol = float(torch.clamp_min(d - rtol * y.abs(), 0.0).max())
    (p999_abs,) = _percentiles(d, [99.9])
    return rule.Tolerance(n=n, differ=differ, p999_ulp=p999_ulp, max_ulp=float(ulp.max()), p999_abs=p999_abs,
                          max_abs=float(d.max()), max_rel=float(rel.max()), atol=atol, rtol=rtol)


__all__ = ["error_stats", "errors", "bf16_ulp", "round_bf16", "bf16_ordered", "pair_gap"]
