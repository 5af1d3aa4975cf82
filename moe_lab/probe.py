"""Controller side of `moe-lab probe`: run cases on a warm cluster → tidy records (one dict per case)."""

from __future__ import annotations

import datetime
import logging

from . import measure
from .cluster import Cluster
from .config import MoEConfig

logger = logging.getLogger(__name__)

COMPARISONS = ("cross_rank", "rerun", "truncation")


def check_case(cfg: MoEConfig, world: int, megatron_version: str, cut: int) -> None:
    """Everything about a case that can be wrong before an engine runs it: raise ValueError naming it."""
    from .compat import check_router_dtype

    cfg.resolved_ep(world)
    check_router_dtype(cfg.router_dtype, megatron_version)
    if not 0 < cut < cfg.seq_len:
        raise ValueError(f"cut ({cut}) must be in 1..seq_len-1 ({cfg.seq_len - 1})")


def run_case(cluster: Cluster, cfg: MoEConfig, *, cut: int = 90, detail: bool = False, repeats: int = 3,
             timeout: float | None = None, **extra) -> dict:
    """One case on every rank → one record: environment, config, and the three comparisons (worst over ranks)."""
    check_case(cfg, cluster.world, cluster.summary()["megatron_core"], cut)
    per_rank = cluster.run(measure.run_case, cfg.asdict(), cut=cut, detail=detail, repeats=repeats,
                           what=f"MoE case {cfg.dispatcher}/{cfg.router_dtype}", timeout=timeout)
    r0 = per_rank[0]
    rec = dict(cluster.summary())
    rec.update(extra)
    rec.update(
        time=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
        config=cfg.asdict(),
        dispatcher=cfg.dispatcher,
        router_dtype=cfg.router_dtype,
        deterministic=cfg.deterministic,
        cut=cut,
        cross_rank=r0["cross_rank"],
        rerun=measure.worst([r["rerun"] for r in per_rank]),
        truncation=measure.worst([r["truncation"] for r in per_rank]),
        t_forward_s=max(r["t_forward_s"] for r in per_rank) if repeats else None,
    )
    if detail:
        d = r0["cross_rank_detail"]
        rec["detail"] = {
            "pairs": d["pairs"],
            "ulp_hist": d["ulp_hist"],
            "token_mismatch": d["token_mismatch"],
            "mismatch_map": d["mismatch_map"],
            "bytes_compared": d["bytes_compared"],
            "truncation_token_mismatch": {str(r["rank"]): r["truncation_token_mismatch"] for r in per_rank},
        }
    return rec


def probe(cluster: Cluster, cfgs: list[MoEConfig], *, cut: int = 90, **kw) -> list[dict]:
    """Run each config on the same warm cluster; errors in input are raised before any case runs."""
    version = cluster.summary()["megatron_core"]
    for cfg in cfgs:
        check_case(cfg, cluster.world, version, cut)
    return [run_case(cluster, cfg, cut=cut, **kw) for cfg in cfgs]


def headline(rec: dict) -> str:
    """One line a person reads: per comparison, bitwise verdict, mismatch fraction and max ULP."""
    parts = []
    for name in COMPARISONS:
        c = rec[name]
        verdict = "bitwise equal" if c["bitwise_equal"] else f"{c['mismatch_frac']:.2%} differ, max {c['max_ulp']:.0f} ULP"
        parts.append(f"{name}: {verdict}")
    return f"{rec['dispatcher']}/router {rec['router_dtype']}{' det' if rec['deterministic'] else ''} — " + "; ".join(parts)
