"""Notebook 07: your model. For each model preset (`moe_lab.models`: Mixtral, Qwen3, DeepSeek-V3,
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

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from . import QUESTION
from ..promotion import experiment as promotion
from ...experiments import protocol
from ...experiments.probe import case as probe_case
from .record import PresetRecord
from ...experiments.protocol import Case

NAME = "presets"
NOTEBOOK = QUESTION.number


def params_of(config: RunConfig):
    """The profile's "presets" object, typed; a profile's `model` (-p model=NAME) narrows it to that model."""
    from .params import PresetParams

    pp = config.params(PresetParams)
    if config.run.model is not None:
        pp = PresetParams(**{**pp.asdict(), "models": (config.run.model,), "scale": config.run.scale})
    return pp


def layers(config: RunConfig) -> list:
    """Each preset's layer (MoEConfig) at the profile's seq_len and seed, scaled as the presets object says."""

    pp = params_of(config)
    return [config.preset_layer(m, pp.scale) for m in pp.models]


def cases(config: RunConfig) -> list[Case]:
    """Preset x dispatcher x router dtype x deterministic: the plain bf16 cell of each preset and dispatcher first."""

    pp = params_of(config)
    out = []
    for base in layers(config):
        for d in config.run.dispatchers:
            for det in pp.deterministic:
                for r in pp.router_dtypes:
                    cfg = base.replace(dispatcher=d, router_dtype=r, deterministic=det)
                    out.append(probe_case(cfg, cut=config.run.cut, trials=config.run.trials, repeats=0,
                                          experiment=NAME, release=config.release,
                                          deterministic_env=det and config.gpu,
                                          cost_rounds=pp.cost_rounds, layout=config.layout))
    return out


not_applicable = protocol.not_applicable_in_release
on_engine = promotion.on_engine  # the engine side is notebook 03's cell


def records(case: Case, per_rank: list[dict]) -> list[dict]:
    """Notebook 03's record of the cell, as a PresetRecord."""
    return promotion.records(case, per_rank, record_type=PresetRecord)



def summary(records: list[dict]):
    """One row per preset x dispatcher, rendered from its findings (`questions.presets.findings`): does it diverge (and why),
    where first, which setting fixes it, at what cost."""
    import pandas as pd

    from . import findings as found

    return pd.DataFrame(found.rows(records))


def verdict(records: list[dict]) -> str:
    """Per preset (its layer, as every record names it): its findings, then its headline; one block per preset."""
    from . import findings as found
    from ...findings import render

    fs = found.findings(records)
    layers = list(dict.fromkeys(f.subject.get("layer", "?") for f in fs))
    return "\n\n".join(render.verdict([f for f in fs if f.subject.get("layer", "?") == lay], title=lay)
                       for lay in layers) or render.verdict([])


__all__ = ["cases", "layers", "params_of", "on_engine", "records", "summary", "verdict", "not_applicable"]
