"""results.json: tidy records appended atomically (write-then-rename, `fsio.write_atomic`) in the current schema
(`records.SCHEMA`), read back through `records.upgrade` (every committed schema), as pandas DataFrames; and the run
lists beside it (`cases-NN.json`: which records a notebook's latest run showed). Every file here is read without
blocking (`fsio.read_regular`) and checked: a file that is not a report's is one ResultsFileError naming it."""

from __future__ import annotations

import contextlib
import json
import logging
import lzma
import os
from pathlib import Path

from . import fsio
from . import records as _records

logger = logging.getLogger(__name__)

LAB_FIELDS = ("notebook", "config", "dispatcher", "router_dtype", "device", "world", "megatron_core")
"""Fields every record the lab has written carries, in every committed schema (a skipped case's record too): a
record without them was written by another tool or edited, and no finding can read it."""


class ResultsFileError(RuntimeError):
    """results.json (or a cases-NN.json beside it) exists but cannot be read; it is never overwritten silently."""


def load(path: str | os.PathLike) -> list[dict]:
    """The records in `path`; a missing results.json is read from results.json.xz beside it (a published report's
    records, lzma-compressed), a missing file of neither kind is no records. A case measured more than once (two runs
    into one folder) is read as its latest measurement, said once in the log."""
    p = _existing(Path(path))
    if p is None:
        return []
    return _latest_measurements(p, _read(p))


def _existing(p: Path) -> Path | None:
    if not _exists(p) and p.with_name(p.name + ".xz").is_file():
        p = p.with_name(p.name + ".xz")
    return p if _exists(p) else None


def _exists(p: Path) -> bool:
    return p.exists() or p.is_symlink()  # a dangling link is a file that cannot be read, not a missing one


def _read(p: Path) -> list[dict]:
    """Every record in `p` (present), checked and in the current schema; ResultsFileError naming `p` otherwise."""
    try:
        raw = fsio.read_regular(p)
        data = json.loads(lzma.decompress(raw).decode() if p.suffix == ".xz" else raw.decode())
    except lzma.LZMAError as e:
        raise ResultsFileError(f"{p} is not lzma-compressed JSON ({e}); it was not overwritten") from None
    except json.JSONDecodeError as e:
        raise ResultsFileError(f"{p} is not valid JSON ({e}); move it aside or delete it, it was not overwritten") from None
    except UnicodeDecodeError as e:
        raise ResultsFileError(f"{p} is not UTF-8 text ({e}); move it aside or delete it, "
                               "it was not overwritten") from None
    except OSError as e:  # a directory, a FIFO, unreadable, a broken mount: the path and why, never a traceback
        raise ResultsFileError(f"{p} cannot be read ({e.strerror or type(e).__name__}); fix or move it, or give "
                               "another --out") from None
    except RecursionError:
        raise ResultsFileError(f"{p} nests its JSON too deep to be records; move it aside or delete it, it was not "
                               "overwritten") from None
    if not isinstance(data, list):
        raise ResultsFileError(f"{p} must hold a JSON list of records, found {type(data).__name__}; "
                               "it was not overwritten")
    bad = [i for i, r in enumerate(data) if not isinstance(r, dict)]
    if bad:
        raise ResultsFileError(f"{p}: entries {bad[:5]} are not records (JSON objects); it was not overwritten")
    for i, r in enumerate(data):
        _check_shape(p, i, r)
    return _upgraded(p, data)


def _check_shape(p: Path, i: int, r: dict) -> None:
    """The fields every reader indexes or groups by have the shape the lab writes: a string (or absent) for
    notebook, case_key, experiment and kind, a JSON object (or absent) for config and env."""
    for k in ("notebook", "case_key", "experiment", "kind"):
        if not isinstance(r.get(k), (str, type(None))):
            raise ResultsFileError(f"{p}: record {i} has {k} {r.get(k)!r} ({type(r.get(k)).__name__}); a moe-lab "
                                   f"record's {k} is a string — this file is not a report's results.json, or was "
                                   "edited by hand")
    for k in ("config", "env"):
        if not isinstance(r.get(k), (dict, type(None))):
            raise ResultsFileError(f"{p}: record {i} has {k} of type {type(r.get(k)).__name__}; a moe-lab record's "
                                   f"{k} is a JSON object — this file is not a report's results.json, or was edited "
                                   "by hand")


def _upgraded(p: Path, data: list[dict]) -> list[dict]:
    """Every record in the current schema (`records.upgrade`: the one reader of every committed schema)."""
    try:
        return [_records.upgrade(r) for r in data]
    except ValueError as e:
        raise ResultsFileError(f"{p}: {e}; it was not overwritten") from None


_said: set = set()


def _say_once(key: tuple, message: str) -> None:
    """A warning about a file, logged once per process (the file is read by every page and finding)."""
    if key not in _said:
        _said.add(key)
        logger.warning("%s", message)


def say_unreadable(p: str | os.PathLike, records: list[dict]) -> None:
    """Log once (per file and count) that records of `p` lack the fields every record the lab writes carries: no
    finding can read them, and a reader of findings would otherwise see NOT MEASURED without a word why. Said where
    findings are read (`moe-lab findings`, the start of `moe-lab run`), not by every load (a notebook's kernel)."""
    odd = [(i, [k for k in LAB_FIELDS if k not in r]) for i, r in enumerate(records)]
    odd = [(i, missing) for i, missing in odd if missing]
    if not odd:
        return
    i, missing = odd[0]
    _say_once((str(p), "fields", len(odd)), (
        f"{p}: {len(odd)} of {len(records)} record(s) lack fields every moe-lab record carries in schemas 1-"
        f"{_records.SCHEMA} (e.g. record {i} has no {', '.join(missing)}): written by another tool or edited by hand; "
        "no finding reads them, so their cases show as NOT MEASURED"))


def _latest_measurements(p: Path, records: list[dict]) -> list[dict]:
    """`records` with each case's latest measurement only. One measurement's records are appended together (one
    `append`: contiguous, one case key, time and wall time); a case key met again in a later block was measured
    again — two runs wrote into one folder at once, or a file was joined by hand — and its earlier blocks are left
    out, so no reader meets one case twice."""
    block_of, last, prev, b = [], {}, None, -1
    for r in records:
        key = r.get("case_key")
        if not key:
            block_of.append(None)
            prev = None
            continue
        mark = (key, json.dumps(r.get("time"), default=str), json.dumps(r.get("case_wall_s"), default=str))
        if mark != prev:
            b, prev = b + 1, mark
        block_of.append(b)
        last[key] = b
    keep = [r for r, blk in zip(records, block_of) if blk is None or last[r["case_key"]] == blk]
    if len(keep) < len(records):
        again = sorted({r["case_key"] for r, blk in zip(records, block_of) if blk is not None
                        and last[r["case_key"]] != blk})
        _say_once((str(p), "again", len(again), len(records)), (
            f"{p}: {len(again)} case(s) were measured more than once (e.g. case {again[0]}; two runs wrote into this "
            f"folder, or the file was joined by hand): the latest measurement of each is read, "
            f"{len(records) - len(keep)} earlier record(s) left out"))
    return keep


def append(path: str | os.PathLike, records: list[dict], **common) -> list[dict]:
    """Add `records` (each updated with `common`, e.g. notebook='01') to the list in `path`, atomically.

    The new list is written by `fsio.write_atomic` (a temporary file, flushed, renamed over `path`): a crash or a
    full disk at any point leaves either the old or the new file, never a partial one. Appends from several
    processes are serialised by a lock file beside `path`, so none is lost. A failed write is the OSError naming
    `path` (whichever of its temporary or lock files failed).
    """
    p = Path(path)
    p.parent.mkdir(parents=True, exist_ok=True)
    new = [_records.stamp({**common, **r}) for r in records]  # written in the current schema
    try:
        with _locked(p):
            old = _existing(p)
            body = _as_written(p) if old == p else None
            if body is None:  # ResultsFileError on a bad file: nothing written
                body = _dumps(_read(old) if old is not None else [])
            text = _dumps(new) if body == _EMPTY else body[:-len(_TAIL)] + b",\n" + _dumps(new)[len(_HEAD):]
            fsio.write_atomic(p, text)
            _WRITTEN[str(p)] = (_signature(p), text)
    except OSError as e:
        if e.errno is None or e.filename == str(p) and e.filename2 is None:
            raise
        raise OSError(e.errno, e.strerror, str(p)) from e  # its subclass by errno (IsADirectoryError, ...)
    return new


_HEAD, _TAIL, _EMPTY = b"[\n", b"\n]\n", b"[]\n"
_WRITTEN: dict[str, tuple[tuple, bytes]] = {}
"""What this process last wrote to each results.json (the file's identity after the write, its bytes). An append
reads the file again only if it changed since: each notebook's kernel reads it once, not once per case, and a
change by another process (or by hand) is read and checked as before."""


def _dumps(records: list[dict]) -> bytes:
    """A JSON list, one record per line: Python's C encoder (the pure-Python one serves `indent` and is 3x slower),
    and a file that grep and diff still read line by line."""
    if not records:
        return _EMPTY
    return _HEAD + b",\n".join(json.dumps(r, default=_default).encode() for r in records) + _TAIL


def _signature(p: Path) -> tuple:
    st = os.stat(p)
    return st.st_dev, st.st_ino, st.st_size, st.st_mtime_ns


def _as_written(p: Path) -> bytes | None:
    """The bytes of `p` as this process last wrote them, if it is still that file; None if it changed or is new."""
    held = _WRITTEN.get(str(p))
    try:
        return held[1] if held is not None and held[0] == _signature(p) else None
    except OSError:
        return None


@contextlib.contextmanager
def _locked(p: Path):
    """An exclusive lock on `.<name>.lock` beside `p` for one append. The lock file lives only as long as the
    append: the holder removes it before it lets go, and a process that got the lock on a file that is no longer
    the one at that path (removed meanwhile) takes it again. The report folder itself is locked by a whole
    `moe-lab run` (reporting.runner), so an append must not lock the folder."""
    try:
        import fcntl
    except ImportError:  # pragma: no cover - Windows: renames are still atomic, concurrent appends may race
        yield
        return
    lock = p.with_name(f".{p.name}.lock")
    while True:
        fd = os.open(lock, os.O_RDWR | os.O_CREAT | os.O_NOFOLLOW, 0o666)
        try:
            fcntl.flock(fd, fcntl.LOCK_EX)
            try:
                same = os.path.samestat(os.fstat(fd), os.stat(lock, follow_symlinks=False))
            except FileNotFoundError:
                same = False
        except BaseException:
            os.close(fd)
            raise
        if same:
            break
        os.close(fd)
    try:
        yield
    finally:
        with contextlib.suppress(OSError):
            os.unlink(lock)
        os.close(fd)  # closing releases the lock


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


def cases_path(folder: str | os.PathLike, notebook: str) -> Path:
    return Path(folder) / f"cases-{notebook}.json"


def read_cases(path: str | os.PathLike) -> dict | None:
    """A run list (`cases-NN.json`: {"keys": [case keys], "run_id": ..., "measured": n, "reused": m}, the last three
    optional), or None when there is none; ResultsFileError naming the file and what to do otherwise."""
    p = Path(path)
    if not _exists(p):
        return None
    d, what = fsio.read_json(p)
    if what is None:
        if not isinstance(d, dict):
            what = f"must be a JSON object with the run's case keys (\"keys\"), found {type(d).__name__}"
        elif not isinstance(d.get("keys"), list) or not all(isinstance(k, str) for k in d["keys"]):
            what = "must hold the run's case keys as a list of strings under \"keys\""
        elif not isinstance(d.get("run_id", ""), str):
            what = f"has a run_id of type {type(d['run_id']).__name__}, not a string"
        elif any(k in d and (not isinstance(d[k], int) or isinstance(d[k], bool)) for k in ("measured", "reused")):
            what = "has counts (measured, reused) that are not integers"
    if what is None:
        return d
    nb = p.stem.removeprefix("cases-")
    raise ResultsFileError(f"{p} {what}: it is not the run list of notebook {nb} moe-lab writes; move it away or "
                           f"delete it (every record of notebook {nb} is then read, and its next run writes a new one)")


def latest(records: list[dict], out_dir: str | os.PathLike) -> list[dict]:
    """The records each notebook's latest run showed (per `cases-NN.json`); a notebook without one keeps all. A run
    list that cannot be read is a ResultsFileError naming it."""
    groups: dict = {}
    for r in records:
        if isinstance(r, dict):
            nb = r.get("notebook")
            groups.setdefault(nb if isinstance(nb, (str, type(None))) else ("not a string", repr(nb)), []).append(r)
    out = []
    for nb, mine in groups.items():
        run = read_cases(cases_path(out_dir, nb)) if isinstance(nb, str) and nb else None
        keys = set(run["keys"]) if run is not None else None
        out += mine if keys is None else [r for r in mine if r.get("case_key") in keys]
    return out
