"""`moe-lab bench`: the warm lab against the usual way (a fresh process group per config), in one run (#8)."""

from __future__ import annotations

import argparse
import datetime
import itertools
import json
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

from .config import DISPATCHERS, MoEConfig

logger = logging.getLogger(__name__)

SEED_SHAPE = (1024, 4096)  # the seed report's MoE output, [tokens x hidden] in bf16
TARGETS = {  # name → (rule, bound): the targets
    "sweep_speedup": (">=", 3.0),
    "fingerprint_overhead_pct": ("<=", 5.0),
    "compare_bytes_pct": ("<", 1.0),
}
_CAPTURE_MODES = ("plain", "fingerprint", "capture", "capture_fingerprints")


def sweep_configs(base: MoEConfig, quick: bool = False) -> list[MoEConfig]:
    """dispatcher x router dtype {none, fp32, fp64} x deterministic {off, on} (12); quick: router {none, fp32}, off (4)."""
    routers = ("none", "fp32") if quick else ("none", "fp32", "fp64")
    dets = (False,) if quick else (False, True)
    return [base.replace(dispatcher=d, router_dtype=r, deterministic=det)
            for d, r, det in itertools.product(DISPATCHERS, routers, dets)]


def label(cfg: MoEConfig) -> str:
    return f"{cfg.dispatcher}/{cfg.router_dtype}" + ("/det" if cfg.deterministic else "")


def case_summary(per_rank: list[dict]) -> dict:
    """What both paths must agree on for one case: the three comparisons and rank 0's output fingerprints."""
    from .measure import worst

    r0 = per_rank[0]
    return {"cross_rank": r0["cross_rank"], "rerun": worst([r["rerun"] for r in per_rank]),
            "truncation": worst([r["truncation"] for r in per_rank]),
            "fingerprints": r0["cross_rank_detail"]["fingerprints"],
            "bytes_compared": r0["cross_rank_detail"]["bytes_compared"]}


# ---------------------------------------------------------------------------------------------- engine side


def time_capture(cfg_dict: dict, *, repeats: int = 10) -> dict:
    """Engine side: median forward time of the layer plain, with fingerprint capture (moe.out only, fingerprinted),
    with full capture (every stage + collective ledger), and full capture + a fingerprint of every stage."""
    import torch.distributed as tdist

    from . import capture, compat, measure, metrics, model
    from .dist import STATE

    cfg = MoEConfig(**cfg_dict)
    layer = measure.get_layer(cfg)
    tokens = model.make_tokens(cfg, STATE["torch_device"])
    stages = []

    def plain():
        compat.moe_forward(layer, tokens)

    def fingerprint():
        cache = capture.Cache()
        with capture.capture_hooks(layer, cache, names_filter="moe.out"):
            compat.moe_forward(layer, tokens)
        metrics.fingerprint(cache.tensors["moe.out"])

    def full(fingerprints: bool = False):
        _, cache = capture.run_with_capture(layer, tokens, hidden=cfg.hidden, num_experts=cfg.num_experts)
        if fingerprints:
            for t in cache.tensors.values():
                metrics.fingerprint(t)
        stages[:] = list(cache.tensors)

    modes = {"plain": plain, "fingerprint": fingerprint, "capture": full,
             "capture_fingerprints": lambda: full(True)}
    times: dict[str, list[float]] = {m: [] for m in modes}
    names = list(modes)
    for i in range(repeats + 1):  # round 0 warms up every mode (first-call allocations, the fingerprint table)
        # Modes interleaved, in a rotating order: a change of load on the machine hits them alike.
        for m in names[i % len(names):] + names[:i % len(names)]:
            fn = modes[m]
            tdist.barrier()
            measure._sync()
            t0 = time.perf_counter()
            fn()
            measure._sync()
            if i:
                times[m].append(time.perf_counter() - t0)
    return {"rank": tdist.get_rank(), "median_s": {m: statistics.median(v) for m, v in times.items()},
            "iqr_s": {m: _iqr(v) for m, v in times.items()}, "times_s": times, "stages": len(stages)}


def _iqr(xs: list[float]) -> float:
    if len(xs) < 2:
        return 0.0
    q1, _, q3 = statistics.quantiles(xs, n=4)
    return q3 - q1


def fingerprint_bytes(shape: list[int], dtype: str = "bf16") -> dict:
    """Engine side: bytes this rank sends to compare one [shape] output across ranks by fingerprint (counted at
    `all_gather`, which `all_gather_object` calls), against gathering the full tensors (world x numel x size)."""
    import torch
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    from . import compat, metrics
    from .dist import STATE

    out = torch.zeros(shape, dtype=compat.torch_dtype(dtype), device=STATE["torch_device"])
    fp = metrics.fingerprint(out)
    sent = []
    orig = c10d.all_gather

    def counting(tensor_list, tensor, *a, **k):
        sent.append(tensor.numel() * tensor.element_size())
        return orig(tensor_list, tensor, *a, **k)

    world = tdist.get_world_size()
    fps: list = [None] * world
    c10d.all_gather = counting
    try:
        tdist.barrier()
        t0 = time.perf_counter()
        tdist.all_gather_object(fps, fp)
        t_exchange = time.perf_counter() - t0
    finally:
        c10d.all_gather = orig
    if len(set(fps)) != 1:
        raise RuntimeError(f"rank {tdist.get_rank()}: fingerprints of equal zero tensors differ: {fps}")
    return {"rank": tdist.get_rank(), "shape": list(shape), "dtype": dtype, "fingerprint": fp,
            "sent_bytes": sum(sent), "exchange_s": t_exchange,
            "full_bytes": world * out.numel() * out.element_size()}


def peak_memory() -> dict:
    """Engine side (or a spawned rank): peak resident memory of this process, and peak CUDA memory on GPUs."""
    import resource

    import torch

    from .dist import STATE

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    cuda = None
    if STATE.get("device") == "cuda":
        cuda = torch.cuda.max_memory_allocated(STATE["torch_device"])
    return {"rank": STATE.get("rank"), "max_rss_bytes": rss, "cuda_max_allocated_bytes": cuda}


# ---------------------------------------------------------------------------------------------- the usual way


def spawn_worker(spec_path: str, rank: int) -> int:
    """One rank of a fresh spawn (the usual way): join the process group, set up parallel_state, health all-reduce,
    run the spec's cases with `measure.run_case`, tear down; writes its results next to the spec."""
    t_start = time.time()
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    from . import dist, measure

    out: dict = {"rank": rank, "t_start": t_start, "results": []}
    dist.setup(rank=rank, world=spec["world"], master_addr="127.0.0.1", master_port=spec["port"],
               device=spec["device"], tp=spec["tp"], timeout_s=spec["timeout_s"])
    try:
        dist.health_check()
        out["t_ready"] = time.time()
        for cfg_dict in spec["cases"]:
            out["results"].append(measure.run_case(cfg_dict, cut=spec["cut"], repeats=spec["repeats"]))
        out.update(peak_memory())
    finally:
        dist.teardown()
    out["t_done"] = time.time()
    path = Path(spec_path).with_name(f"rank{rank}.pkl")
    with open(f"{path}.tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(f"{path}.tmp", path)
    return 0


def spawn(cases: list[dict], *, world: int, device: str, tp: int = 1, cut: int = 90, repeats: int = 1,
          timeout_s: float = 300.0) -> dict:
    """`world` fresh Python processes, one rank each, as torchrun starts its workers (without torchrun's own
    launcher process: a lower bound on its cost). Returns wall times and every rank's results."""
    from .dist import free_port

    work = Path(tempfile.mkdtemp(prefix="moe_lab_bench_"))
    spec = dict(world=world, port=free_port(), device=device, tp=tp, cut=cut, repeats=repeats,
                timeout_s=timeout_s, cases=cases)
    spec_path = work / "spec.pkl"
    spec_path.write_bytes(pickle.dumps(spec))
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from moe_lab.bench import spawn_worker; "
            "sys.exit(spawn_worker(sys.argv[2], int(sys.argv[3])))")
    pkg_parent = str(Path(__file__).resolve().parents[1])
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
    quick:  4 configs, repeats=1, and the small layer unless `config` is given: for CI.
    """
    from . import compat, measure, probe
    from .cluster import Cluster, default_config

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
    version = compat.installed_version()
    for cfg in cfgs:  # everything checkable, before any process starts
        probe.check_case(cfg, world, version, cut)
    load = {"start": os.getloadavg()[0]}
    t_bench = time.perf_counter()

    fresh_ready = []  # quick: the sweep's spawns give the ready time (the same initialisation comes first)
    if not quick:
        logger.info("bench: %d fresh spawn(s) of %d ranks for the ready time", repeats, world)
        fresh_ready = [spawn([], world=world, device=ccfg.device, tp=ccfg.tp, timeout_s=timeout_s)
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
            for cfg in cfgs:
                t0 = time.perf_counter()
                per_rank = c.run(measure.run_case, cfg.asdict(), cut=cut, repeats=repeats, what=f"bench {label(cfg)}")
                t_all += time.perf_counter() - t0
                res[label(cfg)] = case_summary(per_rank)
            warm_times.append(t_all)
            warm_results.append(res)
        load["warm_sweep"] = os.getloadavg()[0]
        memory = c.run(peak_memory, what="bench peak memory")
        cap = c.run(time_capture, base.asdict(), repeats=max(10 * repeats, 20), what="bench capture overhead")
        memory_cap = c.run(peak_memory, what="bench peak memory after capture")
        out_shape = [base.seq_len, 1, base.hidden]  # model.make_tokens: [seq, batch 1, hidden]
        bytes_bench = c.run(fingerprint_bytes, out_shape, base.dtype, what="bench fingerprint bytes")
        bytes_seed = c.run(fingerprint_bytes, list(SEED_SHAPE), "bf16", what="bench fingerprint bytes (seed shape)")
    finally:
        if c is not None:
            c.stop()

    logger.info("bench: fresh sweep, one spawn per config, %d configs x %d", len(cfgs), repeats)
    fresh_times, fresh_results, fresh_rss = [], [], []
    for _ in range(repeats):
        t_all, res = 0.0, {}
        for cfg in cfgs:
            s = spawn([cfg.asdict()], world=world, device=ccfg.device, tp=ccfg.tp, cut=cut, repeats=repeats,
                      timeout_s=timeout_s)
            t_all += s["total_s"]
            res[label(cfg)] = case_summary([r["results"][0] for r in s["per_rank"]])
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
    from .cluster import Cluster, default_config

    if not isinstance(rounds, int) or isinstance(rounds, bool) or rounds < 2:
        raise ValueError(f"rounds ({rounds!r}) must be an integer >= 2")
    ccfg = default_config(device=device, engines=engines, timeout_s=timeout_s)
    config = config or (MoEConfig.seed_report() if ccfg.device == "cuda" else MoEConfig())
    base = config.replace(dispatcher="allgather", router_dtype="none", deterministic=False)
    with Cluster(ccfg) as c:
        cap = c.run(time_capture, base.asdict(), repeats=rounds, what="bench capture overhead")
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
    # The slowest rank bounds a step: per mode, the worst rank's median.
    ms = {m: 1e3 * max(r["median_s"][m] for r in per_rank) for m in _CAPTURE_MODES}
    # Run-to-run spread of the plain forward: an overhead smaller than this is not resolved on this machine.
    noise = max(100 * r["iqr_s"]["plain"] / r["median_s"]["plain"] for r in per_rank)
    out = {"config": label(cfg), "stages": per_rank[0]["stages"], "forward_ms": ms, "plain_iqr_pct": noise,
           "overhead_pct": {m: 100 * (ms[m] / ms["plain"] - 1) for m in _CAPTURE_MODES if m != "plain"}}
    if all("times_s" in r for r in per_rank):
        out.update(_paired(per_rank))
    return out


def _paired(per_rank: list[dict]) -> dict:
    """Overhead from rounds: each round times every mode back to back, so per round mode/plain cancels what drifts
    between rounds (clocks, launch queues, load). A round's time is its slowest rank's. The spread (interquartile
    range of the per-round overheads) is what an overhead must exceed to be resolved."""
    n = len(per_rank[0]["times_s"]["plain"])
    rounds = {m: [max(r["times_s"][m][i] for r in per_rank) for i in range(n)] for m in _CAPTURE_MODES}
    pct = {m: [100 * (t / p - 1) for t, p in zip(rounds[m], rounds["plain"]) if p > 0]
           for m in _CAPTURE_MODES if m != "plain"}
    return {"paired_overhead_pct": {m: statistics.median(v) for m, v in pct.items()},
            "paired_iqr_pct": {m: _iqr(v) for m, v in pct.items()}, "rounds": n}


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
    paired = "paired_overhead_pct" in cap  # per-round ratios: the figure that resolves small overheads
    fp_pct = cap["paired_overhead_pct"]["fingerprint"] if paired else cap["overhead_pct"]["fingerprint"]
    fp_spread = cap["paired_iqr_pct"]["fingerprint"] if paired else cap["plain_iqr_pct"]
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
    if abs(values["fingerprint_overhead_pct"]) <= fp_spread:
        notes["fingerprint_overhead_pct"] = (
            f"within the spread here (interquartile range {fp_spread:.0f} %"
            + (" of the per-round overheads" if paired else " of the plain forward") + "): not resolved")
    out = []
    for name, (rule, bound) in TARGETS.items():
        v = values[name]
        met = {">=": v >= bound, "<=": v <= bound, "<": v < bound}[rule]
        out.append({"name": name, "rule": f"{rule} {bound:g}", "value": v, "met": bool(met),
                    "reason": None if met else reasons[name], "note": notes.get(name)})
    return out


# ---------------------------------------------------------------------------------------------- output


def _mb(n) -> str:
    if n is None:
        return "—"
    return f"{n / 2**20:.1f} MiB" if n >= 2**20 else f"{n / 2**10:.1f} KiB" if n >= 2**10 else f"{n} B"


def format_table(result: dict) -> str:
    """The bench result as a markdown table, with the machine and load it was measured on."""
    m, st, rd, sw, cap, mem = (result[k] for k in ("machine", "settings", "ready", "sweep", "capture", "memory"))
    cfg = st["config"]
    tgt = {t["name"]: t for t in result["targets"]}

    def verdict(name):
        t = tgt[name]
        return f"{t['rule']}: {'met' if t['met'] else 'MISSED'}"

    load = result["load_1min"]
    lines = [
        f"moe_lab bench: {st['device']}, {st['world']} ranks ({st['backend']}), hidden {cfg['hidden']} / "
        f"{cfg['num_experts']} experts / top-{cfg['topk']} / ffn {cfg['ffn_hidden']} / {cfg['seq_len']} tokens, "
        f"{cfg['dtype']}; medians of {st['repeats']}{' (quick)' if st['quick'] else ''}",
        f"{m['host']}, {m['cores']} cores, {m['gpu'] or 'no GPU'}; Python {m['python']}, torch {m['torch']}, "
        f"megatron-core {m['megatron_core']}; {m['date']}; load average (1 min) {load['start']:.1f} at start, "
        f"{load['end']:.1f} at end",
        "",
        "| what | lab (warm cluster) | usual way (fresh spawn) | fresh / lab | target |",
        "| --- | --- | --- | --- | --- |",
        f"| ready: {st['world']} processes + process group + parallel_state + health all-reduce | "
        f"{rd['cluster_median_s']:.1f} s | {rd['fresh_median_s']:.1f} s "
        + ("(in the sweep's spawns) " if st["quick"] else f"({rd['fresh_total_median_s']:.1f} s to exit) ")
        + f"| {rd['ratio']:.2f}x | |",
        f"| sweep of {sw['n_configs']} configs, results equal: {'yes' if sw['results_equal'] else 'NO'}"
        + (f" ({sw.get('n_compared', sw['n_configs'])} deterministic configs held equal)"
           if sw.get("n_compared", sw["n_configs"]) != sw["n_configs"] else "") + " | "
        f"{sw['warm_median_s']:.1f} s ({sw['warm_per_config_s']:.2f} s/config) | {sw['fresh_median_s']:.1f} s "
        f"({sw['fresh_per_config_s']:.1f} s/config) | {sw['ratio']:.1f}x | {verdict('sweep_speedup')} |",
        f"| the same sweep, cluster start included | {rd['cluster_median_s'] + sw['warm_median_s']:.1f} s | "
        f"{sw['fresh_median_s']:.1f} s | {sw['ratio_incl_start']:.1f}x | |",
        f"| forward ({cap['config']}), plain | {cap['forward_ms']['plain']:.2f} ms (interquartile range "
        f"{cap['plain_iqr_pct']:.0f} %) | | | |",
    ]
    names = {"fingerprint": "+ fingerprint capture (moe.out, fingerprinted)",
             "capture": f"+ full capture ({cap['stages']} stages + collective ledger)",
             "capture_fingerprints": "+ full capture + every stage fingerprinted"}
    for mode, text in names.items():
        paired = (f"; per round {cap['paired_overhead_pct'][mode]:+.1f} % ± {cap['paired_iqr_pct'][mode] / 2:.1f}"
                  if "paired_overhead_pct" in cap else "")
        lines.append(f"| {text} | {cap['forward_ms'][mode]:.2f} ms ({cap['overhead_pct'][mode]:+.1f} %{paired}) | | | "
                     + (verdict("fingerprint_overhead_pct") if mode == "fingerprint" else "") + " |")
    for key, what in (("seed_shape", "compare one output across ranks (seed shape)"),
                      ("bench_shape", "compare one output across ranks (this layer)")):
        b = result["bytes"][key]
        lines.append(f"| {what}: [{' x '.join(map(str, b['shape']))}] {b['dtype']}, {b['world']} ranks | "
                     f"{b['fingerprint_bytes']} B (fingerprints) | {_mb(b['full_bytes'])} (full tensors) | "
                     f"{b['pct']:.4f} % | " + (verdict("compare_bytes_pct") if key == "seed_shape" else "") + " |")
    lines.append(f"| peak memory per engine (max over ranks): RSS after the sweep, after capture | "
                 f"{_mb(mem['max_rss_bytes'])}, {_mb(mem['with_capture']['max_rss_bytes'])} | "
                 f"{_mb(mem['fresh_max_rss_bytes'])} | | |")
    if mem["cuda_max_allocated_bytes"]:
        lines.append(f"| peak CUDA memory allocated per engine: after the sweep, after capture | "
                     f"{_mb(mem['cuda_max_allocated_bytes'])}, {_mb(mem['with_capture']['cuda_max_allocated_bytes'])} "
                     "| | | |")
    missed = [t for t in result["targets"] if not t["met"]]
    noted = [t for t in result["targets"] if t["met"] and t.get("note")]
    if missed or noted or sw["mismatches"] or sw.get("run_to_run"):
        lines.append("")
    for t in missed:
        lines.append(f"- {t['name']} {t['rule']} missed ({t['value']:.3g}): {t['reason']}")
    for t in noted:
        lines.append(f"- {t['name']} {t['rule']} met ({t['value']:.3g}), but {t['note']}")
    for mm in sw["mismatches"]:
        lines.append(f"- results differ: {mm}")
    for mm in sw.get("run_to_run", []):
        lines.append(f"- not held equal (no deterministic mode on GPU: every run is a sample): {mm}")
    return "\n".join(lines)


def add_arguments(p: argparse.ArgumentParser) -> argparse.ArgumentParser:
    """The options of `moe-lab bench` (shared by cli.py and `python -m moe_lab.bench`)."""
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--engines", type=int, default=None, help="default: one per GPU (cuda) or 4 (cpu)")
    p.add_argument("--seed-report", action="store_true",
                   help="the seed report's layer (default on cuda; on cpu the small layer of MoEConfig())")
    p.add_argument("--repeats", type=int, default=3, help="every figure is the median of this many runs")
    p.add_argument("--quick", action="store_true",
                   help="4 configs, 1 repeat, the small layer unless --seed-report (CI; a short GPU run)")
    p.add_argument("--cut", type=int, default=90, help="truncation test: first CUT tokens must not change")
    p.add_argument("--timeout", type=float, default=300.0, help="seconds for every engine call and collective")
    p.add_argument("--capture-only", type=int, default=None, metavar="ROUNDS",
                   help="only the capture overhead, from ROUNDS paired rounds (no fresh spawns)")
    p.add_argument("--json", dest="json_out", default=None, metavar="OUT",
                   help="write the result as JSON to OUT ('-': stdout, the table then goes to stderr)")
    return p


def cmd(a: argparse.Namespace) -> int:
    """Run the bench for parsed arguments: table on stdout, JSON to --json; exit 1 if the two paths disagree."""
    config = MoEConfig.seed_report() if a.seed_report else None
    if a.capture_only is not None:
        res = capture_overhead(device=a.device, engines=a.engines, config=config, rounds=a.capture_only,
                               timeout_s=a.timeout)
        text = json.dumps(res, indent=2, default=str)
        cap = res["capture"]
        for mode, pct in cap["paired_overhead_pct"].items():
            print(f"{mode:22s} {cap['forward_ms'][mode]:9.2f} ms  per round {pct:+8.1f} % "
                  f"(interquartile range {cap['paired_iqr_pct'][mode]:.1f} %), {res['rounds']} rounds, {cap['config']}")
        print(f"plain                  {cap['forward_ms']['plain']:9.2f} ms")
        if a.json_out:
            Path(a.json_out if a.json_out != "-" else "/dev/stdout").write_text(text + "\n")
        return 0
    res = run(device=a.device, engines=a.engines, config=config, repeats=a.repeats, quick=a.quick, cut=a.cut,
              timeout_s=a.timeout)
    table = format_table(res)
    text = json.dumps(res, indent=2, default=str)
    if a.json_out == "-":
        print(table, file=sys.stderr)
        print(text)
    else:
        print(table)
        if a.json_out:
            Path(a.json_out).write_text(text + "\n")
        else:
            print()
            print(text)
    return 0 if res["sweep"]["results_equal"] else 1


def main(argv=None) -> int:
    ap = add_arguments(argparse.ArgumentParser(prog="moe-lab bench", description=__doc__))
    a = ap.parse_args(argv)
    logging.basicConfig(level=logging.INFO, format="%(asctime)s %(name)s %(levelname)s %(message)s", stream=sys.stderr)
    logging.getLogger("megatron").setLevel(logging.WARNING)  # its import-time INFO lines are not bench figures
    try:
        return cmd(a)
    except ValueError as e:  # bad input: one line, exit 2, nothing launched
        print(f"moe-lab bench: error: {e}", file=sys.stderr)
        return 2
    except KeyboardInterrupt:
        print("moe-lab bench: interrupted; engines and spawned ranks stopped", file=sys.stderr)
        return 130


if __name__ == "__main__":
    # Run the imported module's main: functions defined in __main__ would reach the engines by value, not by name.
    from moe_lab.bench import main as _main

    sys.exit(_main())
