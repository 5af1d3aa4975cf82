"""Notebook 08's parameters: the profile's "oracle" object. Torch-free."""

from __future__ import annotations

from dataclasses import dataclass, field

from ...params import Section, tuple_of
from .gradients_params import OracleTrainingParams

FAULT_NAMES = ("swap_experts", "capacity_drop", "etp_shard", "scale_expert")
"""The planted faults."""
FAULT_LAYOUTS = {"swap_experts": "ep4", "capacity_drop": "ep4", "etp_shard": "tp2,ep2", "scale_expert": "ep4"}
"""The layout each fault is planted on (one layout only: the others stay correct)."""


@dataclass(frozen=True, kw_only=True)
class OracleParams(Section):
    """The layouts run in bf16 against the fp64 truth (each `trials` times: the reruns), the reference layout whose
    weights make the truth, and the faults planted (each on one layout only) as the rule's controls."""

    KEY = "oracle"

    layouts: tuple[str, ...] = ("ep1", "ep4", "tp2,ep2", "tp2,ep2,etp1")
    """Layouts of the same global weights and tokens, all known-correct: their spread is the band a run is held to."""
    reference: str = "ep1"
    """The layout whose bf16 weights and tokens, upcast to fp64, are the truth."""
    faults: tuple[str, ...] = FAULT_NAMES
    """Planted faults, each on one layout only (empty: none)."""
    truth_layouts: tuple[str, ...] = ()
    """Layouts whose own fp64 truth (their bf16 weights upcast) is compared with the reference's, to show the truth
    does not depend on the layout; empty: every layout. An fp64 layer takes four times a bf16 one's memory per
    rank: on one GPU shared by four ranks the seed layer's fp64 fits only split over EP."""
    training: OracleTrainingParams = field(default_factory=OracleTrainingParams)
    """One step's gradients and the first K training steps against fp64 (`gradients_params`; the profile's
    `"oracle": {"training": {...}}`)."""
    ffn_hidden: int = 0
    """The experts' ffn width of the oracle's layer; 0: the profile's, narrowed where ranks share a GPU it would not
    fit (`memory.size`; the record and the findings say so). Given, the layer is not sized."""
    trials: int = 0
    """Runs of each layout on each dispatcher (the reruns); 0: the profile's `trials`. Each run's error statistics
    are measured over every element, where the layer ran (`rule_torch`: on a GPU, sorted there)."""

    def __post_init__(self):
        from ...layout import Layout

        if not isinstance(self.training, OracleTrainingParams):
            object.__setattr__(self, "training", OracleTrainingParams.from_dict(self.training, "oracle.training"))

        tuple_of(self, "layouts", str)
        if len(self.layouts) < 2:
            raise ValueError(f"oracle.layouts ({list(self.layouts)!r}) must name at least two layouts: a band needs "
                             "a spread, e.g. [\"ep1\", \"ep4\"]")
        for spec in (*self.layouts, self.reference):
            try:
                Layout.parse(spec)
            except ValueError as e:
                raise ValueError(f"oracle.layouts entry {spec!r}: {e}") from None
        if self.truth_layouts in ([], ()):
            object.__setattr__(self, "truth_layouts", ())
        else:
            tuple_of(self, "truth_layouts", str)
            if self.reference not in self.truth_layouts or not set(self.truth_layouts) <= set(self.layouts):
                raise ValueError(f"oracle.truth_layouts ({list(self.truth_layouts)!r}) must be layouts of "
                                 f"oracle.layouts and hold the reference {self.reference!r}")
        if self.reference not in self.layouts:
            raise ValueError(f"oracle.reference ({self.reference!r}) must be one of oracle.layouts {list(self.layouts)}")
        from ...config import MAX_REPEATS, check_count

        check_count("oracle.trials", self.trials, least=0, most=MAX_REPEATS, zero="the profile's trials")
        if not isinstance(self.ffn_hidden, int) or isinstance(self.ffn_hidden, bool) or self.ffn_hidden < 0:
            raise ValueError(f"oracle.ffn_hidden ({self.ffn_hidden!r}) must be a positive integer, or 0 for the "
                             "profile's ffn_hidden")
        if self.faults in ([], ()):
            object.__setattr__(self, "faults", ())
        else:
            tuple_of(self, "faults", str, FAULT_NAMES)

    def layer(self, profile_layer):
        """The oracle's layer: the profile's, with `ffn_hidden` where set."""
        return profile_layer.replace(ffn_hidden=self.ffn_hidden) if self.ffn_hidden else profile_layer

    def runs(self, profile_trials: int) -> int:
        return self.trials or profile_trials

    def check_world(self, config, ccfg) -> None:
        """Each layout, and each fault's layout, splits the layer on the run's world."""
        from ...layout import Layout

        self.training.check_world(config, ccfg)
        base = self.layer(config.layer)
        for spec in (*self.layouts, *(FAULT_LAYOUTS[f] for f in self.faults)):
            try:
                Layout.parse(spec).on(ccfg.engines).check_layer(base)
            except ValueError as e:
                raise ValueError(f"oracle layout {spec!r} on {ccfg.engines} ranks: {e}") from None
