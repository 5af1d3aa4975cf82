"""Controller side, one function per notebook question: profile params + warm cluster → tidy records."""

from __future__ import annotations

import logging
import os

from . import probe, profiles
from .cluster import Cluster

logger = logging.getLogger(__name__)


def _progress(items, desc: str):
    """A progress bar when a person watches; none under the headless runner (it shows its own progress)."""
    if os.environ.get("MOE_LAB_HEADLESS"):
        return items
    from tqdm.auto import tqdm

    return tqdm(items, desc=desc)


def reproduce(cluster: Cluster, params: dict, *, repeats: int = 3) -> list[dict]:
    """Notebook 01: identical tokens on every EP rank, each dispatcher x router dtype → outputs equal across ranks?"""
    base = profiles.base_moe(params)
    cases = [base.replace(dispatcher=d, router_dtype=r) for d in params["dispatchers"] for r in params["router_dtypes"]]
    version = cluster.summary()["megatron_core"]
    for cfg in cases:
        probe.check_case(cfg, cluster.world, version, params["cut"])
    return [probe.run_case(cluster, cfg, cut=params["cut"], detail=True, repeats=repeats, notebook="01")
            for cfg in _progress(cases, "01 cases")]


def verdict_01(records: list[dict]) -> str:
    """Plain-language verdict of notebook 01 from its records (no numbers typed in by hand)."""
    if not records:
        return "No case ran."
    r0 = records[0]
    lines = [f"megatron-core {r0['megatron_core']}, {r0['world']} EP ranks on {r0.get('gpu') or r0['device']} "
             f"({r0['backend']}); same tokens on every rank:"]
    diverging = []
    for r in records:
        c = r["cross_rank"]
        if c["bitwise_equal"]:
            state = "ranks agree bit for bit"
        else:
            diverging.append(r)
            state = (f"ranks DIFFER in {c['mismatch_frac']:.2%} of output elements "
                     f"(max {c['max_ulp']:.0f} ULP, max abs {c['max_abs']:.3g}; allclose(1e-3): {c['allclose_1e3']})")
        lines.append(f"- {r['dispatcher']}, router dtype {r['router_dtype']}: {state}")
    if diverging:
        names = sorted({f"{r['dispatcher']}/{r['router_dtype']}" for r in diverging})
        lines.append(f"Verdict: the EP divergence of the seed report reproduces here for {', '.join(names)}.")
    else:
        lines.append("Verdict: no cross-rank divergence on this setup for any case run.")
    return "\n".join(lines)
