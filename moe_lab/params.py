"""The base of every question's typed parameters: a frozen dataclass per question (its folder's `params.py`), with
documented fields and defaults stated once, checked once when the profile loads (`profiles.load` → `run_config.RunConfig`). A question's
parameters are either an object of their own in a profile (`Section`, e.g. "training") or flat top-level keys
(`Flat`, as `-p key=value` sets them). The keys every question shares (the layer, the cluster, the release, trials,
cost rounds) are the run config's `layer`, `cluster` and `run` sections. An unknown key is an error that names the allowed ones. Torch-free."""

from __future__ import annotations

import dataclasses
from typing import ClassVar


class Section:
    """A profile's JSON object for one experiment ('_'-keys are comments)."""

    KEY: ClassVar[str] = ""

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "parameters"):
        d = {} if d is None else d
        if not isinstance(d, dict):
            raise ValueError(f"{where}: {cls.KEY} ({d!r}) must be a JSON object of {sorted(cls.__dataclass_fields__)}")
        d = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: {cls.KEY} has unknown key(s) {sorted(unknown)}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}")
        try:
            return cls(**d)
        except ValueError as e:
            raise ValueError(f"{where}: {e}") from None

    def asdict(self) -> dict:
        return dataclasses.asdict(self)

    def check_world(self, config, ccfg) -> None:
        """The rules that need the run's other sections and its cluster (a layout against the world and the experts,
        tokens against the ranks): `config` is the run's `RunConfig`, `ccfg` the `ClusterConfig` it will start.
        Raises a one-line ValueError naming the key; a question without such rules has nothing to check."""


def as_tuple(obj, name: str):
    """obj.name, a JSON list made the tuple a frozen dataclass keeps (set in place)."""
    v = getattr(obj, name)
    if isinstance(v, list):
        v = tuple(v)
        object.__setattr__(obj, name, v)
    return v


def tuple_of(obj, name: str, kind: type, allowed=None) -> tuple:
    """obj.name as a non-empty tuple of distinct `kind` values (from allowed); a JSON list becomes a tuple."""
    v = as_tuple(obj, name)
    ok = (isinstance(v, tuple) and v
          and all(isinstance(x, kind) and (kind is not int or (not isinstance(x, bool) and x > 0)) for x in v)
          and len(set(v)) == len(v) and (allowed is None or all(x in allowed for x in v)))
    if not ok:
        what = "positive integers" if kind is int else f"{kind.__name__} values"
        raise ValueError(f"{obj.KEY}.{name} ({v!r}) must be a non-empty list of distinct {what}"
                         + (f" from {', '.join(map(repr, allowed))}" if allowed else ""))
    return v


class Flat(Section):
    """One notebook's parameters, read from the profile's top level (their keys are flat, as `-p key=value` sets
    them): each field is a profile key, absent = its default. `of(params)` is how an experiment reads them."""

    NOTEBOOK: ClassVar[str] = ""
    SPLIT: ClassVar[dict] = {}
    """field → separator: a string value (as `-p` gives it) split into a list."""

    @classmethod
    def of(cls, params, where: str = "parameters"):
        """From a flat profile dict (the parse, `profiles`); from a parsed `RunConfig`, its instance."""
        if hasattr(params, "questions"):
            return params.params(cls)
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


def bools(obj, name: str) -> None:
    v = as_tuple(obj, name)
    if not isinstance(v, tuple) or not v or not all(isinstance(x, bool) for x in v):
        raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a non-empty list of true/false")


def strs(obj, name: str, allowed=None, *, empty_ok: bool = False, what: str = "") -> None:
    v = as_tuple(obj, name)
    ok = isinstance(v, tuple) and (v or empty_ok) and all(isinstance(x, str) for x in v) \
        and (allowed is None or all(x in allowed for x in v))
    if not ok:
        raise ValueError(f"{name} ({list(v) if isinstance(v, tuple) else v!r}) must be a "
                         f"{'' if empty_ok else 'non-empty '}list of "
                         + (what or (", ".join(allowed) if allowed else "strings")))
