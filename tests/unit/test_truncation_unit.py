"""Unit tests for the pure parts of moe_lab.questions.truncation.experiment and .remedies (no engines): the bf16 tolerance table, the M-dependent split-K
EMULATION, fixed-row tiling, the ordered combine, and input checks. Expected numbers are written by hand."""

from __future__ import annotations

import pytest
import torch
import torch.nn.functional as F

from moe_lab.experiments import remedies as B
from moe_lab.questions.truncation import experiment as T
from moe_lab.questions.truncation import verdict as V

BF16 = torch.bfloat16


def _data(m=512, n=512, k=256, seed=0):
    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(BF16)
    w = (torch.randn(n, k, generator=g) * 0.02).to(BF16)
    return x, w


# ------------------------------------------------------------------------------------------ tolerance table


def test_tolerance_table_by_hand():
    rows = {r["abs_x"]: r for r in T.tolerance_table()}
    # bf16 stores 7 significand bits: one ULP in [2**e, 2**(e+1)) is 2**(e-7).
    assert rows[1.0]["one_ulp"] == 2.0**-7 == 0.0078125
    assert rows[1.0]["tolerance"] == pytest.approx(0.002)  # 1e-3 + 1e-3 * 1
    assert not rows[1.0]["one_ulp_passes"] and rows[1.0]["ulps_allowed"] == 0
    assert rows[0.25]["one_ulp"] == 2.0**-9 and rows[0.25]["tolerance"] == pytest.approx(0.00125)
    assert not rows[0.25]["one_ulp_passes"]  # 0.00195 > 0.00125: the smallest power of two where 1 ULP fails
    assert rows[0.125]["one_ulp"] == 2.0**-10 and rows[0.125]["one_ulp_passes"]  # 0.000977 <= 0.001125
    assert rows[0.125]["ulps_allowed"] == 1
    assert rows[2.0**-8]["ulps_allowed"] == 32  # floor(0.00100390625 / 2**-15) = floor(32.9)
    assert [r["one_ulp_passes"] for r in T.tolerance_table()] == [True] * 6 + [False] * 6


def test_tolerance_table_dense_is_a_staircase():
    rows = T.tolerance_table(dense=True)
    assert len(rows) == 600 and rows[0]["abs_x"] == pytest.approx(2.0**-9, rel=1e-2)
    ulps = [r["one_ulp"] for r in rows]
    assert ulps == sorted(ulps) and len(set(ulps)) == 14  # 2**-9 … 16 spans 14 binades (16 itself is the last)


def test_one_ulp_fails_frac():
    x = torch.tensor([1.0, 0.1, -0.5, 0.01], dtype=BF16)
    assert T.one_ulp_fails_frac(x) == 0.5  # |x| >= 0.25 fail: 1.0 and -0.5
    assert T.one_ulp_fails_frac(torch.tensor([], dtype=BF16)) == 0.0


# ------------------------------------------------------------------------------------------ split-K emulation


def test_splitk_splits_by_hand():
    # N=512 → 8 output-tile columns of 64; SMs 132; capped at 8 and at K/32.
    assert B.splitk_splits(16, 512, 256) == 8  # 1 x 8 tiles → 132 // 8 = 16 → 8
    assert B.splitk_splits(192, 512, 256) == 5  # 3 x 8 = 24 → 5
    assert B.splitk_splits(256, 512, 256) == 4  # 4 x 8 = 32 → 4
    assert B.splitk_splits(1024, 512, 256) == 1  # 16 x 8 = 128 → 1
    assert B.splitk_splits(16, 512, 64) == 2  # K/32 caps it


def test_splitk_with_one_split_is_the_plain_gemm():
    x, w = _data()
    assert torch.equal(B.splitk_linear(x, w, splits=1), F.linear(x, w))


def test_splitk_at_a_fixed_split_is_row_invariant():
    """The M dependence comes only from the split choice: at a fixed split, rows do not depend on M (CPU)."""
    x, w = _data()
    for s in (2, 3, 8):
        assert torch.equal(B.splitk_linear(x[:512], w, splits=s)[:64], B.splitk_linear(x[:64], w, splits=s))


def _real_gemm_invariant(cpu_gemm, k, n, ms) -> bool:
    """This CPU's bf16 GEMM at (K, N) and these Ms, measured apart over several draws (a subprocess at this process's
    thread count): batch invariant on AVX2 / AVX-512 without AMX, not with oneDNN's AMX kernels (tests/README.md)."""
    return cpu_gemm.invariant([(k, n)], ms, threads=torch.get_num_threads())


@pytest.mark.parametrize("reduce_dtype", [BF16, None], ids=["bf16-reduce", "fp32-reduce"])
def test_splitk_emulation_is_m_dependent_on_a_plain_matmul(reduce_dtype, cpu_gemm):
    x, w = _data(m=1024, n=1024, k=1024)
    m = 128
    alone = B.splitk_linear(x[:m], w, reduce_dtype=reduce_dtype)  # M=128: 2 x 16 tiles → 4 splits
    inside = B.splitk_linear(x[:1024], w, reduce_dtype=reduce_dtype)[:m]  # M=1024 → 1 split
    assert B.splitk_splits(m, 1024, 1024) != B.splitk_splits(1024, 1024, 1024)
    diff = int((alone.view(torch.int16) != inside.view(torch.int16)).sum())
    assert diff > (m * 1024 // 10 if reduce_dtype is BF16 else 0), diff
    # the real CPU GEMM: batch invariant where this CPU's is, measured over several draws (the emulation's M
    # dependence is its own either way); where it is not, this one draw may or may not show it
    if _real_gemm_invariant(cpu_gemm, 1024, 1024, [m, 1024]):
        assert torch.equal(F.linear(x[:1024], w)[:m], F.linear(x[:m], w))


def test_no_splitk_sets_and_restores_torch_switches_and_the_emulation_obeys_it(cpu_gemm):
    if not B.splitk_control_available():
        pytest.skip(f"torch {torch.__version__} has no split-K switch")
    m = torch.backends.cuda.matmul
    before = (m.allow_bf16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction_split_k,
              m.allow_fp16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction_split_k)
    x, w = _data(m=1024, n=1024, k=1024)
    alone = lambda: B.splitk_linear(x[:128], w)  # noqa: E731 - the emulated heuristic picks 4 splits at M=128
    split = alone()
    with B.no_splitk():
        assert not m.allow_bf16_reduced_precision_reduction_split_k and not m.allow_bf16_reduced_precision_reduction
        assert not B.splitk_allowed()
        unsplit = alone()
        assert torch.equal(unsplit, F.linear(x[:128], w))  # one split: the plain GEMM
        assert torch.equal(B.splitk_linear(x, w), F.linear(x, w))  # at M=1024 too: the plain GEMM, unsplit
        # and M matters no more than it does to the plain GEMM (not at all where this CPU's is batch invariant)
        assert torch.equal(B.splitk_linear(x, w)[:128], unsplit) == _real_gemm_invariant(cpu_gemm, 1024, 1024,
                                                                                          [128, 1024])
    assert not torch.equal(split, unsplit)  # positive control: the split did change bits
    assert (m.allow_bf16_reduced_precision_reduction, m.allow_bf16_reduced_precision_reduction_split_k,
            m.allow_fp16_reduced_precision_reduction, m.allow_fp16_reduced_precision_reduction_split_k) == before
    with pytest.raises(RuntimeError), B.no_splitk():
        raise RuntimeError("restored on error too")
    assert m.allow_bf16_reduced_precision_reduction_split_k == before[1]


# ------------------------------------------------------------------------------------------ fixed-row tiles


def test_tiles_make_emulated_rows_m_invariant():
    x, w = _data(m=700)
    fn = lambda c: B.splitk_linear(c, w)  # noqa: E731
    m = 40
    ref = B.tiled_rows(fn, x[:m], 64)
    untiled_differs = False
    for big in (64, 100, 128, 300, 513, 700):
        assert torch.equal(B.tiled_rows(fn, x[:big], 64)[:m], ref), big
        untiled_differs |= not torch.equal(fn(x[:big])[:m], fn(x[:m]))
    assert untiled_differs  # positive control: without tiles the emulation does change these rows


def test_tiles_keep_shape_order_and_bias():
    x, w = _data(m=130)
    calls = []

    def fn(c):
        calls.append(c.shape[0])
        return F.linear(c, w), "bias"

    out, bias = B.tiled_rows(fn, x, 64)
    assert out.shape == (130, 512) and bias == "bias" and calls == [64, 64, 64]  # last tile padded to 64
    assert torch.equal(out, F.linear(x, w))
    assert B.tiled_rows(lambda c: c * 2, x[:0], 64).shape == (0, 256)
    with pytest.raises(ValueError, match=r"tile \(0\) must be a positive integer"):
        B.tiled_rows(fn, x, 0)


def test_auto_tile():
    assert B.auto_tile(128, 4, 4, 8) == 256  # cpu profile: 256 rows per expert on average
    assert B.auto_tile(1024, 2, 6, 64) == 256  # seed config on 2 GPUs: 192 → 256
    assert B.auto_tile(1, 1, 1, 64) == 16


# ------------------------------------------------------------------------------------------ combine


def test_ordered_sum_is_batch_invariant_and_order_matters_in_bf16():
    g = torch.Generator().manual_seed(1)
    rows = torch.randn(40, 16, generator=g).to(BF16)
    idx = torch.randint(0, 8, (40,), generator=g)
    full = B.ordered_sum(rows, idx, 8)
    assert full.dtype == torch.float32
    expected = torch.zeros(8, 16).index_add_(0, idx, rows.float())
    assert torch.allclose(full, expected, atol=1e-6)
    # Drop every row of tokens 4..7 (other tokens): tokens 0..3 keep their bits.
    keep = idx < 4
    part = B.ordered_sum(rows[keep], idx[keep], 8)
    assert torch.equal(part[:4], full[:4])
    # Positive control for the atomics emulation: a bf16 sum in another order flips bits.
    perm = torch.randperm(40, generator=g)
    a = B.ordered_sum(rows, idx, 8, acc_dtype=BF16)
    b = B.ordered_sum(rows[perm], idx[perm], 8, acc_dtype=BF16)
    assert not torch.equal(a, b)


# ------------------------------------------------------------------------------------------ input checks, plan


def test_parse_names_field_value_and_rule():
    assert B.parse("none", B.REMEDIES, "remedy") == ()
    assert B.parse("deterministic+tiled_experts", B.REMEDIES, "remedy") == ("deterministic", "tiled_experts")
    with pytest.raises(ValueError, match=r"remedy \('fast'\) must be 'none' or '\+'-joined names from"):
        B.parse("fast", B.REMEDIES, "remedy")
    with pytest.raises(ValueError, match=r"emulation \('atomics\+atomics'\)"):
        B.parse("atomics+atomics", B.EMULATIONS, "emulation")


def test_plan_puts_the_plain_case_first_and_sweeps_tiles_on_gpu():
    cpu = T.plan("cpu", auto=256)
    assert cpu[0] == {"emulation": "none", "remedy": "none", "tile": None}
    assert {c["emulation"] for c in cpu} == {"none", "splitk+atomics"}
    assert all(c["tile"] == 256 for c in cpu if "tiled_experts" in c["remedy"])
    gpu = T.plan("cuda", auto=256)
    # 7 untiled (none + 6 remedies), 3 tiled remedies x 2 tiles (auto = 256 is one of them)
    assert {c["emulation"] for c in gpu} == {"none"} and len(gpu) == 7 + 3 * 2
    assert sorted({c["tile"] for c in gpu if c["tile"]}) == [256, 512]
    assert {"no_splitk", "deterministic+no_splitk", "ordered_combine+no_splitk"} <= {c["remedy"] for c in gpu}
    mine = T.plan("cpu", emulations=["splitk_bf16"], remedies=["tiled_experts"], tiles=[32], auto=256)
    assert mine == [{"emulation": "splitk_bf16", "remedy": "none", "tile": None},
                    {"emulation": "splitk_bf16", "remedy": "tiled_experts", "tile": 32}]
    with pytest.raises(ValueError, match=r"tile \(-4\) must be a positive integer"):
        T.plan("cpu", remedies=["tiled_experts"], tiles=[-4], auto=256)


def test_label_names_emulated_cases():
    assert T.label({"emulated": True, "emulation": "splitk", "remedy": "tiled_experts", "tile": 64}) == \
        "EMULATED splitk / tiled_experts T=64"
