"""`moe-lab preflight`: before any engine starts, what a model preset (or the lab's own layer) on a layout will run,
what is left out and why, and the memory per rank and per GPU — or a one-line refusal (exit 2) for a layout the layer
cannot take. Torch-free: it reads the presets (`moe_lab.models`), the layout rules (`moe_lab.layout`) and the router
features' rules (`config.MoEConfig`); the release checks of the engine's compat layer (it imports torch) are not
run here — every feature a preset sets ships in each release the lab builds (`releases.FEATURE_FIELDS`).

Memory is `tools.scale_plan.plan`'s calculation at TP=1 (parameters exactly; one forward's activations as megatron-core
0.16.1's unfused path allocates them, the lab's comparisons around it), with the expert weights divided by ETP for a
layout with ETP > 1 (activations under TP/ETP > 1 are not modelled: said so). Ranks that share a GPU (virtual EP) add
up on it."""

from __future__ import annotations

from dataclasses import dataclass

from .. import models
from ..config import MoEConfig
from ..layout import Layout
from . import scale, scale_plan

GIB = 2**30


@dataclass
class Plan:
    title: str
    runs: list[str]
    left_out: list[str]
    memory: list[dict]
    notes: list[str]
    fits: bool | None

    def text(self) -> str:
        out = [self.title, "will run:"] + [f"  - {r}" for r in self.runs]
        out += ["left out:"] + ([f"  - {x}" for x in self.left_out] or ["  - nothing"])
        out.append("memory (estimate, per rank and per GPU; bf16 weights):")
        for m in self.memory:
            out.append(f"  - {m['dispatcher']}, router {m['router_dtype']}: weights {m['weights_gib']:.2f} GiB "
                       f"(experts {m['experts_gib']:.2f}, shared {m['shared_gib']:.2f}, router {m['router_gib']:.3f}), "
                       f"forward + the lab's comparisons {m['activations_gib']:.2f} GiB → {m['rank_gib']:.2f} GiB per "
                       f"rank, {m['gpu_gib']:.2f} GiB per GPU ({m['ranks_per_gpu']} rank(s) on it)"
                       + ("" if m["fits"] is None else ("; fits" if m["fits"] else "; DOES NOT FIT")))
        out += [f"note: {n}" for n in self.notes]
        return "\n".join(out)

    def to_dict(self) -> dict:
        return {"title": self.title, "runs": self.runs, "left_out": self.left_out, "memory": self.memory,
                "notes": self.notes, "fits": self.fits}


def layer_for(model: str | None, scale_factor: float, seq_len: int | None, **changes) -> tuple[MoEConfig, object]:
    """The MoEConfig of a preset (scaled) or of the lab's default layer, and the preset (or None)."""
    if model:
        preset = models.get(model)
        cfg = preset.moe(scale=scale_factor, **changes)
    else:
        if scale_factor != 1:
            raise ValueError("--scale needs --model (it scales a preset)")
        preset, cfg = None, MoEConfig(**changes)
    if seq_len is not None:
        cfg = cfg.replace(seq_len=seq_len)
    return cfg, preset


def plan(cfg: MoEConfig, layout: Layout, *, preset=None, world: int | None = None, gpus: int | None = None,
         device: str = "cuda", dispatchers=("allgather", "alltoall"), router_dtypes=("none",),
         gpu_memory_gib: float | None = None, cut: int = 90) -> Plan:
    """Everything `moe-lab preflight` prints; ValueError (one line) for a layout or placement that cannot be."""
    world = world or layout.min_world
    layout.check_world(world)
    layout.check_layer(cfg, heads=preset.heads if preset else None)
    if device not in ("cpu", "cuda"):
        raise ValueError(f"device ({device!r}) must be cpu or cuda")
    if device == "cpu":
        gpus = None
    elif gpus is None:
        gpus = world
    elif not isinstance(gpus, int) or gpus < 1 or world % gpus:
        raise ValueError(f"gpus ({gpus!r}) must divide the world ({world}): each GPU holds world/gpus ranks")
    rpg = 1 if gpus is None else world // gpus
    g = layout.groups(world)
    if device == "cpu":
        where = f"{world} CPU engines over gloo"
    elif rpg == 1:
        where = f"{world} rank(s), one per GPU, over NCCL"
    else:
        where = f"{world} ranks on {gpus} GPU(s), {rpg} per GPU over gloo — virtual EP"
    title = (f"preflight: {cfg.model or 'the lab layer'} on {layout.label()} — world {world} (dp {g['dp']}, "
             f"edp {g['edp']}), {where}")
    runs = [f"layer: {cfg.label()}",
            f"{cfg.num_experts // layout.ep} local expert(s) per EP rank; dispatchers {', '.join(dispatchers)}; router "
            f"dtype {', '.join(router_dtypes)}; megatron-core's SequentialMLP (local spec, no TransformerEngine)"]
    left, notes = [], []
    if preset is not None:
        left += [f"{x}: needs TransformerEngine (megatron-core builds SequentialMLP / the unfused permute without it)"
                 for x in preset.needs_te]
        left += list(preset.left_out)
        left.append(f"the model's other layers (MoE layers: {preset.moe_layers}); attention is not built")
        prod = ", ".join(f"{k}={v}" for k, v in preset.production.items())
        if prod:
            notes.append(f"{preset.name}'s production config also sets {prod}")
        notes += [f"source: {s}" for s in preset.sources]
    if layout.expert_tp != layout.tp:
        left.append(f"ETP ({layout.expert_tp}) != TP ({layout.tp}): the lab's engines build experts with ETP = TP only")
    if layout.tp > 1 and not layout.sequence_parallel:
        notes.append("megatron-core needs sequence parallelism for MoE with TP > 1 in training (add ,sp)")
    if layout.tp > 1 or layout.expert_tp > 1:
        notes.append("activations under TP/ETP > 1 are counted as at TP 1 (an over-estimate of the per-rank share)")
    if cfg.shared_ffn:
        notes.append("the shared expert's weights are counted; its forward intermediates are not")
    mem, fits = [], None
    for disp in dispatchers:
        for rd in router_dtypes:
            c = cfg.replace(dispatcher=disp, router_dtype=rd)
            row = scale_plan.plan(c, layout.ep, cut=cut, usable_bytes=1 << 62, reserve_bytes=0,
                                  device="cpu" if device == "cpu" else "cuda")
            experts = row["param_experts_bytes"] / layout.expert_tp
            shared = scale.param_bytes(c, layout.ep)["shared"] / layout.tp
            weights = row["param_router_bytes"] + shared + experts
            act = row["lab_peak_bytes"] - row["param_bytes"]
            rank = weights + act
            m = {"dispatcher": disp, "router_dtype": rd, "weights_gib": weights / GIB, "experts_gib": experts / GIB,
                 "shared_gib": shared / GIB, "router_gib": row["param_router_bytes"] / GIB,
                 "activations_gib": act / GIB, "rank_gib": rank / GIB, "ranks_per_gpu": rpg,
                 "gpu_gib": rank * rpg / GIB, "fits": None}
            if gpu_memory_gib is not None and device == "cuda":
                m["fits"] = m["gpu_gib"] <= gpu_memory_gib
                fits = m["fits"] if fits is None else fits and m["fits"]
            mem.append(m)
    if "fp64" in router_dtypes:
        notes.append("router fp64: the router weight and logits, the probs and (allgather) the combine's "
                     "[tokens x EP, hidden] buffer and reduce-scatter are fp64 — 4x the bf16 bytes there")
    if mem:  # what an fp64 copy of the layer (an fp64 reference, as the training arithmetic test builds) needs
        w64 = 4 * mem[0]["weights_gib"]
        fit64 = ("" if gpu_memory_gib is None or device != "cuda" else
                 "; fits beside the bf16 layer" if (w64 + mem[0]["weights_gib"]) * rpg <= gpu_memory_gib else
                 "; does NOT fit beside the bf16 layer")
        notes.append(f"an fp64 copy of the weights: {w64:.2f} GiB per rank, {w64 * rpg:.2f} GiB per GPU "
                     f"({rpg} rank(s) on it){fit64}")
    return Plan(title=title, runs=runs, left_out=left, memory=mem, notes=notes, fits=fits)


ENGINE_PROCESS_BYTES = GIB // 2
"""What a CPU engine holds before its layer: a Python process with torch, megatron-core and ipyparallel imported
(~0.35 GiB resident measured for torch + megatron-core's MoE layer, plus ipyparallel's engine)."""


def available_memory() -> int | None:
    """Bytes this machine can still give processes (psutil; else /proc/meminfo's MemAvailable); None if unknown."""
    try:
        import psutil

        return int(psutil.virtual_memory().available)
    except Exception:  # noqa: BLE001 - psutil missing or unable to read: the kernel's own figure
        pass
    try:
        with open("/proc/meminfo") as f:
            for line in f:
                if line.startswith("MemAvailable:"):
                    return int(line.split()[1]) * 1024
    except (OSError, ValueError, IndexError):
        pass
    return None


def check_host_memory(cfgs, ccfg, *, cut: int = 90, layout: Layout = Layout(ep=0),
                      available: int | None = None) -> dict | None:
    """The CPU twin of `scale_plan.check_memory`: the ranks of CPU engines on this machine (launcher 'local') need
    ENGINE_PROCESS_BYTES plus `plan`'s estimate of the busiest rank (weights + one forward + the lab's comparisons)
    each; refused in one line when that is more than the memory available at the check, before any engine starts (the
    engines would otherwise die one by one allocating it). Returns the numbers, or None where it does not apply or
    the available memory cannot be read. `available` overrides the measured bytes (tests)."""
    if ccfg.device != "cpu" or ccfg.launcher != "local" or not cfgs:
        return None
    available = available_memory() if available is None else available
    if available is None:
        return None
    world = ccfg.engines
    lay = layout.on(world)
    worst = None
    for cfg in cfgs:
        p = plan(cfg, lay, world=world, device="cpu", dispatchers=(cfg.dispatcher,),
                 router_dtypes=(cfg.router_dtype,), cut=cut)
        rank = max(m["rank_gib"] for m in p.memory) * GIB
        if worst is None or rank > worst["per_rank_bytes"]:
            worst = {"per_rank_bytes": rank, "config": cfg}
    need = (worst["per_rank_bytes"] + ENGINE_PROCESS_BYTES) * world
    worst.update(need_bytes=need, available_bytes=available, engines=world)
    if need > available:
        c = worst["config"]
        raise ValueError(
            f"{world} CPU engines need {need / GIB:.1f} GiB ({worst['per_rank_bytes'] / GIB:.1f} GiB per rank for "
            f"hidden {c.hidden}, {c.num_experts} experts, ffn {c.ffn_hidden}, {c.seq_len} tokens on {lay.label()}, "
            f"+ {ENGINE_PROCESS_BYTES / GIB:.1f} GiB per engine process), but this machine has {available / GIB:.1f} "
            "GiB available: use a smaller layer (hidden, ffn, seq_len), fewer engines, or a machine with more memory")
    return worst
