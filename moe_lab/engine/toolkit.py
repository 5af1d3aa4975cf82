"""Runs on engines: the measurement steps every experiment shares — set up a case, run a forward, compare a tensor
across ranks (fingerprints first, full tensors only where they differ), compare copies within a rank, and time
paired rounds. An experiment that needs a new engine-side step adds it here, never a private copy."""

from __future__ import annotations

import contextlib
import logging
import time
from dataclasses import dataclass

import torch
import torch.distributed as tdist

from .. import metrics
from ..config import MoEConfig
from ..layout import Layout
from . import layer as layer_mod
from .capture import collective_timer
from .dist import STATE
from .forward_pass import forward, gather_sequence, sync  # the forward pass, re-exported: toolkit.forward

logger = logging.getLogger(__name__)

FINGERPRINT_BYTES = 48  # what one fingerprint costs on the wire, as the records book it (hash + dtype/shape text)


@dataclass
class CaseSetup:
    """One case on this rank: its config, its layout (resolved on this world), the (cached) layer and the input
    tokens, identical on every rank."""

    cfg: MoEConfig
    layout: Layout
    layer: object
    tokens: torch.Tensor

    @property
    def device(self) -> torch.device:
        return self.tokens.device

    def truncated(self, cut: int) -> torch.Tensor:
        return layer_mod.truncate(self.tokens, cut)


def is_out_of_memory(e: BaseException) -> bool:
    """A device's allocator ran out of memory (torch's OutOfMemoryError, a RuntimeError)."""
    return isinstance(e, torch.OutOfMemoryError) or "CUDA out of memory" in str(e)


def unavailable(e: BaseException) -> dict:
    """This rank's answer for a setting it cannot run — an option the machine or the release lacks, where every rank
    fails at the same point, before any collective: the record says so (a finding). A device out of memory is not
    such a finding and is raised again: it can strike one rank of several, whose others then wait in a collective,
    and the controller names the rank and stops the engines at once (`controller.diagnosis.raise_failed`)."""
    if is_out_of_memory(e):
        raise e
    return {"rank": tdist.get_rank(), "available": False, "reason": f"{type(e).__name__}: {e}"[:400]}


def setup(cfg_dict: dict, layout: dict | Layout | None = None) -> CaseSetup:
    """The one engine-side case setup: config from its dict, its layout (a payload's "layout"; None: `WORLD`), the
    layer for both (built once, cached), its tokens."""
    cfg = MoEConfig(**cfg_dict)
    lay = layer_mod.layout_here(layout)
    layer = layer_mod.get_layer(cfg, lay)
    return CaseSetup(cfg=cfg, layout=lay, layer=layer, tokens=layer_mod.make_tokens(cfg, STATE["torch_device"]))


def set_deterministic(on: bool) -> None:
    # warn_only: ops without a deterministic kernel warn instead of raising; megatron's unpermute checks
    # are_deterministic_algorithms_enabled() and switches scatter_add_ → index_add_.
    torch.use_deterministic_algorithms(on, warn_only=True)


@contextlib.contextmanager
def deterministic(on: bool = True):
    """torch deterministic algorithms on (or off) for the block; the previous state comes back after it."""
    prev, warn = torch.are_deterministic_algorithms_enabled(), torch.is_deterministic_algorithms_warn_only_enabled()
    set_deterministic(on)
    try:
        yield
    finally:
        torch.use_deterministic_algorithms(prev, warn_only=warn)


def world() -> int:
    return tdist.get_world_size()


def not_applicable(reason: str) -> dict:
    """A comparison that cannot be made here (e.g. across ranks with one rank), with the reason."""
    return {"applicable": False, "reason": reason}


def compare_across_ranks(tensors: dict[str, torch.Tensor], *, detail: tuple[str, ...] = ()) -> dict | None:
    """Compare each named tensor of this rank with the same-named tensor of every other rank; every rank must call
    it with the same names in the same order. Rank 0 returns {name: {"pairs": {"0-r": comparison}, "fingerprints":
    [...]} | detail ..., "bytes_compared": n}; the other ranks None. With one rank: every entry not applicable.

    Ranks first exchange fingerprints (FINGERPRINT_BYTES each); a tensor crosses the wire only if some rank's
    fingerprint differs. For names in `detail`, rank 0 also computes the ULP histogram, mismatches per token (row)
    and a binned [rows x columns] mismatch map of each pair.
    """
    rank, n = tdist.get_rank(), tdist.get_world_size()
    if n == 1:
        why = not_applicable("world size 1: there is no other rank to compare with")
        return {"bytes_compared": 0, **{name: {"pairs": {}, "fingerprints": [metrics.fingerprint(t)], **why}
                                        for name, t in tensors.items()}}
    mine = {name: (metrics.fingerprint(t), list(t.shape)) for name, t in tensors.items()}
    everyone: list = [None] * n
    tdist.all_gather_object(everyone, mine)
    out: dict = {"bytes_compared": FINGERPRINT_BYTES * len(mine) * n}
    for name, t in tensors.items():  # same order on every rank: every rank issues the same collectives
        fps = [e[name][0] for e in everyone]
        res: dict = {"fingerprints": fps, "pairs": {}}
        if len(set(fps)) == 1:
            zero = compare_identical(t)
            res["pairs"] = {f"0-{r}": dict(zero) for r in range(1, n)}
            if name in detail:
                res.update(_detail_equal(t, n))
        elif len({tuple(e[name][1]) for e in everyone}) > 1:
            res["pairs"] = {f"0-{r}": {"shape_differs": True, "mismatch_frac": 1.0, "bitwise_equal": False}
                            for r in range(1, n)}
        else:
            g = gather(t)
            out["bytes_compared"] += g.numel() * g.element_size()
            if rank == 0:  # compared where the tensors are (on the GPU: milliseconds, not seconds)
                res["pairs"] = {f"0-{r}": compare_any(g[0], g[r]) for r in range(1, n)}
                if name in detail:
                    res.update(_detail(g))
        out[name] = res
    return out if rank == 0 else None


def broadcast_from_rank0(value):
    """Rank 0's `value` on every rank (a small Python object)."""
    box = [value]
    if tdist.get_world_size() > 1:
        tdist.broadcast_object_list(box, src=0)
    return box[0]


def gather(t: torch.Tensor) -> torch.Tensor:
    """[world, *shape]: every rank's `t` (bool as uint8), on every rank (gloo wants ranks along dim 0)."""
    flat = t.contiguous()
    if flat.dtype == torch.bool:
        flat = flat.to(torch.uint8)
    n = tdist.get_world_size()
    g = torch.empty((n * flat.shape[0], *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    tdist.all_gather_into_tensor(g, flat)
    return g.view(n, *flat.shape)


def compare_any(a: torch.Tensor, b: torch.Tensor) -> dict:
    """metrics.compare for float tensors; exact element equality for bool/int (no ULPs there)."""
    if a.is_floating_point():
        return metrics.compare(a, b)
    return metrics.compare_exact(a, b)


def compare_identical(t: torch.Tensor) -> dict:
    """`compare_any(t, t)` for a tensor whose copy was shown bitwise equal (fingerprints matched), without comparing."""
    return metrics.identical(t) if t.is_floating_point() else compare_any(t, t)


def compare_parts(parts: list[torch.Tensor]) -> dict:
    """The worst of parts[c] vs parts[0] (c >= 1), fingerprints first; `worst_copy` says which c."""
    base = parts[0]
    fps = [metrics.fingerprint(p) for p in parts]
    worst, worst_c = None, 0
    for c in range(1, len(parts)):
        cmp = compare_identical(base) if fps[c] == fps[0] else compare_any(base.cpu(), parts[c].cpu())
        if worst is None or (cmp["mismatch_frac"], cmp["max_ulp"]) > (worst["mismatch_frac"], worst["max_ulp"]):
            worst, worst_c = cmp, c
    return {**(worst or compare_identical(base)), "worst_copy": worst_c}


def _rows(t: torch.Tensor) -> torch.Tensor:
    return t.reshape(t.shape[0], -1)


def _detail_equal(t: torch.Tensor, n: int) -> dict:
    empty = binned_map(torch.zeros(t.shape[0], t[0].numel() if t.shape[0] else 0, dtype=torch.bool))
    return {"ulp_hist": {f"0-{r}": {0: t.numel()} for r in range(1, n)},
            "token_mismatch": {f"0-{r}": [0] * t.shape[0] for r in range(1, n)},
            "mismatch_map": {f"0-{r}": empty for r in range(1, n)}}


def _detail(g: torch.Tensor) -> dict:
    hist, tok, maps = {}, {}, {}
    for r in range(1, g.shape[0]):
        key = f"0-{r}"
        hist[key] = metrics.ulp_histogram(g[0], g[r])
        mism = _rows(metrics.bitwise_mismatch(g[0], g[r]))
        tok[key] = mism.sum(dim=1).tolist()
        maps[key] = binned_map(mism)
    return {"ulp_hist": hist, "token_mismatch": tok, "mismatch_map": maps}


def binned_map(mask: torch.Tensor, bins: int = 64) -> dict:
    """Fraction of mismatching elements in a [tokens x hidden] grid of at most bins x bins cells (for heatmaps)."""
    t, h = mask.shape
    bt, bh = min(bins, t), min(bins, h)
    m = mask.to(torch.float32).cpu()
    ti = (torch.arange(t) * bt) // t  # index → bin by integer division, then average each bin
    hi = (torch.arange(h) * bh) // h
    rows = torch.zeros(bt, h).index_add_(0, ti, m) / torch.bincount(ti, minlength=bt).clamp_min(1).unsqueeze(1)
    grid = torch.zeros(bt, bh).index_add_(1, hi, rows) / torch.bincount(hi, minlength=bh).clamp_min(1).unsqueeze(0)
    return {"tokens_per_bin": t / bt, "hidden_per_bin": h / bh, "frac": grid.tolist()}


def token_mismatch(a: torch.Tensor, b: torch.Tensor) -> list[int]:
    """Differing elements per token (row) between a and b."""
    return _rows(metrics.bitwise_mismatch(a, b)).sum(dim=1).tolist()


def paired_rounds(fns: dict, rounds: int, *, warmup: int = 1, rotate: bool = False,
                  collectives=True) -> dict[str, dict[str, list[float]]]:
    """Seconds of each of `fns` (name → no-argument callable), `rounds` times; in each round every fn runs once,
    back to back (in a rotating order if `rotate`), each started together on every rank (barrier) and timed to
    the end of its device work. `warmup` untimed rounds run first (first-call allocations, kernel selection).

    Returns {"wall_s": {name: [seconds per round]}, "collective_s": {name: [seconds per round]}, "calls": {name:
    [collectives per round]}, "placement": placement()}: the collective seconds are the time this rank spent inside
    torch.distributed collectives during the timed call (capture.collective_timer: its wrappers are installed for the
    rounds, outside every clock, and book only while a timed fn runs; a device sync around every collective). They
    change no value (tests/cluster/test_cost_timer.py). `collectives`: True (every fn), False (none: nothing is
    wrapped) or the names whose collectives are timed — a fn left out has no entry in "collective_s" (its
    collectives pass through the paused wrappers). The wrapper's overhead is measured by timing one forward both ways
    (tools.bench_engine.time_collective_timer). The controller turns every rank's result into a cost
    (stats.paired_cost)."""
    names = list(fns)
    timed = set(names) if collectives is True else set() if collectives is False else set(collectives) & set(names)
    wall: dict[str, list[float]] = {m: [] for m in names}
    coll: dict[str, list[float]] = {m: [] for m in names if m in timed}
    calls: dict[str, list[int]] = {m: [] for m in names if m in timed}
    with collective_timer(None, sync) if timed else contextlib.nullcontext([None]) as box:
        for i in range(warmup + rounds):
            order = names[i % len(names):] + names[:i % len(names)] if rotate else names
            for m in order:
                acc = {"collective_s": 0.0, "calls": 0}
                tdist.barrier()  # ranks start together: a rank still busy elsewhere is not timed as collective wait
                sync()
                box[0] = acc if m in timed else None
                t0 = time.perf_counter()
                fns[m]()
                sync()
                t = time.perf_counter() - t0
                box[0] = None
                if i >= warmup:
                    wall[m].append(t)
                    if m in timed:
                        coll[m].append(acc["collective_s"])
                        calls[m].append(acc["calls"])
    return {"wall_s": wall, "collective_s": coll, "calls": calls, "placement": placement()}


def placement() -> dict:
    """Where this engine's timings were measured: world, ranks per GPU, backend, device, and `transport` where
    something other than the backend carried the all-to-alls (stats.placement words it)."""
    from . import ipc_collectives

    carried = ipc_collectives.describe()
    return {"world": tdist.get_world_size(), "ranks_per_gpu": STATE.get("ranks_per_gpu", 1),
            "backend": STATE.get("backend") or tdist.get_backend(), "device": STATE.get("device"),
            **({"transport": carried} if carried else {})}


def time_forward(layer, tokens, repeats: int = 3) -> float:
    """Median wall time of `repeats` forwards (after the caller's warm-up), seconds."""
    import statistics

    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(layer, tokens)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)
