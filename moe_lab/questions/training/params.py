"""Notebook 06's parameters: the profile's "training" object. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import DISPATCHERS, check_choice, check_positive
from ...layout import Layout
from ...params import Section, as_tuple, tuple_of


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
        for name in ("steps", "tokens", "reruns", "deep_reruns"):
            check_positive(name, getattr(self, name))
        for name in ("hidden", "num_experts", "topk", "ffn_hidden", "cost_rounds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"training.{name} ({v!r}) must be 0 (the profile's) or a positive integer")
        for name, kind in (("stacks", int), ("eps", int), ("deterministic", bool), ("settings", str)):
            tuple_of(self, name, kind)
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
