"""`moe-lab probe`: its options, the layers they choose, and the run — one JSON object per config on stdout, its
headline and the verdict on stderr (the comparisons are moe_lab.experiments.probe)."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import MAX_DIM, MAX_REPEATS
from .argtypes import (count as _count, model_list as _models, nonempty as _nonempty, scale as _scale,
                       seconds as _seconds)
from .options import add_launcher_arguments, launcher_kwargs


def _csv(allowed):
    def parse(s: str) -> list[str]:
        vals = [v.strip() for v in s.split(",") if v.strip()]
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise argparse.ArgumentTypeError(f"{s!r}: each value must be one of {', '.join(allowed)}")
        return vals
    return parse


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..config import DISPATCHERS, ROUTER_DTYPES

    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--engines", type=_count(), default=None,
                   help="ranks (= EP x TP); default one per GPU (cuda) or 4 (cpu). On cuda a multiple of the GPUs: "
                        "k x GPUs puts k ranks on each GPU over gloo (virtual EP)")
    p.add_argument("--gpus", type=_count(), default=None, help="cuda: GPUs to use (default all visible)")
    p.add_argument("--trials", type=_count(1, MAX_REPEATS), default=None,
                   help="trials of each comparison (default 5 on cuda, 3 on cpu)")
    p.add_argument("--dispatcher", type=_csv(DISPATCHERS), default=["allgather"], help="comma list")
    p.add_argument("--router-dtype", type=_csv(ROUTER_DTYPES), default=["none"], help="comma list: none,fp32,fp64")
    p.add_argument("--hidden", type=_count(1, MAX_DIM), default=256)
    p.add_argument("--experts", type=_count(1, MAX_DIM), default=8)
    p.add_argument("--topk", type=_count(1, MAX_DIM), default=4)
    p.add_argument("--ffn", type=_count(1, MAX_DIM), default=512)
    p.add_argument("--seq", type=_count(2, MAX_DIM), default=128)
    p.add_argument("--cut", type=int, default=90, help="truncation test: first CUT tokens must not change")
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--tp", type=_count(), default=1)
    p.add_argument("--deterministic", action="store_true", help="torch deterministic algorithms (+NCCL_ALGO=Ring)")
    p.add_argument("--seed-report", action="store_true",
                   help="the seed report's layer: 4096/64 experts/top-6/1024 tokens/ffn 16384")
    p.add_argument("--model", type=_models, default=None, help="model presets' layers, comma list, one cluster for "
                                                               "all (moe-lab preflight lists what each runs): e.g. "
                                                               "qwen3-30b-a3b,deepseek-v3")
    p.add_argument("--scale", type=_scale, default=1.0, help="with --model: shrink hidden and ffn (e.g. 0.125)")
    p.add_argument("--megatron", type=_nonempty("--megatron"), default=None,
                   help="a release installed with `moe-lab versions install`")
    p.add_argument("--timeout", type=_seconds, default=300.0, help="seconds for every engine call and collective")
    p.add_argument("--start-timeout", type=_seconds, default=120.0,
                   help="seconds for the engines to start and register (a Slurm job may wait in the queue)")
    p.add_argument("--json", action="store_true", help="only JSON lines on stdout")
    add_launcher_arguments(p)


def _configs(a) -> list:
    from ..config import MoEConfig, check_cut

    if a.model and a.seed_report:
        raise ValueError("--model and --seed-report each choose the layer: give one")
    if a.scale != 1 and not a.model:
        raise ValueError("--scale needs --model (it scales a preset)")
    if a.model:
        from .. import models

        bases = [models.moe_config(m, a.scale, seq_len=a.seq, seed=a.seed, deterministic=a.deterministic)
                 for m in a.model]
        check_cut(a.cut, a.seq, "--cut")
        return [b.replace(dispatcher=d, router_dtype=r) for b in bases for d in a.dispatcher for r in a.router_dtype]
    elif a.seed_report:
        base = MoEConfig.seed_report(seed=a.seed, deterministic=a.deterministic)
    else:
        base = MoEConfig(hidden=a.hidden, num_experts=a.experts, topk=a.topk, ffn_hidden=a.ffn, seq_len=a.seq,
                         seed=a.seed, deterministic=a.deterministic)
    cfgs = [base.replace(dispatcher=d, router_dtype=r) for d in a.dispatcher for r in a.router_dtype]
    check_cut(a.cut, base.seq_len, "--cut")
    return cfgs


def check(a):
    """Everything `moe-lab probe` is given, checked before torch is imported or anything starts (a ValueError, one
    line, exit 2): the layers, the cut, the release, the cluster (engines against this machine's CPUs or GPUs, the
    launcher and its options), the layout on the world, and the memory the ranks need (per GPU, or of the machine
    for CPU engines). Returns (layers, ClusterConfig, layout). Only device 'cuda', or none given with a CUDA or
    ROCm build of torch, imports torch here, to count the GPUs (`placement.visible_gpus`)."""
    from ..controller import placement
    from ..controller.launchers import launcher_settings
    from ..layout import Layout
    from ..tools import preflight, scale_plan

    cfgs = _configs(a)
    if a.megatron:
        from ..release_dirs import path_for

        path_for(a.megatron)  # installed side by side? one line if not
    ccfg = placement.default_config(device=a.device, engines=a.engines, gpus=a.gpus, timeout_s=a.timeout,
                                    start_timeout_s=a.start_timeout, deterministic=a.deterministic,
                                    **launcher_kwargs(a))
    launcher_settings(ccfg)  # a bad option or a missing mpiexec/sbatch/ssh: exit 2 before anything starts
    layout = Layout(tp=a.tp, ep=0)  # the experts over the rest of the world
    for cfg in cfgs:
        try:
            layout.on(ccfg.engines).check_layer(cfg)
        except ValueError as e:
            raise ValueError(f"--engines {ccfg.engines}, --tp {a.tp}: {e}") from None
    scale_plan.check_memory(cfgs, ccfg, cut=a.cut, layout=layout)
    preflight.check_host_memory(cfgs, ccfg, cut=a.cut, layout=layout)
    return cfgs, ccfg, layout


def cmd(a) -> int:
    cfgs, ccfg, layout = check(a)
    from ..controller.cluster import Cluster
    from ..experiments import probe, protocol

    release = a.megatron or protocol.INSTALLED
    trials = a.trials or (5 if ccfg.device == "cuda" else 3)
    cases = [probe.case(cfg, cut=a.cut, trials=trials, release=release, layout=layout) for cfg in cfgs]
    protocol.check_all(cases, ccfg)  # the release's features, each case against the world once more
    with Cluster(ccfg) as c:
        if not a.json:
            print(f"# cluster ready in {c.timings['ready_s']:.1f} s: {c.config.placement}, {c.summary()}",
                  file=sys.stderr)

        def show(rec):
            rec["ready_s"] = round(c.timings["ready_s"], 2)
            print(json.dumps(rec, default=str), flush=True)
            if not a.json:
                print("# " + probe.headline(rec), file=sys.stderr)

        recs = protocol.run(probe, cluster=c, cases=cases, on_record=show, notebook="")
    if not a.json:  # the summary: notebook 01's findings over these records, as every report renders them
        print(summary(recs), file=sys.stderr)
    return 0


def summary(records: list[dict]) -> str:
    """`moe-lab probe`'s summary: notebook 01's findings over the probe's records, rendered — one block per layer when
    several were probed (`--model a,b`), titled with the layer (its preset and features)."""
    from ..findings import render
    from ..findings.model import subject_of
    from ..questions.reproduce import findings as found

    by_layer: dict[str, list[dict]] = {}
    for r in records:
        by_layer.setdefault(subject_of(r)["layer"], []).append(r)
    if len(by_layer) <= 1:
        return render.verdict(found.findings(records))
    return "\n\n".join(render.verdict(found.findings(rs), title=f"{layer}:") for layer, rs in by_layer.items())
