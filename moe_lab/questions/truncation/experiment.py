"""Notebook 04, the truncation test of Megatron-LM #1421: reproduce it, explain it, and toggle remedies on it.

The test: the first `cut` tokens of a MoE forward must not change when tokens[cut:] are zeroed. The zeroed tokens
still route somewhere, so every expert GEMM gets a different number of rows M; a kernel whose reduction split depends
on M (cuBLAS split-K) then changes the bits of rows it did not touch, and atomics in the combine add run-to-run noise.

Cases (kinds): `routing` per dispatcher (router outputs and rows per expert GEMM, full vs truncated), one `kernel`
probe (an expert GEMM's first rows inside M rows vs alone, per switch state), and `case` per dispatcher x
emulation x remedy (x tile): truncation and rerun in `trials` trials, and the cost from paired rounds against the
same setting without the remedy (the no-remedy case is the A/A noise floor). The verdict is in truncation_verdict.

Every record carries `emulated`: on CPU the GEMMs are batch invariant, so the mechanism is shown with an emulation
of GPU behaviour (`splitk`: reduction split chosen from M; `atomics`: combine summed in a random order unless
deterministic mode is on, as megatron's `scatter_add_` on GPU). Emulated numbers are never GPU numbers.
"""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

import logging
import math

import torch

from . import QUESTION
from ... import metrics, stats
from ...findings.labels import label, rem_label  # noqa: F401 - re-exported: the names of 04's cases
from .record import KernelRecord, RoutingRecord, TruncationCase
from ...experiments.protocol import Case
from .verdict import verdict  # noqa: F401 - the protocol's verdict: 04's findings, rendered
from ...experiments.remedies import (EMULATIONS, REMEDIES, auto_tile, parse, splitk_allowed, splitk_control_available, splitk_splits,
                       toggles)

logger = logging.getLogger(__name__)

NAME = "truncation"
NOTEBOOK = QUESTION.number
ATOL = RTOL = 1e-3  # the seed report's allclose
COST_GOAL = 1.3  # the full remedy may cost at most 1.3x the plain forward on GPU
WORKSPACE = ("CUBLAS_WORKSPACE_CONFIG", ":4096:8")  # what deterministic training sets; it changes cuBLAS's choices


# ============================================================================================= pure functions


def tolerance_table(values=None, dtype=torch.bfloat16, atol: float = ATOL, rtol: float = RTOL, *,
                    dense: bool = False) -> list[dict]:
    """Why allclose(atol=rtol=1e-3) cannot hold bf16 results that differ by one ULP: per |x|, the ULP vs atol+rtol|x|.
    Default |x| = powers of two 2**-8 … 8; dense=True: 600 points 2**-9 … 16 (for the staircase figure)."""
    if values is None:
        values = ([2.0 ** (-9 + 13 * i / 599) for i in range(600)] if dense else [2.0**e for e in range(-8, 4)])
    x = torch.tensor(values, dtype=dtype)
    ulp = metrics.ulp_size(x)
    rows = []
    for v, u in zip(x.to(torch.float64).tolist(), ulp.tolist()):
        tol = atol + rtol * abs(v)
        rows.append({"abs_x": abs(v), "one_ulp": u, "tolerance": tol, "one_ulp_passes": u <= tol,
                     "ulps_allowed": math.floor(tol / u)})
    return rows


def one_ulp_fails_frac(x: torch.Tensor, atol: float = ATOL, rtol: float = RTOL) -> float:
    """Fraction of elements of `x` at which a one-ULP change already fails allclose(atol, rtol)."""
    u = metrics.ulp_size(x)
    tol = atol + rtol * x.detach().abs().to(torch.float64)
    return float((u > tol).to(torch.float64).mean()) if x.numel() else 0.0


# ============================================================================================= engine side


def engine_case(cfg_dict: dict, case: dict, *, cut: int, rounds: int = 7, trials: int = 1,
                layout: dict | None = None) -> dict:
    """One (remedy, emulation, tile) case: full vs truncated forward (first `cut` tokens) and a rerun, in `trials`
    trials, and `rounds` timed rounds, each a forward with the case's toggles and one without its remedy (same
    emulation), back to back: the cost is read from paired rounds, so drift between cases does not enter it. The
    timed forwards are also the trials' full-input forwards (two per trial)."""
    import torch.distributed as tdist

    from ...engine import compat, toolkit

    s = toolkit.setup(cfg_dict, layout)
    layer, tokens, trunc = s.layer, s.tokens, s.truncated(cut)
    seq = tokens.shape[0]
    full_mask = torch.ones(seq, 1, dtype=torch.bool, device=tokens.device)
    cut_mask = full_mask.clone()
    cut_mask[cut:] = False
    rem = parse(case["remedy"], REMEDIES, "remedy")
    row = {"rank": tdist.get_rank(), **case, "available": True}
    if "padding_mask" in rem and not compat.supports_padding_mask(layer):
        return {**row, "available": False,
                "reason": f"megatron-core {compat.installed_version()} MoELayer.forward has no padding_mask"}
    if "no_splitk" in rem and not splitk_control_available():
        return {**row, "available": False,
                "reason": f"torch {torch.__version__} cannot forbid cuBLAS split-K (needs >= 2.10)"}
    if "batch_invariant_mode" in rem and compat.batch_invariant_available():
        return {**row, "available": False, "reason": compat.batch_invariant_available()}
    masks = (full_mask, cut_mask) if "padding_mask" in rem else (None, None)
    tile = case.get("tile") or 128

    def with_remedy(x, mask):
        with toggles(layer, remedy=case["remedy"], emulation=case["emulation"], tile=tile):
            return toolkit.forward(layer, x, mask)

    def plain():
        with toggles(layer, remedy="none", emulation=case["emulation"]):
            toolkit.forward(layer, tokens)

    from ... import provenance

    with toggles(layer, remedy=case["remedy"], emulation=case["emulation"], tile=tile):
        switches = provenance.torch_switches()  # what the remedy's forwards run under (e.g. cuBLASLt preferred)
    out_t = with_remedy(trunc, masks[1])  # trial 1's truncated forward, and the warm-up of this toggle state
    outs: list = []
    times = toolkit.paired_rounds({"case": lambda: outs.append(with_remedy(tokens, masks[0])), "plain": plain},
                                  max(2, rounds), warmup=0)
    # The timed full-input forwards double as the trials' rerun pairs, in order (trial t: forwards 2t and 2t+1);
    # only a trial they do not cover runs its own. Each trial has its own truncated forward.
    pool = iter(outs)

    def full():
        o = next(pool, None)
        return with_remedy(tokens, masks[0]) if o is None else o

    per_trial = []
    for t in range(trials):
        a = full()
        c = out_t if t == 0 else with_remedy(trunc, masks[1])
        b = full()
        per_trial.append((metrics.compare(a[:cut], c[:cut]), metrics.compare(a, b),
                          toolkit.token_mismatch(a[:cut], c[:cut])))
    out = outs[0]
    worst_t = max(range(len(per_trial)), key=lambda i: per_trial[i][0]["n_mismatch"])
    a = out[:cut]
    return {**row, "truncation": [t[0] for t in per_trial], "rerun": [t[1] for t in per_trial],
            "token_mismatch": per_trial[worst_t][2], "hidden": a[0].numel(), "times": times,
            "one_ulp_fails_frac": one_ulp_fails_frac(a), "abs_quantiles": _quantiles(a),
            "switches": switches, "env": provenance.numerics_env()}


def _quantiles(x: torch.Tensor) -> dict:
    v = x.detach().abs().reshape(-1).to(torch.float32).cpu()
    q = torch.quantile(v, torch.tensor([0.5, 0.99])).tolist() if v.numel() else [0.0, 0.0]
    return {"p50": q[0], "p99": q[1], "max": float(v.max()) if v.numel() else 0.0}


def engine_routing(cfg_dict: dict, *, cut: int, layout: dict | None = None) -> dict:
    """Router outputs (probs, routing_map) and expert GEMM rows (tokens_per_expert) with and without truncation."""
    import torch.distributed as tdist
    from megatron.core import parallel_state as ps

    from ...engine import compat, toolkit

    s = toolkit.setup(cfg_dict, layout)
    layer, tokens, trunc = s.layer, s.tokens, s.truncated(cut)
    seen: dict = {}
    h1 = layer.router.register_forward_hook(
        lambda m, i, o: seen.__setitem__("router", tuple(t.detach().clone() for t in o)))
    h2 = layer.experts.register_forward_pre_hook(
        lambda m, args: seen.__setitem__("rows", torch.as_tensor(args[1]).detach().clone().cpu()))
    try:
        runs = {}
        mask = torch.ones(tokens.shape[0], 1, dtype=torch.bool, device=tokens.device)
        mask[cut:] = False
        plan_ = [("full", tokens, None), ("truncated", trunc, None)]
        if compat.supports_padding_mask(layer):
            plan_.append(("truncated+padding_mask", trunc, mask))
        for name, x, m in plan_:
            seen.clear()
            toolkit.forward(layer, x, m)
            runs[name] = dict(seen)
        with torch.no_grad():
            logits = layer.router.gating(trunc[cut:].reshape(-1, trunc.shape[-1]))
    finally:
        h1.remove()
        h2.remove()
    (pf, mf), (pt, mt) = runs["full"]["router"], runs["truncated"]["router"]
    pf, mf, pt, mt = (t.reshape(-1, t.shape[-1]) for t in (pf, mf, pt, mt))
    zero_sets = [torch.nonzero(r).flatten().tolist() for r in mt[cut:].unique(dim=0)]
    zero_probs = pt[cut:][mt[cut:]].unique().tolist()
    return {
        "rank": tdist.get_rank(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "routing_map_equal": bool(torch.equal(mf[:cut], mt[:cut])),  # the same top-k expert set per token
        "probs": metrics.compare(pf[:cut].contiguous(), pt[:cut].contiguous()),
        "probs_dtype": str(pf.dtype).removeprefix("torch."),
        "zero_tokens": {"max_abs_logit": float(logits.abs().max()) if logits.numel() else 0.0,
                        "expert_sets": zero_sets[:8], "probs": zero_probs[:8]},
        "router_counts": {"full": mf.sum(0).tolist(), "truncated": mt.sum(0).tolist()},
        "rows_local": {k: v["rows"].tolist() for k, v in runs.items()},
    }


def engine_kernel(cfg_dict: dict, *, ms: list[int], states: list[dict], cut: int,
                  layout: dict | None = None) -> list[dict] | None:
    """Batch variance of the expert GEMMs (rank 0's local expert 0, linear_fc1 and linear_fc2): the first min(ms) rows
    computed inside M rows vs alone, for each M and each (emulation, remedy, tile) state. Other ranks return None."""
    import torch.distributed as tdist

    from ...engine import toolkit
    from ...engine.dist import STATE

    s = toolkit.setup(cfg_dict, layout)
    cfg, layer = s.cfg, s.layer
    if tdist.get_rank() != 0:
        return None
    expert = layer.experts.local_experts[0]
    m0 = min(ms)
    rows = []
    with torch.no_grad():
        for name in ("fc1", "fc2"):
            lin = getattr(expert, f"linear_{name}")
            k = lin.weight.shape[1]  # fc2 reduces over the ffn width: the long K where split-K pays
            g = torch.Generator(device=STATE["torch_device"]).manual_seed(cfg.seed)
            x = torch.randn((max(ms), k), generator=g, device=STATE["torch_device"]).to(lin.weight.dtype)
            for st in states:
                rem = parse(st["remedy"], REMEDIES, "remedy")
                if "no_splitk" in rem and not splitk_control_available():
                    continue
                with toggles(layer, remedy=st["remedy"], emulation=st["emulation"], tile=st.get("tile") or 128):
                    ref = lin(x[:m0])[0]
                    for m in ms:
                        out = lin(x[:m])[0][:m0]
                        rows.append({**st, "linear": name, "K": k, "N": lin.weight.shape[0], "M": m, "m": m0,
                                     "kernel": metrics.compare(ref, out),
                                     "splits": (splitk_splits(m, lin.weight.shape[0], k) if splitk_allowed() else 1)
                                     if "splitk" in st["emulation"] else None})
    return rows


def on_engine(payload: dict):
    """Engine side of every 04 case, by kind. A remedy that cannot run with this layer (megatron's batch-invariant
    Triton matmul has no fp64 configuration: the fp64 router fails) is a finding: the case says so; a device out of
    memory is not (`toolkit.unavailable`)."""
    import torch.distributed as tdist

    from ...engine import toolkit

    kind, kn, cut = payload["kind"], payload["knobs"], payload["cut"]
    if kind == "routing":
        return engine_routing(payload["moe"], cut=cut, layout=payload.get("layout"))
    if kind == "kernel":
        return engine_kernel(payload["moe"], layout=payload.get("layout"), ms=kn["ms"], states=kn["states"],
                             cut=cut)
    case = {k: kn[k] for k in ("emulation", "remedy", "tile")}
    try:
        return engine_case(payload["moe"], case, cut=cut, rounds=kn.get("rounds", 7), trials=kn.get("trials", 1),
                           layout=payload.get("layout"))
    except (KeyError, RuntimeError, NotImplementedError, AssertionError) as e:
        if "batch_invariant_mode" not in case["remedy"] or toolkit.is_out_of_memory(e):
            raise
        return {"rank": tdist.get_rank(), **case, "available": False, "reason": f"{type(e).__name__}: {e}"[:300]}


# ============================================================================================= controller side


DEFAULT_REMEDIES = ["none", "deterministic", "padding_mask", "ordered_combine", "tiled_experts", "no_splitk",
                    "deterministic+tiled_experts", "ordered_combine+tiled_experts", "deterministic+no_splitk",
                    "ordered_combine+no_splitk"]


def default_plan(device: str) -> dict[str, list[str]]:
    """emulation → remedies. GPU: the real layer, every remedy. CPU (batch invariant already): the real layer with
    the megatron/torch remedies and tiles, and every remedy under the EMULATION of both GPU mechanisms."""
    if device == "cpu":
        return {"none": ["none", "deterministic", "padding_mask", "tiled_experts"],
                "splitk+atomics": list(DEFAULT_REMEDIES)}
    return {"none": list(DEFAULT_REMEDIES)}


def plan(device: str, *, emulations=None, remedies=None, tiles=None, auto: int) -> list[dict]:
    """The case list: emulation x remedy (`remedies` for every emulation given, else the default plan), each tiled
    remedy once per tile size, the no-remedy case first per emulation. Checked before any engine runs."""
    by_emu = default_plan(device)
    if emulations or remedies:
        rems = list(remedies or DEFAULT_REMEDIES)
        by_emu = {e: rems for e in (emulations or by_emu)}
    tiles = tiles or ([auto] if device == "cpu" else sorted({256, 512, auto}))
    cases = []
    for e, rems in by_emu.items():
        parse(e, EMULATIONS, "emulation")
        rems = ["none"] + [r for r in rems if parse(r, REMEDIES, "remedy")]
        for r in rems:
            tiled = "tiled_experts" in parse(r, REMEDIES, "remedy")
            for t in (tiles if tiled else [None]):
                if t is not None and (not isinstance(t, int) or t < 1):
                    raise ValueError(f"tile ({t!r}) must be a positive integer")
                cases.append({"emulation": e, "remedy": r, "tile": t})
    return cases


def kernel_ms(device: str) -> list[int]:
    return [128, 192, 256, 320, 384, 512, 1024] if device == "cpu" else [16, 32, 64, 128, 256, 512, 1024, 2048, 4096]


def kernel_states(device: str, auto: int) -> list[dict]:
    states = [{"emulation": "none", "remedy": "none", "tile": None},
              {"emulation": "none", "remedy": "tiled_experts", "tile": auto},
              {"emulation": "none", "remedy": "no_splitk", "tile": None}]
    if device == "cpu":
        states += [{"emulation": "splitk", "remedy": "none", "tile": None},
                   {"emulation": "splitk", "remedy": "tiled_experts", "tile": auto},
                   {"emulation": "splitk", "remedy": "no_splitk", "tile": None}]
    return states


def worlds(config: RunConfig) -> list[int | None]:
    """The worlds notebook 04 runs at: `truncation_engines` if given; on one GPU EP=1 and the virtual EP of
    `one_gpu_engines` (a rank alone on the GPU, then ranks sharing it); else the profile's world (None). Probes the
    GPUs (as building the cluster does)."""
    from ...controller.placement import default_engines
    from .params import TruncationParams

    given = config.params(TruncationParams).truncation_engines
    if given:
        return list(given)
    n = default_engines(config.cluster)
    if config.gpu and not config.cluster.engines and n and n > 1:
        return [1, n]
    return [None]


def cases(config: RunConfig, *, router_dtype: str = "fp64", emulations=None, remedies=None, tiles=None,
          rounds: int | None = None, ms=None, engines: int | None = None, workspaces=None) -> list[Case]:
    """Notebook 04's cases, in the order they run: per dispatcher its routing case, the kernel probe once (first
    dispatcher), then its remedy cases. `engines`: the world the cases run at (default the profile's);
    `workspaces`: the CUBLAS_WORKSPACE_CONFIG settings to repeat the remedy cases under (GPU default: unset and
    ':4096:8' — the cost of a remedy depends on it; CPU: unset only)."""
    from ...controller.placement import from_settings
    from .params import TruncationParams

    device, tp_ = config.device, config.params(TruncationParams)
    world = engines or from_settings(config.cluster).engines
    cfgs = [config.moe(dispatcher=d, router_dtype=router_dtype) for d in config.run.dispatchers]
    c0 = cfgs[0]
    auto = auto_tile(c0.seq_len, world, c0.topk, c0.num_experts)
    plan_ = plan(device, emulations=emulations, remedies=remedies or list(tp_.truncation_remedies) or None,
                 tiles=tiles or list(tp_.truncation_tiles) or None, auto=auto)
    rounds = rounds or config.rounds(default_gpu=15, default_cpu=7)
    trials = config.run.trials
    if workspaces is None:  # both workspace settings at the largest world the notebook runs (GPU); else unset
        biggest = max((e or from_settings(config.cluster).engines) for e in worlds(config))
        workspaces = [None, WORKSPACE[1]] if device == "cuda" and world == biggest else [None]
    release = config.release
    out = []
    for ws in workspaces:
        env = ((WORKSPACE[0], ws),) if ws else ()
        wsk = {"workspace": ws or "unset"}
        for i, cfg in enumerate(cfgs):
            if ws == workspaces[0]:
                out.append(Case(experiment=NAME, kind="routing", moe=cfg, cut=config.run.cut, release=release,
                                layout=config.layout,
                                knobs={"remedy": "none", "emulation": "none", **wsk}, engine_env=env,
                                label=f"routing {cfg.dispatcher}"))
                if i == 0:
                    out.append(Case(experiment=NAME, kind="kernel", moe=cfg, cut=config.run.cut, release=release,
                                    layout=config.layout,
                                    knobs={"ms": ms or kernel_ms(device), "states": kernel_states(device, auto), **wsk},
                                    engine_env=env, label="kernel probe"))
            for p in plan_:
                out.append(Case(experiment=NAME, kind="case", moe=cfg, cut=config.run.cut, release=release,
                                layout=config.layout,
                                knobs={**p, "rounds": rounds, "trials": trials, **wsk}, engine_env=env,
                                label=f"{cfg.dispatcher} {label(dict(p, emulated=p['emulation'] != 'none'))}"))
    return out


def records(case: Case, per_rank) -> list[dict]:
    if case.kind == "routing":
        return [RoutingRecord(emulated=False, **_routing_record(per_rank)).asdict()]
    if case.kind == "kernel":
        return [KernelRecord.of_row(r).asdict() for r in per_rank[0]]
    return [TruncationCase(**_case_record(per_rank)).asdict()]


def _routing_record(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    rows = {k: [n for r in sorted(per_rank, key=lambda r: r["ep_rank"]) for n in r["rows_local"][k]]
            for k in r0["rows_local"]}
    return {"routing": {"routing_map_equal": all(r["routing_map_equal"] for r in per_rank),
                        "probs": metrics.worst([r["probs"] for r in per_rank]), "probs_dtype": r0["probs_dtype"]},
            "zero_tokens": r0["zero_tokens"], "router_counts": r0["router_counts"], "rows_per_expert": rows}


def _case_record(per_rank: list[dict]) -> dict:
    r0 = per_rank[0]
    rec = {"remedy": r0["remedy"], "emulation": r0["emulation"], "emulated": r0["emulation"] != "none",
           "tile": r0.get("tile") if "tiled_experts" in r0["remedy"] else None, "available": r0["available"]}
    if not r0["available"]:
        return {**rec, "reason": r0["reason"], "truncation": None, "rerun": None, "t_forward_s": None}
    hidden = r0["hidden"]
    n = len(r0["truncation"])
    cost = stats.paired_cost([r["times"] for r in per_rank], "case", "plain", environment={
        **r0["env"], **{k: r0["switches"].get(k) for k in ("deterministic_algorithms", "preferred_blas_library",
                                                            "allow_bf16_reduced_precision_reduction_split_k")}})
    rec.update(truncation=metrics.over_trials([metrics.worst([r["truncation"][t] for r in per_rank]) for t in range(n)]),
               rerun=metrics.over_trials([metrics.worst([r["rerun"][t] for r in per_rank]) for t in range(n)]),
               token_mismatch_frac=[max(r["token_mismatch"][t] for r in per_rank) / hidden
                                    for t in range(len(r0["token_mismatch"]))],
               t_forward_s=cost["t_with_s"], t_plain_s=cost["t_without_s"], cost=cost, overhead=cost["ratio"],
               overhead_range=cost["ci"], one_ulp_fails_frac=r0["one_ulp_fails_frac"],
               abs_quantiles=r0["abs_quantiles"])
    return rec


__all__ = ["cases", "on_engine", "records", "plan", "tolerance_table", "one_ulp_fails_frac", "label", "rem_label",
           "DEFAULT_REMEDIES", "COST_GOAL", "WORKSPACE"]
