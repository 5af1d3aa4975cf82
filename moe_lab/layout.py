"""A parallel layout — TP x EP x ETP (+ sequence parallel) — parsed and checked once, torch-free.

Vocabulary (megatron-core's): the dense side splits the world into tp x dp; the expert side into etp x ep x edp
(expert-data-parallel). ETP defaults to TP (`expert_tensor_parallel_size=None` in megatron). A layout fits a world of
W ranks when W is a multiple of tp and of etp x ep; the smallest such world is lcm(tp, etp x ep)."""

from __future__ import annotations

import math
import re
from dataclasses import dataclass

_PART = re.compile(r"^(tp|ep|etp)(\d+)$|^(sp)$|^(epall)$")


@dataclass(frozen=True)
class Layout:
    tp: int = 1
    """Tensor parallel size of the dense side (attention; the router's input is replicated over it)."""
    ep: int = 1
    """Expert parallel size: the experts are split over this many ranks. 0 = every rank the world leaves after etp
    (`WORLD`, resolved by `on(world)` when the world is known)."""
    etp: int = 0
    """Expert tensor parallel size; 0 = the same as tp (megatron's default)."""
    sequence_parallel: bool = False
    """Sequence parallelism (megatron requires it for MoE with TP > 1 in training); 'sp' in a layout's text."""

    def __post_init__(self):
        for name, least in (("tp", 1), ("ep", 0)):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < least:
                raise ValueError(f"layout: {name} ({v!r}) must be a positive integer"
                                 + (" (or 0 = the whole world)" if least == 0 else ""))
        if not isinstance(self.etp, int) or isinstance(self.etp, bool) or self.etp < 0:
            raise ValueError(f"layout: etp ({self.etp!r}) must be a positive integer (or 0 = tp)")
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"layout: sequence_parallel ({self.sequence_parallel!r}) must be True or False")

    @classmethod
    def parse(cls, text: str) -> "Layout":
        """'tp2,ep4' / 'ep8' / 'tp2,ep2,etp1,sp' / 'tp2,epall' (EP over the rest of the world) → Layout; a one-line
        ValueError that shows the form otherwise."""
        if not isinstance(text, str) or not text.strip():
            raise ValueError("layout is empty: give e.g. ep4 or tp2,ep4,etp1,sp")
        kw: dict = {}
        for part in text.lower().replace(" ", "").split(","):
            m = _PART.match(part)
            if not m:
                raise ValueError(f"layout ({text!r}): {part!r} is not tpN, epN, etpN or sp (e.g. tp2,ep4,etp1,sp)")
            key, val = (("sequence_parallel", True) if m.group(3) else ("ep", 0) if m.group(4)
                        else (m.group(1), int(m.group(2))))
            if key == "ep" and val == 0 and not m.group(4):
                raise ValueError(f"layout ({text!r}): ep0: ep must be a positive integer (epall: every rank left)")
            if key in kw:
                raise ValueError(f"layout ({text!r}) names {key} twice")
            kw[key] = val
        return cls(**kw)

    @property
    def expert_tp(self) -> int:
        return self.etp or self.tp

    @property
    def parallel_state(self) -> tuple[int, int, int]:
        """(tp, ep, expert tp): what megatron makes its process groups for (sequence parallelism is the layer's)."""
        return self.tp, self.ep, self.expert_tp

    @property
    def min_world(self) -> int:
        return math.lcm(self.tp, self.expert_tp * max(self.ep, 1))

    @property
    def resolved(self) -> bool:
        """False for a layout whose EP is still 'the whole world' (ep 0)."""
        return self.ep > 0

    def on(self, world: int) -> "Layout":
        """This layout on `world` ranks: EP resolved (ep 0 → world / etp), the world checked against it."""
        self.check_world(world)
        if self.ep:
            return self
        return Layout(tp=self.tp, ep=world // self.expert_tp, etp=self.etp, sequence_parallel=self.sequence_parallel)

    def spec(self) -> str:
        """The layout in `parse`'s form, shortest: 'ep4', 'tp2,ep2,sp', 'tp2,ep4,etp1,sp' (parse(spec) has the same
        sizes)."""
        parts = ([f"tp{self.tp}"] if self.tp != 1 else []) + [f"ep{self.ep or 'all'}"]
        parts += [f"etp{self.expert_tp}"] if self.expert_tp != self.tp else []
        parts += ["sp"] if self.sequence_parallel else []
        return ",".join(parts)

    def label(self) -> str:
        s = f"tp {self.tp} × ep {self.ep or 'all'}"
        if self.expert_tp != self.tp:
            s += f" (etp {self.expert_tp})"
        return s + (", sequence parallel" if self.sequence_parallel else "")

    def dp(self, world: int) -> int:
        """Data-parallel size of the dense (router, shared-expert) parameters at `world` ranks."""
        return world // self.tp

    def expert_dp(self, world: int) -> int:
        """Data-parallel size of the expert parameters (megatron's expert-data-parallel group)."""
        return world // (self.expert_tp * self.ep)

    def check(self, world: int, num_experts: int) -> None:
        """ValueError unless the layout fits `world` ranks and `num_experts` experts."""
        self.check_world(world)
        if self.ep and num_experts % self.ep:
            raise ValueError(f"layout {self.label()}: num_experts ({num_experts}) must be divisible by ep ({self.ep})")

    def asdict(self) -> dict:
        return {"tp": self.tp, "ep": self.ep, "etp": self.expert_tp, "sequence_parallel": self.sequence_parallel}

    def fields(self) -> dict:
        """What every record says of its case's layout (flat, for tidy tables): tp, ep, etp, sequence parallel and
        the layout in words."""
        return {**self.asdict(), "layout": self.label()}

    def groups(self, world: int) -> dict:
        """Every group size at `world` ranks: dp (dense side), edp (expert side), checked."""
        self.check_world(world)
        return {"world": world, "tp": self.tp, "dp": world // self.tp, "ep": self.ep, "etp": self.expert_tp,
                "edp": world // (self.expert_tp * self.ep)}

    def check_world(self, world: int) -> None:
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world ({world!r}) must be a positive integer")
        if world % self.tp:
            raise ValueError(f"layout {self.label()}: world ({world}) must be a multiple of tp ({self.tp})")
        if world % (self.expert_tp * max(self.ep, 1)):
            raise ValueError(f"layout {self.label()}: world ({world}) must be a multiple of etp x ep "
                             f"({self.expert_tp} x {self.ep} = {self.expert_tp * self.ep})")

    def check_layer(self, cfg, *, heads: int | None = None) -> None:
        """Can this layer (a MoEConfig) be split this way? One ValueError naming the first rule broken."""
        rules = [(self.ep and cfg.num_experts % self.ep,
                  f"num_experts ({cfg.num_experts}) must be divisible by ep ({self.ep})"),
                 (cfg.hidden % self.tp, f"hidden ({cfg.hidden}) must be divisible by tp ({self.tp})"),
                 (cfg.ffn_hidden % self.expert_tp,
                  f"expert ffn ({cfg.ffn_hidden}) must be divisible by etp ({self.expert_tp})"),
                 (cfg.shared_ffn % self.tp, f"shared expert ffn ({cfg.shared_ffn}) must be divisible by tp ({self.tp})"),
                 (self.sequence_parallel and cfg.seq_len % self.tp,
                  f"seq_len ({cfg.seq_len}) must be divisible by tp ({self.tp}) with sequence parallelism"),
                 (heads is not None and heads % self.tp,
                  f"attention heads ({heads}) must be divisible by tp ({self.tp})")]
        for broken, msg in rules:
            if broken:
                raise ValueError(f"layout {self.label()}: {msg}")


WORLD = Layout(ep=0)
"""The default layout of a case: TP 1, the experts split over every rank of the world it runs on."""


def state_major(items: list, state_of, first=None) -> list:
    """`items` with those of one parallel state (`state_of(item)`, e.g. `Layout.parallel_state`) together: the state
    `first` (if given) before all, each other state where its first item stands, the items of a state in their own
    order. An engine that runs them in this order makes megatron's process groups once per state."""
    order = {} if first is None else {first: 0}
    for it in items:
        order.setdefault(state_of(it), len(order))
    return sorted(items, key=lambda it: order[state_of(it)])  # stable: their own order within a state
