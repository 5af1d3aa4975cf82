"""Notebook 03: which fp32/fp64 / deterministic settings make EP ranks agree, in which megatron-core release, at
what cost. A grid dispatcher x router dtype x probs-fp32-gather x deterministic per release; per cell the probe's
comparisons (with trials), one captured forward (what travels in which dtype, the first divergent stage) and the
cost: paired rounds of the cell's forward against the plain bf16 forward of the same dispatcher (the plain cell
itself is the A/A noise floor). On GPUs deterministic cells run on engines started with NCCL_ALGO=Ring and
CUBLAS_WORKSPACE_CONFIG=:4096:8; other releases are installed side by side and get engines of their own.
"""

from __future__ import annotations

import itertools
import logging

from .. import stats
from . import localise, probe
from . import protocol
from .protocol import Case

logger = logging.getLogger(__name__)

NAME = "promotion"
NOTEBOOK = "03"


def grid(params: dict) -> list:
    from .. import profiles

    base = profiles.base_moe(params)
    return [base.replace(dispatcher=d, router_dtype=r, probs_fp32_gather=p, deterministic=det)
            for d, r, p, det in itertools.product(params["dispatchers"],
                                                  params.get("sweep_router_dtypes") or params["router_dtypes"],
                                                  params.get("probs_fp32_gather", [False, True]),
                                                  params.get("deterministic", [False, True]))]


def cases(params: dict) -> list[Case]:
    """Release x grid. A setting a release lacks (router dtype before 0.12) is still a case: its record says
    'skipped' with the reason, so the heatmaps show it as n/a."""
    from .. import profiles

    releases = list(params.get("releases") or [profiles.release(params)])
    out = []
    for release in releases:
        for cfg in grid(params):
            det_env = cfg.deterministic and params["device"] == "cuda"  # NCCL_ALGO is read when NCCL starts
            out.append(probe.case(cfg, cut=params["cut"], trials=profiles.trials(params), repeats=0,
                                  experiment=NAME, release=release, deterministic_env=det_env,
                                  cost_rounds=profiles.cost_rounds(params)))
    return out


not_applicable = protocol.not_applicable_in_release  # a setting the release lacks: a record that says so


# ---------------------------------------------------------------------------------------------- engine side


def on_engine(payload: dict) -> dict:
    """Engine side: the probe's comparisons, one captured forward, and the cost against the plain forward."""
    from ..engine import toolkit
    from .remedies import probs_fp32_before_gather

    cfg_d = payload["moe"]
    res = {"probe": probe.on_engine(payload), "localise": localise.on_engine(payload)}
    rounds = payload["knobs"].get("cost_rounds", 0)
    if rounds:
        s = toolkit.setup(cfg_d)
        plain = toolkit.setup({**cfg_d, "router_dtype": "none", "probs_fp32_gather": False, "deterministic": False})

        def cell():
            with toolkit.deterministic(s.cfg.deterministic), probs_fp32_before_gather(s.layer,
                                                                                        s.cfg.probs_fp32_gather):
                toolkit.forward(s.layer, s.tokens)

        res["times"] = toolkit.paired_rounds({"cell": cell, "plain": lambda: toolkit.forward(plain.layer,
                                                                                           plain.tokens)}, rounds)
        from .. import provenance

        res["env"] = provenance.numerics_env()
    res["rank"] = toolkit.tdist.get_rank()
    return res


# ---------------------------------------------------------------------------------------------- controller side


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    rec = probe.summarise([r["probe"] for r in per_rank])
    loc = localise.records(case, [r["localise"] for r in per_rank])[0]
    rec.update(probs_dtype=loc["probs_gather_dtype"] or "not communicated", combine_op=loc["combine_op"],
               combine_dtype=loc["combine_dtype"], out_dtype=loc["out_dtype"],
               first_divergent_stage=loc["first_divergent_stage"],
               first_divergent_kind=loc["first_divergent_kind"])
    if "times" in per_rank[0]:
        rec["cost"] = stats.paired_cost([r["times"] for r in per_rank], "cell", "plain", environment={
            **per_rank[0].get("env", {}), "deterministic_algorithms": case.moe.deterministic})
        rec["t_forward_s"] = rec["cost"]["t_with_s"]
    return [rec]


def is_plain(r: dict) -> bool:
    return r["router_dtype"] == "none" and not r["probs_fp32_gather"] and not r["deterministic"]


def remedy_name(r: dict) -> str:
    parts = [f"router {r['router_dtype']}"]
    if r["probs_fp32_gather"]:
        parts.append("probs fp32 gather")
    if r["deterministic"]:
        parts.append("deterministic")
    return " + ".join(parts)


def cost_table(records: list[dict]):
    """Cost of every cell relative to the plain bf16 forward of the same release and dispatcher (paired rounds):
    `relative_time` (median ratio), its 95 % interval, and whether it is measurable against the A/A noise floor."""
    import pandas as pd

    rows = []
    for r in records:
        if "skipped" in r or not r.get("cost"):
            continue
        floor = _floor(records, r)
        rows.append({**{k: r[k] for k in ("megatron_core", "dispatcher", "router_dtype", "probs_fp32_gather",
                                          "deterministic")},
                     "relative_time": r["cost"]["ratio"], "ci_low": r["cost"]["ci"][0], "ci_high": r["cost"]["ci"][1],
                     "measurable": stats.measurable(r["cost"], floor) if not is_plain(r) else None,
                     "t_forward_ms": 1e3 * r["cost"]["t_with_s"], "setting": remedy_name(r)})
    return pd.DataFrame(rows)


def _floor(records: list[dict], r: dict) -> dict | None:
    return next((x.get("cost") for x in records if "skipped" not in x and is_plain(x)
                 and x["megatron_core"] == r["megatron_core"] and x["dispatcher"] == r["dispatcher"]), None)


def agrees(r: dict) -> bool:
    """Bitwise-equal ranks and reruns in every trial."""
    return r["cross_rank"].get("bitwise_equal", False) and r["rerun"]["bitwise_equal"]


def verdict(records: list[dict]) -> str:
    """Per release and dispatcher: which settings give bitwise-equal ranks and reruns in every trial, and the
    cheapest of them — ranked only where the costs are resolved against the noise floor."""
    ran = [r for r in records if "skipped" not in r]
    if not ran:
        return "No cell ran."
    lines = []
    for v, d in sorted({(r["megatron_core"], r["dispatcher"]) for r in ran}, key=lambda x: (_vt(x[0]), x[1])):
        cells = [r for r in ran if r["megatron_core"] == v and r["dispatcher"] == d]
        plain = next((r for r in cells if is_plain(r)), None)
        trials = plain["cross_rank"].get("trials", 1) if plain else 1
        head = f"- megatron-core {v}, {d}: plain bf16 "
        if plain is None:
            head += "not measured"
        elif not plain["cross_rank"].get("applicable", True):
            head += "has one rank (cross-rank not applicable)"
        elif agrees(plain):
            head += f"ranks already agree bit for bit ({trials} trials)"
        else:
            head += (f"ranks differ in {plain['cross_rank']['n_differ']} of {trials} trials "
                     f"(up to {plain['cross_rank']['mismatch_frac']:.3g} of elements), reruns differ in "
                     f"{plain['rerun']['n_differ']} of {trials}")
        good = [r for r in cells if agrees(r) and not is_plain(r)]
        if good and plain is not None and not agrees(plain):
            floor = plain.get("cost")
            free = sorted((r for r in good if stats.measurable(r.get("cost"), floor) is False), key=_simplicity)
            costed = sorted((r for r in good if r not in free), key=lambda r: (r.get("cost") or {}).get("ratio") or 9e9)
            head += f"; {len(good)} of {len(cells) - 1} settings give bitwise-equal ranks and reruns in every trial"
            if free:
                head += f"; at no measurable cost: {', '.join(remedy_name(r) for r in free)}"
            elif costed:
                head += f"; cheapest: {remedy_name(costed[0])} ({stats.describe(costed[0].get('cost'), floor)})"
        elif plain is not None and not agrees(plain):
            head += "; no setting in the grid gives bitwise-equal ranks and reruns in every trial"
        lines.append(head)
    skipped = sorted({(r["megatron_core"], r["skipped"]) for r in records if "skipped" in r})
    for v, why in skipped[:3]:
        lines.append(f"- megatron-core {v}: some cells are not applicable ({why})")
    return "\n".join(lines)


def _simplicity(r: dict) -> tuple:
    """Fewer changes first: no deterministic mode, no lab cast, then the narrower router dtype."""
    return (r["deterministic"], r["probs_fp32_gather"], {"none": 0, "fp32": 1, "fp64": 2}[r["router_dtype"]])


def best_setting(cells: list[dict]) -> tuple[dict, dict] | None:
    """Of one release x dispatcher's cells, the setting to recommend and the noise floor it is judged against: among
    the settings that agree in every trial, those with no measurable cost by simplicity, else the lowest ratio.
    None if the plain forward already agrees or nothing does."""
    plain = next((r for r in cells if is_plain(r)), None)
    if plain is None or agrees(plain):
        return None
    good = [r for r in cells if agrees(r) and not is_plain(r)]
    if not good:
        return None
    floor = plain.get("cost")
    free = [r for r in good if stats.measurable(r.get("cost"), floor) is False]
    best = (min(free, key=_simplicity) if free else
            min(good, key=lambda r: ((r.get("cost") or {}).get("ratio") or 9e9, _simplicity(r))))
    return best, floor


def recommendations(records: list[dict]) -> list[str]:
    """What a user who wants bitwise-equal EP ranks should set, per release and dispatcher, from the records:
    the cheapest setting that holds in every trial (a dtype setting before deterministic mode at equal cost)."""
    ran = [r for r in records if "skipped" not in r]
    out = []
    for v, d in sorted({(r["megatron_core"], r["dispatcher"]) for r in ran}, key=lambda x: (_vt(x[0]), x[1])):
        cells = [r for r in ran if r["megatron_core"] == v and r["dispatcher"] == d]
        plain = next((r for r in cells if is_plain(r)), None)
        if plain is None or agrees(plain):
            out.append(f"megatron-core {v}, {d}: nothing to set — the ranks already agree in every trial.")
            continue
        good = [r for r in cells if agrees(r) and not is_plain(r)]
        if not good:
            nondet = not plain["rerun"]["bitwise_equal"]
            out.append(f"megatron-core {v}, {d}: no setting in the grid makes the ranks agree in every trial"
                       + (" — the plain forward is itself run-to-run nondeterministic; see notebook 04's remedies."
                          if nondet else "."))
            continue
        best, floor = best_setting(cells)
        out.append(f"megatron-core {v}, {d}: {remedy_name(best)} ({stats.describe(best.get('cost'), floor)}).")
    return out


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
    from ..engine import compat

    try:
        return compat.parse_version(v)
    except ValueError:
        return (0, 0, 0)


__all__ = ["grid", "cases", "not_applicable", "on_engine", "records", "cost_table", "verdict", "recommendations",
           "remedy_name", "dtype_story"]
