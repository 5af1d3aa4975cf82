"""Folders the lab writes into, checked before anything starts: one line naming the path, the flag the user
gave and why it cannot be used — never a traceback. No torch here."""

from __future__ import annotations

import os
from pathlib import Path


def writable_dir(path: str | os.PathLike, flag: str = "--out") -> Path:
    """Create `path` (parents too) and prove a file can be written there; raise ValueError in one line otherwise
    (a path under a file, /proc, no permission, a read-only mount)."""
    p = Path(path)
    try:
        p.mkdir(parents=True, exist_ok=True)
        probe = p / f".moe_lab-write-test-{os.getpid()}"
        probe.write_text("")
        probe.unlink()
    except OSError as e:
        raise ValueError(f"{flag} ({p}) is not a writable directory: {e.strerror or e}; choose another {flag}") \
            from None
    return p


def check_writable(path: str | os.PathLike, flag: str = "--out") -> Path:
    """`writable_dir`'s test without its trace: the folders it had to create are removed again, so input refused
    later (a bad parameter, a missing release) leaves nothing behind. Same one-line ValueError."""
    p = Path(path)
    missing = []
    for d in (p, *p.parents):
        if d.exists() or d == d.parent:
            break
        missing.append(d)
    try:
        return writable_dir(p, flag)
    finally:
        for d in missing:  # deepest first: each is empty again once the probe file is gone
            try:
                d.rmdir()
            except OSError:
                break


class ReportWriteError(RuntimeError):
    """A file of the report could not be written once the run had started (the folder made read-only, a full disk, a
    path taken by a directory): the CLI says it in one line and exits 3; what was written before is kept."""

    def __init__(self, path: str | os.PathLike, error: OSError, kept: str = ""):
        self.path, self.error = str(path), error
        why = error.strerror or type(error).__name__
        super().__init__(f"cannot write {path} ({why}) during the run, so it stopped there" + (f"; {kept}" if kept
                         else "") + "; make the folder writable (a read-only or full file system, a directory where the "
                         "file goes) or give another --out, and run again: finished cases are reused")


def failed_write(e: BaseException, folder: str | os.PathLike) -> str | None:
    """The path under `folder` an OSError (or an exception caused by one) failed to write, else None."""
    seen = 0
    while e is not None and seen < 5:
        if isinstance(e, OSError) and e.filename and _under(e.filename, folder):
            return str(e.filename)
        e, seen = e.__cause__ or e.__context__, seen + 1
    return None


def _under(path, folder) -> bool:
    try:
        return Path(os.path.abspath(path)).is_relative_to(Path(os.path.abspath(folder)))
    except (TypeError, ValueError):
        return False


__all__ = ["writable_dir", "ReportWriteError", "failed_write"]
