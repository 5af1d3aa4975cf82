"""Notebook 08: is this gap expected? One case: the same global weights and tokens run in bf16 under each dispatcher
x layout (`trials` times: reruns), under each planted fault (one layout each), and once in fp64 — the truth: the
reference layout's bf16 weights and tokens upcast, so only the arithmetic differs. Rank 0 measures every run's error
to the truth per stage (router.logits, router.probs on the truth's routed entries, the output, and the output of
each expert's tokens by the truth's routing), the tokens whose top-k set differs from the truth's with their margin,
and the gap between the pairs of outputs a reader compares (`_pairs`, `rule.pair_gap`). The verdicts are the
findings' (`rule.judge_runs`).

The fp64 truth is also computed under each layout of `truth_layouts` (default: every layout), each from that layout's
own bf16 weights upcast: its distance to the reference layout's truth says the truth does not depend on the layout
(only then is one truth the truth of all).

Planted faults (`FAULTS`), each a bug a sharding mistake makes, each on one layout only:
- swap_experts: EP rank 0's two first local experts hold each other's weights (an expert index mapped wrong);
- capacity_drop: that layout alone runs with megatron's `moe_expert_capacity_factor` 1.0 (`moe_token_drop_policy`
  probs): over-capacity tokens dropped;
- etp_shard: under ETP 2, ETP rank 0 holds the other ETP rank's expert shards (a shard index wrong);
- scale_expert: EP rank 0's first local expert's weights scaled by (1 + 2**-12) before their rounding to bf16
  (about a twentieth of them move one bf16 ULP): a fault below what rounding lets the oracle see.
"""

from __future__ import annotations

import dataclasses
import itertools
from collections.abc import Mapping
from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from . import QUESTION
from ...config import MoEConfig
from ...experiments.protocol import Case
from ...layout import Layout, state_major
from ...records import ABSENT
from .params import FAULT_LAYOUTS
from .record import OracleRecord

NAME = "oracle"
NOTEBOOK = QUESTION.number
STAGES = ("router.logits", "router.probs", "out")
FAULTS = dict(FAULT_LAYOUTS)
"""Each planted fault and the layout it is planted on."""
SCALE_EXPONENT = 12
"""scale_expert multiplies the expert's weights by (1 + 2**-SCALE_EXPONENT) before rounding them to bf16."""


def case(base: MoEConfig, layouts: tuple[str, ...], *, dispatchers: tuple[str, ...] = ("allgather", "alltoall"),
         faults: tuple[str, ...] = tuple(FAULTS), trials: int = 2, reference: str = "ep1",
         truth_layouts: tuple[str, ...] | None = None, release: str = "installed", cut: int = 90,
         memory: dict | None = None) -> Case:
    """The oracle of `base`: every dispatcher x layout of `layouts` `trials` times, every dispatcher x fault of
    `faults` once, against the fp64 truth of `reference`'s weights (`base.dispatcher`'s layer); the fp64 truth of
    each of `truth_layouts` (default: every layout) against the reference's. `memory`: how `base` was sized to the
    GPU (`memory.OracleSizing` as a dict), kept in the record."""
    unknown = [f for f in faults if f not in FAULTS]
    if unknown:
        raise ValueError(f"faults {unknown} unknown; the faults are {', '.join(FAULTS)}")
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials ({trials!r}) must be an integer >= 1")
    for spec in (*layouts, reference):
        Layout.parse(spec)
    return Case(experiment=NAME, moe=base, kind="oracle", release=release, cut=cut,
                knobs=dict(layouts=list(layouts), dispatchers=list(dispatchers), faults=list(faults), trials=trials,
                           reference=reference, fault_layouts={f: FAULTS[f] for f in faults},
                           **({} if truth_layouts is None else {"truth_layouts": list(truth_layouts)}),
                           **({} if memory is None else {"memory": memory})),
                label=f"{'/'.join(dispatchers)} x {len(layouts)} layouts x {trials}, {len(faults)} faults vs fp64")


def cases(config: RunConfig) -> list[Case]:
    """One case: every dispatcher of the profile in it (so that dispatcher against dispatcher is a pair of runs);
    the layer's router dtype 'none' (the plain bf16 layer)."""
    from ...controller.placement import from_settings
    from .params import OracleParams

    p = config.params(OracleParams)
    ccfg = from_settings(config.cluster)
    world = ccfg.engines
    base = p.layer(config.layer).replace(router_dtype="none")
    sizing = _sized_to_the_gpu(base, p, ccfg)
    if sizing is not None and sizing.ffn_hidden:
        base = base.replace(ffn_hidden=sizing.ffn_hidden)
    for spec in (*p.layouts, *(FAULTS[f] for f in p.faults)):
        try:
            Layout.parse(spec).on(world).check_layer(base)
        except ValueError as e:
            raise ValueError(f"oracle layout {spec!r} on {world} ranks: {e}") from None
    return [case(base.replace(dispatcher=config.run.dispatchers[0]), p.layouts,
                 dispatchers=tuple(config.run.dispatchers), faults=p.faults, trials=p.runs(config.run.trials),
                 reference=p.reference, truth_layouts=p.truth_layouts or None, release=config.release,
                 cut=config.run.cut, memory=dataclasses.asdict(sizing) if sizing and sizing.words() else None)]


def _sized_to_the_gpu(layer, p, ccfg):
    """`memory.size` of the oracle's layer for ranks that share one GPU (virtual EP), against each rank's share of
    its memory; None elsewhere (a GPU per rank, a CPU), where the run gives `oracle.ffn_hidden`, or where the GPU's
    memory cannot be read."""
    from ...controller.placement import gpu_total_bytes
    from . import memory

    if ccfg.device != "cuda" or ccfg.ranks_per_gpu <= 1 or p.ffn_hidden:
        return None
    gpus = max(1, ccfg.engines // ccfg.ranks_per_gpu)
    total = gpu_total_bytes(gpus)
    if not total:
        return None
    return memory.size(layer, p, ccfg.engines, min(total) / 2**30 / ccfg.ranks_per_gpu)


# ---------------------------------------------------------------------------------------------- engine side


def _capture(layer, tokens, cfg):
    """{stage: whole tensor} of one forward (router stages gathered over TP under sequence parallelism)."""
    from ...engine import capture, toolkit

    out, cache = capture.run_with_capture(layer, tokens, ("router",), hidden=cfg.hidden, num_experts=cfg.num_experts)
    st = {k: toolkit.gather_sequence(layer, cache.tensors[k]) for k in ("router.logits", "router.probs",
                                                                          "router.routing_map") if k in cache.tensors}
    st["out"] = out
    return {k: v.detach().clone() for k, v in st.items()}


def _fp64_twin(layer, cfg, layout, *, consume: bool = False):
    """A fresh layer of the same layout whose every tensor is `layer`'s bf16 value upcast to fp64.

    The twin is built on the host (megatron's CPU initialisation: fp32 placeholders of the config's parameters, never
    written) and each parameter moves to `layer`'s device as fp64 straight from `layer`'s value: a GPU never holds an
    fp32 copy, whose freed blocks the caching allocator would keep beside the fp64 ones (the seed layer's truth at
    EP 4 then took 30 GiB on one rank, and four ranks sharing an 80 GB GPU ran out of memory). `consume`: `layer` is
    dropped parameter by parameter as the twin takes its place (the caller no longer uses it), so a GPU holds the
    fp64 twin and at most one parameter of both."""
    import torch

    from ...engine import compat
    from ...engine import layer as layer_mod

    lay = layer_mod.parallel_state_for(layout)
    twin = compat.build_moe_layer(cfg.replace(dtype="fp32"), lay, device="cpu")
    src = dict(layer.named_parameters())
    device = next(iter(src.values())).device
    with torch.no_grad():
        for name, p in twin.named_parameters():
            p.data = src[name].detach().to(torch.float64)
            if consume:
                src[name].data = src[name].data.new_empty(0)
                if device.type == "cuda":
                    torch.cuda.empty_cache()
        twin = twin.to(device=device, dtype=torch.float64)  # what is left: the buffers
        bias, tb = getattr(layer.router, "expert_bias", None), getattr(twin.router, "expert_bias", None)
        if bias is not None and tb is not None:
            tb.copy_(bias.to(tb.dtype))
    return twin


def _truth(moe: dict, spec: str):
    """The fp64 stages of layout `spec`'s weights and tokens, upcast (cached per layer and layout on this engine)."""
    import gc

    import torch

    from ...engine import toolkit
    from ...engine.dist import STATE, case_cache

    key = repr((sorted(moe.items()), spec))
    cache = case_cache("oracle_truths")
    if key not in cache:
        if len(cache) > 8:
            cache.clear()
        cuda = STATE.get("device") == "cuda"
        if cuda:  # an fp64 copy takes four times a bf16 layer: other cached layers go first (a module's reference
            STATE.get("layers", {}).clear()  # cycles keep it until a collection)
            gc.collect()
            torch.cuda.empty_cache()
        s = toolkit.setup(moe, Layout.parse(spec))
        if cuda:  # and so does this one: the twin takes its place (the runs build it again)
            STATE.get("layers", {}).clear()
        twin = _fp64_twin(s.layer, s.cfg, s.layout, consume=cuda)
        cache[key] = _capture(twin, s.tokens.to(torch.float64), s.cfg)
        del twin, s
        if cuda:
            gc.collect()
            torch.cuda.empty_cache()
    return cache[key]


def _plant(layer, cfg, layout, fault: str) -> dict:
    """Plant `fault` in a fresh (uncached) layer on this rank; says what changed here."""
    import torch
    from megatron.core import parallel_state as ps

    from ...engine import layer as layer_mod

    experts = layer.experts.local_experts
    ep_rank = ps.get_expert_model_parallel_rank()
    with torch.no_grad():
        if fault == "swap_experts":
            if ep_rank != 0 or len(experts) < 2:
                return {"changed": 0}
            a, b = experts[0], experts[1]
            for (_, pa), (_, pb) in zip(a.named_parameters(), b.named_parameters()):
                tmp = pa.detach().clone()
                pa.copy_(pb)
                pb.copy_(tmp)
            return {"changed": sum(p.numel() for p in a.parameters()) * 2}
        if fault == "etp_shard":
            etp, etp_rank = ps.get_expert_tensor_parallel_world_size(), ps.get_expert_tensor_parallel_rank()
            if etp < 2 or etp_rank != 0:
                return {"changed": 0}
            before = [p.detach().clone() for p in experts.parameters()]
            layer_mod.init_weights(layer, cfg, ep_rank=ep_rank, tp_rank=ps.get_tensor_model_parallel_rank(),
                                   tp=ps.get_tensor_model_parallel_world_size(), etp_rank=1, etp=etp)
            return {"changed": sum(int((p != b).sum()) for p, b in zip(experts.parameters(), before))}
        if fault == "scale_expert":
            # the expert's weights before their rounding to bf16: the same seeded init in fp32 (built on every
            # rank: a layer's build sets the layout's process groups)
            full = layer_mod.fresh_layers(cfg.replace(dtype="fp32"), layout, 1)[0].experts.local_experts[0]
            if ep_rank != 0:
                return {"changed": 0}
            changed = 0
            for kind in ("linear_fc1", "linear_fc2"):
                w = getattr(experts[0], kind).weight
                scaled = (getattr(full, kind).weight.detach().to(torch.float64)
                          * (1 + 2.0 ** -SCALE_EXPONENT)).to(w.dtype)
                changed += int((scaled != w).sum())
                w.copy_(scaled)
            return {"changed": changed}
    return {"changed": 0}


def _run(moe: dict, spec: str, fault: str | None):
    """One bf16 forward of layout `spec` (with `fault` planted in a fresh layer, where given) → (stages, note)."""
    from ...engine import layer as layer_mod
    from ...engine import toolkit

    if fault == "capacity_drop":
        moe = {**moe, "capacity_factor": 1.0, "drop_policy": "probs"}
    s = toolkit.setup(moe, Layout.parse(spec))
    note = {"changed": 0}
    layer = s.layer
    if fault in ("swap_experts", "etp_shard", "scale_expert"):
        layer = layer_mod.fresh_layers(s.cfg, s.layout, 1)[0]
        note = _plant(layer, s.cfg, s.layout, fault)
    return _capture(layer, s.tokens, s.cfg), note


def _measure(stages: dict, truth: dict, k: int) -> dict:
    """Rank 0: a run's error statistics per stage and group, and its routing flips with their margins."""
    import numpy as np
    import torch

    from . import rule, rule_torch

    # the statistics where the layer ran (a GPU sorts a run's millions of elements in milliseconds); the routing
    # and its margins, small, on the host
    stages = {k: v.detach() for k, v in stages.items()}
    truth = {k: v.detach().to(stages["out"].device) for k, v in truth.items()}
    t_map, r_map = truth["router.routing_map"].bool(), stages["router.routing_map"].bool()
    tokens = t_map.shape[0]
    flipped = (t_map != r_map).any(dim=1)
    count_changed = int((t_map.sum(dim=1) != r_map.sum(dim=1)).sum())
    kept = ~flipped
    lg = truth["router.logits"].reshape(tokens, -1).to(torch.float64).cpu()
    top = torch.sort(lg, dim=1, descending=True).values
    if lg.shape[1] > k:
        margin = (top[:, k - 1] - top[:, k]).numpy() / rule.bf16_ulp(top[:, k - 1].numpy())
    else:
        margin = np.full(tokens, np.inf)
    stats = rule_torch.error_stats(stages["router.logits"], truth["router.logits"], prefix="router.logits/")
    routed = t_map.reshape(tokens, -1) & kept[:, None]
    stats.update(rule_torch.error_stats(stages["router.probs"].reshape(tokens, -1)[routed],
                                        truth["router.probs"].reshape(tokens, -1)[routed], prefix="router.probs/"))
    out, t_out = stages["out"].reshape(tokens, -1), truth["out"].reshape(tokens, -1)
    hidden = out.shape[1]
    stats.update(rule_torch.error_stats(out, t_out, prefix="out/", masks=_ExpertElements(t_map, hidden),
                                        keep=kept.repeat_interleave(hidden)))
    flipped, kept, r_map = flipped.cpu(), kept.cpu().numpy(), r_map.cpu()
    return {"stats": stats,
            "flips": {"tokens": tokens, "flipped": int(flipped.sum()), "count_changed": count_changed,
                      "flipped_margin_ulp": [float(m) for m in margin[~kept]],
                      "flipped_topk": {str(int(t)): r_map[t].nonzero().reshape(-1).tolist()
                                       for t in flipped.nonzero().reshape(-1)},
                      "margin_ulp_quantiles": {q: float(np.percentile(margin, v)) for q, v in
                                               (("min", 0), ("p1", 1), ("median", 50))},
                      "margin_ulp_below": {str(u): int((margin <= u).sum()) for u in (1, 4, 16, 64)}}}


class _ExpertElements(Mapping):
    """"expert e" → the output elements of the tokens the truth routed to expert e (a token's hidden elements
    repeated), each mask built when the statistics ask for it: one at a time, not one per expert at once."""

    def __init__(self, routing_map, hidden: int):
        self.map, self.hidden = routing_map, hidden

    def __getitem__(self, name: str):
        e = int(name.removeprefix("expert "))
        return self.map[:, e].repeat_interleave(self.hidden)

    def __iter__(self):
        return (f"expert {e}" for e in range(self.map.shape[1]))

    def __len__(self) -> int:
        return int(self.map.shape[1])


def on_engine(payload: dict) -> dict:
    import torch

    from ...engine import toolkit
    from ...engine.dist import case_cache

    kn, moe = payload["knobs"], payload["moe"]
    rank0 = toolkit.tdist.get_rank() == 0
    dispatchers = kn.get("dispatchers") or [moe["dispatcher"]]
    truth = _truth(moe, kn["reference"])
    jobs = [("truth", None, spec, None, 1) for spec in kn.get("truth_layouts", kn["layouts"])]
    jobs += [("run", d, spec, None, t + 1) for d, spec in itertools.product(dispatchers, kn["layouts"])
             for t in range(kn["trials"])]
    jobs += [("fault", d, kn["fault_layouts"][f], f, 1) for d, f in itertools.product(dispatchers, kn["faults"])]
    done: dict[tuple, tuple] = {}
    for job in layout_major(jobs, kn["reference"], toolkit.world()):
        what, d, spec, fault, _ = job
        if what == "truth":
            other = _truth(moe, spec)
            if rank0:
                dev = (other["out"] - truth["out"]).abs()
                done[job] = ({"max_abs": float(dev.max()),
                              "max_rel": float((dev / truth["out"].abs().clamp_min(1e-300)).max()),
                              "routing_equal": bool(torch.equal(other["router.routing_map"],
                                                                truth["router.routing_map"]))}, None)
            if spec != kn["reference"]:  # only the reference's truth is needed after its comparison
                case_cache("oracle_truths").pop(repr((sorted(moe.items()), spec)), None)
            continue
        stages, note = _run({**moe, "dispatcher": d}, spec, fault)
        if fault:
            notes = [None] * toolkit.world()
            toolkit.tdist.all_gather_object(notes, note)
            note = {"changed": sum(n["changed"] for n in notes)}
        if rank0:
            done[job] = (_measure(stages, truth, moe["topk"]), stages["out"], note)
    fp64_layouts = {job[2]: done[job][0] for job in jobs if job[0] == "truth"} if rank0 else {}
    runs: list[dict] = []
    outs: dict[str, torch.Tensor] = {}
    for job in jobs if rank0 else ():  # in the order the record has always listed them: runs, then faults
        what, d, spec, fault, trial = job
        if what == "truth":
            continue
        measured, out, note = done[job]
        label = f"{d} {spec} + {fault}" if fault else f"{d} {spec} run {trial}"
        runs.append({"label": label, "dispatcher": d, "layout": spec, "fault": fault, "trial": trial,
                     **({"changed": note["changed"]} if fault else {}), **measured})
        outs[label] = out
    if not rank0:
        return {"rank": toolkit.tdist.get_rank()}
    from . import rule_torch

    pairs = [{"a": a, "b": b, **rule_torch.pair_gap(outs[a], outs[b]).asdict()}
             for a, b in _pairs(runs, kn["reference"])]
    return {"rank": 0, "runs": runs, "pairs": pairs, "fp64_layouts": fp64_layouts,
            "truth": {"layout": kn["reference"], "elements": int(truth["out"].numel())}}


def layout_major(jobs: list[tuple], reference: str, world: int) -> list[tuple]:
    """The order this engine runs `jobs` (each (what, dispatcher, layout spec, fault, trial)) in: layout by layout,
    the reference's first (`layout.state_major`). A change of parallel state remakes the process groups on every rank
    and drops the cached layers; the record lists the runs in `jobs` order whatever order they ran in."""
    def state(spec: str) -> tuple:
        return Layout.parse(spec).on(world).parallel_state

    return state_major(jobs, lambda job: state(job[2]), first=state(reference))


def _pairs(runs: list[dict], reference: str) -> list[tuple[str, str]]:
    """The pairs whose gap is measured (all pairs of a GPU profile's runs would take minutes): every run against its
    dispatcher's reference run, every rerun and fault against its layout's first run, and each layout's first run
    under one dispatcher against the next dispatcher's."""
    first = {(r["dispatcher"], r["layout"]): r["label"] for r in runs if not r["fault"] and r["trial"] == 1}
    out: list[tuple[str, str]] = []
    for r in runs:
        ref = first.get((r["dispatcher"], reference))
        own = first.get((r["dispatcher"], r["layout"]))
        for other in (ref, own):
            if other and other != r["label"] and (other, r["label"]) not in out:
                out.append((other, r["label"]))
    dispatchers = list(dict.fromkeys(r["dispatcher"] for r in runs))
    for d, e in zip(dispatchers, dispatchers[1:]):
        for (dd, lay), label in first.items():
            if dd == d and (e, lay) in first:
                out.append((label, first[(e, lay)]))
    return out


# ---------------------------------------------------------------------------------------------- controller side


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    r0 = next(r for r in per_rank if r.get("rank") == 0)
    return [OracleRecord(reference=case.knobs["reference"], layouts=list(case.knobs["layouts"]),
                         dispatchers=list(case.knobs.get("dispatchers") or [case.moe.dispatcher]),
                         faults=list(case.knobs["faults"]), trials=case.knobs["trials"], runs=r0["runs"],
                         pairs=r0["pairs"], fp64_layouts=r0["fp64_layouts"], truth=r0["truth"],
                         memory=case.knobs.get("memory", ABSENT)).asdict()]


def verdict(records: list[dict]) -> str:
    from ...findings import render
    from . import findings as found

    return render.verdict(found.findings(records))


__all__ = ["cases", "case", "on_engine", "records", "verdict", "FAULTS", "STAGES"]
