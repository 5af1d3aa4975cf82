"""Runs as its own process, one per cluster and engine start (release path, environment): the preload server. It
makes the slow imports of an engine once — torch, megatron-core (`dist.prepare`, with the start's environment and
release path) and ipyparallel's engine — and then forks every engine of the cluster from itself, so an engine starts
with its imports done instead of each engine importing them again on cores the others share.

    python -c '...main()' --profile DIR --exits DIR --prepare JSON      (controller.preloaded starts it)

It talks to the controller over its stdin and stdout, one JSON object a line: first {"ready": ...} (or {"error":
...} and exit 2), then for each request {"argv": [...], "env": {...}, "cwd": ..., "output": FILE} the forked engine's
{"pid": N} (or {"error": ...}: the controller then starts that engine as a process of its own). It reaps the engines
it forked and writes each exit code (negative: the signal that ended it) to EXITS/<pid>: that is how the controller
says how an engine ended. It exits when its stdin closes (the controller stopped the cluster, or died).

Forking is safe because nothing here computes before the fork: no OpenMP pool, no CUDA context and no call of the
CUDA runtime (both checked after the imports), no thread of ours. Each engine reseeds Python's and numpy's global
generators, as a fresh process starts with its own, and names itself ENGINE_NAME (its command line is the server's,
so `controller.processes` knows an engine by that name).
"""

from __future__ import annotations

import argparse
import atexit
import json
import os
import select
import signal
import sys
import time
import traceback

ENGINE_NAME = "moe_lab_engine"
"""The name (Linux comm, at most 15 bytes) a forked engine gives itself; its command line is the server's."""
MARK = "moe_lab.engine.preload"
"""On the server's command line (and so on its engines'): what `controller.processes` looks for."""
ENGINE_MODULE = "ipyparallel.engine"


def main(argv: list[str] | None = None) -> None:
    ap = argparse.ArgumentParser(prog=MARK)
    ap.add_argument("--profile", required=True, help="the cluster's profile (on the command line to be found by it)")
    ap.add_argument("--exits", required=True, help="folder for the forked engines' exit codes")
    ap.add_argument("--prepare", required=True, help="dist.prepare's arguments, as JSON")
    args = ap.parse_args(argv)
    try:
        took = _preload(json.loads(args.prepare))
        os.makedirs(args.exits, exist_ok=True)
    except BaseException as e:  # noqa: BLE001 - said to the controller, which starts engines the usual way
        _reply({"error": f"{type(e).__name__}: {e}"})
        traceback.print_exc()
        sys.exit(2)
    _reply({"ready": True, "imports_s": round(took, 3), "pid": os.getpid()})
    serve(args.exits)
    os._exit(0)  # nothing to finalise: torch's and megatron-core's exit handlers would only cost the stop time


NVML_CHECK = "PYTORCH_NVML_BASED_CUDA_CHECK"
"""Set during the server's imports: torch.cuda.is_available() then counts GPUs through NVML instead of the CUDA
runtime, whose first call forbids CUDA in every process forked afterwards (megatron-core's imports ask)."""


def _preload(prepare: dict) -> float:
    t0 = time.perf_counter()
    from . import dist

    before = os.environ.get(NVML_CHECK)
    os.environ[NVML_CHECK] = "1"
    try:
        dist.prepare(**{**prepare, "extra_path": tuple(prepare.get("extra_path") or ())})
        import ipyparallel.engine.app  # noqa: F401 - the engine application every fork runs
    finally:  # the engines ask the CUDA runtime as a process of their own would
        if before is None:
            os.environ.pop(NVML_CHECK, None)
        else:
            os.environ[NVML_CHECK] = before
    import torch

    if torch.cuda.is_initialized():
        raise RuntimeError("an import initialised CUDA; a forked engine could not use it")
    if torch.version.cuda and fork_forbids_cuda():
        raise RuntimeError("an import called the CUDA runtime (e.g. torch.cuda.device_count() without NVML); a "
                           "forked engine could not use CUDA")
    return time.perf_counter() - t0


def fork_forbids_cuda() -> bool:
    """Whether a process forked now could not use CUDA (torch marks such a fork 'bad' once this process has called
    the CUDA runtime, which torch.cuda.is_initialized() does not show): asked of a child forked for the purpose."""
    import torch

    pid = os.fork()
    if pid == 0:
        os._exit(1 if torch.cuda._is_in_bad_fork() else 0)
    _, status = os.waitpid(pid, 0)
    return os.waitstatus_to_exitcode(status) != 0


def _reply(obj: dict) -> None:
    sys.stdout.write(json.dumps(obj) + "\n")
    sys.stdout.flush()


def serve(exits: str) -> None:
    """Answer fork requests until stdin closes; reap the forked engines meanwhile (every 50 ms)."""
    fd = sys.stdin.fileno()
    buf = b""
    while True:
        ready, _, _ = select.select([fd], [], [], 0.05)
        reap(exits)
        if not ready:
            continue
        chunk = os.read(fd, 1 << 16)
        if not chunk:
            return
        buf += chunk
        while b"\n" in buf:
            line, buf = buf.split(b"\n", 1)
            if line.strip():
                _reply(fork_engine(json.loads(line), exits))


def reap(exits: str) -> None:
    """Collect every forked engine that has ended; write its exit code (os.waitstatus_to_exitcode) to exits/<pid>."""
    while True:
        try:
            pid, status = os.waitpid(-1, os.WNOHANG)
        except ChildProcessError:
            return
        if pid == 0:
            return
        tmp = os.path.join(exits, f".{pid}")
        with open(tmp, "w") as f:
            f.write(str(os.waitstatus_to_exitcode(status)))
        os.replace(tmp, os.path.join(exits, str(pid)))


def fork_engine(req: dict, exits: str) -> dict:
    """Fork one engine for `req`; in the parent, its pid. The child never returns here."""
    argv = list(req.get("argv") or ())
    if argv[1:3] != ["-m", ENGINE_MODULE]:
        return {"error": f"not an ipyparallel engine command ({' '.join(argv[:3])}): start it as a process"}
    sys.stdout.flush()
    sys.stderr.flush()
    pid = os.fork()
    if pid:
        return {"pid": pid}
    code = 1
    try:
        _become_engine(req, argv[3:])
        code = 0
    except SystemExit as e:
        code = e.code if isinstance(e.code, int) else (0 if e.code is None else 1)
    except BaseException:  # noqa: BLE001 - the engine's own failure, written to its log as a process would
        traceback.print_exc()
    finally:
        try:
            atexit._run_exitfuncs()
            sys.stdout.flush()
            sys.stderr.flush()
        finally:
            os._exit(code)


def _become_engine(req: dict, args: list[str]) -> None:
    """In the forked child: a session of its own, the engine's log as stdout and stderr, its working folder and
    environment (the launcher's), fresh random state, its name; then ipyparallel's engine with its arguments."""
    os.setsid()
    out = os.open(req["output"], os.O_WRONLY | os.O_CREAT | os.O_APPEND, 0o644)
    null = os.open(os.devnull, os.O_RDONLY)
    os.dup2(null, 0)
    os.dup2(out, 1)
    os.dup2(out, 2)
    os.close(out)
    os.close(null)
    os.chdir(req.get("cwd") or ".")
    os.environ.clear()
    os.environ.update(req.get("env") or {})
    signal.signal(signal.SIGINT, signal.default_int_handler)
    _set_name(ENGINE_NAME)
    import random

    random.seed()
    if "numpy" in sys.modules:
        sys.modules["numpy"].random.seed()
    sys.argv = [sys.executable, *args]
    from ipyparallel.engine.app import main as engine_main

    engine_main()


def _set_name(name: str) -> None:
    try:
        import ctypes

        ctypes.CDLL(None, use_errno=True).prctl(15, name.encode()[:15], 0, 0, 0)  # PR_SET_NAME
    except (OSError, AttributeError):
        pass


if __name__ == "__main__":
    main()
