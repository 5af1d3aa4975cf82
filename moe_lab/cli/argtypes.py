"""The types of `moe-lab`'s flags: each value is checked where it is parsed, so bad input is one line and exit 2
before anything starts — counts in range, finite timeouts a timer can hold (whole seconds where papermill needs
them), finite amounts of memory, non-empty names, notebook lists without repeats. The rule of a value that an API
also takes lives in `moe_lab.config` (`seconds_ok`, MAX_DIM, ...) and is called from here."""

from __future__ import annotations

import argparse
import math

from ..config import MAX_SECONDS, SECONDS_RULE, seconds_ok


def count(lo: int = 1, hi: int | None = None):
    """An int flag in lo..hi (a count of trials, engines, GPUs, rounds; a layer size)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        if hi is not None and v > hi:
            raise argparse.ArgumentTypeError(f"{v} must be <= {hi}")
        return v
    return parse


def seconds(s: str) -> float:
    """A timeout flag: a number of seconds by `config.seconds_ok` (finite, in [MIN_SECONDS, MAX_SECONDS])."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    if not seconds_ok(v):
        raise argparse.ArgumentTypeError(f"{s!r}: seconds must be {SECONDS_RULE}")
    return v


def whole_seconds(s: str) -> int:
    """A timeout that papermill takes (its execution_timeout is an int): `seconds`, rounded up to whole seconds."""
    return math.ceil(seconds(s))


def number(what: str, *, above: float | None = None, least: float | None = None, most: float | None = None):
    """A finite real number flag (GiB of memory, TFLOP/s, a ratio): > above, >= least, <= most where given."""
    def parse(s: str) -> float:
        try:
            v = float(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a number ({what})") from None
        ok = (math.isfinite(v) and (above is None or v > above) and (least is None or v >= least)
              and (most is None or v <= most))
        if not ok:
            rule = ", ".join(f"{op} {bound:.15g}" for op, bound in (("> ", above), (">=", least), ("<=", most))
                             if bound is not None).replace(">  ", "> ")
            raise argparse.ArgumentTypeError(f"{s!r}: {what} must be finite" + (f", {rule}" if rule else ""))
        return v
    return parse


def nonempty(what: str):
    def parse(s: str) -> str:
        if not s.strip():
            raise argparse.ArgumentTypeError(f"empty {what}")
        return s.strip()
    return parse


def notebooks(s: str) -> str:
    """--only: a non-empty comma list of notebook numbers, each once (which exist is checked by runner.select)."""
    want = [w.strip().zfill(2) for w in s.split(",") if w.strip()]
    if not want:
        raise argparse.ArgumentTypeError(f"{s!r}: give notebook numbers, e.g. --only 01,03")
    dup = sorted({w for w in want if want.count(w) > 1})
    if dup:
        raise argparse.ArgumentTypeError(f"{s!r}: notebook {', '.join(dup)} given twice")
    return ",".join(want)


__all__ = ["count", "seconds", "whole_seconds", "number", "nonempty", "notebooks", "MAX_SECONDS"]


def model(s: str) -> str:
    """A model preset's name (`moe_lab.models.PRESETS`)."""
    from .. import models

    try:
        return models.get(s.strip()).name
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def scale(s: str) -> float:
    """A preset's scale: a number in (0, 1] (hidden and ffn are multiplied by it)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number") from None
    if not 0 < v <= 1:
        raise argparse.ArgumentTypeError(f"{s!r} must be in (0, 1], e.g. 0.125")
    return v


def layout(s: str):
    """A parallel layout, e.g. tp2,ep4 (`moe_lab.layout.Layout.parse`)."""
    from ..layout import Layout

    try:
        return Layout.parse(s)
    except ValueError as e:
        raise argparse.ArgumentTypeError(str(e)) from None


def model_list(s: str) -> list[str]:
    """One or more model presets, comma separated, each once (`moe-lab probe --model a,b` probes both on one cluster)."""
    names = [model(v) for v in s.split(",") if v.strip()]
    if not names:
        raise argparse.ArgumentTypeError(f"{s!r}: give a preset, e.g. qwen3-30b-a3b")
    if len(set(names)) != len(names):
        raise argparse.ArgumentTypeError(f"{s!r}: a preset named twice")
    return names
