"""Notebook 06 — does it matter for training? The same stack of MoE layers, the same global initial weights and the
same global batch per step, trained for K steps at EP = 1, 2, 4 (the rest of the world data parallel) and at the
profile's TP x EP / ETP layouts (sequence parallel), each layout run twice, with and without deterministic mode; and
the remedies, each at every layout.

Every run is one case (its layout on the case, stamped on its record); the engine runs K steps of
`engine.train.Trainer` (megatron's DP gradient arithmetic and optimizer semantics: bf16 params, fp32 main weights,
AdamW, global-norm clipping) and returns per step the global loss (its bits), the gradient norm, the weights'
fingerprint, norm and random-projection sketch, and per layer the top-k experts and the top-k boundary margin of
every token. What one run says against another (first differing step, relative loss difference, weight divergence,
routing flips) is computed from two records by `questions.training.findings`: records are compared across cases, never on the
engines.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

import base64
import contextlib
import logging
import zlib

from . import QUESTION
from ... import stats
from .params import TrainParams
from .findings import layout_of
from ...layout import Layout
from ...experiments import protocol
from ...records import Unavailable
from .record import TrainingRecord
from ...experiments.protocol import Case

logger = logging.getLogger(__name__)

NAME = "training"
NOTEBOOK = QUESTION.number
# setting name → (MoEConfig changes, remedy): a remedy is compound's remedy string ('+'-joined; fp32_grad_reduce
# here is also megatron DDP's grad_reduce_in_fp32 for the data-parallel reduce)
SETTINGS = {
    "plain": ({}, "none"),
    "router fp32": ({"router_dtype": "fp32"}, "none"),
    "router fp64": ({"router_dtype": "fp64"}, "none"),
    "fp32 grad reduce": ({}, "fp32_grad_reduce"),
    "router fp32 + fp32 grad reduce": ({"router_dtype": "fp32"}, "fp32_grad_reduce"),
    "ordered combine": ({}, "ordered_combine"),
    "router fp32 + fp32 grad reduce + ordered combine": ({"router_dtype": "fp32"}, "fp32_grad_reduce+ordered_combine"),
    # every layout routes each token of step t to the experts the reference layout's run chose (megatron's router
    # replay, fed from the reference record): `replay_cases`, after the reference has run
    "routing replay": ({"options": ("moe_enable_routing_replay",)}, "none"),
}
REPLAY = "routing replay"
REFERENCE = "plain"


def params_of(config: RunConfig) -> TrainParams:
    return config.params(TrainParams)


def layouts_of(tp: TrainParams) -> list[Layout]:
    """The layouts compared, the reference first: EP = each of `eps` (TP 1), then each of `layouts`."""
    return [Layout(ep=e) for e in tp.eps] + [Layout.parse(s) for s in tp.layouts]


def cases(config: RunConfig, *, precision: str = "bf16", mistake: str = "none") -> list[Case]:
    """Plain: the first stack x deterministic x layout x `reruns` runs, the other stacks in the last-listed mode x
    layout x `deep_reruns` runs; each other setting: the first stack, the last-listed mode, every layout, one run.
    `precision` ('fp64': the arithmetic test) and `mistake` (the tests' controls, engine.train.MISTAKES) are for the
    tests; both are in every record and its key."""
    from ...controller.placement import from_settings

    tp = params_of(config)
    bad = [s for s in tp.settings if s not in SETTINGS]
    if bad:
        raise ValueError(f"training.settings ({bad!r}) must be among {', '.join(SETTINGS)}")
    if REFERENCE not in tp.settings:
        raise ValueError(f"training.settings ({list(tp.settings)!r}) must include {REFERENCE!r} (the reference)")
    over = {k: getattr(tp, k) for k in ("hidden", "num_experts", "topk", "ffn_hidden") if getattr(tp, k)}
    base = config.moe(dispatcher=tp.dispatcher, **over)
    world = from_settings(config.cluster).engines
    release = config.release
    lays = layouts_of(tp)
    for lay in lays:
        lay.check(world, base.num_experts)
        lay.check_layer(base)  # (TP > 1 without sequence parallelism: TrainParams refuses it)
    if tp.tokens % world:
        raise ValueError(f"training.tokens ({tp.tokens}) must be divisible by the world ({world} ranks: each rank "
                         "feeds one share, data-parallel x tensor-parallel)")
    common = {"steps": tp.steps, "tokens": tp.tokens, "lr": tp.lr, "precision": precision,
              "mistake": mistake, "reference_layout": lays[0].spec()}
    out = []
    for name in tp.settings:
        changes, remedy = SETTINGS[name]
        stacks = tp.stacks if name == REFERENCE else tp.stacks[:1]
        dets = tp.deterministic if name == REFERENCE else tp.deterministic[-1:]
        for si, layers in enumerate(stacks):
            runs = range(1) if name != REFERENCE else range(tp.reruns if si == 0 else tp.deep_reruns)
            for det in (dets if si == 0 else dets[-1:]):
                for lay in (lays[:1] if name == REPLAY else lays):  # replay's other layouts: replay_cases
                    for run in runs:
                        # timed: each remedy against the plain step (same mode), and deterministic mode alone (the
                        # first stack's plain det run) against the plain step without it; at the largest EP, run 0
                        det_alone = name == REFERENCE and si == 0 and det and len(dets) > 1
                        timed = ((name != REFERENCE or det_alone) and lay.spec() == f"ep{max(tp.eps)}" and run == 0
                                 and tp.cost_rounds > 0)
                        out.append(Case(
                            experiment=NAME, kind="train", moe=base.replace(deterministic=det, **changes),
                            cut=config.run.cut,
                            release=release, layout=lay, deterministic_env=det,
                            label=f"{name}, {layers} layer(s), {lay.spec()}, {'det' if det else 'nondet'}, run {run}",
                            knobs={**common, "setting": name, "remedy": remedy, "layers": layers, "run": run,
                                   "rounds": tp.cost_rounds if timed else 0,
                                   "baseline_deterministic": det and not det_alone}))
    return out


not_applicable = protocol.not_applicable_in_release


def replay_cases(config: RunConfig, records: list[dict]) -> list[Case]:
    """The routing-replay runs of the other layouts, each fed the reference layout's routing (its record's packed
    top-k per layer and step, in the knob `replay`); [] when the profile does not list the setting or its reference
    run is missing or was not available."""
    tp = params_of(config)
    if REPLAY not in tp.settings:
        return []
    lays = layouts_of(tp)
    base = [c for c in cases(config) if c.knobs["setting"] == REPLAY][0]
    ref = next((r for r in records if r.get("kind") == "train" and r.get("setting") == REPLAY
                and r.get("available") and r.get("case_key") and layout_of(r) == lays[0].spec()), None)
    if ref is None:
        return []
    out = []
    for lay in lays[1:]:
        out.append(Case(experiment=NAME, kind="train", moe=base.moe, release=base.release, layout=lay,
                        cut=base.cut, deterministic_env=base.deterministic_env,
                        label=base.label.replace(f", {lays[0].spec()},", f", {lay.spec()},"),
                        knobs={**base.knobs, "replay": [[s["topk"] for s in per] for per in ref["routing"]],
                               "replay_of": ref["case_key"]}))
    return out


# ---------------------------------------------------------------------------------------------- engine side


def _pack(t, dtype) -> str:
    """A tensor's bytes as zlib + base64 text (records stay JSON; findings unpack with `array`, no torch)."""
    return base64.b64encode(zlib.compress(t.contiguous().numpy().astype(dtype).tobytes(), 6)).decode()


def _unpack(text: str, k: int):
    """A packed top-k (uint8) → [tokens, k] int64 indices."""
    import numpy as np
    import torch

    raw = np.frombuffer(zlib.decompress(base64.b64decode(text)), dtype=np.uint8)
    return torch.from_numpy(raw.astype(np.int64)).reshape(-1, k)


@contextlib.contextmanager
def _setting(stack, remedy: str):
    """The case's remedy for the block (compound's: '+'-joined; megatron's options and the lab's toggles patch
    module attributes, so entering them once, with the first layer, covers the whole stack)."""
    from ..compound.experiment import remedy_entered

    with (remedy_entered(stack[0], remedy, "full") if remedy != "none" else contextlib.nullcontext()):
        yield


def on_engine(payload: dict) -> dict:
    from ...engine import toolkit

    try:
        return engine_train(payload)
    except (ValueError, KeyError, RuntimeError, NotImplementedError, ImportError) as e:
        return toolkit.unavailable(e)


def engine_train(payload: dict) -> dict:
    """K steps of the case's stack at its layout; every rank's per-step results gathered to rank 0 once, at the end."""
    import torch
    import torch.distributed as tdist

    from ...config import MoEConfig
    from ...engine import compat, toolkit, train
    from ...engine.dist import STATE

    kn, lay = payload["knobs"], Layout(**payload["layout"])
    cfg = MoEConfig(**payload["moe"])
    remedy = kn["remedy"]
    fp32_reduce = "fp32_grad_reduce" in remedy.split("+")
    stack = train.build_stack(cfg, kn["layers"], layout=lay, precision=kn["precision"])
    tr = train.Trainer(stack, optim=train.Optim(lr=kn["lr"]), grad_reduce_fp32=fp32_reduce,
                       mistake=kn.get("mistake", "none"))
    dtype = train.PRECISIONS[kn["precision"]]
    dev = STATE["torch_device"]
    sink: list[list] = [[] for _ in stack]
    steps, weights = [], [tr.weights(cfg.seed)]
    replay = kn.get("replay")
    with contextlib.ExitStack() as st:
        st.enter_context(toolkit.deterministic(cfg.deterministic))
        st.enter_context(_setting(stack, remedy))
        st.enter_context(train.routing(stack, sink))
        targets = st.enter_context(compat.replay_targets(stack)) if replay else None
        for t in range(kn["steps"]):
            x, y = train.batch(cfg, t, kn["tokens"], dtype, dev)
            if targets is not None:  # this rank's tokens of step t: the reference run's top-k experts
                k = stack[0].config.moe_router_topk
                targets([tr.my_share(_unpack(per[t], k)).to(dev) for per in replay])
            steps.append(tr.step(tr.my_share(x), tr.my_share(y)))
            weights.append(tr.weights(cfg.seed))
    mine = {"share": tr.share, "steps": steps, "weights": weights,
            "routing": [[(idx, m) for idx, m in per_layer] for per_layer in sink]}
    every: list = [None] * tdist.get_world_size()
    tdist.all_gather_object(every, mine)
    res: dict = {"rank": tdist.get_rank(), "available": True, "dp": tr.dp,
                 "expert_dp": tdist.get_world_size(tr.expert_group)}
    if tdist.get_rank() == 0:
        res.update(_assemble(every, kn, stack[0].config.moe_router_topk))
    rounds = kn.get("rounds", 0)
    if rounds:
        res["times"], res["env"] = _time(cfg, kn, lay, tr, stack, remedy, rounds, dtype, dev)
    return res


def _assemble(every: list[dict], kn: dict, k: int) -> dict:
    import torch

    from ...engine import train

    first = sorted(every, key=lambda e: e["share"])  # one per share of the global batch (DP x TP of them)
    n = len(first)
    K = kn["steps"]
    loss, loss_hex = [], []
    for t in range(K):
        v = 0.0
        for e in first:  # the mean of the shares' local means (equal shares), summed in share order, in fp64: the
            # same sum at every layout of the same world
            v += e["steps"][t]["loss"]
        v /= n
        loss.append(v)
        loss_hex.append(v.hex())
    w = [train.combine_weights([e["weights"][t] for e in every]) for t in range(K + 1)]
    routing = []
    for li in range(len(first[0]["routing"])):
        per_step = []
        for t in range(K):
            idx = torch.cat([e["routing"][li][t][0] for e in first])
            mar = torch.cat([e["routing"][li][t][1] for e in first])
            per_step.append({"topk": _pack(idx, "uint8"), "margin": _pack(mar, "float32")})
        routing.append(per_step)
    return {"loss": loss, "loss_hex": loss_hex, "grad_norm": [s["grad_norm"] for s in every[0]["steps"]],
            "weights_fp": [x["fingerprint"] for x in w], "weights_norm": [x["norm"] for x in w],
            "weights_sketch": [x["sketch"] for x in w], "weights_tensors": w[0]["tensors"], "routing": routing,
            "topk": k, "shares": n}


def _time(cfg, kn, lay, tr, stack, remedy, rounds, dtype, dev):
    """Paired rounds (rotating order): one step of the case's setting in its mode, one of the plain setting (same
    layout; deterministic as `baseline_deterministic` says) and that plain step again (the A/A noise floor)."""
    import torch

    from ... import provenance
    from ...engine import toolkit, train

    plain_cfg = cfg.replace(router_dtype="none", options=())
    plain = train.Trainer(train.build_stack(plain_cfg, kn["layers"], layout=lay, precision=kn["precision"]),
                          optim=train.Optim(lr=kn["lr"]))
    x, y = train.batch(cfg, kn["steps"], kn["tokens"], dtype, dev)
    xs, ys = tr.my_share(x), tr.my_share(y)

    base_det = kn.get("baseline_deterministic", cfg.deterministic)

    def case_step():
        with toolkit.deterministic(cfg.deterministic), _setting(stack, remedy):
            tr.step(xs, ys)

    def plain_step():
        with toolkit.deterministic(base_det):
            plain.step(xs, ys)

    # "again": the plain step a second time, its A/A noise floor
    times = toolkit.paired_rounds({"case": case_step, "plain": plain_step, "again": plain_step}, rounds, rotate=True)
    with toolkit.deterministic(cfg.deterministic):
        env = {**provenance.numerics_env(), "deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
               "baseline_deterministic": base_det}
    return times, env


# ---------------------------------------------------------------------------------------------- records, verdict

_PER_CASE = ("loss", "loss_hex", "grad_norm", "weights_fp", "weights_norm", "weights_sketch", "weights_tensors",
             "routing", "topk", "shares")


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    """One record per run: its per-step series (rank 0's assembly of every rank), DP sizes, and the cost."""
    r0 = per_rank[0]
    if not r0.get("available"):
        return [Unavailable(r0.get("reason")).asdict()]
    rec = {"dp": r0["dp"], "expert_dp": r0["expert_dp"], **{k: r0[k] for k in _PER_CASE}}
    if "times" in r0:
        times = [r["times"] for r in per_rank]
        rec["cost"] = stats.paired_cost(times, "case", "plain",
                                        environment={**r0.get("env", {}), "remedy": case.knobs.get("remedy", "none")})
        rec["floor"] = stats.paired_cost(times, "again", "plain")
    return [TrainingRecord(**rec).asdict()]


def verdict(records: list[dict]) -> str:
    """Notebook 06's verdict: its findings (moe_lab.questions.training.findings), rendered."""
    from ...findings import render
    from . import findings as found

    tr = [r for r in records if r.get("kind") == "train"]
    r0 = tr[0] if tr else None
    title = (f"megatron-core {r0['megatron_core']}, {r0['world']} rank(s) on {r0.get('gpu') or r0['device']}; "
             f"{r0.get('steps')} steps of {r0.get('tokens')} tokens, MSE loss, AdamW (bf16 params, fp32 main "
             f"weights), layouts {', '.join(dict.fromkeys(layout_of(r) for r in tr))}:" if r0 else "")
    return render.verdict(found.findings(records), title=title)


__all__ = ["cases", "replay_cases", "REPLAY", "on_engine", "records", "verdict", "not_applicable", "SETTINGS",
           "REFERENCE", "params_of", "layouts_of"]
