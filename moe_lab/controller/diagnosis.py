"""Controller side: why a call on the engines failed — which rank, doing what — from remote tracebacks, the engine
processes and stack dumps the engines write on SIGUSR1. Pure functions, except `where` (signals engines on this host).

Blame rule for a collective that failed or hung (#16): a rank is named only if it is the cause — it returned without
calling the collective, it is busy outside any collective, or its process is gone. Ranks that report the same
collective's timeout, or whose stack shows them waiting in it, are its victims and are never named as the cause.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import time


class ClusterError(RuntimeError):
    """An engine failed, died or timed out; the message names the rank(s) and what they were doing.

    `kind` is one of 'failed' (an exception on a rank), 'died' (an engine process is gone), 'collective' (a
    collective failed or hung: `ranks` did not join it), 'timeout' (ranks did not answer in time).
    """

    def __init__(self, message: str, *, kind: str = "failed", ranks: list[int] | None = None, stopped: bool = False):
        super().__init__(message)
        self.kind, self.ranks, self.stopped = kind, list(ranks or []), stopped

# ---------------------------------------------------------------------- helpers (pure, or processes by profile)
_ANSI = re.compile(r"\x1b\[[0-9;]*m")

_COLLECTIVE_PATTERNS = re.compile(
    r"Timed out waiting|pair closure|Connection closed by peer|Connection reset by peer|Broken pipe|"
    r"DistBackendError|DistNetworkError|NCCL|collective operation timeout|Socket Timeout", re.I)

def _remote_message(e: BaseException) -> str:
    ename = getattr(e, "ename", None)
    evalue = getattr(e, "evalue", None)
    if ename:
        return f"{ename}: {evalue}"
    return f"{type(e).__name__}: {e}"

def _is_collective_error(e: BaseException) -> bool:
    return bool(_COLLECTIVE_PATTERNS.search(_remote_message(e)))

def _remote_frames(e: BaseException) -> list[tuple[str, int, str]]:
    """(file, line, function) of a remote traceback, outermost first (IPython's or Python's format)."""
    tb = _ANSI.sub("", getattr(e, "traceback", None) or "")
    frames = []
    for m in re.finditer(r'File "?([^",\n]+?)"?(?::(\d+)|, line (\d+)),? in (\w[\w.<>]*)', tb):
        frames.append((m.group(1), int(m.group(2) or m.group(3)), m.group(4)))
    return frames

def _dump_frames(text: str, main_thread: int) -> list[tuple[str, int, str]] | None:
    """The main thread's frames from a faulthandler dump, outermost first; None until the dump is complete."""
    want = f"0x{main_thread:016x}"
    lines = text.splitlines()
    for k, line in enumerate(lines):
        if want in line and ("Thread" in line or "thread" in line):
            frames = []
            for fl in lines[k + 1:]:
                m = re.match(r'\s+File "([^"]+)", line (\d+) in (\S+)', fl)
                if not m:
                    break
                frames.append((m.group(1), int(m.group(2)), m.group(3)))
            return frames[::-1]  # faulthandler lists the most recent call first
    return None

def _collective_of(frames: list[tuple[str, int, str]]) -> tuple[str | None, str | None]:
    """The outermost torch.distributed call in `frames` (outermost first) and the frame that made it."""
    for k, (file, _, fn) in enumerate(frames):
        if "torch/distributed/" in file.replace("\\", "/") and file.endswith("distributed_c10d.py"):
            caller = next(((f, ln, name) for f, ln, name in reversed(frames[:k])
                           if "torch/distributed/" not in f.replace("\\", "/")), None)
            return fn, (f"{caller[2]} at {os.path.basename(caller[0])}:{caller[1]}" if caller else None)
    return None, None

_PLUMBING = ("/ipyparallel/", "/ipykernel/", "/tornado/", "/asyncio/", "/traitlets/", "<string>", "<frozen")

def _innermost(frames: list[tuple[str, int, str]]) -> str:
    """The innermost frame (not the engine's own plumbing), and the innermost of our own code (moe_lab) under it."""
    frames = [f for f in frames if not any(s in f[0].replace("\\", "/") for s in _PLUMBING)]
    if not frames:
        return "native code called directly (no Python frame of its own)"
    ours = [f for f in frames if "/moe_lab/" in f[0].replace("\\", "/")]

    def name(f):
        return f"{f[2]} at {os.path.basename(f[0])}:{f[1]}"

    if ours and ours[-1] != frames[-1]:
        return f"{name(frames[-1])} (called from {name(ours[-1])})"
    return name(frames[-1])


def process_state(pid: int) -> str | None:
    """Why a live local engine cannot answer, from its process state: 'stopped (…)' for SIGSTOP / Ctrl-Z / a
    debugger, 'in uninterruptible sleep (…)'; None for a running or sleeping process (or one that is gone)."""
    import psutil

    try:
        st = psutil.Process(pid).status()
    except psutil.Error:
        return None
    if st == psutil.STATUS_STOPPED:
        return "stopped (process state 'stopped': SIGSTOP, Ctrl-Z or a debugger)"
    if st == getattr(psutil, "STATUS_TRACING_STOP", "tracing-stop"):
        return "stopped by a debugger (process state 'tracing-stop')"
    if st == psutil.STATUS_DISK_SLEEP:
        return "in uninterruptible sleep (process state 'disk-sleep': waiting on I/O or the OS)"
    return None


def where(procs: list[dict], ranks: list[int], wait_s: float = 1.0) -> dict[int, tuple[str | None, str]]:
    """rank → (collective or None, 'waiting in <collective> (<caller>)' or 'in <function> at <file:line>'), from a
    SIGUSR1 stack dump of each engine on this host (`engine.dist.identify` registers the handler); for an engine on
    this host that cannot dump (stopped, uninterruptible) or did not within `wait_s`, (None, why: process_state, or
    'not answering: …'). `procs[r]` is rank r's process record (pid, node, main_thread, stack_file); ranks on other
    hosts are left out."""
    here = platform.node()
    todo, out = {}, {}
    for r in ranks:
        p = procs[r] if r < len(procs) else None
        if not p or p["node"] != here:
            continue
        state = process_state(p["pid"])
        if state or not p.get("stack_file"):
            out[r] = (None, state or "not answering (no stack file to read its stack from)")
            continue
        try:
            size = os.path.getsize(p["stack_file"])
            os.kill(p["pid"], signal.SIGUSR1)
            todo[r] = (p, size)
        except OSError:
            continue
    deadline = time.monotonic() + wait_s
    seen = {r: -1 for r in todo}
    while todo and time.monotonic() < deadline:
        time.sleep(0.03)
        for r, (p, size) in list(todo.items()):
            try:
                now_size = os.path.getsize(p["stack_file"])
            except OSError:
                continue
            if now_size == size or now_size != seen[r]:  # nothing yet, or still being written
                seen[r] = now_size
                continue
            with open(p["stack_file"]) as f:
                f.seek(size)
                frames = _dump_frames(f.read(), p["main_thread"])
            if frames is None:
                continue
            coll, caller = _collective_of(frames)
            if coll:
                out[r] = (coll, f"waiting in {coll}" + (f" ({caller})" if caller else ""))
            else:
                out[r] = (None, f"in {_innermost(frames)}")
            del todo[r]
    for r, (p, _) in todo.items():  # no dump in time
        out[r] = (None, process_state(p["pid"]) or f"not answering (no stack dump within {wait_s:.0f} s)")
    return out


def blame(ranks: list[int], *, returned: set[int], errored: set[int],
          pending: dict[int, tuple[str | None, str] | None]) -> tuple[list[int], list[str]]:
    """The ranks that caused a collective to fail or hang, and a note on each.

    returned: ranks whose call finished without error (they never entered the collective, or left it early);
    errored:  ranks that reported the collective's own failure (its victims);
    pending:  ranks still running → their `where` entry (None where no stack could be read: another host).
    A pending rank waiting in a collective is a victim; one busy elsewhere, or unreadable, is named.
    """
    culprits, notes = [], []
    for r in ranks:
        if r in returned:
            culprits.append(r)
            notes.append(f"rank {r} returned without calling it")
        elif r in pending and r not in errored:
            w = pending[r]
            if w is None:
                culprits.append(r)
                notes.append(f"rank {r} is still busy (its stack cannot be read from this host)")
            elif w[0] is None:
                culprits.append(r)
                notes.append(f"rank {r} is still busy {w[1]}" if w[1].startswith("in ") else f"rank {r} is {w[1]}")
    return culprits, notes


def remote_message(e: BaseException) -> str:
    return _remote_message(e)


def is_collective_error(e: BaseException) -> bool:
    return _is_collective_error(e)


def collective_of_error(e: BaseException) -> tuple[str | None, str | None]:
    """The torch.distributed call a remote exception was raised in, and the frame that made it."""
    return _collective_of(_remote_frames(e))


__all__ = ["ClusterError", "where", "blame", "remote_message", "is_collective_error", "collective_of_error"]
