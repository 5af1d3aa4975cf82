"""Run profiles (cpu, gpu): the parameters every notebook gets, loaded and checked before anything launches."""

from __future__ import annotations

import json
from importlib import resources
from pathlib import Path

from .config import (DISPATCHERS, LAUNCHERS, MAX_SECONDS, ROUTER_DTYPES, ClusterConfig, MoEConfig,
                     check_cut, seconds_ok)
from .params import FLAT, FLAT_KEYS, SECTIONS

PROFILES = ("cpu", "gpu")
_MOE_KEYS = ("hidden", "num_experts", "topk", "ffn_hidden", "seq_len", "seed")
_COMMON = {"device", "engines", "cut", "dispatchers", "router_dtypes", "timeout_s", "tp", "megatron", "wheels",
           "launcher", "launcher_options", "start_timeout_s", "trials", "cost_rounds", "gpus", "one_gpu_engines",
           "model", "scale"}
"""The keys every notebook shares (the layer, the cluster, the release, trials and cost rounds)."""
_KNOWN = set(_MOE_KEYS) | _COMMON | FLAT_KEYS | set(SECTIONS)
"""Every key a profile may hold: the layer's, the common ones, each notebook's flat fields (`params.FLAT`) and each
experiment object (`params.SECTIONS`)."""


def load(name_or_path: str, overrides: dict | None = None) -> dict:
    """A profile's parameters (a built-in name or a JSON file), with `overrides` applied and everything checked."""
    if name_or_path in PROFILES:
        text = resources.files("moe_lab").joinpath(f"profiles/{name_or_path}.json").read_text()
        where = f"profile {name_or_path!r}"
    else:
        p = Path(name_or_path)
        if not p.is_file():
            raise ValueError(f"profile ({name_or_path!r}) must be one of {', '.join(PROFILES)} or a JSON file")
        text, where = p.read_text(), str(p)
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    if not isinstance(params, dict):
        raise ValueError(f"{where} must hold a JSON object of parameters, found {type(params).__name__}")
    params = {k: v for k, v in params.items() if not k.startswith("_")}
    params.update(overrides or {})
    check(params, where)
    return params


def check(params: dict, where: str = "parameters") -> None:
    unknown = set(params) - _KNOWN
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KNOWN)}")
    for key, allowed in (("dispatchers", DISPATCHERS), ("router_dtypes", ROUTER_DTYPES)):
        vals = params.get(key, [])
        if isinstance(vals, str):
            vals = params[key] = [v for v in vals.split(",") if v]
        if not isinstance(vals, list):
            raise ValueError(f"{where}: {key} ({vals!r}) must be a non-empty list of {', '.join(allowed)}")
        bad = [v for v in vals if v not in allowed]
        if bad or not vals:
            raise ValueError(f"{where}: {key} ({vals!r}) must be a non-empty list of {', '.join(allowed)}")
    try:
        base_moe(params)  # MoEConfig checks sizes (and a preset, its scale)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    for key, section in SECTIONS.items():  # an experiment's own object (06: training, 07: presets): its dataclass
        section.from_dict(params.get(key), where)
    for section in FLAT:  # a notebook's flat keys (01 layouts, 03, 04, 05): its dataclass, defaults and checks once
        typed = section.of(params, where)
        for key in section.SPLIT:  # a `-p key=a,b` string is kept as the list it means
            if isinstance(params.get(key), str):
                params[key] = list(getattr(typed, key))
    for key in ("trials", "cost_rounds", "gpus"):
        v = params.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or v < (0 if key == "cost_rounds" else 1):
            raise ValueError(f"{where}: {key} ({v!r}) must be a positive integer")
    if params.get("device") not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device ({params.get('device')!r}) must be 'cpu' or 'cuda'")
    for key in ("timeout_s", "start_timeout_s"):
        t = params.get(key, 120)
        if not seconds_ok(t):
            raise ValueError(f"{where}: {key} ({t!r}) must be a positive number of seconds "
                             f"(finite, <= {MAX_SECONDS:.0f})")
    for key in ("engines", "one_gpu_engines"):
        e = params.get(key, 0)
        if not isinstance(e, int) or isinstance(e, bool) or e < 0:
            raise ValueError(f"{where}: {key} ({e!r}) must be a positive integer (0 = the device's default)")
    if params.get("launcher", "local") not in LAUNCHERS:
        raise ValueError(f"{where}: launcher ({params['launcher']!r}) must be one of {', '.join(map(repr, LAUNCHERS))}")
    if not isinstance(params.get("launcher_options", {}), dict):
        raise ValueError(f"{where}: launcher_options ({params['launcher_options']!r}) must be a JSON object of "
                         "ipyparallel settings, e.g. {\"mpi_args\": [\"--oversubscribe\"]}")
    cut, seq = params.get("cut", 90), params.get("seq_len", base_moe(params).seq_len)  # MoEConfig's default
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 2:
        raise ValueError(f"{where}: seq_len ({seq!r}) must be an integer >= 2")
    try:
        check_cut(cut, seq)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None


def base_moe(params: dict, **changes) -> MoEConfig:
    """The notebooks' base layer: the profile's sizes, or with `model` a preset's layer (`moe_lab.models`, scaled by
    `scale`; the preset decides hidden, experts, top-k, ffn and the router's features, the profile only seq_len, seed
    and tp)."""
    if params.get("model") is not None:
        from . import models

        kw = {k: params[k] for k in ("seq_len", "seed", "tp") if k in params}
        kw.update(changes)
        scale = params.get("scale", 1.0)
        if not isinstance(scale, (int, float)) or isinstance(scale, bool):
            raise ValueError(f"scale ({scale!r}) must be a number in (0, 1], e.g. 0.125")
        return models.moe_config(params["model"], scale, **kw)
    if params.get("scale", 1.0) != 1.0:
        raise ValueError(f"scale ({params['scale']!r}) needs model (it scales a preset), e.g. -p model=qwen3-30b-a3b")
    kw = {k: params[k] for k in _MOE_KEYS if k in params}
    if "tp" in params:
        kw["tp"] = params["tp"]
    kw.update(changes)
    return MoEConfig(**kw)


def cluster_config(params: dict, *, engines: int | None = None) -> ClusterConfig:
    """The profile's cluster (`engines` overrides the profile's); a launcher and its options are checked here,
    before any notebook starts. The megatron-core release is the cases' (`release`), not the cluster's."""
    from .controller.launchers import launcher_settings
    from .controller.placement import default_config

    if params.get("megatron"):
        from .release_dirs import path_for

        path_for(params["megatron"])  # installed side by side? (one line saying how if not)
    ccfg = default_config(device=params["device"], engines=engines or default_engines(params),
                          gpus=params.get("gpus"), timeout_s=float(params.get("timeout_s", 120)), tp=params.get("tp", 1),
                          start_timeout_s=float(params.get("start_timeout_s", 120)),
                          launcher=params.get("launcher", "local"),
                          launcher_options=params.get("launcher_options") or {})
    launcher_settings(ccfg)
    return ccfg


def default_engines(params: dict) -> int | None:
    """The profile's engines; 0 means the device's default: one per GPU — or, on a machine with ONE GPU,
    `one_gpu_engines` ranks sharing it (virtual EP: the seed report's EP=4 on one GPU); 4 on CPU."""
    n = params.get("engines") or 0
    if n:
        return n
    if params["device"] == "cuda" and params.get("one_gpu_engines") and params.get("launcher", "local") == "local":
        from .controller.placement import visible_gpus

        if visible_gpus() == 1:
            return int(params["one_gpu_engines"])
    return None


def truncation_engines(params: dict) -> list[int | None]:
    """The worlds notebook 04 runs at: `truncation_engines` if given; on one GPU EP=1 and the virtual EP of
    `one_gpu_engines` (a rank alone on the GPU, then ranks sharing it); else the profile's world (None)."""
    from .params import TruncationParams

    given = TruncationParams.of(params).truncation_engines
    if given:
        return list(given)
    n = default_engines(params)
    if params["device"] == "cuda" and not params.get("engines") and n and n > 1:
        return [1, n]
    return [None]


def public(params: dict) -> dict:
    """The parameters as a report shows them: absolute paths (wheels, profile files) reduced to their last part."""
    import os

    def clean(v):
        if isinstance(v, str) and os.path.isabs(v):
            return os.path.basename(v.rstrip("/")) or v
        if isinstance(v, list):
            return [clean(x) for x in v]
        if isinstance(v, dict):
            return {k: clean(x) for k, x in v.items()}
        return v

    return {k: clean(v) for k, v in params.items()}


def release(params: dict) -> str:
    """The megatron-core release of notebooks 01, 02, 04 and 05: `megatron` (installed side by side) or the installed one."""
    return params.get("megatron") or "installed"


def trials(params: dict) -> int:
    """Trials of every comparison that can be nondeterministic (#14): default 5 on GPU, 3 on CPU."""
    return int(params.get("trials") or (5 if params["device"] == "cuda" else 3))


def cost_rounds(params: dict, *, default_gpu: int = 15, default_cpu: int = 7) -> int:
    """Paired timing rounds per cost (>= 6 for a 95 % interval of the median that is not just min–max)."""
    v = params.get("cost_rounds")
    return int(v) if v is not None else (default_gpu if params["device"] == "cuda" else default_cpu)
