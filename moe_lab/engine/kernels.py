"""Is this process's GEMM batch invariant? The check of notebook 04's kernel probe on a bare matmul (no layer, no
process group): the first m rows of x[:M] @ w.T computed inside M rows vs alone, bitwise, for each M.

CPUs differ here: oneDNN's bf16 GEMM on CPUs with AMX (Xeon with `amx_bf16`) picks its blocking from M, so rows
change with the total M (the CPU analogue of cuBLAS split-K), while the AVX2 path (and oneDNN capped at
`ONEDNN_MAX_CPU_ISA=AVX512_CORE_BF16`) is batch invariant at the cpu profile's shapes. The ISA cap is read once per
process, when oneDNN first runs: measure in a process started with the environment in question
(`python -m moe_lab.engine.kernels`, which prints JSON). Where AMX's kernels differ from the AVX-512 ones only in rare
roundings (a Xeon seen here: one element in 16,384 of a K=512 GEMM from M=256 on, in half the random draws), one draw
of data need not show it: count over several draws (`draws`) before calling a GEMM batch invariant."""

from __future__ import annotations

import torch


def _matmul(x: torch.Tensor, w: torch.Tensor) -> torch.Tensor:
    return x @ w.t()  # as megatron's expert linears multiply (LinearWithGradAccumulation...: matmul(x, weight.t()))


def rows_differ(k: int, n: int, ms, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0, m: int | None = None,
                device: str = "cpu", matmul=_matmul, draws: int = 1) -> dict[int, int]:
    """{M: elements of the first m rows (default min(ms)) whose bits differ between x[:M] @ w.T and x[:m] @ w.T},
    summed over `draws` random draws of x and w (seeds seed, seed + 1, ...). x is [max(ms), k], w is [n, k] (a Linear's
    weight); `matmul(x, w)` is the GEMM under test (default x @ w.t())."""
    ms = sorted(set(int(v) for v in ms))
    m = min(ms) if m is None else int(m)
    if not ms or m < 1 or k < 1 or n < 1 or m > min(ms) or draws < 1:
        raise ValueError(f"need k, n, draws >= 1 and 1 <= m <= min(ms) (k={k}, n={n}, m={m}, ms={ms}, draws={draws})")
    out = dict.fromkeys(ms, 0)
    for d in range(draws):
        g = torch.Generator().manual_seed(seed + d)
        x = torch.randn(max(ms), k, generator=g).to(device=device, dtype=dtype)
        w = (torch.randn(n, k, generator=g) * k ** -0.5).to(device=device, dtype=dtype)
        with torch.no_grad():
            ref = matmul(x[:m], w)
            for M in ms:
                out[M] += int((ref != matmul(x[:M], w)[:m]).sum())
    return out


def cpu_gemm_batch_variance(k: int, n: int, ms, *, dtype: torch.dtype = torch.bfloat16, seed: int = 0,
                            m: int | None = None, matmul=_matmul, draws: int = 1) -> int | None:
    """The first M in `ms` at which the first m rows (default min(ms)) of x[:M] @ w.T differ bitwise from x[:m] @ w.T
    on this process's CPU GEMM, or None when they are equal at every M (batch invariant at this shape)."""
    d = rows_differ(k, n, ms, dtype=dtype, seed=seed, m=m, matmul=matmul, draws=draws)
    return next((M for M, n_diff in d.items() if n_diff), None)


def gemm_ms(k: int, n: int, m: int, *, dtype: torch.dtype = torch.bfloat16, repeats: int = 20,
            seed: int = 0) -> float:
    """Median milliseconds of one x[:m] @ w.T (x [m, k], w [n, k]) on this process's CPU GEMM, after 3 warm-ups.
    CPUs differ by more than their clocks here: without bf16 instructions (AVX2 only) torch 2.13's CPU bf16 GEMM
    takes a slow path (~50x its fp32 GEMM at the cpu profile's shapes on an AMD EPYC with AVX2), which sets how long
    the cpu profile runs there (tests/notebooks: the budget holds where bf16 is not that slow)."""
    import statistics
    import time

    g = torch.Generator().manual_seed(seed)
    x = torch.randn(m, k, generator=g).to(dtype)
    w = (torch.randn(n, k, generator=g) * k ** -0.5).to(dtype)
    ts = []
    with torch.no_grad():
        for i in range(3 + repeats):
            t0 = time.perf_counter()
            _matmul(x, w)
            if i >= 3:
                ts.append((time.perf_counter() - t0) * 1e3)
    return statistics.median(ts)


def main(argv=None) -> int:
    """`python -m moe_lab.engine.kernels --shape K,N [--shape K,N ...] --ms 128,256 [--threads 1] [--dtype bf16]
    [--draws 8]`: one JSON line {"K,N": {"first_variant_m": M or null, "differ": {M: n}}, "threads": t, "draws": d,
    "env": {...}}."""
    import argparse
    import json

    from .. import provenance

    p = argparse.ArgumentParser(prog="python -m moe_lab.engine.kernels")
    p.add_argument("--shape", action="append", required=True, help="K,N (repeatable)")
    p.add_argument("--ms", required=True, help="comma-separated M values; m = the smallest")
    p.add_argument("--threads", type=int, default=None, help="torch.set_num_threads (CPU engines use 1)")
    p.add_argument("--dtype", default="bf16", choices=("bf16", "fp16", "fp32"))
    p.add_argument("--seed", type=int, default=0)
    p.add_argument("--draws", type=int, default=8, help="random draws of x and w, their differing elements summed")
    p.add_argument("--speed", action="store_true",
                   help="also the median ms of one GEMM at M = the largest of --ms, in --dtype and in fp32")
    a = p.parse_args(argv)
    if a.threads:
        torch.set_num_threads(a.threads)
    dt = {"bf16": torch.bfloat16, "fp16": torch.float16, "fp32": torch.float32}[a.dtype]
    ms = [int(v) for v in a.ms.split(",")]
    out = {}
    for s in a.shape:
        k, n = (int(v) for v in s.split(","))
        d = rows_differ(k, n, ms, dtype=dt, seed=a.seed, draws=a.draws)
        out[f"{k},{n}"] = {"first_variant_m": next((M for M, c in d.items() if c), None),
                           "differ": {str(M): c for M, c in d.items()}}
        if a.speed:
            out[f"{k},{n}"]["gemm_ms"] = {a.dtype: gemm_ms(k, n, max(ms), dtype=dt, seed=a.seed),
                                          "fp32": gemm_ms(k, n, max(ms), dtype=torch.float32, seed=a.seed)}
    print(json.dumps({"shapes": out, "ms": ms, "dtype": a.dtype, "threads": torch.get_num_threads(),
                      "draws": a.draws, "env": provenance.numerics_env()}))
    return 0


__all__ = ["rows_differ", "cpu_gemm_batch_variance", "gemm_ms", "main"]

if __name__ == "__main__":
    raise SystemExit(main())
