"""Gather every wheel an air-gapped GPU node needs beyond torch, and the one pip line that installs them there.

`build()` runs on a machine with internet, for the node's Python and platform (not this machine's):
- the lab's runtime deps (`REQUIREMENTS`, + JupyterLab on request, + `extra`) with their whole dependency closure,
  resolved by pip for the target. torch, triton and nvidia-* never enter: pip resolves against a placeholder torch
  (a metadata-only wheel pinned to `torch_version`) so nothing that depends on torch drags CUDA wheels in, and
  whatever of those names pip still returns is dropped. pip evaluates environment markers for the interpreter that
  runs it, not for --python-version (papermill needs `aiohttp; python_version == "3.12"`), so the closure is then
  re-walked from the wheels' metadata with the target's markers: what is missing is fetched, what only this
  machine's Python needs is left out;
- megatron-core, each release with --no-deps (0.11/0.12 declare test/tooling deps, 0.13 numpy<2: none are needed).
  A release with no wheel for the target (0.11–0.13 on Python 3.12) comes as its sdist plus the wheels that build
  it (setuptools, pybind11); the node then needs a C++ compiler.
It writes `moe_lab-deps.txt` in the wheelhouse: every runtime package pinned, plus the first megatron-core release.
The node installs from it with `install_command()` (pip --no-index --no-deps: nothing is fetched, torch untouched);
other releases go side by side with `moe-lab versions install X.Y.Z --from DIR`.
"""

from __future__ import annotations

import base64
import email.parser
import fnmatch
import hashlib
import importlib.metadata
import logging
import os
import platform as _platform
import re
import shlex
import tempfile
import zipfile
from pathlib import Path

from packaging.markers import Marker
from packaging.requirements import InvalidRequirement, Requirement
from packaging.utils import canonicalize_name
from packaging.version import Version

from .. import releases
from . import versions

logger = logging.getLogger(__name__)

# pyproject.toml [project.dependencies] without torch (the node's own), megatron-core (per release, below) and
# jupyterlab (JUPYTERLAB: GPU nodes run headless). tests/unit/test_wheelhouse.py keeps the two in step.
# ipywidgets stays in: it is the kernel's side of the progress widget, needed wherever the lab's Python is the kernel
# of a JupyterLab, the node's own (a site JupyterHub) included.
REQUIREMENTS = [
    "numpy",
    "pandas>=2.0",
    "seaborn>=0.13",
    "matplotlib>=3.8",
    "ipyparallel>=8.6",
    "papermill>=2.5",
    "nbconvert>=7.0",
    "nbformat>=5.9",
    "ipykernel>=6.0",
    "ipywidgets>=8.0",
    "tqdm>=4.64.1",
    "packaging>=24.2",
]
JUPYTERLAB = "jupyterlab>=4.0"
EXCLUDED = ("torch", "triton", "pytorch-triton*", "nvidia-*")  # canonical names; the node has its own
DEPS_FILE = "moe_lab-deps.txt"
TIMEOUT_S = 1800.0
_ROUNDS = 5  # pip download rounds to close the target's dependency graph (one extra round is typical)
_COMMON = ["--no-input", "--progress-bar", "off"]

_PLATFORM_RE = re.compile(r"manylinux_(\d+)_(\d+)_(x86_64|aarch64)|manylinux(2014|2010|1)_(x86_64|aarch64)")
_LEGACY = {(2, 17): "manylinux2014", (2, 12): "manylinux2010", (2, 5): "manylinux1"}
_PLACEHOLDER_LOCAL = "moelab.placeholder"


def excluded(name: str) -> bool:
    n = canonicalize_name(name)
    return any(fnmatch.fnmatchcase(n, pat) for pat in EXCLUDED)


def platform_tags(platform: str) -> list[str]:
    """The target platform and every older manylinux tag its glibc runs (pip does not expand manylinux_2_N itself)."""
    m = _PLATFORM_RE.fullmatch(platform or "")
    if not m:
        raise ValueError(f"platform ({platform!r}) must be a manylinux tag such as manylinux_2_28_x86_64 or "
                         "manylinux2014_x86_64 (x86_64 or aarch64)")
    if m.group(1):
        glibc, arch = (int(m.group(1)), int(m.group(2))), m.group(3)
    else:
        glibc, arch = {v: k for k, v in _LEGACY.items()}[f"manylinux{m.group(4)}"], m.group(5)
    if glibc[0] != 2 or glibc[1] < 5:
        raise ValueError(f"platform ({platform!r}) names glibc {glibc[0]}.{glibc[1]}; manylinux tags start at 2.5")
    oldest = 17 if arch == "aarch64" else 5
    tags = []
    for minor in range(glibc[1], oldest - 1, -1):
        tags.append(f"manylinux_2_{minor}_{arch}")
        if (2, minor) in _LEGACY:
            tags.append(f"{_LEGACY[(2, minor)]}_{arch}")
    return tags


def _check_python(python: str) -> tuple[int, int]:
    m = re.fullmatch(r"(\d+)\.(\d+)", str(python).strip())
    py = (int(m.group(1)), int(m.group(2))) if m else None
    if py not in releases.SUPPORTED:
        allowed = ", ".join(f"{a}.{b}" for a, b in sorted(releases.SUPPORTED))
        raise ValueError(f"python ({python!r}) must be one the lab supports: {allowed}")
    return py


def _check_requirements(reqs: list[str]) -> list[str]:
    for r in reqs:
        try:
            name = Requirement(r).name
        except InvalidRequirement as e:
            raise ValueError(f"requirement ({r!r}) is not a valid pip requirement: {e}") from e
        if excluded(name):
            raise ValueError(f"requirement ({r!r}) is never in the wheelhouse: the node has its own {', '.join(EXCLUDED)}")
        if canonicalize_name(name) == versions.PACKAGE:
            raise ValueError(f"requirement ({r!r}): pass megatron-core releases as megatron_versions, not requirements")
    return reqs


def _torch_version(torch_version: str | None) -> str:
    if torch_version is None:
        try:
            return Version(importlib.metadata.version("torch")).base_version
        except importlib.metadata.PackageNotFoundError:
            return "2.6.0"
    try:
        return Version(str(torch_version)).base_version
    except ValueError as e:
        raise ValueError(f"torch_version ({torch_version!r}) must be a torch release such as 2.7.1") from e


def target_environment(python: tuple[int, int], platform: str) -> dict:
    """The PEP 508 marker environment of CPython `python` on a Linux `platform` (what pip would see on the node)."""
    v = f"{python[0]}.{python[1]}"
    return {"python_version": v, "python_full_version": f"{v}.0", "implementation_name": "cpython",
            "implementation_version": f"{v}.0", "platform_python_implementation": "CPython", "sys_platform": "linux",
            "platform_system": "Linux", "os_name": "posix", "platform_release": "", "platform_version": "",
            "platform_machine": "aarch64" if platform.endswith("aarch64") else "x86_64"}


def _applies(marker: Marker | None, env: dict, extras) -> bool:
    return marker is None or any(marker.evaluate({**env, "extra": e}) for e in ("", *extras))


def wheel_requirements(path: Path) -> list[Requirement]:
    """The Requires-Dist entries of a wheel's METADATA."""
    with zipfile.ZipFile(path) as z:
        names = [n for n in z.namelist() if n.count("/") == 1 and n.endswith(".dist-info/METADATA")]
        if not names:
            raise RuntimeError(f"{path.name} has no .dist-info/METADATA; not a wheel pip can install")
        meta = email.parser.Parser().parsestr(z.read(names[0]).decode("utf-8", "replace"), headersonly=True)
    return [Requirement(r) for r in meta.get_all("Requires-Dist") or []]


def closure(wheels: dict, top: list[str], env: dict) -> tuple[set, list[Requirement]]:
    """Walk `top` through `wheels` ({canonical name: path}) with the target's markers.

    Returns (names reached, requirements that no wheel satisfies by name). Excluded names (torch...) are not followed.
    """
    reached, missing, seen = set(), [], set()
    todo = [(Requirement(r), ()) for r in top]
    while todo:
        req, parent_extras = todo.pop()
        if not _applies(req.marker, env, parent_extras):
            continue
        name = canonicalize_name(req.name)
        if excluded(name):
            continue
        if name not in wheels:
            if name not in {canonicalize_name(m.name) for m in missing}:
                missing.append(req)
            continue
        reached.add(name)
        key = (name, frozenset(req.extras))
        if key in seen:
            continue
        seen.add(key)
        todo += [(r, tuple(req.extras)) for r in wheel_requirements(wheels[name])]
    return reached, missing


def _without_marker(req: Requirement) -> str:
    extras = f"[{','.join(sorted(req.extras))}]" if req.extras else ""
    return f"{req.name}{extras}{req.specifier}"


def _placeholder_torch(folder: Path, version: str) -> Path:
    """A metadata-only torch wheel with no dependencies: pip resolves `torch` to it and never fetches the real one."""
    v = f"{version}+{_PLACEHOLDER_LOCAL}"
    info = f"torch-{v}.dist-info"
    files = {
        f"{info}/METADATA": f"Metadata-Version: 2.1\nName: torch\nVersion: {v}\nSummary: moe_lab wheelhouse placeholder\n",
        f"{info}/WHEEL": "Wheel-Version: 1.0\nGenerator: moe_lab.wheelhouse\nRoot-Is-Purelib: true\nTag: py3-none-any\n",
    }
    record = []
    path = folder / f"torch-{v}-py3-none-any.whl"
    with zipfile.ZipFile(path, "w") as z:
        for name, text in files.items():
            data = text.encode()
            z.writestr(name, data)
            digest = base64.urlsafe_b64encode(hashlib.sha256(data).digest()).rstrip(b"=").decode()
            record.append(f"{name},sha256={digest},{len(data)}")
        record.append(f"{info}/RECORD,,")
        z.writestr(f"{info}/RECORD", "\n".join(record) + "\n")
    return path


def _download_deps(reqs: list[str], dest: Path, work: Path, *, target: list[str], env: dict, torch_v: str, what: str,
                   timeout_s: float) -> None:
    """pip download `reqs` and their closure for the target into `dest`, until the target's markers find no gap.

    Each round pins what is already there (constraints), so later rounds only add; wheels only this machine's
    Python needs are removed at the end.
    """
    dest.mkdir()
    stub = work / "stub"
    stub.mkdir()
    _placeholder_torch(stub, torch_v)
    constraints = work / "constraints.txt"
    wheels, ask, reached = {}, list(reqs), set()
    for round_ in range(1, _ROUNDS + 1):
        if not ask:
            break
        logger.info("resolving %d requirements for %s (torch stands in as %s)", len(ask), what, torch_v)
        pins = [f"{n}=={versions.parse_dist(p.name)[2]}" for n, p in sorted(wheels.items())]
        constraints.write_text("\n".join([f"torch=={torch_v}", *pins]) + "\n")
        versions.run_pip(["download", *_COMMON, *target, "--find-links", str(stub), "--constraint", str(constraints),
                          "-d", str(dest), *ask],
                         what=f"pip download the lab's deps for {what} (torch as {torch_v}; pass torch_version= "
                              "the node's torch if a requirement pins another)",
                         timeout_s=timeout_s)
        for f in dest.glob("*.whl"):
            kind, name, _ver, _tags = versions.parse_dist(f.name)
            if kind == "wheel" and not excluded(name):
                wheels[name] = f
        reached, missing = closure(wheels, reqs, env)
        ask = [_without_marker(m) for m in missing]
        if ask:
            logger.info("round %d: %s also needs %s, which pip skipped (it reads markers for this Python)", round_,
                        what, ", ".join(ask))
    if ask:
        raise versions.InstallError(f"the deps for {what} do not close after {_ROUNDS} rounds; still missing: {', '.join(ask)}")
    for name in sorted(set(wheels) - reached):
        logger.info("left out %s: only this machine's Python needs it, not %s", wheels[name].name, what)
        wheels[name].unlink()


def _download_megatron(version: str, dest: Path, *, target: list[str], what: str, timeout_s: float) -> bool:
    """pip download megatron-core `version` (--no-deps) into `dest`: its wheel for the target (True), else its sdist."""
    args = ["download", *_COMMON, "--no-deps", "-d", str(dest)]
    spec = f"{versions.PACKAGE}=={version}"
    r = versions.run_pip([*args, *target, spec], what=f"pip download {spec}", timeout_s=timeout_s, check=False)
    if r.returncode == 0:
        return True
    output = r.stdout + r.stderr
    if "No matching distribution" not in output and "Could not find a version" not in output:
        raise versions.InstallError(f"pip download {spec} for {what}: {versions.pip_error_line(output)}")
    logger.warning("megatron-core %s has no %s wheel: taking its sdist, the node builds it (needs a C++ compiler)",
                   version, what)
    no_binary = ["--no-binary", versions.PACKAGE, *target[1:]]  # --no-deps allows the target flags without wheels
    versions.run_pip([*args, *no_binary, spec], what=f"pip download the {spec} sdist", timeout_s=timeout_s)
    return False


def build(out_dir: str | os.PathLike, *, python: str = "3.12", platform: str = "manylinux_2_28_x86_64",
          megatron_versions=("0.16.1",), extra=(), jupyterlab: bool = False, requirements=None,
          torch_version: str | None = None, timeout_s: float = TIMEOUT_S) -> list[Path]:
    """Download into `out_dir` every wheel the lab needs beyond torch on a node with CPython `python` on `platform`.

    `requirements` replaces REQUIREMENTS (e.g. a tiny set in tests); `extra` adds to it. `torch_version`: the node's
    torch, which the placeholder stands for when a requirement depends on torch (default: this machine's torch).
    Returns the files gathered (wheels, and sdists of megatron-core releases that have no wheel for the target).
    """
    py = _check_python(python)
    plats = platform_tags(platform)
    mvs = []
    for v in (megatron_versions,) if isinstance(megatron_versions, str) else megatron_versions:
        n = versions.normalize(v)
        releases.check_supported(n, python=py)  # e.g. 0.17+ only on Python >= 3.12
        if n not in mvs:
            mvs.append(n)
    reqs = _check_requirements(list(REQUIREMENTS if requirements is None else requirements)
                               + ([JUPYTERLAB] if jupyterlab else []) + list(extra))
    torch_v = _torch_version(torch_version)
    cp = f"cp{py[0]}{py[1]}"
    if not platform.endswith(_platform.machine()):
        logger.warning("target %s differs from this machine (%s): pip resolves with this machine's markers and the "
                       "closure is re-walked for the target; try the wheelhouse on a node", platform, _platform.machine())
    target = ["--only-binary=:all:", "--python-version", f"{py[0]}.{py[1]}", "--implementation", "cp"]
    for p in plats:
        target += ["--platform", p]
    out = Path(out_dir).expanduser()
    out.mkdir(parents=True, exist_ok=True)

    with tempfile.TemporaryDirectory(prefix=".moe_lab-wheelhouse-", dir=out) as work_s:
        work = Path(work_s)
        deps, mcore, build_deps = (work / n for n in ("deps", "mcore", "build"))
        _download_deps(reqs, deps, work, target=target, env=target_environment(py, platform), torch_v=torch_v,
                       what=f"{cp} {platform}", timeout_s=timeout_s)
        sdists = [v for v in mvs if not _download_megatron(v, mcore, target=target, what=f"{cp} {platform}",
                                                          timeout_s=timeout_s)]
        if sdists:
            versions.run_pip(["download", *_COMMON, *target, "-d", str(build_deps), *versions.BUILD_REQUIREMENTS],
                             what=f"pip download {', '.join(versions.BUILD_REQUIREMENTS)} (to build sdists)",
                             timeout_s=timeout_s)
        pins, gathered = [], []
        for folder in (deps, mcore, build_deps):
            if not folder.is_dir():
                continue
            for f in sorted(folder.iterdir()):
                kind, name, ver, _tags = versions.parse_dist(f.name)
                if kind is None:
                    logger.warning("ignoring %s: neither a wheel nor an sdist", f.name)
                    continue
                if excluded(name):
                    if not (name == "torch" and ver.local == _PLACEHOLDER_LOCAL):
                        logger.warning("left out %s: the node has its own %s", f.name, name)
                    continue
                if folder is deps:
                    pins.append(f"{name}=={ver}")
                dest = out / f.name
                os.replace(f, dest)
                gathered.append(dest)

    first = [f"{versions.PACKAGE}=={mvs[0]}"] if mvs else []
    others = [f"moe-lab versions install {v} --from {out}" for v in mvs[1:]]
    lines = [f"# moe_lab runtime deps for {cp} {platform}, gathered by moe_lab.wheelhouse; torch, triton and nvidia-*",
             "# are left out (the node has its own). Install on the node with:",
             f"#   {install_command(out)}"]
    lines += [f"# other megatron-core releases here, side by side: {c}" for c in others]
    (out / DEPS_FILE).write_text("\n".join(lines + first + sorted(pins, key=str.lower)) + "\n")
    size = sum(p.stat().st_size for p in gathered) / 2**20
    logger.info("wheelhouse %s: %d files, %.0f MiB; %d pinned in %s", out, len(gathered), size, len(pins) + len(first),
                DEPS_FILE)
    return sorted(gathered)


def install_command(wheel_dir: str | os.PathLike, target: str | os.PathLike | None = None) -> str:
    """The one line to run on the node: install everything pinned in the wheelhouse, from it alone, torch untouched.

    With `target`, into that folder (`pip --target`; put it on PYTHONPATH) instead of the node's environment.
    """
    d = str(wheel_dir)
    cmd = ["python3", "-m", "pip", "install", "--no-index", "--no-deps", "--find-links", d,
           "-r", os.path.join(d, DEPS_FILE)]
    if target is not None:
        cmd += ["--target", str(target)]
    return shlex.join(cmd)
