"""`moe-lab bench` (controller side): the warm lab against the usual way (a fresh process group per config), in one
run. The same probe cases run both ways (the experiment protocol); costs are paired rounds (stats.paired)."""

from __future__ import annotations

import datetime
import itertools
import logging
import os
import pickle
import platform
import shutil
import statistics
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from .. import stats
from ..config import DISPATCHERS, MoEConfig
from . import bench_engine

logger = logging.getLogger(__name__)

SEED_SHAPE = (1024, 4096)  # the seed report's MoE output, [tokens x hidden] in bf16
TARGETS = {  # name → (rule, bound): the targets
    "sweep_speedup": (">=", 3.0),
    "fingerprint_overhead_pct": ("<=", 5.0),
    "compare_bytes_pct": ("<", 1.0),
}
_CAPTURE_MODES = ("plain", "fingerprint", "capture", "capture_fingerprints")


def sweep_configs(base: MoEConfig, quick: bool = False) -> list[MoEConfig]:
    """dispatcher x router dtype {none, fp32, fp64} x deterministic {off, on} (12); quick: allgather with router
    none and fp32, off (2: the pair whose results differ, so the equal-results check has something to hold, and each
    further config is one more fresh spawn of every rank)."""
    if quick:
        return [base.replace(dispatcher="allgather", router_dtype=r, deterministic=False) for r in ("none", "fp32")]
    return [base.replace(dispatcher=d, router_dtype=r, deterministic=det)
            for d, r, det in itertools.product(DISPATCHERS, ("none", "fp32", "fp64"), (False, True))]


def label(cfg: MoEConfig) -> str:
    return f"{cfg.dispatcher}/{cfg.router_dtype}" + ("/det" if cfg.deterministic else "")


def case_summary(case, per_rank: list[dict]) -> dict:
    """What both paths must agree on for one case: the three comparisons and rank 0's output fingerprints."""
    from ..experiments import probe

    rec = probe.records(case, per_rank)[0]
    return {k: rec[k] for k in ("cross_rank", "rerun", "truncation", "fingerprints", "bytes_compared")}


def probe_cases(cfgs: list[MoEConfig], *, cut: int, repeats: int) -> list:
    from ..experiments import probe

    return [probe.case(cfg, cut=cut, repeats=repeats, experiment="bench") for cfg in cfgs]


# ---------------------------------------------------------------------------------------------- the usual way


def rendezvous_port() -> int:
    """The port rank 0 of a fresh spawn binds for the rendezvous, chosen before any rank starts (as torchrun's
    MASTER_PORT): one from below the OS's ephemeral range (`controller.ports.reserve`), which no other process's bind
    to port 0 or outgoing connection takes in between — a port the OS picks can be taken by any of them before rank 0
    binds it (EADDRINUSE) —; the OS's pick where that range does not exist."""
    from ..controller import ports
    from ..engine.dist import free_port

    reserved = ports.reserve(1)
    return reserved[0] if reserved else free_port()


def spawn(cases: list[dict], *, world: int, device: str, timeout_s: float = 300.0) -> dict:
    """`world` fresh Python processes, one rank each, as torchrun starts its workers (without torchrun's own
    launcher process: a lower bound on its cost). Returns wall times and every rank's results."""
    work = Path(tempfile.mkdtemp(prefix="moe_lab_bench_"))
    spec = dict(world=world, port=rendezvous_port(), device=device, timeout_s=timeout_s, cases=cases)
    spec_path = work / "spec.pkl"
    spec_path.write_bytes(pickle.dumps(spec))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from moe_lab.tools.bench_engine import spawn_worker; "
            "sys.exit(spawn_worker(sys.argv[2], int(sys.argv[3])))")
    pkg_parent = str(Path(__file__).resolve().parents[2])
    procs, errs = [], []
    t_launch, t0 = time.time(), time.perf_counter()
    try:
        for r in range(world):
            env = dict(os.environ, RANK=str(r), LOCAL_RANK=str(r), WORLD_SIZE=str(world), MASTER_ADDR="127.0.0.1",
                       MASTER_PORT=str(spec["port"]))  # what torchrun gives its workers
            errs.append(open(work / f"rank{r}.err", "w"))
            procs.append(subprocess.Popen([sys.executable, "-c", code, pkg_parent, str(spec_path), str(r)],
                                          stdin=subprocess.DEVNULL, stdout=subprocess.DEVNULL, stderr=errs[-1],
                                          env=env))
        _wait(procs, work, t0 + timeout_s + 60)
        total = time.perf_counter() - t0
        per_rank = [pickle.loads((work / f"rank{r}.pkl").read_bytes()) for r in range(world)]
    finally:
        for p in procs:
            if p.poll() is None:
                p.kill()
                p.wait()
        for f in errs:
            f.close()
        shutil.rmtree(work, ignore_errors=True)
    return {"total_s": total, "ready_s": max(o["t_ready"] for o in per_rank) - t_launch, "per_rank": per_rank}


def _wait(procs: list, work: Path, deadline: float) -> None:
    while True:
        codes = [p.poll() for p in procs]
        bad = [(r, c) for r, c in enumerate(codes) if c not in (None, 0)]
        if bad:
            r, c = bad[0]
            tail = (work / f"rank{r}.err").read_text(errors="replace").strip().splitlines()[-5:]
            raise RuntimeError(f"fresh spawn: rank {r} exited with code {c}: " + " | ".join(tail))
        if all(c == 0 for c in codes):
            return
        if time.perf_counter() > deadline:
            running = [r for r, c in enumerate(codes) if c is None]
            raise RuntimeError(f"fresh spawn: rank(s) {running} still running after the timeout; killed")
        time.sleep(0.02)


# ---------------------------------------------------------------------------------------------- controller


def run(device: str | None = "cpu", engines: int | None = None, config: MoEConfig | None = None, repeats: int = 3,
        quick: bool = False, *, cut: int = 90, timeout_s: float = 300.0) -> dict:
    """Measure the warm cluster against one fresh spawn per config; every figure is a median over `repeats`.

    config: the layer (default: the seed report's on cuda, `MoEConfig()` on cpu and with quick=True).
    quick:  2 configs, repeats=1, and the small layer unless `config` is given: for CI.
    """
    from ..controller.cluster import Cluster
    from ..controller.placement import default_config
    from ..experiments import probe, protocol

    if quick:
        repeats = 1
    if not isinstance(repeats, int) or isinstance(repeats, bool) or repeats < 1:
        raise ValueError(f"repeats ({repeats!r}) must be a positive integer")
    ccfg = default_config(device=device, engines=engines, timeout_s=timeout_s)
    world = ccfg.engines
    if config is None:
        config = MoEConfig.seed_report() if ccfg.device == "cuda" and not quick else MoEConfig()
    base = config.replace(dispatcher="allgather", router_dtype="none", deterministic=False)
    cfgs = sweep_configs(base, quick)
    cases = probe_cases(cfgs, cut=cut, repeats=repeats)
    protocol.check_all(cases, ccfg)  # everything checkable, before any process starts
    load = {"start": os.getloadavg()[0]}
    t_bench = time.perf_counter()

    fresh_ready = []  # quick: the sweep's spawns give the ready time (the same initialisation comes first)
    if not quick:
        logger.info("bench: %d fresh spawn(s) of %d ranks for the ready time", repeats, world)
        fresh_ready = [spawn([], world=world, device=ccfg.device, timeout_s=timeout_s)
                       for _ in range(repeats)]

    cluster_ready, warm_times, warm_results = [], [], []
    c = None
    try:
        for i in range(repeats):
            logger.info("bench: starting the cluster (%d/%d)", i + 1, repeats)
            if c is not None:
                c.stop()
            c = Cluster(ccfg).start()
            cluster_ready.append(c.timings["ready_s"])
        summary = c.summary()
        logger.info("bench: warm sweep of %d configs x %d", len(cfgs), repeats)
        for _ in range(repeats):
            t_all, res = 0.0, {}
            for cfg, case in zip(cfgs, cases):
                t0 = time.perf_counter()
                per_rank = c.run(probe.on_engine, case.payload(world), what=f"bench {label(cfg)}")
                t_all += time.perf_counter() - t0
                res[label(cfg)] = case_summary(case, per_rank)
            warm_times.append(t_all)
            warm_results.append(res)
        load["warm_sweep"] = os.getloadavg()[0]
        memory = c.run(bench_engine.peak_memory, what="bench peak memory")
        cap = c.run(bench_engine.time_capture, {"moe": base.asdict()}, rounds=max(10 * repeats, 20),
                    what="bench capture overhead")
        memory_cap = c.run(bench_engine.peak_memory, what="bench peak memory after capture")
        out_shape = [base.seq_len, 1, base.hidden]  # model.make_tokens: [seq, batch 1, hidden]
        bytes_bench = c.run(bench_engine.fingerprint_bytes, out_shape, base.dtype, what="bench fingerprint bytes")
        bytes_seed = c.run(bench_engine.fingerprint_bytes, list(SEED_SHAPE), "bf16", what="bench fingerprint bytes (seed shape)")
    finally:
        if c is not None:
            c.stop()

    logger.info("bench: fresh sweep, one spawn per config, %d configs x %d", len(cfgs), repeats)
    fresh_times, fresh_results, fresh_rss = [], [], []
    for _ in range(repeats):
        t_all, res = 0.0, {}
        for cfg, case in zip(cfgs, cases):
            s = spawn([case.payload(world)], world=world, device=ccfg.device, timeout_s=timeout_s)
            t_all += s["total_s"]
            res[label(cfg)] = case_summary(case, [r["results"][0] for r in s["per_rank"]])
            fresh_rss.append(max(r["max_rss_bytes"] for r in s["per_rank"]))
            if quick:
                fresh_ready.append(s)
        fresh_times.append(t_all)
        fresh_results.append(res)
    load["end"] = os.getloadavg()[0]

    result = {
        "machine": _machine(summary),
        "settings": {"device": ccfg.device, "world": world, "backend": summary.get("backend"), "repeats": repeats,
                     "quick": quick, "cut": cut, "config": base.asdict(), "configs": [label(cfg) for cfg in cfgs],
                     "fresh_spawn": "world fresh Python processes (torchrun's workers, without its launcher)"},
        "load_1min": load,
        "ready": _ready(cluster_ready, fresh_ready, quick),
        "sweep": _sweep(cfgs, warm_times, fresh_times, warm_results, fresh_results, statistics.median(cluster_ready),
                        device=ccfg.device),
        "capture": _capture(cap, base),
        "bytes": {"seed_shape": _bytes(bytes_seed), "bench_shape": _bytes(bytes_bench)},
        "memory": dict(_memory(memory), with_capture=_memory(memory_cap), fresh_max_rss_bytes=max(fresh_rss)),
        "bench_s": time.perf_counter() - t_bench,
    }
    result["targets"] = _targets(result, base)
    return result


def capture_overhead(device: str | None = "cpu", engines: int | None = None, config: MoEConfig | None = None,
                     rounds: int = 40, timeout_s: float = 300.0) -> dict:
    """Only the capture-overhead part of the bench, with more rounds: one cluster, `rounds` paired rounds of the four
    capture modes (plain first in rotation), the seed report's layer on cuda. For resolving a few-% overhead."""
    from ..controller.cluster import Cluster
    from ..controller.placement import default_config

    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 2:
        raise ValueError(f"rounds ({rounds!r}) must be an integer >= 2")
    ccfg = default_config(device=device, engines=engines, timeout_s=timeout_s)
    config = config or (MoEConfig.seed_report() if ccfg.device == "cuda" else MoEConfig())
    base = config.replace(dispatcher="allgather", router_dtype="none", deterministic=False)
    with Cluster(ccfg) as c:
        cap = c.run(bench_engine.time_capture, {"moe": base.asdict()}, rounds=rounds, what="bench capture overhead")
        return {"machine": _machine(c.summary()), "capture": _capture(cap, base), "rounds": rounds}


def _memory(per_rank: list[dict]) -> dict:
    return {"per_rank": per_rank, "max_rss_bytes": max(m["max_rss_bytes"] for m in per_rank),
            "cuda_max_allocated_bytes": max((m["cuda_max_allocated_bytes"] or 0) for m in per_rank) or None}


def _median(xs):
    return statistics.median(xs) if xs else None


def _machine(summary: dict) -> dict:
    return {"host": platform.node(), "cores": os.cpu_count(), "gpu": summary.get("gpu"),
            "python": platform.python_version(), "torch": summary.get("torch"),
            "megatron_core": summary.get("megatron_core"), "nccl": summary.get("nccl"),
            "date": datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds")}


def _ready(cluster_ready: list[float], fresh: list[dict], quick: bool) -> dict:
    c, f = _median(cluster_ready), _median([s["ready_s"] for s in fresh])
    return {"fresh_from": "the sweep's spawns" if quick else "spawns that only initialise and exit",
            "cluster_s": cluster_ready, "cluster_median_s": c, "fresh_s": [s["ready_s"] for s in fresh],
            "fresh_median_s": f, "fresh_total_s": [s["total_s"] for s in fresh],
            "fresh_total_median_s": _median([s["total_s"] for s in fresh]), "ratio": f / c}


def comparable(cfg: MoEConfig, device: str) -> bool:
    """Whether two runs of `cfg` must give the same bits: always on CPU (gloo, CPU kernels, no atomics); on GPU only
    in deterministic mode — without it the combine's scatter_add_ atomics and NCCL's algorithm choice make every run a
    sample (notebooks 01/04 measure it: a rerun on the same rank differs), so warm vs fresh cannot be held equal."""
    return device == "cpu" or cfg.deterministic


def _sweep(cfgs, warm_times, fresh_times, warm_results, fresh_results, ready_s, device: str = "cpu") -> dict:
    ref = warm_results[0]
    strict = {label(c) for c in cfgs if comparable(c, device)}
    mismatches, run_to_run = [], []
    for path, runs in (("warm", warm_results), ("fresh", fresh_results)):
        for i, res in enumerate(runs):
            for name, summ in res.items():
                if summ != ref[name]:
                    diff = sorted(k for k in summ if summ[k] != ref[name].get(k))
                    msg = f"{name}: {path} run {i + 1} differs from warm run 1 in {diff}"
                    (mismatches if name in strict else run_to_run).append(msg)
    n = len(cfgs)
    warm, fresh = _median(warm_times), _median(fresh_times)
    warm_case, fresh_case = warm / n, fresh / n
    return {"n_configs": n, "warm_s": warm_times, "fresh_s": fresh_times, "warm_median_s": warm,
            "fresh_median_s": fresh, "warm_per_config_s": warm_case, "fresh_per_config_s": fresh_case,
            "ratio": fresh / warm, "ratio_incl_start": fresh / (ready_s + warm),
            "break_even_configs": ready_s / (fresh_case - warm_case) if fresh_case > warm_case else None,
            "results_equal": not mismatches, "mismatches": mismatches, "n_compared": len(strict),
            "run_to_run": run_to_run, "results": ref}


def _capture(per_rank: list[dict], cfg: MoEConfig) -> dict:
    """Per mode: the slowest rank's median forward, and the overhead against plain from paired rounds (median ratio
    with its 95 % interval, stats.paired) — the one cost definition the notebooks use too."""
    rounds = {m: stats.slowest([r["times_s"][m] for r in per_rank]) for m in _CAPTURE_MODES}
    ms = {m: 1e3 * statistics.median(v) for m, v in rounds.items()}
    cost = {m: stats.paired(rounds[m], rounds["plain"]) for m in _CAPTURE_MODES if m != "plain"}
    return {"config": label(cfg), "stages": per_rank[0]["stages"], "forward_ms": ms, "rounds": len(rounds["plain"]),
            "overhead_pct": {m: 100 * (c["ratio"] - 1) for m, c in cost.items()},
            "overhead_ci_pct": {m: [100 * (c["ci"][0] - 1), 100 * (c["ci"][1] - 1)] for m, c in cost.items()}}


def _bytes(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    world = len(per_rank)
    fp_total = sum(r["sent_bytes"] for r in per_rank)
    return {"shape": r0["shape"], "dtype": r0["dtype"], "world": world, "fingerprint_bytes": fp_total,
            "fingerprint_bytes_per_rank": r0["sent_bytes"], "full_bytes": r0["full_bytes"],
            "pct": 100 * fp_total / r0["full_bytes"],
            "exchange_ms": 1e3 * max(r["exchange_s"] for r in per_rank)}


def _targets(res: dict, cfg: MoEConfig) -> list[dict]:
    s, cap, b = res["sweep"], res["capture"], res["bytes"]["seed_shape"]
    st = res["settings"]
    seed_gpu = st["device"] == "cuda" and cfg == MoEConfig.seed_report()
    fp_pct = cap["overhead_pct"]["fingerprint"]
    fp_ci = cap["overhead_ci_pct"]["fingerprint"]
    values = {"sweep_speedup": s["ratio"], "fingerprint_overhead_pct": fp_pct, "compare_bytes_pct": b["pct"]}
    reasons = {
        "sweep_speedup": (f"a fresh spawn costs {s['fresh_per_config_s']:.1f} s per config (of which "
                          f"{res['ready']['fresh_median_s']:.1f} s to start {st['world']} processes, import torch + "
                          f"megatron-core and join the process group) against {s['warm_per_config_s']:.2f} s on the "
                          f"warm cluster; load average {res['load_1min']['start']:.1f}–{res['load_1min']['end']:.1f} "
                          f"on {res['machine']['cores']} cores"),
        "fingerprint_overhead_pct": (
            f"capture adds {cap['forward_ms']['fingerprint'] - cap['forward_ms']['plain']:.2f} ms (hooks, a clone "
            f"of the output, its fingerprint) to a {cap['forward_ms']['plain']:.2f} ms forward"
            + ("" if seed_gpu else f"; the target is for the seed report's layer on GPUs, this is {st['device']} "
               f"with hidden {cfg.hidden}, {cfg.num_experts} experts, {cfg.seq_len} tokens, where the fixed cost "
               "is not amortised")),
        "compare_bytes_pct": (f"fingerprints: {b['fingerprint_bytes']} B against {b['full_bytes']} B of full "
                              f"tensors over {b['world']} ranks"),
    }
    notes = {}
    if fp_ci[0] <= 0 <= fp_ci[1]:
        notes["fingerprint_overhead_pct"] = (f"its 95 % interval ({fp_ci[0]:+.1f} … {fp_ci[1]:+.1f} %) includes 0: "
                                             "not resolved from the noise")
    out = []
    for name, (rule, bound) in TARGETS.items():
        v = values[name]
        met = {">=": v >= bound, "<=": v <= bound, "<": v < bound}[rule]
        out.append({"name": name, "rule": f"{rule} {bound:g}", "value": v, "met": bool(met),
                    "reason": None if met else reasons[name], "note": notes.get(name)})
    return out
