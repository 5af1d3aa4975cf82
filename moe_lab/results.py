"""results.json: tidy records appended atomically (write-then-rename) in the current schema (`records.SCHEMA`), read
back through `records.upgrade` (every committed schema), as pandas DataFrames."""

from __future__ import annotations

import contextlib
import json
import logging
import lzma
import os
import tempfile
from pathlib import Path

from . import records as _records

logger = logging.getLogger(__name__)


class ResultsFileError(RuntimeError):
    """results.json exists but cannot be read; it is never overwritten silently."""


def load(path: str | os.PathLike) -> list[dict]:
    """The records in `path`; a missing results.json is read from results.json.xz beside it (a published report's
    records, lzma-compressed), a missing file of neither kind is no records."""
    p = Path(path)
    if not p.exists() and p.with_name(p.name + ".xz").is_file():
        p = p.with_name(p.name + ".xz")
    if not p.exists():
        return []
    try:
        data = json.loads(lzma.decompress(p.read_bytes()).decode() if p.suffix == ".xz" else p.read_text())
    except lzma.LZMAError as e:
        raise ResultsFileError(f"{p} is not lzma-compressed JSON ({e}); it was not overwritten") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p} is not valid JSON ({e}); move it aside or delete it, it was not overwritten") from None
    except UnicodeDecodeError as e:
        raise ResultsFileError(f"{p} is not UTF-8 text ({e}); move it aside or delete it, "
                               "it was not overwritten") from None
    except OSError as e:  # a directory, unreadable, a broken mount: the path and why, never a traceback
        raise ResultsFileError(f"{p} cannot be read ({e.strerror or type(e).__name__}); fix or move it, or give "
                               "another --out") from None
    if not isinstance(data, list):
        raise ResultsFileError(f"{p} must hold a JSON list of records, found {type(data).__name__}; "
                               "it was not overwritten")
    bad = [i for i, r in enumerate(data) if not isinstance(r, dict)]
    if bad:
        raise ResultsFileError(f"{p}: entries {bad[:5]} are not records (JSON objects); it was not overwritten")
    return _upgraded(p, data)


def _upgraded(p: Path, data: list[dict]) -> list[dict]:
    """Every record in the current schema (`records.upgrade`: the one reader of every committed schema)."""
    try:
        return [_records.upgrade(r) for r in data]
    except ValueError as e:
        raise ResultsFileError(f"{p}: {e}; it was not overwritten") from None


def append(path: str | os.PathLike, records: list[dict], **common) -> list[dict]:
    """Add `records` (each updated with `common`, e.g. notebook='01') to the list in `path`, atomically.

    The new list goes to a temporary file in the same directory, is flushed to disk, then renamed over `path`: a
    crash at any point leaves either the old or the new file, never a partial one. Appends from several processes
    are serialised by a lock on the directory, so none is lost.
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = [_records.stamp({**common, **r}) for r in records]  # written in the current schema
    with _locked(p.parent):
        data = load(p) + new  # raises ResultsFileError on a bad file: nothing is written then
        fd, tmp = tempfile.mkstemp(prefix=p.name + ".", suffix=".tmp", dir=p.parent)
        try:
            with os.fdopen(fd, "w") as f:
                json.dump(data, f, indent=1, default=_default)
                f.flush()
                os.fsync(f.fileno())
            os.chmod(tmp, 0o666 & ~_umask())  # mkstemp makes 0600; a report file gets ordinary permissions
            os.replace(tmp, p)
        except BaseException:
            if os.path.exists(tmp):
                os.unlink(tmp)
            raise
    return new


@contextlib.contextmanager
def _locked(directory: Path):
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: renames are still atomic, concurrent appends may race
        yield
        return
    fd = os.open(directory, os.O_RDONLY)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)  # closing releases the lock


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask


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


def latest(records: list[dict], out_dir: str | os.PathLike) -> list[dict]:
    """The records each notebook's latest run showed (per `cases-NN.json`); a notebook without one keeps all."""
    out = []
    records = [r for r in records if isinstance(r, dict)]
    for nb in dict.fromkeys(r.get("notebook") for r in records):
        p = Path(out_dir) / f"cases-{nb}.json"
        mine = [r for r in records if r.get("notebook") == nb]
        try:
            keys = set(json.loads(p.read_text())["keys"]) if p.exists() else None
        except (OSError, json.JSONDecodeError, KeyError):
            keys = None
        out += mine if keys is None else [r for r in mine if r.get("case_key") in keys]
    return out

