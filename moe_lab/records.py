"""Typed records: the one comparison type every experiment shares, the header every record carries, `compose` (a record
from its parts, refusing a key stated twice with two values unless declared), and `upgrade` (the one function that
reads every committed schema into the current one).

Records are still written as flat JSON objects (results.json, tidy DataFrames): the types here build them and read
them back, so the JSON keys stay the ones findings and the committed reports use. Torch-free.

Schemas:
    1  no `schema` key. Notebook 02's records name their discriminator `record` (case | stage | collective) and a
       stage record's `kind` is the stage's kind (replicated | copies | copies/expert), not its case's.
    2  `schema: 2`. Every record's discriminator is `kind`; 02's stage records carry the stage's kind as `stage_kind`.
    3  `schema: 3`. The layer's `config` holds no layout (tp, ep, etp, sequence_parallel): the case's layout is in the
       record's own fields.
"""

from __future__ import annotations

import dataclasses
from dataclasses import dataclass, field
from typing import Any, Iterable, Mapping

SCHEMA = 3
"""The schema `results.append` writes."""


class _Absent:
    """A field a comparison did not state (left out of its JSON, unlike a stated None)."""

    _it = None

    def __new__(cls):
        if cls._it is None:
            cls._it = super().__new__(cls)
        return cls._it

    def __repr__(self) -> str:
        return "ABSENT"

    def __bool__(self) -> bool:
        return False

    def __reduce__(self):
        return (_Absent, ())


ABSENT: Any = _Absent()


def _present(obj) -> dict:
    """A dataclass's stated fields, in field order (ABSENT ones left out), plus its `extra` keys."""
    out = {f.name: getattr(obj, f.name) for f in dataclasses.fields(obj) if f.name != "extra"}
    out = {k: v for k, v in out.items() if v is not ABSENT}
    return {**out, **getattr(obj, "extra", {})}


# ---------------------------------------------------------------------------------------------- comparisons


@dataclass(frozen=True)
class Comparison:
    """One comparison of two tensors (or the worst of several), under the JSON keys the lab has always written:

    numel, n_mismatch, mismatch_frac, bitwise_equal: elements compared, how many differ in their bits, the fraction
    max_abs, max_rel, max_ulp, mean_ulp: over the differing elements (0 when none differs)
    allclose_1e3, assert_close: `torch.allclose(atol=rtol=1e-3)` and `torch.testing.assert_close` (shown, not verdicts)
    trials, n_differ, per_trial: made in several trials, in how many it differed, each trial's mismatch count
    worst_copy: of several copies compared with the first, which was worst
    A field a producer did not state stays ABSENT and is left out of `asdict()` (an integer stage's comparison has no
    ULPs); anything else it stated is kept in `extra`, so `from_dict(d).asdict() == d`.
    """

    numel: Any = ABSENT
    n_mismatch: Any = ABSENT
    mismatch_frac: Any = ABSENT
    bitwise_equal: Any = ABSENT
    max_abs: Any = ABSENT
    max_rel: Any = ABSENT
    max_ulp: Any = ABSENT
    mean_ulp: Any = ABSENT
    allclose_1e3: Any = ABSENT
    assert_close: Any = ABSENT
    trials: Any = ABSENT
    n_differ: Any = ABSENT
    per_trial: Any = ABSENT
    worst_copy: Any = ABSENT
    extra: dict = field(default_factory=dict, compare=True)

    applicable = True

    @classmethod
    def counted(cls, numel: int, n_mismatch: int, **measured) -> "Comparison":
        """THE constructor of a comparison: `mismatch_frac` and `bitwise_equal` follow from the counts (0.0 and True
        for an empty tensor); `measured` are the other fields (max_abs, max_ulp, ... as the producer measured them)."""
        return cls(numel=numel, n_mismatch=n_mismatch, mismatch_frac=n_mismatch / numel if numel else 0.0,
                   bitwise_equal=n_mismatch == 0, **measured)

    @classmethod
    def from_dict(cls, d: Mapping) -> "Comparison":
        if not isinstance(d, Mapping):
            raise TypeError(f"a comparison is a JSON object, got {type(d).__name__}")
        if d.get("applicable", True) is False:
            raise ValueError(f"not a comparison (applicable: False, {d.get('reason')!r}): use parse_comparison")
        names = {f.name for f in dataclasses.fields(cls)} - {"extra"}
        if "numel" not in d or "bitwise_equal" not in d:
            raise ValueError(f"a comparison states numel and bitwise_equal, got keys {sorted(d)}")
        return cls(**{k: v for k, v in d.items() if k in names}, extra={k: v for k, v in d.items() if k not in names})

    def asdict(self) -> dict:
        return _present(self)

    def __getitem__(self, key: str):  # read like the dict it is written as
        return self.asdict()[key]

    def get(self, key: str, default=None):
        return self.asdict().get(key, default)


@dataclass(frozen=True)
class NotCompared:
    """A comparison that could not be made (one rank: nothing to compare with; a stage this release does not capture;
    shapes that differ): `applicable: False` and why; `trials` when it stands for several trials."""

    reason: str
    trials: Any = ABSENT

    applicable = False

    @classmethod
    def from_dict(cls, d: Mapping) -> "NotCompared":
        if d.get("applicable", True) is not False:
            raise ValueError(f"not a NotCompared (applicable is not False): {sorted(d)}")
        return cls(reason=d.get("reason", ""), trials=d.get("trials", ABSENT))

    def asdict(self) -> dict:
        out = {"applicable": False, "reason": self.reason}
        if self.trials is not ABSENT:
            out["trials"] = self.trials
        return out


@dataclass(frozen=True)
class Unavailable:
    """A whole case that did not run (an option its release or build lacks): `available: False` and why."""

    reason: Any = None

    @classmethod
    def from_dict(cls, d: Mapping) -> "Unavailable":
        if d.get("available", True) is not False:
            raise ValueError(f"not an Unavailable (available is not False): {sorted(d)}")
        return cls(reason=d.get("reason"))

    def asdict(self) -> dict:
        return {"available": False, "reason": self.reason}


def parse_comparison(d: Mapping | None) -> Comparison | NotCompared | None:
    """A comparison as written (a dict, or None where none was made) → its type."""
    if d is None:
        return None
    if isinstance(d, (Comparison, NotCompared)):
        return d
    return NotCompared.from_dict(d) if d.get("applicable", True) is False else Comparison.from_dict(d)


def as_json(x):
    """A typed value → what JSON holds: dataclasses of this module through their `asdict()`, dicts and lists
    element-wise, anything else as it is."""
    if hasattr(x, "asdict") and dataclasses.is_dataclass(x):
        return x.asdict()
    if isinstance(x, dict):
        return {k: as_json(v) for k, v in x.items()}
    if isinstance(x, list):
        return [as_json(v) for v in x]
    return x


class Body:
    """Base of the per-question record types (each question folder's `record.py`): `asdict()` gives the record's own
    fields in field order, typed values as their JSON (`as_json`), ABSENT fields left out, `extra` (if the type has
    one) last — the flat JSON object the experiment has always written."""

    def asdict(self) -> dict:
        out: dict = {}
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if f.name == "extra":
                out.update(as_json(v))
            elif v is not ABSENT:
                out[f.name] = as_json(v)
        return out

    @classmethod
    def from_dict(cls, d: Mapping):
        """The record's own fields from a record (header fields and anything else ignored); comparisons typed."""
        names = {f.name for f in dataclasses.fields(cls)}
        kw = {k: d[k] for k in names if k in d and k != "extra"}
        for k in getattr(cls, "COMPARISONS", ()):
            if isinstance(kw.get(k), Mapping):
                kw[k] = parse_comparison(kw[k])
        return cls(**kw)


# ---------------------------------------------------------------------------------------------- header + compose


@dataclass(frozen=True)
class Header:
    """What `protocol.measure` stamps on every record before the experiment's own fields, in this order: the notebook,
    the environment (rank 0's description of where it ran: device, world, placement, GPU, megatron-core release,
    versions, switches, code version), the time, the case (experiment, kind, layer config, cut, dispatcher, router
    dtype, knobs ...), its layout (tp, ep, etp, sequence parallel, the layout in words, whether the compared forwards
    ran with autograd), its label, its key and the case's wall time."""

    notebook: str
    environment: dict
    time: str
    case: dict
    layout: dict
    label: str
    case_key: str
    case_wall_s: float | None = None

    def parts(self) -> tuple[dict, ...]:
        return (
            {"notebook": self.notebook}, dict(self.environment), {"time": self.time}, dict(self.case),
            dict(self.layout), {"label": self.label, "case_key": self.case_key, "case_wall_s": self.case_wall_s},
        )

    @property
    def release(self) -> str | None:
        return self.environment.get("megatron_core")

    @property
    def placement(self) -> str | None:
        return self.environment.get("placement")


class CollisionError(ValueError):
    """A record's parts state one key with two different values, and the overlap was not declared."""


HEADER_OVERLAPS: dict[str, str] = {
    "tp": "the case's layout (its `layout`, or its layer's over the world) restates the environment's tp: the "
          "cluster's start, which a layout case does not follow",
    "ep": "the case's layout restates the environment's ep (the cluster's start), as for tp",
    "kind": "02's records refine their case's kind (case) to case | stage | collective",
    "detail": "a probe case's `detail` knob (True) is replaced by the detail it asked for (ULP histograms, maps)",
    "trials": "02's records state the trials their engine made (a stage: its comparison's, None when it states none) "
              "over the `trials` knob",
    "remedy": "04's case record states the remedy its engine applied over the `remedy` knob",
    "emulation": "04's case record states the emulation its engine applied over the `emulation` knob",
    "tile": "04's case record states the tile its engine used (None unless the remedy tiles the experts) over the "
            "`tile` knob",
}
"""The keys a record's parts may state twice with different values (the later part wins), and why: what
`protocol.measure` merged before records were composed. Of these, tp/ep (a layout case on a cluster started with
another), kind (every 02 stage and collective record) and detail (every probe case with detail) differ in the
committed reports; trials/remedy/emulation/tile agree there but are the engine's own statement, so it is the one kept.
Every other key stated twice must have the same value both times (`compose`)."""


def compose(*parts: Mapping, allowed_overlaps: Iterable[str] | Mapping[str, str] = ()) -> dict:
    """One flat record from its parts, in order (a key keeps the position it first had; a later part's value wins).
    A key stated by two parts with two different values is a CollisionError unless it is in `allowed_overlaps`: a
    later part never silently overrides an earlier one."""
    allowed = set(allowed_overlaps)
    out: dict = {}
    where: dict = {}
    for i, part in enumerate(parts):
        for k, v in part.items():
            if k in out and k not in allowed and not _same(out[k], v):
                raise CollisionError(f"record key {k!r} stated twice with different values: part {where[k]} says "
                                     f"{out[k]!r}, part {i} says {v!r} (declare it in allowed_overlaps if meant)")
            out[k] = v
            where.setdefault(k, i)
    return out


def _same(a, b) -> bool:
    if a is b:
        return True
    try:
        if a == b:
            return True
    except Exception:  # noqa: BLE001 - arrays and other objects without a plain truth value
        return False
    return isinstance(a, float) and isinstance(b, float) and a != a and b != b  # NaN is NaN


# ---------------------------------------------------------------------------------------------- upgrade


def schema_of(record: Mapping) -> int:
    s = record.get("schema", 1)
    if not isinstance(s, int) or isinstance(s, bool) or s < 1:
        raise ValueError(f"record schema ({s!r}) must be a positive integer")
    return s


def upgrade(record: Mapping) -> dict:
    """Any committed record → the current schema (a new dict; the record passed is not changed). A record from a
    newer schema than this code knows is a ValueError."""
    s = schema_of(record)
    if s > SCHEMA:
        raise ValueError(f"record schema {s} is newer than this moe_lab reads ({SCHEMA}): update moe_lab")
    r = dict(record)
    if s == 1:
        r = _from_1(r)
    if s <= 2:
        r = _from_2(r)
    return r


LAYOUT_IN_CONFIG = ("tp", "ep", "etp", "sequence_parallel")
"""The layout fields a schema-2 record's `config` (its layer) held; from schema 3 a case's layout is its own."""


def _from_2(r: dict) -> dict:
    """Schema 2 → 3: the layout fields leave the layer's `config`. A record that does not state them itself (its
    header's layout: tp, ep, etp, sequence parallel) keeps the config's where they name a size (ep 0 and etp 0 meant
    'derived', so they say nothing)."""
    cfg = r.get("config")
    if isinstance(cfg, dict) and any(k in cfg for k in LAYOUT_IN_CONFIG):
        cfg = dict(cfg)
        for k in LAYOUT_IN_CONFIG:
            v = cfg.pop(k, None)
            if k not in r and v not in (None, 0):
                r[k] = v
        r["config"] = cfg
    r["schema"] = SCHEMA
    return r


def _from_1(r: dict) -> dict:
    """Schema 1 → 2 (then `_from_2`): 02's `record` discriminator becomes `kind` (where `kind` was, or where `record`
    was when there was no kind); a stage record's own `kind` (the stage's) becomes `stage_kind` after its `stage`, as
    does each stage's in 05's `backward_stages`."""
    if "record" in r:
        disc = r["record"]
        stage_kind = r.get("kind") if disc == "stage" else None
        out: dict = {}
        for k, v in r.items():
            if k == "kind":
                out["kind"] = disc
            elif k == "record":
                if "kind" not in r:
                    out["kind"] = disc
            else:
                out[k] = v
                if k == "stage" and disc == "stage" and "kind" in r:
                    out["stage_kind"] = stage_kind
        if disc == "stage" and "kind" in r and "stage_kind" not in out:
            out["stage_kind"] = stage_kind
        r = out
    if isinstance(r.get("backward_stages"), list):
        r["backward_stages"] = [{("stage_kind" if k == "kind" else k): v for k, v in x.items()}
                                for x in r["backward_stages"]]
    r["schema"] = SCHEMA
    return r


def stamp(record: Mapping) -> dict:
    """A record as written now: `schema` first (the record's own `schema` must be the current one or absent)."""
    s = record.get("schema", SCHEMA)
    if s != SCHEMA:
        raise ValueError(f"record schema {s!r}: only schema {SCHEMA} records are written (upgrade it first)")
    return {"schema": SCHEMA, **{k: v for k, v in record.items() if k != "schema"}}


def comparisons_in(record: Mapping) -> list[tuple[str, dict]]:
    """Every comparison a record holds (path, dict), at any depth: the JSON objects stating `bitwise_equal` and
    `numel`, or `applicable: False`. A flat 02 stage record's own metrics are not in the list."""
    out: list = []

    def walk(x, path):
        if isinstance(x, Mapping):
            if path and (("bitwise_equal" in x and "numel" in x) or x.get("applicable", True) is False):
                out.append((path, x))
                return
            for k, v in x.items():
                walk(v, f"{path}.{k}" if path else str(k))
        elif isinstance(x, list):
            for i, v in enumerate(x):
                walk(v, f"{path}[{i}]")

    walk(record, "")
    return out


__all__ = ["SCHEMA", "ABSENT", "Comparison", "NotCompared", "Unavailable", "parse_comparison", "Header", "compose",
           "CollisionError", "HEADER_OVERLAPS", "Body", "upgrade", "stamp", "schema_of", "comparisons_in", "as_json"]
