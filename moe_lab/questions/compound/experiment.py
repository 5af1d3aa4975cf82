"""Notebook 05 — does it compound? Gradients, stacked layers, and megatron-core's own remedies.

The reporter trains with EP used as DP and says the error "continues to compound on top of this after many layers";
the seed test applies the layer 4 times. Here, with the same tokens on every rank and a fixed loss
L = sum(out[:cut] * R[:cut]) (R seeded, the same on every rank; only the first `cut` tokens enter it, so every
gradient below depends on those tokens alone and must not change when tokens[cut:] are zeroed):

- `backward` cases: per trial a forward+backward of the full input, a rerun, and one of the truncated input; the
  output, the input gradient, the (replicated) router weight gradient — across ranks, reruns and truncation — and
  the expert weight gradients of each rank's own experts (rerun, truncation). Trial 1 also captures the gradient
  reaching every forward stage and a ledger of the backward's collectives: which backward stage first differs.
  Settings: the router dtypes, the reporter's cast, deterministic mode, the lab's batch-invariant remedy, and
  megatron's own options (batch_invariant_mode, routing replay, permute/router fusion) where the release has them.
- `depth` cases: the same layer applied `layers` times (the seed test) and `layers` distinct layers: per layer the
  output and the gradient at its input, across ranks, reruns and truncation.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

import contextlib
import logging

from . import QUESTION
from ... import metrics, stats
from ...config import MEGATRON_OPTIONS
from ...findings.labels import FWD_CMPS, GRAD_CMPS
from ...experiments import protocol
from ...records import Unavailable, parse_comparison
from .record import BackwardRecord, DepthRecord
from ...experiments.protocol import Case
from .findings import grads_agree  # noqa: F401 - one definition, used by tests and callers

logger = logging.getLogger(__name__)

NAME = "compound"
NOTEBOOK = QUESTION.number
FORWARD_GRAD = True  # forward and backward with autograd on, as a training step (records: grad_enabled)
# setting name → (MoEConfig changes, remedy): what 05 measures on the backward, in this order
SETTINGS = {
    "plain": ({}, "none"),
    "router fp32": ({"router_dtype": "fp32"}, "none"),
    "router fp64": ({"router_dtype": "fp64"}, "none"),
    "probs fp32 gather": ({"probs_fp32_gather": True}, "none"),
    "deterministic": ({"deterministic": True}, "none"),
    "ordered_combine+no_splitk": ({"router_dtype": "fp32"}, "ordered_combine+no_splitk"),
    "router fp32 + fp32 grad reduce": ({"router_dtype": "fp32"}, "fp32_grad_reduce"),
    "batch_invariant_mode": ({"router_dtype": "fp32"}, "batch_invariant_mode"),
    "batch_invariant_mode, router fp64": ({"router_dtype": "fp64"}, "batch_invariant_mode"),
    "routing replay": ({"router_dtype": "fp32", "options": ("moe_enable_routing_replay",)}, "routing_replay"),
    "moe_permute_fusion": ({"options": ("moe_permute_fusion",)}, "none"),
    "moe_router_fusion": ({"options": ("moe_router_fusion",)}, "none"),
    # everything at once, for the gradients under truncation: fixed routing, fixed kernels, fixed combine order
    "deterministic + ordered_combine+no_splitk + routing replay": (
        {"router_dtype": "fp32", "deterministic": True, "options": ("moe_enable_routing_replay",)},
        "routing_replay+ordered_combine+no_splitk"),
    "deterministic + ordered_combine+no_splitk + routing replay + fp32 grad reduce": (
        {"router_dtype": "fp32", "deterministic": True, "options": ("moe_enable_routing_replay",)},
        "routing_replay+fp32_grad_reduce+ordered_combine+no_splitk"),
}
GRADS = ("out", "dx", "router_grad")


def cases(config: RunConfig, *, settings=None, depth_settings=None, layers: int | None = None,
          depth_ffn_hidden: int | None = None) -> list[Case]:
    """Backward cases (dispatcher x setting), then depth cases (dispatcher x {same layer x4, `layers` distinct} x
    depth_settings). `depth_ffn_hidden`: a narrower expert for the depth stacks (GPU: `layers` seed-size layers per
    rank would not fit), said in every record. Each keyword left None is the profile's (`params.CompoundParams`)."""
    from .params import CompoundParams

    base, cp = config.layer, config.params(CompoundParams)
    trials, rounds, release = config.run.trials, config.rounds(), config.release
    layers = layers or cp.depth_layers
    depth_ffn = depth_ffn_hidden or cp.depth_ffn_hidden or base.ffn_hidden
    depth_settings = depth_settings or cp.depth_settings
    out = []
    for d in config.run.dispatchers:
        for name in settings or cp.compound_settings or list(SETTINGS):
            if name not in SETTINGS:
                raise ValueError(f"setting ({name!r}) must be one of {', '.join(SETTINGS)}")
            changes, remedy = SETTINGS[name]
            out.append(Case(experiment=NAME, kind="backward", moe=base.replace(dispatcher=d, **changes),
                            cut=config.run.cut, release=release, layout=config.layout, label=f"backward {d} {name}",
                            knobs={"setting": name, "remedy": remedy, "trials": trials, "rounds": rounds}))
    for d in config.run.dispatchers:
        for name in depth_settings:
            if name not in SETTINGS:
                raise ValueError(f"depth setting ({name!r}) must be one of {', '.join(SETTINGS)}")
            changes, remedy = SETTINGS[name]
            for n, distinct in ((4, False), (layers, True)):
                stack = f"{n} distinct layers" if distinct else f"the same layer x{n}"
                out.append(Case(experiment=NAME, kind="depth", cut=config.run.cut, release=release,
                                layout=config.layout,
                                moe=base.replace(dispatcher=d, ffn_hidden=depth_ffn, **changes),
                                label=f"depth {d} {name} {stack}",
                                knobs={"setting": name, "remedy": remedy, "trials": trials, "layers": n,
                                       "distinct": distinct, "stack": stack}))
    return out


not_applicable = protocol.not_applicable_in_release  # a setting the release lacks: a record that says so


# ---------------------------------------------------------------------------------------------- engine side


def on_engine(payload: dict) -> dict:
    from ...engine import toolkit

    try:
        if payload["kind"] == "depth":
            return engine_depth(payload)
        return engine_backward(payload)
    except (ValueError, KeyError, RuntimeError, NotImplementedError, AssertionError, ImportError) as e:
        # an option this machine or release cannot run (no TransformerEngine, no Triton, fp64 in a Triton matmul):
        # a finding, reported as such — every rank fails at the same point, before any collective
        return toolkit.unavailable(e)


def _loss_weights(cfg, device):
    import torch

    from ...engine.layer import generator

    g = generator(device, cfg.seed, "loss")
    return torch.randn((cfg.seq_len, 1, cfg.hidden), generator=g, device=device, dtype=torch.float32)


@contextlib.contextmanager
def remedy_entered(layer, remedy: str, phase: str):
    """The case's remedy for one step, one or several joined by '+': the lab's toggles, megatron's
    batch_invariant_mode, an fp32 gradient reduce, routing replay (recorded on the full input, replayed on the
    truncated one, so every expert GEMM gets the rows it had)."""
    from ...engine import compat
    from ...experiments.remedies import toggles

    parts = remedy.split("+")  # megatron's options and the lab's toggles, entered together
    own = [p for p in parts if p in ("routing_replay", "batch_invariant_mode", "fp32_grad_reduce")]
    lab = "+".join(p for p in parts if p not in own and p != "none")
    with contextlib.ExitStack() as st:
        if "routing_replay" in own:
            st.enter_context(compat.routing_replay(layer, "replay" if phase == "truncated" else "record"))
        if "batch_invariant_mode" in own:
            st.enter_context(compat.batch_invariant_mode())
        if "fp32_grad_reduce" in own:
            st.enter_context(compat.fp32_gather_grad_reduce())
        if lab:
            st.enter_context(toggles(layer, remedy=lab))
        yield


def _step(layers, x, cut: int, R, remedy: str = "none", phase: str = "full", cache=None) -> dict:
    """One forward + backward of the stack on this rank; returns outputs, input gradient, gradients at each layer's
    input and the parameter gradients (the first layer's router and local experts)."""
    import torch

    from ...engine import capture, compat, toolkit
    from ...experiments.remedies import probs_fp32_before_gather

    cfg = layers[0].config
    for lyr in layers:
        for p in lyr.parameters():
            p.grad = None
    x = x.detach().clone().requires_grad_(True)
    with contextlib.ExitStack() as st:
        st.enter_context(torch.enable_grad())
        for lyr in layers:
            st.enter_context(probs_fp32_before_gather(lyr, getattr(lyr, "_moe_lab_pf32", False)))
        if cache is not None:  # trial 1: every stage's gradient and the backward's collectives (first layer)
            st.enter_context(capture.capture_hooks(layers[0], cache))
        if remedy != "none":
            if len(layers) > 1:
                raise ValueError("a remedy applies to a single-layer case")
            st.enter_context(remedy_entered(layers[0], remedy, phase))
        h, hs = x, []
        for lyr in layers:
            h = compat.moe_output(lyr(h))
            h.retain_grad()
            hs.append(h)
        loss = (h[:cut].float() * R[:cut]).sum()
        if cache is not None:
            with cache.in_stage("backward"), capture.collective_ledger(cache, hidden=cfg.hidden_size,
                                                                      num_experts=cfg.num_moe_experts):
                loss.backward()
        else:
            loss.backward()
    toolkit.sync()
    first = layers[0]
    return {"outs": [t.detach() for t in hs], "dx": x.grad.detach(),
            "inputs_grad": [x.grad.detach()] + [t.grad.detach() for t in hs[:-1]],
            "router_grad": first.router.weight.grad.detach(),
            "experts": {n: p.grad.detach() for n, p in first.named_parameters()
                        if "local_experts" in n and p.grad is not None}}


def _drop_grads(layers) -> None:
    """Let go of the stack's parameter gradients: a layer kept in the engine's cache would otherwise hold one set of
    gradients (as many bytes as its weights) into the next step or case."""
    for lyr in layers:
        for p in lyr.parameters():
            p.grad = None


def _timed_step(layers, x, cut: int, R, remedy: str = "none") -> None:
    """A cost round's forward + backward: `_step`, then its gradients dropped, so the case's and the plain layer's
    rounds never hold two sets of gradients at once (the seed layer's are 4 GiB per rank at EP 4)."""
    _step(layers, x, cut, R, remedy, "full")
    _drop_grads(layers)


def _compare_grads(a: dict, b: dict) -> dict:
    """Worst of this rank's expert weight gradients, a vs b (both on this rank: compared in place, no fingerprints;
    `metrics.compare` measures only the differing elements)."""
    return metrics.worst([metrics.compare(g, b[n]) for n, g in a.items()])


def engine_backward(payload: dict) -> dict:
    """Engine side of a backward case: `trials` trials of (full, rerun, truncated) forward+backward steps."""
    import torch.distributed as tdist

    from ...engine import capture, toolkit
    from ..localise import experiment as localise

    kn, cut = payload["knobs"], payload["cut"]
    s = toolkit.setup(payload["moe"], payload.get("layout"))
    layer = s.layer
    layer._moe_lab_pf32 = s.cfg.probs_fp32_gather
    R = _loss_weights(s.cfg, s.device)
    trunc = s.truncated(cut)
    remedy = kn.get("remedy", "none")
    with toolkit.deterministic(s.cfg.deterministic):
        trials, cross, back = [], [], None
        for t in range(kn.get("trials", 1)):
            cache = capture.Cache(want_grads=True) if t == 0 else None
            A = _step([layer], s.tokens, cut, R, remedy, "full", cache)
            a = {"out": A["outs"][-1], "dx": A["dx"], "router_grad": A["router_grad"]}
            B = _step([layer], s.tokens, cut, R, remedy, "rerun")  # compared at once: one set of gradients at a time
            t_ = {"rerun": {k: metrics.compare(a[k], v) for k, v in
                            (("out", B["outs"][-1]), ("dx", B["dx"]), ("router_grad", B["router_grad"]))},
                  "experts_rerun": _compare_grads(A["experts"], B["experts"])}
            del B
            C = _step([layer], trunc, cut, R, remedy, "truncated")
            t_["truncation"] = {k: metrics.compare(a[k][:cut] if k != "router_grad" else a[k], v) for k, v in
                                (("out", C["outs"][-1][:cut]), ("dx", C["dx"][:cut]), ("router_grad", C["router_grad"]))}
            t_["experts_truncation"] = _compare_grads(A["experts"], C["experts"])
            del C
            trials.append(t_)
            cross.append(toolkit.compare_across_ranks(a))
            if cache is not None:  # cache.grads is in backward order: the output's gradient first
                back = localise.compare_stages(cache.grads, lambda n: localise.grad_kind(n, s.cfg.dispatcher),
                                               localise.tokens_per_expert(cache))
                back["ledger"] = [c_ for c_ in cache.ledger if c_["stage"] == "backward"]
            del A, a
        _drop_grads([layer])  # the last step's gradients stay on the parameters otherwise, through the rounds
        res = {"rank": tdist.get_rank(), "available": True, "trials": trials, "backward": back}
        if cross[0] is not None:
            res["cross"] = [{k: _pairs_worst(cr[k]) for k in GRADS} for cr in cross]
        rounds = kn.get("rounds", 0)
        if rounds:
            plain = toolkit.setup({**payload["moe"], "router_dtype": "none", "probs_fp32_gather": False,
                                   "deterministic": False, "options": ()}, payload.get("layout"))
            # the case's layer again (the cache may have reordered)
            layer = toolkit.setup(payload["moe"], payload.get("layout")).layer
            times = toolkit.paired_rounds({"case": lambda: _timed_step([layer], s.tokens, cut, R, remedy),
                                           "plain": lambda: _timed_step([plain.layer], plain.tokens, cut, R)}, rounds)
            res["times"] = times
            import torch

            from ... import provenance

            res["env"] = {**provenance.numerics_env(),  # what the timed steps ran under (inside the case's mode)
                          "deterministic_algorithms": torch.are_deterministic_algorithms_enabled()}
    return res


def _pairs_worst(entry: dict) -> dict:
    if not entry.get("applicable", True):
        return {"applicable": False, "reason": entry["reason"]}
    return metrics.worst(list(entry["pairs"].values()))


def engine_depth(payload: dict) -> dict:
    """Engine side of a depth case: per trial (full, rerun, truncated) forward+backward through the stack; per layer
    its output and the gradient at its input, compared across ranks, reruns and truncation."""
    import torch.distributed as tdist

    from ...engine import layer as layer_mod, toolkit

    kn, cut = payload["knobs"], payload["cut"]
    s = toolkit.setup(payload["moe"], payload.get("layout"))
    stack = layer_mod.get_stack(s.cfg, s.layout, kn["layers"], distinct=kn["distinct"])
    for lyr in stack:
        lyr._moe_lab_pf32 = s.cfg.probs_fp32_gather
    R = _loss_weights(s.cfg, s.device)
    trunc = s.truncated(cut)
    per_trial, cross = [], []
    with toolkit.deterministic(s.cfg.deterministic):
        for _ in range(kn.get("trials", 1)):
            A = _step(stack, s.tokens, cut, R)
            B = _step(stack, s.tokens, cut, R)
            C = _step(stack, trunc, cut, R)
            layers = []
            for i in range(len(stack)):
                layers.append({
                    "rerun_out": metrics.compare(A["outs"][i], B["outs"][i]),
                    "truncation_out": metrics.compare(A["outs"][i][:cut], C["outs"][i][:cut]),
                    "rerun_grad": metrics.compare(A["inputs_grad"][i], B["inputs_grad"][i]),
                    "truncation_grad": metrics.compare(A["inputs_grad"][i][:cut], C["inputs_grad"][i][:cut]),
                    "abs_out": float(A["outs"][i].float().abs().mean())})
            per_trial.append(layers)
            names = {f"out{i}": A["outs"][i] for i in range(len(stack))}
            names.update({f"grad{i}": A["inputs_grad"][i] for i in range(len(stack))})
            cross.append(toolkit.compare_across_ranks(names))
            del A, B, C
    _drop_grads(stack)
    res = {"rank": tdist.get_rank(), "available": True, "trials": per_trial}
    if cross[0] is not None:
        res["cross"] = [{k: _pairs_worst(v) for k, v in cr.items() if k != "bytes_compared"} for cr in cross]
    return res


# ---------------------------------------------------------------------------------------------- controller side


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    r0 = per_rank[0]
    if not r0.get("available", True):
        return [Unavailable(r0["reason"]).asdict()]
    if case.kind == "depth":
        return _depth_records(case, per_rank)
    n = len(r0["trials"])
    rec: dict = {"available": True}
    for k in GRADS:
        rec[f"rerun_{k}"] = metrics.over_trials([metrics.worst([r["trials"][t]["rerun"][k] for r in per_rank])
                                                 for t in range(n)])
        rec[f"truncation_{k}"] = metrics.over_trials(
            [metrics.worst([r["trials"][t]["truncation"][k] for r in per_rank]) for t in range(n)])
        rec[f"cross_{k}"] = metrics.over_trials([c[k] for c in r0["cross"]]) if "cross" in r0 else \
            {"applicable": False, "reason": "world size 1: there is no other rank to compare with", "trials": n}
    for k in ("experts_rerun", "experts_truncation"):
        rec[k] = metrics.over_trials([metrics.worst([r["trials"][t][k] for r in per_rank]) for t in range(n)])
    if r0.get("backward"):
        from ..localise import experiment as localise

        rows = localise.stage_rows([r["backward"] for r in per_rank])
        rec["backward_first_divergent"] = localise.first_divergent(rows)
        rec["backward_stages"] = [{k: x.get(k) for k in ("stage", "order", "stage_kind", "unit", "dtype", "n_mismatch",
                                                         "mismatch_frac", "bitwise_equal", "max_ulp")} for x in rows]
        rec["backward_ledger"] = r0["backward"]["ledger"]
    if "times" in r0:
        rec["cost"] = stats.paired_cost([r["times"] for r in per_rank], "case", "plain",
                                        environment={**r0.get("env", {}), "remedy": case.knobs.get("remedy", "none")})
    return [BackwardRecord(**{k: parse_comparison(v) if k in BackwardRecord.COMPARISONS else v
                              for k, v in rec.items()}).asdict()]


def _depth_records(case: Case, per_rank: list[dict]) -> list[dict]:
    """One record per layer of the stack (layer = 1 is the first), comparisons worst over ranks, then trials."""
    r0 = per_rank[0]
    n, L = len(r0["trials"]), len(r0["trials"][0])
    out = []
    for i in range(L):
        rec = {"layer": i + 1, "abs_out": r0["trials"][0][i]["abs_out"]}
        for k in ("rerun_out", "truncation_out", "rerun_grad", "truncation_grad"):
            rec[k] = metrics.over_trials([metrics.worst([r["trials"][t][i][k] for r in per_rank]) for t in range(n)])
        for k, name in (("cross_out", f"out{i}"), ("cross_grad", f"grad{i}")):
            rec[k] = (metrics.over_trials([c[name] for c in r0["cross"]]) if "cross" in r0 else
                      {"applicable": False, "reason": "world size 1", "trials": n})
        out.append(DepthRecord(**{k: parse_comparison(v) if k in DepthRecord.COMPARISONS else v
                                  for k, v in rec.items()}).asdict())
    return out





# ---------------------------------------------------------------------------------------------- verdict

def verdict(records: list[dict]) -> str:
    """Notebook 05's verdict: its findings (moe_lab.questions.compound.findings: gradient fractions over the loss's tokens)."""
    from . import findings as found
    from ...findings import render

    back = [r for r in records if r.get("kind") in ("backward", "depth")]
    r0 = back[0] if back else None
    title = (f"megatron-core {r0['megatron_core']}, {r0['world']} EP rank(s) on {r0.get('gpu') or r0['device']} "
             f"({r0.get('placement', '')}); loss = sum(out[:{r0['cut']}] * R), {r0.get('trials', 1)} trial(s):"
             if r0 else "")
    return render.verdict(found.findings(records), title=title)


__all__ = ["cases", "on_engine", "records", "not_applicable", "verdict", "grads_agree", "SETTINGS", "MEGATRON_OPTIONS",
           "GRAD_CMPS", "FWD_CMPS"]
