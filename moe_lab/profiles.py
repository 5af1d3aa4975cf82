"""Run profiles (cpu, gpu): the parameters every notebook gets, loaded and checked before anything launches."""

from __future__ import annotations

import copy
import dataclasses
import json
import types
from importlib import resources
from pathlib import Path

from .config import (DISPATCHERS, LAUNCHERS, MAX_RANKS_PER_GPU, MAX_REPEATS, ROUTER_DTYPES, SECONDS_RULE,
                     MoEConfig, check_cut, seconds_ok)
from .params import Flat
from .questions import QUESTIONS, params_types
from .run_config import CLUSTER_KEYS, MOE_KEYS, RUN_KEYS, ClusterSettings, RunConfig, RunSettings, freeze

PROFILES = ("cpu", "gpu")
_MOE_KEYS = MOE_KEYS
_COMMON = set(CLUSTER_KEYS) | set(RUN_KEYS)
"""The keys every notebook shares (the layer, the cluster, the release, trials and cost rounds)."""
SECTIONS = {c.KEY: c for c in params_types() if not issubclass(c, Flat)}
"""The profile keys that hold a question's own object (its parameters' KEY), and their dataclasses."""
FLAT = tuple(c for c in params_types() if issubclass(c, Flat))
"""The questions whose parameters are flat profile keys (each field one key), and their dataclasses."""
FLAT_KEYS = frozenset(k for c in FLAT for k in c.__dataclass_fields__)
_KNOWN = set(_MOE_KEYS) | _COMMON | FLAT_KEYS | set(SECTIONS)
"""Every key a profile may hold: the layer's, the common ones, and each registered question's parameters (flat fields
or its own object)."""


MAX_PROFILE_BYTES = 16 * 2**20
"""A profile is a small JSON file; a larger one is not a profile (and reading it would be the first thing to hang)."""


def locate(name_or_path: str) -> str:
    """A built-in profile's name as it is, or a profile file's absolute path (a relative path is resolved against
    the caller's working directory here: a notebook's kernel runs in notebooks/, where it would name another file or
    none). A path that is not a readable regular file is refused in one line naming it."""
    if not isinstance(name_or_path, str) or not name_or_path.strip():
        raise ValueError(f"profile ({name_or_path!r}) is empty: give one of {', '.join(PROFILES)} or a JSON file")
    if name_or_path in PROFILES:
        return name_or_path
    p = Path(name_or_path).expanduser()
    try:
        p = p.resolve()
        mode = p.stat().st_mode
    except OSError as e:
        raise ValueError(f"profile ({name_or_path!r}) must be one of {', '.join(PROFILES)} or a JSON file; "
                         f"{p}: {e.strerror or type(e).__name__}") from None
    except RuntimeError:  # a symlink loop
        raise ValueError(f"profile ({name_or_path!r}): the path is a symlink loop; give a JSON file") from None
    import stat

    if not stat.S_ISREG(mode):
        kind = "a directory" if stat.S_ISDIR(mode) else "not a regular file (a FIFO, socket or device)"
        raise ValueError(f"profile ({name_or_path!r}): {p} is {kind}; give one of {', '.join(PROFILES)} or a JSON "
                         "file")
    return str(p)


def load(name_or_path: str, overrides: dict | None = None) -> RunConfig:
    """A profile (a built-in name or a JSON file) with `overrides` (flat keys or `section.field`) applied, checked and
    parsed once into a `RunConfig`. Neither the file's dict nor `overrides` is changed."""
    where = locate(name_or_path)
    if where in PROFILES:
        text = resources.files("moe_lab").joinpath(f"profiles/{where}.json").read_text()
        where = f"profile {where!r}"
    else:
        text = _read_profile(Path(where))
    try:
        params = json.loads(text)
    except json.JSONDecodeError as e:
        raise ValueError(f"{where} is not valid JSON: {e}") from None
    except RecursionError:
        raise ValueError(f"{where} is not a profile: its JSON nests too deep") from None
    if not isinstance(params, dict):
        raise ValueError(f"{where} must hold a JSON object of parameters, found {type(params).__name__}")
    about = params.get("_doc")
    config = parse({k: v for k, v in params.items() if not k.startswith("_")}, overrides, where)
    return dataclasses.replace(config, about=about) if isinstance(about, str) else config


def _read_profile(p: Path) -> str:
    try:
        size = p.stat().st_size
        if size > MAX_PROFILE_BYTES:
            raise ValueError(f"{p} is {size / 2**20:.0f} MiB; a profile is a JSON file of at most "
                             f"{MAX_PROFILE_BYTES // 2**20} MiB")
        data = p.read_bytes()
    except OSError as e:
        raise ValueError(f"{p} cannot be read ({e.strerror or type(e).__name__}); give a readable JSON file") from None
    try:
        return data.decode("utf-8")
    except UnicodeDecodeError as e:
        raise ValueError(f"{p} is not UTF-8 text (byte {data[e.start]:#04x} at offset {e.start}); save the profile "
                         "as UTF-8 JSON") from None


def _translation() -> dict[str, dict[str, tuple[str, ...]]]:
    """THE table between `section.field` and the profile's keys: section → field → the path of its key (a flat key,
    or a question's own object and its field). The sections: layer, cluster, run, and each registered question (by
    its folder's name, and a `Section` also by its KEY)."""
    table = {"layer": {k: (k,) for k in _MOE_KEYS},
             "cluster": {k: (k,) for k in CLUSTER_KEYS},
             "run": {k: (k,) for k in RUN_KEYS}}
    for q in QUESTIONS:
        c = q.params
        if c is None:
            continue
        fields = {f: ((f,) if issubclass(c, Flat) else (c.KEY, f)) for f in c.__dataclass_fields__}
        table.setdefault(q.name, {}).update(fields)
        if not issubclass(c, Flat):
            table.setdefault(c.KEY, {}).update(fields)
    return table


TRANSLATION = _translation()


def translate(overrides: dict | None, where: str = "parameters") -> tuple[dict, dict]:
    """Overrides as the profile's keys: a flat key stays as it is; `section.field=v` becomes its key (a flat key, or
    the field of a question's own object, merged into that object). A section or field not in `TRANSLATION` is
    refused with the allowed ones."""
    flat, nested = {}, {}
    for key, v in (overrides or {}).items():
        if not isinstance(key, str) or "." not in key:
            flat[key] = v
            continue
        section, _, name = key.partition(".")
        fields = TRANSLATION.get(section)
        if fields is None:
            raise ValueError(f"{where}: {key!r}: unknown section {section!r}; sections: {sorted(TRANSLATION)}")
        path = fields.get(name)
        if path is None:
            raise ValueError(f"{where}: {key!r}: section {section!r} has no field {name!r}; its fields: "
                             f"{sorted(fields)}")
        if len(path) == 1:
            flat[path[0]] = v
        else:
            nested.setdefault(path[0], {})[path[1]] = v
    return flat, nested


def parse(params: dict, overrides: dict | None = None, where: str = "parameters") -> RunConfig:
    """Profile keys + overrides → a checked RunConfig. Works on a copy: `params` and `overrides` stay as they were."""
    params = copy.deepcopy(params)
    flat, nested = translate(copy.deepcopy(overrides), where)
    params.update(flat)
    for key, fields in nested.items():  # `training.steps=5`: one field of the question's object
        obj = params.get(key)
        params[key] = {**(obj if isinstance(obj, dict) else {}), **fields}
    layer, questions = check(params, where)
    return _typed(params, layer, questions, where)


def _typed(params: dict, layer: MoEConfig, questions: dict, where: str) -> RunConfig:
    """The checked flat profile as typed sections (`layer` and each question's parameters as `check` built them)."""
    device = params["device"]
    cluster = ClusterSettings(
        device=device, engines=params.get("engines") or 0, gpus=params.get("gpus"),
        timeout_s=float(params.get("timeout_s", 120)), start_timeout_s=float(params.get("start_timeout_s", 120)),
        launcher=params.get("launcher", "local"), launcher_options=freeze(params.get("launcher_options") or {}),
        one_gpu_engines=params.get("one_gpu_engines") or 0,
        megatron=params.get("megatron") or None, wheels=params.get("wheels"))
    run = RunSettings(dispatchers=tuple(params["dispatchers"]), router_dtypes=tuple(params["router_dtypes"]),
                      cut=params.get("cut", 90),
                      trials=int(params.get("trials") or (5 if device == "cuda" else 3)),
                      cost_rounds=params.get("cost_rounds"), model=params.get("model"),
                      scale=params.get("scale", 1.0), tp=params.get("tp", 1))
    layer_keys = {k: params[k] for k in ("seq_len", "seed") if k in params}
    return RunConfig(layer=layer, cluster=cluster, run=run, questions=types.MappingProxyType(questions),
                     flat=freeze(params), where=where, layer_keys=types.MappingProxyType(layer_keys),
                     parser=parse)


def check(params: dict, where: str = "parameters") -> tuple[MoEConfig, dict]:
    """Every key of a flat profile checked (the dict is normalised in place: `-p` strings become the lists they
    mean; `parse` hands it a copy); returns what the checks built, once: the base layer and each question's typed
    parameters (its class → its instance)."""
    unknown = set(params) - _KNOWN
    if unknown:
        raise ValueError(f"{where}: unknown key(s) {sorted(unknown)}; allowed: {sorted(_KNOWN)}")
    for key, allowed in (("dispatchers", DISPATCHERS), ("router_dtypes", ROUTER_DTYPES)):
        vals = params.get(key, [])
        if isinstance(vals, str):
            vals = params[key] = [v for v in vals.split(",") if v]
        if not isinstance(vals, list):
            raise ValueError(f"{where}: {key} ({vals!r}) must be a non-empty list of {', '.join(allowed)}")
        bad = [v for v in vals if not isinstance(v, str) or v not in allowed]
        if bad or not vals:
            raise ValueError(f"{where}: {key} ({vals!r}) must be a non-empty list of {', '.join(allowed)}")
        if len(set(vals)) != len(vals):
            raise ValueError(f"{where}: {key} ({vals!r}) names a value twice; give each once")
    try:
        layer = base_moe(params)  # MoEConfig checks sizes (and a preset, its scale)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    questions = {}
    for key, section in SECTIONS.items():  # a question's own object (e.g. training): its dataclass
        questions[section] = section.from_dict(params.get(key), where)
    for section in FLAT:  # a question's flat keys: its dataclass, defaults and checks once
        typed = questions[section] = section.of(params, where)
        for key in section.SPLIT:  # a `-p key=a,b` string is kept as the list it means
            if isinstance(params.get(key), str):
                params[key] = list(getattr(typed, key))
    for key in ("trials", "cost_rounds", "gpus", "tp"):
        v = params.get(key, 1)
        if not isinstance(v, int) or isinstance(v, bool) or not (0 if key == "cost_rounds" else 1) <= v <= MAX_REPEATS:
            raise ValueError(f"{where}: {key} ({v!r}) must be a positive integer <= {MAX_REPEATS}")
    if params.get("device") not in ("cpu", "cuda"):
        raise ValueError(f"{where}: device ({params.get('device')!r}) must be 'cpu' or 'cuda'")
    for key in ("timeout_s", "start_timeout_s"):
        t = params.get(key, 120)
        if not seconds_ok(t):
            raise ValueError(f"{where}: {key} ({t!r}) must be a positive number of seconds ({SECONDS_RULE})")
    for key, most in (("engines", MAX_REPEATS), ("one_gpu_engines", MAX_RANKS_PER_GPU)):
        e = params.get(key, 0)
        if not isinstance(e, int) or isinstance(e, bool) or not 0 <= e <= most:
            raise ValueError(f"{where}: {key} ({e!r}) must be a positive integer <= {most} (0 = the device's "
                             "default)")
    for key in ("megatron", "wheels", "model"):  # names and paths: text, or null for none
        v = params.get(key)
        if v is not None and (not isinstance(v, str) or not v.strip()):
            raise ValueError(f"{where}: {key} ({v!r}) must be " + {
                "megatron": "a release installed side by side, X.Y.Z (e.g. \"0.12.3\"), or null for the installed one",
                "wheels": "a folder of wheels (a path), or null",
                "model": "a preset's name (e.g. \"qwen3-30b-a3b\"), or null for the profile's sizes"}[key])
    if params.get("launcher", "local") not in LAUNCHERS:
        raise ValueError(f"{where}: launcher ({params['launcher']!r}) must be one of {', '.join(map(repr, LAUNCHERS))}")
    if not isinstance(params.get("launcher_options", {}), dict):
        raise ValueError(f"{where}: launcher_options ({params['launcher_options']!r}) must be a JSON object of "
                         "ipyparallel settings, e.g. {\"mpi_args\": [\"--oversubscribe\"]}")
    cut, seq = params.get("cut", 90), params.get("seq_len", layer.seq_len)  # MoEConfig's default
    if not isinstance(seq, int) or isinstance(seq, bool) or seq < 2:
        raise ValueError(f"{where}: seq_len ({seq!r}) must be an integer >= 2")
    try:
        check_cut(cut, seq)
    except ValueError as e:
        raise ValueError(f"{where}: {e}") from None
    return layer, questions


def base_moe(params: dict, **changes) -> MoEConfig:
    """The notebooks' base layer: the profile's sizes, or with `model` a preset's layer (`moe_lab.models`, scaled by
    `scale`; the preset decides hidden, experts, top-k, ffn and the router's features, the profile only seq_len and
    seed; its tp is the run's layout, `RunConfig.layout`)."""
    scale = params.get("scale", 1.0)
    if not isinstance(scale, (int, float)) or isinstance(scale, bool):
        raise ValueError(f"scale ({scale!r}) must be a number in (0, 1], e.g. 0.125")
    if params.get("model") is not None:
        from . import models

        kw = {k: params[k] for k in ("seq_len", "seed") if k in params}
        kw.update(changes)
        return models.moe_config(params["model"], scale, **kw)
    if scale != 1.0:
        raise ValueError(f"scale ({params['scale']!r}) needs model (it scales a preset), e.g. -p model=qwen3-30b-a3b")
    kw = {k: params[k] for k in _MOE_KEYS if k in params}
    kw.update(changes)
    return MoEConfig(**kw)
