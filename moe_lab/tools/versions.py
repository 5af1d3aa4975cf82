"""megatron-core releases side by side: each in its own folder of the lab's cache, so one machine compares releases.

Layout: `$MOE_LAB_CACHE` (default `~/.cache/moe_lab`) / `megatron-core` / `<python X.Y>` / `<version>` /, a `pip --target`
folder holding only megatron-core (installed with --no-deps: the interpreter's torch, numpy and packaging serve every
release; 0.11/0.12 declare test/tooling deps and 0.13 declares numpy<2, none of which the layer needs). Engines put
`path_for(version)` first on sys.path (`dist.setup(extra_path=...)`) before importing megatron. Looking a release up
is `release_dirs` (torch- and pip-free, what experiments use); installing one is here, and `prepare` does it before
a run.

Installs land in a `.partial-*` sibling and are renamed into place only after a fresh interpreter imported the
requested version from there, so an interrupted install never leaves a half folder under the version's name.
"""

from __future__ import annotations

import datetime
import json
import logging
import os
import shutil
import socket
import stat
import subprocess
import sys
import tempfile
import time
from pathlib import Path

from packaging.tags import sys_tags
from packaging.utils import (
    InvalidSdistFilename,
    InvalidWheelFilename,
    canonicalize_name,
    parse_sdist_filename,
    parse_wheel_filename,
)
from packaging.version import InvalidVersion, Version

from .. import releases
from ..fsio import writable_dir
from ..release_dirs import PACKAGE, is_installed, normalize, path_for, python_tag, version_dir
from .errors import InstallError

logger = logging.getLogger(__name__)

PIP_TIMEOUT_S = 900.0
VERIFY_TIMEOUT_S = 300.0
# What a megatron-core sdist's pyproject asks for to build (its setup.py also runs `python3 -m pybind11 --includes`
# and compiles one C++ helper, so a compiler is needed too). Offline sdist builds need these wheels in `from_dir`.
BUILD_REQUIREMENTS = ("setuptools", "pybind11")
MARKER = ".moe_lab-install.json"
_VERIFY_TAG = "MOE_LAB_VERIFY "
_SYS_TAGS = frozenset(sys_tags())  # the wheel tags this interpreter installs


# ---------------------------------------------------------------------------------------------- install


def install(version: str, *, from_dir: str | os.PathLike | None = None, pip_args=(), force: bool = False,
            timeout_s: float = PIP_TIMEOUT_S) -> Path:
    """Install megatron-core `version` side by side for this Python and return its folder.

    `from_dir`: offline (air-gapped nodes): pip gets `--no-index --find-links from_dir`, which must hold this release's
    wheel for this Python or its sdist (plus setuptools and pybind11 wheels to build it). Already installed: returned
    as is unless `force`. Everything checkable (version string, support on this Python, from_dir) is checked first.
    """
    v = normalize(version)
    releases.check_supported(v)
    find_links = check_from_dir(from_dir, v) if from_dir is not None else None
    final = version_dir(v)
    if is_installed(final) and not force:
        logger.info("megatron-core %s already installed in %s", v, final)
        return final
    writable_dir(final.parent, "MOE_LAB_CACHE")  # the release cache: one line before pip runs, never a traceback
    _remove_stale(final.parent, v)
    tmp = Path(tempfile.mkdtemp(prefix=_partial_prefix(".partial", v), dir=final.parent))
    tmp.chmod(0o755)  # mkdtemp's 0700 would hide a shared cache from other users' engines
    t0 = time.perf_counter()
    try:
        _pip_install(v, tmp, find_links, tuple(pip_args), timeout_s)
        verify(tmp, v)
        meta = dict(version=v, python=python_tag(), source=str(Path(find_links).absolute()) if find_links else "index",
                    installed_at=datetime.datetime.now(datetime.timezone.utc).isoformat(timespec="seconds"),
                    install_s=round(time.perf_counter() - t0, 2))
        (tmp / MARKER).write_text(json.dumps(meta, indent=1) + "\n")
        _swap_in(tmp, final, v)
    except OSError as e:  # the cache filled up or went away mid-install: one line (exit 3), nothing half-installed
        shutil.rmtree(tmp, ignore_errors=True)
        raise InstallError(f"installing megatron-core {v} into {final}: {e.strerror or type(e).__name__}"
                           + (f" ({e.filename})" if e.filename else "") + "; free space in the release cache or set "
                           "MOE_LAB_CACHE to another folder, and run again") from e
    except BaseException:
        shutil.rmtree(tmp, ignore_errors=True)
        raise
    logger.info("megatron-core %s installed in %s (%.1f s)", v, final, time.perf_counter() - t0)
    return final


def check_from_dir(from_dir: str | os.PathLike, version: str) -> str:
    """Check that `from_dir` can install `version` offline on this Python; return it as a string, else ValueError."""
    d = Path(from_dir).expanduser()
    if not d.is_dir():
        raise ValueError(f"from_dir ({str(from_dir)!r}) is not a directory; it must hold the megatron-core {version} wheel or sdist")
    want = Version(version)
    found, same, wheels, sdists, have = [], [], [], [], set()
    try:
        listed = sorted(d.iterdir())
    except OSError as e:
        raise ValueError(f"from_dir ({d}) cannot be listed ({e.strerror or type(e).__name__}); give a folder this "
                         f"user can read, holding the megatron-core {version} wheel or sdist") from None
    for f in listed:
        kind, name, ver, tags = parse_dist(f.name)
        if kind is None:
            continue
        have.add(name)
        if name != PACKAGE:
            continue
        found.append(f.name)
        if ver != want:
            continue
        same.append(f.name)
        if kind == "sdist":
            sdists.append(f.name)
        elif tags & _SYS_TAGS:
            wheels.append(f.name)
    if wheels:
        return str(d)
    here = f"cp{sys.version_info[0]}{sys.version_info[1]}"
    if not same:
        raise ValueError(f"from_dir ({d}) has no megatron-core {version} wheel or sdist; "
                         f"megatron-core files found: {', '.join(found) or 'none'}")
    if not sdists:
        raise ValueError(f"from_dir ({d}) has megatron-core {version} only as wheels for other Pythons/platforms "
                         f"({', '.join(same)}); this Python needs a {here} wheel or the sdist")
    missing = [r for r in BUILD_REQUIREMENTS if r not in have]
    if missing:
        raise ValueError(f"from_dir ({d}) has only the megatron-core {version} sdist ({sdists[0]}); building it offline "
                         f"also needs wheels of {', '.join(missing)} there (`moe-lab wheelhouse` gathers them)")
    logger.info("megatron-core %s: no %s wheel in %s, pip builds %s (needs a C++ compiler)", version, here, d, sdists[0])
    return str(d)


def parse_dist(filename: str):
    """(kind, canonical name, version, tags) of a wheel or sdist file name; (None, ...) for anything else."""
    try:
        if filename.endswith(".whl"):
            name, ver, _build, tags = parse_wheel_filename(filename)
            return "wheel", canonicalize_name(name), ver, frozenset(tags)
        if filename.endswith((".tar.gz", ".zip")):
            name, ver = parse_sdist_filename(filename)
            return "sdist", canonicalize_name(name), ver, frozenset()
    except (InvalidWheelFilename, InvalidSdistFilename, InvalidVersion):
        pass
    return None, None, None, frozenset()


def pip_env(shim_dir: str | os.PathLike) -> dict:
    """The environment for a pip subprocess: `python3`/`python` on PATH run this interpreter.

    megatron-core's setup.py runs `python3 -m pybind11 --includes` from PATH; without this, a build finds whatever
    `python3` the shell has (a pyenv shim, the system one), which lacks the isolated build env's pybind11.
    """
    shim = Path(shim_dir)
    for name in ("python3", "python"):
        p = shim / name
        p.write_text(f'#!/bin/sh\nexec "{sys.executable}" "$@"\n')
        p.chmod(p.stat().st_mode | stat.S_IXUSR | stat.S_IXGRP | stat.S_IXOTH)
    env = dict(os.environ)
    env["PATH"] = str(shim) + os.pathsep + env.get("PATH", "")
    env["PIP_DISABLE_PIP_VERSION_CHECK"] = "1"
    return env


def run_pip(args: list[str], *, what: str, timeout_s: float, check: bool = True) -> subprocess.CompletedProcess:
    """Run `sys.executable -m pip ARGS`; RuntimeError naming `what` (one line) on a timeout, or a failure if `check`."""
    cmd = [sys.executable, "-m", "pip", *args]
    logger.debug("running %s", " ".join(cmd))
    with tempfile.TemporaryDirectory(prefix="moe_lab-pip-") as shim:
        try:
            r = subprocess.run(cmd, env=pip_env(shim), capture_output=True, text=True, timeout=timeout_s)
        except subprocess.TimeoutExpired as e:
            raise InstallError(f"{what}: pip timed out after {timeout_s:g} s") from e
    if r.returncode != 0 and check:
        out = (r.stdout or "") + (r.stderr or "")
        logger.debug("%s: pip exited %d:\n%s", what, r.returncode, "\n".join(out.splitlines()[-40:]))  # -v shows it
        raise InstallError(f"{what}: pip exited {r.returncode}: {pip_error_line(out)}")
    return r


def pip_error_line(output: str) -> str:
    """The line of pip's output that says what went wrong (its first `ERROR:` line, else the last line)."""
    lines = [ln.strip() for ln in output.splitlines() if ln.strip()]
    errors = [ln for ln in lines if ln.startswith("ERROR:")]
    return (errors or lines or ["(no output)"])[0 if errors else -1]


def _pip_install(version: str, target: Path, find_links: str | None, pip_args: tuple, timeout_s: float) -> None:
    args = ["install", "--no-deps", "--no-compile", "--no-input", "--progress-bar", "off", "--target", str(target)]
    if find_links:
        args += ["--no-index", "--find-links", find_links]
    args += [*map(str, pip_args), f"{PACKAGE}=={version}"]
    where = f" from {find_links}" if find_links else ""
    logger.info("installing megatron-core %s%s into %s", version, where, target)
    run_pip(args, what=f"pip install megatron-core=={version}{where}", timeout_s=timeout_s)


_VERIFY_CODE = f"""
import json, sys
sys.path.insert(0, sys.argv[1])
import megatron.core as mc
v = getattr(mc, "__version__", None)
if v is None:
    from megatron.core import package_info
    v = package_info.__version__
print({_VERIFY_TAG!r} + json.dumps({{"version": str(v), "file": mc.__file__}}))
"""


def verify(path: str | os.PathLike, version: str, *, timeout_s: float = VERIFY_TIMEOUT_S) -> dict:
    """Import megatron.core in a fresh interpreter with `path` first on sys.path; RuntimeError unless it is `version`.

    Returns {"version", "file"} as that interpreter saw them.
    """
    path = Path(path)
    try:
        r = subprocess.run([sys.executable, "-c", _VERIFY_CODE, str(path)], capture_output=True, text=True,
                           timeout=timeout_s)
    except subprocess.TimeoutExpired as e:
        raise InstallError(f"importing megatron.core from {path} took over {timeout_s:g} s") from e
    lines = [ln for ln in r.stdout.splitlines() if ln.startswith(_VERIFY_TAG)]
    if r.returncode != 0 or not lines:
        logger.error("import megatron.core from %s failed:\n%s", path, "\n".join(r.stderr.splitlines()[-30:]))
        last = (r.stderr.strip().splitlines() or ["(no output)"])[-1]
        raise InstallError(f"megatron-core {version} in {path} does not import: {last}")
    got = json.loads(lines[-1][len(_VERIFY_TAG):])
    if not Path(got["file"]).resolve().is_relative_to(path.resolve()):
        raise InstallError(f"megatron.core imported from {got['file']}, not from {path}: a regular `megatron` package "
                           "earlier on sys.path shadows it")
    if Version(got["version"]) != Version(version):
        raise InstallError(f"{path} holds megatron-core {got['version']}, not the requested {version}")
    return got


def _partial_prefix(kind: str, version: str) -> str:
    return f"{kind}-{version}-{socket.gethostname()}-{os.getpid()}-"


def _pid_alive(pid: int) -> bool:
    try:
        os.kill(pid, 0)
    except ProcessLookupError:
        return False
    except PermissionError:
        return True
    return True


def _remove_stale(parent: Path, version: str) -> None:
    """Remove this host's leftovers (.partial-/.old-) of `version` whose installing process is gone."""
    host = socket.gethostname()
    for kind in (".partial", ".old"):
        prefix = f"{kind}-{version}-{host}-"
        for p in parent.glob(f"{kind}-*"):
            if not p.name.startswith(prefix):
                continue  # another version, or another host sharing this cache (its pids mean nothing here)
            pid = p.name[len(prefix):].split("-", 1)[0]
            if pid.isdigit() and not _pid_alive(int(pid)):
                logger.info("removing %s left by an interrupted install", p)
                shutil.rmtree(p, ignore_errors=True)


def _swap_in(tmp: Path, final: Path, version: str) -> None:
    """Rename the verified `tmp` to `final`; a folder already there (force, or not a complete install) goes first."""
    old = None
    if final.exists():
        old = Path(tempfile.mkdtemp(prefix=_partial_prefix(".old", version), dir=final.parent))
        os.replace(final, old / "v")
    try:
        os.rename(tmp, final)
    except OSError:
        if is_installed(final):  # another process finished the same install first: theirs is as good
            logger.info("megatron-core %s was installed in %s concurrently; keeping that one", version, final)
            shutil.rmtree(tmp, ignore_errors=True)
        else:
            if old is not None:  # put the previous install back rather than leave none
                os.replace(old / "v", final)
            raise
    finally:
        if old is not None:
            shutil.rmtree(old, ignore_errors=True)


# ---------------------------------------------------------------------------------------------- before a run


def prepare(wanted, *, from_dir: str | os.PathLike | None = None) -> dict[str, Path]:
    """Every release of `wanted` installed side by side before a run measures anything ('installed', the release the
    controller imports, needs nothing): those missing are installed now, from `from_dir` when given (offline), else
    from the package index. The one place a run installs releases (the runner, the CLI and notebook 03 call it); the
    experiments only look them up (`release_dirs.path_for`). Returns {release: folder}."""
    out = {}
    for r in dict.fromkeys(wanted or ()):
        if r == "installed" or normalize(r) == releases.installed_version():
            continue
        try:
            out[r] = path_for(r)
        except ValueError:
            logger.warning("installing megatron-core %s side by side%s", r, f" from {from_dir}" if from_dir else "")
            out[r] = install(r, from_dir=from_dir)
    return out


def wanted_by(config, notebooks=None) -> list[str]:
    """The releases a run of `notebooks` (numbers; None: all) installs before it starts: notebook 03's `releases`.
    The profile's `megatron` (the release of every other notebook) must be installed already: the profile check
    says how if it is not."""
    from ..questions.promotion.params import PromotionParams

    if notebooks is not None and "03" not in notebooks:
        return []
    return [r for r in config.params(PromotionParams).releases if r != "installed"]
