"""Notebook 08, gradients: one training step's input and weight gradients under each layout against the fp64 gradient.

Each case is one run (a layout, a rerun of it, or a layout carrying a planted bug, `engine.train.MISTAKES`): the
training stack of notebook 06 built twice on the same ranks at the same layout — once in bf16 (the run, with the
case's mistake) and once in fp64 from the SAME bf16 weights upcast (the truth, never with a mistake) — and one step
of `engine.train.Trainer` on each, on the same global batch (the bf16 tokens upcast, the same fp32 targets upcast):
only the arithmetic differs. What is compared is what megatron's optimizer steps on: the main gradients after the
data-parallel / expert-data-parallel / sequence-parallel reduce and before clipping, and the gradient of the global
loss at the input tokens (each share's `x.grad` scaled by TP / shares, a power of two: exact).

Rank 0 gathers the whole tensors (each expert's ETP shards made whole, every share of the batch in order) and
computes the rule's per-group statistics (`rule.error_stats`: |error| in ULPs of the truth's bf16 value) for the
input gradient, the forward's output, the router gradient and the expert gradients (all, and per expert: a fault
confined to one expert stands out in its own group), the least-squares scale of the run against the truth per group
(<run, truth> / <truth, truth>: a gradient scaled by a wrong factor shows that factor), the bf16 run's fingerprints
(reruns compared bitwise) and the truth's norm and random projections (the fp64 truths of every layout compared
across records). The verdicts are the findings' (`gradients_findings`), from records only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

import logging
from collections.abc import Mapping
from dataclasses import dataclass
from ...experiments import protocol
from ...experiments.protocol import Case
from ...layout import Layout
from ...records import ABSENT, Body, Unavailable
from .gradients_params import OracleTrainingParams

logger = logging.getLogger(__name__)

NAME = "oracle_gradients"
NOTEBOOK = "08"
SKETCH = 16
"""Random projections of each truth (fp64): two layouts' truths compared across records to fp64 rounding."""
GROUPS = ("input", "output", "router", "experts")
"""The tensors compared, in the order their statistics are given (the judge names the first group out of band)."""


def params_of(config: RunConfig) -> OracleTrainingParams:
    """The section's parameters: the registered class's, or a question's parameters' `training` field holding them
    (an `OracleTrainingParams`, or the profile's JSON object for one), else the defaults."""
    try:
        return config.params(OracleTrainingParams)
    except KeyError:
        pass
    for p in getattr(config, "questions", {}).values():
        t = getattr(p, "training", None)
        if isinstance(t, OracleTrainingParams):
            return t
        if isinstance(t, Mapping) and getattr(p, "KEY", "") == "oracle":
            return OracleTrainingParams.from_dict(dict(t), "oracle.training")
    return OracleTrainingParams()


def run_name(layout: str, run: int, mistake: str) -> str:
    """A run's name in verdicts: its layout, its rerun, its planted bug."""
    return layout + (f" run {run}" if run else "") + (f" + planted {mistake}" if mistake != "none" else "")


def cases(config: RunConfig, params: OracleTrainingParams | None = None, *, name: str = NAME,
          kind: str = "gradients") -> list[Case]:
    """One case per run of `params.runs()`: each correct layout, each rerun, each planted bug at its layouts."""
    from ...controller.placement import from_settings

    op = params or params_of(config)
    base = op.layer(config.layer)
    world = from_settings(config.cluster).engines
    if op.tokens % world:
        raise ValueError(f"oracle_training.tokens ({op.tokens}) must be divisible by the world ({world} ranks)")
    out = []
    for lay, run, mistake in op.runs():
        lay.check(world, base.num_experts)
        lay.check_layer(base)
        label = run_name(lay.spec(), run, mistake)
        knobs = {"layers": op.layers, "tokens": op.tokens, "lr": op.lr, "run": run, "mistake": mistake,
                 "run_name": label}
        if kind == "trajectory":
            knobs["steps"] = op.steps
        out.append(Case(experiment=name, kind=kind, moe=base, release=config.release, layout=lay,
                        cut=config.run.cut, label=f"{kind}: {label}", knobs=knobs))
    return out


not_applicable = protocol.not_applicable_in_release


# ---------------------------------------------------------------------------------------------- engine side


def on_engine(payload: dict) -> dict:
    from ...engine import toolkit

    try:
        return engine_gradients(payload)
    except (ValueError, KeyError, RuntimeError, NotImplementedError, ImportError) as e:
        return toolkit.unavailable(e)


def pair(cfg, layers: int, layout: Layout, *, lr: float, mistake: str):
    """The run's and the truth's trainers at `layout`: the bf16 stack (with `mistake`) and an fp64 stack whose every
    parameter and float buffer is the bf16 stack's value upcast (fp64 holds every bf16 value exactly)."""
    import torch

    from ...engine import train

    stack = train.build_stack(cfg, layers, layout=layout)
    truth_stack = train.build_stack(cfg, layers, layout=layout, precision="fp64")
    with torch.no_grad():
        for (na, a, _), (nb, b, _) in zip(train.named_params(stack), train.named_params(truth_stack)):
            if na != nb or a.shape != b.shape:
                raise RuntimeError(f"the fp64 stack's parameter {nb} does not match the bf16 stack's {na}")
            b.copy_(a.to(torch.float64))
        for la, lb in zip(stack, truth_stack):
            for (na, a), (_, b) in zip(la.named_buffers(), lb.named_buffers()):
                if a.is_floating_point() and b.is_floating_point():
                    b.copy_(a.to(b.dtype))
    run = train.Trainer(stack, optim=train.Optim(lr=lr), mistake=mistake)
    truth = train.Trainer(truth_stack, optim=train.Optim(lr=lr))
    return run, truth


def watch(tr) -> dict:
    """What one `Trainer.step` computes on the way, kept for comparison: the stack's output (its forward) and every
    main gradient right after the reduce, before clipping changes it (the instance's `forward` and `grad_norm`
    wrapped; the step itself is the trainer's own)."""
    seen: dict = {}
    fwd, norm = tr.forward, tr.grad_norm

    def forward(x):
        h = fwd(x)
        seen["output"] = h.detach()
        return h

    def grad_norm():
        seen["grads"] = {q.name: q.main.grad.detach().clone() for q in tr.params}
        return norm()

    tr.forward, tr.grad_norm = forward, grad_norm
    return seen


def batch_pair(cfg, step: int, tokens: int, device):
    """The global batch of `step` for the run (bf16 tokens, fp32 targets) and for the truth (the same values in
    fp64)."""
    import torch

    from ...engine import train

    x, y = train.batch(cfg, step, tokens, torch.bfloat16, device)
    return (x, y), (x.to(torch.float64), y.to(torch.float64))


def step(tr, seen: dict, x, y) -> dict:
    """One optimizer step of `tr` on its share of the global batch (x, y); returns the step's loss and norm, and
    this rank's pieces: its share's input gradient (of the global loss) and output, and its gradients."""
    xs = tr.my_share(x).detach().clone().requires_grad_(True)
    res = tr.step(xs, tr.my_share(y))
    scale = (tr.tp if tr.tp > 1 else 1) / tr.shares  # a power of two: the scaled gradient is exact
    return {**res, "input": (xs.grad.detach() * scale), "output": seen["output"], "grads": seen["grads"]}


def pieces(tr, grads: dict, extra: dict) -> dict:
    """This rank's part of a whole state: every share's per-token tensors (`extra`, this rank's share), the router
    tensor where this rank owns it (DP and TP rank 0) and each expert tensor's ETP shard where this rank's expert-DP
    rank is 0. `grads`: name → tensor (main gradients or main weights)."""
    from megatron.core import parallel_state as ps

    own_dense = ps.get_data_parallel_rank() == 0 and ps.get_tensor_model_parallel_rank() == 0
    own_expert = ps.get_expert_data_parallel_rank() == 0
    etp_rank = ps.get_expert_tensor_parallel_rank()
    out = {"share": tr.share, "per_token": {k: v.detach().cpu() for k, v in extra.items()}, "dense": {},
           "experts": {}}
    for q in tr.params:
        t = grads[q.name].detach().cpu()
        if q.expert and own_expert:
            out["experts"][(q.name, etp_rank)] = t
        elif not q.expert and own_dense:
            out["dense"][q.name] = t
    return out


def gather0(obj):
    """Every rank's `obj` on rank 0 (a list in rank order), None elsewhere."""
    import torch.distributed as tdist

    box = [None] * tdist.get_world_size() if tdist.get_rank() == 0 else None
    tdist.gather_object(obj, box, dst=0)
    return box


def whole_state(every: list[dict], gated: bool) -> dict:
    """Rank 0: the gathered pieces as whole flat tensors — per-token tensors in share order, the router(s) in name
    order, and the experts (fc1 then fc2 of each, experts in global order, ETP shards made whole) with the global
    expert of every element."""
    import re

    import torch

    from ...engine import train

    shares = sorted({e["share"]: e for e in every}.values(), key=lambda e: e["share"])
    out = {k: torch.cat([e["per_token"][k].reshape(-1) for e in shares]) for k in shares[0]["per_token"]}
    dense: dict = {}
    shards: dict = {}
    for e in every:
        dense.update(e["dense"])
        for (name, r), t in e["experts"].items():
            shards.setdefault(name, {})[r] = t
    out["router"] = torch.cat([dense[n].reshape(-1) for n in sorted(dense)])

    def key(name):
        m = re.match(r"layer(\d+)\.expert(\d+)\.(.*)$", name)
        return (int(m.group(2)), int(m.group(1)), m.group(3)) if m else (1 << 30, 0, name)

    flats, labels = [], []
    for name in sorted(shards, key=key):
        parts = [shards[name][r] for r in sorted(shards[name])]
        t = (train.whole(name, parts, gated=gated) if len(parts) > 1 else parts[0]).reshape(-1)
        flats.append(t)
        labels.append(torch.full((t.numel(),), key(name)[0], dtype=torch.int64))
    out["experts"] = torch.cat(flats)
    out["experts_labels"] = torch.cat(labels)
    return out


def compare_state(run: dict, truth: dict, groups, seed: int, *, prefix: str = "", per_expert: bool = True) -> dict:
    """Rank 0: the rule's statistics of each group of the run against the truth (experts also per expert where
    `per_expert`), the run's least-squares scale against the truth (likewise) — both on the engine's device —, its
    fingerprint, and the truth's norm and sketch."""
    import torch

    from ... import metrics
    from ...engine import layer as layer_mod
    from ...engine.dist import STATE
    from . import rule_torch

    dev = STATE.get("torch_device", torch.device("cpu"))  # the statistics where the engine computes: its GPU
    stats, scale, fps, tnorm, sketch = {}, {}, {}, {}, {}
    for g in groups:
        a, t = run[g], truth[g]
        a_dev, t_dev = a.detach().to(dev), t.detach().to(dev)  # each tensor copied to the device once
        lab = run["experts_labels"].to(dev) if g == "experts" and per_expert else None
        stats.update(rule_torch.error_stats(a_dev, t_dev, lab, prefix=f"{prefix}{g}."))
        a64, t64 = a_dev.to(torch.float64), t_dev.to(torch.float64)
        tt = float(t64 @ t64)
        scale[f"{prefix}{g}.all"] = float(a64 @ t64) / tt if tt else None
        if lab is not None:
            for e in sorted(set(torch.unique(lab).tolist())):
                m = lab == e
                te = float(t64[m] @ t64[m])
                scale[f"{prefix}{g}.{e}"] = float(a64[m] @ t64[m]) / te if te else None
        fps[f"{prefix}{g}"] = metrics.fingerprint(a)
        tnorm[f"{prefix}{g}"] = tt ** 0.5
        gen = layer_mod.generator(dev, seed, "oracle sketch", g, t64.numel())  # the same directions at every layout
        r = torch.randn((SKETCH, t64.numel()), generator=gen, dtype=torch.float64, device=dev)
        sketch[f"{prefix}{g}"] = (r @ t64).tolist()
    return {"stats": stats, "scale": scale, "fingerprints": fps, "truth_norm": tnorm, "truth_sketch": sketch}


def engine_gradients(payload: dict) -> dict:
    """One step of the run and of the truth at the case's layout; rank 0 returns the comparison."""
    import torch.distributed as tdist

    from ...config import MoEConfig
    from ...engine import toolkit
    from ...engine.dist import STATE

    kn, lay = payload["knobs"], Layout(**payload["layout"])
    cfg = MoEConfig(**payload["moe"])
    run, truth = pair(cfg, kn["layers"], lay, lr=kn["lr"], mistake=kn["mistake"])
    seen_r, seen_t = watch(run), watch(truth)
    (x, y), (x64, y64) = batch_pair(cfg, 0, kn["tokens"], STATE["torch_device"])
    with toolkit.deterministic(cfg.deterministic):
        a = step(run, seen_r, x, y)
        b = step(truth, seen_t, x64, y64)
    mine = {"run": pieces(run, a["grads"], {"input": a["input"], "output": a["output"]}),
            "truth": pieces(truth, b["grads"], {"input": b["input"], "output": b["output"]}),
            "loss": (run.share, a["loss"], b["loss"])}
    every = gather0(mine)
    res = {"rank": tdist.get_rank(), "available": True, "dp": run.dp,
           "expert_dp": tdist.get_world_size(run.expert_group)}
    if every is not None:
        gated = bool(run.gated)
        rs, ts = whole_state([e["run"] for e in every], gated), whole_state([e["truth"] for e in every], gated)
        res.update(compare_state(rs, ts, GROUPS, cfg.seed))
        res["pair"] = pair_with_first(payload, rs)
        losses = sorted({s: (lr_, lt) for s, lr_, lt in (e["loss"] for e in every)}.items())
        res["loss"] = sum(v[0] for _, v in losses) / len(losses)
        res["loss_truth"] = sum(v[1] for _, v in losses) / len(losses)
        res["grad_norm"], res["grad_norm_truth"] = a["grad_norm"], b["grad_norm"]
        res["shares"] = run.shares
    return res


FIRST = "oracle_first_correct_run"
"""Engine state (rank 0): the whole gradients of the first correct run these engines measured for a layer, batch and
step, which the runs after it are paired with (`pair_with_first`)."""


def pair_with_first(payload: dict, whole: dict) -> dict:
    """Rank 0: this run's gap to the first correct run (run 0, no planted bug) these engines measured for the same
    layer, batch and step — in case order, the profile's first layout — per group (`rule.pair_gap`: the tolerance a
    test of the two needs). The first correct run's tensors are kept for the runs after it (one set: a later layer
    replaces them); a run with none before it says why."""
    import json

    from ...engine.dist import STATE
    from . import rule_torch

    kn = payload["knobs"]
    same = {"moe": payload["moe"], **{k: v for k, v in kn.items() if k not in ("run", "mistake", "run_name")}}
    ctx = json.dumps(same, sort_keys=True, default=str)
    first = STATE.get(FIRST)
    dev = STATE.get("torch_device", "cpu")
    if first is not None and first["ctx"] == ctx:
        return {"with": first["name"],
                "gaps": {g: rule_torch.pair_gap(whole[g].to(dev), first["whole"][g]).asdict() for g in GROUPS}}
    if kn["mistake"] == "none" and not kn["run"]:  # kept on the device: copied there once, not once a pair
        STATE[FIRST] = {"ctx": ctx, "name": kn["run_name"], "whole": {g: whole[g].to(dev) for g in GROUPS}}
        return {"with": None, "first": True, "reason": "the first correct run: the runs after it are paired with it"}
    return {"with": None, "reason": "no correct run of this layer and batch was measured before it by these engines "
                                    "(a resumed report reuses that run's record; its tensors are not kept)"}


# ---------------------------------------------------------------------------------------------- records, verdict


@dataclass(frozen=True)
class GradientsRecord(Body):
    """One run's step against its fp64 truth: the rule's statistics per group (`<tensor>.<group>`: input, output,
    router, experts; experts also per global expert), the least-squares scale against the truth per group, the bf16
    run's fingerprints, the truth's norm and random projections, the global loss and gradient norm of both, and the
    data-parallel sizes."""

    dp: int
    expert_dp: int
    shares: int
    stats: dict
    scale: dict
    fingerprints: dict
    truth_norm: dict
    truth_sketch: dict
    loss: float
    loss_truth: float
    grad_norm: float
    grad_norm_truth: float
    available: bool = True
    pair: dict = ABSENT
    """The gap to the first correct run (`pair_with_first`): {"with": its name, "gaps": group → rule.Tolerance}, or
    {"with": None, "reason": why there is none}."""

    def asdict(self) -> dict:
        return {"available": self.available, **{k: v for k, v in super().asdict().items() if k != "available"}}


_FIELDS = ("dp", "expert_dp", "shares", "stats", "scale", "fingerprints", "truth_norm", "truth_sketch", "loss",
           "loss_truth", "grad_norm", "grad_norm_truth")


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    r0 = per_rank[0]
    if not r0.get("available"):
        return [Unavailable(r0.get("reason")).asdict()]
    return [GradientsRecord(**{k: r0[k] for k in _FIELDS}, **({"pair": r0["pair"]} if "pair" in r0 else {})).asdict()]


def verdict(records: list[dict]) -> str:
    """Notebook 08's gradient verdict: its findings, rendered."""
    from ...findings import render
    from . import gradients_findings as found

    return render.verdict([f for f in found.findings(records) if f.experiment == NAME])


__all__ = ["cases", "on_engine", "records", "verdict", "not_applicable", "params_of", "run_name", "GROUPS",
           "GradientsRecord", "pair", "watch", "batch_pair", "step", "pieces", "gather0", "whole_state",
           "compare_state", "pair_with_first", "NAME", "NOTEBOOK"]
