"""Unit tests for moe_lab.metrics against hand-computed IEEE cases (pure CPU, no engines).

Bit patterns used below (sign | exponent | significand):
  bf16 1.0 = 0x3F80, fp16 1.0 = 0x3C00, fp32 1.0 = 0x3F800000, fp64 1.0 = 0x3FF0000000000000.
Significand bits stored (without the implicit one): bf16 7, fp16 10, fp32 23, fp64 52,
so one ULP in [1, 2) is 2**-7, 2**-10, 2**-23, 2**-52.
"""

from __future__ import annotations

import math
import re

import pytest
import torch

from moe_lab import metrics

BF16, FP16, FP32, FP64 = torch.bfloat16, torch.float16, torch.float32, torch.float64
FLOATS = [BF16, FP16, FP32, FP64]

# Stored significand bits (the ULP in [1, 2) is 2**-STORED), hand-written, not read from metrics.
STORED = {BF16: 7, FP16: 10, FP32: 23, FP64: 52}
# Smallest positive subnormal, 2**(emin - STORED), hand-written.
SMALLEST_SUB = {BF16: 2.0**-133, FP16: 2.0**-24, FP32: 2.0**-149, FP64: 2.0**-1074}
# Bits of 1.0 and of +inf, hand-written.
ONE_BITS = {BF16: 0x3F80, FP16: 0x3C00, FP32: 0x3F800000, FP64: 0x3FF0000000000000}
INF_BITS = {BF16: 0x7F80, FP16: 0x7C00, FP32: 0x7F800000, FP64: 0x7FF0000000000000}
INT_VIEW = {BF16: torch.int16, FP16: torch.int16, FP32: torch.int32, FP64: torch.int64}

ids = {BF16: "bf16", FP16: "fp16", FP32: "fp32", FP64: "fp64"}
each_dtype = pytest.mark.parametrize("dtype", FLOATS, ids=[ids[d] for d in FLOATS])


def t(values, dtype) -> torch.Tensor:
    return torch.tensor(values, dtype=dtype)


def up(x: torch.Tensor) -> torch.Tensor:
    """Next representable value towards +inf."""
    return torch.nextafter(x, torch.full_like(x, math.inf))


def down(x: torch.Tensor) -> torch.Tensor:
    """Next representable value towards -inf."""
    return torch.nextafter(x, torch.full_like(x, -math.inf))


def ulp(a, b, dtype) -> list[float]:
    return metrics.ulp_distance(t(a, dtype), t(b, dtype)).tolist()


# --------------------------------------------------------------------------------------------------
# ordered_bits
# --------------------------------------------------------------------------------------------------


@each_dtype
def test_ordered_bits_hand_values(dtype):
    """1.0 keeps its raw bits, -1.0 becomes their negation, both zeros map to 0, inf keeps its bits."""
    x = t([1.0, -1.0, 0.0, -0.0, math.inf, -math.inf], dtype)
    one, inf = ONE_BITS[dtype], INF_BITS[dtype]
    assert metrics.ordered_bits(x).tolist() == [one, -one, 0, 0, inf, -inf]
    assert metrics.ordered_bits(x).dtype == torch.int64


@each_dtype
def test_ordered_bits_is_monotone_and_dense(dtype):
    """Walking nextafter from -inf to +inf through both zeros and subnormals steps the order by exactly 1."""
    fi = torch.finfo(dtype)
    anchors = [-math.inf, -fi.max, -2.0, -1.0, -fi.tiny, -SMALLEST_SUB[dtype], 0.0,
               SMALLEST_SUB[dtype], fi.tiny, 1.0, 2.0, fi.max]
    x = t(anchors, dtype)
    o, o_up = metrics.ordered_bits(x), metrics.ordered_bits(up(x))
    assert (o_up - o).tolist() == [1] * len(anchors)
    assert bool((o[1:] > o[:-1]).all())


def test_ordered_bits_rejects_non_float():
    """Integer tensors have no ULPs: the error names the dtype."""
    with pytest.raises(ValueError, match="int32"):
        metrics.ordered_bits(torch.zeros(3, dtype=torch.int32))


# --------------------------------------------------------------------------------------------------
# ulp_distance
# --------------------------------------------------------------------------------------------------


@each_dtype
@pytest.mark.parametrize("x", [1.0, -3.5, 1e-3, 0.0, 1000.0, -6.0e4])
def test_ulp_adjacent_values_are_one_apart(dtype, x):
    """nextafter in either direction is, by definition, exactly 1 ULP away (both argument orders)."""
    a = t([x, x], dtype)
    b = torch.stack([up(a[0]), down(a[1])])
    assert metrics.ulp_distance(a, b).tolist() == [1.0, 1.0]
    assert metrics.ulp_distance(b, a).tolist() == [1.0, 1.0]


@each_dtype
def test_ulp_one_plus_one_ulp_hand_computed(dtype):
    """1.0 vs 1.0 + 2**-stored is 1 ULP (bf16 2**-7, fp16 2**-10, fp32 2**-23, fp64 2**-52)."""
    s = STORED[dtype]
    assert ulp([1.0], [1.0 + 2.0**-s], dtype) == [1.0]
    # And half a ULP is not representable: it rounds back to 1.0 (ties-to-even), distance 0.
    assert ulp([1.0], [1.0 + 2.0**-(s + 1)], dtype) == [0.0]


@each_dtype
def test_ulp_whole_binade(dtype):
    """[1, 2) holds 2**stored values, so 1.0 vs 2.0 is 2**stored ULPs; 1.0 vs -1.0 is twice 1.0's bits."""
    assert ulp([1.0], [2.0], dtype) == [float(2**STORED[dtype])]
    assert ulp([1.0], [-1.0], dtype) == [float(2 * ONE_BITS[dtype])]


@each_dtype
def test_ulp_crossing_binades(dtype):
    """Crossing 1.0 and 2.0 counts representable values, not abs distance (the ULP halves below 1.0)."""
    s = STORED[dtype]
    two = t([2.0], dtype)
    assert metrics.ulp_distance(down(two), two).tolist() == [1.0]
    assert down(two).item() == 2.0 - 2.0**-s  # hand check of the value nextafter gave
    # 1 - 2**-(s+1) (one ULP below 1) vs 1 + 2**-s (one ULP above 1): 2 ULPs, although 3 half-ULPs apart.
    assert ulp([1.0 - 2.0**-(s + 1)], [1.0 + 2.0**-s], dtype) == [2.0]
    # Just below 2.0 vs just above 2.0: 2 ULPs across the binade boundary.
    assert ulp([2.0 - 2.0**-s], [2.0 + 2.0**(1 - s)], dtype) == [2.0]


def test_ulp_bf16_named_cases():
    """The brief's bf16 cases: 1 vs 1+2**-7 and nextafter(2, 0) vs 2 are 1 ULP; fp16 1 vs 1+2**-10 too."""
    assert ulp([1.0], [1.0 + 2.0**-7], BF16) == [1.0]
    assert ulp([1.0], [1.0 + 2.0**-10], FP16) == [1.0]
    two = t([2.0], BF16)
    assert metrics.ulp_distance(torch.nextafter(two, t([0.0], BF16)), two).tolist() == [1.0]


@each_dtype
def test_ulp_signed_zeros_are_equal(dtype):
    """+0 and -0 are the same value: 0 ULPs apart (though their bits differ)."""
    assert ulp([0.0, -0.0, 0.0], [-0.0, 0.0, 0.0], dtype) == [0.0, 0.0, 0.0]


@each_dtype
def test_ulp_through_zero_subnormals(dtype):
    """±smallest subnormal are 2 ULPs apart (through the single zero); each is 1 ULP from either zero."""
    s = SMALLEST_SUB[dtype]
    assert up(t([0.0], dtype)).item() == s  # hand value is really the smallest subnormal
    assert ulp([s, s, -s, -s], [-s, 0.0, -0.0, 0.0], dtype) == [2.0, 1.0, 1.0, 1.0]


@each_dtype
def test_ulp_infinity_is_one_past_max(dtype):
    """IEEE order puts ±inf one ULP past ±max finite."""
    fi = torch.finfo(dtype)
    assert ulp([math.inf, -math.inf], [fi.max, -fi.max], dtype) == [1.0, 1.0]


@each_dtype
def test_ulp_nan(dtype):
    """NaN vs NaN is 0 (same verdict both sides), NaN vs anything else (even inf) is inf, either order."""
    nan = math.nan
    assert ulp([nan, nan, 1.0, nan, nan], [nan, 1.0, nan, math.inf, 0.0], dtype) == [0.0] + [math.inf] * 4


@each_dtype
def test_ulp_is_float64_and_symmetric(dtype):
    """The result is float64 and d(a, b) == d(b, a) on a mixed-sign batch."""
    g = torch.Generator().manual_seed(0)
    a = (torch.randn(257, generator=g) * 10).to(dtype)
    b = (torch.randn(257, generator=g) * 10).to(dtype)
    d = metrics.ulp_distance(a, b)
    assert d.dtype == torch.float64
    assert torch.equal(d, metrics.ulp_distance(b, a))
    assert bool((d >= 0).all())


def test_ulp_fp64_opposite_sign_huge_does_not_overflow():
    """fp64 ±max are ~2**64 ULPs apart: the int64 sum would wrap; the result must be finite, positive, right."""
    fi = torch.finfo(FP64)
    max_bits = 0x7FEFFFFFFFFFFFFF  # fp64 max finite
    d = ulp([fi.max, -math.inf, 2.0], [-fi.max, math.inf, -2.0], FP64)
    assert all(math.isfinite(v) and v > 0 for v in d)
    assert d[0] == pytest.approx(2 * max_bits, rel=1e-15)
    assert d[1] == pytest.approx(2 * 0x7FF0000000000000, rel=1e-15)
    assert d[2] == float(2**63)  # 2 * 0x4000000000000000
    assert 2.0**63 < d[0] < 2.0**64


def test_ulp_rejects_mismatched_inputs():
    """Different dtypes or shapes cannot be compared element-wise: ValueError naming both sides."""
    with pytest.raises(ValueError, match=r"torch\.bfloat16.*torch\.float16"):
        metrics.ulp_distance(torch.zeros(2, dtype=BF16), torch.zeros(2, dtype=FP16))
    with pytest.raises(ValueError, match=r"\(2,\).*\(3,\)"):
        metrics.ulp_distance(torch.zeros(2, dtype=BF16), torch.zeros(3, dtype=BF16))


def test_ulp_non_contiguous_inputs():
    """Transposed (non-contiguous) views are compared element-wise like their contiguous copies."""
    a = torch.arange(12, dtype=FP32).reshape(3, 4)
    b = up(a)
    assert torch.equal(metrics.ulp_distance(a.T, b.T), torch.ones(4, 3, dtype=FP64))


# --------------------------------------------------------------------------------------------------
# bitwise_mismatch
# --------------------------------------------------------------------------------------------------


@each_dtype
def test_bitwise_mismatch_signed_zero_and_nan(dtype):
    """+0 vs -0 differ in bits (mismatch) although 0 ULPs apart; the same NaN bits are equal."""
    a = t([0.0, math.nan, 1.0, 1.0], dtype)
    b = t([-0.0, math.nan, 1.0, 2.0], dtype)
    assert metrics.bitwise_mismatch(a, b).tolist() == [True, False, False, True]


@each_dtype
def test_bitwise_mismatch_nan_payloads_differ(dtype):
    """Two NaNs with different payload bits are a bitwise mismatch (yet 0 ULPs apart)."""
    a = t([math.nan], dtype)
    b = (a.view(INT_VIEW[dtype]) ^ 1).view(dtype)  # flip the lowest significand bit: still a NaN
    assert bool(torch.isnan(b).all())
    assert metrics.bitwise_mismatch(a, b).tolist() == [True]
    assert metrics.ulp_distance(a, b).tolist() == [0.0]


# --------------------------------------------------------------------------------------------------
# compare
# --------------------------------------------------------------------------------------------------


def test_compare_hand_built_bf16_pair():
    """Every field on a 4-element bf16 pair: equal, 1 ULP at 2, 3 ULPs at 4, and +0 vs -0."""
    a = t([1.0, 2.0, 4.0, 0.0], BF16)
    b = t([1.0, 2.0 + 2.0**-6, 4.0 + 3 * 2.0**-5, -0.0], BF16)  # ULP in [2,4) is 2**-6, in [4,8) 2**-5
    r = metrics.compare(a, b)
    assert r["numel"] == 4
    assert r["n_mismatch"] == 3  # -0 counts: its bits differ
    assert r["mismatch_frac"] == 0.75
    assert r["bitwise_equal"] is False
    assert r["max_abs"] == 3 * 2.0**-5
    assert r["max_rel"] == pytest.approx((3 * 2.0**-5) / (4.0 + 3 * 2.0**-5), rel=1e-12)
    assert r["max_ulp"] == 3.0
    assert r["mean_ulp"] == pytest.approx(4 / 3)  # mean over mismatched elements: (1 + 3 + 0) / 3
    assert r["allclose_1e3"] is False
    assert r["assert_close"] is False  # 3 ULPs at 4 is rel 0.023 > bf16 rtol 1.6e-2


def test_compare_identical():
    """A tensor against its own copy: bitwise equal, all errors zero, both tolerance checks pass."""
    a = torch.randn(64, generator=torch.Generator().manual_seed(1)).to(BF16)
    r = metrics.compare(a, a.clone())
    assert r["bitwise_equal"] is True and r["n_mismatch"] == 0 and r["mismatch_frac"] == 0.0
    assert r["max_abs"] == r["max_rel"] == r["max_ulp"] == r["mean_ulp"] == 0.0
    assert r["allclose_1e3"] is True and r["assert_close"] is True


def test_compare_empty():
    """Zero elements: no division by zero, everything reads as equal."""
    r = metrics.compare(torch.zeros(0, dtype=BF16), torch.zeros(0, dtype=BF16))
    assert r["numel"] == 0 and r["mismatch_frac"] == 0.0 and r["bitwise_equal"] is True
    assert r["max_abs"] == 0.0 and r["max_ulp"] == 0.0


def test_compare_nan_and_inf():
    """A NaN against a number makes max_ulp inf, while max_abs/max_rel skip the non-finite element."""
    a = t([1.0, math.nan, math.inf], FP32)
    b = t([1.5, 2.0, math.inf], FP32)
    r = metrics.compare(a, b)
    assert r["max_ulp"] == math.inf
    assert r["max_abs"] == 0.5
    assert r["max_rel"] == pytest.approx(0.5 / 1.5)
    assert r["n_mismatch"] == 2


def test_compare_identical_nans():
    """Same NaN bits: bitwise equal and allclose (equal_nan=True), but assert_close's default equal_nan=False fails."""
    a = t([math.nan, 1.0], BF16)
    r = metrics.compare(a, a.clone())
    assert r["bitwise_equal"] is True and r["max_ulp"] == 0.0
    assert r["allclose_1e3"] is True
    assert r["assert_close"] is False


def _compare_every_element(a, b, atol=1e-3, rtol=1e-3):
    """The reference: every element measured (how `compare` worked before it measured only the differing ones)."""
    n = a.numel()
    mism = metrics.bitwise_mismatch(a, b)
    n_mism = int(mism.sum())
    ulp = metrics.ulp_distance(a, b)
    a64, b64 = a.to(torch.float64), b.to(torch.float64)
    abs_err = (a64 - b64).abs()
    finite = torch.isfinite(abs_err)
    denom = torch.maximum(a64.abs(), b64.abs())
    rel_err = torch.where(denom > 0, abs_err / denom, torch.zeros_like(abs_err))
    try:
        torch.testing.assert_close(a, b)
        ok = True
    except AssertionError:
        ok = False
    return {"numel": n, "n_mismatch": n_mism, "mismatch_frac": n_mism / n if n else 0.0, "bitwise_equal": n_mism == 0,
            "max_abs": float(abs_err[finite].max()) if bool(finite.any()) else 0.0,
            "max_rel": float(rel_err[finite].max()) if bool(finite.any()) else 0.0,
            "max_ulp": float(ulp.max()) if n else 0.0, "mean_ulp": float(ulp[mism].mean()) if n_mism else 0.0,
            "allclose_1e3": bool(torch.allclose(a, b, atol=atol, rtol=rtol, equal_nan=True)), "assert_close": ok}


@pytest.mark.parametrize("dtype", [BF16, torch.float16, FP32, torch.float64])
@pytest.mark.parametrize("frac", [0.0, 0.001, 0.3, 1.0])
def test_compare_equals_measuring_every_element(dtype, frac):
    """compare() measures only the differing elements; on random pairs with NaNs, infinities, signed zeros, tiny
    and large perturbations and a non-contiguous view it gives exactly what measuring every element gives."""
    g = torch.Generator().manual_seed(int(frac * 1000) + len(str(dtype)))
    for trial in range(6):
        a = (torch.randn(4000, generator=g) * 10 ** torch.randint(-3, 4, (4000,), generator=g)).to(dtype)
        b = a.clone()
        pick = torch.rand(4000, generator=g) < frac
        noise = torch.randn(4000, generator=g).to(dtype) * (1e-2 if trial % 2 else 1e-5)
        b[pick] = (a[pick].float() + noise[pick].float()).to(dtype)
        if trial >= 2:  # specials, placed where both agree and where they differ
            a[:8] = t([math.nan, math.inf, -math.inf, 0.0, -0.0, math.nan, 1.0, math.inf], dtype)
            b[:8] = t([math.nan, math.inf, 1.0, -0.0, -0.0, 2.0, math.nan, -math.inf], dtype)
        if trial == 3:  # differing elements 1 ULP apart (assert_close holds on them) and the same NaN in both
            b = a.clone()  # elsewhere: assert_close must still fail, for the NaN alone
            bits = b.view(metrics._formats()[dtype][0])
            bits[pick] += 1
            a[:8], b[:8] = t([math.nan] * 8, dtype), t([math.nan] * 8, dtype)
        x, y = (a.view(40, 100).t(), b.view(40, 100).t()) if trial == 4 else (a, b)
        assert metrics.compare(x, y) == _compare_every_element(x, y), (dtype, frac, trial)


def test_compare_shape_mismatch_names_both():
    """Shape mismatch raises ValueError naming both shapes."""
    with pytest.raises(ValueError, match=r"\(2, 3\).*\(3, 2\)"):
        metrics.compare(torch.zeros(2, 3, dtype=BF16), torch.zeros(3, 2, dtype=BF16))


def test_compare_dtype_mismatch_names_both():
    """Dtype mismatch raises ValueError naming both dtypes."""
    with pytest.raises(ValueError, match=r"bfloat16.*float32"):
        metrics.compare(torch.zeros(2, dtype=BF16), torch.zeros(2, dtype=FP32))


@pytest.mark.parametrize(
    "magnitude, allclose_expected",
    [(0.1, True), (1.0, False), (4.0, False), (100.0, False)],
)
def test_allclose_1e3_cannot_judge_bf16(magnitude, allclose_expected):
    """One bf16 ULP exceeds atol+rtol*|x| = 1e-3*(1+|x|) for any |x| >= 1 (ULP 2**-7 at 1, 2**-5 at 4)."""
    a = t([magnitude], BF16)
    b = up(a)
    r = metrics.compare(a, b)
    assert r["max_ulp"] == 1.0
    one_ulp = metrics.ulp_size(a).item()
    tol = 1e-3 + 1e-3 * abs(b.item())
    assert (one_ulp <= tol) is allclose_expected  # the numerical reason, hand-checked
    assert r["allclose_1e3"] is allclose_expected
    # ...while assert_close's bf16 defaults (rtol 1.6e-2) accept one ULP everywhere (2**-7 < 1.6e-2).
    assert r["assert_close"] is True


def test_allclose_1e3_at_four_hand_numbers():
    """At 4.0 one bf16 ULP is 2**-5 = 0.03125 > 1e-3 + 1e-3*4 = 0.005; at 0.1 it is 2**-11 < 1.1e-3."""
    assert metrics.ulp_size(t([4.0], BF16)).item() == 2.0**-5
    assert 2.0**-5 > 1e-3 + 1e-3 * 4
    assert metrics.ulp_size(t([0.1], BF16)).item() == 2.0**-11
    assert 2.0**-11 < 1e-3 + 1e-3 * 0.1


@pytest.mark.parametrize(
    "dtype, a, b, ok",
    [
        (BF16, 1.0, 1.0 + 2 * 2.0**-7, True),   # 0.0156 <= 1e-5 + 1.6e-2 * 1.0156
        (BF16, 1.0 + 3 * 2.0**-7, 1.0, False),  # 0.0234 >  1e-5 + 1.6e-2 * 1
        (FP16, 1.0, 1.0 + 2.0**-10, True),      # 0.00098 <= 1e-5 + 1e-3
        (FP16, 1.0, 1.0 + 2.0**-9 + 2.0**-10, False),  # 0.0029 > 1e-5 + 1e-3 * 1.003
        (FP32, 1.0, 1.0 + 2.0**-20, True),      # 9.5e-7 <= 1e-5 + 1.3e-6
        (FP32, 1.0, 1.0 + 2.0**-16, False),     # 1.5e-5 >  1e-5 + 1.3e-6
        (FP64, 1.0, 1.0 + 2.0**-25, True),      # 3.0e-8 <= 1e-7 + 1e-7
        (FP64, 1.0, 1.0 + 2.0**-21, False),     # 4.8e-7 >  1e-7 + 1e-7
    ],
    ids=["bf16-2ulp", "bf16-3ulp", "fp16-1ulp", "fp16-3ulp", "fp32-8ulp", "fp32-128ulp",
         "fp64-close", "fp64-far"],
)
def test_assert_close_uses_dtype_defaults(dtype, a, b, ok):
    """assert_close follows torch.testing.assert_close defaults (bf16 1.6e-2/1e-5, fp16 1e-3/1e-5, fp32 1.3e-6/1e-5, fp64 1e-7/1e-7)."""
    assert metrics.compare(t([a], dtype), t([b], dtype))["assert_close"] is ok


# --------------------------------------------------------------------------------------------------
# ulp_size
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize(
    "dtype, x, expected",
    [
        (BF16, 1.0, 2.0**-7),
        (BF16, 3.0, 2.0**-6),
        (BF16, -3.0, 2.0**-6),
        (BF16, 0.1, 2.0**-11),
        (BF16, 4096.0, 2.0**5),
        (FP16, 1.0, 2.0**-10),
        (FP16, 1000.0, 2.0**-1),
        (FP32, 1.0, 2.0**-23),
        (FP32, 3.0, 2.0**-22),
        (FP64, 1.0, 2.0**-52),
        (BF16, 0.0, 2.0**-133),  # at zero and among subnormals the spacing is the smallest subnormal
        (FP16, 2.0**-20, 2.0**-24),
        (FP32, 0.0, 2.0**-149),
    ],
)
def test_ulp_size_hand_values(dtype, x, expected):
    """ULP at |x| = 2**(floor(log2|x|) - stored bits), hand-computed per dtype."""
    assert metrics.ulp_size(t([x], dtype)).tolist() == [expected]


@each_dtype
def test_ulp_size_matches_nextafter(dtype):
    """For normal values, ulp_size(x) is exactly the gap to the next value away from zero."""
    g = torch.Generator().manual_seed(2)
    x = (torch.randn(500, generator=g) * torch.logspace(-3, 3, 500, dtype=torch.float32)).to(dtype)
    x = x[x.abs() >= torch.finfo(dtype).tiny]
    gap = (torch.nextafter(x.abs(), torch.full_like(x, math.inf)).double() - x.abs().double())
    assert torch.equal(metrics.ulp_size(x), gap)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32], ids=["bf16", "fp16", "fp32"])
@pytest.mark.parametrize("k", [1, 2, 4, 10])
def test_ulp_size_just_below_power_of_two(dtype, k):
    """The largest value below 2**k lives in the lower binade: its ULP is half that of 2**k."""
    x = down(t([2.0**k], dtype))
    assert metrics.ulp_size(x).item() == 2.0 ** (k - 1 - STORED[dtype])


@pytest.mark.parametrize("k", [4, 10])
def test_ulp_size_fp64_just_below_power_of_two(k):
    """Same as above for fp64: nextafter(2**k, 0) has ULP 2**(k-1-52)."""
    x = down(t([2.0**k], FP64))
    assert metrics.ulp_size(x).item() == 2.0 ** (k - 1 - 52)


# --------------------------------------------------------------------------------------------------
# ulp_histogram
# --------------------------------------------------------------------------------------------------


def test_ulp_histogram_counts():
    """Counts per distance, 0 included, NaN-vs-number (inf) reported under -1; counts add up to numel."""
    a = t([1.0, 1.0, 1.0, 2.0, math.nan, 0.0, 1.0], BF16)
    b = t([1.0, 1.0 + 2.0**-7, 1.0 + 2 * 2.0**-7, 2.0, 1.0, -0.0, 1.0 + 2.0**-7], BF16)
    h = metrics.ulp_histogram(a, b)
    assert h == {0: 3, 1: 2, 2: 1, -1: 1}
    assert sum(h.values()) == a.numel()
    assert all(type(k) is int and type(v) is int for k, v in h.items())


def test_ulp_histogram_2d():
    """Works on multi-dimensional tensors (counts over all elements)."""
    a = torch.ones(3, 4, dtype=FP16)
    b = a.clone()
    b[0, 0] = 1.0 + 2.0**-10
    b[2, 3] = 1.0 + 5 * 2.0**-10
    assert metrics.ulp_histogram(a, b) == {0: 10, 1: 1, 5: 1}


def test_ulp_histogram_fp64_opposite_signs():
    """fp64 2.0 vs -2.0 is 2 * 0x4000000000000000 = 2**63 ULPs: the key must be 2**63, not negative."""
    h = metrics.ulp_histogram(t([2.0], FP64), t([-2.0], FP64))
    assert h == {2**63: 1}


# --------------------------------------------------------------------------------------------------
# fingerprint
# --------------------------------------------------------------------------------------------------

FP_RE = re.compile(r"^[0-9a-f]{32}:[a-z0-9_]+:[0-9x]*$")


def _big_bf16() -> torch.Tensor:
    return torch.randn(100_000, generator=torch.Generator().manual_seed(3)).to(BF16)


def test_fingerprint_format():
    """32 hex chars, then dtype and shape ('2x3')."""
    fp = metrics.fingerprint(torch.zeros(2, 3, dtype=BF16))
    assert FP_RE.match(fp), fp
    assert fp.endswith(":bfloat16:2x3")


def test_fingerprint_equal_tensors_equal_strings():
    """Equal bits → equal fingerprints, also across copies and with other sizes fingerprinted in between."""
    x = _big_bf16()
    fp = metrics.fingerprint(x)
    assert metrics.fingerprint(x.clone()) == fp
    metrics.fingerprint(torch.zeros(7, dtype=BF16))
    metrics.fingerprint(torch.zeros(3 * metrics.FP_BLOCK + 1, dtype=FP64))
    assert metrics.fingerprint(x.clone()) == fp


@pytest.mark.parametrize("bit", [0, 6, 7, 14, 15], ids=lambda b: f"bit{b}")
@pytest.mark.parametrize("pos", [0, 54_321, 99_999], ids=lambda p: f"pos{p}")
def test_fingerprint_single_bit_flip(bit, pos):
    """Flipping any single bit (mantissa, exponent or sign) anywhere in 1e5 bf16 values changes the fingerprint."""
    x = _big_bf16()
    y = x.clone()
    iv = y.view(torch.int16)
    iv[pos] ^= torch.tensor(1 << bit, dtype=torch.int32).to(torch.int16)  # 1 << 15 wraps to the int16 sign bit
    assert metrics.bitwise_mismatch(x, y).sum().item() == 1
    assert metrics.fingerprint(y) != metrics.fingerprint(x)


def test_fingerprint_position_sensitive():
    """Swapping two elements (same multiset of bits) changes the fingerprint."""
    assert metrics.fingerprint(t([1.0, 2.0, 3.0], BF16)) != metrics.fingerprint(t([2.0, 1.0, 3.0], BF16))


def test_fingerprint_same_bits_different_shape():
    """Same bits reshaped → different fingerprint (shape is part of it)."""
    x = _big_bf16()
    fa, fb = metrics.fingerprint(x), metrics.fingerprint(x.reshape(100, 1000))
    assert fa != fb
    assert fa.split(":")[0] == fb.split(":")[0]  # the hash part itself only sees bits


def test_fingerprint_same_bits_different_dtype():
    """bf16 and fp16 tensors with identical bit patterns get different fingerprints."""
    x = t([1.0, -2.5, 0.0], BF16)
    y = x.view(torch.int16).view(FP16)
    assert torch.equal(x.view(torch.int16), y.view(torch.int16))
    assert metrics.fingerprint(x) != metrics.fingerprint(y)


@each_dtype
def test_fingerprint_signed_zero(dtype):
    """+0 and -0 are equal values but different bits → different fingerprints."""
    assert metrics.fingerprint(t([0.0, 1.0], dtype)) != metrics.fingerprint(t([-0.0, 1.0], dtype))


def test_fingerprint_non_contiguous():
    """A transposed view fingerprints like its contiguous copy."""
    x = torch.randn(4, 5, generator=torch.Generator().manual_seed(4)).to(BF16).T
    assert not x.is_contiguous()
    assert metrics.fingerprint(x) == metrics.fingerprint(x.contiguous())


def test_fingerprint_bool():
    """bool tensors: deterministic, one flipped element changes it, dtype is named."""
    m = torch.zeros(1000, dtype=torch.bool)
    m[::3] = True
    fp = metrics.fingerprint(m)
    assert fp == metrics.fingerprint(m.clone()) and fp.endswith(":bool:1000")
    m2 = m.clone()
    m2[500] = ~m2[500]
    assert metrics.fingerprint(m2) != fp


def test_fingerprint_int64():
    """int64 tensors (e.g. routing indices): huge values and a one-unit change are told apart."""
    x = torch.tensor([0, -1, 2**62, -(2**63), 2**63 - 1, 7], dtype=torch.int64)
    fp = metrics.fingerprint(x)
    assert FP_RE.match(fp) and fp.endswith(":int64:6")
    y = x.clone()
    y[5] += 1
    assert metrics.fingerprint(y) != fp
    y = x.clone()
    y[3] = 2**63 - 1  # flip every bit of one element
    assert metrics.fingerprint(y) != fp


def test_fingerprint_empty_and_scalar():
    """0-element and 0-dim tensors fingerprint without error and differ by shape."""
    e = metrics.fingerprint(torch.zeros(0, dtype=BF16))
    s = metrics.fingerprint(torch.tensor(0.0, dtype=BF16))
    assert FP_RE.match(e) and FP_RE.match(s) and e != s


def test_fingerprint_other_float_dtype_uses_bits():
    """The docstring promises equal fingerprints iff bits are equal, for any dtype."""
    a = torch.tensor([0.25, 0.5]).to(torch.float8_e4m3fn)
    b = torch.tensor([0.5, 0.25]).to(torch.float8_e4m3fn)
    assert not torch.equal(a.view(torch.uint8), b.view(torch.uint8))
    assert metrics.fingerprint(a) != metrics.fingerprint(b)


# ---- the hash itself, against a pure-Python reference (integers modulo 2**64) ----------------------------------

M64 = 2**64 - 1


def py_splitmix64(seed: int, k: int) -> int:
    """splitmix64's k-th output from `seed`, as published (Steele, Lea, Flood 2014; Vigna's splitmix64.c)."""
    z = (seed + k * 0x9E3779B97F4A7C15) & M64
    z = ((z ^ (z >> 30)) * 0xBF58476D1CE4E5B9) & M64
    z = ((z ^ (z >> 27)) * 0x94D049BB133111EB) & M64
    return z ^ (z >> 31)


def py_words(x: torch.Tensor) -> list[int]:
    """The word stream by hand: each element's bits as a signed integer (its own width; bytes for fp8, 0/1 for bool),
    64-bit elements as (low 32 bits unsigned, high 32 bits signed)."""
    if x.is_complex():
        x = torch.view_as_real(x)
    view = {BF16: torch.int16, FP16: torch.int16, FP32: torch.int32, FP64: torch.int64,
            torch.float8_e4m3fn: torch.uint8, torch.float8_e5m2: torch.uint8}.get(x.dtype)
    vals = [int(v) for v in (x.contiguous().view(view) if view else x.contiguous()).reshape(-1).tolist()]
    if x.element_size() == 8:
        return [w for v in vals for w in (v & 0xFFFFFFFF, v >> 32)]
    return vals


def py_fingerprint(x: torch.Tensor, block: int) -> str:
    """h_lane = sum_p word[p] * (W[p mod block] * M[p div block]) mod 2**64, W/M odd splitmix64 outputs."""
    lanes = []
    for seed in metrics._FP_SEEDS:
        h = 0
        for p, w in enumerate(py_words(x)):
            wcol = py_splitmix64(seed, p % block + 1) | 1
            wrow = py_splitmix64(seed, metrics._FP_ROW_BASE + p // block + 1) | 1
            h = (h + w * wcol * wrow) & M64
        lanes.append(h)
    return f"{lanes[0]:016x}{lanes[1]:016x}:{str(x.dtype).removeprefix('torch.')}:{'x'.join(map(str, x.shape))}"


@pytest.fixture
def small_block(monkeypatch):
    """Blocks of 8 words and 3 kept row multipliers: many blocks, chunks and on-the-fly multipliers on small inputs."""
    monkeypatch.setattr(metrics, "FP_BLOCK", 8)
    monkeypatch.setattr(metrics, "_FP_TABLE_ROWS", 3)
    return 8


def test_splitmix64_known_answer():
    """The reference is splitmix64 itself: seeded with 0, its first outputs are the published 0xE220A8397B1DCDAF..."""
    assert [py_splitmix64(0, k) for k in (1, 2, 3)] == [0xE220A8397B1DCDAF, 0x6E789E6AA1B965F4, 0x06C45D188009454F]


def test_splitmix64_matches_python_reference():
    """torch's int64 ops (wrapping multiply, emulated logical shift) give the same bits as Python's mod 2**64."""
    ks = [0, 1, 2, 3, 12345, 2**31 - 1, 2**32 + 7, 2**40 + 3, metrics._FP_ROW_BASE + 1, 2**63 - 1]
    seeds = (*metrics._FP_SEEDS, 0, M64, 2**63)
    got = metrics._splitmix64(torch.tensor(ks, dtype=torch.int64), seeds=seeds)
    for lane, seed in enumerate(seeds):
        assert [v & M64 for v in got[lane].tolist()] == [py_splitmix64(seed, k) for k in ks], hex(seed)


@pytest.mark.parametrize("dtype", [BF16, FP16, FP32, FP64, torch.float8_e4m3fn, torch.complex64, torch.bool,
                                   torch.int8, torch.int32, torch.int64],
                         ids=lambda d: str(d).removeprefix("torch."))
@pytest.mark.parametrize("n", [1, 5, 8, 21, 61])
def test_fingerprint_matches_python_reference(small_block, dtype, n):
    """The whole fingerprint against the reference: every dtype branch, one to eight blocks, multipliers past the
    kept table, 64-bit elements split in two words, any chunk size."""
    g = torch.Generator().manual_seed(n)
    x = torch.randn(n, generator=g) * 3e4
    x = x > 0 if dtype == torch.bool else x.to(dtype) if dtype.is_floating_point or dtype.is_complex else \
        (x.to(torch.int64) * 2**40 if dtype == torch.int64 else x.clamp(-100, 100).to(dtype))
    ref = py_fingerprint(x, small_block)
    assert metrics.fingerprint(x) == ref
    for chunk in (1, 8, 24, 1000):
        assert metrics.fingerprint(x, chunk=chunk) == ref


def test_fingerprint_matches_python_reference_default_block():
    """With the real block size: a tensor of two blocks and a bit (the second row multiplier matters)."""
    x = torch.randn(metrics.FP_BLOCK + 3, generator=torch.Generator().manual_seed(5)).to(BF16)
    assert metrics.fingerprint(x) == py_fingerprint(x, metrics.FP_BLOCK)


def test_fingerprint_zero_tensor_hash_is_zero():
    """All-zero bits contribute nothing (the shape in the string tells zero tensors apart)."""
    assert metrics.fingerprint(torch.zeros(3, 5, dtype=BF16)) == "0" * 32 + ":bfloat16:3x5"


# ---- layouts and chunking ---------------------------------------------------------------------------------------


def test_fingerprint_chunk_size_does_not_matter():
    """Whole, or in chunks of one block or of two blocks and a bit: the same string (default block)."""
    b = metrics.FP_BLOCK
    for dtype in (BF16, FP64):
        x = torch.randn(3 * b + 5, generator=torch.Generator().manual_seed(6)).to(dtype)
        fps = {metrics.fingerprint(x, chunk=c) for c in (b, 2 * b + 1, 10**9, None)}
        assert len(fps) == 1, (dtype, fps)


@pytest.mark.parametrize("chunk", [1, 8, 40, None])
def test_fingerprint_layouts_many_chunks(small_block, chunk):
    """Non-contiguous views (transposed, strided, expanded, sliced) fingerprint like their contiguous copies, chunk
    after chunk (read with torch.take, never copied whole)."""
    g = torch.Generator().manual_seed(8)
    base = torch.randn(12, 10, generator=g)
    views = [base.to(BF16).T, base.to(FP64).T, base.to(FP32)[:, ::3], base.to(BF16)[2:9, 1:7],
             base[0].to(BF16).expand(5, 10), base.to(torch.complex64).T, (base > 0).T,
             base.to(torch.float8_e4m3fn).T, (base * 1e9).to(torch.int64).T]
    for v in views:
        assert not v.is_contiguous()
        assert metrics.fingerprint(v, chunk=chunk) == metrics.fingerprint(v.contiguous()) == \
            py_fingerprint(v, small_block), v.dtype


def _flip(x: torch.Tensor, pos: int, bit: int) -> torch.Tensor:
    iv = INT_VIEW[x.dtype]
    y = x.clone()
    flat = y.view(iv).view(-1)
    flat[pos] ^= torch.tensor(1 << bit, dtype=torch.int64).to(iv) if bit < 63 else torch.tensor(-(2**63))
    assert metrics.bitwise_mismatch(x, y).sum().item() == 1
    return y


def test_fingerprint_bit_flips_at_chunk_boundaries():
    """One flipped bit at the first element, either side of a CPU chunk boundary and a block boundary, and the last
    element changes the fingerprint (bf16; fp64 in its low and high word)."""
    b, c = metrics.FP_BLOCK, metrics.FP_CHUNK_CPU
    x = torch.randn(c + 5, generator=torch.Generator().manual_seed(9)).to(BF16)
    fp = metrics.fingerprint(x)
    for pos in (0, b - 1, b, c - 1, c, c + 4):
        for bit in (0, 15):
            assert metrics.fingerprint(_flip(x, pos, bit)) != fp, (pos, bit)
    x = torch.randn(b + 3, generator=torch.Generator().manual_seed(10)).to(FP64)  # 2b + 6 words
    fp = metrics.fingerprint(x, chunk=b)
    for pos in (0, b // 2 - 1, b // 2, b + 2):
        for bit in (0, 31, 32, 63):
            assert metrics.fingerprint(_flip(x, pos, bit), chunk=b) != fp, (pos, bit)


@pytest.mark.parametrize("bit", [0, 7, 15])
def test_fingerprint_bit_flips_many_chunks(small_block, bit):
    """Blocks of 8, chunks of 8: every position of 40 elements, one flipped bit each, gives 40 new fingerprints."""
    x = torch.randn(40, generator=torch.Generator().manual_seed(11)).to(BF16)
    fps = {metrics.fingerprint(_flip(x, pos, bit), chunk=8) for pos in range(40)}
    assert len(fps) == 40 and metrics.fingerprint(x, chunk=8) not in fps


def test_fingerprint_swaps_change_it():
    """Swapping two different elements: neighbours, across a chunk, same column of two blocks (only the row
    multiplier tells them apart), first and last."""
    b, c = metrics.FP_BLOCK, metrics.FP_CHUNK_CPU
    x = torch.randn(c + 7, generator=torch.Generator().manual_seed(12)).to(BF16)
    fp = metrics.fingerprint(x)
    for i, j in ((0, 1), (c - 1, c), (5, b + 5), (3, 3 * b + 3), (0, c + 6)):
        assert x[i] != x[j]
        y = x.clone()
        y[i], y[j] = x[j], x[i]
        assert metrics.fingerprint(y) != fp, (i, j)


# ---- bits, not values ----------------------------------------------------------------------------------------


NAN_BITS = {BF16: (0x7FC0, 0x7FC1, -0x40), FP16: (0x7E00, 0x7E01, -0x200),
            FP32: (0x7FC00000, 0x7FC00001, -0x400000), FP64: (0x7FF8000000000000, 0x7FF8000000000001, -(2**51))}


@each_dtype
def test_fingerprint_nan_payloads_differ(dtype):
    """Quiet NaNs with different payloads or signs are all NaN, but their bits differ, and so do the fingerprints."""
    fps = set()
    for nb in NAN_BITS[dtype]:
        x = torch.tensor([1.0, 0.0], dtype=dtype)
        x.view(INT_VIEW[dtype])[1] = nb
        assert torch.isnan(x[1])
        fps.add(metrics.fingerprint(x))
    assert len(fps) == 3


def test_fingerprint_fp64_sign_flips_are_not_lost():
    """64-bit elements hash as two 32-bit words: x and -x (every sign bit flipped: a 2**63 step each, which a plain
    64-bit multiply-add would cancel in pairs) differ, and so do two sign flips or two 2**63 steps of int64."""
    x = torch.randn(1000, generator=torch.Generator().manual_seed(13), dtype=FP64)
    assert metrics.fingerprint(x) != metrics.fingerprint(-x)
    y = x.clone()
    y[[3, 700]] *= -1
    assert metrics.fingerprint(y) != metrics.fingerprint(x)
    i = torch.arange(10, dtype=torch.int64)
    j = i.clone()
    j[[2, 5]] ^= torch.tensor(-(2**63))
    assert metrics.fingerprint(i) != metrics.fingerprint(j)


def test_fingerprint_keeps_no_size_dependent_state():
    """Only one fixed-size weight table per device is kept, whatever sizes are fingerprinted."""
    for n in (1, 1000, 3 * metrics.FP_BLOCK + 1):
        metrics.fingerprint(torch.zeros(n, dtype=BF16))
    dims, table = metrics._FP_TABLES["cpu"]
    assert dims == (metrics.FP_BLOCK, metrics._FP_TABLE_ROWS)
    assert tuple(table.shape) == (2, metrics.FP_BLOCK + metrics._FP_TABLE_ROWS)
    assert not hasattr(metrics, "_FP_WEIGHTS")


@pytest.mark.parametrize("chunk", [0, -1, 2.0, True])
def test_fingerprint_bad_chunk(chunk):
    with pytest.raises(ValueError, match="chunk"):
        metrics.fingerprint(torch.zeros(3, dtype=BF16), chunk=chunk)


@pytest.mark.parametrize("t", [torch.randn(257).to(torch.bfloat16), torch.tensor([1.0, float("nan"), float("inf"), -0.0]),
                               torch.randn(7, 3, dtype=torch.float64), torch.zeros(0, dtype=torch.float16)])
def test_identical_is_compare_of_a_tensor_with_itself(t):
    """The fast path used once fingerprints match must give exactly what the full comparison would."""
    assert metrics.identical(t) == metrics.compare(t, t)
