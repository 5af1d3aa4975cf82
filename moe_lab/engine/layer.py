"""Runs on engines: "the layer" — the real megatron-core MoELayer for a config (built through `compat`), its weights
seeded so that they depend only on (seed, global expert, tensor), one cached per engine; and the input tokens,
identical on every rank."""

from __future__ import annotations

import logging
import re
import zlib

import torch

from ..config import ROUTER_FEATURES, MoEConfig
from ..layout import WORLD, Layout
from . import compat
from .dist import STATE, init_parallel_state
from .forward_pass import forward

logger = logging.getLogger(__name__)

INIT_STD = 0.02  # megatron's default init_method_std
# Fields that change the built layer (the rest — seq_len, deterministic, probs_fp32_gather — only how it is run).
_LAYER_KEYS = ("hidden", "num_experts", "topk", "ffn_hidden", "dtype", "dispatcher", "router_dtype", "seed",
               "options") + ROUTER_FEATURES
MAX_LAYERS = 2  # layers kept per engine: a case's and the plain one its cost is paired with
EXPERT_PARAM = re.compile(r"experts\.local_experts\.(\d+)\.(linear_fc1|linear_fc2)\.weight$")
_SHARED_PARAM = re.compile(r"shared_experts\.(linear_fc1|linear_fc2)\.weight$")
EXPERT_BIAS_STD = 0.01
"""The seeded aux-loss-free expert bias (megatron starts it at zero and learns it; a zero bias would not change which
experts win, so the lab draws it: it is a function of (seed, global expert) like every weight)."""


def generator(device: torch.device, seed: int, *key) -> torch.Generator:
    """A generator seeded from (seed, key): draws depend only on what is drawn, never on call order."""
    h = zlib.crc32(repr((seed,) + key).encode())
    return torch.Generator(device=device).manual_seed(h)


def _normal(shape, device, seed, *key) -> torch.Tensor:
    g = generator(device, seed, *key)
    return torch.randn(shape, generator=g, device=device, dtype=torch.float32) * INIT_STD


@torch.no_grad()
def init_weights(layer, cfg: MoEConfig, *, ep_rank: int, tp_rank: int, tp: int, etp_rank: int | None = None,
                 etp: int | None = None) -> int:
    """Overwrite the layer's weights from `cfg.seed`: global expert e gets the same weights whichever rank holds it.

    megatron's own init draws from the rank's RNG stream, so the weights would depend on EP/TP layout; this
    makes them a function of (seed, global expert index, tensor name) alone. Returns the number of tensors set.
    """
    num_local = _num_local(layer)
    etp_rank, etp = (tp_rank, tp) if etp is None else (etp_rank, etp)  # experts are split over ETP (default = TP)
    n = 0
    for name, p in layer.named_parameters():
        dev = p.device
        if name.endswith("router.weight"):
            full = _normal((cfg.num_experts, cfg.hidden), dev, cfg.seed, "router")
            p.copy_(full.to(p.dtype))
            n += 1
            continue
        m, s = EXPERT_PARAM.search(name), _SHARED_PARAM.search(name)
        if m is not None:
            key, kind, r, size = ("expert", ep_rank * num_local + int(m.group(1))), m.group(2), etp_rank, etp
        elif s is not None:  # the shared expert is replicated over EP, sharded over TP
            key, kind, r, size = ("shared",), s.group(1), tp_rank, tp
        else:
            continue
        shard = _shard(p.shape, cfg, kind, key, tp_rank=r, tp=size, device=dev)
        if shard.shape != p.shape:
            raise RuntimeError(f"{name}: seeded shard {tuple(shard.shape)} != parameter {tuple(p.shape)}")
        p.copy_(shard.to(p.dtype))
        n += 1
    bias = getattr(getattr(layer, "router", None), "expert_bias", None)
    if bias is not None:  # a buffer (float32 in megatron), not a parameter: seeded apart, not counted in n
        bias.copy_((_normal((cfg.num_experts,), bias.device, cfg.seed, "expert_bias") / INIT_STD
                    * EXPERT_BIAS_STD).to(bias.dtype))
    return n


def _shard(shape, cfg: MoEConfig, kind: str, key: tuple, *, tp_rank: int, tp: int, device) -> torch.Tensor:
    """This TP rank's slice of the full seeded matrix `key`/`kind`, so that the global weights never depend on TP.
    fc1 is column-parallel ([ffn, hidden], TP shards rows; gated: [gate; up], each half sharded on its own, as
    megatron lays out a GLU's fc1), fc2 row-parallel ([hidden, ffn], TP shards columns)."""
    if kind == "linear_fc1":
        rows = shape[0] * tp
        full = _normal((rows, cfg.hidden), device, cfg.seed, *key, kind)
        if cfg.gated:
            gate, up = full.chunk(2, dim=0)
            return torch.cat([gate.chunk(tp, dim=0)[tp_rank], up.chunk(tp, dim=0)[tp_rank]], dim=0)
        return full.chunk(tp, dim=0)[tp_rank]
    cols = shape[1] * tp
    full = _normal((cfg.hidden, cols), device, cfg.seed, *key, kind)
    return full.chunk(tp, dim=1)[tp_rank]


def _num_local(layer) -> int:
    return len(layer.experts.local_experts)


def make_tokens(cfg: MoEConfig, device: torch.device) -> torch.Tensor:
    """[seq_len, 1, hidden] standard-normal tokens in cfg.dtype, identical on every rank (seeded, not broadcast)."""
    g = generator(device, cfg.seed, "tokens")
    x = torch.randn((cfg.seq_len, 1, cfg.hidden), generator=g, device=device, dtype=torch.float32)
    return x.to(compat.torch_dtype(cfg.dtype))


def truncate(tokens: torch.Tensor, cut: int) -> torch.Tensor:
    """The seed report's truncation: tokens[cut:] = 0."""
    from ..config import check_cut

    check_cut(cut, tokens.shape[0])
    t = tokens.clone()
    t[cut:] = 0
    return t


def layout_here(layout: Layout | dict | None = None) -> Layout:
    """A case's layout on this engine's world, resolved and checked: a `Layout`, its `asdict()` (a payload's
    "layout"), or None (`WORLD`: the experts over every rank)."""
    import torch.distributed as tdist

    if layout is None:
        layout = WORLD
    elif isinstance(layout, dict):
        layout = Layout(**layout)
    return layout.on(tdist.get_world_size())


def parallel_state_for(layout: Layout | dict | None) -> Layout:
    """megatron's parallel_state for `layout` (as `layout_here` takes it) on this world (re-initialised only when it
    changes); the layout, resolved."""
    lay = layout_here(layout)
    init_parallel_state(tp=lay.tp, ep=lay.ep, etp=lay.expert_tp)
    return lay


def build(cfg: MoEConfig, layout: Layout):
    """A freshly built layer for `cfg` split as `layout` (parallel_state already set for it), every tensor seeded
    → (layer, tensors seeded)."""
    from megatron.core import parallel_state as ps

    lay = layout_here(layout)
    layer = compat.build_moe_layer(cfg, lay, device=STATE["device"])
    n = init_weights(layer, cfg, ep_rank=ps.get_expert_model_parallel_rank(),
                     tp_rank=ps.get_tensor_model_parallel_rank(), tp=lay.tp,
                     etp_rank=ps.get_expert_tensor_parallel_rank(), etp=lay.expert_tp)
    return layer, n


def fresh_layers(cfg: MoEConfig, layout: Layout, n: int) -> list:
    """`n` freshly built (uncached) layers for `cfg` split as `layout`, layer i seeded from seed + i, after
    parallel_state is set for the layout: the one build path of a stack (`get_stack`, the training stack
    `train.build_stack`)."""
    lay = parallel_state_for(layout)
    return [build(cfg.replace(seed=cfg.seed + i), lay)[0] for i in range(n)]


CACHE_SHARE = 0.5
"""On a GPU, the cached layers and the one being built may take at most this share of the rank's part of the GPU
(its memory over the ranks sharing it): the rest is for activations, gradients and fp64 truths. The seed layer at
EP 1 takes 17 GB a rank, four ranks sharing one H200 have 35 GB each: two such layers are never kept together."""


def _shape(key: tuple) -> tuple:
    return tuple(key[_LAYER_KEYS.index(k)] for k in ("hidden", "num_experts", "topk", "ffn_hidden", "dtype"))


def layer_bytes(layer) -> int:
    return sum(p.numel() * p.element_size() for p in layer.parameters())


def gpu_share_bytes() -> int:
    """This rank's part of its GPU's memory: the GPU's total over the ranks that share it."""
    total = torch.cuda.get_device_properties(STATE["torch_device"]).total_memory
    return total // max(1, STATE.get("ranks_per_gpu") or 1)


def evictions(cached: dict, need: int, budget: float) -> list:
    """The cached layers (key → bytes, least recently used first) to drop before a layer of `need` bytes is built so
    the cache and it fit in `budget` bytes: the least recently used first, as few as that takes. The same on every
    rank of a layout (their layers' shares are the same size), so the ranks build and drop alike."""
    out, held = [], sum(cached.values())
    for k, size in cached.items():
        if held + need <= budget:
            break
        out.append(k)
        held -= size
    return out


def get_layer(cfg: MoEConfig, layout: Layout | dict | None = None):
    """The MoE layer for `cfg` split as `layout` (None: `WORLD`) on this rank, built once per layer-defining config
    and layout (a warm cluster reuses it)."""
    lay = parallel_state_for(layout)
    key = tuple(getattr(cfg, k) for k in _LAYER_KEYS) + (lay,)
    layers = STATE.setdefault("layers", {})
    if key in layers:
        layers[key] = layers.pop(key)  # most recently used last
    else:
        while len(layers) >= MAX_LAYERS:  # a case and its plain reference; the seed config's experts take GBs
            layers.pop(next(iter(layers)))
        if STATE["device"] == "cuda":
            sizes = {k: layer_bytes(v) for k, v in layers.items()}
            like = [sizes[k] for k in layers if k[-1] == lay and _shape(k) == _shape(key)]
            for k in evictions(sizes, max(like, default=0), gpu_share_bytes() * CACHE_SHARE):
                layers.pop(k)
            torch.cuda.empty_cache()
        layer, n = build(cfg, lay)
        names = [name for name, _ in layer.named_parameters()]
        if n != len(names):  # megatron's init is off (perform_initialization=False): every tensor must be seeded
            raise RuntimeError(f"megatron-core {compat.installed_version()}: seeded {n} of {len(names)} parameters "
                               f"({names}); teach layer.init_weights the new names")
        layers[key] = layer
    return layers[key]


def output_fingerprint(cfg_dict: dict, layout: dict | None = None) -> dict:
    """This rank's forward of its layer for `cfg_dict` (split as `layout`, None: `WORLD`) on the config's tokens:
    the output's fingerprint, the routing map's and the number of tokens routed (what shows that a router feature
    reached megatron's layer)."""
    from .. import metrics

    cfg = MoEConfig(**cfg_dict)
    layer = get_layer(cfg, layout)
    tokens = make_tokens(cfg, STATE["torch_device"])
    seen = {}

    def keep(_mod, _inp, out):
        seen["probs"], seen["map"] = out[0], out[1]

    hook = layer.router.register_forward_hook(keep)
    try:
        out = forward(layer, tokens)
    finally:
        hook.remove()
    return {"out": metrics.fingerprint(out), "routing_map": metrics.fingerprint(seen["map"]),
            "routed": int(seen["map"].sum()), "probs_sum": float(seen["probs"].float().sum())}


def weights_fingerprint(cfg_dict: dict, layout: dict | None = None, *, rebuild: bool = False) -> dict[str, str]:
    """Fingerprint of every parameter of this rank's layer for `cfg_dict` split as `layout` (None: `WORLD`;
    rebuild=True builds it afresh)."""
    from .. import metrics

    cfg = MoEConfig(**cfg_dict)
    if rebuild:
        STATE.get("layers", {}).clear()
    layer = get_layer(cfg, layout)
    return {name: metrics.fingerprint(p) for name, p in layer.named_parameters()}


def get_stack(cfg: MoEConfig, layout: Layout, n: int, *, distinct: bool):
    """`n` MoE layers split as `layout` for a depth experiment on this rank: the layer for `cfg` `n` times (the seed
    test's `[layer.mlp] * 4`), or `n` distinct layers seeded seed, seed+1, ... Cached per (config, layout, n,
    distinct): one stack at a time, beside the case layers of `get_layer`."""
    if not isinstance(n, int) or n < 1:
        raise ValueError(f"layers ({n!r}) must be a positive integer")
    lay = layout_here(layout)
    key = (tuple(getattr(cfg, k) for k in _LAYER_KEYS), lay, n, distinct)
    stacks = STATE.setdefault("stacks", {})
    if key not in stacks:
        stacks.clear()
        if not distinct:
            stacks[key] = [get_layer(cfg, lay)] * n
        else:
            stacks[key] = fresh_layers(cfg, lay, n)
    return stacks[key]
