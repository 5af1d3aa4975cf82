"""Fixtures of the unit tests that more than one file uses."""

import pytest

from moe_lab.tools import versions


@pytest.fixture
def no_subprocess(monkeypatch):
    """Any subprocess (pip, the import check) fails the test; the calls tried are returned."""
    calls = []

    def boom(*a, **k):
        calls.append(a)
        raise AssertionError(f"a subprocess ran: {a!r}")

    monkeypatch.setattr(versions.subprocess, "run", boom)
    monkeypatch.setattr(versions.subprocess, "Popen", boom)
    return calls
