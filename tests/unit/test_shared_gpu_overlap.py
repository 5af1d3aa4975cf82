"""Two notebooks at a time on a GPU that a run's ranks share only where it has the memory (`reporting.runner`):
the decision from the shared cluster's engines, the override, and the index's words."""

from types import SimpleNamespace

import pytest

from moe_lab.controller import turns
from moe_lab.reporting import runner


def _cluster(gib, ranks_per_gpu=4, engines=4):
    info = [{"rank": r, "gpu_memory_bytes": None if gib is None else int(gib * 2**30)} for r in range(engines)]
    return SimpleNamespace(info=info, state=SimpleNamespace(config=SimpleNamespace(ranks_per_gpu=ranks_per_gpu)))


def _config(device="cuda"):
    return SimpleNamespace(cluster=SimpleNamespace(device=device))


@pytest.mark.parametrize("gib, expected", [(79.2, 1), (139.8, turns.AT_ONCE)])
def test_a_shared_gpu_under_the_bound_runs_one_notebook_at_a_time_and_a_larger_one_two(monkeypatch, gib, expected):
    monkeypatch.delenv(runner.OVERLAP_ENV, raising=False)
    shared = runner._shared_gpu_gib(_cluster(gib), _config())
    assert shared == pytest.approx(gib)
    assert runner.notebooks_at_once(9, shared) == expected


def test_controls_one_rank_per_gpu_cpu_engines_and_an_unread_size_keep_two_at_a_time(monkeypatch):
    monkeypatch.delenv(runner.OVERLAP_ENV, raising=False)
    assert runner._shared_gpu_gib(_cluster(79.2, ranks_per_gpu=1), _config()) is None  # NCCL: a GPU of its own
    assert runner._shared_gpu_gib(_cluster(79.2), _config("cpu")) is None
    assert runner._shared_gpu_gib(_cluster(None), _config()) is None
    assert runner._shared_gpu_gib(None, _config()) is None
    assert runner.notebooks_at_once(9, None) == turns.AT_ONCE
    assert runner.notebooks_at_once(1, 139.8) == 1


def test_the_overlap_switch_decides_over_the_memory_bound(monkeypatch):
    monkeypatch.setenv(runner.OVERLAP_ENV, "1")
    assert runner.notebooks_at_once(9, 79.2) == turns.AT_ONCE
    monkeypatch.setenv(runner.OVERLAP_ENV, "0")
    assert runner.notebooks_at_once(9, 139.8) == 1


def test_the_index_says_why_notebooks_ran_one_at_a_time():
    words = "the 79 GiB GPU the ranks share is under 100 GiB"
    page = runner._profile_and_sizing_notes({"one_at_a_time": words, "notebooks_at_once": 1})
    assert "One notebook at a time:" in page and words in page and "Two notebooks at a time" not in page
    control = runner._profile_and_sizing_notes({"notebooks_at_once": 2})
    assert "One notebook at a time" not in control and "Two notebooks at a time" in control
