"""Controller side: why a call on the engines failed — which rank, doing what — from remote tracebacks, the engine
processes and stack dumps the engines write on SIGUSR1. Pure functions, except `where` (signals engines on this host)
and, at the end, a cluster's failure reports (`raise_*`: they read the cluster's processes; the Cluster stops its
engines where the error says `stopped`).

Blame rule for a collective that failed or hung: a rank is named only if it is the cause — it returned without
calling the collective, it is busy outside any collective, or its process is gone. Ranks that report the same
collective's timeout, or whose stack shows them waiting in it, are its victims and are never named as the cause.
"""

from __future__ import annotations

import os
import platform
import re
import signal
import time

from . import processes


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


# ---------------------------------------------------------------------- a cluster's failures (diagnosis lives
# here): which of its engines ended and how, and the ClusterError each kind of failure raises (`stopped` where the
# process group cannot go on: the Cluster stops its engines before the error reaches its caller). `cluster` is the
# cluster's controller.state.ClusterState; nothing here stops or changes it.
def dead_ranks(cluster) -> dict[int, str]:
    """rank → how its engine ended, for every engine whose process is gone (or that left the controller)."""
    dead = {}
    here = platform.node()
    try:
        registered = set(cluster.client.ids) if cluster.client is not None else set()
    except Exception:  # noqa: BLE001 - a closed client: pids below still tell
        registered = set(cluster.engine_ids)
    for rank, eid in enumerate(cluster.engine_ids):
        proc = cluster.procs[rank] if rank < len(cluster.procs) else None
        if proc and proc["node"] == here:
            how = processes.pid_gone(proc["pid"])
            if how is not None:
                dead[rank] = exit_status(cluster, proc["pid"]) or how
                continue
        if eid not in registered:
            # An engine's nanny tells the hub as soon as the engine's pipe closes, while the kernel is still
            # ending the process: wait for it to end, so the report carries its signal or exit code.
            if proc and proc["node"] == here and wait_gone(proc["pid"]):
                dead[rank] = exit_status(cluster, proc["pid"]) or processes.pid_gone(proc["pid"]) or "process gone"
            else:  # a stopped engine misses its heartbeats: the hub drops it while its process lives
                state = process_state(proc["pid"]) if proc and proc["node"] == here else None
                dead[rank] = "unregistered from the controller" + (f": it is {state}" if state else "")
    return dead

def wait_gone(pid: int, wait_s: float = 2.0) -> bool:
    """True once `pid` has ended (within `wait_s`); False if it still runs."""
    deadline = time.monotonic() + wait_s
    while processes.pid_gone(pid) is None:
        if time.monotonic() > deadline:
            return False
        time.sleep(0.02)
    return True

def ended_engines(cluster) -> list[str]:
    """'pid N: exit code C' / 'pid N: killed by SIGKILL' for each engine process of the current engine set that
    has ended (engines this process launched itself: the local launcher; other launchers report nothing here), with
    the last line its log holds, where it wrote one: what it said as it ended (the log goes with the cluster's
    folder)."""
    es = cluster.engine_sets()[1]
    out = []
    for launcher in list(getattr(es, "launchers", {}).values()):
        proc = getattr(launcher, "process", None)
        if proc is not None and processes.pid_gone(proc.pid) is not None:
            out.append(f"pid {proc.pid}: {exit_status(cluster, proc.pid) or processes.pid_gone(proc.pid)}"
                       f"{log_end(_output(launcher.get_output))}")
    outputs = getattr(es, "outputs", None) or {}
    for ident, data in (getattr(es, "stop_data", None) or {}).get("engines", {}).items():  # reaped by ipyparallel
        if isinstance(data, dict) and data.get("pid") and not any(f"pid {data['pid']}:" in o for o in out):
            out.append(f"pid {data['pid']}: {exit_status(cluster, data['pid']) or 'process gone'}"
                       f"{log_end(outputs.get(ident))}")
    return out


LOG_END_CHARS = 200


def log_end(text) -> str:
    """'; its log ends: "<its last non-empty line>"' (shortened to LOG_END_CHARS), or '' for no output."""
    lines = [line.strip() for line in str(text or "").splitlines() if line.strip()]
    return f"; its log ends: {lines[-1][:LOG_END_CHARS]!r}" if lines else ""


def _output(get) -> str:
    """A launcher's output (its log file, read once the process has ended), '' where it cannot be read."""
    try:
        return get()
    except Exception:  # noqa: BLE001 - a diagnosis adds what it can; the exit status is said either way
        return ""


def exit_status(cluster, pid: int) -> str:
    """'exit code N' / 'killed by SIGKILL' for an engine this process started (ipyparallel waits on it). Once
    ipyparallel has noticed the exit (promptly where its event loop runs, e.g. in a notebook's kernel) the engine's
    launcher is gone and its code is in the engine set's stop_data: read there first."""
    for es in cluster.engine_sets()[0]:
        for data in (getattr(es, "stop_data", None) or {}).get("engines", {}).values():
            if isinstance(data, dict) and data.get("pid") == pid and data.get("exit_code") is not None:
                return processes.describe_exit(data["exit_code"])
    for es in cluster.engine_sets()[0]:
        for launcher in list(getattr(es, "launchers", {}).values()):
            proc = getattr(launcher, "process", None)
            if proc is None or proc.pid != pid:
                continue
            # ipyparallel's launcher thread reaps its engines and psutil caches the code; when the check here
            # races that thread (zombie not yet reaped, or reaped under us), give it a moment, then retry.
            deadline = time.monotonic() + 2.0
            while True:
                try:
                    code = proc.wait(timeout=0)
                except Exception:  # noqa: BLE001 - still exiting, or being reaped by the launcher thread
                    code = getattr(proc, "returncode", None)
                if code is not None or time.monotonic() > deadline:
                    return processes.describe_exit(code) if code is not None else ""
                time.sleep(0.05)
    return ""

_CONTROLLERS: dict[str, int | None] = {}  # profile dir → its controller's pid, once looked up (None: not found)


def controller_pid(cluster) -> int | None:
    """The pid of the cluster's ipyparallel controller, through which every call and answer passes: its launcher's
    process where this process started it; for a client of another process's cluster (a run's shared cluster), the
    process of the same profile running `ipyparallel.controller`, looked up once. None where it is not on this host."""
    launcher = getattr(getattr(cluster, "ipp", None), "controller", None)
    pid = getattr(getattr(launcher, "process", None), "pid", None) or getattr(launcher, "pid", None)
    if isinstance(pid, int):
        return pid
    profile = getattr(cluster, "profile_dir", None)
    if not profile:
        return None
    if profile not in _CONTROLLERS:
        found = [p for p in processes.cluster_processes(profile)
                 if any("ipyparallel.controller" in a for a in (p.info.get("cmdline") or ()))]
        pids = {p.pid for p in found}
        roots = []  # its schedulers are forks of it, with its command line: the one whose parent is none of them
        for p in found:
            try:
                if p.ppid() not in pids:
                    roots.append(p.pid)
            except Exception:  # noqa: BLE001 - gone meanwhile
                continue
        _CONTROLLERS[profile] = roots[0] if len(roots) == 1 else None
    return _CONTROLLERS[profile]


def controller_down(cluster, *, stopped: bool = True) -> tuple[int, str, bool] | None:
    """(pid, how, gone) when the cluster's controller cannot pass calls on: its process gone (how: its exit code or
    signal), or — with `stopped` — it or one of its scheduler processes stopped (SIGSTOP, Ctrl-Z, a debugger); None
    while it runs, or when it is not known here."""
    import psutil

    pid = controller_pid(cluster)
    if pid is None:
        return None
    gone = processes.pid_gone(pid)
    if gone is not None:
        launcher = getattr(getattr(cluster, "ipp", None), "controller", None)
        code = (getattr(launcher, "stop_data", None) or {}).get("exit_code") if launcher is not None else None
        proc = getattr(launcher, "process", None)
        deadline = time.monotonic() + 2.0
        while code is None and proc is not None and time.monotonic() < deadline:
            try:  # ipyparallel's launcher thread reaps it and psutil keeps the code: read it there
                code = proc.wait(timeout=0)
            except Exception:  # noqa: BLE001 - not reaped yet, or being reaped by that thread
                time.sleep(0.05)
        return pid, processes.describe_exit(code) if isinstance(code, int) else gone, True
    if not stopped:
        return None
    state = process_state(pid)
    if state:
        return pid, f"is {state}", False
    try:
        children = psutil.Process(pid).children()
    except psutil.Error:
        children = []
    for child in children:
        state = process_state(child.pid)
        if state:
            return pid, f"has its scheduler process {child.pid} {state}", False
    return None


def _controller_line(cluster, down: tuple[int, str, bool]) -> str:
    pid, how, gone = down
    return f"the cluster's controller (pid {pid}) " + (f"is gone ({how})" if gone else how)


def raise_if_dead(cluster, what: str, errors: dict) -> None:
    """A ClusterError ('died') if the controller's process is gone, or an engine's: checked first, on every error and
    every 0.5 s of a call (calls.get)."""
    from ipyparallel.error import EngineError

    down = controller_down(cluster, stopped=False)
    if down is not None:  # no call or answer can pass any more: said at once, before any rank
        raise ClusterError(f"{_controller_line(cluster, down)} during {what}: calls reach the engines and their "
                           "answers come back only through it; the engines were stopped: start the cluster again",
                           kind="died", ranks=[], stopped=True)
    dead = dead_ranks(cluster)
    if not dead and not any(isinstance(e, EngineError) for e in errors.values()):
        return
    if not dead:  # the hub saw it die before we did
        dead = {r: "the controller lost it" for r, eid in enumerate(cluster.engine_ids)
                if any(isinstance(e, EngineError) and str(eid) in str(e) for e in errors.values())}
    parts = []
    for rank, how in sorted(dead.items()):
        pid = cluster.procs[rank]["pid"] if rank < len(cluster.procs) else "?"
        verb = "was dropped" if how.startswith("unregistered from the controller: it is") else "died"
        parts.append(f"rank {rank} (engine {cluster.engine_ids[rank]}, pid {pid}) {verb} during {what} ({how})")
    raise ClusterError("; ".join(parts) + "; the other engines were stopped: start the cluster again",
                       kind="died", ranks=sorted(dead), stopped=True)


def out_of_memory_hint(message: str) -> str:
    """What to do where a rank's device ran out of memory ('' for any other failure)."""
    if "OutOfMemoryError" not in message and "out of memory" not in message:
        return ""
    return ("; the ranks on that GPU need more memory than it has: start fewer ranks per GPU, run a smaller layer "
            "(-p hidden=..., ffn_hidden=..., seq_len=...) or use a GPU with more memory (`moe-lab preflight` "
            "estimates a layer's memory per rank)")


def raise_failed(cluster, what, ranks, errors, pending) -> None:
    i = min(i for i, e in errors.items() if not is_collective_error(e))
    said = remote_message(errors[i])
    msg = f"rank {ranks[i]} ({who(cluster, ranks[i])}) failed in {what}: {said}" + out_of_memory_hint(said)
    where = _where_in(cluster, [ranks[j] for j in pending])
    waiting = sorted(r for r, (c, _) in where.items() if c)
    if not waiting:
        raise ClusterError(msg, kind="failed", ranks=[ranks[i]]) from errors[i]
    # The others wait for it in a collective that can only time out and break the process group.
    msg += (f"; rank(s) {waiting} are {where[waiting[0]][1]} for it, which can only time out: the engines were "
            "stopped, start the cluster again")
    raise ClusterError(msg, kind="failed", ranks=[ranks[i]], stopped=True) from errors[i]

def raise_collective(cluster, what, ranks, results, errors, pending, elapsed) -> None:
    """A collective failed on some ranks (its timeout, or a broken peer): name the ranks that caused it."""
    failed = sorted(ranks[i] for i in errors)
    first = errors[min(errors)]
    coll, caller = collective_of_error(first)
    where = _where_in(cluster, [ranks[i] for i in pending])
    culprits, notes = blame(
        ranks, returned={ranks[i] for i in results}, errored=set(failed),
        pending={ranks[i]: where.get(ranks[i]) for i in pending})
    msg = (f"{what}: collective {coll or '(unknown)'}{f' in {caller}' if caller else ''} failed on rank(s) "
           f"{failed} after {elapsed:.1f} s ({remote_message(first).splitlines()[0][:300]})")
    if culprits:
        msg += (f"; the cause: rank(s) {culprits} did not join it ("
                + "; ".join(f"{n} ({who(cluster, r)})" for r, n in zip(culprits, notes)) + ")")
    else:
        msg += "; every rank entered it, so the cause is in the collective itself (network, backend, a peer)"
    msg += ". The process group is broken: the engines were stopped, start the cluster again"
    raise ClusterError(msg, kind="collective", ranks=culprits, stopped=True) from first

def raise_timeout(cluster, what, ranks, results, pending, timeout) -> None:
    waiting = sorted(ranks[i] for i in pending)
    down = controller_down(cluster)  # the controller first: while it cannot pass calls on, no rank is to blame
    if down is not None:
        pid, _, gone = down
        msg = (f"{what}: rank(s) {waiting} did not answer within {timeout:.0f} s because "
               f"{_controller_line(cluster, down)}: calls reach the engines and their answers come back only through "
               "it, so no rank is to blame")
        if gone:
            raise ClusterError(msg + "; the engines were stopped: start the cluster again", kind="died", ranks=[],
                               stopped=True)
        raise ClusterError(msg + f"; `kill -CONT {pid}` (and its scheduler processes) resumes it, or stop the cluster "
                           "and start it again", kind="timeout", ranks=[])
    where = _where_in(cluster, waiting)
    msg = f"{what}: rank(s) {waiting} did not answer within {timeout:.0f} s"
    in_coll = [r for r in waiting if r in where and where[r][0]]
    if where:
        msg += " (" + "; ".join(f"rank {r} is {where[r][1]} ({who(cluster, r)})" for r in waiting if r in where) + ")"
    if in_coll:
        culprits, notes = blame(ranks, returned={ranks[i] for i in results}, errored=set(),
                                          pending={r: where.get(r) for r in waiting})
        msg += (f"; hung collective {where[in_coll[0]][0]}: rank(s) {culprits} did not join it ("
                + "; ".join(f"{n} ({who(cluster, r)})" for r, n in zip(culprits, notes))
                + "). The engines were stopped, start the cluster again")
        raise ClusterError(msg, kind="collective", ranks=culprits, stopped=True)
    stopped = [r for r in waiting if where.get(r, (None, ""))[1].startswith("stopped")]
    if stopped:
        pids = " ".join(str(cluster.procs[r]["pid"]) for r in stopped)
        msg += (f"; rank(s) {stopped} cannot go on until resumed: `kill -CONT {pids}`, or stop the cluster and "
                "start it again")
    else:
        msg += ("; they keep running and later calls wait behind them: stop the cluster and start it again if "
                "they hang")
    raise ClusterError(msg, kind="timeout", ranks=waiting)

def who(cluster, rank: int) -> str:
    """'engine 3, pid 1234' for a rank."""
    pid = cluster.procs[rank]["pid"] if rank < len(cluster.procs) else "?"
    return f"engine {cluster.engine_ids[rank]}, pid {pid}"

def _where_in(cluster, ranks: list[int], wait_s: float = 1.0) -> dict[int, tuple[str | None, str]]:
    return where(cluster.procs, ranks, wait_s)


__all__ = ["ClusterError", "where", "blame", "remote_message", "is_collective_error", "collective_of_error",
           "dead_ranks", "ended_engines", "exit_status", "raise_if_dead", "raise_failed", "raise_collective",
           "raise_timeout", "who", "controller_pid", "controller_down"]
