"""Typed parameters of every notebook's own questions (#22 item 2): one frozen dataclass each, documented fields,
defaults stated once, checked once when the profile loads (`profiles.check`), read by its experiment alone. 06 and
07 have an object of their own in a profile (`SECTIONS`: "training", "presets"); 01's layouts, 03, 04 and 05 read
flat keys (`FLAT`: each field is a top-level key, as `-p key=value` sets it). The keys every notebook shares (the
layer, the cluster, the release, trials, cost rounds) are `profiles._COMMON`. An unknown key is an error that names
the allowed ones. Torch-free."""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass
from typing import ClassVar

from .config import DISPATCHERS, ROUTER_DTYPES, _choice, _positive
from .layout import Layout


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


def _as_tuple(obj, name: str):
    """obj.name, a JSON list made the tuple a frozen dataclass keeps (set in place)."""
    v = getattr(obj, name)
    if isinstance(v, list):
        v = tuple(v)
        object.__setattr__(obj, name, v)
    return v


def _tuple_of(obj, name: str, kind: type, allowed=None) -> tuple:
    """obj.name as a non-empty tuple of distinct `kind` values (from allowed); a JSON list becomes a tuple."""
    v = _as_tuple(obj, name)
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
    layouts: tuple[str, ...] = ()
    """Further layouts compared after the EPs (moe_lab.layout's form, e.g. "tp2,ep2,sp", "tp2,ep2,etp1,sp"): TP > 1
    needs 'sp' (megatron requires sequence parallelism for MoE with TP in training)."""
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
        lays = _as_tuple(self, "layouts")
        if not isinstance(lays, tuple) or not all(isinstance(x, str) for x in lays):
            raise ValueError(f"training.layouts ({lays!r}) must be a list of layouts such as \"tp2,ep2,sp\"")
        specs = [Layout(ep=e).spec() for e in self.eps]
        for text in lays:
            try:
                lay = Layout.parse(text)
            except ValueError as e:
                raise ValueError(f"training.layouts: {e}") from None
            if lay.spec() in specs:
                raise ValueError(f"training.layouts: {text!r} is listed twice (as {lay.spec()!r}; the eps are "
                                 f"{', '.join(specs[:len(self.eps)])})")
            if lay.tp > 1 and not lay.sequence_parallel:
                raise ValueError(f"training.layouts: {text!r} has tp {lay.tp} without sequence parallelism, which "
                                 f"megatron requires for MoE with TP in training: write \"{lay.spec()},sp\"")
            specs.append(lay.spec())
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


# ---------------------------------------------------------------------------------------------- 01, 03, 04, 05


class _Flat(_Section):
    """One notebook's parameters, read from the profile's top level (their keys are flat, as `-p key=value` sets
    them): each field is a profile key, absent = its default. `of(params)` is how an experiment reads them."""

    NOTEBOOK: ClassVar[str] = ""
    SPLIT: ClassVar[dict] = {}
    """field → separator: a string value (as `-p` gives it) split into a list."""

    @classmethod
    def of(cls, params: dict, where: str = "parameters"):
        kw = {}
        for name in cls.__dataclass_fields__:
            if name in params:
                v = params[name]
                if isinstance(v, str) and name in cls.SPLIT:
                    v = [x for x in v.split(cls.SPLIT[name]) if x]
                kw[name] = v
        try:
            return cls(**kw)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None


def _bools(obj, name: str) -> None:
    v = _as_tuple(obj, name)
    if not isinstance(v, tuple) or not v or not all(isinstance(x, bool) for x in v):
        raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a non-empty list of true/false")


def _strs(obj, name: str, allowed=None, *, empty_ok: bool = False, what: str = "") -> None:
    v = _as_tuple(obj, name)
    ok = isinstance(v, tuple) and (v or empty_ok) and all(isinstance(x, str) for x in v) \
        and (allowed is None or all(x in allowed for x in v))
    if not ok:
        raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a "
                         f"{'' if empty_ok else 'non-empty '}list of "
                         + (what or (", ".join(allowed) if allowed else "strings")))


@dataclass(frozen=True, kw_only=True)
class LayoutParams(_Flat):
    """Notebook 01's second question (#23 item 3): the same layer under other parallel layouts, element by element
    against a reference layout."""

    NOTEBOOK = "01"
    SPLIT = {"layouts": ";", "layout_router_dtypes": ","}

    layouts: tuple[str, ...] = ("ep1", "ep4", "tp2,ep2", "tp2,ep2,etp1", "tp2,ep2,sp")
    """Layouts compared (`layout.Layout` specs: tp, ep, etp, sp); `-p 'layouts=ep1;ep4;tp2,ep2'`."""
    layout_reference: str = "ep1"
    """The layout every other one is compared with (run first; added if `layouts` lacks it)."""
    layout_router_dtypes: tuple[str, ...] = ("none", "fp32")
    """moe_router_dtype settings each layout runs with."""
    layout_deterministic: tuple[bool, ...] = (False,)
    """torch deterministic algorithms off / on for every layout and its reference (on GPUs also NCCL_ALGO=Ring and
    CUBLAS_WORKSPACE_CONFIG=:4096:8): with it on, a GPU's reference repeats itself and a difference is the layout's."""

    def __post_init__(self):
        from .layout import Layout

        _strs(self, "layouts")
        if len(set(self.layouts)) != len(self.layouts):
            raise ValueError(f"layouts ({list(self.layouts)!r}) must be a non-empty list of distinct layouts, e.g. "
                             "[\"ep1\", \"ep4\", \"tp2,ep2\"] (or -p 'layouts=ep1;ep4;tp2,ep2')")
        for spec in self.layouts + (self.layout_reference,):
            try:
                Layout.parse(spec)
            except ValueError as e:
                raise ValueError(f"layouts entry: {e}") from None
        _strs(self, "layout_router_dtypes", ROUTER_DTYPES)
        _bools(self, "layout_deterministic")

    def order(self) -> list[str]:
        """The reference first, then the other layouts as listed."""
        return [self.layout_reference] + [s for s in self.layouts if s != self.layout_reference]


@dataclass(frozen=True, kw_only=True)
class PromotionParams(_Flat):
    """Notebook 03's parameters: the grid of router dtype x probs fp32 gather x deterministic mode, per release."""

    NOTEBOOK = "03"
    SPLIT = {"releases": ",", "sweep_router_dtypes": ","}

    releases: tuple[str, ...] = ()
    """megatron-core releases compared ('installed' or X.Y.Z, side by side); empty: the profile's release."""
    sweep_router_dtypes: tuple[str, ...] = ()
    """moe_router_dtype settings of the grid; empty: the profile's `router_dtypes`."""
    probs_fp32_gather: tuple[bool, ...] = (False, True)
    """Gather the routing probabilities in fp32 (the seed report's suggestion) off / on."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on."""

    def __post_init__(self):
        from .releases import check_supported, parse_version

        _strs(self, "releases", empty_ok=True, what="'installed' or X.Y.Z strings, e.g. [\"0.11.0\", \"installed\"] or "
                                                    "-p releases=0.11.0,installed")
        if len(set(self.releases)) != len(self.releases):
            raise ValueError(f"releases ({list(self.releases)!r}) names a release twice")
        for v in self.releases:
            if v == "installed":
                continue
            try:
                parse_version(v)
            except ValueError:
                raise ValueError(f"releases entry ({v!r}) must be 'installed' or X.Y.Z, e.g. 0.12.3") from None
            try:
                check_supported(v)
            except ValueError as e:
                raise ValueError(f"releases entry {v!r}: {e}") from None
        _strs(self, "sweep_router_dtypes", ROUTER_DTYPES, empty_ok=True)
        _bools(self, "probs_fp32_gather")
        _bools(self, "deterministic")

    def router_dtypes(self, params: dict) -> tuple[str, ...]:
        return self.sweep_router_dtypes or tuple(params["router_dtypes"])


@dataclass(frozen=True, kw_only=True)
class TruncationParams(_Flat):
    """Notebook 04's parameters: the worlds the truncation test runs at, and the remedies and tiles it tries."""

    NOTEBOOK = "04"
    SPLIT = {"truncation_remedies": ","}

    truncation_engines: tuple[int, ...] = ()
    """Worlds to run at; empty: on one GPU EP=1 and the virtual EP of `one_gpu_engines`, else the profile's."""
    truncation_remedies: tuple[str, ...] = ()
    """Remedies tried (experiments.truncation); empty: every one the device's plan has."""
    truncation_tiles: tuple[int, ...] = ()
    """Tile sizes of tiled_experts; empty: the plan's."""

    def __post_init__(self):
        for name in ("truncation_engines", "truncation_tiles"):
            v = _as_tuple(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, int) and not isinstance(x, bool) and x > 0
                                                   for x in v):
                raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a list of positive "
                                 "integers, e.g. [1, 4]")
        _strs(self, "truncation_remedies", empty_ok=True)


@dataclass(frozen=True, kw_only=True)
class CompoundParams(_Flat):
    """Notebook 05's parameters: the settings whose gradients are compared, and the depth stacks."""

    NOTEBOOK = "05"
    SPLIT = {"compound_settings": ",", "depth_settings": ","}

    compound_settings: tuple[str, ...] = ()
    """Settings compared at one layer (experiments.compound.SETTINGS); empty: all of them."""
    depth_settings: tuple[str, ...] = ("plain", "router fp32")
    """Settings of the depth stacks."""
    depth_layers: int = 8
    """Distinct layers of the depth stack."""
    depth_ffn_hidden: int = 0
    """Expert ffn of the depth stack's layers (0: the profile's layer's)."""

    def __post_init__(self):
        _strs(self, "compound_settings", empty_ok=True)
        _strs(self, "depth_settings")
        _positive("depth_layers", self.depth_layers)
        if not isinstance(self.depth_ffn_hidden, int) or isinstance(self.depth_ffn_hidden, bool) \
                or self.depth_ffn_hidden < 0:
            raise ValueError(f"depth_ffn_hidden ({self.depth_ffn_hidden!r}) must be 0 (the layer's) or a positive "
                             "integer")


SECTIONS = {c.KEY: c for c in (TrainParams, PresetParams)}
"""The profile keys that hold an experiment's object, and their dataclasses."""
FLAT = (LayoutParams, PromotionParams, TruncationParams, CompoundParams)
"""The notebooks whose parameters are flat profile keys, and their dataclasses (each field one key)."""
FLAT_KEYS = frozenset(k for c in FLAT for k in c.__dataclass_fields__)
