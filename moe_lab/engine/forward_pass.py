"""Runs on engines: the forward pass — one MoE layer's forward of the whole input (a sequence-parallel layer fed its
slice and its output gathered over TP), a stack's residual forward, and the device sync that ends a timed step. The
bottom of the engine's measuring modules: `layer`, `capture`, `toolkit` and `train` import it, it imports none of
them."""

from __future__ import annotations

import torch
import torch.distributed as tdist

from . import compat
from .dist import STATE


def sync() -> None:
    if STATE.get("device") == "cuda":
        torch.cuda.synchronize()


def forward(layer, tokens, padding_mask=None, *, grad: bool = False) -> torch.Tensor:
    """One MoE forward (no autograd) of the whole [seq, 1, hidden] input, finished on the device before it returns.
    With sequence parallelism each TP rank feeds its 1/tp of the tokens and the output is gathered over TP (a copy,
    no arithmetic), so every rank returns the whole output whatever the layout."""
    if not getattr(layer.config, "sequence_parallel", False):
        out = compat.moe_forward(layer, tokens, padding_mask, grad=grad)
        sync()
        return out
    from megatron.core import parallel_state as ps

    tp, r = ps.get_tensor_model_parallel_world_size(), ps.get_tensor_model_parallel_rank()
    part = tokens.chunk(tp, dim=0)[r].contiguous()
    mask = padding_mask.chunk(tp, dim=1)[r].contiguous() if padding_mask is not None else None  # [bsz, seq]
    out = compat.moe_forward(layer, part, mask, grad=grad)
    return gather_sequence(layer, out)


def gather_sequence(layer, t: torch.Tensor) -> torch.Tensor:
    """A per-token tensor of a sequence-parallel layer ([tokens/tp, ...] on each TP rank) gathered over TP into the
    whole [tokens, ...] (a copy, no arithmetic); unchanged without sequence parallelism."""
    if not getattr(layer.config, "sequence_parallel", False):
        return t
    from megatron.core import parallel_state as ps

    t = t.contiguous()
    parts = [torch.empty_like(t) for _ in range(ps.get_tensor_model_parallel_world_size())]
    tdist.all_gather(parts, t, group=ps.get_tensor_model_parallel_group())
    sync()
    return torch.cat(parts, dim=0)


def stack_forward(layers, x: torch.Tensor) -> torch.Tensor:
    """A stack of MoE layers with residual connections: h <- h + moe_i(h), layer by layer (with autograd, as
    training runs it; megatron's DistributedDataParallel wraps the same forward as `train.StackModule`)."""
    h = x
    for lyr in layers:
        h = h + compat.moe_output(lyr(h))
    return h


__all__ = ["sync", "forward", "gather_sequence", "stack_forward"]
