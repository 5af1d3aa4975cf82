"""The run config: a profile (plus overrides) parsed ONCE at the edge (the CLI, a notebook's parameters cell) into
typed, frozen sections that are passed down as objects — nothing reads the profile's dict after this, and nothing is
written back into it (a variant is `config.with_overrides(...)`).

Sections:
- `layer`: the base `MoEConfig` (the profile's sizes, or a preset's layer with `run.model` / `run.scale`);
- `cluster`: `ClusterSettings`, plain data (device, engines, gpus, timeouts, launcher, release paths). No GPU is
  probed here: the `ClusterConfig` is built from it when a cluster is about to start
  (`controller.placement.from_settings`, also the runner's preflight);
- `run`: `RunSettings` (dispatchers, router dtypes, cut, trials, cost rounds, model, scale, tp), and from it the
  layout of every case that does not set its own (`RunConfig.layout`);
- every registered question's typed parameters: `config.params(SomeParams)` or `config.question("training")`.

Overrides name a flat key (`seq_len=256`, as always) or `section.field` (`training.steps=5`, `layer.seq_len=256`,
`run.trials=2`, `cluster.engines=2`, `seq_len.seq_lens=64,128`): `translate` is the one table between the two.
Torch-free; the parsing and checks themselves live in `profiles` (`profiles.load`, `profiles.parse`)."""

from __future__ import annotations

import copy
import dataclasses
import os
import types
from dataclasses import dataclass, field
from typing import Callable, Mapping

from .config import MoEConfig
from .layout import Layout

MOE_KEYS = ("hidden", "num_experts", "topk", "ffn_hidden", "seq_len", "seed")
"""The flat keys of the layer section (`layer.<key>`)."""
CLUSTER_KEYS = ("device", "engines", "gpus", "timeout_s", "start_timeout_s", "launcher", "launcher_options",
                "one_gpu_engines", "megatron", "wheels")
"""The flat keys of the cluster section (`cluster.<key>`)."""
RUN_KEYS = ("dispatchers", "router_dtypes", "cut", "trials", "cost_rounds", "model", "scale", "tp")
"""The flat keys of the run section (`run.<key>`)."""


def _frozen(v):
    """A JSON value as an immutable one (lists → tuples, objects → read-only mappings)."""
    if isinstance(v, list):
        return tuple(_frozen(x) for x in v)
    if isinstance(v, dict):
        return types.MappingProxyType({k: _frozen(x) for k, x in v.items()})
    return v


def _thawed(v):
    if isinstance(v, tuple):
        return [_thawed(x) for x in v]
    if isinstance(v, Mapping):
        return {k: _thawed(x) for k, x in v.items()}
    return v


@dataclass(frozen=True)
class ClusterSettings:
    """Where the engines run, as the profile says it (plain data: `engines` 0 = the device's default, resolved —
    and the GPUs probed — only when a cluster is built from these settings)."""

    device: str
    engines: int = 0
    gpus: int | None = None
    timeout_s: float = 120.0
    start_timeout_s: float = 120.0
    launcher: str = "local"
    launcher_options: Mapping = field(default_factory=lambda: types.MappingProxyType({}), hash=False)
    one_gpu_engines: int = 0
    megatron: str | None = None
    """The megatron-core release installed side by side that every case runs on (None: the installed one)."""
    wheels: str | None = None
    """A folder of wheels to install releases from offline."""

    def options(self) -> dict:
        """launcher_options as the plain dict a ClusterConfig holds."""
        return _thawed(self.launcher_options)


@dataclass(frozen=True)
class RunSettings:
    """What every question's cases share: the dispatchers and router dtypes compared, the cut, trials, cost rounds."""

    dispatchers: tuple[str, ...]
    router_dtypes: tuple[str, ...]
    cut: int = 90
    trials: int = 3
    """Trials of every comparison that can be nondeterministic (resolved: default 5 on GPU, 3 on CPU)."""
    cost_rounds: int | None = None
    """Paired timing rounds per cost as the profile gives them (None: each question's default, `RunConfig.rounds`)."""
    model: str | None = None
    scale: float = 1.0
    tp: int = 1
    """Tensor-parallel size of the cases that do not set their own layout (their experts over the rest of the
    world): `RunConfig.layout`."""


@dataclass(frozen=True)
class RunConfig:
    """One run's parameters, parsed once (`profiles.load`)."""

    layer: MoEConfig
    cluster: ClusterSettings
    run: RunSettings
    questions: Mapping = field(hash=False, repr=False)
    """Each registered question's parameters class → its instance (`params(cls)`)."""
    flat: Mapping = field(hash=False, repr=False)
    """The checked profile as flat keys (read-only): what `public()` shows and `with_overrides` starts from."""
    where: str = "parameters"
    layer_keys: Mapping = field(default_factory=lambda: types.MappingProxyType({}), hash=False, repr=False)
    """The layer keys the profile itself sets that a preset's layer keeps (seq_len, seed)."""
    parser: Callable | None = field(default=None, hash=False, repr=False, compare=False)
    """The parse that made this config (`profiles.parse`), which `with_overrides` runs again."""
    about: str = field(default="", compare=False)
    """The profile's own description (its `_doc`): what it runs and leaves out; a report shows it."""

    def params(self, cls: type):
        """The typed parameters of one question (its parameters class)."""
        try:
            return self.questions[cls]
        except KeyError:
            raise KeyError(f"{cls.__name__} is not a registered question's parameters; known: "
                           f"{sorted(c.__name__ for c in self.questions)}") from None

    def question(self, name: str):
        """The typed parameters of the question named `name` (its folder), from the registry."""
        from .questions import BY_NAME

        q = BY_NAME.get(name)
        if q is None or q.params is None:
            raise KeyError(f"no question {name!r} with parameters; known: "
                           f"{sorted(n for n, q in BY_NAME.items() if q.params is not None)}")
        return self.params(q.params)

    @property
    def device(self) -> str:
        return self.cluster.device

    @property
    def gpu(self) -> bool:
        return self.cluster.device == "cuda"

    @property
    def release(self) -> str:
        """The megatron-core release of the cases: `megatron` (installed side by side) or the installed one."""
        return self.cluster.megatron or "installed"

    @property
    def layout(self) -> Layout:
        """The layout of every case that does not set its own: the profile's tp, the experts over the rest of the
        world (resolved when the world is known, `Layout.on`)."""
        return Layout(tp=self.run.tp, ep=0)

    def check_world(self, ccfg, notebooks=None) -> None:
        """The rules that need the cluster the run will start (`ccfg`, a ClusterConfig): the run's layout on its
        world and layer, then each question's own (`params.Section.check_world`: its layouts against the world and
        the experts, training tokens against the ranks, ...) for the questions of `notebooks` (their numbers; None:
        every question). One-line ValueError naming the key; nothing is started."""
        from .questions import QUESTIONS

        try:
            self.layout.on(ccfg.engines).check_layer(self.layer)
        except ValueError as e:
            raise ValueError(f"{self.where}: the layer on {ccfg.engines} engines: {e}") from None
        for q in QUESTIONS:
            if q.params is None or (notebooks is not None and q.number not in notebooks):
                continue
            try:
                self.questions[q.params].check_world(self, ccfg)
            except ValueError as e:
                raise ValueError(f"{self.where}: notebook {q.number}: {e}") from None

    def moe(self, **changes) -> MoEConfig:
        """The base layer, with `changes`."""
        return self.layer.replace(**changes) if changes else self.layer

    def preset_layer(self, model: str, scale: float = 1.0, **changes) -> MoEConfig:
        """A preset's layer (`moe_lab.models`) scaled by `scale`, keeping the profile's seq_len and seed."""
        from . import models

        return models.moe_config(model, scale, **{**dict(self.layer_keys), **changes})

    def rounds(self, *, default_gpu: int = 15, default_cpu: int = 7) -> int:
        """Paired timing rounds per cost (>= 6 for a 95 % interval of the median that is not just min–max)."""
        v = self.run.cost_rounds
        return int(v) if v is not None else (default_gpu if self.gpu else default_cpu)

    def with_overrides(self, overrides: dict | None = None, **kw) -> "RunConfig":
        """A new config: these overrides (flat keys or `section.field`) on this one's profile, parsed and checked
        again. This one is unchanged."""
        if self.parser is None:
            raise ValueError("this RunConfig was not made by profiles.load: load the profile to override it")
        return dataclasses.replace(self.parser(self.raw(), {**(overrides or {}), **kw}, self.where), about=self.about)

    replace = with_overrides

    def raw(self) -> dict:
        """The checked profile as a fresh plain dict (flat keys; sections as objects)."""
        return copy.deepcopy(_thawed(self.flat))

    def public(self) -> dict:
        """The parameters as a report shows them: absolute paths (wheels, profile files) reduced to their last part,
        a section's layer override of 0 shown as the profile's value it stands for."""

        def clean(v):
            if isinstance(v, str) and os.path.isabs(v):
                return os.path.basename(v.rstrip("/")) or v
            if isinstance(v, list):
                return [clean(x) for x in v]
            if isinstance(v, dict):
                return {k: clean(x) for k, x in v.items()}
            return v

        out = {k: clean(v) for k, v in self.raw().items()}
        for section in (v for v in out.values() if isinstance(v, dict)):
            for key in ("hidden", "num_experts", "topk", "ffn_hidden"):  # a section's 0: "the profile's layer"
                if section.get(key) == 0 and isinstance(out.get(key), int):
                    section[key] = f"{out[key]} (the profile's)"
        return out


def freeze(d: dict) -> Mapping:
    return _frozen(d)
