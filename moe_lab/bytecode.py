"""A bytecode cache of the lab's own for the processes it starts, where the Python environment neither holds torch's
compiled bytecode nor lets Python write any.

Python compiles a module's source on import and keeps the bytecode in `__pycache__` beside it; `pip install` compiles
every module it installs. An environment that sets PYTHONDONTWRITEBYTECODE over a torch installed without its bytecode
(a container image built that way) compiles torch's modules again in every process that imports them: on one H100 node
(docs/bench.md) torch's and megatron-core's imports took 14-18 s in every process there, 4.6 s once a cache held
their bytecode — and a run starts such a process for every cluster, release switch and engine of its own. There, the
processes the lab starts afterwards (controller, preload servers, engines, notebook kernels) are given
PYTHONPYCACHEPREFIX, a bytecode tree under the lab's cache (`release_dirs.cache_dir()/bytecode`), and may write it;
the environment's own folders are not written. Anywhere else nothing changes. MOE_LAB_BYTECODE_CACHE=0 turns it off,
=1 turns it on wherever writing bytecode is forbidden. Torch-free: torch's bytecode is looked for, never imported.
"""

from __future__ import annotations

import importlib.util
import logging
import os
import sys
from pathlib import Path

from . import release_dirs, switches

logger = logging.getLogger(__name__)

SWITCH = "MOE_LAB_BYTECODE_CACHE"
PREFIX_ENV = "PYTHONPYCACHEPREFIX"
NO_WRITE_ENV = "PYTHONDONTWRITEBYTECODE"
PACKAGE = "torch"
"""The package whose missing bytecode turns the cache on: the largest of an engine's imports (with megatron-core's
torch.compile decorators, most of its 14-18 s there)."""


def folder() -> Path:
    """Where the cache's bytecode tree lives (bytecode files name their Python, so one tree serves several)."""
    return release_dirs.cache_dir() / "bytecode"


def _spec(package: str):
    """The import system's spec of `package`, found without importing it (None where it is not installed)."""
    try:
        return importlib.util.find_spec(package)
    except (ImportError, ValueError):
        return None


def holds_no_bytecode(package: str = PACKAGE) -> bool:
    """Whether `package` is installed as source with no bytecode of this Python beside it (its `__init__`'s own
    `__pycache__` file, whatever cache prefix this process has). False where it is not installed."""
    origin = getattr(_spec(package), "origin", None)
    if not origin or not origin.endswith(".py"):
        return False
    source = Path(origin)
    return not (source.parent / "__pycache__" / f"{source.stem}.{sys.implementation.cache_tag}.pyc").exists()


def changes(environ: dict | None = None, package: str = PACKAGE) -> dict[str, str | None]:
    """The environment changes the cache needs ({} where it does not apply): PYTHONPYCACHEPREFIX set to `folder()`
    and PYTHONDONTWRITEBYTECODE removed (None). It applies where the environment forbids writing bytecode (Python
    reads PYTHONDONTWRITEBYTECODE as set when it is not empty), names no bytecode tree of its own, and `package` holds
    no bytecode — or MOE_LAB_BYTECODE_CACHE=1 skips that last check; =0 turns it off."""
    env = os.environ if environ is None else environ
    forced = switches.forced(SWITCH)
    if forced is False or env.get(PREFIX_ENV) or not env.get(NO_WRITE_ENV):
        return {}
    if forced is None and not holds_no_bytecode(package):
        return {}
    return {PREFIX_ENV: str(folder()), NO_WRITE_ENV: None}


def use_for_started_processes(package: str = PACKAGE) -> dict[str, str | None]:
    """Apply `changes()` to this process's environment, which the processes it starts afterwards inherit (its own
    imports are left as they are); returns what changed ({} where nothing applies, or the folder cannot be made)."""
    wanted = changes(package=package)
    if not wanted:
        return {}
    try:
        Path(wanted[PREFIX_ENV]).mkdir(parents=True, exist_ok=True)
    except OSError as e:
        logger.warning("no bytecode cache at %s (%s): every process the lab starts compiles its imports again; set "
                       "MOE_LAB_CACHE to a writable folder", wanted[PREFIX_ENV], e.strerror or type(e).__name__)
        return {}
    for key, value in wanted.items():
        if value is None:
            os.environ.pop(key, None)
        else:
            os.environ[key] = value
    logger.info("bytecode cache for the processes the lab starts: %s (%s is set and %s holds no bytecode here, so "
                "every process would compile its imports again)", wanted[PREFIX_ENV], NO_WRITE_ENV, package)
    return wanted


FILLED = (PACKAGE, "megatron.core", "sympy", "networkx", "ipyparallel", "ipykernel", "IPython", "jupyter_client", "zmq",
          "traitlets")
"""What `fill` compiles besides the standard library: the imports of the lab's engines and controller (sympy and
networkx: torch's own, made as megatron-core's imports reach torch.compile)."""


def _folder_of(package: str) -> Path | None:
    locations = getattr(_spec(package), "submodule_search_locations", None)
    return Path(next(iter(locations))) if locations else None


def fill(packages=FILLED, *, stdlib: bool = True, timeout_s: float = 900.0) -> dict | None:
    """Compile `packages`' folders (and the standard library) into the tree where the cache applies to the first of
    them (None elsewhere), as `pip install` compiles what it installs: a set-up step, so that a fresh machine's first
    command reads their bytecode instead of compiling it. Returns the folders and the seconds taken; RuntimeError if
    compileall could not run (a file it cannot compile is left to be compiled on import, as Python would)."""
    import subprocess
    import sysconfig
    import time

    wanted = changes(package=packages[0] if packages else PACKAGE)
    if not wanted:
        return None
    folders = [f for f in (_folder_of(p) for p in packages) if f is not None]
    if stdlib:
        folders.append(Path(sysconfig.get_path("stdlib")))
    folders = sorted({str(f) for f in folders})
    env = {k: v for k, v in os.environ.items() if k != NO_WRITE_ENV}
    env[PREFIX_ENV] = wanted[PREFIX_ENV]
    Path(wanted[PREFIX_ENV]).mkdir(parents=True, exist_ok=True)
    t0 = time.perf_counter()
    try:  # compileall's status is 1 for any file it could not compile (a test file of another Python): not a failure
        subprocess.run([sys.executable, "-m", "compileall", "-q", "-j", "0", *folders], env=env,
                       stdout=subprocess.DEVNULL, stderr=subprocess.DEVNULL, timeout=timeout_s, check=False)
    except (OSError, subprocess.TimeoutExpired) as e:
        raise RuntimeError(f"compiling {len(folders)} folder(s) into {wanted[PREFIX_ENV]} failed: {e}") from e
    return {"folder": wanted[PREFIX_ENV], "compiled": folders, "seconds": round(time.perf_counter() - t0, 1)}


__all__ = ["SWITCH", "PREFIX_ENV", "NO_WRITE_ENV", "PACKAGE", "FILLED", "folder", "holds_no_bytecode", "changes",
           "use_for_started_processes", "fill"]
