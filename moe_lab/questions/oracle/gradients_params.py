"""Notebook 08's gradient and training parameters (the profile's "oracle_training" object): one step's gradients
and the first K training steps of notebook 06's layouts, each bf16 run against the fp64 computation of the same
function from the same bf16 weights and batches. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass

from ...config import DISPATCHERS, MAX_DIM, MAX_REPEATS, check_choice, check_count, check_positive
from ...layout import Layout
from ...params import Section, as_tuple

MISTAKE_NAMES = ("expert_dp", "no_sp_reduce")
"""The planted bugs a layout can carry (engine.train.MISTAKES without 'none'; a test holds the two lists equal)."""


@dataclass(frozen=True, kw_only=True)
class OracleTrainingParams(Section):
    """The layouts, reruns and planted bugs whose gradients and K-step trajectories are judged against fp64."""

    KEY = "oracle_training"

    steps: int = 5
    """K: optimizer steps of every trajectory (the fp64 truth trains the same K steps from the same weights)."""
    tokens: int = 16
    """Tokens of the global batch per step, split evenly over the data-parallel x tensor-parallel shares."""
    layers: int = 1
    """MoE layers of the stack (residual: h <- h + moe(h))."""
    layouts: tuple[str, ...] = ("ep1", "ep2", "ep4", "tp2,ep2,sp", "tp2,ep2,etp1,sp", "tp2,ep1,sp")
    """The correct layouts (moe_lab.layout's form; TP > 1 needs 'sp'): the known-correct set the bands come from,
    each judged against the others. A tensor that every other correct run computes in the same order has a band of
    no width: the layouts whose router gradient takes the expert-TP reduce (ETP 2: tp2,ep2,sp and tp2,ep1,sp) each need
    the other beside them."""
    reruns: tuple[str, ...] = ("ep4",)
    """Layouts run a second time (run 1): the run-to-run effect, part of the known-correct set."""
    mistakes: tuple[str, ...] = ("expert_dp",)
    """Planted bugs (engine.train.MISTAKES), each run at every layout of `mistake_layouts`."""
    mistake_layouts: tuple[str, ...] = ("ep2",)
    """Where the planted bugs run (expert_dp is a no-op where expert-DP equals DP: EP 1, or ETP 1 with TP x EP = world)."""
    hidden: int = 32
    """Layer overrides (0: the profile's layer); the default is notebook 06's cpu layer."""
    num_experts: int = 0
    topk: int = 2
    ffn_hidden: int = 64
    dispatcher: str = "allgather"
    lr: float = 1e-3
    """Adam learning rate (megatron OptimizerConfig's other defaults, clip_grad 1.0)."""

    def __post_init__(self):
        check_positive("oracle_training.steps", self.steps, MAX_REPEATS)
        check_positive("oracle_training.layers", self.layers, 8)
        check_positive("oracle_training.tokens", self.tokens, MAX_DIM)
        for name in ("hidden", "num_experts", "topk", "ffn_hidden"):
            check_count(f"oracle_training.{name}", getattr(self, name), least=0, most=MAX_DIM, zero="the profile's")
        check_choice("oracle_training.dispatcher", self.dispatcher, DISPATCHERS)
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"oracle_training.lr ({self.lr!r}) must be a number in (0, 1)")
        for name in ("layouts", "reruns", "mistakes", "mistake_layouts"):
            v = as_tuple(self, name)
            if not isinstance(v, tuple) or not all(isinstance(x, str) for x in v) or len(set(v)) != len(v):
                raise ValueError(f"oracle_training.{name} ({v!r}) must be a list of distinct strings")
        if len(self.layouts) < 2:
            raise ValueError(f"oracle_training.layouts ({list(self.layouts)!r}) must name at least two layouts: a "
                             "band needs the spread of two known-correct runs")
        bad = [m for m in self.mistakes if m not in MISTAKE_NAMES]
        if bad:
            raise ValueError(f"oracle_training.mistakes ({bad!r}) must be among {', '.join(MISTAKE_NAMES)}")
        specs = []
        for name in ("layouts", "reruns", "mistake_layouts"):
            for text in getattr(self, name):
                try:
                    lay = Layout.parse(text)
                except ValueError as e:
                    raise ValueError(f"oracle_training.{name}: {e}") from None
                if lay.tp > 1 and not lay.sequence_parallel:
                    raise ValueError(f"oracle_training.{name}: {text!r} has tp {lay.tp} without sequence "
                                     f"parallelism, which megatron requires for MoE with TP in training: write "
                                     f"\"{lay.spec()},sp\"")
                if name == "layouts":
                    specs.append(lay.spec())
                elif name == "reruns" and lay.spec() not in specs:
                    raise ValueError(f"oracle_training.reruns: {text!r} is not among the layouts {specs}")

    def layer(self, base):
        """The layer: the run's base layer (a MoEConfig) with this section's dispatcher and non-zero overrides."""
        over = {k: getattr(self, k) for k in ("hidden", "num_experts", "topk", "ffn_hidden") if getattr(self, k)}
        try:
            return base.replace(dispatcher=self.dispatcher, **over)
        except ValueError as e:
            raise ValueError(f"oracle_training: the layer with {over or 'no'} overrides: {e}") from None

    def runs(self) -> list[tuple[Layout, int, str]]:
        """(layout, run, mistake) of every run: each layout's run 0, the reruns' run 1, then each planted bug at
        each of its layouts."""
        out = [(Layout.parse(s), 0, "none") for s in self.layouts]
        out += [(Layout.parse(s), 1, "none") for s in self.reruns]
        out += [(Layout.parse(s), 0, m) for m in self.mistakes for s in self.mistake_layouts]
        return out

    def check_world(self, config, ccfg) -> None:
        """Every layout fits the world and the layer's experts; the global batch splits evenly over the shares."""
        world, base = ccfg.engines, self.layer(config.layer)
        for lay, _, _ in self.runs():
            try:
                lay.check(world, base.num_experts)
                lay.check_layer(base)
            except ValueError as e:
                raise ValueError(f"oracle_training: {lay.spec()} on {world} ranks: {e}") from None
        if self.tokens % world:
            raise ValueError(f"oracle_training.tokens ({self.tokens}) must be divisible by the world ({world} ranks: "
                             "each rank feeds one share, data-parallel x tensor-parallel)")


__all__ = ["OracleTrainingParams", "MISTAKE_NAMES"]
