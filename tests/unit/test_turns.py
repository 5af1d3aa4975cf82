"""The engines' turns (controller.turns): with MOE_LAB_ENGINE_TURN named, a process's cases wait while another
process holds the engines, and go on once it lets go — or dies holding them; without it a turn is taken at once.
The holder is a real second process (a kernel is one)."""

from __future__ import annotations

import subprocess
import sys
import textwrap
import time

import pytest

from moe_lab.controller import turns
from moe_lab.experiments import protocol

HOLDER = textwrap.dedent("""
    import os, sys, time
    from pathlib import Path
    from moe_lab.controller import turns
    with turns.engines_turn("holder"):
        Path(sys.argv[1]).write_text("held")
        while not Path(sys.argv[2]).exists():
            time.sleep(0.02)
        time.sleep(float(sys.argv[3]))
""")


def _holder(tmp_path, monkeypatch, hold_s: float):
    lock = tmp_path / "engines.lock"
    monkeypatch.setenv(turns.ENV, str(lock))
    held, go = tmp_path / "held", tmp_path / "go"
    p = subprocess.Popen([sys.executable, "-c", HOLDER, str(held), str(go), str(hold_s)])
    deadline = time.monotonic() + 60
    while not held.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the holder never took the engines"
        time.sleep(0.02)
    return p, go


def test_a_turn_waits_while_another_process_holds_the_engines_and_goes_on_when_it_lets_go(tmp_path, monkeypatch):
    p, go = _holder(tmp_path, monkeypatch, 0.6)
    go.touch()  # the holder keeps the engines 0.6 s more, then lets go
    t0 = time.monotonic()
    with turns.engines_turn() as waited:
        took = time.monotonic() - t0
    p.wait(timeout=30)
    assert took >= 0.4 and waited >= 0.4, (took, waited)
    assert turns.notebooks_at_once() == 2
    # the control: nobody holds the engines now, so the next turn is taken at once
    t0 = time.monotonic()
    with turns.engines_turn() as waited:
        assert time.monotonic() - t0 < 0.3 and waited < 0.3


def test_while_another_process_holds_the_engines_the_wait_calls_waiting(tmp_path, monkeypatch):
    p, go = _holder(tmp_path, monkeypatch, 0.5)
    go.touch()
    calls = []
    with turns.engines_turn(waiting=lambda: calls.append(time.monotonic())):
        pass
    p.wait(timeout=30)
    assert len(calls) >= 3  # every POLL_S of the wait
    calls.clear()
    with turns.engines_turn(waiting=lambda: calls.append(time.monotonic())):  # the control: nobody holds them
        pass
    assert calls == []


def test_a_holder_that_dies_holding_the_engines_blocks_nobody(tmp_path, monkeypatch):
    p, _ = _holder(tmp_path, monkeypatch, 0.0)
    p.kill()  # killed mid-turn, as a kernel ended by Ctrl-C or the OOM killer
    p.wait(timeout=30)
    t0 = time.monotonic()
    with turns.engines_turn():
        assert time.monotonic() - t0 < 1.0


def test_a_turn_is_reentrant_and_without_the_variable_taken_at_once(tmp_path, monkeypatch):
    monkeypatch.setenv(turns.ENV, str(tmp_path / "engines.lock"))
    with turns.engines_turn():
        with turns.engines_turn() as inner:  # a second flock of the same file by this process would wait forever
            assert inner == 0.0
    monkeypatch.delenv(turns.ENV)
    assert turns.notebooks_at_once() == 1
    with turns.engines_turn() as waited:
        assert waited == 0.0


WHOLE_HOLDER = textwrap.dedent("""
    import sys, time
    from pathlib import Path
    from moe_lab.controller import turns
    for case in range(2):  # two cases of one notebook, each through its own turn block
        with turns.engines_turn("whole holder"):
            pass
    Path(sys.argv[1]).write_text("cases done")
    time.sleep(float(sys.argv[2]))  # its figures and pages: no turn block, the process still running
""")


@pytest.mark.parametrize("whole", [True, False])
def test_a_whole_notebook_turn_is_kept_until_the_process_exits(tmp_path, monkeypatch, whole):
    """With MOE_LAB_ENGINE_TURN_WHOLE=1 a process that took the engines keeps them after its turn blocks end (its
    second block re-enters the turn it holds), until it exits; the control, without it, lets go after each block."""
    import os

    monkeypatch.setenv(turns.ENV, str(tmp_path / "engines.lock"))
    monkeypatch.delenv(turns.WHOLE_ENV, raising=False)  # this process waits as any kernel does
    env = dict(os.environ, **({turns.WHOLE_ENV: "1"} if whole else {}))
    done = tmp_path / "done"
    p = subprocess.Popen([sys.executable, "-c", WHOLE_HOLDER, str(done), "1.0"], env=env)
    deadline = time.monotonic() + 60
    while not done.exists():
        assert p.poll() is None and time.monotonic() < deadline, "the holder never ran its cases"
        time.sleep(0.02)
    t0 = time.monotonic()
    with turns.engines_turn() as waited:
        took = time.monotonic() - t0
        still_running = p.poll() is None
    p.wait(timeout=30)
    assert p.returncode == 0
    if whole:
        assert took >= 0.5 and waited >= 0.5 and not still_running, (took, waited)
    else:
        assert took < 0.5 and still_running, took


def test_a_turn_file_that_cannot_be_opened_is_said_with_the_variable_and_what_to_do(tmp_path, monkeypatch):
    monkeypatch.setenv(turns.ENV, str(tmp_path / "missing" / "engines.lock"))
    with pytest.raises(OSError, match=rf"the engines' turn file \({turns.ENV}\) cannot be opened: .*unset {turns.ENV}"):
        with turns.engines_turn():
            pass


def test_protocol_run_takes_the_engines_turn_for_its_cases(tmp_path, monkeypatch):
    """The control for the protocol: a holder in another process keeps protocol.run from starting its cases (its
    experiment's first engine call would come while the other process holds the engines)."""
    p, go = _holder(tmp_path, monkeypatch, 0.0)
    started = []

    class Planned(Exception):
        pass

    def run_groups(*a, **k):  # the first thing protocol.run does inside its turn
        started.append(time.monotonic())
        raise Planned

    monkeypatch.setattr(protocol, "_plan", lambda *a, **k: ([], {}, 0))  # planned before the turn: no engine call
    monkeypatch.setattr(protocol, "_run_groups", run_groups)
    import threading

    t = threading.Timer(0.5, go.touch)
    t.start()
    t0 = time.monotonic()
    with pytest.raises(Planned):
        protocol.run(type("E", (), {"NAME": "x", "cases": staticmethod(lambda c: [])}), None, cases=[],
                     cluster=type("C", (), {"config": None})())
    t.join()
    p.wait(timeout=30)
    assert started and started[0] - t0 >= 0.4, "protocol.run ran its cases while another process held the engines"
