"""`moe-lab oracle`: notebook 08 on one layer (yours, a model preset's, or the seed report's) and a list of layouts:
each layout's bf16 output on each dispatcher against the fp64 truth, with the planted faults as the rule's controls;
the findings on stderr (or the record as JSON on stdout with --json)."""

from __future__ import annotations

import argparse
import json
import sys

from ..config import MAX_DIM, MAX_REPEATS
from .argtypes import count as _count, model_list as _models, scale as _scale, seconds as _seconds
from .options import add_launcher_arguments, launcher_kwargs


def _layouts(s: str) -> list[str]:
    vals = [v.strip() for v in s.split(";") if v.strip()]
    if len(vals) < 2:
        raise argparse.ArgumentTypeError(f"{s!r}: give at least two layouts separated by ';', e.g. 'ep1;ep4;tp2,ep2'")
    return vals


def _faults(s: str) -> list[str]:
    from ..questions.oracle.params import FAULT_NAMES

    if s.strip() == "none":
        return []
    vals = [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in vals if v not in FAULT_NAMES]
    if bad or not vals:
        raise argparse.ArgumentTypeError(f"{s!r}: each fault must be one of {', '.join(FAULT_NAMES)} (or 'none')")
    return vals


def _dispatchers(s: str) -> list[str]:
    from ..config import DISPATCHERS

    vals = [v.strip() for v in s.split(",") if v.strip()]
    bad = [v for v in vals if v not in DISPATCHERS]
    if bad or not vals or len(set(vals)) != len(vals):
        raise argparse.ArgumentTypeError(f"{s!r}: distinct values of {', '.join(DISPATCHERS)}, comma separated")
    return vals


def add_arguments(p: argparse.ArgumentParser) -> None:
    from ..questions.oracle.params import FAULT_NAMES, OracleParams

    p.add_argument("--layouts", type=_layouts, default=list(OracleParams.layouts),
                   help="layouts separated by ';' (default %(default)s), e.g. 'ep1;ep4;tp2,ep2,etp1'")
    p.add_argument("--reference", default=OracleParams.reference,
                   help="the layout whose bf16 weights, upcast to fp64, are the truth (one of --layouts)")
    p.add_argument("--faults", type=_faults, default=list(FAULT_NAMES),
                   help=f"planted faults, comma list of {', '.join(FAULT_NAMES)}, or 'none'")
    p.add_argument("--dispatcher", type=_dispatchers, default=["allgather", "alltoall"], help="comma list")
    p.add_argument("--device", choices=("cpu", "cuda"), default=None, help="default: cuda if a GPU is visible")
    p.add_argument("--engines", type=_count(), default=None, help="ranks; default one per GPU (cuda) or 4 (cpu)")
    p.add_argument("--gpus", type=_count(), default=None, help="cuda: GPUs to use (default all visible)")
    p.add_argument("--trials", type=_count(1, MAX_REPEATS), default=None,
                   help="runs of each layout (reruns; default 5 on cuda, 3 on cpu)")
    p.add_argument("--hidden", type=_count(1, MAX_DIM), default=256)
    p.add_argument("--experts", type=_count(1, MAX_DIM), default=8)
    p.add_argument("--topk", type=_count(1, MAX_DIM), default=4)
    p.add_argument("--ffn", type=_count(1, MAX_DIM), default=512)
    p.add_argument("--seq", type=_count(2, MAX_DIM), default=128)
    p.add_argument("--seed", type=int, default=123)
    p.add_argument("--seed-report", action="store_true",
                   help="the seed report's layer: 4096/64 experts/top-6/1024 tokens/ffn 16384")
    p.add_argument("--model", type=_models, default=None, help="a model preset's layer (moe-lab preflight lists them)")
    p.add_argument("--scale", type=_scale, default=1.0, help="with --model: shrink hidden and ffn (e.g. 0.125)")
    p.add_argument("--timeout", type=_seconds, default=600.0, help="seconds for every engine call and collective")
    p.add_argument("--start-timeout", type=_seconds, default=120.0, help="seconds for the engines to start")
    p.add_argument("--json", action="store_true", help="the record as one JSON line on stdout")
    add_launcher_arguments(p)


def _layer(a):
    from ..config import MoEConfig

    if a.model and a.seed_report:
        raise ValueError("--model and --seed-report each choose the layer: give one")
    if a.scale != 1 and not a.model:
        raise ValueError("--scale needs --model (it scales a preset)")
    if a.model:
        if len(a.model) != 1:
            raise ValueError(f"--model: one preset at a time (got {', '.join(a.model)})")
        from .. import models

        return models.moe_config(a.model[0], a.scale, seq_len=a.seq, seed=a.seed)
    if a.seed_report:
        return MoEConfig.seed_report(seed=a.seed)
    return MoEConfig(hidden=a.hidden, num_experts=a.experts, topk=a.topk, ffn_hidden=a.ffn, seq_len=a.seq,
                     seed=a.seed)


def check(a):
    """Everything `moe-lab oracle` is given, checked before anything starts (a ValueError: one line, exit 2): the
    layer, the layouts and faults (`OracleParams`' rules), the cluster, each layout (and each fault's) on the world,
    the memory. Returns (case, ClusterConfig)."""
    from ..controller import placement
    from ..controller.launchers import launcher_settings
    from ..layout import Layout
    from ..questions.oracle import experiment
    from ..questions.oracle.params import FAULT_LAYOUTS, OracleParams
    from ..tools import preflight, scale_plan

    base = _layer(a).replace(dispatcher=a.dispatcher[0], router_dtype="none")
    p = OracleParams(layouts=tuple(a.layouts), reference=a.reference, faults=tuple(a.faults))
    ccfg = placement.default_config(device=a.device, engines=a.engines, gpus=a.gpus, timeout_s=a.timeout,
                                    start_timeout_s=a.start_timeout, **launcher_kwargs(a))
    launcher_settings(ccfg)
    for spec in (*p.layouts, *(FAULT_LAYOUTS[f] for f in p.faults)):
        lay = Layout.parse(spec)
        try:
            lay.on(ccfg.engines).check_layer(base)
        except ValueError as e:
            raise ValueError(f"--layouts / --faults: layout {spec!r} on {ccfg.engines} ranks: {e}") from None
        scale_plan.check_memory([base], ccfg, cut=base.seq_len // 2, layout=lay)
        preflight.check_host_memory([base], ccfg, cut=base.seq_len // 2, layout=lay)
    trials = a.trials or (5 if ccfg.device == "cuda" else 3)
    case = experiment.case(base, p.layouts, dispatchers=tuple(a.dispatcher), faults=p.faults, trials=trials,
                           reference=p.reference)
    return case, ccfg


def cmd(a) -> int:
    case, ccfg = check(a)
    from ..controller.cluster import Cluster
    from ..experiments import protocol
    from ..findings import render
    from ..questions.oracle import experiment
    from ..questions.oracle import findings as found

    protocol.check_all([case], ccfg)
    with Cluster(ccfg) as c:
        if not a.json:
            print(f"# cluster ready in {c.timings['ready_s']:.1f} s: {c.config.placement}", file=sys.stderr)
        recs = protocol.run(experiment, cluster=c, cases=[case], notebook="")
    if a.json:
        print(json.dumps(recs[0], default=str), flush=True)
    else:
        print(render.verdict(found.findings(recs)), file=sys.stderr)
    return 0
