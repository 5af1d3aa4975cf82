"""controller.ports: a controller's ports come from below the OS's ephemeral range (which no bind to port 0 and no
outgoing connection takes), skip any port something holds, and are never handed to two controllers at once on one
machine (a locked registry, read by every moe-lab process)."""

import socket
import subprocess
import sys

import pytest

from moe_lab.controller import ports


@pytest.fixture
def registry(tmp_path, monkeypatch):
    path = tmp_path / "ports.json"
    monkeypatch.setattr(ports, "registry_path", lambda: path)
    return path


def test_ports_are_distinct_free_and_below_the_ephemeral_range(registry):
    low = int(ports.EPHEMERAL.read_text().split()[0])
    got = ports.reserve(24)
    assert len(got) == len(set(got)) == 24
    assert all(ports.LOWEST <= p < low for p in got)
    for p in got:  # each can be bound now
        with socket.socket() as s:
            s.bind(("", p))


def test_two_controllers_never_get_the_same_port_even_from_two_processes(registry):
    first = ports.reserve(24)
    code = ("import sys; from pathlib import Path; from moe_lab.controller import ports; "
            "ports.registry_path = lambda: Path(sys.argv[1]); print(ports.reserve(24))")
    out = subprocess.run([sys.executable, "-c", code, str(registry)], capture_output=True, text=True, timeout=60)
    second = eval(out.stdout)  # noqa: S307 - a list of ints this test's child printed
    assert len(second) == 24 and not set(first) & set(second)


def test_a_held_port_is_skipped(registry, monkeypatch):
    """The control: the port the choice meets first is held by a listening socket, so it is not handed out."""
    low = ports.LOWEST
    monkeypatch.setattr(ports, "candidate_range", lambda: (low, low + 5000))
    target = low + 7
    held = socket.socket()
    held.bind(("", target))
    held.listen()
    picks = iter([target, target, low + 1, low + 2])
    monkeypatch.setattr(ports.random, "randint", lambda a, b: next(picks))
    try:
        assert ports.reserve(2) == [low + 1, low + 2]
    finally:
        held.close()


def test_handed_out_ports_come_back_after_the_hold(registry, monkeypatch):
    low = ports.LOWEST
    monkeypatch.setattr(ports, "candidate_range", lambda: (low, low + 3))
    first = ports.reserve(4, now=1000.0)
    assert sorted(first) == [low, low + 1, low + 2, low + 3]
    assert ports.reserve(1, now=1000.0 + ports.HOLD_S - 1) is None  # every one still held: ipyparallel's own choice
    assert ports.reserve(1, now=1000.0 + ports.HOLD_S + 1)[0] in first


def test_without_a_range_below_the_ephemeral_one_ipyparallel_picks(registry, monkeypatch, tmp_path):
    f = tmp_path / "range"
    f.write_text("1024\t65535\n")
    monkeypatch.setattr(ports, "EPHEMERAL", f)
    assert ports.candidate_range() is None and ports.reserve() is None
    f.write_text("32768\t60999\n")
    assert ports.candidate_range() == (ports.LOWEST, 32767)


def test_an_unwritable_registry_leaves_the_choice_to_ipyparallel(tmp_path, monkeypatch):
    monkeypatch.setattr(ports, "registry_path", lambda: tmp_path / "no-such-dir" / "ports.json")
    assert ports.reserve() is None


def test_the_registry_is_the_machines_whatever_tmpdir_says(tmp_path, monkeypatch):
    import tempfile

    monkeypatch.setattr(tempfile, "tempdir", str(tmp_path))  # a job's or a test's own temp folder
    assert ports.registry_path().parent == __import__("pathlib").Path("/tmp")
