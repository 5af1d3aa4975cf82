"""Unit tests for moe_lab.versions: bad requests refused before pip runs, atomic installs, real side-by-side releases."""

from __future__ import annotations

import importlib.metadata
import json
import os
import subprocess
import sys
from pathlib import Path

import pytest

from moe_lab import release_dirs, releases
from moe_lab.tools import versions

PY = f"{sys.version_info[0]}.{sys.version_info[1]}"
CP = f"cp{sys.version_info[0]}{sys.version_info[1]}"
OLD = "0.12.0"  # a release the lab supports on 3.11 and 3.12, older than the venv's


def _supported_range():
    lo, hi = releases.SUPPORTED[sys.version_info[:2]]
    return releases.parse_version(lo + ".0"), releases.parse_version(hi + ".0")


@pytest.fixture
def cache(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "cache"))
    return tmp_path / "cache"


def _fake_install(root: Path, python: str, version: str) -> Path:
    p = root / "megatron-core" / python / version
    (p / "megatron" / "core").mkdir(parents=True)
    (p / "megatron" / "core" / "__init__.py").write_text(f"__version__ = {version!r}\n")
    return p


# --------------------------------------------------------------------------------------------------
# refused before anything runs
# --------------------------------------------------------------------------------------------------


@pytest.mark.parametrize("bad", ["", "0.12", "v0.12.0", "latest", "0.12.0; rm -rf /", "0.12.0 --pre", "0.12.x",
                                 "0.12.0+local", "0.12.0-foo", None, 12])
def test_bad_version_strings_refused_before_pip(bad, cache, no_subprocess):
    with pytest.raises(ValueError, match="version"):
        versions.install(bad)
    assert not no_subprocess
    assert not cache.exists()


def test_unsupported_releases_refused_before_pip(cache, no_subprocess):
    lo, hi = _supported_range()
    too_old = f"{lo[0]}.{lo[1] - 1}.0"
    too_new = f"{hi[0]}.{hi[1] + 1}.0"
    for v in (too_old, too_new):
        with pytest.raises(ValueError, match=rf"megatron-core {v} is not supported on Python {PY}"):
            versions.install(v)
    assert not no_subprocess
    assert not cache.exists()


def test_from_dir_missing_refused_before_pip(cache, tmp_path, no_subprocess):
    with pytest.raises(ValueError, match=r"from_dir \('.*nowhere'\) is not a directory"):
        versions.install(OLD, from_dir=tmp_path / "nowhere")
    assert not no_subprocess


def test_from_dir_without_that_release_lists_what_it_found(cache, tmp_path, no_subprocess):
    d = tmp_path / "wheels"
    d.mkdir()
    (d / f"megatron_core-0.16.1-{CP}-{CP}-manylinux_2_28_x86_64.whl").write_bytes(b"")
    (d / "tqdm-4.70.1-py3-none-any.whl").write_bytes(b"")
    (d / "notes.txt").write_text("x")
    with pytest.raises(ValueError, match=rf"no megatron-core {OLD} wheel or sdist; megatron-core files found: "
                                         rf"megatron_core-0.16.1-{CP}"):
        versions.install(OLD, from_dir=d)
    (d / f"megatron_core-0.16.1-{CP}-{CP}-manylinux_2_28_x86_64.whl").unlink()
    with pytest.raises(ValueError, match="megatron-core files found: none"):
        versions.install(OLD, from_dir=d)
    assert not no_subprocess


def test_from_dir_with_only_other_pythons_wheels_refused(cache, tmp_path, no_subprocess):
    d = tmp_path / "wheels"
    d.mkdir()
    (d / f"megatron_core-{OLD}-cp39-cp39-manylinux_2_28_x86_64.whl").write_bytes(b"")
    with pytest.raises(ValueError, match=rf"only as wheels for other Pythons/platforms .*needs a {CP} wheel or the sdist"):
        versions.install(OLD, from_dir=d)
    assert not no_subprocess


def test_from_dir_sdist_needs_build_wheels(cache, tmp_path, no_subprocess):
    d = tmp_path / "wheels"
    d.mkdir()
    (d / f"megatron_core-{OLD}.tar.gz").write_bytes(b"")
    (d / "setuptools-80.0.0-py3-none-any.whl").write_bytes(b"")
    with pytest.raises(ValueError, match=r"only the megatron-core 0\.12\.0 sdist .*needs wheels of pybind11"):
        versions.install(OLD, from_dir=d)
    assert not no_subprocess


def test_from_dir_accepts_compatible_wheel_or_buildable_sdist(tmp_path):
    d = tmp_path / "wheels"
    d.mkdir()
    (d / f"megatron_core-{OLD}-{CP}-{CP}-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl").write_bytes(b"")
    assert versions.check_from_dir(d, OLD) == str(d)
    e = tmp_path / "sdist"
    e.mkdir()
    for f in (f"megatron_core-{OLD}.tar.gz", "setuptools-80.0.0-py3-none-any.whl", "pybind11-3.0.0-py3-none-any.whl"):
        (e / f).write_bytes(b"")
    assert versions.check_from_dir(e, OLD) == str(e)


# --------------------------------------------------------------------------------------------------
# cache layout, lookup
# --------------------------------------------------------------------------------------------------


def test_cache_dir_env_and_default(tmp_path, monkeypatch):
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "c"))
    assert release_dirs.cache_dir() == tmp_path / "c"
    assert versions.version_dir("0.16.1") == tmp_path / "c" / "megatron-core" / PY / "0.16.1"
    monkeypatch.delenv("MOE_LAB_CACHE")
    monkeypatch.setenv("HOME", str(tmp_path / "home"))
    assert release_dirs.cache_dir() == tmp_path / "home" / ".cache" / "moe_lab"
    monkeypatch.setenv("MOE_LAB_CACHE", "")  # empty = unset
    assert release_dirs.cache_dir() == tmp_path / "home" / ".cache" / "moe_lab"


def test_normalize():
    assert versions.normalize(" 0.12.0 ") == "0.12.0"
    assert versions.normalize("0.16.0rc0") == "0.16.0rc0"


def test_list_installed_sorted_by_version_all_pythons(cache):
    assert release_dirs.list_installed() == []
    for py, v in (("3.12", "0.19.2"), (PY, "0.16.1"), (PY, "0.9.0"), (PY, OLD)):
        _fake_install(cache, py, v)
    (cache / "megatron-core" / PY / ".partial-0.13.1-host-1-abc").mkdir()  # interrupted: never listed
    (cache / "megatron-core" / PY / "0.14.0").mkdir()  # empty folder: not an install
    rows = release_dirs.list_installed()
    assert [r["version"] for r in rows] == ["0.9.0", OLD, "0.16.1", "0.19.2"]  # 0.9 < 0.12: versions, not strings
    assert rows[1] == {"version": OLD, "path": str(cache / "megatron-core" / PY / OLD), "python": PY}
    assert rows[-1]["python"] == "3.12"


def test_path_for(cache):
    with pytest.raises(ValueError, match=rf"megatron-core 0.13.1 is not installed for Python {PY} \(installed: none\); "
                                         r"run `moe-lab versions install 0.13.1`"):
        versions.path_for("0.13.1")
    p = _fake_install(cache, PY, OLD)
    assert versions.path_for(OLD) == p
    with pytest.raises(ValueError, match=rf"installed: {OLD}\)"):
        versions.path_for("0.13.1")
    with pytest.raises(ValueError, match="X.Y.Z"):
        versions.path_for("0.13")


def test_already_installed_is_returned_without_pip(cache, no_subprocess):
    p = _fake_install(cache, PY, OLD)
    assert versions.install(OLD) == p
    assert not no_subprocess


# --------------------------------------------------------------------------------------------------
# atomicity (pip faked)
# --------------------------------------------------------------------------------------------------


def _fake_pip(monkeypatch, *, rc=0, raise_timeout=False, version=OLD):
    """pip writes a megatron tree into --target, then exits `rc` (or times out)."""
    seen = {}

    def run(cmd, **kw):
        if "-c" in cmd:  # the import check
            return subprocess.CompletedProcess(cmd, 1, "", "ImportError: boom")
        seen["cmd"] = cmd
        seen["env"] = kw.get("env")
        seen["shim"] = Path(kw["env"]["PATH"].split(os.pathsep)[0], "python3").read_text()
        target = Path(cmd[cmd.index("--target") + 1])
        (target / "megatron" / "core").mkdir(parents=True)
        (target / "megatron" / "core" / "__init__.py").write_text("")
        if raise_timeout:
            raise subprocess.TimeoutExpired(cmd, kw.get("timeout"))
        return subprocess.CompletedProcess(cmd, rc, "", "ERROR: No matching distribution found for megatron-core")

    monkeypatch.setattr(versions.subprocess, "run", run)
    return seen


def _leftovers(cache):
    d = cache / "megatron-core" / PY
    return sorted(p.name for p in d.iterdir()) if d.is_dir() else []


def test_failed_pip_leaves_nothing(cache, monkeypatch):
    seen = _fake_pip(monkeypatch, rc=1)
    with pytest.raises(RuntimeError, match=r"pip install megatron-core==0.12.0: pip exited 1: ERROR: No matching"):
        versions.install(OLD)
    assert _leftovers(cache) == []
    cmd = seen["cmd"]
    assert cmd[:4] == [sys.executable, "-m", "pip", "install"]
    assert {"--no-deps", "--no-compile", "--target"} <= set(cmd) and cmd[-1] == "megatron-core==0.12.0"
    assert "--no-index" not in cmd
    assert f'exec "{sys.executable}"' in seen["shim"]  # setup.py's `python3` (first on PATH) is this interpreter


def test_pip_timeout_leaves_nothing(cache, monkeypatch):
    _fake_pip(monkeypatch, raise_timeout=True)
    with pytest.raises(RuntimeError, match=r"timed out after 5 s"):
        versions.install(OLD, timeout_s=5)
    assert _leftovers(cache) == []


def test_failed_import_check_leaves_nothing(cache, monkeypatch):
    _fake_pip(monkeypatch, rc=0)
    with pytest.raises(RuntimeError, match=r"megatron-core 0.12.0 in .* does not import: ImportError: boom"):
        versions.install(OLD)
    assert _leftovers(cache) == []


def test_offline_pip_command(cache, tmp_path, monkeypatch):
    d = tmp_path / "wheels"
    d.mkdir()
    (d / f"megatron_core-{OLD}-{CP}-{CP}-manylinux_2_24_x86_64.manylinux_2_28_x86_64.whl").write_bytes(b"")
    seen = _fake_pip(monkeypatch, rc=1)
    with pytest.raises(RuntimeError, match=rf"from {d}"):
        versions.install(OLD, from_dir=d, pip_args=("--no-build-isolation",))
    cmd = seen["cmd"]
    assert cmd[cmd.index("--no-index") + 1:cmd.index("--no-index") + 3] == ["--find-links", str(d)]
    assert cmd[-2:] == ["--no-build-isolation", "megatron-core==0.12.0"]


def test_stale_partials_of_dead_processes_are_removed(cache, monkeypatch):
    import socket

    d = cache / "megatron-core" / PY
    dead = d / f".partial-{OLD}-{socket.gethostname()}-999999999-x"
    alive = d / f".partial-{OLD}-{socket.gethostname()}-{os.getpid()}-y"
    other_host = d / f".partial-{OLD}-elsewhere.example-999999999-z"
    for p in (dead, alive, other_host):
        p.mkdir(parents=True)
    _fake_pip(monkeypatch, rc=1)
    with pytest.raises(RuntimeError):
        versions.install(OLD)
    assert not dead.exists() and alive.exists() and other_host.exists()


# --------------------------------------------------------------------------------------------------
# real installs (PyPI)
# --------------------------------------------------------------------------------------------------


@pytest.fixture(scope="module")
def old_wheel_dir(tmp_path_factory):
    """This Python's megatron-core 0.12.0 wheel, downloaded; skips the module's network tests if PyPI is unreachable."""
    d = tmp_path_factory.mktemp("wheel")
    try:
        r = subprocess.run([sys.executable, "-m", "pip", "download", "--no-deps", "--only-binary=:all:", "-d", str(d),
                            f"megatron-core=={OLD}"], capture_output=True, text=True, timeout=180)
    except subprocess.TimeoutExpired:
        pytest.skip("PyPI unreachable: pip download megatron-core timed out")
    if r.returncode != 0:
        pytest.skip(f"PyPI unreachable: {versions.pip_error_line(r.stdout + r.stderr)}")
    return d


@pytest.fixture(scope="module")
def real_cache(tmp_path_factory, old_wheel_dir):
    with pytest.MonkeyPatch.context() as mp:
        root = tmp_path_factory.mktemp("cache")
        mp.setenv("MOE_LAB_CACHE", str(root))
        yield root


def _import_in_subprocess(path) -> str:
    code = ("import sys; sys.path.insert(0, sys.argv[1]); from moe_lab import releases; "
            "import megatron.core as mc; print(releases.installed_version(), mc.__file__)")
    r = subprocess.run([sys.executable, "-c", code, str(path)], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stdout.strip().splitlines()[-1]


def test_real_install_side_by_side(real_cache):
    p = versions.install(OLD)
    assert p == real_cache / "megatron-core" / PY / OLD
    assert [(r["version"], r["python"], r["path"]) for r in release_dirs.list_installed()] == [(OLD, PY, str(p))]
    assert versions.path_for(OLD) == p
    meta = json.loads((p / versions.MARKER).read_text())
    assert meta["version"] == OLD and meta["source"] == "index"
    assert not any(n.startswith(".") for n in os.listdir(p.parent))
    version, module = _import_in_subprocess(p).split()  # what an engine with extra_path=(p,) sees
    assert version == OLD and module.startswith(str(p))
    assert importlib.metadata.version("megatron-core") != OLD  # this interpreter's own release is untouched


def test_real_offline_reinstall_from_dir(real_cache, old_wheel_dir, monkeypatch):
    p = versions.install(OLD)  # present from the test above, or installed now
    before = json.loads((p / versions.MARKER).read_text())["installed_at"]
    # any attempt to reach an index now fails: the install must come from old_wheel_dir alone
    for var in ("HTTP_PROXY", "HTTPS_PROXY", "http_proxy", "https_proxy"):
        monkeypatch.setenv(var, "http://127.0.0.1:9")
    monkeypatch.setenv("PIP_RETRIES", "0")
    assert versions.install(OLD, from_dir=old_wheel_dir, force=True) == p
    meta = json.loads((p / versions.MARKER).read_text())
    assert meta["source"] == str(old_wheel_dir) and meta["installed_at"] >= before
    assert sorted(os.listdir(p.parent)) == [OLD]  # no .partial-/.old- left; the import check ran before the swap
