"""A grid of cases on a warm cluster per megatron-core release → one tidy record per cell, streamed to results.json.

Grid: dispatcher x router dtype x the reporter's probs-fp32-before-gather toggle x deterministic mode, for each
release. Each cell runs the probe's comparisons (cross_rank, rerun; median forward time over `repeats`) and one
captured forward for the dtypes the probs travel in and the combine runs in (from the collective ledger).
Cells already in results.json are skipped, so an interrupted sweep resumes where it stopped.
"""

from __future__ import annotations

import itertools
import logging
import os

from . import compat, localise, probe, profiles, results
from .cluster import Cluster, ClusterError
from .config import MoEConfig

logger = logging.getLogger(__name__)

INSTALLED = "installed"  # the release the controller's Python imports
_KEY = ("notebook", "megatron_core", "device", "world", "dispatcher", "router_dtype", "probs_fp32_gather",
        "deterministic")


def grid(params: dict) -> list[MoEConfig]:
    base = profiles.base_moe(params)
    return [base.replace(dispatcher=d, router_dtype=r, probs_fp32_gather=p, deterministic=det)
            for d, r, p, det in itertools.product(params["dispatchers"], params["router_dtypes"],
                                                  params.get("probs_fp32_gather", [False, True]),
                                                  params.get("deterministic", [False, True]))]


def release_path(release: str, wheels: str | None = None) -> tuple[str, ...]:
    """sys.path entries for a release: () for the installed one, else its side-by-side folder (installed if missing)."""
    if release == INSTALLED or release == compat.installed_version():
        return ()
    from . import versions

    try:
        return (str(versions.path_for(release)),)
    except ValueError:
        logger.info("installing megatron-core %s side by side%s", release, f" from {wheels}" if wheels else "")
        return (str(versions.install(release, from_dir=wheels)),)


def key(rec: dict) -> tuple:
    return tuple(str(rec.get(k)) for k in _KEY)


def run_cell(cluster: Cluster, cfg: MoEConfig, *, cut: int, repeats: int, notebook: str = "03") -> dict:
    """One cell: probe comparisons + ledger dtypes + first divergent stage; a release lacking a feature → skipped."""
    env = cluster.summary()
    common = dict(env, notebook=notebook, dispatcher=cfg.dispatcher, router_dtype=cfg.router_dtype,
                  probs_fp32_gather=cfg.probs_fp32_gather, deterministic=cfg.deterministic, config=cfg.asdict())
    try:
        compat.check_router_dtype(cfg.router_dtype, env["megatron_core"])
    except ValueError as e:
        return dict(common, skipped=str(e))
    rec = probe.run_case(cluster, cfg, cut=cut, repeats=repeats)
    per_rank = cluster.run(localise.localise_case, cfg.asdict(), what=f"capture {cfg.dispatcher}/{cfg.router_dtype}")
    ledger = per_rank[0]["ledger"]
    stages = {s["stage"]: s for s in per_rank[0]["stages"]}
    combine = next((c for c in ledger if c["stage"].startswith("combine")), {})
    rows = localise.stage_rows(per_rank)
    return dict(common, cut=cut, cross_rank=rec["cross_rank"], rerun=rec["rerun"], truncation=rec["truncation"],
                t_forward_s=rec["t_forward_s"],
                probs_dtype=next((c["dtype"] for c in ledger if c["role"] == "probs"), "not communicated"),
                combine_op=combine.get("op"), combine_dtype=combine.get("dtype"),
                out_dtype=stages.get("moe.out", {}).get("dtype"),
                first_divergent_stage=localise.first_divergent(rows))


def run(params: dict, results_path: str | os.PathLike, *, releases=None, repeats: int | None = None,
        progress=None) -> list[dict]:
    """The whole sweep on one warm cluster: for each release (and on GPUs each deterministic setting) the engines
    are restarted with that release first on their path (`Cluster.restart_engines`: the controller stays).

    Cells already in `results_path` (an earlier, interrupted run on the same device, world and release) are taken
    from there; engines are (re)started only for a group with cells left to measure.
    """
    releases = list(releases or params.get("releases") or [INSTALLED])
    repeats = repeats or int(params.get("repeats", 5))
    cells = grid(params)
    earlier = {key(r): r for r in results.load(results_path) if r.get("notebook") == "03"}
    ccfg0 = profiles.cluster_config(params)
    out = []
    cluster: Cluster | None = None
    try:
        for release in releases:
            version = compat.installed_version() if release == INSTALLED else compat.normalize_version(release)
            # NCCL_ALGO is read when NCCL starts: on GPUs deterministic cells get engines started with Ring.
            groups = ([(False, [c for c in cells if not c.deterministic]),
                       (True, [c for c in cells if c.deterministic])]
                      if params["device"] == "cuda" else [(False, cells)])
            for det_env, group in groups:
                env = dict(notebook="03", megatron_core=version, device=ccfg0.device, world=ccfg0.engines)
                todo = [c for c in group if key(dict(env, **_flags(c))) not in earlier]
                out += [earlier[key(dict(env, **_flags(c)))] for c in group if c not in todo]
                logger.info("megatron-core %s: %d cells to run, %d already measured", version, len(todo),
                            len(group) - len(todo))
                if not todo:
                    continue
                changes = dict(extra_path=release_path(release, params.get("wheels")), deterministic=det_env)
                if cluster is None:
                    cluster = Cluster(ccfg0.replace(**changes)).start()
                elif any(getattr(cluster.config, k) != v for k, v in changes.items()):
                    cluster.restart_engines(**changes)
                if cluster.summary()["megatron_core"] != version:
                    raise RuntimeError(f"engines imported megatron-core {cluster.summary()['megatron_core']}, "
                                       f"expected {version}: check `moe-lab versions list`")
                for cfg in (progress(todo, version) if progress else todo):
                    rec = run_cell(cluster, cfg, cut=params["cut"], repeats=repeats)
                    results.append(results_path, [rec])  # streamed: an interrupted sweep keeps every finished cell
                    out.append(rec)
    except BaseException as e:
        if cluster is not None:  # after Ctrl-C or an engine failure the engines may be mid-collective
            cluster.stop(graceful=not isinstance(e, (KeyboardInterrupt, ClusterError)))
        raise
    if cluster is not None:
        cluster.stop()
    order = {_flags_key(c): i for i, c in enumerate(cells)}
    return sorted(out, key=lambda r: (_vt(r["megatron_core"]), order.get(_flags_key(r), 0)))


def _flags_key(c) -> tuple:
    get = (lambda k: getattr(c, k)) if isinstance(c, MoEConfig) else c.get
    return tuple(get(k) for k in ("dispatcher", "router_dtype", "probs_fp32_gather", "deterministic"))


def _flags(cfg: MoEConfig) -> dict:
    return dict(dispatcher=cfg.dispatcher, router_dtype=cfg.router_dtype, probs_fp32_gather=cfg.probs_fp32_gather,
                deterministic=cfg.deterministic)


def cost_table(records: list[dict]):
    """Forward time of every cell relative to the plain bf16 forward of the same release and dispatcher."""
    import pandas as pd

    df = pd.DataFrame([r for r in records if "skipped" not in r])
    base = df[(df.router_dtype == "none") & (~df.probs_fp32_gather) & (~df.deterministic)]
    base = base.set_index(["megatron_core", "dispatcher"])["t_forward_s"]
    df["relative_time"] = [t / base.get((v, d), float("nan")) for t, v, d in
                           zip(df.t_forward_s, df.megatron_core, df.dispatcher)]
    return df


def remedy_name(r: dict) -> str:
    parts = [f"router {r['router_dtype']}"]
    if r["probs_fp32_gather"]:
        parts.append("probs fp32 gather")
    if r["deterministic"]:
        parts.append("deterministic")
    return " + ".join(parts)


def verdict(records: list[dict]) -> str:
    """Per release and dispatcher: which settings give bitwise-equal ranks (cross_rank and rerun), and the cheapest."""
    if not records:
        return "No cell ran."
    ran = [r for r in records if "skipped" not in r]
    lines = []
    costs = cost_table(records).set_index(["megatron_core", "dispatcher", "router_dtype", "probs_fp32_gather",
                                           "deterministic"])["relative_time"] if ran else None
    for (v, d) in sorted({(r["megatron_core"], r["dispatcher"]) for r in ran}, key=lambda x: (_vt(x[0]), x[1])):
        cells = [r for r in ran if r["megatron_core"] == v and r["dispatcher"] == d]
        plain = next((r for r in cells if r["router_dtype"] == "none" and not r["probs_fp32_gather"]
                      and not r["deterministic"]), None)
        good = [r for r in cells if r["cross_rank"]["bitwise_equal"] and r["rerun"]["bitwise_equal"]]
        head = f"- megatron-core {v}, {d}: plain bf16 "
        head += ("ranks already agree bit for bit" if plain and plain["cross_rank"]["bitwise_equal"]
                 and plain["rerun"]["bitwise_equal"] else
                 f"ranks differ ({plain['cross_rank']['mismatch_frac']:.3g} of elements, rerun "
                 f"{plain['rerun']['mismatch_frac']:.3g})" if plain else "not measured")
        if good:
            cheapest = min(good, key=lambda r: costs.get((v, d, r["router_dtype"], r["probs_fp32_gather"],
                                                           r["deterministic"]), float("inf")))
            c = costs.get((v, d, cheapest["router_dtype"], cheapest["probs_fp32_gather"], cheapest["deterministic"]))
            head += (f"; {len(good)}/{len(cells)} settings give bitwise-equal ranks; cheapest: "
                     f"{remedy_name(cheapest)} ({c:.2f}x the plain forward)")
        else:
            head += "; no setting in the grid gives bitwise-equal ranks"
        lines.append(head)
    return "\n".join(lines)


def _vt(v: str):
    try:
        return compat.parse_version(v)
    except ValueError:
        return (0, 0, 0)


__all__ = ["grid", "run", "run_cell", "cost_table", "verdict", "INSTALLED"]
