"""Runs on engines: build (or reuse) the layer for a case, run the seed report's comparisons, return small dicts."""

from __future__ import annotations

import logging
import statistics
import time

import torch
import torch.distributed as tdist

from . import compat, metrics, model, toggles
from .config import MoEConfig
from .dist import STATE, init_parallel_state

logger = logging.getLogger(__name__)

# Fields that change the built layer (the rest — seq_len, deterministic — only change how it is run).
_LAYER_KEYS = ("hidden", "num_experts", "topk", "ffn_hidden", "dtype", "dispatcher", "router_dtype", "ep", "tp", "seed")


def _sync():
    if STATE.get("device") == "cuda":
        torch.cuda.synchronize()


def get_layer(cfg: MoEConfig):
    """The MoE layer for `cfg` on this rank, built once per layer-defining config (a warm cluster reuses it)."""
    world = tdist.get_world_size()
    ep = cfg.resolved_ep(world)
    init_parallel_state(tp=cfg.tp, ep=ep)
    key = tuple(getattr(cfg, k) for k in _LAYER_KEYS)
    layers = STATE.setdefault("layers", {})
    if key not in layers:
        layers.clear()  # one layer at a time: the seed config's experts take GBs
        if STATE["device"] == "cuda":
            torch.cuda.empty_cache()
        from megatron.core import parallel_state as ps

        layer = compat.build_moe_layer(cfg, ep=ep, tp=cfg.tp, device=STATE["device"])
        n = model.init_weights(layer, cfg, ep_rank=ps.get_expert_model_parallel_rank(),
                               tp_rank=ps.get_tensor_model_parallel_rank(), tp=cfg.tp)
        names = [name for name, _ in layer.named_parameters()]
        if n != len(names):  # megatron's init is off (perform_initialization=False): every tensor must be seeded
            raise RuntimeError(f"megatron-core {compat.installed_version()}: seeded {n} of {len(names)} parameters "
                               f"({names}); teach model.init_weights the new names")
        layers[key] = layer
    return layers[key]


def weights_fingerprint(cfg_dict: dict, *, rebuild: bool = False) -> dict[str, str]:
    """Fingerprint of every parameter of this rank's layer for `cfg_dict` (rebuild=True builds it afresh)."""
    cfg = MoEConfig(**cfg_dict)
    if rebuild:
        STATE.get("layers", {}).clear()
    layer = get_layer(cfg)
    return {name: metrics.fingerprint(p) for name, p in layer.named_parameters()}


def set_deterministic(on: bool) -> None:
    # warn_only: ops without a deterministic kernel warn instead of raising; megatron's unpermute checks
    # are_deterministic_algorithms_enabled() and switches scatter_add_ → index_add_.
    torch.use_deterministic_algorithms(on, warn_only=True)


def forward(layer, tokens, padding_mask=None):
    out = compat.moe_forward(layer, tokens, padding_mask)
    _sync()
    return out


def time_forward(layer, tokens, repeats: int = 3) -> float:
    """Median wall time of `repeats` forwards (after the caller's warm-up), seconds."""
    ts = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        forward(layer, tokens)
        ts.append(time.perf_counter() - t0)
    return statistics.median(ts)


def cross_rank(out: torch.Tensor, *, detail: bool = False) -> dict | None:
    """Compare this rank's output with every other rank's, fingerprints first; rank 0 returns the comparison.

    Ranks exchange 48-byte fingerprints; full tensors cross only if some fingerprint differs.
    """
    rank, world = tdist.get_rank(), tdist.get_world_size()
    fp = metrics.fingerprint(out)
    fps: list = [None] * world
    tdist.all_gather_object(fps, fp)
    res: dict = {"fingerprints": fps, "bytes_compared": 48 * world, "pairs": {}}
    if len(set(fps)) == 1:
        zero = metrics.compare(out, out)
        for r in range(1, world):
            res["pairs"][f"0-{r}"] = dict(zero)
        if detail:
            res["ulp_hist"] = {f"0-{r}": {0: out.numel()} for r in range(1, world)}
            res["token_mismatch"] = {f"0-{r}": [0] * out.shape[0] for r in range(1, world)}
            empty = binned_map(torch.zeros(out.shape[0], out[0].numel(), dtype=torch.bool))
            res["mismatch_map"] = {f"0-{r}": empty for r in range(1, world)}
        return res if rank == 0 else None
    flat = out.contiguous()
    gathered = torch.empty((world * flat.shape[0], *flat.shape[1:]), dtype=flat.dtype, device=flat.device)
    tdist.all_gather_into_tensor(gathered, flat)  # gloo wants the ranks concatenated along dim 0
    gathered = gathered.view(world, *flat.shape)
    res["bytes_compared"] += gathered.numel() * gathered.element_size()
    if rank != 0:
        return None
    a = gathered[0].cpu()
    hist, tok, maps = {}, {}, {}
    for r in range(1, world):
        b = gathered[r].cpu()
        key = f"0-{r}"
        res["pairs"][key] = metrics.compare(a, b)
        if detail:
            hist[key] = metrics.ulp_histogram(a, b)
            mism = metrics.bitwise_mismatch(a, b).reshape(a.shape[0], -1)
            tok[key] = mism.sum(dim=1).tolist()
            maps[key] = binned_map(mism)
    if detail:
        res["ulp_hist"], res["token_mismatch"], res["mismatch_map"] = hist, tok, maps
    return res


def binned_map(mask: torch.Tensor, bins: int = 64) -> dict:
    """Fraction of mismatching elements in a [tokens x hidden] grid of at most bins x bins cells (for heatmaps)."""
    t, h = mask.shape
    bt, bh = min(bins, t), min(bins, h)
    m = mask.to(torch.float32)
    # Split evenly-ish: index → bin via integer division, then average each bin.
    ti = (torch.arange(t) * bt) // t
    hi = (torch.arange(h) * bh) // h
    rows = torch.zeros(bt, h).index_add_(0, ti, m) / torch.bincount(ti, minlength=bt).clamp_min(1).unsqueeze(1)
    grid = torch.zeros(bt, bh).index_add_(1, hi, rows) / torch.bincount(hi, minlength=bh).clamp_min(1).unsqueeze(0)
    return {"tokens_per_bin": t / bt, "hidden_per_bin": h / bh, "frac": grid.tolist()}


def worst(cmps: list[dict]) -> dict:
    """The worst of several comparisons, metric by metric (booleans: all must hold)."""
    out = {}
    for k in cmps[0]:
        vals = [c[k] for c in cmps]
        if isinstance(vals[0], bool):
            out[k] = all(vals)
        elif isinstance(vals[0], (int, float)):
            out[k] = max(vals)
    return out


def run_case(cfg_dict: dict, *, cut: int = 90, detail: bool = False, repeats: int = 3) -> dict:
    """The three comparisons of `moe-lab probe` for one config; rank 0's result carries `cross_rank`.

    cross_rank: the same tokens on every rank → outputs must be bitwise equal across ranks.
    rerun:      the same input twice on the same rank → bitwise equal (run-to-run determinism).
    truncation: first `cut` tokens with and without tokens[cut:] zeroed → bitwise equal (batch invariance).
    """
    cfg = MoEConfig(**cfg_dict)
    dev = STATE["torch_device"]
    set_deterministic(cfg.deterministic)
    try:
        layer = get_layer(cfg)
        tokens = model.make_tokens(cfg, dev)
        with toggles.probs_fp32_before_gather(layer, cfg.probs_fp32_gather):
            out1 = forward(layer, tokens)
            out2 = forward(layer, tokens)
            out_t = forward(layer, model.truncate(tokens, cut))
            t_fwd = time_forward(layer, tokens, repeats) if repeats else None
        res = {
            "rank": tdist.get_rank(),
            "rerun": metrics.compare(out1, out2),
            "truncation": metrics.compare(out1[:cut], out_t[:cut]),
            "t_forward_s": t_fwd,
            "out_shape": list(out1.shape),
        }
        cr = cross_rank(out1, detail=detail)
        if cr is not None:
            res["cross_rank_detail"] = cr
            res["cross_rank"] = worst(list(cr["pairs"].values()))
        if detail:
            res["truncation_token_mismatch"] = metrics.bitwise_mismatch(out1[:cut], out_t[:cut]).reshape(cut, -1).sum(dim=1).tolist()
        return res
    finally:
        set_deterministic(False)
