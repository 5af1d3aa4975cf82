"""The one Finding type: what a notebook's verdict, an index card, `moe-lab probe`'s summary, `moe-lab findings`
and the README's findings all render. A finding is built from records only; its evidence names them (case keys),
carries every count with its denominator, the trials it held in (k of N), and for a cost the ratio, its interval,
the noise floor and where it was measured. Pure Python: no torch (the `findings` CLI reads a report without it)."""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field

from .. import stats
from ..config import ROUTER_FEATURES, MoEConfig, describe_features

_DEFAULTS = {k: getattr(MoEConfig(), k) for k in ROUTER_FEATURES}

PASS, FAIL, MIXED, NOT_MEASURED, NA = "PASS", "FAIL", "MIXED", "NOT MEASURED", "N/A"
STATUSES = (PASS, FAIL, MIXED, NOT_MEASURED, NA)


@dataclass(frozen=True)
class Count:
    """n of `of` `what` (e.g. 6,155 of 23,040 gradient elements of the loss's 90 tokens) — a fraction never
    stands without its denominator."""

    n: int
    of: int
    what: str

    @property
    def frac(self) -> float:
        return self.n / self.of if self.of else math.nan

    def text(self) -> str:
        if not self.of:
            return f"{self.n:,} {self.what} (denominator 0)"
        return f"{self.n:,} of {self.of:,} {self.what} ({self.frac:.3g})"


@dataclass(frozen=True)
class Cost:
    """A remedy's cost against the plain forward of the same setting (paired rounds, `stats.paired`). `figure` says
    which ratio is the cost: 'wall' (the forward's wall time) or 'compute' (wall minus the time inside collectives,
    used where collectives are over half of the plain forward: virtual EP's gloo transport)."""

    ratio: float | None
    ci: tuple[float, float] | None
    floor_ci: tuple[float, float] | None
    figure: str = "wall"
    wall_ratio: float | None = None
    wall_ci: tuple[float, float] | None = None
    collective_share: float | None = None
    placement: str = ""
    environment: str = ""
    rounds: int = 0

    @property
    def valid(self) -> bool:
        """A ratio that is finite and > 0, with a finite interval (NaN, inf, 0 or a negative ratio is no cost)."""
        ok = lambda x: isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) and x > 0  # noqa: E731
        return ok(self.ratio) and self.ci is not None and len(self.ci) == 2 and all(ok(x) for x in self.ci)

    @property
    def resolved(self) -> bool | None:
        """The interval lies outside the A/A noise floor's (None: no floor to judge against, or invalid)."""
        rel = self.against_floor
        return None if rel is None else rel in (stats.ABOVE, stats.BELOW)

    @property
    def against_floor(self) -> str | None:
        """Where the interval lies against the A/A noise floor's: 'inside', 'overlaps', 'above', 'below'
        (`stats.against_floor`, the one rule); None when invalid or without a floor."""
        return stats.against_floor(self.ci, self.floor_ci) if self.valid else None

    @property
    def inside_floor(self) -> bool:
        """The interval lies within the A/A noise floor's: the only case worded 'no measurable cost'."""
        return self.against_floor == stats.INSIDE

    @property
    def faster(self) -> bool:
        return self.against_floor == stats.BELOW

    def text(self) -> str:
        if not self.valid:
            return f"cost invalid (ratio {self.ratio!r}): not ranked"
        s = f"{self.ratio:.2f}x ({stats.interval_words(self.ci, self.rounds or None)})"
        if self.figure == "compute":
            s = f"{s} in compute (transport-bound: collectives {self.collective_share:.0%} of the plain forward"
            s += f"; wall {self.wall_ratio:.2f}x)" if isinstance(self.wall_ratio, (int, float)) else ")"
        elif self.collective_share is not None:
            s += f" wall time (collectives {self.collective_share:.0%} of the plain forward)"
        elif "virtual EP" in self.placement:
            s += " wall time (collective share not recorded: on virtual EP the wall time may be mostly transport)"
        rel = self.against_floor
        if rel is None:
            s += ", no noise floor to judge it against"
        elif rel in stats.FLOOR_WORDS:
            s += ", " + stats.FLOOR_WORDS[rel]
        return s


@dataclass
class Evidence:
    records: list[str] = field(default_factory=list)
    """case keys of the records the finding rests on."""
    counts: list[Count] = field(default_factory=list)
    trials: tuple[int, int] | None = None
    """(k, N): the claim held (or the difference showed) in k of N trials."""
    cost: Cost | None = None
    notes: list[str] = field(default_factory=list)
    """Further clauses, each derived from a record field (never typed in)."""


@dataclass
class Finding:
    experiment: str
    """the registry's name: reproduce, localise, promotion, truncation, compound."""
    question: str
    """short id of the question, e.g. 'ranks agree', 'first divergent stage', 'fix: ranks diverge'."""
    subject: dict
    """release, dispatcher, placement, layout, layer, environment (+ the case's own axis, e.g. router dtype)."""
    status: str
    claim: str
    evidence: Evidence = field(default_factory=Evidence)
    remedy: str | None = None
    lines: list[str] = field(default_factory=list)
    """what to put in a training job for `remedy`."""
    card: bool = False
    """shown on the index card of its subject."""
    commits: list[str] = field(default_factory=list)
    short: str = ""
    """The answer in a few words (the answer table's cell: 'yes — EP order, 3/3 trials', 'fix found: router fp32'),
    built from the same fields as the claim; '' where the finding is not a card's."""

    def __post_init__(self):
        if self.status not in STATUSES:
            raise ValueError(f"status {self.status!r} is not one of {STATUSES}")

    def card_key(self) -> tuple:
        s = self.subject
        return (s.get("release", "?"), s.get("dispatcher", "?"), s.get("placement", "?"), s.get("layer", "?"))

    def text(self) -> str:
        ev = self.evidence
        extra = [c.text() for c in ev.counts if c.text() not in self.claim]
        out = f"[{self.status}] {self.claim}"
        if extra:
            out += " (" + "; ".join(extra) + ")"
        if ev.cost is not None and ev.cost.text() not in self.claim:
            out += f"; cost {ev.cost.text()}"
        for n in ev.notes:
            out += f" — {n}"
        return out

    def to_dict(self) -> dict:
        return asdict(self)


def subject_of(rec: dict, *, axes: tuple[str, ...] = (), **extra) -> dict:
    """The subject of a record: its release, dispatcher, placement, layout, layer config and environment — findings
    with different subjects never merge. `axes`: layer-config fields a question varies within one subject (its
    `Question.axes`, e.g. seq_len), left out of the layer's words."""
    cfg = rec.get("config") or {}
    tokens = "" if "seq_len" in axes else f"{cfg.get('seq_len')} tokens, "
    layer = (f"hidden {cfg.get('hidden')}, {cfg.get('num_experts')} experts, top-{cfg.get('topk')}, ffn "
             f"{cfg.get('ffn_hidden')}, {tokens}{cfg.get('dtype')}") if cfg else "?"
    if isinstance(cfg, dict) and cfg:  # a preset and router features set (older records may have neither)
        layer = describe_features(layer, str(cfg.get("model") or ""),
                                  {k: cfg[k] for k in ROUTER_FEATURES if k in cfg and cfg[k] != _DEFAULTS[k]})
    return {"release": str(rec.get("megatron_core") or "?"), "dispatcher": str(rec.get("dispatcher") or "?"),
            "placement": placement_label(rec), "layout": layout_label(rec), "layer": layer,
            "environment": env_label(rec), **extra}


def placement_label(rec: dict) -> str:
    """'4 ranks share one GPU (NVIDIA H200) over gloo — virtual EP' / '4 CPU engines over gloo' / ... from fields;
    with the record's `transport` where something other than the backend carried the all-to-alls ('... over gloo,
    all-to-alls through CUDA IPC — virtual EP')."""
    world, backend, dev = rec.get("world"), rec.get("backend"), rec.get("device")
    rpg = rec.get("ranks_per_gpu") or 1
    gpu = rec.get("gpu")
    over = f"over {backend}" + stats.carried(rec.get("transport"))
    if dev == "cuda" and isinstance(rpg, int) and rpg > 1:
        gpus = "one GPU" if world == rpg or not isinstance(world, int) else f"{world // rpg} GPUs"
        return f"{world} ranks share {gpus} ({gpu}) {over} — virtual EP"
    if dev == "cuda":
        return f"{world} rank(s), one per GPU ({gpu}), {over}"
    if dev == "cpu":
        return f"{world} CPU engine(s) {over}"
    return str(rec.get("placement") or "placement not recorded")


def layout_label(rec: dict) -> str:
    """The case's layout in words (older records without it: their tp and ep)."""
    return rec.get("layout") or f"tp {rec.get('tp', 1) or 1} × ep {rec.get('ep') or rec.get('world') or '?'}"


def env_label(rec: dict) -> str:
    env = rec.get("env") or {}
    return ", ".join(f"{k}={v}" for k, v in sorted(env.items())) if env else "no numerics env var set"


def case_keys(recs) -> list[str]:
    """The records' case keys; a record without one (an older layout) is named by a hash of its content."""
    import hashlib
    import json

    return [str(r["case_key"]) if r.get("case_key") else
            "unkeyed:" + hashlib.sha256(json.dumps(r, sort_keys=True, default=str).encode()).hexdigest()[:12]
            for r in recs if isinstance(r, dict)]


def commits_of(recs) -> list[str]:
    return sorted({str((r.get("code") or {}).get("commit")) for r in recs if isinstance(r, dict)
                   and (r.get("code") or {}).get("commit")})


__all__ = ["Finding", "Evidence", "Count", "Cost", "STATUSES", "PASS", "FAIL", "MIXED", "NOT_MEASURED", "NA",
           "subject_of", "placement_label", "layout_label", "case_keys", "commits_of"]
