"""Notebook 03: which fp32/fp64 / deterministic settings make EP ranks agree, in which megatron-core release, at
what cost. A grid dispatcher x router dtype x probs-fp32-gather x deterministic per release; per cell the probe's
comparisons (with trials), one captured forward (what travels in which dtype, the first divergent stage) and the
cost: paired rounds of the cell's forward against the plain bf16 forward of the same dispatcher (the plain cell
itself is the A/A noise floor). On GPUs deterministic cells run on engines started with NCCL_ALGO=Ring and
CUBLAS_WORKSPACE_CONFIG=:4096:8; other releases are installed side by side and get engines of their own.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

import itertools
import logging

from . import QUESTION
from ... import stats
from ..localise import experiment as localise
from ...experiments import probe
from ...experiments import protocol
from ...records import ABSENT, parse_comparison
from .record import PromotionRecord
from ...experiments.protocol import Case
from .findings import agrees, is_plain, remedy_name  # noqa: F401 - one definition, used here too

logger = logging.getLogger(__name__)

NAME = "promotion"
NOTEBOOK = QUESTION.number


def grid(config: RunConfig) -> list:
    from .params import PromotionParams

    base, pp = config.layer, config.params(PromotionParams)
    return [base.replace(dispatcher=d, router_dtype=r, probs_fp32_gather=p, deterministic=det)
            for d, r, p, det in itertools.product(config.run.dispatchers, pp.router_dtypes(config),
                                                  pp.probs_fp32_gather, pp.deterministic)]


def cases(config: RunConfig) -> list[Case]:
    """Release x grid. A setting a release lacks (router dtype before 0.12) is still a case: its record says
    'skipped' with the reason, so the heatmaps show it as n/a."""
    from .params import PromotionParams

    releases = list(config.params(PromotionParams).releases or [config.release])
    out = []
    for release in releases:
        for cfg in grid(config):
            det_env = cfg.deterministic and config.gpu  # NCCL_ALGO is read when NCCL starts
            out.append(probe.case(cfg, cut=config.run.cut, trials=config.run.trials, repeats=0,
                                  experiment=NAME, release=release, deterministic_env=det_env,
                                  cost_rounds=config.rounds(), layout=config.layout))
    return out


not_applicable = protocol.not_applicable_in_release  # a setting the release lacks: a record that says so


# ---------------------------------------------------------------------------------------------- engine side


def on_engine(payload: dict) -> dict:
    """Engine side: the probe's comparisons, one captured forward, and the cost against the plain forward."""
    from ...engine import toolkit
    from ...experiments.remedies import probs_fp32_before_gather

    cfg_d = payload["moe"]
    res = {"probe": probe.on_engine(payload), "localise": localise.on_engine(payload)}
    rounds = payload["knobs"].get("cost_rounds", 0)
    if rounds:
        s = toolkit.setup(cfg_d, payload.get("layout"))
        plain = toolkit.setup({**cfg_d, "router_dtype": "none", "probs_fp32_gather": False, "deterministic": False},
                              payload.get("layout"))

        def cell():
            with toolkit.deterministic(s.cfg.deterministic), probs_fp32_before_gather(s.layer,
                                                                                        s.cfg.probs_fp32_gather):
                toolkit.forward(s.layer, s.tokens)

        res["times"] = toolkit.paired_rounds({"cell": cell, "plain": lambda: toolkit.forward(plain.layer,
                                                                                           plain.tokens)}, rounds)
        from ... import provenance

        res["env"] = provenance.numerics_env()
    res["rank"] = toolkit.tdist.get_rank()
    return res


# ---------------------------------------------------------------------------------------------- controller side


def records(case: Case, per_rank: list[dict], record_type=PromotionRecord) -> list[dict]:
    """One record of `record_type` (notebook 07's presets give theirs): the probe's comparisons, 02's dtypes and first
    divergent stage, the paired cost."""
    s = probe.summarise([r["probe"] for r in per_rank])
    loc = localise.records(case, [r["localise"] for r in per_rank])[0]
    cost = ABSENT
    if "times" in per_rank[0]:
        cost = stats.paired_cost([r["times"] for r in per_rank], "cell", "plain", environment={
            **per_rank[0].get("env", {}), "deterministic_algorithms": case.moe.deterministic})
    rec = record_type(cross_rank=parse_comparison(s["cross_rank"]), rerun=parse_comparison(s["rerun"]),
                      truncation=parse_comparison(s["truncation"]),
                      t_forward_s=s["t_forward_s"] if cost is ABSENT else cost["t_with_s"],
                      probs_dtype=loc["probs_gather_dtype"] or "not communicated", combine_op=loc["combine_op"],
                      combine_dtype=loc["combine_dtype"], out_dtype=loc["out_dtype"],
                      first_divergent_stage=loc["first_divergent_stage"],
                      first_divergent_kind=loc["first_divergent_kind"], cost=cost)
    return [rec.asdict()]


def cost_table(records: list[dict]):
    """Cost of every cell relative to the plain bf16 forward of the same release and dispatcher (paired rounds):
    `relative_time` (median ratio), its interval (`ci_low`, `ci_high` over `rounds`), and where that interval lies
    against the A/A noise floor (`vs_noise_floor`: inside, overlaps, above, below — `stats.against_floor`)."""
    import pandas as pd

    rows = []
    for r in records:
        if "skipped" in r or not r.get("cost"):
            continue
        floor = _floor(records, r)
        rows.append({**{k: r[k] for k in ("megatron_core", "dispatcher", "router_dtype", "probs_fp32_gather",
                                          "deterministic")},
                     "relative_time": r["cost"]["ratio"], "ci_low": r["cost"]["ci"][0], "ci_high": r["cost"]["ci"][1],
                     "rounds": r["cost"].get("rounds"),
                     "vs_noise_floor": (stats.against_floor(r["cost"].get("ci"), (floor or {}).get("ci"))
                                        if not is_plain(r) else None),
                     "t_forward_ms": 1e3 * r["cost"]["t_with_s"], "setting": remedy_name(r)})
    return pd.DataFrame(rows)


def _floor(records: list[dict], r: dict) -> dict | None:
    return next((x.get("cost") for x in records if "skipped" not in x and is_plain(x)
                 and x["megatron_core"] == r["megatron_core"] and x["dispatcher"] == r["dispatcher"]), None)


def verdict(records: list[dict]) -> str:
    """Notebook 03's verdict: per release and dispatcher, its findings (moe_lab.questions.promotion.findings), rendered —
    settings are never ranked inside their intervals' overlap."""
    from . import findings as found
    from ...findings import render

    return render.verdict(found.findings(records))


def recommendations(records: list[dict]) -> list[str]:
    """What a user who wants bitwise-equal EP ranks should set, per release and dispatcher: the fix findings."""
    from . import findings as found

    return [f"[{f.status}] {f.claim}" + ("".join(f"\n    {line}" for line in f.lines) if f.lines else "")
            for f in found.findings(records) if f.question == found.QUESTION]


def dtype_story(records: list[dict]) -> str:
    """Per release and dispatcher, from the ledger and the comparisons: the dtype the probs travel in, the combine's
    and the output's dtype, and whether the ranks agreed — for plain bf16, the reporter's cast and router fp32."""
    ran = [r for r in records if "skipped" not in r and not r["deterministic"]]
    lines = []
    for v, d in sorted({(r["megatron_core"], r["dispatcher"]) for r in ran}, key=lambda x: (_vt(x[0]), x[1])):
        parts = []
        for name, router, pf32 in (("plain bf16", "none", False), ("probs fp32 gather", "none", True),
                                   ("router fp32", "fp32", False)):
            r = next((x for x in ran if (x["megatron_core"], x["dispatcher"], x["router_dtype"],
                                         x["probs_fp32_gather"]) == (v, d, router, pf32)), None)
            if r is None:
                parts.append(f"{name}: n/a in this release")
                continue
            c = r["cross_rank"]
            agree = ("one rank" if not c.get("applicable", True) else "ranks agree" if c["bitwise_equal"]
                     else f"ranks differ (up to {c['mismatch_frac']:.3g}, max {c['max_ulp']:.0f} ULP)")
            parts.append(f"{name}: probs {r['probs_dtype']}, combine {r['combine_op']} in {r['combine_dtype']}, "
                         f"output {r['out_dtype']} → {agree}")
        lines.append(f"- megatron-core {v}, {d}: " + "; ".join(parts))
    return "\n".join(lines) or "No cell ran."


def _vt(v: str):
    from ... import releases

    try:
        return releases.parse_version(v)
    except ValueError:
        return (0, 0, 0)


__all__ = ["grid", "cases", "not_applicable", "on_engine", "records", "cost_table", "verdict", "recommendations",
           "remedy_name", "dtype_story"]
