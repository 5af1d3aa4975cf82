"""Remedies and lab toggles, applied to a built layer for one block (never by editing megatron-core), and the
EMULATIONS of GPU mechanisms that make a token's MoE output depend on the rest of the batch (notebook 04).

- EMULATIONS of GPU mechanisms, for machines whose kernels are batch invariant (CPU): `splitk` (an expert GEMM's
  K reduction split chosen from its row count M, as cuBLAS's heuristic does) and `atomics` (the combine summing a
  token's expert outputs in a random order, rounding every add, as `scatter_add_` on GPUs without deterministic mode);
- REMEDIES: `deterministic` (torch.use_deterministic_algorithms), `tiled_experts` (every expert GEMM on fixed T-row
  tiles), `ordered_combine` (fp32, expert order, no atomics), `no_splitk` (cuBLAS may not split K); `padding_mask`
  is megatron's own forward argument, applied by the caller (truncation); the lab toggle `probs_fp32_before_gather`
  is the seed reporter's cast (notebooks 02, 03).

Pure functions first (testable without a layer), then context managers that patch one built layer's instances or
megatron's module attribute `token_dispatcher.unpermute` for a block, never megatron's files; `toggles` combines them.
"""

from __future__ import annotations

import contextlib
import functools
import itertools
import math

import torch
import torch.nn.functional as F

REMEDIES = ("deterministic", "padding_mask", "tiled_experts", "ordered_combine", "no_splitk", "batch_invariant_mode")
"""deterministic: torch.use_deterministic_algorithms (megatron's unpermute: scatter_add_ → index_add_);
padding_mask: megatron's MoE `padding_mask` (tokens[cut:] marked as padding); tiled_experts: every expert GEMM on
fixed T-row tiles (last one zero-padded); ordered_combine: the combine sums each token's expert outputs in fp32 in
expert order (no atomics); no_splitk: cuBLAS may not split K (torch >= 2.10's
`allow_bf16_reduced_precision_reduction = (False, False)`), so no GEMM picks its reduction split from M;
batch_invariant_mode: megatron-core's own batch-invariant kernels (Triton, GPU; `compat.batch_invariant_mode`)."""
EMULATIONS = ("splitk", "splitk_bf16", "atomics")
"""splitk: expert GEMMs split K by a GPU-like heuristic on M, fp32 partials reduced in fp32 (cuBLAS's usual scheme);
splitk_bf16: the same, partials reduced in the output dtype (cuBLASLt output-type reduction: many more flipped bits);
atomics: the combine adds a token's expert outputs in a random order, rounding each add (GPU scatter_add_)."""

# split-K emulation: a GPU-like heuristic that splits K when the output tiles cannot fill the SMs (H100/H200: 132).
SMS, OUT_TILE, MAX_SPLITS, MIN_CHUNK = 132, 64, 8, 32


def parse(spec: str, allowed: tuple[str, ...], field: str) -> tuple[str, ...]:
    """'a+b' → ('a', 'b'); 'none' → (). Raises ValueError naming the field, the value and the allowed names."""
    if not isinstance(spec, str):
        raise ValueError(f"{field} ({spec!r}) must be a string like 'none' or {'+'.join(allowed[:2])!r}")
    parts = tuple(p for p in spec.split("+") if p and p != "none")
    bad = [p for p in parts if p not in allowed]
    if bad or len(set(parts)) != len(parts):
        raise ValueError(f"{field} ({spec!r}) must be 'none' or '+'-joined names from {', '.join(allowed)}")
    return parts


# ============================================================================================= pure functions


def splitk_splits(m: int, n: int, k: int) -> int:
    """EMULATED cuBLAS-like heuristic: split K when the ceil(M/64)*ceil(N/64) output tiles leave SMs idle, so the
    split (and the order of the K reduction) depends on M."""
    tiles = math.ceil(m / OUT_TILE) * math.ceil(n / OUT_TILE)
    return max(1, min(MAX_SPLITS, SMS // max(tiles, 1), k // MIN_CHUNK))


def splitk_linear(x: torch.Tensor, w: torch.Tensor, splits: int | None = None,
                  reduce_dtype: torch.dtype | None = None) -> torch.Tensor:
    """EMULATED split-K GEMM x @ w.T: K cut into `splits` chunks (default: from M), fp32 partial products (cuBLAS's
    compute type) summed in chunk order in `reduce_dtype` (default fp32, rounded once to the output dtype; the output
    dtype instead is cuBLASLt's output-type reduction and flips far more bits). splits=1 is the plain GEMM."""
    m, k = x.shape[0], x.shape[-1]
    # The emulated heuristic obeys torch's split-K switch as cuBLAS does (the no_splitk remedy): then it never splits.
    s = (splitk_splits(m, w.shape[0], k) if splitk_allowed() else 1) if splits is None else splits
    if not isinstance(s, int) or s < 1:
        raise ValueError(f"splits ({s!r}) must be a positive integer")
    if s == 1:
        return F.linear(x, w)
    rd = reduce_dtype or torch.float32
    bounds = [round(i * k / s) for i in range(s + 1)]
    out = None
    for lo, hi in zip(bounds, bounds[1:]):
        part = F.linear(x[..., lo:hi].float(), w[:, lo:hi].float()).to(rd)
        out = part if out is None else out + part
    return out.to(x.dtype)


def splitk_control_available() -> bool:
    """Whether this torch can forbid cuBLAS split-K (the (allow_reduced_precision, allow_splitk) pair, torch >= 2.10)."""
    try:
        torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction_split_k  # noqa: B018 - probing the API
    except AttributeError:
        return False
    return True


def splitk_allowed() -> bool:
    """torch's current bf16 split-K switch (True where this torch has none: cuBLAS may always split)."""
    return torch.backends.cuda.matmul.allow_bf16_reduced_precision_reduction_split_k \
        if splitk_control_available() else True


_REDUCTION_FLAGS = ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction")


@contextlib.contextmanager
def no_splitk():
    """Remedy: forbid cuBLAS split-K for the block (torch requires reduced-precision reductions off for that, and the
    switch acts on cuBLASLt, so on CUDA cuBLASLt becomes the preferred BLAS library for the block); the previous
    settings are restored. Every GEMM then reduces K in one pass whatever its M. On a CPU-only torch only the switch
    is set (the EMULATED split-K heuristic obeys it)."""
    if not splitk_control_available():
        raise ValueError(f"no_splitk needs torch >= 2.10 (allow_bf16_reduced_precision_reduction = (False, False)); "
                         f"this is torch {torch.__version__}")
    m = torch.backends.cuda.matmul
    prev = {n: (getattr(m, n), getattr(m, n + "_split_k")) for n in _REDUCTION_FLAGS}
    lt = torch.cuda.is_available()
    prev_blas = torch.backends.cuda.preferred_blas_library() if lt else None
    try:
        if lt:  # before the switch: torch refuses allow_splitk=False while plain cuBLAS is preferred
            torch.backends.cuda.preferred_blas_library("cublaslt")
        for n in _REDUCTION_FLAGS:
            setattr(m, n, (False, False))
        yield
    finally:
        for n, v in prev.items():
            setattr(m, n, v)
        if lt:
            torch.backends.cuda.preferred_blas_library(prev_blas)


def tiled_rows(fn, x: torch.Tensor, tile: int):
    """Call `fn` on fixed `tile`-row slices of x (the last one zero-padded) and stitch the rows back.

    Every call then sees M = tile whatever x.shape[0] is, so a kernel that picks its reduction from M runs the same
    way for every row (batch invariance). Full tiles are views (no copy); only the last tile is padded.
    `fn` returns a tensor or (tensor, extra); extra (megatron's bias) is passed through from the first call.
    """
    if not isinstance(tile, int) or tile < 1:
        raise ValueError(f"tile ({tile!r}) must be a positive integer")
    m = x.shape[0]
    if m == 0:
        return fn(x)
    outs, extra, is_tuple = [], None, False
    for start in range(0, m, tile):
        chunk = x[start:start + tile]
        rows = chunk.shape[0]
        if rows < tile:
            pad = chunk.new_zeros((tile - rows, *chunk.shape[1:]))
            chunk = torch.cat([chunk, pad], dim=0)
        res = fn(chunk)
        if isinstance(res, tuple):
            is_tuple, (res, e) = True, res
            extra = e if extra is None else extra
        outs.append(res[:rows])
    out = outs[0] if len(outs) == 1 else torch.cat(outs, dim=0)
    return (out, extra) if is_tuple else out


def auto_tile(seq_len: int, world: int, topk: int, num_experts: int, lo: int = 16, hi: int = 1024) -> int:
    """Tile size from the plain forward's mean rows per expert GEMM (seq*world*topk/experts), rounded up to a power
    of two: most experts then need one GEMM call, so the tiles cost about nothing when weights dominate the time."""
    mean = seq_len * world * topk / num_experts
    return int(min(hi, max(lo, 2 ** math.ceil(math.log2(max(mean, 1))))))


def ordered_sum(permuted: torch.Tensor, token_index: torch.Tensor, num_tokens: int,
                acc_dtype: torch.dtype | None = None) -> torch.Tensor:
    """Sum rows of `permuted` into `num_tokens` outputs by `token_index`, one add at a time in `acc_dtype` (default:
    fp32 or wider), each token's rows in their order in `permuted`: no atomics, and a token's order does not depend
    on the other tokens. With acc_dtype = the row dtype it is what bf16 atomics do, in the given order."""
    acc_dtype = acc_dtype or torch.promote_types(permuted.dtype, torch.float32)
    idx, perm = torch.sort(token_index, stable=True)
    rows = permuted.index_select(0, perm).to(acc_dtype)
    counts = torch.bincount(idx, minlength=num_tokens)
    starts = torch.cumsum(counts, 0) - counts
    pos = torch.arange(idx.numel(), device=idx.device) - starts.index_select(0, idx)
    kmax = int(counts.max()) if counts.numel() else 0
    dense = rows.new_zeros((num_tokens, max(kmax, 1), *permuted.shape[1:]))
    dense[idx, pos] = rows
    acc = dense[:, 0].clone()
    for j in range(1, kmax):
        acc += dense[:, j]
    return acc


# ============================================================================================= engine-side toggles


def _expert_linears(layer):
    experts = getattr(getattr(layer, "experts", None), "local_experts", None)
    if experts is None:
        raise ValueError(f"layer ({type(layer).__name__}) must have experts.local_experts (SequentialMLP, local spec)")
    return [lin for e in experts for lin in (e.linear_fc1, e.linear_fc2)]


@contextlib.contextmanager
def _patched_forwards(linears, make):
    """Give each linear an instance-level `forward` = make(linear, previous forward); restore on exit."""
    saved = [(lin, lin.__dict__.get("forward")) for lin in linears]
    try:
        for lin in linears:
            lin.forward = make(lin, lin.forward)
        yield
    finally:
        for lin, prev in saved:
            if prev is None:
                lin.__dict__.pop("forward", None)
            else:
                lin.forward = prev


def layer_dtype(layer) -> torch.dtype:
    return next(layer.parameters()).dtype


def emulate_splitk(layer, reduce_dtype: torch.dtype | None = None):
    """EMULATION: every expert linear becomes `splitk_linear` (K split chosen from M). Needs no bias, expert TP 1."""
    linears = _expert_linears(layer)
    for lin in linears:
        if getattr(lin, "bias", None) is not None:
            raise ValueError("splitk emulation needs add_bias_linear=False (the expert linears have a bias)")

    def make(lin, prev):
        def forward(x, *a, **k):
            if a or k:
                raise ValueError(f"splitk emulation: unexpected linear arguments {a} {k}")
            flat = x.reshape(-1, x.shape[-1])
            return splitk_linear(flat, lin.weight, reduce_dtype=reduce_dtype).reshape(*x.shape[:-1], -1), None
        return forward

    return _patched_forwards(linears, make)


def tiled_experts(layer, tile: int):
    """Remedy: every expert linear runs on fixed `tile`-row GEMMs (wraps whatever forward is there, emulated or not)."""
    def make(lin, prev):
        return lambda x, *a, **k: tiled_rows(lambda c: prev(c, *a, **k), x, tile)

    return _patched_forwards(_expert_linears(layer), make)


_ATOMIC_CALLS = itertools.count()


def emulate_atomics():
    """EMULATION of GPU `scatter_add_` atomics in megatron's unpermute: without deterministic mode each call sums a
    token's expert outputs in a fresh random order, rounding every add to bf16; with it, megatron's index_add_ path."""
    def make(orig):
        def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                      drop_and_pad=False):
            if torch.are_deterministic_algorithms_enabled() or probs is not None or fused or drop_and_pad:
                return orig(permuted_tokens, sorted_indices, restore_shape, probs=probs, routing_map=routing_map,
                            fused=fused, drop_and_pad=drop_and_pad)
            # CPU scatter_add_/index_add_ accumulate bf16 in fp32 (order-insensitive); GPU atomics round every add.
            g = torch.Generator(device="cpu").manual_seed(next(_ATOMIC_CALLS))
            perm = torch.randperm(sorted_indices.numel(), generator=g).to(sorted_indices.device)
            return ordered_sum(permuted_tokens.index_select(0, perm), sorted_indices.index_select(0, perm),
                               restore_shape[0], acc_dtype=permuted_tokens.dtype)
        return unpermute

    from ..engine import compat

    return compat.patched_unpermute(make)


def ordered_combine():
    """Remedy: megatron's unpermute replaced by `ordered_sum` (fp32, expert order, no atomics, no global flag)."""
    def make(orig):
        def unpermute(permuted_tokens, sorted_indices, restore_shape, probs=None, routing_map=None, fused=False,
                      drop_and_pad=False):
            if fused or drop_and_pad:
                raise ValueError("ordered_combine supports the unfused, dropless unpermute only")
            input_dtype = permuted_tokens.dtype
            if probs is not None:  # releases that weight in the combine (<= 0.12): weight first, as megatron does
                permuted_probs = probs.T.contiguous().masked_select(routing_map.T.contiguous())
                permuted_tokens = permuted_tokens * permuted_probs.unsqueeze(-1)
            out = ordered_sum(permuted_tokens, sorted_indices, restore_shape[0])
            return out.to(input_dtype)
        return unpermute

    from ..engine import compat

    return compat.patched_unpermute(make)


def deterministic():
    """Remedy: torch.use_deterministic_algorithms(True, warn_only=True) for the block, previous state restored."""
    from ..engine import toolkit

    return toolkit.deterministic(True)


@contextlib.contextmanager
def probs_fp32_before_gather(layer, on: bool = True):
    """Lab toggle, the seed reporter's fix: routing probs cast to fp32 before the dispatcher communicates them.

    Wraps the dispatcher's entry point (`compat.dispatcher_entry`) so the probs it receives are fp32; whatever
    megatron does downstream with `probs.dtype` follows from that.
    """
    if not on:
        yield
        return
    from ..engine import compat

    disp = layer.token_dispatcher
    name, i = compat.dispatcher_entry(disp)
    orig = getattr(disp, name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if "probs" in kwargs:
            kwargs["probs"] = _fp32(kwargs["probs"])
        else:
            args = list(args)
            args[i] = _fp32(args[i])
        return orig(*args, **kwargs)

    setattr(disp, name, wrapper)
    try:
        yield
    finally:
        if name in vars(disp):
            delattr(disp, name)


def _fp32(p: torch.Tensor) -> torch.Tensor:
    return p.float() if p.dtype in (torch.bfloat16, torch.float16) else p


@contextlib.contextmanager
def toggles(layer, *, remedy: str = "none", emulation: str = "none", tile: int = 128):
    """Apply an emulation (innermost, it stands for the kernel) and then remedies on a built layer, for one block."""
    rem, emu = parse(remedy, REMEDIES, "remedy"), parse(emulation, EMULATIONS, "emulation")
    if tile is not None and (not isinstance(tile, int) or tile < 1):
        raise ValueError(f"tile ({tile!r}) must be a positive integer")
    with contextlib.ExitStack() as stack:
        if "splitk" in emu and "splitk_bf16" in emu:
            raise ValueError(f"emulation ({emulation!r}) must name at most one of splitk, splitk_bf16")
        if "splitk" in emu or "splitk_bf16" in emu:
            stack.enter_context(emulate_splitk(layer, None if "splitk" in emu else layer_dtype(layer)))
        if "atomics" in emu:
            stack.enter_context(emulate_atomics())
        if "tiled_experts" in rem:
            stack.enter_context(tiled_experts(layer, tile))
        if "ordered_combine" in rem:
            stack.enter_context(ordered_combine())
        if "deterministic" in rem:
            stack.enter_context(deterministic())
        if "no_splitk" in rem:
            stack.enter_context(no_splitk())
        if "batch_invariant_mode" in rem:
            from ..engine import compat

            stack.enter_context(compat.batch_invariant_mode())
        yield
