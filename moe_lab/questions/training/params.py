"""Notebook 06's parameters: the profile's "training" object. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import DISPATCHERS, MAX_DIM, MAX_REPEATS, check_choice, check_count, check_positive
from ...layout import Layout
from ...params import Section, as_tuple, tuple_of

SETTING_NAMES = ("plain", "router fp32", "router fp64", "fp32 grad reduce", "router fp32 + fp32 grad reduce",
                 "ordered combine", "router fp32 + fp32 grad reduce + ordered combine", "routing replay")
"""The settings a training run can have (questions.training.experiment.SETTINGS says what each one changes; a test
holds the two lists equal): here, torch-free, so that a profile naming another one is refused when it loads."""
REFERENCE = "plain"


@dataclass(frozen=True, kw_only=True)
class TrainParams(Section):
    """Notebook 06's parameters (the profile's "training" object): a stack of MoE layers trained on a fixed
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
    """Settings run (questions.training.experiment.SETTINGS); 'plain' is the reference."""
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
        for name in ("steps", "reruns", "deep_reruns"):
            check_positive(f"training.{name}", getattr(self, name), MAX_REPEATS)
        check_positive("training.tokens", self.tokens, MAX_DIM)
        for name in ("hidden", "num_experts", "topk", "ffn_hidden"):
            check_count(f"training.{name}", getattr(self, name), least=0, most=MAX_DIM, zero="the profile's")
        check_count("training.cost_rounds", self.cost_rounds, least=0, most=MAX_REPEATS, zero="no cost")
        for name, kind in (("stacks", int), ("eps", int), ("deterministic", bool), ("settings", str)):
            tuple_of(self, name, kind, SETTING_NAMES if name == "settings" else None)
        for name in ("stacks", "eps"):
            big = [v for v in getattr(self, name) if v > MAX_REPEATS]
            if big:
                raise ValueError(f"training.{name} ({list(getattr(self, name))!r}): {big[0]} must be <= {MAX_REPEATS}")
        if REFERENCE not in self.settings:
            raise ValueError(f"training.settings ({list(self.settings)!r}) must include {REFERENCE!r} (the reference)")
        lays = as_tuple(self, "layouts")
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
        check_choice("training.dispatcher", self.dispatcher, DISPATCHERS)
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"training.lr ({self.lr!r}) must be a number in (0, 1)")

    def layer(self, base):
        """The training layer: the run's base layer (a MoEConfig) with this section's dispatcher and its non-zero
        size overrides."""
        over = {k: getattr(self, k) for k in ("hidden", "num_experts", "topk", "ffn_hidden") if getattr(self, k)}
        try:
            return base.replace(dispatcher=self.dispatcher, **over)
        except ValueError as e:
            raise ValueError(f"training: the layer with {over or 'no'} overrides: {e}") from None

    def layouts_compared(self) -> list[Layout]:
        """The layouts compared, the reference first: EP = each of `eps` (TP 1), then each of `layouts`."""
        return [Layout(ep=e) for e in self.eps] + [Layout.parse(s) for s in self.layouts]

    def check_world(self, config, ccfg) -> None:
        """Every layout fits the world and the training layer's experts; the global batch splits evenly."""
        world, base = ccfg.engines, self.layer(config.layer)
        for lay in self.layouts_compared():
            try:
                lay.check(world, base.num_experts)
                lay.check_layer(base)
            except ValueError as e:
                raise ValueError(f"training: {lay.spec()} on {world} ranks: {e}") from None
        if self.tokens % world:
            raise ValueError(f"training.tokens ({self.tokens}) must be divisible by the world ({world} ranks: each "
                             "rank feeds one share, data-parallel x tensor-parallel)")
