"""The lab's bytecode cache (moe_lab.bytecode): where the environment forbids writing bytecode and a package holds none,
the processes the lab starts get a bytecode tree of the lab's own, write it once and read it afterwards; anywhere else
nothing changes. The package here is a small one made for the test, standing for torch."""

import os
import subprocess
import sys
import textwrap
import uuid
from pathlib import Path

import pytest

from moe_lab import bytecode, cli

NO_WRITE, PREFIX = bytecode.NO_WRITE_ENV, bytecode.PREFIX_ENV


@pytest.fixture
def package(tmp_path, monkeypatch):
    """A source-only package on sys.path (no bytecode beside it), and the lab's cache in tmp_path."""
    name = f"moe_lab_test_pkg_{uuid.uuid4().hex[:8]}"
    src = tmp_path / "src" / name
    src.mkdir(parents=True)
    (src / "__init__.py").write_text("VALUE = 41 + 1\n")
    monkeypatch.syspath_prepend(str(src.parent))
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path / "cache"))
    monkeypatch.delenv(bytecode.SWITCH, raising=False)
    monkeypatch.delenv(PREFIX, raising=False)
    return name, src


def _compiled_beside(src: Path) -> None:
    import py_compile

    init = src / "__init__.py"
    py_compile.compile(str(init), cfile=str(src / "__pycache__" / f"__init__.{sys.implementation.cache_tag}.pyc"),
                       doraise=True)


def test_no_write_and_no_bytecode_give_the_labs_tree_and_every_other_case_nothing(package, monkeypatch, tmp_path):
    name, src = package
    want = {PREFIX: str(tmp_path / "cache" / "bytecode"), NO_WRITE: None}
    assert bytecode.holds_no_bytecode(name)
    assert bytecode.changes({NO_WRITE: "1"}, package=name) == want
    # controls: each condition alone turned the other way gives nothing
    assert bytecode.changes({}, package=name) == {}
    assert bytecode.changes({NO_WRITE: ""}, package=name) == {}  # Python reads an empty value as unset
    assert bytecode.changes({NO_WRITE: "1", PREFIX: "/their/own"}, package=name) == {}
    monkeypatch.setenv(bytecode.SWITCH, "0")
    assert bytecode.changes({NO_WRITE: "1"}, package=name) == {}
    monkeypatch.delenv(bytecode.SWITCH)
    _compiled_beside(src)
    assert not bytecode.holds_no_bytecode(name)
    assert bytecode.changes({NO_WRITE: "1"}, package=name) == {}
    monkeypatch.setenv(bytecode.SWITCH, "1")  # on wherever writing is forbidden, the package's bytecode or not
    assert bytecode.changes({NO_WRITE: "1"}, package=name) == want
    assert bytecode.changes({}, package=name) == {}
    assert not bytecode.holds_no_bytecode(f"{name}_not_installed")


def test_a_bad_switch_value_is_refused_by_name(package, monkeypatch):
    monkeypatch.setenv(bytecode.SWITCH, "yes")
    with pytest.raises(ValueError, match=r"MOE_LAB_BYTECODE_CACHE='yes': give 0 \(off\) or 1 \(on\)"):
        bytecode.changes({NO_WRITE: "1"}, package=package[0])


def _import_verbosely(name: str, env: dict) -> str:
    """A fresh Python importing `name` with -v: its stderr says which bytecode file each module came from."""
    r = subprocess.run([sys.executable, "-v", "-c", f"import {name}; assert {name}.VALUE == 42"], env=env,
                       capture_output=True, text=True, timeout=60)
    assert r.returncode == 0, r.stderr[-2000:]
    return r.stderr


def test_the_started_processes_write_the_tree_once_and_read_it_after(package, monkeypatch, tmp_path):
    name, src = package
    env = dict(os.environ, PYTHONPATH=str(src.parent), **{NO_WRITE: "1"})
    env.pop(PREFIX, None)
    tree = tmp_path / "cache" / "bytecode"
    # the control: as the environment stands, no process writes bytecode, so each compiles the package again
    for _ in range(2):
        _import_verbosely(name, env)
        assert not (src / "__pycache__").exists() and not tree.exists()
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.delenv(PREFIX, raising=False)
    assert bytecode.use_for_started_processes(package=name) == {PREFIX: str(tree), NO_WRITE: None}
    assert os.environ[PREFIX] == str(tree) and NO_WRITE not in os.environ
    started = dict(os.environ, PYTHONPATH=str(src.parent))
    _import_verbosely(name, started)
    cached = tree / src.relative_to(src.anchor) / f"__init__.{sys.implementation.cache_tag}.pyc"  # no __pycache__ there
    assert cached.is_file()
    assert not (src / "__pycache__").exists()  # the environment's own folders are not written
    second = _import_verbosely(name, started)
    assert f"code object from '{cached}'" in second, second[-2000:]
    assert f"code object from '{cached}'" not in _import_verbosely(name, env)  # without the cache: not read


def test_an_unwritable_cache_is_said_and_changes_nothing(package, monkeypatch, tmp_path, caplog):
    name, _ = package
    blocker = tmp_path / "a_file"
    blocker.write_text("")
    monkeypatch.setenv("MOE_LAB_CACHE", str(blocker / "cache"))
    monkeypatch.setenv(NO_WRITE, "1")
    assert bytecode.use_for_started_processes(package=name) == {}
    assert os.environ[NO_WRITE] == "1" and PREFIX not in os.environ
    assert "no bytecode cache at" in caplog.text and "set MOE_LAB_CACHE to a writable folder" in caplog.text


def test_a_command_gives_the_cache_to_what_it_starts_before_it_starts_anything(package, monkeypatch, tmp_path):
    """`moe-lab timing` on a folder that is not there fails in one line; the environment it would start processes
    with was set first. torch holds its bytecode in this venv, so the switch turns the cache on."""
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.setenv(bytecode.SWITCH, "1")
    code = cli.main(["timing", str(tmp_path / "no_report_here")])
    assert code != 0
    assert os.environ.get(PREFIX) == str(tmp_path / "cache" / "bytecode") and NO_WRITE not in os.environ
    # the control: switched off, the same command leaves the environment alone
    monkeypatch.setenv(NO_WRITE, "1")
    monkeypatch.delenv(PREFIX)
    monkeypatch.setenv(bytecode.SWITCH, "0")
    cli.main(["timing", str(tmp_path / "no_report_here")])
    assert PREFIX not in os.environ and os.environ[NO_WRITE] == "1"


def test_the_module_stays_torch_free():
    code = textwrap.dedent("""
        import sys
        from moe_lab import bytecode
        bytecode.changes({"PYTHONDONTWRITEBYTECODE": "1"})
        assert "torch" not in sys.modules, "torch imported"
    """)
    r = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=60,
                       cwd=Path(__file__).resolve().parents[2])
    assert r.returncode == 0, r.stderr[-2000:]


def test_a_fill_at_set_up_is_read_by_the_first_process_after_it(package, monkeypatch, tmp_path):
    name, src = package
    monkeypatch.delenv(NO_WRITE, raising=False)
    assert bytecode.fill((name,), stdlib=False) is None  # the control: writing is allowed, nothing to do
    monkeypatch.setenv(NO_WRITE, "1")
    filled = bytecode.fill((name,), stdlib=False)
    tree = tmp_path / "cache" / "bytecode"
    assert filled["folder"] == str(tree) and filled["compiled"] == [str(src)] and filled["seconds"] >= 0
    cached = tree / src.relative_to(src.anchor) / f"__init__.{sys.implementation.cache_tag}.pyc"
    assert cached.is_file() and not (src / "__pycache__").exists()
    assert os.environ[NO_WRITE] == "1" and PREFIX not in os.environ  # filling leaves this process's environment
    started = {k: v for k, v in os.environ.items() if k != NO_WRITE}
    first = _import_verbosely(name, dict(started, PYTHONPATH=str(src.parent), **{PREFIX: str(tree)}))
    assert f"code object from '{cached}'" in first, first[-2000:]
