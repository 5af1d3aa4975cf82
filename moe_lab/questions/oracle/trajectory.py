"""Notebook 08, training: the first K training steps of notebook 06's layouts against an fp64 trajectory from the same
weights and batches.

Each case is one run (a layout, a rerun of it, or a layout carrying a planted bug): the bf16 stack (with the case's
mistake) and an fp64 stack from the SAME bf16 weights upcast (never with a mistake) each train K steps of
`engine.train.Trainer` on the same global batches (bf16 tokens and fp32 targets, upcast for the truth). The truth is
the fp64 run's own trajectory — each of its steps starts from its own weights, never re-synced to the bf16 run's — so
at step t the bf16 run's distance to it is what K steps of bf16 arithmetic accumulate, not one step's rounding.

After every step rank 0 compares, with the rule's per-group statistics (`rule.error_stats`), the step's forward
output (`output.all`), the main gradients after the reduce and before clipping (`grad.router.all`, `grad.experts.all`)
and the fp32 main weights after the step (`weights.router.all`, `weights.experts.all`) with the truth's, each tensor
whole (one step's gradients are compared expert by expert in `gradients`);
and records both losses and gradient norms. Whether a run stays inside the band the other correct runs span, step by
step, is the findings' (`gradients_findings`), from records only.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from dataclasses import dataclass

from ...experiments import protocol
from ...experiments.protocol import Case
from ...layout import Layout
from ...records import Body, Unavailable
from . import gradients as _g
from .gradients_params import OracleTrainingParams

NAME = "oracle_trajectory"
NOTEBOOK = _g.NOTEBOOK
FAMILIES = ("output", "grad", "weights")
"""What is compared at every step, in order: the forward, the gradients it gives, the weights the step leaves."""


def cases(config: RunConfig, params: OracleTrainingParams | None = None) -> list[Case]:
    """One case per run of `params.runs()`, each training `params.steps` steps."""
    return _g.cases(config, params, name=NAME, kind="trajectory")


not_applicable = protocol.not_applicable_in_release


def on_engine(payload: dict) -> dict:
    from ...engine import toolkit

    try:
        return engine_trajectory(payload)
    except (ValueError, KeyError, RuntimeError, NotImplementedError, ImportError) as e:
        return toolkit.unavailable(e)


def engine_trajectory(payload: dict) -> dict:
    """K steps of the run and of the truth at the case's layout; rank 0 returns one comparison per step."""
    import torch.distributed as tdist

    from ...config import MoEConfig
    from ...engine import toolkit
    from ...engine.dist import STATE

    kn, lay = payload["knobs"], Layout(**payload["layout"])
    cfg = MoEConfig(**payload["moe"])
    run, truth = _g.pair(cfg, kn["layers"], lay, lr=kn["lr"], mistake=kn["mistake"])
    seen_r, seen_t = _g.watch(run), _g.watch(truth)
    per_step = []
    with toolkit.deterministic(cfg.deterministic):
        for t in range(kn["steps"]):
            (x, y), (x64, y64) = _g.batch_pair(cfg, t, kn["tokens"], STATE["torch_device"])
            a = _g.step(run, seen_r, x, y)
            b = _g.step(truth, seen_t, x64, y64)
            mine = {}
            for who, tr, s in (("run", run, a), ("truth", truth, b)):
                mine[who] = {"grad": _g.pieces(tr, s["grads"], {"output": s["output"]}),
                             "weights": _g.pieces(tr, {q.name: q.main for q in tr.params}, {})}
            mine["loss"] = (run.share, a["loss"], b["loss"])
            every = _g.gather0(mine)
            if every is None:
                continue
            gated = bool(run.gated)
            one: dict = {"stats": {}, "scale": {}, "fingerprints": {}, "truth_norm": {}, "truth_sketch": {}}
            for fam in ("grad", "weights"):
                rs = _g.whole_state([e["run"][fam] for e in every], gated)
                ts = _g.whole_state([e["truth"][fam] for e in every], gated)
                groups = (("output",) if fam == "grad" else ()) + ("router", "experts")
                for g in groups:  # the output keeps its own name; the tensors their family's
                    c = _g.compare_state(rs, ts, (g,), cfg.seed, prefix="" if g == "output" else f"{fam}.",
                                         per_expert=False)
                    for k in one:
                        one[k].update(c[k])
            losses = sorted({s: (lr_, lt) for s, lr_, lt in (e["loss"] for e in every)}.items())
            one["loss"] = sum(v[0] for _, v in losses) / len(losses)
            one["loss_truth"] = sum(v[1] for _, v in losses) / len(losses)
            one["grad_norm"], one["grad_norm_truth"] = a["grad_norm"], b["grad_norm"]
            per_step.append(one)
    res = {"rank": tdist.get_rank(), "available": True, "dp": run.dp,
           "expert_dp": tdist.get_world_size(run.expert_group)}
    if tdist.get_rank() == 0:
        res["steps_compared"], res["shares"] = per_step, run.shares
    return res


@dataclass(frozen=True)
class TrajectoryRecord(Body):
    """One run's K steps against the fp64 trajectory: per step (1..K, in order) the rule's statistics per group
    (`output.all`, `grad.router.all`, `grad.experts.all`, `weights.router.all`, `weights.experts.all`: each tensor
    whole), the least-squares scale against the truth, the run's fingerprints, the truth's norms and projections,
    and both global losses and gradient norms."""

    dp: int
    expert_dp: int
    shares: int
    steps_compared: list
    available: bool = True

    def asdict(self) -> dict:
        return {"available": self.available, **{k: v for k, v in super().asdict().items() if k != "available"}}


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    r0 = per_rank[0]
    if not r0.get("available"):
        return [Unavailable(r0.get("reason")).asdict()]
    return [TrajectoryRecord(dp=r0["dp"], expert_dp=r0["expert_dp"], shares=r0["shares"],
                             steps_compared=r0["steps_compared"]).asdict()]


def verdict(records: list[dict]) -> str:
    """Notebook 08's training verdict: its findings, rendered."""
    from ...findings import render
    from . import gradients_findings as found

    return render.verdict([f for f in found.findings(records) if f.experiment == NAME])


__all__ = ["cases", "on_engine", "records", "verdict", "not_applicable", "TrajectoryRecord", "FAMILIES", "NAME",
           "NOTEBOOK"]
