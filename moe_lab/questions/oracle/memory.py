"""Notebook 08's GPU memory on ranks that share one GPU (virtual EP), and the layer sized to it. Torch-free.

The oracle holds, on every rank at once, the fp64 truth of its reference layout (and of each truth layout in turn):
the experts' weights upcast, four times a bf16 layer's bytes, at that layout's split. Its bf16 runs hold the layer at
each run layout's split (EP 1: every expert on every rank). On one 80 GB H100 shared by four ranks the seed layer's
truth at EP 4 (16.0 GiB of fp64 weights a rank) ran out of memory with the ranks holding 21.9-22.0 GiB each
(`HELD_OVER_WEIGHTS`), so there notebook 08's case takes a narrower layer: the experts' ffn width halved until the
rule says it fits, the rest of the layer the profile's (`experiment.cases`, wherever 08 runs: a run of every notebook,
08 alone, a notebook kernel; `oracle.ffn_hidden` given, it is not sized). The record keeps the sizing (`memory`) and
the findings say it."""

from __future__ import annotations

from dataclasses import dataclass

from ...layout import Layout

HELD_OVER_WEIGHTS = 1.4
"""GPU memory a rank held while the fp64 truth ran, over the truth's own fp64 weights on that rank: 21.94-22.02 GiB
for 16.0 GiB (ratio 1.37-1.38) on one H100 shared by four ranks, the seed layer at EP 4 with the allgather dispatcher
(2026-12-06, docs/bench.md): the forward's fp64 activations, the CUDA context and the allocator's blocks."""

MIN_FFN = 256
"""The narrowest expert ffn the sizing goes to: below it the layer is no longer the profile's question."""

FP64_BYTES, BF16_BYTES = 8, 2


def expert_weights_per_rank(layer, spec: str, world: int, itemsize: int) -> int:
    """Bytes of the experts' weights one rank holds under layout `spec` on `world` ranks, at `itemsize` bytes an
    element: its EP share of the experts, split over ETP (fc1 doubled for gated experts), plus the router's weight."""
    lay = Layout.parse(spec).on(world)
    fc1 = layer.hidden * layer.ffn_hidden * (2 if getattr(layer, "gated", False) else 1)
    per_expert = fc1 + layer.ffn_hidden * layer.hidden
    local = layer.num_experts // max(lay.ep, 1)
    return (local * per_expert // lay.expert_tp + layer.hidden * layer.num_experts) * itemsize


def need_gib(layer, params, world: int) -> float:
    """GiB a rank holds at the oracle's largest step: the fp64 truth of each truth layout, or a bf16 run layout's
    layer, whichever is larger, times `HELD_OVER_WEIGHTS`."""
    truths = params.truth_layouts or params.layouts
    most = max([expert_weights_per_rank(layer, s, world, FP64_BYTES) for s in (*truths, params.reference)]
               + [expert_weights_per_rank(layer, s, world, BF16_BYTES) for s in params.layouts])
    return most * HELD_OVER_WEIGHTS / 2**30


@dataclass(frozen=True)
class OracleSizing:
    """The oracle's layer against the GPU share of a rank: what the profile's layer needs, what each rank has, and
    the ffn width the run takes (None: the profile's, it fits)."""

    share_gib: float
    need_gib: float
    profile_ffn: int
    ffn_hidden: int | None
    sized_need_gib: float | None = None

    def words(self) -> str:
        if self.ffn_hidden is None:
            if self.need_gib <= self.share_gib:
                return ""
            return (f"the layer takes about {self.need_gib:.1f} GiB a rank here (its fp64 truth and layouts), more "
                    f"than each rank's {self.share_gib:.1f} GiB share of this GPU, and its expert ffn "
                    f"({self.profile_ffn}) cannot be halved further: it may run out of memory (fewer ranks per GPU, "
                    f"or a GPU with more memory)")
        head = (f"sized to this GPU: expert ffn {self.ffn_hidden}, not the profile's {self.profile_ffn} — at "
                f"{self.profile_ffn} the fp64 truth and layouts take about {self.need_gib:.1f} GiB a rank, and each "
                f"rank's share of this GPU is {self.share_gib:.1f} GiB")
        if self.sized_need_gib is not None and self.sized_need_gib > self.share_gib:
            return (f"{head}; even at ffn {self.ffn_hidden} it takes about {self.sized_need_gib:.1f} GiB, so it may "
                    f"run out of memory (fewer ranks per GPU or a GPU with more memory)")
        return (f"{head} ({self.sized_need_gib:.1f} GiB at ffn {self.ffn_hidden}; rule: the largest fp64 truth or "
                f"bf16 layout a rank holds x {HELD_OVER_WEIGHTS}, measured on an H100; -p oracle.ffn_hidden=N "
                f"sets the width)")


def size(layer, params, world: int, share_gib: float) -> OracleSizing:
    """The oracle's layer for ranks with `share_gib` GiB each: the profile's where it fits, else the expert ffn
    halved (kept divisible by every layout's ETP) until it does, down to `MIN_FFN`."""
    if share_gib <= 0:
        raise ValueError(f"a rank's share of the GPU ({share_gib!r} GiB) must be positive")
    need = need_gib(layer, params, world)
    if need <= share_gib:
        return OracleSizing(share_gib, need, layer.ffn_hidden, None)
    etp = max(Layout.parse(s).on(world).expert_tp for s in (*params.layouts, params.reference))
    ffn, sized = layer.ffn_hidden, need
    while sized > share_gib and ffn // 2 >= MIN_FFN and (ffn // 2) % etp == 0:
        ffn //= 2
        sized = need_gib(layer.replace(ffn_hidden=ffn), params, world)
    if ffn == layer.ffn_hidden:
        return OracleSizing(share_gib, need, layer.ffn_hidden, None)
    return OracleSizing(share_gib, need, layer.ffn_hidden, ffn, sized)


__all__ = ["HELD_OVER_WEIGHTS", "MIN_FFN", "OracleSizing", "expert_weights_per_rank", "need_gib", "size"]
