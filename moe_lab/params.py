"""Typed parameters of the experiments that have their own object in a profile (#22 item 2): one frozen dataclass
each, defaults stated once, checked once when the profile loads (`profiles.check`); an unknown key is an error that
names the allowed ones. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .config import DISPATCHERS, ROUTER_DTYPES, _choice, _positive


class _Section:
    """A profile's JSON object for one experiment ('_'-keys are comments)."""

    KEY: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "parameters"):
        d = d or {}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: {cls.KEY} ({d!r}) must be a JSON object of {sorted(cls.__dataclass_fields__)}")
        d = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: {cls.KEY} has unknown key(s) {sorted(unknown)}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


def _tuple_of(obj, name: str, kind: type, allowed=None) -> tuple:
    """obj.name as a non-empty tuple of distinct `kind` values (from allowed); a JSON list becomes a tuple."""
    v = getattr(obj, name)
    if isinstance(v, list):
        v = tuple(v)
        object.__setattr__(obj, name, v)
    ok = (isinstance(v, tuple) and v and len(set(v)) == len(v)
          and all(isinstance(x, kind) and (kind is not int or (not isinstance(x, bool) and x > 0)) for x in v)
          and (allowed is None or all(x in allowed for x in v)))
    if not ok:
        what = "positive integers" if kind is int else f"{kind.__name__} values"
        raise ValueError(f"{obj.KEY}.{name} ({v!r}) must be a non-empty list of distinct {what}"
                         + (f" from {', '.join(map(repr, allowed))}" if allowed else ""))
    return v


@dataclass(frozen=True, kw_only=True)
class TrainParams(_Section):
    """Notebook 06's parameters (the profile's "training" object; #24): a stack of MoE layers trained on a fixed
    regression loss at several EP layouts, each run `reruns` times, with and without deterministic mode."""

    KEY = "training"

    steps: int = 50
    """K: optimizer steps per run."""
    tokens: int = 64
    """Tokens of the global batch per step, split evenly over the data-parallel ranks."""
    stacks: tuple[int, ...] = (1, 2)
    """MoE layers per stack (residual: h <- h + moe(h)); the first stack runs every mode and setting, the others the
    plain setting in the last-listed mode."""
    eps: tuple[int, ...] = (1, 2, 4)
    """Expert-parallel sizes compared (the first is the reference layout); the rest of the world is data parallel."""
    reruns: int = 2
    """Runs of every plain layout of the first stack (run 1 is the rerun: the run-to-run effect)."""
    deep_reruns: int = 2
    """Runs of every layout of the other stacks (1: no rerun there; their run-to-run finding then says so)."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on for the first stack's plain layouts (other cases: the last listed)."""
    settings: tuple[str, ...] = ("plain", "router fp32", "router fp32 + fp32 grad reduce")
    """Settings run (experiments.training.SETTINGS); 'plain' is the reference."""
    hidden: int = 0
    """Layer overrides for training (0: the profile's layer)."""
    num_experts: int = 0
    topk: int = 0
    ffn_hidden: int = 0
    dispatcher: str = "allgather"
    """megatron-core token dispatcher of every training case."""
    lr: float = 1e-3
    """Adam learning rate (megatron OptimizerConfig's other defaults: weight decay 0.01, betas 0.9/0.999, eps 1e-8,
    clip_grad 1.0)."""
    cost_rounds: int = 5
    """Paired timing rounds (case step vs plain step) per remedy, at the largest EP; 0: no cost."""

    def __post_init__(self):
        for name in ("steps", "tokens", "reruns", "deep_reruns"):
            _positive(name, getattr(self, name))
        for name in ("hidden", "num_experts", "topk", "ffn_hidden", "cost_rounds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"training.{name} ({v!r}) must be 0 (the profile's) or a positive integer")
        for name, kind in (("stacks", int), ("eps", int), ("deterministic", bool), ("settings", str)):
            _tuple_of(self, name, kind)
        _choice("training.dispatcher", self.dispatcher, DISPATCHERS)
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"training.lr ({self.lr!r}) must be a number in (0, 1)")


@dataclass(frozen=True, kw_only=True)
class PresetParams(_Section):
    """Notebook 07's parameters (the profile's "presets" object; #23 item 2): for each model preset, the questions of
    01-04 — do EP ranks agree, where do they first part, which setting makes them agree and at what cost — on a grid
    of dispatcher x router dtype x deterministic mode of the preset's layer."""

    KEY = "presets"

    models: tuple[str, ...] = ("qwen3-30b-a3b", "deepseek-v3")
    """Presets run (moe_lab.models); with the profile's `model` set, that one model instead."""
    scale: float = 1.0
    """Shrinks every preset's hidden and ffn (labelled as scaled); 1 is the published layer."""
    router_dtypes: tuple[str, ...] = ("none", "fp32")
    """moe_router_dtype settings of the grid ('none': plain bf16, the reference cell)."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on (on GPUs also NCCL_ALGO=Ring and CUBLAS_WORKSPACE_CONFIG=:4096:8)."""
    cost_rounds: int = 7
    """Paired timing rounds of each cell against the plain forward; 0: no cost."""

    def __post_init__(self):
        from . import models

        mods = _tuple_of(self, "models", str)
        for m in mods:
            try:
                models.get(m)
            except ValueError as e:
                raise ValueError(f"presets.models: {e}") from None
        if not isinstance(self.scale, (int, float)) or isinstance(self.scale, bool) or not 0 < self.scale <= 1:
            raise ValueError(f"presets.scale ({self.scale!r}) must be a number in (0, 1], e.g. 0.125")
        _tuple_of(self, "router_dtypes", str, ROUTER_DTYPES)
        if "none" not in self.router_dtypes:
            raise ValueError(f"presets.router_dtypes ({self.router_dtypes!r}) must include 'none': the plain bf16 "
                             "cell is the reference every other setting is judged against")
        _tuple_of(self, "deterministic", bool)
        if False not in self.deterministic:
            raise ValueError(f"presets.deterministic ({self.deterministic!r}) must include false (the plain cell)")
        if not isinstance(self.cost_rounds, int) or isinstance(self.cost_rounds, bool) or self.cost_rounds < 0:
            raise ValueError(f"presets.cost_rounds ({self.cost_rounds!r}) must be 0 (no cost) or a positive integer")


SECTIONS = {c.KEY: c for c in (TrainParams, PresetParams)}
"""The profile keys that hold an experiment's object, and their dataclasses."""
