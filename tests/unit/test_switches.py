"""The on/off environment switches: unset, 0 or 1 each; another value is refused by name, with what the switch does,
by the code that reads it and by the CLI before anything starts."""

from __future__ import annotations

import importlib

import pytest

from moe_lab import switches
from moe_lab.config import ClusterConfig
from moe_lab.controller import preloaded, spares

cli = importlib.import_module("moe_lab.cli.main")


def test_a_switch_takes_unset_0_or_1_and_refuses_anything_else_by_name(monkeypatch):
    for name in switches.SWITCHES:
        for value, want in (("", None), ("0", False), ("1", True), (" 1 ", True)):
            monkeypatch.setenv(name, value)
            assert switches.forced(name) is want
            switches.check()
        monkeypatch.setenv(name, "yes")
        with pytest.raises(ValueError, match=rf"{name}='yes': give 0 \(off\) or 1 \(on\), or leave it unset; "
                                             r"it switches: \w"):
            switches.check()
        monkeypatch.delenv(name)


def test_the_readers_refuse_a_bad_value_and_follow_a_good_one(monkeypatch):
    cfg = ClusterConfig(device="cpu", engines=2)
    monkeypatch.setenv("MOE_LAB_PRELOAD", "0")
    assert preloaded.wanted(cfg) is False
    monkeypatch.setenv("MOE_LAB_PRELOAD", "on")
    with pytest.raises(ValueError, match="MOE_LAB_PRELOAD='on'"):
        preloaded.wanted(cfg)
    monkeypatch.setenv("MOE_LAB_PRESTART", "1")
    assert spares.prestart_wanted(cfg) is True
    monkeypatch.setenv("MOE_LAB_PRESTART", "2")
    with pytest.raises(ValueError, match="MOE_LAB_PRESTART='2'"):
        spares.prestart_wanted(cfg)


def test_the_cli_refuses_a_bad_switch_before_it_starts_anything(monkeypatch, capsys):
    monkeypatch.setenv("MOE_LAB_PRELOAD", "true")
    started = []
    monkeypatch.setattr(cli, "cmd_probe", lambda a: started.append(a) or 0)
    assert cli.main(["probe", "--device", "cpu", "--engines", "2"]) == cli.EXIT_INPUT
    err = capsys.readouterr().err
    assert "moe-lab probe: error: MOE_LAB_PRELOAD='true': give 0 (off) or 1 (on)" in err and not started
    monkeypatch.setenv("MOE_LAB_PRELOAD", "0")  # the control: a good value reaches the command
    assert cli.main(["probe", "--device", "cpu", "--engines", "2"]) == 0 and len(started) == 1
