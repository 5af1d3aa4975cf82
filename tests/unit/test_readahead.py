"""Reading the engines' libraries ahead, and the on/off switches (its own among them): when it runs, that it reads every
file skipped, not fatal), the files it picks, and that a command's flags choose its device."""

from __future__ import annotations

import sys
from argparse import Namespace

import pytest

import importlib
from moe_lab.controller import readahead

cli = importlib.import_module("moe_lab.cli.main")


@pytest.mark.parametrize("env,device,gpu_node,expected", [
    ("", "cuda", False, True), ("", "cpu", True, False), ("", None, True, True), ("", None, False, False),
    ("", "auto", True, True), ("0", "cuda", True, False), ("1", "cpu", False, True)])
def test_it_runs_where_the_engines_use_gpus_or_where_asked(monkeypatch, env, device, gpu_node, expected):
    monkeypatch.setenv(readahead.READAHEAD_ENV, env)
    monkeypatch.setattr(readahead.os.path, "exists", lambda p: gpu_node and p == "/dev/nvidiactl")
    assert readahead.wanted(device) is expected


def test_it_reads_every_byte_once_and_skips_what_it_cannot_read(tmp_path):
    files = []
    for i, size in enumerate((0, 1, 3 * readahead.CHUNK // 2, 12345)):
        p = tmp_path / f"lib{i}.so"
        p.write_bytes(b"x" * size)
        files.append(p)
    r = readahead.Readahead(files + [tmp_path / "gone.so"], threads=3)
    assert r.done.wait(30)
    assert r.bytes == sum(p.stat().st_size for p in files) and r.seconds > 0
    empty = readahead.Readahead([])
    assert empty.done.is_set() and empty.bytes == 0


def test_it_picks_a_packages_shared_libraries_smallest_first_up_to_its_cap(tmp_path, monkeypatch):
    pkg = tmp_path / "fakepkg_ra"
    (pkg / "lib").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    for name, size in (("big.so.1", 300), ("small.so", 10), ("mid.so", 100), ("notes.txt", 5)):
        (pkg / "lib" / name).write_bytes(b"x" * size)
    monkeypatch.syspath_prepend(str(tmp_path))
    sys.modules.pop("fakepkg_ra", None)
    got = readahead.library_files(("fakepkg_ra", "no_such_package_ra"))
    assert [p.name for p in got] == ["small.so", "mid.so", "big.so.1"]  # text files and missing packages left out
    monkeypatch.setattr(readahead, "MAX_BYTES", 150)
    assert [p.name for p in readahead.library_files(("fakepkg_ra",))] == ["small.so", "mid.so"]


def test_a_commands_flags_choose_its_engines_device():
    assert cli._engine_device(Namespace(cmd="run", profile="gpu")) == "cuda"
    assert cli._engine_device(Namespace(cmd="run", profile="cpu")) == "cpu"
    assert cli._engine_device(Namespace(cmd="run", profile=None)) is None  # a GPU if one is visible
    assert cli._engine_device(Namespace(cmd="run", profile="/x/p.json")) is None
    assert cli._engine_device(Namespace(cmd="probe", device="cpu")) == "cpu"
    assert set(cli.ENGINE_COMMANDS) >= {"probe", "run", "bench"}


def test_a_switch_set_to_another_value_is_refused_by_name(monkeypatch):
    """Every on/off switch takes unset, 0 or 1: another value is refused with the switch's name and what it does,
    by the reader and by the CLI before anything starts (exit 2, one line); 0, 1 and unset pass (the control)."""
    from moe_lab import switches

    for name in switches.SWITCHES:
        for ok, want in (("", None), ("0", False), ("1", True), (" 1 ", True)):
            monkeypatch.setenv(name, ok)
            assert switches.forced(name) is want
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=rf"{name}='yes': give 0 \(off\) or 1 \(on\), or leave it unset; "
                                             rf"it switches: "):
            switches.check()
        monkeypatch.delenv(name)
    monkeypatch.setenv(readahead.READAHEAD_ENV, "on")
    with pytest.raises(ValueError, match="MOE_LAB_READAHEAD='on'"):
        readahead.wanted("cuda")


def test_the_cli_refuses_a_bad_switch_before_it_starts_anything(monkeypatch, capsys):
    monkeypatch.setenv("MOE_LAB_PRELOAD", "true")
    started = []
    monkeypatch.setattr(readahead, "start", lambda device: started.append(device))
    assert cli.main(["probe", "--device", "cpu", "--engines", "2"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "moe-lab probe: error: MOE_LAB_PRELOAD='true': give 0 (off) or 1 (on)" in err and not started
