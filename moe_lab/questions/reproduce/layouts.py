"""Notebook 01, second question: the same global weights and tokens under another parallel layout — do
the bits change? Each case is one layout (EP=1, EP=4, TP=2 x EP=2, ETP=1, sequence parallel, ...) of the same layer;
every rank compares its whole output, and the router's stages, with the reference layout's (EP=1 by default) on the
same rank — element by element, no tolerance.

Why it can differ: the weights are a function of (seed, global expert, tensor) alone (`engine.layer.init_weights`),
so only the arithmetic's order changes with the layout — which rank sums a token's k expert outputs, whether the
combine reduce-scatters over EP or TP x EP, whether an expert's GEMM is split over ETP (fc2's partial products summed
in the probs dtype by the dispatcher's reduce-scatter), the order of a TP all-reduce.

Per case and rank the engine computes the reference layout's output once (kept in the engine between cases of the
same layer; recomputed after a restart or a resume), then `trials` forwards of the case's layout: each against the
reference (`vs_reference`), against the layout's own first forward (`rerun`: run-to-run), and across ranks
(`cross_rank`); and once with autograd on, as a training step's forward (`grad_vs_nograd`: megatron-core 0.18+
sorts the top-k only when grad is enabled, so the two can differ). The first stage that differs from the reference among router.logits → router.probs →
router.routing_map → the output says whether the routing itself moved. Which stages are compared (`STAGES`) holds
for every layout: the router's stages are per token and replicated over EP and TP, gathered over TP under sequence
parallelism; intermediate stages change shape with the layout and are not compared.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from . import QUESTION
from ... import metrics
from ...config import MoEConfig
from ...layout import Layout
from .params import LayoutParams
from ...records import NotCompared, parse_comparison
from .layouts_record import LayoutRecord
from ...experiments.protocol import Case

NAME = "layouts"
REFERENCES_KEPT = 8
"""Reference outputs an engine keeps (one per layer: dispatcher, router dtype, deterministic mode). The runner
measures a layout's cases together (`protocol.layout_major`), so every layer's reference is needed again at the next
layout; one not kept is a switch to the reference layout and back."""
NOTEBOOK = QUESTION.number
STAGES = ("router.logits", "router.probs", "router.routing_map", "out")


def case(base: MoEConfig, layout: str, *, reference: str = LayoutParams.layout_reference, trials: int = 1,
         cut: int = 90, release: str = "installed", deterministic_env: bool = False) -> Case:
    """One layout of `base` against `reference` (both with `base`'s deterministic mode; `deterministic_env`: the
    engines start with NCCL_ALGO=Ring and CUBLAS_WORKSPACE_CONFIG=:4096:8, as on GPUs)."""
    lay, ref = Layout.parse(layout), Layout.parse(reference)
    if not isinstance(trials, int) or isinstance(trials, bool) or trials < 1:
        raise ValueError(f"trials ({trials!r}) must be an integer >= 1")
    return Case(experiment=NAME, moe=base, layout=lay, cut=cut, kind="layout", release=release,
                deterministic_env=deterministic_env,
                knobs=dict(layout_spec=layout, reference_spec=reference, trials=trials),
                label=f"{base.dispatcher}/{base.router_dtype}{' det' if base.deterministic else ''} {lay.label()}")


def cases(config: RunConfig) -> list[Case]:
    """Every layout of `layouts` (the reference first) for each dispatcher x router dtype x deterministic mode of the
    profile (`LayoutParams`); a layout the world or the layer cannot take is refused before anything starts (one line,
    its rule). With deterministic mode on, a GPU's reference repeats itself, so a layout's difference is the layout's
    and not run-to-run nondeterminism."""
    from ...controller.placement import from_settings

    base, lp = config.layer, config.params(LayoutParams)
    world = from_settings(config.cluster).engines
    order, reference = lp.order(), lp.layout_reference
    for spec in order:
        lay = Layout.parse(spec)
        try:
            lay.on(world).check_layer(base)
        except ValueError as e:
            raise ValueError(f"layouts entry {spec!r} on {world} ranks: {e}") from None
    gpu = config.gpu
    return [case(base.replace(dispatcher=d, router_dtype=r, deterministic=det), spec, reference=reference,
                 trials=config.run.trials, cut=config.run.cut, release=config.release,
                 deterministic_env=det and gpu)
            for det in lp.layout_deterministic for d in config.run.dispatchers for r in lp.layout_router_dtypes
            for spec in order]


# ---------------------------------------------------------------------------------------------- engine side


def _forward_stages(cfg_dict: dict, layout):
    """One captured forward of the layer for `cfg_dict` split as `layout` on this rank: {stage: whole tensor}
    (gathered over TP under sequence parallelism), as `STAGES` names them."""
    from ...engine import capture, toolkit

    s = toolkit.setup(cfg_dict, layout)
    out, cache = capture.run_with_capture(s.layer, s.tokens, ("router",), hidden=s.cfg.hidden,
                                          num_experts=s.cfg.num_experts)
    stages = {k: toolkit.gather_sequence(s.layer, cache.tensors[k]) for k in STAGES[:-1] if k in cache.tensors}
    stages["out"] = out
    return stages


def on_engine(payload: dict) -> dict:
    from ...engine import toolkit
    from ...engine.dist import case_cache

    kn, moe = payload["knobs"], payload["moe"]
    reference = Layout.parse(kn["reference_spec"])
    ref_moe = {**moe, "seed": kn.get("reference_seed", moe["seed"])}  # another seed: the tests' control only
    ref_key = repr((sorted(ref_moe.items()), reference))
    refs = case_cache("layout_references")
    if ref_key not in refs:  # once per reference layer on this engine (dropped on a restart and by release_caches)
        while len(refs) >= REFERENCES_KEPT:
            refs.pop(next(iter(refs)))
        with toolkit.deterministic(moe["deterministic"]):
            refs[ref_key] = {k: v.clone() for k, v in _forward_stages(ref_moe, reference).items()}
    ref = refs[ref_key]
    trials, outs = [], []
    with toolkit.deterministic(moe["deterministic"]):
        for _ in range(kn.get("trials", 1)):
            st = _forward_stages(moe, payload.get("layout"))
            t = {"vs_reference": metrics.compare(st["out"], ref["out"]),
                 "stages": {k: _cmp_stage(st.get(k), ref.get(k)) for k in STAGES}}
            t["rerun"] = metrics.compare(st["out"], outs[0]) if outs else metrics.identical(st["out"])
            outs.append(st["out"])
            trials.append(t)
        # a training step's forward: grad enabled (0.18+ sorts the top-k then)
        s = toolkit.setup(moe, payload.get("layout"))
        grad = toolkit.forward(s.layer, s.tokens, grad=True)
    cross = [toolkit.compare_across_ranks({"out": o}) for o in outs]
    res = {"rank": toolkit.tdist.get_rank(), "trials": trials, "grad_vs_nograd": metrics.compare(grad, outs[0])}
    if cross[0] is not None:
        res["cross_rank"] = [metrics.worst(list(c["out"]["pairs"].values())) if c["out"].get("applicable", True)
                             else c["out"] for c in cross]
    return res


def _cmp_stage(a, b) -> dict:
    if a is None or b is None:
        return NotCompared("not captured in this release").asdict()
    if a.dtype == b.dtype and a.shape == b.shape:
        return metrics.compare(a, b) if a.is_floating_point() else _cmp_exact(a, b)
    return NotCompared(f"{tuple(a.shape)} {a.dtype} vs {tuple(b.shape)} {b.dtype}").asdict()


def _cmp_exact(a, b) -> dict:
    """A bool / integer stage (the routing map): how many entries differ."""
    return metrics.compare_exact(a, b, measured=False)


# ---------------------------------------------------------------------------------------------- controller side


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    n = len(per_rank[0]["trials"])
    per_trial = lambda name: [metrics.worst([r["trials"][t][name] for r in per_rank]) for t in range(n)]  # noqa: E731
    stages = {k: metrics.over_trials([metrics.worst([r["trials"][t]["stages"][k] for r in per_rank])
                                      for t in range(n)]) for k in STAGES}
    first = next((k for k in STAGES if stages[k].get("applicable", True) and stages[k].get("n_differ")), None)
    lay, ref = Layout.parse(case.knobs["layout_spec"]), Layout.parse(case.knobs["reference_spec"])
    return [LayoutRecord(
        layout=lay.label(), reference_layout=ref.label(), is_reference=lay == ref, etp=lay.expert_tp,
        sequence_parallel=lay.sequence_parallel,
        vs_reference=parse_comparison(metrics.over_trials(per_trial("vs_reference"))),
        rerun=parse_comparison(metrics.over_trials(per_trial("rerun"))),
        cross_rank=parse_comparison(metrics.over_trials(per_rank[0].get("cross_rank")
                                                        or [NotCompared("one rank").asdict()])),
        stages_vs_reference={k: parse_comparison(v) for k, v in stages.items()}, first_divergent_stage=first,
        grad_vs_nograd=parse_comparison(metrics.worst([r["grad_vs_nograd"] for r in per_rank]))).asdict()]


def verdict(records: list[dict]) -> str:
    from . import layouts_findings as found
    from ...findings import render

    return render.verdict(found.findings(records), title="Same weights and tokens, another layout:")


__all__ = ["cases", "case", "on_engine", "records", "verdict", "STAGES"]
