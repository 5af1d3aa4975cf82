"""The shared libraries an engine's first imports read (torch's and the CUDA packages'), read into the page cache in
background threads as soon as a command that starts GPU engines begins.

On a fresh GPU machine the engines' imports are disk-bound: the importing process (the preload server, or each engine)
faults torch's and CUDA's libraries in page by page, one file after another. Read in large chunks, several files at
a time, while the command checks its input and starts its controller, the same bytes are in the page cache by the
time the imports ask for them. On a warm cache it costs a read from memory. It never blocks the command and any
error ends it quietly: a speed-up, never a condition. `MOE_LAB_READAHEAD=0` / `1` turns it off / on; by default it
runs where the command's engines use GPUs.

Torch-free: it finds the files through the packages' locations, without importing them.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import threading
import time
from pathlib import Path

from .. import switches

logger = logging.getLogger(__name__)

READAHEAD_ENV = "MOE_LAB_READAHEAD"
PACKAGES = ("torch", "nvidia")
"""Whose shared libraries are read: torch's own (lib/) and the CUDA libraries' wheels (the `nvidia` namespace)."""
THREADS = 4
CHUNK = 16 * 2**20
MAX_BYTES = 12 * 2**30
"""At most this much is read (a machine whose libraries are larger keeps the largest files for last and skips the
rest): the CUDA build's libraries are a few GB."""


def wanted(device: str | None) -> bool:
    """Whether a command whose engines run on `device` ('cuda', 'cpu', or None / 'auto': a GPU if one is visible)
    reads the libraries ahead."""
    forced = switches.forced(READAHEAD_ENV)
    if forced is not None:
        return forced
    if device == "cuda":
        return True
    return device in (None, "auto") and os.path.exists("/dev/nvidiactl")


def library_files(packages=PACKAGES) -> list[Path]:
    """The shared libraries (`*.so*`) under each package's folder, smallest first (the many small ones an import
    opens early are read first; the largest, read last, overlap the controller's start)."""
    files = []
    for name in packages:
        try:
            spec = importlib.util.find_spec(name)
        except (ImportError, ValueError):
            continue
        for root in (spec.submodule_search_locations or []) if spec else []:
            for p in Path(root).rglob("*.so*"):
                try:
                    if p.is_file():
                        files.append((p.stat().st_size, p))
                except OSError:
                    continue
    files.sort(key=lambda sp: sp[0])
    out, total = [], 0
    for size, p in files:
        if total + size > MAX_BYTES:
            break
        out.append(p)
        total += size
    return out


class Readahead:
    """Background threads reading `files` once, each into a scratch buffer (the bytes are dropped: the page cache
    keeps them). `done` is set when every thread has finished; `bytes` and `seconds` say what was read."""

    def __init__(self, files: list[Path], threads: int = THREADS):
        self.files, self.bytes, self.seconds = list(files), 0, 0.0
        self.done = threading.Event()
        self._lock = threading.Lock()
        self._next = 0
        self._left = max(1, min(threads, len(self.files)))
        self._t0 = time.perf_counter()
        if not self.files:
            self.done.set()
            return
        for i in range(self._left):
            threading.Thread(target=self._work, name=f"moe_lab-readahead-{i}", daemon=True).start()

    def _take(self) -> Path | None:
        with self._lock:
            if self._next >= len(self.files):
                return None
            self._next += 1
            return self.files[self._next - 1]

    def _work(self) -> None:
        buf = bytearray(CHUNK)
        read = 0
        try:
            while (p := self._take()) is not None:
                try:
                    with open(p, "rb", buffering=0) as f:
                        while n := f.readinto(buf):
                            read += n
                except OSError:
                    continue
        finally:
            with self._lock:
                self.bytes += read
                self._left -= 1
                last = self._left == 0
            if last:
                self.seconds = time.perf_counter() - self._t0
                logger.info("read %.1f GB of torch's and CUDA's libraries ahead of the imports in %.1f s (%d files)",
                            self.bytes / 1e9, self.seconds, len(self.files))
                self.done.set()


def start(device: str | None) -> Readahead | None:
    """Start reading the libraries ahead where `wanted(device)`; None where not (or where nothing could be found)."""
    if not wanted(device):
        return None
    try:
        files = library_files()
    except OSError:
        return None
    return Readahead(files) if files else None


__all__ = ["wanted", "library_files", "Readahead", "start", "READAHEAD_ENV"]
