"""Ports that no other process can take before the lab binds them: a controller's, and the rendezvous port of the
bench's fresh spawn (`tools.bench.rendezvous_port`), which rank 0 binds only once the ranks start.

ipyparallel's controller picks each of its ~18 ports by binding port 0 and releasing it, and binds it for real a
moment later (its schedulers in processes of their own, later still). The OS hands the same ephemeral ports to every
other bind to port 0 and to every outgoing connection's source port — gloo's connections between ranks, torch's
rendezvous, notebook kernels, a second test worker's controller — so one of them can take a released port in between:
the controller, or one of its schedulers, then fails to bind and the engines never answer.

Here the ports come from below the OS's ephemeral range (`/proc/sys/net/ipv4/ip_local_port_range`), which neither a
bind to port 0 nor an outgoing connection ever takes; a port some service holds there is skipped (a test bind); and
the ports handed to one controller are noted, under a lock, in a registry every moe-lab process on the machine reads,
so two controllers starting at once never get the same one. Where the OS leaves no such range, or the registry cannot
be used, ipyparallel picks its ports as it does by itself (`reserve` returns None)."""

from __future__ import annotations

import contextlib
import fcntl
import json
import logging
import os
import random
import socket
import tempfile
import time
from pathlib import Path

logger = logging.getLogger(__name__)

CONTROLLER_PORTS = 24
"""Ports handed to one controller: it binds 18 with ipyparallel's default scheduler depth; more than it uses fall
through unused, fewer would send the rest back to ipyparallel's own random choice."""
LOWEST = 10000
MIN_RANGE = 2000
"""Below the ephemeral range at least this many ports from LOWEST, else ipyparallel's own choice."""
HOLD_S = 600.0
"""How long a port handed out stays out of the next choices: its controller has bound it long before."""
EPHEMERAL = Path("/proc/sys/net/ipv4/ip_local_port_range")


def registry_path() -> Path:
    """The machine's registry of recently handed-out controller ports, one per user: in /tmp whatever TMPDIR says (a
    job or a test with a temp folder of its own still shares the machine's ports), else the temp folder."""
    root = Path("/tmp") if os.path.isdir("/tmp") and os.access("/tmp", os.W_OK) else Path(tempfile.gettempdir())
    return root / f"moe-lab-controller-ports-{os.getuid()}.json"


def candidate_range() -> tuple[int, int] | None:
    """(lowest, highest) port to choose from: below the OS's ephemeral range, or None where that leaves too few."""
    try:
        low = int(EPHEMERAL.read_text().split()[0])
    except (OSError, ValueError, IndexError):
        return None  # not Linux, or the file unreadable: the ephemeral range is not known
    highest = min(low - 1, 65535)
    return (LOWEST, highest) if highest - LOWEST + 1 >= MIN_RANGE else None


def _bindable(port: int) -> bool:
    with contextlib.closing(socket.socket(socket.AF_INET, socket.SOCK_STREAM)) as s:
        try:
            s.bind(("", port))
        except OSError:
            return False
    return True


@contextlib.contextmanager
def _locked(path: Path):
    fd = os.open(f"{path}.lock", os.O_RDWR | os.O_CREAT, 0o600)
    try:
        fcntl.flock(fd, fcntl.LOCK_EX)
        yield
    finally:
        os.close(fd)


def reserve(n: int = CONTROLLER_PORTS, *, now: float | None = None) -> list[int] | None:
    """`n` distinct ports free now, below the ephemeral range, and not handed out by this function in the last
    HOLD_S seconds on this machine (noted before returning). None where no such range exists or the registry
    cannot be used."""
    span = candidate_range()
    if span is None:
        return None
    path = registry_path()
    now = time.time() if now is None else now
    try:
        with _locked(path):
            try:
                held = {int(p): float(t) for p, t in json.loads(path.read_text()).items()}
            except (OSError, ValueError, AttributeError, TypeError):
                held = {}  # none yet, or unreadable: started again
            held = {p: t for p, t in held.items() if now - t < HOLD_S}
            chosen: list[int] = []
            tries = 0
            while len(chosen) < n:
                tries += 1
                if tries > 50 * n:
                    logger.info("no %d free controller ports below the ephemeral range: ipyparallel picks them", n)
                    return None
                p = random.randint(*span)
                if p in held or p in chosen or not _bindable(p):
                    continue
                chosen.append(p)
            held.update({p: now for p in chosen})
            tmp = path.with_name(f"{path.name}.{os.getpid()}.tmp")
            tmp.write_text(json.dumps(held))
            os.replace(tmp, path)
            return chosen
    except OSError as e:  # a read-only or full temp dir: ipyparallel's own choice, as without this module
        logger.info("controller ports not reserved (%s): ipyparallel picks them", e)
        return None


__all__ = ["CONTROLLER_PORTS", "HOLD_S", "candidate_range", "registry_path", "reserve"]
