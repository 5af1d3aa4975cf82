"""Runs on engines: stage-by-stage capture of one MoE forward on a rank, and a ledger of every collective the layer issues.

Stages are recorded through forward hooks and by wrapping the token dispatcher's methods on the instance (never by
editing megatron-core); collectives by wrapping `torch.distributed` functions and the module-level aliases
megatron binds at import (`mappings.dist_all_gather_func`, ...). Both are temporary: hooks are global state.

Stage names are dotted and version-independent where the releases agree:
router.logits · router.probs · router.routing_map · dispatch.pre.* · dispatch.comm.* · dispatch.post.* ·
experts.out · combine.pre · combine.comm · combine.post · moe.out   (0.11/0.12: dispatch.permuted.*, combine.unpermuted)
"""

from __future__ import annotations

import contextlib
import functools
import sys
import time
from dataclasses import dataclass, field

import torch
import torch.distributed as tdist

from . import compat
from .forward_pass import forward, sync as device_sync

_COLLECTIVES = ("all_gather_into_tensor", "_all_gather_base", "all_gather", "reduce_scatter_tensor",
                "_reduce_scatter_base", "reduce_scatter", "all_to_all_single", "all_reduce", "broadcast")


@dataclass
class Cache:
    """What one captured forward recorded on this rank: stage name → tensor (cloned), in execution order."""

    tensors: dict = field(default_factory=dict)
    ledger: list = field(default_factory=list)
    grads: dict = field(default_factory=dict)
    """stage name → the gradient that reached it in backward (with `want_grads`), in backward order."""
    want_grads: bool = False
    _stage: list = field(default_factory=lambda: ["forward"])

    def add(self, name: str, value) -> None:
        if isinstance(value, torch.Tensor):
            # clone: detach() shares storage, and a later in-place op could flip a bitwise verdict
            self.tensors[name] = value.detach().clone()
            if self.want_grads and value.requires_grad:
                value.register_hook(lambda g, name=name: self._add_grad(name, g))

    @contextlib.contextmanager
    def in_stage(self, name: str):
        """Collectives issued in the block are booked in the ledger under stage `name` (e.g. "backward")."""
        self._stage.append(name)
        try:
            yield self
        finally:
            self._stage.pop()

    def _add_grad(self, name: str, g) -> None:
        if g is not None:
            self.grads[name] = g.detach().clone()

    @property
    def stages(self) -> list[str]:
        return list(self.tensors)


def _record_outputs(cache: Cache, prefix: str, names, out) -> None:
    if isinstance(out, tuple):
        for i, v in enumerate(out):
            sub = names[i] if names and i < len(names) else str(i)
            cache.add(f"{prefix}.{sub}", v)
    else:
        cache.add(prefix, out)


@contextlib.contextmanager
def capture_hooks(layer, cache: Cache, names_filter=None):
    """Record the stages of `layer`'s forwards into `cache` while the block runs; always removes what it added."""
    keep = _filter(names_filter)
    undo = []
    disp = layer.token_dispatcher

    def wrap(obj, attr, prefix, names):
        orig = getattr(obj, attr)

        @functools.wraps(orig)
        def wrapper(*a, **k):
            cache._stage.append(prefix)
            try:
                out = orig(*a, **k)
            finally:
                cache._stage.pop()
            if keep(prefix):
                _record_outputs(cache, prefix, names, out)
            return out

        wrapper._moe_lab_capture = True
        setattr(obj, attr, wrapper)  # instance attribute shadows the class method
        undo.append(lambda: delattr(obj, attr) if attr in vars(obj) else None)

    try:
        logits = compat.router_logits_method(layer.router)
        if logits:
            wrap(layer.router, logits, "router.logits", None)
        def hook(name, names=None):
            def fn(module, inputs, out):  # must return None: a forward hook's return value replaces the output
                if keep(name):
                    _record_outputs(cache, name, names, out[0] if names is None and isinstance(out, tuple) else out)
            return fn

        undo.append(layer.router.register_forward_hook(hook("router", ("probs", "routing_map"))).remove)
        for meth, (prefix, names) in compat.DISPATCHER_METHODS.items():
            if hasattr(disp, meth):
                wrap(disp, meth, prefix, names)
        undo.append(layer.experts.register_forward_hook(hook("experts.out")).remove)
        undo.append(layer.register_forward_hook(hook("moe.out")).remove)
        yield cache
    finally:
        for u in reversed(undo):
            u()


def _filter(names_filter):
    if names_filter is None:
        return lambda name: True
    if isinstance(names_filter, str):
        return lambda name: name.startswith(names_filter) or names_filter.startswith(name)
    if callable(names_filter):
        return names_filter
    prefixes = tuple(names_filter)
    return lambda name: any(name.startswith(p) or p.startswith(name) for p in prefixes)


# ---------------------------------------------------------------------------------------------- collective ledger


def _role(t: torch.Tensor, stage: str, hidden: int, num_experts: int) -> str:
    if t.dtype == torch.bool:
        return "routing_map"
    if not t.is_floating_point():
        return "token counts"
    if t.dim() >= 2 and t.shape[-1] == hidden:
        return "expert outputs" if stage.startswith("combine") else "tokens"
    if (t.dim() >= 2 and t.shape[-1] == num_experts) or t.dim() == 1:
        return "probs"
    return "other"


def _first_tensor(args, kwargs):
    """The tensor a collective *sends* (its input): second positional for out-of-place ops, else the first."""
    tensors = [a for a in args if isinstance(a, torch.Tensor)]
    lists = [a for a in args if isinstance(a, (list, tuple)) and a and isinstance(a[0], torch.Tensor)]
    return tensors, lists


@contextlib.contextmanager
def wrap_collectives(make):
    """While the block runs, every `torch.distributed` collective of _COLLECTIVES is replaced by `make(name, orig)`,
    and so is every module-level alias megatron bound at import (e.g. `mappings.dist_all_gather_func =
    all_gather_into_tensor`); the originals come back after it. The one patching mechanism of the ledger and the
    collective timer (nested, each wraps what the other installed)."""
    originals = {name: getattr(tdist, name) for name in _COLLECTIVES if hasattr(tdist, name)}
    by_id = {id(f): name for name, f in originals.items()}
    wrappers = {}
    patched = []  # (object, attribute, original)
    try:
        for name, orig in originals.items():
            w = wrappers[name] = make(name, orig)
            setattr(tdist, name, w)
            patched.append((tdist, name, orig))
        for mod_name, mod in list(sys.modules.items()):
            if not mod_name.startswith("megatron.") or mod is None:
                continue
            for attr, val in list(vars(mod).items()):
                if callable(val) and id(val) in by_id:
                    setattr(mod, attr, wrappers[by_id[id(val)]])
                    patched.append((mod, attr, val))
        yield
    finally:
        for obj, attr, orig in reversed(patched):
            setattr(obj, attr, orig)


@contextlib.contextmanager
def collective_ledger(cache: Cache, *, hidden: int, num_experts: int):
    """Record every collective issued while the block runs: op, dtype, shape, group size, bytes, stage, role."""

    def make(name, orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            group = kwargs.get("group")
            tensors, lists = _first_tensor(args, kwargs)
            if name in ("all_gather_into_tensor", "_all_gather_base", "reduce_scatter_tensor", "_reduce_scatter_base",
                        "all_to_all_single"):
                sent = tensors[1] if len(tensors) > 1 else tensors[0]
            elif name in ("all_gather",):
                sent = tensors[0] if tensors else lists[0][0]
            elif name == "reduce_scatter":
                sent = lists[0][0] if lists else tensors[0]
            else:
                sent = tensors[0]
            stage = cache._stage[-1]
            cache.ledger.append({
                "seq": len(cache.ledger), "op": name, "dtype": str(sent.dtype).removeprefix("torch."),
                "shape": list(sent.shape), "bytes": sent.numel() * sent.element_size(),
                "group_size": tdist.get_world_size(group), "stage": stage,
                "role": _role(sent, stage, hidden, num_experts)})
            return orig(*args, **kwargs)
        wrapper._moe_lab_ledger = True
        return wrapper

    with wrap_collectives(make):
        yield cache


@contextlib.contextmanager
def collective_timer(acc: dict | None, sync=None):
    """Add the seconds spent inside collectives while the block runs to acc["collective_s"] (and acc["calls"]):
    each call is timed between a device sync before it (GPU work queued earlier is not booked as transport) and one
    after it (an asynchronous collective is booked whole). A collective a wrapped one calls is not booked twice.
    Values are untouched: the wrapper only calls the original and reads the clock. `sync` defaults to the engine's
    (forward_pass.sync: CUDA synchronize on GPU engines, nothing on CPU).

    Yields a one-item list holding the dict booked into: set [0] to another dict to book elsewhere, or to None to
    pause (the wrappers then only call the originals, no sync, no clock) — so a caller timing many calls installs
    the wrappers once (patching scans megatron's modules: milliseconds) and books only the calls it times."""
    if sync is None:
        sync = device_sync
    box = [acc]
    depth = [0]
    clock = time.perf_counter

    def make(name, orig):
        @functools.wraps(orig)
        def wrapper(*args, **kwargs):
            book = box[0]
            if book is None or depth[0]:
                return orig(*args, **kwargs)
            depth[0] += 1
            try:
                sync()
                t0 = clock()
                out = orig(*args, **kwargs)
                sync()
                book["collective_s"] = book.get("collective_s", 0.0) + clock() - t0
                book["calls"] = book.get("calls", 0) + 1
            finally:
                depth[0] -= 1
            return out
        wrapper._moe_lab_timer = True
        return wrapper

    with wrap_collectives(make):
        yield box


def run_with_capture(layer, tokens: torch.Tensor, names_filter=None, *, hidden: int, num_experts: int):
    """One forward of `layer` with stage capture and the collective ledger → (out, cache)."""
    cache = Cache()
    with capture_hooks(layer, cache, names_filter), collective_ledger(cache, hidden=hidden, num_experts=num_experts):
        out = forward(layer, tokens)  # feeds a sequence-parallel layer its slice and gathers the output
    return out, cache
