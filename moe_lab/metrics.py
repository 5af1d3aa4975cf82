"""Pure tensor → number: bitwise mismatch, abs/rel error, ULP distance, fingerprints.

Experts read bf16 divergence in ULPs (units in the last place), not through `allclose(1e-3)`:
bf16 keeps 8 significand bits, so one ULP at |x| in [1, 2) is 2**-7 = 0.0078 — far above 1e-3.
"""

from __future__ import annotations

import math

import torch

# dtype → (integer view dtype, bits, mantissa bits incl. the implicit one)
_FORMATS = {
    torch.bfloat16: (torch.int16, 16, 8),
    torch.float16: (torch.int16, 16, 11),
    torch.float32: (torch.int32, 32, 24),
    torch.float64: (torch.int64, 64, 53),
}


def _format(dtype: torch.dtype):
    try:
        return _FORMATS[dtype]
    except KeyError:
        raise ValueError(f"dtype ({dtype}) must be one of {', '.join(map(str, _FORMATS))}") from None


def ordered_bits(x: torch.Tensor) -> torch.Tensor:
    """Map floats to int64 so that adjacent representable values differ by 1 (and +0 == -0).

    Sign-magnitude → two's-complement order: non-negative floats keep their bits, negative floats
    become -(magnitude bits). For fp64 the result spans the whole int64 range.
    """
    int_dtype, bits, _ = _format(x.dtype)
    i = x.contiguous().view(int_dtype).to(torch.int64)
    mag_mask = (1 << (bits - 1)) - 1
    mag = i & mag_mask
    return torch.where(i < 0, -mag, mag)


def ulp_distance(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Element-wise ULP distance as float64: 0 for equal values (+0 vs -0 too), inf if exactly one is NaN.

    Two NaNs are at distance 0. Infinities sit one ULP past the largest finite value, as IEEE orders them.
    """
    if a.dtype != b.dtype or a.shape != b.shape:
        raise ValueError(f"tensors must share dtype and shape, got {a.dtype}{tuple(a.shape)} vs {b.dtype}{tuple(b.shape)}")
    oa, ob = ordered_bits(a), ordered_bits(b)
    same_sign = (oa >= 0) == (ob >= 0)
    # Same sign: the int64 difference cannot overflow. Opposite signs: |oa| + |ob| may (fp64), so add as float.
    d_same = (oa - ob).abs().to(torch.float64)
    d_opp = oa.abs().to(torch.float64) + ob.abs().to(torch.float64)
    d = torch.where(same_sign, d_same, d_opp)
    na, nb = torch.isnan(a), torch.isnan(b)
    d = torch.where(na & nb, torch.zeros_like(d), d)
    d = torch.where(na ^ nb, torch.full_like(d, math.inf), d)
    return d


def ulp_size(x: torch.Tensor) -> torch.Tensor:
    """The spacing of representable values at |x| (as float64): 2**(exponent(x) - mantissa_bits + 1)."""
    _, _, mant = _format(x.dtype)
    finfo = torch.finfo(x.dtype)
    ax = x.detach().abs().to(torch.float64).clamp_min(finfo.tiny)
    e = torch.frexp(ax).exponent - 1  # exact; floor(log2(x)) rounds up just below powers of two in fp64
    return torch.pow(2.0, (e - (mant - 1)).to(torch.float64))


def bitwise_mismatch(a: torch.Tensor, b: torch.Tensor) -> torch.Tensor:
    """Boolean mask of elements whose bits differ (a NaN with identical bits counts as equal)."""
    int_dtype, _, _ = _format(a.dtype)
    return a.contiguous().view(int_dtype) != b.contiguous().view(int_dtype)


def compare(a: torch.Tensor, b: torch.Tensor, *, atol: float = 1e-3, rtol: float = 1e-3) -> dict:
    """One comparison the way the lab reports it: bitwise first, then ULPs, abs/rel, and tolerance checks.

    `allclose_1e3` is the seed report's `torch.allclose(atol=rtol=1e-3)`: shown for what it is, not a verdict.
    `assert_close` is `torch.testing.assert_close` with its dtype defaults (bf16: rtol 1.6e-2, atol 1e-5).
    """
    if a.shape != b.shape:
        raise ValueError(f"shapes differ: {tuple(a.shape)} vs {tuple(b.shape)}")
    if a.dtype != b.dtype:
        raise ValueError(f"dtypes differ: {a.dtype} vs {b.dtype}")
    a, b = a.detach(), b.detach()
    n = a.numel()
    mism = bitwise_mismatch(a, b)
    n_mism = int(mism.sum())
    ulp = ulp_distance(a, b)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    abs_err = (a64 - b64).abs()
    finite = torch.isfinite(abs_err)
    denom = torch.maximum(a64.abs(), b64.abs())
    rel_err = torch.where(denom > 0, abs_err / denom, torch.zeros_like(abs_err))
    try:
        torch.testing.assert_close(a, b)
        assert_close_ok = True
    except AssertionError:
        assert_close_ok = False
    return {
        "numel": n,
        "n_mismatch": n_mism,
        "mismatch_frac": n_mism / n if n else 0.0,
        "bitwise_equal": n_mism == 0,
        "max_abs": float(abs_err[finite].max()) if bool(finite.any()) else 0.0,
        "max_rel": float(rel_err[finite].max()) if bool(finite.any()) else 0.0,
        "max_ulp": float(ulp.max()) if n else 0.0,
        "mean_ulp": float(ulp[mism].mean()) if n_mism else 0.0,
        "allclose_1e3": bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)),
        "assert_close": assert_close_ok,
    }


def ulp_histogram(a: torch.Tensor, b: torch.Tensor) -> dict[int, int]:
    """Counts of elements per ULP distance (0 included), for plots. inf is reported as -1."""
    d = ulp_distance(a, b)
    d = torch.where(torch.isinf(d), torch.full_like(d, -1), d)
    vals, counts = torch.unique(d, return_counts=True)  # float64 keys: fp64 distances can pass 2**63
    return {int(v): int(c) for v, c in zip(vals.tolist(), counts.tolist())}


_FP_WEIGHTS: dict = {}


def _weights(n: int, device) -> torch.Tensor:
    key = (n, str(device))
    w = _FP_WEIGHTS.get(key)
    if w is None:
        g = torch.Generator().manual_seed(0x5EED)
        # Odd 62-bit multipliers, one per position, two lanes: a collision needs both sums to agree.
        w = (torch.randint(0, 2**62, (2, n), generator=g, dtype=torch.int64) | 1).to(device)
        _FP_WEIGHTS.clear()  # keep one size cached: the lab fingerprints same-shaped stages in a row
        _FP_WEIGHTS[key] = w
    return w


def fingerprint(x: torch.Tensor) -> str:
    """A hash of the tensor's bytes computed where the tensor lives (GPU or CPU): 32 hex chars + dtype/shape.

    Two tensors get the same fingerprint iff (up to a 2**-64-ish collision chance) their bits are equal, so
    ranks can compare stages by exchanging 16 bytes instead of the tensor. int64 sums wrap modulo 2**64.
    """
    x = x.detach().contiguous()
    if x.dtype in _FORMATS:
        bits = x.view(_FORMATS[x.dtype][0]).reshape(-1).to(torch.int64)
    elif x.is_floating_point() or x.is_complex():  # fp8 and friends: hash the bytes, never the values
        bits = x.reshape(-1).view(torch.uint8).to(torch.int64)
    else:  # bool and integer values are their bits
        bits = x.reshape(-1).to(torch.int64)
    w = _weights(bits.numel(), bits.device)
    h = (bits.unsqueeze(0) * w).sum(dim=1)
    lanes = [int(v) & (2**64 - 1) for v in h.tolist()]
    return f"{lanes[0]:016x}{lanes[1]:016x}:{str(x.dtype).removeprefix('torch.')}:{'x'.join(map(str, x.shape))}"
