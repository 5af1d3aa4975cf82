"""Runs on the bench's engines and on its freshly spawned ranks (`moe-lab bench`): capture timing, the bytes a
fingerprint comparison moves, peak memory, and the spawned rank's main."""

from __future__ import annotations

import os
import pickle
import sys
import time
from pathlib import Path


def time_capture(payload: dict, *, rounds: int = 10) -> dict:
    """Median forward time of the layer plain, with fingerprint capture (moe.out only, fingerprinted), with full
    capture (every stage + collective ledger), and full capture + a fingerprint of every stage: `rounds` paired rounds
    of the four modes in a rotating order (a change of load on the machine hits them alike), after one warm-up."""
    from .. import metrics
    from ..engine import capture, compat, toolkit

    s = toolkit.setup(payload["moe"], payload.get("layout"))
    cfg, layer, tokens = s.cfg, s.layer, s.tokens
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

    modes = {"plain": plain, "fingerprint": fingerprint, "capture": full, "capture_fingerprints": lambda: full(True)}
    times = toolkit.paired_rounds(modes, rounds, warmup=1, rotate=True, collectives=False)["wall_s"]
    return {"rank": toolkit.tdist.get_rank(), "times_s": times, "stages": len(stages)}


def time_collective_timer(payload: dict, *, rounds: int = 20) -> dict:
    """What the collective timer of paired_rounds costs: the same forward timed plain and with its collectives timed
    (capture.collective_timer), `rounds` paired rounds in a rotating order after one warm-up; with each round's
    collective seconds and whether every output was bitwise equal to the first (fingerprints). The controller reads
    the overhead with stats.paired(slowest(timed), slowest(plain))."""
    from .. import metrics
    from ..engine import toolkit

    s = toolkit.setup(payload["moe"], payload.get("layout"))
    outs = []

    def fwd():
        outs.append(toolkit.forward(s.layer, s.tokens))  # fingerprinted after the rounds, outside the clock

    t = toolkit.paired_rounds({"plain": fwd, "timed": fwd}, rounds, warmup=1, rotate=True, collectives=("timed",))
    fps = {metrics.fingerprint(o) for o in outs}
    return {"rank": toolkit.tdist.get_rank(), **t, "outputs_equal": len(fps) == 1, "forwards": len(outs)}


def fingerprint_bytes(shape: list[int], dtype: str = "bf16") -> dict:
    """Engine side: bytes this rank sends to compare one [shape] output across ranks by fingerprint (counted at
    `all_gather`, which `all_gather_object` calls), against gathering the full tensors (world x numel x size)."""
    import torch
    import torch.distributed as tdist
    from torch.distributed import distributed_c10d as c10d

    from .. import metrics
    from ..engine import compat
    from ..engine.dist import STATE

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

    from ..engine.dist import STATE

    rss = resource.getrusage(resource.RUSAGE_SELF).ru_maxrss
    rss *= 1 if sys.platform == "darwin" else 1024  # Linux reports KiB
    cuda = None
    if STATE.get("device") == "cuda":
        cuda = torch.cuda.max_memory_allocated(STATE["torch_device"])
    return {"rank": STATE.get("rank"), "max_rss_bytes": rss, "cuda_max_allocated_bytes": cuda}


def spawn_worker(spec_path: str, rank: int) -> int:
    """One rank of a fresh spawn (the usual way): join the process group, set up parallel_state, health all-reduce,
    run the spec's cases with the probe's engine function (as the warm cluster does), tear down; writes its results
    next to the spec."""
    t_start = time.time()
    with open(spec_path, "rb") as f:
        spec = pickle.load(f)
    from ..engine import dist
    from ..experiments import probe

    out: dict = {"rank": rank, "t_start": t_start, "results": []}
    dist.setup(rank=rank, world=spec["world"], master_addr="127.0.0.1", master_port=spec["port"],
               device=spec["device"], timeout_s=spec["timeout_s"])
    try:
        dist.health_check()
        out["t_ready"] = time.time()
        for payload in spec["cases"]:
            out["results"].append(probe.on_engine(payload))
        out.update(peak_memory())
    finally:
        dist.teardown()
    out["t_done"] = time.time()
    path = Path(spec_path).with_name(f"rank{rank}.pkl")
    with open(f"{path}.tmp", "wb") as f:
        pickle.dump(out, f)
    os.replace(f"{path}.tmp", path)
    return 0
