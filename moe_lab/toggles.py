"""Lab toggles: remedies applied to a built layer for the duration of a block, never by editing megatron-core."""

from __future__ import annotations

import contextlib
import functools

import torch


@contextlib.contextmanager
def probs_fp32_before_gather(layer, on: bool = True):
    """The seed reporter's fix: routing probs cast to fp32 before the dispatcher communicates them.

    Wraps the dispatcher's entry point (`dispatch_preprocess` from 0.13, `token_permutation` before) so the
    probs it receives are fp32; whatever megatron does downstream with `probs.dtype` follows from that.
    """
    if not on:
        yield
        return
    disp = layer.token_dispatcher
    name = "dispatch_preprocess" if hasattr(disp, "dispatch_preprocess") else "token_permutation"
    orig = getattr(disp, name)

    @functools.wraps(orig)
    def wrapper(*args, **kwargs):
        if "probs" in kwargs:
            kwargs["probs"] = _fp32(kwargs["probs"])
        else:
            args = list(args)
            # dispatch_preprocess(hidden, routing_map, probs) | token_permutation(hidden, probs, routing_map)
            i = 2 if name == "dispatch_preprocess" else 1
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
