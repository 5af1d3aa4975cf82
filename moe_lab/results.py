"""results.json: tidy records appended atomically (write-then-rename), read back as pandas DataFrames."""

from __future__ import annotations

import json
import os
import tempfile
from pathlib import Path


class ResultsFileError(RuntimeError):
    """results.json exists but cannot be read; it is never overwritten silently."""


def load(path: str | os.PathLike) -> list[dict]:
    p = Path(path)
    if not p.exists():
        return []
    try:
        data = json.loads(p.read_text())
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p} is not valid JSON ({e}); move it aside or delete it, it was not overwritten") from None
    if not isinstance(data, list):
        raise ResultsFileError(f"{p} must hold a JSON list of records, found {type(data).__name__}; it was not overwritten")
    return data


def append(path: str | os.PathLike, records: list[dict], **common) -> list[dict]:
    """Add `records` (each updated with `common`, e.g. notebook='01') to the list in `path`, atomically."""
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    existing = load(p)
    new = [{**common, **r} for r in records]
    data = existing + new
    fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
    try:
        with os.fdopen(fd, "w") as f:
            json.dump(data, f, indent=1, default=_default)
            f.flush()
            os.fsync(f.fileno())
        os.replace(tmp, p)
    except BaseException:
        if os.path.exists(tmp):
            os.unlink(tmp)
        raise
    return new


def _default(o):
    if hasattr(o, "item"):
        return o.item()
    if isinstance(o, (set, tuple)):
        return list(o)
    raise TypeError(f"{type(o).__name__} is not JSON serialisable")


def tidy(records: list[dict]):
    """One row per record; nested comparisons flattened as `cross_rank.mismatch_frac` etc. `detail` dropped."""
    import pandas as pd

    rows = [{k: v for k, v in r.items() if k not in ("detail", "config")} | {"config": json.dumps(r.get("config"))}
            for r in records]
    return pd.json_normalize(rows, sep=".")
