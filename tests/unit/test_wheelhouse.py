"""Unit tests for moe_lab.wheelhouse: arguments refused up front, the target's dep closure, a real tiny wheelhouse."""

from __future__ import annotations

import glob
import importlib.metadata
import os
import shlex
import shutil
import subprocess
import sys
import tomllib
import zipfile
from pathlib import Path

import pytest
from packaging import tags
from packaging.requirements import Requirement
from packaging.utils import canonicalize_name

from moe_lab import release_dirs
from moe_lab.tools import versions, wheelhouse

ROOT = Path(__file__).resolve().parents[2]
PY = f"{sys.version_info[0]}.{sys.version_info[1]}"


def _wheel(folder: Path, name: str, version: str, requires=()) -> Path:
    """A minimal wheel whose METADATA declares `requires`."""
    dist = f"{name.replace('-', '_')}-{version}"
    path = folder / f"{dist}-py3-none-any.whl"
    meta = ["Metadata-Version: 2.1", f"Name: {name}", f"Version: {version}"] + [f"Requires-Dist: {r}" for r in requires]
    with zipfile.ZipFile(path, "w") as z:
        z.writestr(f"{dist}.dist-info/METADATA", "\n".join(meta) + "\n")
    return path


# --------------------------------------------------------------------------------------------------
# the requirement list and the command
# --------------------------------------------------------------------------------------------------


def test_requirements_match_pyproject():
    """REQUIREMENTS + JUPYTERLAB = pyproject's dependencies minus torch and megatron-core."""
    deps = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]["dependencies"]
    want = {canonicalize_name(Requirement(d).name): str(Requirement(d).specifier) for d in deps}
    for name in ("torch", "megatron-core"):
        want.pop(name)
    got = {canonicalize_name(Requirement(r).name): str(Requirement(r).specifier)
           for r in wheelhouse.REQUIREMENTS + [wheelhouse.JUPYTERLAB]}
    assert got == want


def test_install_command():
    assert wheelhouse.install_command("/opt/wh") == (
        "python3 -m pip install --no-index --no-deps --find-links /opt/wh -r /opt/wh/moe_lab-deps.txt")
    cmd = wheelhouse.install_command("/mnt/a b", target="/scratch/lab site")
    assert shlex.split(cmd)[-2:] == ["--target", "/scratch/lab site"]
    assert shlex.split(cmd)[shlex.split(cmd).index("-r") + 1] == "/mnt/a b/moe_lab-deps.txt"


def test_platform_tags():
    tags = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    assert tags[0] == "manylinux_2_28_x86_64" and tags[-1] == "manylinux1_x86_64"
    assert {"manylinux_2_24_x86_64", "manylinux_2_17_x86_64", "manylinux2014_x86_64", "manylinux2010_x86_64"} <= set(tags)
    assert "manylinux_2_29_x86_64" not in tags
    assert wheelhouse.platform_tags("manylinux2014_aarch64") == ["manylinux_2_17_aarch64", "manylinux2014_aarch64"]


# --------------------------------------------------------------------------------------------------
# refused before pip runs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("kwargs, match", [
    (dict(python="3.10"), r"python \('3.10'\) must be one the lab supports: 3.11, 3.12, 3.13"),
    (dict(python="3"), r"python \('3'\)"),
    (dict(platform="linux_x86_64"), r"platform \('linux_x86_64'\) must be a manylinux tag"),
    (dict(platform="win_amd64"), r"platform \('win_amd64'\)"),
    (dict(python="3.11", megatron_versions=("0.17.0",)), r"megatron-core 0.17.0 is not supported on Python 3.11"),
    (dict(python="3.13", megatron_versions=("0.16.1",)), r"megatron-core 0.16.1 is not supported on Python 3.13"),
    (dict(megatron_versions=("0.16",)), r"X.Y.Z"),
    (dict(extra=("torch>=2.6",)), r"requirement \('torch>=2.6'\) is never in the wheelhouse"),
    (dict(extra=("nvidia-nccl-cu12",)), r"never in the wheelhouse"),
    (dict(extra=("megatron-core==0.12.0",)), r"pass megatron-core releases as megatron_versions"),
    (dict(extra=("not a requirement!",)), r"is not a valid pip requirement"),
    (dict(torch_version="two"), r"torch_version \('two'\)"),
])
def test_bad_arguments_refused_before_pip(kwargs, match, tmp_path, no_subprocess):
    with pytest.raises(ValueError, match=match):
        wheelhouse.build(tmp_path / "wh", **kwargs)
    assert not no_subprocess
    assert not (tmp_path / "wh").exists()


def test_excluded():
    for name in ("torch", "Torch", "triton", "nvidia-cublas-cu12", "nvidia_nccl_cu12", "pytorch-triton-rocm"):
        assert wheelhouse.excluded(name), name
    for name in ("torchvision", "tqdm", "numpy"):
        assert not wheelhouse.excluded(name), name


# --------------------------------------------------------------------------------------------------
# the target's closure (synthetic wheels)
# --------------------------------------------------------------------------------------------------


def test_closure_reads_markers_for_the_target(tmp_path):
    wheels = {
        "papermill": _wheel(tmp_path, "papermill", "2.7.0", ['aiohttp>=3.9; python_version == "3.12"', "tqdm",
                                                             'tomli; python_version < "3.12"']),
        "tqdm": _wheel(tmp_path, "tqdm", "4.70.1", ['colorama; platform_system == "Windows"']),
        "tomli": _wheel(tmp_path, "tomli", "2.0.0"),
        "ranger": _wheel(tmp_path, "ranger", "0.1", ["torch", "nvidia-nccl-cu12"]),
        "extra-user": _wheel(tmp_path, "extra-user", "1.0", ['rich; extra == "pretty"']),
    }
    wheels = {canonicalize_name(k): v for k, v in wheels.items()}
    env312 = wheelhouse.target_environment((3, 12), "manylinux_2_28_x86_64")
    reached, missing = wheelhouse.closure(wheels, ["papermill", "ranger", "extra-user"], env312)
    assert reached == {"papermill", "tqdm", "ranger", "extra-user"}  # no tomli (3.11 only), torch/nvidia not followed
    assert [str(m) for m in missing] == ['aiohttp>=3.9; python_version == "3.12"']
    env311 = wheelhouse.target_environment((3, 11), "manylinux_2_28_x86_64")
    reached, missing = wheelhouse.closure(wheels, ["papermill", "extra-user[pretty]"], env311)
    assert reached == {"papermill", "tqdm", "tomli", "extra-user"}
    assert [m.name for m in missing] == ["rich"]


def test_placeholder_torch_is_a_wheel_without_deps(tmp_path):
    p = wheelhouse._placeholder_torch(tmp_path, "2.7.1")
    assert p.name == "torch-2.7.1+moelab.placeholder-py3-none-any.whl"
    assert wheelhouse.wheel_requirements(p) == []
    kind, name, ver, _ = versions.parse_dist(p.name)
    assert (kind, name, str(ver)) == ("wheel", "torch", "2.7.1+moelab.placeholder")


# --------------------------------------------------------------------------------------------------
# real wheelhouse (PyPI)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def pypi():
    """Skips the module's network tests when PyPI is unreachable (a quick pip download of a megatron-core wheel)."""
    with __import__("tempfile").TemporaryDirectory() as d:
        try:
            r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:",
                                "--python-version", "3.12", "--implementation", "cp", "--platform",
                                "manylinux_2_28_x86_64", "-d", d, "megatron-core==0.16.1"],
                               capture_output=True, text=True, timeout=180)
        except subprocess.TimeoutExpired:
            pytest.skip("PyPI unreachable: pip download megatron-core timed out")
    if r.returncode != 0:
        pytest.skip(f"PyPI unreachable: {versions.pip_error_line(r.stdout + r.stderr)}")


@pytest.fixture(scope="module")
def tiny(pypi, tmp_path_factory):
    """A wheelhouse for a Python 3.12 node: tqdm, papermill's aiohttp case, a torch-dependent extra, two releases."""
    out = tmp_path_factory.mktemp("wh")
    files = wheelhouse.build(out, python="3.12", megatron_versions=("0.16.1", "0.12.0"),
                             requirements=("tqdm", "papermill"), extra=("pytorch-ranger",), torch_version="2.7.1")
    return out, files


def test_tiny_wheelhouse(tiny):
    out, files = tiny
    names = sorted(p.name for p in files)
    assert sorted(os.listdir(out)) == sorted(names + [wheelhouse.DEPS_FILE])  # nothing else left behind
    dists = {versions.parse_dist(n)[1]: versions.parse_dist(n) for n in names}
    assert not [n for n in dists if wheelhouse.excluded(n)]  # pytorch-ranger needs torch: neither it nor CUDA came
    assert {"tqdm", "papermill", "pytorch-ranger", "megatron-core", "setuptools", "pybind11"} <= set(dists)
    assert "aiohttp" in dists  # papermill needs it on 3.12 only: pip (running on this Python) skipped it
    assert "megatron_core-0.16.1-cp312-cp312-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl" in names
    assert "megatron_core-0.12.0.tar.gz" in names  # 0.12 has no cp312 wheel
    plats = wheelhouse.platform_tags("manylinux_2_28_x86_64")
    node = set(tags.cpython_tags((3, 12), platforms=plats)) | set(tags.compatible_tags((3, 12), "cp312", plats))
    for n in names:
        if n.endswith(".whl"):
            assert versions.parse_dist(n)[3] & node, f"{n} does not install on a cp312 manylinux_2_28 node"
    pins = [ln for ln in (out / wheelhouse.DEPS_FILE).read_text().splitlines() if ln and not ln.startswith("#")]
    assert pins[0] == "megatron-core==0.16.1"
    pinned = {Requirement(p).name for p in pins}
    assert {"tqdm", "papermill", "pytorch-ranger", "aiohttp"} <= pinned
    assert not {"torch", "setuptools", "pybind11"} & pinned  # build-only wheels are not installed on the node
    assert "moe-lab versions install 0.12.0 --from" in (out / wheelhouse.DEPS_FILE).read_text()


def _python312():
    cands = [shutil.which("python3.12"), *sorted(glob.glob(os.path.expanduser("~/.pyenv/versions/3.12*/bin/python3.12")))]
    for c in cands:
        if c and subprocess.run([c, "-c", "import pip"], capture_output=True).returncode == 0:
            return c
    return None


def test_tiny_wheelhouse_installs_offline_on_a_312_node(tiny, tmp_path):
    """The one line, run by a Python 3.12 with no torch, index unreachable: everything pinned lands in --target."""
    py312 = _python312()
    if py312 is None:
        pytest.skip("no Python 3.12 with pip on this machine to play the node")
    out, _ = tiny
    site = tmp_path / "site"
    cmd = shlex.split(wheelhouse.install_command(out, target=site))
    env = dict(os.environ, HTTPS_PROXY="http://127.0.0.1:9", HTTP_PROXY="http://127.0.0.1:9")
    r = subprocess.run([py312, *cmd[1:]], capture_output=True, text=True, timeout=300, env=env)
    assert r.returncode == 0, r.stderr[-3000:]
    got = {canonicalize_name(d.metadata["Name"]): d.version for d in importlib.metadata.distributions(path=[str(site)])}
    assert got["megatron-core"] == "0.16.1" and "aiohttp" in got and "papermill" in got
    assert not [n for n in got if wheelhouse.excluded(n)]
    r = subprocess.run([py312, "-c", "import sys; sys.path.insert(0, sys.argv[1]); import papermill, aiohttp, tqdm",
                        str(site)], capture_output=True, text=True, timeout=120)
    assert r.returncode == 0, r.stderr[-2000:]


def test_sdist_release_installs_offline_from_the_wheelhouse(tiny, tmp_path, monkeypatch):
    """0.12.0 is only an sdist in a 3.12 wheelhouse: `versions.install --from` builds it here with no index."""
    if not (shutil.which("c++") or shutil.which("g++")):
        pytest.skip("no C++ compiler to build the megatron-core sdist")
    out, _ = tiny
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "cache"))
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    p = versions.install("0.12.0", from_dir=out)
    assert release_dirs.list_installed() == [{"version": "0.12.0", "path": str(p), "python": PY}]
    assert list(p.glob(f"megatron/core/datasets/helpers_cpp*{sys.version_info[0]}{sys.version_info[1]}*.so"))
