"""The types of `moe-lab`'s flags: each value is checked where it is parsed, so bad input is one line and exit 2
before anything starts — counts >= 1, finite timeouts a timer can hold, non-empty names, notebook lists
without repeats."""

from __future__ import annotations

import argparse

from ..config import MAX_SECONDS, seconds_ok


def count(lo: int = 1):
    """An int flag >= lo (a count of trials, engines, GPUs, rounds; a layer size)."""
    def parse(s: str) -> int:
        try:
            v = int(s)
        except ValueError:
            raise argparse.ArgumentTypeError(f"{s!r} is not a whole number") from None
        if v < lo:
            raise argparse.ArgumentTypeError(f"{v} must be >= {lo}")
        return v
    return parse


def seconds(s: str) -> float:
    """A timeout flag: a finite number of seconds in (0, MAX_SECONDS] (config.seconds_ok)."""
    try:
        v = float(s)
    except ValueError:
        raise argparse.ArgumentTypeError(f"{s!r} is not a number of seconds") from None
    if not seconds_ok(v):
        raise argparse.ArgumentTypeError(f"{s!r}: seconds must be finite, > 0 and <= {MAX_SECONDS:.0f} (a week)")
    return v


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


__all__ = ["count", "seconds", "nonempty", "notebooks", "MAX_SECONDS"]


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
