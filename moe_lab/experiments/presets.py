"""Notebook 07 (#23 item 2): your model. For each model preset (`moe_lab.models`: Mixtral, Qwen3, DeepSeek-V3,
Moonlight, GPT-OSS — one MoE layer with its router features, scaled where the profile says), the questions of 01-04 on
the preset's own layer: do the EP ranks agree (and is a difference EP order or run-to-run nondeterminism), which stage
first parts, and which setting — router fp32/fp64, deterministic mode — makes ranks and reruns bitwise equal, at
what cost.

A cell is notebook 03's (`promotion.on_engine`: the probe's comparisons with trials, one captured forward for the
first divergent stage and the dtypes, paired cost rounds against the plain forward of the same preset), so the
findings are 03's rules applied per preset; the grid and the models come from the profile's "presets" object
(`params.PresetParams`), the release is the installed one.
"""

from __future__ import annotations

from . import promotion, protocol
from .probe import case as probe_case
from .protocol import Case

NAME = "presets"
NOTEBOOK = "07"


def params_of(params: dict):
    """The profile's "presets" object, typed; a profile's `model` (-p model=NAME) narrows it to that model."""
    from ..params import PresetParams

    pp = PresetParams.from_dict(params.get("presets"))
    if params.get("model") is not None:
        pp = PresetParams(**{**pp.asdict(), "models": (params["model"],), "scale": params.get("scale", 1.0)})
    return pp


def layers(params: dict) -> list:
    """Each preset's layer (MoEConfig) at the profile's seq_len and seed, scaled as the presets object says."""
    from .. import profiles

    pp = params_of(params)
    return [profiles.base_moe({**params, "model": m, "scale": pp.scale}) for m in pp.models]


def cases(params: dict) -> list[Case]:
    """Preset x dispatcher x router dtype x deterministic: the plain bf16 cell of each preset and dispatcher first."""
    from .. import profiles

    pp = params_of(params)
    out = []
    for base in layers(params):
        for d in params["dispatchers"]:
            for det in pp.deterministic:
                for r in pp.router_dtypes:
                    cfg = base.replace(dispatcher=d, router_dtype=r, deterministic=det)
                    out.append(probe_case(cfg, cut=params["cut"], trials=profiles.trials(params), repeats=0,
                                          experiment=NAME, release=profiles.release(params),
                                          deterministic_env=det and params["device"] == "cuda",
                                          cost_rounds=pp.cost_rounds))
    return out


not_applicable = protocol.not_applicable_in_release
on_engine = promotion.on_engine  # the engine side is notebook 03's cell
records = promotion.records


def summary(records: list[dict]):
    """One row per preset x dispatcher, rendered from its findings (`findings.presets`): does it diverge (and why),
    where first, which setting fixes it, at what cost."""
    import pandas as pd

    from ..findings import presets as found

    return pd.DataFrame(found.rows(records))


def verdict(records: list[dict]) -> str:
    """Per preset (its layer, as every record names it): its findings, then its headline; one block per preset."""
    from ..findings import presets as found, render

    fs = found.findings(records)
    layers = list(dict.fromkeys(f.subject.get("layer", "?") for f in fs))
    return "\n\n".join(render.verdict([f for f in fs if f.subject.get("layer", "?") == lay], title=lay)
                       for lay in layers) or render.verdict([])


__all__ = ["cases", "layers", "params_of", "on_engine", "records", "summary", "verdict", "not_applicable"]
