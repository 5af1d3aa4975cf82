"""Controller side: engines forked from a preload server (`engine.preload`) instead of each started as a fresh
Python that imports torch and megatron-core again. On a CPU machine the engines of a cluster share a few cores, so
those imports cost N times one import (about 4.5 s of CPU each with megatron-core 0.16); on a GPU node the engines
make them all at once too (an H200 node: 15.9–17.7 s of imports and process group with engines of their own, 1.6–1.7
s forked). The server makes the imports once, while the controller starts, and an engine forked from it registers
with its imports done; the server never touches CUDA (`engine.preload` checks), so each engine makes its own
context. It serves the cluster's engine starts for one configuration (release path, environment); a restart for
another starts another server.

Where it applies (`wanted`): local engines on Linux, CPU or GPU; MOE_LAB_PRELOAD=0 starts every engine as a process of
its own (=1 asks for the server wherever it can run). Where the server cannot start or answer, engines start the
usual way and the log says why: a preload is a speed-up, never a condition.

`PreloadedEngineSetLauncher` is ipyparallel's local engine-set launcher with each engine's Popen replaced by a fork
request to the server; everything else (the engine's arguments, environment, log file, stop and signals) is the
local launcher's. A forked engine is not this process's child: its exit code comes from the server, which reaps it.
"""

from __future__ import annotations

import json
import logging
import os
import select
import subprocess
import sys
import threading
import time
from pathlib import Path

import psutil
from ipyparallel.cluster.launcher import LocalEngineLauncher, LocalEngineSetLauncher
from traitlets import Any

from .. import switches
from ..config import ClusterConfig
from ..engine.preload import MARK

logger = logging.getLogger("moe_lab.controller.cluster")  # a cluster's log, whichever module does the work

PRELOAD_ENV = "MOE_LAB_PRELOAD"
READY_TIMEOUT_S = 120.0
"""How long the server may take to import (it shares the cores with the controller starting)."""
ANSWER_TIMEOUT_S = 30.0


def wanted(cfg: ClusterConfig) -> bool:
    """Whether the cluster's engines are forked from a preload server (see the module docstring)."""
    if cfg.launcher != "local" or sys.platform != "linux" or not hasattr(os, "fork"):
        return False
    if "LocalEngineSetLauncher.engine_cmd" in cfg.launcher_options or "engine_cmd" in cfg.launcher_options:
        return False  # a command of the user's own: run as they asked
    forced = switches.forced(PRELOAD_ENV)
    return True if forced is None else forced


def prepare_of(cfg: ClusterConfig) -> dict:
    """`dist.prepare`'s arguments for cfg (the spare sets' `spares.prepare_args`, as a dict)."""
    return {"device": cfg.device, "extra_path": list(cfg.extra_path), "env": dict(cfg.env),
            "deterministic": bool(cfg.deterministic)}


class PreloadServer:
    """One preload server process (`engine.preload`) and the pipe to it."""

    def __init__(self, profile_dir: str, prepare: dict, index: int = 0):
        self.prepare = prepare
        folder = Path(profile_dir, "preload", str(index))
        folder.mkdir(parents=True)
        self.exits = folder / "exits"
        self.log_file = folder / "server.log"
        self.info: dict | None = None
        self.failed: str | None = None
        self._lock = threading.Lock()
        env = dict(os.environ, **(prepare.get("env") or {}))  # as an engine imports: after dist.prepare applied cfg.env
        env["IPP_PROFILE_DIR"] = profile_dir
        code = ("import sys; sys.path.insert(0, sys.argv.pop(1)); "
                f"from {MARK} import main; main()")
        pkg_parent = str(Path(__file__).resolve().parents[2])
        with open(self.log_file, "ab") as log:
            self.proc = subprocess.Popen(
                [sys.executable, "-c", code, pkg_parent, "--profile", profile_dir, "--exits", str(self.exits),
                 "--prepare", json.dumps(prepare)],
                stdin=subprocess.PIPE, stdout=subprocess.PIPE, stderr=log, env=env, cwd=profile_dir,
                start_new_session=True)
        self._buf = b""

    # ------------------------------------------------------------------ the pipe
    def _read(self, timeout: float) -> dict | None:
        deadline = time.monotonic() + timeout
        fd = self.proc.stdout.fileno()
        while b"\n" not in self._buf:
            left = deadline - time.monotonic()
            if left <= 0:
                return None
            ready, _, _ = select.select([fd], [], [], min(left, 0.5))
            if ready:
                chunk = os.read(fd, 1 << 16)
                if not chunk:
                    return None
                self._buf += chunk
            elif self.proc.poll() is not None:
                return None
        line, self._buf = self._buf.split(b"\n", 1)
        return json.loads(line)

    def ready(self, timeout: float = READY_TIMEOUT_S) -> bool:
        """Wait for the server's imports; False (and why, in `failed`) where it cannot serve."""
        with self._lock:
            if self.info is None and self.failed is None:
                msg = self._read(timeout)
                if msg and msg.get("ready"):
                    self.info = msg
                    logger.info("preload server (pid %d) imported torch and megatron-core in %.1f s",
                                self.proc.pid, msg.get("imports_s", float("nan")))
                else:
                    self.failed = (msg or {}).get("error") or self._why_silent(timeout)
                    logger.warning("the preload server cannot serve (%s); engines start as processes of their own "
                                   "(its log: %s)", self.failed, self.log_file)
                    self.close()
            return self.info is not None

    def settled(self) -> bool:
        """Without waiting: whether `ready()` would answer at once — the imports are done (or their message is
        waiting in the pipe), or the server failed or ended. A set launched early forks its engines only then, so
        the controller never waits on a server's imports while the current engines work."""
        with self._lock:
            if self.info is not None or self.failed is not None or self.proc.poll() is not None:
                return True
            if b"\n" in self._buf:
                return True
            readable, _, _ = select.select([self.proc.stdout.fileno()], [], [], 0)
            return bool(readable)

    def _why_silent(self, timeout: float) -> str:
        code = self.proc.poll()
        return f"it ended ({code})" if code is not None else f"no answer within {timeout:.0f} s"

    def fork(self, argv: list[str], env: dict, cwd: str, output: str) -> int | None:
        """The pid of an engine forked for this command, or None (said in the log) where the server cannot."""
        if not self.ready():
            return None
        with self._lock:
            try:
                self.proc.stdin.write((json.dumps({"argv": argv, "env": env, "cwd": cwd, "output": output})
                                       + "\n").encode())
                self.proc.stdin.flush()
            except (BrokenPipeError, ValueError, OSError) as e:
                logger.warning("the preload server is gone (%s); starting the engine as a process of its own", e)
                return None
            msg = self._read(ANSWER_TIMEOUT_S)
        if not msg or "pid" not in msg:
            logger.warning("the preload server did not fork the engine (%s); starting it as a process of its own",
                           (msg or {}).get("error") or "no answer")
            return None
        return int(msg["pid"])

    def exit_code(self, pid: int, wait_s: float = 1.0) -> int | None:
        """The exit code of a forked engine that has ended (negative: the signal), once the server reaped it."""
        path = self.exits / str(pid)
        deadline = time.monotonic() + wait_s
        while True:
            try:
                return int(path.read_text())
            except (OSError, ValueError):
                if time.monotonic() > deadline:
                    return None
                time.sleep(0.02)

    def close(self) -> None:
        """End the server (its engines are the launcher's to stop); never raises."""
        try:
            if self.proc.stdin and not self.proc.stdin.closed:
                self.proc.stdin.close()
        except OSError:
            pass
        try:
            self.proc.wait(timeout=2)
        except subprocess.TimeoutExpired:
            self.proc.kill()
            self.proc.wait(timeout=5)
        try:
            self.proc.stdout.close()
        except OSError:
            pass


class ForkedEngine:
    """What ipyparallel's launcher and the diagnosis ask of an engine process (pid, is_running, send_signal, wait,
    returncode), for an engine the server forked: it is not this process's child, so its exit code comes from the
    server, which reaps it. An engine that ended before this was made is simply gone."""

    def __init__(self, pid: int, server: PreloadServer):
        self.pid = pid
        self.server = server
        self.returncode = None
        try:
            self._proc = psutil.Process(pid)
        except psutil.NoSuchProcess:
            self._proc = None

    def is_running(self) -> bool:
        try:
            return self._proc is not None and self._proc.is_running() and \
                self._proc.status() != psutil.STATUS_ZOMBIE
        except psutil.NoSuchProcess:
            return False

    def send_signal(self, sig: int) -> None:
        if self._proc is not None:
            self._proc.send_signal(sig)  # psutil refuses a pid the OS has given to another process since

    def wait(self, timeout=None):
        """The exit code once the engine has ended and the server reaped it; psutil.TimeoutExpired before."""
        if self._proc is not None:
            try:
                self._proc.wait(timeout)  # a zombie still exists: this returns once the server has reaped it
            except psutil.NoSuchProcess:
                pass
        if self.returncode is None:
            self.returncode = self.server.exit_code(self.pid)
        return self.returncode


class PreloadedEngineLauncher(LocalEngineLauncher):
    """One engine, forked by its set's server; a process of its own where the server cannot."""

    def start(self):
        server = getattr(self.parent, "server", None)
        if server is None or self.state != "before":
            return super().start()
        env = os.environ.copy()
        env.update(self.get_env())
        pid = server.fork(list(self.args), env, os.path.abspath(self.work_dir), self.output_file)
        if pid is None:
            return super().start()
        self.pid = pid
        self.process = ForkedEngine(pid, server)
        self.notify_start(pid)
        self._start_waiting()


class PreloadedEngineSetLauncher(LocalEngineSetLauncher):
    """ipyparallel's local engine set, its engines forked from `server` (None: processes of their own)."""

    launcher_class = PreloadedEngineLauncher
    server = Any(None, allow_none=True)


# ---------------------------------------------------------------------- a cluster's servers
def server_for(state, cfg: ClusterConfig) -> PreloadServer | None:
    """The cluster's server for cfg's engine start, started now where there is none (None where preloading does
    not apply). A server that failed is not asked again for that start."""
    if not wanted(cfg) or not state.profile_dir:
        return None
    prepare = prepare_of(cfg)
    key = json.dumps(prepare, sort_keys=True)
    servers = state.preload_servers
    if key not in servers:
        try:
            servers[key] = PreloadServer(state.profile_dir, prepare, len(servers))
        except OSError as e:
            logger.warning("the preload server could not start (%s); engines start as processes of their own", e)
            return None
    server = servers[key]
    return None if server.failed else server


def engine_kwargs(state, cfg: ClusterConfig) -> dict:
    """What ipyparallel's start_engines takes for a set of cfg's engines: the server where the cluster forks its
    engines, nothing where it starts them as processes."""
    if state.ipp is None or state.ipp.engine_launcher_class is not PreloadedEngineSetLauncher:
        return {}
    return {"server": server_for(state, cfg)}


def close_servers(state) -> None:
    for server in state.preload_servers.values():
        server.close()
    state.preload_servers.clear()


__all__ = ["wanted", "prepare_of", "PreloadServer", "ForkedEngine", "PreloadedEngineLauncher",
           "PreloadedEngineSetLauncher", "server_for", "engine_kwargs", "close_servers", "PRELOAD_ENV"]
