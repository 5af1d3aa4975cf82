"""Inside engines: the shims megatron-core needs where there is no CUDA, or no NCCL — one versioned, tested module
(`tests/unit/test_shims.py`, and every CPU cluster test). megatron-core assumes CUDA; on CPU engines a MoELayer
forward needs small, contained shims (../shared/notes/megatron-core-facts.md), applied only in engine processes:
- `torch.cuda.current_device()` → the CPU device (router, mappings and experts allocate on it);
- `torch.cuda.Stream/Event/current_stream/stream/synchronize` → no-ops (the alltoall dispatcher's DtoH side stream);
- split sizes that stay CPU tensors/arrays → lists for `all_to_all_single` (gloo rejects tensors; also on GPU
  engines that share a GPU over gloo: `apply_gloo_shims`), and uneven `all_gather`s padded and trimmed (gloo wants
  equal sizes; megatron's alltoall dispatcher with TP > 1 and sequence parallelism gathers uneven ones), and large
  `all_gather_into_tensor`s sent as one `all_to_all_single` (`_gather_as_all_to_all`: the same bytes in the same
  places, faster through gloo), and large `reduce_scatter_tensor`s as one all-to-all and a local sum in gloo's own
  order (`_reduce_scatter_as_all_to_all`: used for a shape only where it gave gloo's bits on that shape's first call);
  that all-to-all hands its calls to another transport where one is set (`set_all_to_all_transport`: the ranks'
  shared buffers, engine.ipc_collectives);
- 0.13–0.16: `moe_utils.te_general_gemm` is never defined without TransformerEngine → None (also on GPUs
  without TE: `fix_missing_te`, applied by dist.setup on every device).
`engine/dist.setup` applies them; `applied()` says which a process has.
"""

from __future__ import annotations

import contextlib
import functools
import logging

import torch

logger = logging.getLogger(__name__)


class _NoStream:
    """Stands in for torch.cuda.Stream/Event on CPU: work is already synchronous."""

    def __init__(self, *a, **k):
        pass

    def wait_stream(self, *a):
        pass

    def record_event(self, *a):
        return self

    def synchronize(self):
        pass

    def wait_event(self, *a):
        pass

    def query(self):
        return True

    def __eq__(self, other):
        return isinstance(other, _NoStream)

    __hash__ = object.__hash__


def _as_list(sizes):
    if sizes is None or isinstance(sizes, list):
        return sizes
    if isinstance(sizes, torch.Tensor):
        return [int(s) for s in sizes.tolist()]
    return [int(s) for s in sizes]  # numpy arrays, tuples


_APPLIED: dict[str, object] = {}


def apply_cpu_shims() -> list[str]:
    """Patch torch.cuda and megatron-core for a CPU-only engine. Idempotent; returns what it patched."""
    if _APPLIED:
        return list(_APPLIED)
    cpu = torch.device("cpu")
    torch.cuda.current_device = lambda: cpu
    torch.cuda.Stream = _NoStream
    torch.cuda.Event = _NoStream
    torch.cuda.current_stream = lambda *a, **k: _NoStream()
    torch.cuda.stream = lambda *a, **k: contextlib.nullcontext()
    torch.cuda.synchronize = lambda *a, **k: None
    torch.Tensor.record_stream = lambda self, *a, **k: None
    _APPLIED.update(current_device=1, streams=1, synchronize=1, record_stream=1)

    apply_gloo_shims()
    fix_missing_te()
    logger.debug("CPU shims applied: %s", list(_APPLIED))
    return list(_APPLIED)


_ALL_TO_ALL_TRANSPORT: dict = {}


def set_all_to_all_transport(transport) -> None:
    """Another way for the gloo shims' all-to-all to move its bytes (`engine.ipc_collectives.all_to_all`: buffers the
    ranks share), or None for gloo's own. Called as transport(gloo_all_to_all, output, input, output_splits,
    input_splits, group) for synchronous calls; it returns False where gloo is to do the call."""
    if transport is None:
        _ALL_TO_ALL_TRANSPORT.clear()
    else:
        _ALL_TO_ALL_TRANSPORT["all_to_all"] = transport


def apply_gloo_shims() -> None:
    """gloo's all_to_all_single wants split sizes as lists of ints; megatron's alltoall dispatcher hands it tensors or
    numpy arrays (NCCL takes those). Applied on CPU engines and on GPU engines that share a GPU (gloo, virtual EP)."""
    orig_a2a = torch.distributed.all_to_all_single
    if getattr(orig_a2a, "_moe_lab_lists", False):
        return

    @functools.wraps(orig_a2a)
    def all_to_all_single(output, input, output_split_sizes=None, input_split_sizes=None, group=None,
                          async_op=False):
        out_splits, in_splits = _as_list(output_split_sizes), _as_list(input_split_sizes)
        transport = _ALL_TO_ALL_TRANSPORT.get("all_to_all")
        if transport is not None and not async_op and transport(orig_a2a, output, input, out_splits, in_splits, group):
            return None
        return orig_a2a(output, input, out_splits, in_splits, group=group, async_op=async_op)

    all_to_all_single._moe_lab_lists = True
    torch.distributed.all_to_all_single = all_to_all_single
    _APPLIED["all_to_all_single_lists"] = 1
    _uneven_all_gather()
    _gather_as_all_to_all(all_to_all_single)
    _reduce_scatter_as_all_to_all(all_to_all_single)


GATHER_AS_ALL_TO_ALL_BYTES = 1 << 20
"""A rank's part of an all-gather from which gloo sends it as one all-to-all (`_gather_as_all_to_all`). Measured on
one H100 node (16 cores, 4 ranks sharing the GPU, docs/bench.md): 8 MiB a rank 39.8 ms as gloo's all-gather, 14.2 ms
as the all-to-all; 2 MiB 4.6 and 3.2 ms; 64 KiB 0.7 and 0.9 ms (below this size gloo's own is kept)."""


def _gather_as_all_to_all(all_to_all_single) -> None:
    """gloo's all-gather passes each rank's part around a ring, one hop at a time; its all-to-all sends to every peer
    at once. An all-gather into one tensor is the all-to-all in which every rank sends its whole input to each rank
    (the input repeated world times): rank j's part lands at rows j of every output, as the all-gather puts it — a
    copy, no arithmetic, the same bytes. Applied to megatron's gathers (its modules bind the function at import:
    `dist_all_gather_func`), on gloo groups, synchronous calls, a rank's part of at least
    GATHER_AS_ALL_TO_ALL_BYTES; everything else takes gloo's own all-gather. The all-to-all called is the one of this
    module (not a wrapper installed later), so a ledger of collectives still sees one all-gather."""
    orig = torch.distributed.all_gather_into_tensor
    if getattr(orig, "_moe_lab_as_a2a", False):
        return

    @functools.wraps(orig)
    def all_gather_into_tensor(output_tensor, input_tensor, group=None, async_op=False):
        nbytes = input_tensor.numel() * input_tensor.element_size()
        if async_op or nbytes < GATHER_AS_ALL_TO_ALL_BYTES or torch.distributed.get_backend(group) != "gloo" \
                or not output_tensor.is_contiguous():
            return orig(output_tensor, input_tensor, group=group, async_op=async_op)
        world = torch.distributed.get_world_size(group)
        if output_tensor.numel() != world * input_tensor.numel():
            return orig(output_tensor, input_tensor, group=group, async_op=async_op)  # gloo says what is wrong
        sent = input_tensor.reshape(-1).repeat(world)
        _APPLIED["all_gather_as_all_to_all"] += 1  # how many went this way: a test, or a question, can check
        return all_to_all_single(output_tensor.view(-1), sent, group=group)

    all_gather_into_tensor._moe_lab_as_a2a = True
    _install("all_gather_into_tensor", orig, all_gather_into_tensor)
    _APPLIED.setdefault("all_gather_as_all_to_all", 0)


def _install(name: str, orig, replacement) -> None:
    """`torch.distributed.<name>` replaced, and so is every reference megatron's modules bound at import (e.g.
    `mappings.dist_all_gather_func`), which would otherwise still call the original."""
    import sys

    setattr(torch.distributed, name, replacement)
    for mod_name, mod in list(sys.modules.items()):
        if mod_name.startswith("megatron.") and mod is not None:
            for attr, val in list(vars(mod).items()):
                if val is orig:
                    setattr(mod, attr, replacement)


def _in_gloos_order(rank: int, world: int) -> list[int]:
    """The order in which gloo's reduce-scatter adds the ranks' parts of rank `rank`'s output, one rounding a step:
    rank - 1, rank - 2, ... (mod world), its own last — its ring passing the partial sum backwards. Read off gloo
    (torch 2.13 on CPU, worlds 2, 3, 4 and 8, bf16, fp16, fp32): bitwise at every even length of a rank's part
    tried (2 to 1,048,576), not at odd ones (3 to 524,291: as if gloo cut the input in two chunks a rank, whose
    borders then fall inside the parts), so odd lengths keep gloo's path and every shape is still checked on its
    first call (`_reduce_scatter_as_all_to_all`)."""
    return [(rank - k) % world for k in range(1, world)] + [rank]


def _reduce_scatter_as_all_to_all(all_to_all_single) -> None:
    """gloo's reduce-scatter is an all-reduce of the whole input around a ring (on one H100 node, 4 ranks: 33-42 ms
    to 8 MiB a rank, docs/bench.md), of which each rank keeps its part. The same sums from one all-to-all (rank j's
    part of every input to rank j) and a local sum of the world parts in gloo's order (`_in_gloos_order`, one
    rounding a step as gloo's). Where that is bitwise gloo's own result is not assumed: the first call of each shape
    runs both, every rank says whether its part agreed (a MIN all-reduce), and the shape keeps the all-to-all only
    where all agreed (`_APPLIED["reduce_scatter_checked"]` / `["reduce_scatter_kept_gloo"]` count the verdicts); that
    first call returns gloo's own result. Applied as `_gather_as_all_to_all` is: megatron's bound
    `dist_reduce_scatter_func` too, gloo groups, synchronous SUM calls, a rank's part of at least
    GATHER_AS_ALL_TO_ALL_BYTES and of even length (`_in_gloos_order`); the collectives it calls are this module's,
    so a ledger still sees one reduce-scatter."""
    orig = torch.distributed.reduce_scatter_tensor
    if getattr(orig, "_moe_lab_as_a2a", False):
        return
    all_reduce = torch.distributed.all_reduce
    sum_op = torch.distributed.ReduceOp.SUM
    verdicts: dict[tuple, bool] = {}

    def through_all_to_all(output, input, group):
        rank, world = torch.distributed.get_rank(group), torch.distributed.get_world_size(group)
        parts = torch.empty_like(input).view(world, -1)
        all_to_all_single(parts.view(-1), input.reshape(-1), group=group)
        order = _in_gloos_order(rank, world)
        acc = parts[order[0]] + parts[order[1]]
        for j in order[2:]:
            acc.add_(parts[j])
        output.view(-1).copy_(acc)

    @functools.wraps(orig)
    def reduce_scatter_tensor(output, input, op=sum_op, group=None, async_op=False):
        nbytes = output.numel() * output.element_size()
        if async_op or op != sum_op or nbytes < GATHER_AS_ALL_TO_ALL_BYTES \
                or torch.distributed.get_backend(group) != "gloo" or not output.is_contiguous():
            return orig(output, input, op=op, group=group, async_op=async_op)
        world = torch.distributed.get_world_size(group)
        if world < 2 or input.numel() != world * output.numel() or input.dtype != output.dtype \
                or input.device != output.device or output.numel() % 2:
            return orig(output, input, op=op, group=group, async_op=async_op)  # gloo says what is wrong
        key = (world, output.numel(), output.dtype, output.device.type)
        if key not in verdicts:
            through_all_to_all(output, input, group)
            mine = output.clone()
            work = orig(output, input.contiguous().clone(), op=op, group=group)
            agreed = torch.tensor([int(torch.equal(mine, output))], dtype=torch.int32)
            all_reduce(agreed, op=torch.distributed.ReduceOp.MIN, group=group)
            verdicts[key] = bool(agreed.item())
            _APPLIED["reduce_scatter_checked"] += 1
            _APPLIED["reduce_scatter_kept_gloo"] += int(not verdicts[key])
            return work
        if not verdicts[key]:
            return orig(output, input, op=op, group=group, async_op=async_op)
        _APPLIED["reduce_scatter_as_all_to_all"] += 1
        through_all_to_all(output, input, group)
        return None

    reduce_scatter_tensor._moe_lab_as_a2a = True
    _install("reduce_scatter_tensor", orig, reduce_scatter_tensor)
    for counter in ("reduce_scatter_as_all_to_all", "reduce_scatter_checked", "reduce_scatter_kept_gloo"):
        _APPLIED.setdefault(counter, 0)


def _uneven_all_gather() -> None:
    """gloo's all_gather wants every rank's tensor the same size; megatron's alltoall dispatcher with TP > 1 and
    sequence parallelism gathers tokens of uneven counts (`_gather_along_first_dim(output_split_sizes=...)`, NCCL
    takes those). Where sizes differ, each rank's tensor is padded along dim 0 to the largest, gathered, and the
    rows copied back: a copy, no arithmetic. Equal sizes take gloo's own path unchanged."""
    orig = torch.distributed.all_gather
    if getattr(orig, "_moe_lab_uneven", False):
        return

    @functools.wraps(orig)
    def all_gather(tensor_list, tensor, group=None, async_op=False):
        shapes = {tuple(t.shape) for t in tensor_list} | {tuple(tensor.shape)}
        if len(shapes) == 1 or tensor.dim() == 0 or async_op:
            return orig(tensor_list, tensor, group=group, async_op=async_op)
        rows = max(t.shape[0] for t in tensor_list)
        pad = lambda t: torch.cat([t, t.new_zeros((rows - t.shape[0],) + tuple(t.shape[1:]))])  # noqa: E731
        padded = [torch.empty((rows,) + tuple(t.shape[1:]), dtype=t.dtype, device=t.device) for t in tensor_list]
        work = orig(padded, pad(tensor.contiguous()), group=group)
        for dst, src in zip(tensor_list, padded):
            dst.copy_(src[: dst.shape[0]])
        return work

    all_gather._moe_lab_uneven = True
    torch.distributed.all_gather = all_gather
    _APPLIED["all_gather_uneven"] = 1


def fix_missing_te() -> bool:
    """0.13–0.16 reference `moe_utils.te_general_gemm` in every router forward but define it only with
    TransformerEngine → NameError without TE, on GPUs too. Define it as None (the non-TE path). Returns True if set."""
    from megatron.core.transformer.moe import moe_utils

    if hasattr(moe_utils, "te_general_gemm"):
        return False
    moe_utils.te_general_gemm = None
    _APPLIED["te_general_gemm=None"] = 1
    return True


def note(name: str) -> None:
    """Record a shim applied elsewhere (compat's batch-invariant mode without TransformerEngine)."""
    _APPLIED[name] = 1


def applied() -> list[str]:
    """The shims this process has applied."""
    return list(_APPLIED)


__all__ = ["apply_cpu_shims", "apply_gloo_shims", "fix_missing_te", "note", "applied"]
