"""The seed report's three comparisons of one layer config (`moe-lab probe`, notebooks 01 and 03, the bench):

cross_rank: the same tokens on every rank → outputs must be bitwise equal across ranks;
rerun:      the same input twice on the same rank → bitwise equal (run-to-run determinism);
truncation: the first `cut` tokens with and without tokens[cut:] zeroed → bitwise equal (batch invariance).

Each is made in `trials` independent trials (a verdict on a nondeterministic outcome needs several): a trial is one
forward of the full input, one more of the same input, and one of the truncated input, in that order.
"""

from __future__ import annotations

import dataclasses
import logging
import statistics
import time
from typing import TYPE_CHECKING

from .. import metrics
from ..config import MoEConfig
from ..layout import WORLD, Layout
from ..findings.common import describe as describe_cmp  # one wording of a comparison
from ..records import parse_comparison
from .probe_record import ProbeRecord
from .protocol import Case

if TYPE_CHECKING:
    from ..run_config import RunConfig

logger = logging.getLogger(__name__)

NAME = "probe"
NOTEBOOK = ""
COMPARISONS = ("cross_rank", "rerun", "truncation")


def case(cfg: MoEConfig, *, cut: int = 90, trials: int = 1, detail: bool = False, repeats: int = 0,
         experiment: str = NAME, release: str = "installed", deterministic_env: bool = False,
         layout: Layout = WORLD, **knobs) -> Case:
    """A probe case of `cfg` split as `layout`: `trials` trials of the three comparisons. Its forward time is the
    median of the trials' own full-input forwards (each finished on the device), or of `repeats` more forwards after
    them if repeats > 0."""
    for name, v, lo in (("trials", trials, 1), ("repeats", repeats, 0)):
        if not isinstance(v, int) or isinstance(v, bool) or v < lo:
            raise ValueError(f"{name} ({v!r}) must be an integer >= {lo}")
    return Case(experiment=experiment, moe=cfg, cut=cut, knobs=dict(trials=trials, detail=detail, repeats=repeats,
                                                                    **knobs),
                release=release, deterministic_env=deterministic_env, layout=layout,
                label=(f"{cfg.model} " if cfg.model else "") + f"{cfg.dispatcher}/{cfg.router_dtype}"
                + ("/det" if cfg.deterministic else ""))


def run(cluster, cfg: MoEConfig, *, cut: int = 90, trials: int = 1, detail: bool = False, repeats: int = 0,
        **knobs) -> dict:
    """One probe case on a running cluster → its record (the protocol's; nothing written to disk)."""
    from . import protocol

    import sys

    return protocol.run(sys.modules[__name__], cluster=cluster, notebook="",
                        cases=[case(cfg, cut=cut, trials=trials, detail=detail, repeats=repeats, **knobs)])[0]


def cases(config: RunConfig) -> list[Case]:
    base = config.layer
    return [case(base.replace(dispatcher=d, router_dtype=r), cut=config.run.cut, trials=config.run.trials)
            for d in config.run.dispatchers for r in config.run.router_dtypes]


# ---------------------------------------------------------------------------------------------- engine side


def on_engine(payload: dict) -> dict:
    """Engine side: every trial's comparisons on this rank; rank 0 also gets the cross-rank ones."""
    from ..engine import toolkit
    from .remedies import probs_fp32_before_gather

    kn = payload["knobs"]
    s = toolkit.setup(payload["moe"], payload.get("layout"))
    cut, detail = payload["cut"], kn.get("detail", False)
    trunc = s.truncated(cut)
    trials = []
    with toolkit.deterministic(s.cfg.deterministic), probs_fp32_before_gather(s.layer, s.cfg.probs_fp32_gather):
        outs, t_full = [], []
        for _ in range(kn.get("trials", 1)):
            t0 = time.perf_counter()
            a = toolkit.forward(s.layer, s.tokens)
            t1 = time.perf_counter()
            b = toolkit.forward(s.layer, s.tokens)
            t_full += [t1 - t0, time.perf_counter() - t1]
            c = toolkit.forward(s.layer, trunc)
            t = {"rerun": metrics.compare(a, b), "truncation": metrics.compare(a[:cut], c[:cut])}
            if detail:
                t["truncation_token_mismatch"] = toolkit.token_mismatch(a[:cut], c[:cut])
            trials.append(t)
            outs.append(a)
        repeats = kn.get("repeats", 0)
        t_fwd = toolkit.time_forward(s.layer, s.tokens, repeats) if repeats else statistics.median(t_full)
    res = {"rank": toolkit.tdist.get_rank(), "trials": trials, "t_forward_s": t_fwd, "out_shape": list(outs[0].shape)}
    cross = [toolkit.compare_across_ranks({"out": o}) for o in outs]
    worst_t = 0
    if cross[0] is not None:  # rank 0
        res["cross_rank"] = [_pairs_worst(c["out"]) for c in cross]
        worst_t = max(range(len(cross)), key=lambda i: res["cross_rank"][i].get("n_mismatch", 0))
    if detail:  # the figures' detail (ULP histogram, where in the output) of the worst trial only: one more compare
        worst_t = toolkit.broadcast_from_rank0(worst_t)
        d = toolkit.compare_across_ranks({"out": outs[worst_t]}, detail=("out",))
        if d is not None:
            cross[worst_t] = d
    if cross[0] is not None:
        res["cross_rank_detail"] = {**cross[worst_t]["out"], "trial": worst_t,
                                    "bytes_compared": sum(c["bytes_compared"] for c in cross)}
    return res


def _pairs_worst(entry: dict) -> dict:
    if not entry.get("applicable", True):
        return {"applicable": False, "reason": entry["reason"]}
    return metrics.worst(list(entry["pairs"].values()))


# ---------------------------------------------------------------------------------------------- controller side


def summarise(per_rank: list[dict]) -> dict:
    """The three comparisons over ranks and trials: per trial the worst rank, then `metrics.over_trials`."""
    r0 = per_rank[0]
    n = len(r0["trials"])
    out = {"cross_rank": metrics.over_trials(r0["cross_rank"])}
    for name in ("rerun", "truncation"):
        out[name] = metrics.over_trials([metrics.worst([r["trials"][t][name] for r in per_rank]) for t in range(n)])
    ts = [r["t_forward_s"] for r in per_rank]
    out["t_forward_s"] = max(ts) if all(t is not None for t in ts) else None
    return out


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    s = summarise(per_rank)
    d0 = per_rank[0]["cross_rank_detail"]
    rec = ProbeRecord(cross_rank=parse_comparison(s["cross_rank"]), rerun=parse_comparison(s["rerun"]),
                      truncation=parse_comparison(s["truncation"]), t_forward_s=s["t_forward_s"],
                      fingerprints=d0["fingerprints"], bytes_compared=d0["bytes_compared"])
    if case.knobs.get("detail"):
        d = per_rank[0]["cross_rank_detail"]
        rec = dataclasses.replace(rec, detail={
            "pairs": d.get("pairs", {}), "ulp_hist": d.get("ulp_hist", {}), "token_mismatch": d.get("token_mismatch", {}),
            "mismatch_map": d.get("mismatch_map", {}), "bytes_compared": d["bytes_compared"], "trial": d["trial"],
            "truncation_token_mismatch": {str(r["rank"]): _worst_trial_tokens(r) for r in per_rank},
        })
    return [rec.asdict()]


def _worst_trial_tokens(r: dict) -> list[int]:
    per = [t["truncation_token_mismatch"] for t in r["trials"]]
    return max(per, key=sum)


def headline(rec: dict) -> str:
    """One line a person reads: per comparison, the bitwise verdict with mismatch and max ULP."""
    parts = [f"{name}: {describe_cmp(rec[name])}" for name in COMPARISONS]
    model = (rec.get("config") or {}).get("model")
    return (f"{model + ': ' if model else ''}{rec['dispatcher']}/router {rec['router_dtype']}"
            f"{' det' if rec['deterministic'] else ''} — " + "; ".join(parts))


__all__ = ["case", "cases", "on_engine", "records", "summarise", "describe_cmp", "headline", "COMPARISONS"]
