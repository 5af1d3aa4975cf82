"""Folders the lab writes into, checked before anything starts (#25): one line naming the path, the flag the user
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


__all__ = ["writable_dir"]
