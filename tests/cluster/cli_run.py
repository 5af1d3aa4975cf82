"""The CLI as a user runs it (a subprocess), and the input contract's check: bad input is one line and exit 2,
before anything is launched."""

import subprocess
import sys
import time


def cli(*args, timeout=600) -> subprocess.CompletedProcess:
    return subprocess.run([sys.executable, "-m", "moe_lab.cli", *args], capture_output=True, text=True,
                          timeout=timeout)


def refused_before_engines(args: list[str], message: str) -> None:
    """`moe-lab probe ARGS` exits 2 with one error line holding `message`, in under 30 s (nothing was launched)."""
    t0 = time.monotonic()
    r = cli("probe", *args, timeout=60)
    assert r.returncode == 2, r.stderr
    err = [line for line in r.stderr.strip().splitlines() if "error" in line]
    assert len(err) == 1 and message in err[0], r.stderr
    assert time.monotonic() - t0 < 30  # nothing was launched
