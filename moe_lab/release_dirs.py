"""Where megatron-core releases live side by side, found without torch or pip: the lookup half of `tools/versions`.

Layout: `$MOE_LAB_CACHE` (default `~/.cache/moe_lab`) / `megatron-core` / `<python X.Y>` / `<version>` /, a `pip --target`
folder holding only megatron-core. Engines put `path_for(version)` first on sys.path (`dist.setup(extra_path=...)`)
before importing megatron. The experiments and the profiles only look releases up here; installing one is the runner's,
the CLI's or a notebook's step before a run (`tools.versions.prepare`), never a side effect of measuring.
"""

from __future__ import annotations

import logging
import os
import sys
from pathlib import Path

from packaging.version import InvalidVersion, Version

from . import releases

logger = logging.getLogger(__name__)

PACKAGE = "megatron-core"


def cache_dir() -> Path:
    """The lab's cache: `$MOE_LAB_CACHE` or `~/.cache/moe_lab` (releases live under megatron-core/<X.Y>/<version>/)."""
    base = os.environ.get("MOE_LAB_CACHE") or "~/.cache/moe_lab"
    return Path(base).expanduser().absolute()


def python_tag(python: tuple[int, int] | None = None) -> str:
    py = python or sys.version_info[:2]
    return f"{py[0]}.{py[1]}"


def normalize(version: str) -> str:
    """The canonical spelling of a megatron-core release ('0.12.0', '0.16.0rc0'); ValueError for anything else."""
    if not isinstance(version, str):
        raise ValueError(f"megatron-core version ({version!r}) must be a string like 0.16.1")
    releases.parse_version(version)  # X.Y.Z or ValueError
    try:
        v = Version(version.strip())
    except InvalidVersion as e:
        raise ValueError(f"megatron-core version ({version!r}) is not a release version; use X.Y.Z, e.g. 0.16.1") from e
    if v.local:
        raise ValueError(f"megatron-core version ({version!r}) has a local part (+{v.local}); PyPI releases have none")
    return str(v)


def version_dir(version: str, python: tuple[int, int] | None = None) -> Path:
    """Where `version` lives (installed or not) for this Python, or for `python` = (X, Y)."""
    return cache_dir() / PACKAGE / python_tag(python) / normalize(version)


def is_installed(path: Path) -> bool:
    return (path / "megatron" / "core" / "__init__.py").is_file()


def list_installed() -> list[dict]:
    """Every installed release, all Pythons: [{"version", "path" (str), "python" ("X.Y")}] sorted by version."""
    root = cache_dir() / PACKAGE
    rows = []
    if not root.is_dir():
        return rows
    for pydir in root.iterdir():
        if not pydir.is_dir() or pydir.name.startswith("."):
            continue
        for vdir in pydir.iterdir():
            if vdir.name.startswith(".") or not is_installed(vdir):
                continue
            try:
                Version(vdir.name)
            except InvalidVersion:
                logger.debug("ignoring %s: not named after a release", vdir)
                continue
            rows.append({"version": vdir.name, "path": str(vdir), "python": pydir.name})
    rows.sort(key=lambda r: (Version(r["version"]), tuple(int(x) for x in r["python"].split(".") if x.isdigit())))
    return rows


def path_for(version: str) -> Path:
    """The folder of an installed release for this Python; ValueError (saying how to install it) if there is none."""
    v = normalize(version)
    p = version_dir(v)
    if not is_installed(p):
        here = [r["version"] for r in list_installed() if r["python"] == python_tag()]
        raise ValueError(f"megatron-core {v} is not installed for Python {python_tag()} (installed: "
                         f"{', '.join(here) or 'none'}); run `moe-lab versions install {v}` (offline: add `--from DIR`, "
                         f"a folder with its wheel)")
    return p


__all__ = ["PACKAGE", "cache_dir", "python_tag", "normalize", "version_dir", "is_installed", "list_installed",
           "path_for"]
