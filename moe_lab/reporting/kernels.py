"""The notebooks' kernels under `moe-lab run`: papermill's kernel manager with three changes.

- The kernel talks to the runner over Unix sockets (zmq's ipc transport) in a private folder of its own, not over
  loopback TCP ports: jupyter_client picks free TCP ports by binding and releasing them before the kernel binds them,
  and in between another process (an engine, a controller, a second run) can take one — the kernel then dies on
  "Address already in use" and papermill waits 60 s for a kernel that is gone. A socket path cannot be taken that
  way. Where the temporary folder's path is too long for a socket address, the kernel uses jupyter_client's TCP.

- The kernel's own stderr (ipykernel's log, C libraries) passes through the runner's stderr, and is dropped
  once the run is interrupted (a kernel stopped mid-cell has nothing to tell the terminal then) and once the kernel is
  being shut down after its notebook ran: ipykernel can race its own shutdown (the "idle" status it publishes after
  the shutdown request meets its closed IOPub socket) and print a ZMQError traceback ("Socket operation on
  non-socket") that says nothing about the notebook. Dropped lines go to this module's debug log.
- Shutting a kernel down after Ctrl-C / SIGTERM (papermill does it as the interrupt unwinds) interrupts its cell first
  and waits until the processes the cell started (a cluster of its own) are gone, bounded by the interrupt's budget,
  then kills the kernel. jupyter_client's own shutdown sends the shutdown request right after the interrupt, so the
  kernel closed its sockets while the cell was still unwinding and printed a ZMQError traceback.
"""

from __future__ import annotations

import atexit
import logging
import shutil
import subprocess
import sys
import tempfile
import threading
import time

from jupyter_client.manager import AsyncKernelManager
from traitlets import default

from ..controller import interrupts

logger = logging.getLogger(__name__)

CELL_STOP_S = 4.0  # at most this long for an interrupted cell to stop what it started
STOPPING = threading.Event()
"""Set by the runner when it ends the kernels of notebooks still running beside one whose failure stops the run:
their stderr (a kernel killed mid-start prints a ZMQError traceback) is dropped from then on, as after Ctrl-C."""


def quiet() -> bool:
    """Whether the kernels' stderr is dropped now: after a signal, or while the runner ends them (`STOPPING`)."""
    return bool(interrupts.interrupted()) or STOPPING.is_set()


def _forward(stream, closing: threading.Event | None = None) -> None:
    """The kernel's stderr lines to the runner's stderr, but while `quiet()` or once `closing` (its shutdown) is set."""
    for line in iter(stream.readline, b""):
        if quiet() or (closing is not None and closing.is_set()):
            logger.debug("kernel stderr dropped (interrupted, stopping or shut down): %s",
                         line.decode(errors="replace").rstrip())
            continue
        try:
            sys.stderr.write(line.decode(errors="replace"))
            sys.stderr.flush()
        except (OSError, ValueError):  # the runner's stderr is gone: keep draining the pipe
            pass


SOCKET_PATH_MAX = 100  # a Unix socket address holds 107 bytes on Linux; the kernel's sockets add "-N"


SOCKET_FOLDERS: set[str] = set()
"""The socket folders of kernels not yet cleaned up: a kernel killed by an interrupt is never cleaned up by
jupyter_client, so the runner (`remove_socket_folders`) and the process's exit remove what is left."""


def new_socket_folder() -> str | None:
    """A new private folder for one kernel's Unix sockets, or None where its path would be too long for them."""
    folder = tempfile.mkdtemp(prefix="moe-lab-kernel-")
    if len(f"{folder}/kernel-00") <= SOCKET_PATH_MAX:
        SOCKET_FOLDERS.add(folder)
        return folder
    shutil.rmtree(folder, ignore_errors=True)
    logger.debug("the temporary folder's path is too long for Unix sockets (%s): the kernel uses TCP", folder)
    return None


def remove_socket_folder(folder: str) -> None:
    shutil.rmtree(folder, ignore_errors=True)
    SOCKET_FOLDERS.discard(folder)


@atexit.register
def remove_socket_folders() -> None:
    """Every kernel socket folder still there: for kernels that were killed, not shut down."""
    for folder in list(SOCKET_FOLDERS):
        remove_socket_folder(folder)


class RunKernelManager(AsyncKernelManager):
    socket_folder: str | None = None

    @default("cache_ports")
    def _no_tcp_port_cache(self) -> bool:
        return False  # ports are socket file numbers under ipc; a TCP kernel picks its own, as jupyter_client does

    async def _async_pre_start_kernel(self, **kw):
        if self.socket_folder is None and not self._connection_file_written:
            self.socket_folder = new_socket_folder()
            if self.socket_folder is not None:
                self.transport = "ipc"
                self.ip = f"{self.socket_folder}/kernel"
        return await super()._async_pre_start_kernel(**kw)

    async def _async_cleanup_resources(self, restart: bool = False) -> None:
        await super()._async_cleanup_resources(restart=restart)
        if not restart and self.socket_folder is not None:
            remove_socket_folder(self.socket_folder)

    async def _async_launch_kernel(self, kernel_cmd, **kw):
        kw["stderr"] = subprocess.PIPE
        self.closing = threading.Event()  # set when the kernel is shut down: its stderr is dropped from then on
        await super()._async_launch_kernel(kernel_cmd, **kw)
        proc = getattr(self.provisioner, "process", None)
        if proc is not None and proc.stderr is not None:
            threading.Thread(target=_forward, args=(proc.stderr, self.closing), name="kernel-stderr",
                             daemon=True).start()

    async def shutdown_kernel(self, now: bool = False, restart: bool = False):
        closing = getattr(self, "closing", None)
        if closing is not None and not restart:
            closing.set()
        if interrupts.interrupted() and self.has_kernel:
            pid = getattr(self.provisioner, "pid", None)
            try:
                await self.interrupt_kernel()  # the cell's KeyboardInterrupt: `with Cluster` stops its engines
            except Exception as e:  # noqa: BLE001 - already gone; killed below anyway
                logger.debug("interrupting the kernel: %s", e)
            if pid:
                until = min(time.monotonic() + CELL_STOP_S, interrupts.deadline() - 3.0)
                if not interrupts.wait_descendants_gone(pid, until):
                    logger.warning("the interrupted kernel's processes did not end in time: they are killed")
            now = True
        await super().shutdown_kernel(now=now, restart=restart)


__all__ = ["RunKernelManager", "remove_socket_folders"]
