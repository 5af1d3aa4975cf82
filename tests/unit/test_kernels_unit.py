"""engine.kernels: the batch-variance check of a bare GEMM (notebook 04's kernel probe without a layer). Its detection
is held against an M-dependent GEMM the lab has on every CPU (the split-K EMULATION: splits chosen from M) and a
fixed-split one; the real GEMM's answer here is whatever this CPU does, counted by hand."""

from __future__ import annotations

import json

import pytest
import torch

from moe_lab.engine import kernels
from moe_lab.experiments import remedies as B


def test_counts_are_the_differing_elements_of_the_first_rows():
    got = kernels.rows_differ(256, 512, [64, 512], seed=3)
    g = torch.Generator().manual_seed(3)
    x = torch.randn(512, 256, generator=g).to(torch.bfloat16)
    w = (torch.randn(512, 256, generator=g) * 256 ** -0.5).to(torch.bfloat16)
    by_hand = int(((x[:64] @ w.t()) != (x @ w.t())[:64]).sum())
    assert got == {64: 0, 512: by_hand}  # M = m: the rows alone, equal by construction
    assert kernels.cpu_gemm_batch_variance(256, 512, [64, 512], seed=3) == (512 if by_hand else None)


def test_an_m_dependent_gemm_is_caught_at_its_first_m_and_a_fixed_one_is_not():
    emulated = lambda x, w: B.splitk_linear(x, w, reduce_dtype=torch.bfloat16)  # noqa: E731 - splits from M
    ms = [128, 256, 1024]
    splits = [B.splitk_splits(m, 1024, 1024) for m in ms]
    assert splits == [4, 2, 1]  # 128 → 4 splits, 256 → 2, 1024 → 1: every M past the first reduces otherwise
    d = kernels.rows_differ(1024, 1024, ms, matmul=emulated)
    assert d[128] == 0 and d[256] > 128 * 1024 // 10 and d[1024] > 128 * 1024 // 10
    assert kernels.cpu_gemm_batch_variance(1024, 1024, ms, matmul=emulated) == 256
    fixed = lambda x, w: B.splitk_linear(x, w, splits=4)  # noqa: E731 - fp32 partials at a fixed split: no M in it
    assert kernels.cpu_gemm_batch_variance(256, 512, [64, 512], matmul=fixed) is None


def test_the_command_line_prints_what_the_function_measures(capsys):
    assert kernels.main(["--shape", "256,512", "--shape", "512,256", "--ms", "128,512"]) == 0  # (--threads: 1
    out = json.loads(capsys.readouterr().out)  # would stay set in this process)
    assert out["ms"] == [128, 512] and out["threads"] == torch.get_num_threads() and out["dtype"] == "bf16"
    for k, n in ((256, 512), (512, 256)):
        row = out["shapes"][f"{k},{n}"]
        assert out["draws"] == 8
        assert row["differ"] == {str(M): c for M, c in kernels.rows_differ(k, n, [128, 512], draws=8).items()}
        assert row["first_variant_m"] == kernels.cpu_gemm_batch_variance(k, n, [128, 512], draws=8)


def test_draws_add_up_the_differing_elements_of_each_seed():
    emulated = lambda x, w: B.splitk_linear(x, w, reduce_dtype=torch.bfloat16)  # noqa: E731 - splits from M
    one = [kernels.rows_differ(1024, 1024, [128, 256], matmul=emulated, seed=s) for s in (5, 6, 7)]
    assert kernels.rows_differ(1024, 1024, [128, 256], matmul=emulated, seed=5, draws=3) == {
        M: sum(d[M] for d in one) for M in (128, 256)}
    assert one[0][256] != one[1][256]  # the draws are different data, not one draw counted three times


def test_bad_shapes_are_refused():
    with pytest.raises(ValueError, match=r"1 <= m <= min\(ms\)"):
        kernels.rows_differ(256, 512, [64, 128], m=100)
    with pytest.raises(ValueError, match="draws=0"):
        kernels.rows_differ(256, 512, [64, 128], draws=0)
    with pytest.raises(ValueError, match="need k, n, draws >= 1"):
        kernels.rows_differ(0, 512, [64])
