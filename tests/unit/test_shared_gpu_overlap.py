"""Two notebooks' cases taking turns on a GPU that a run's ranks share only where it has the memory; under it each
notebook keeps the engines' turn until it ends (`reporting.runner`): the decision from the shared cluster's engines,
the override, the kernels' environment, and the index's words."""

import os
from types import SimpleNamespace

import pytest

from moe_lab.controller import turns
from moe_lab.reporting import runner


def _cluster(gib, ranks_per_gpu=4, engines=4):
    info = [{"rank": r, "gpu_memory_bytes": None if gib is None else int(gib * 2**30)} for r in range(engines)]
    return SimpleNamespace(info=info, state=SimpleNamespace(config=SimpleNamespace(ranks_per_gpu=ranks_per_gpu)))


def _config(device="cuda"):
    return SimpleNamespace(cluster=SimpleNamespace(device=device))


@pytest.mark.parametrize("gib, whole", [(79.2, True), (139.8, False)])
def test_a_shared_gpu_under_the_bound_gives_whole_notebook_turns_and_a_larger_one_case_turns(monkeypatch, gib, whole):
    monkeypatch.delenv(runner.OVERLAP_ENV, raising=False)
    shared = runner._shared_gpu_gib(_cluster(gib), _config())
    assert shared == pytest.approx(gib)
    assert runner.notebooks_at_once(9) == turns.AT_ONCE  # two kernels either way: the next one starts
    assert runner.whole_notebook_turns(shared) is whole


def test_controls_one_rank_per_gpu_cpu_engines_and_an_unread_size_keep_case_turns(monkeypatch):
    monkeypatch.delenv(runner.OVERLAP_ENV, raising=False)
    assert runner._shared_gpu_gib(_cluster(79.2, ranks_per_gpu=1), _config()) is None  # NCCL: a GPU of its own
    assert runner._shared_gpu_gib(_cluster(79.2), _config("cpu")) is None
    assert runner._shared_gpu_gib(_cluster(None), _config()) is None
    assert runner._shared_gpu_gib(None, _config()) is None
    assert runner.notebooks_at_once(9) == turns.AT_ONCE and runner.whole_notebook_turns(None) is False
    assert runner.notebooks_at_once(1) == 1


def test_the_overlap_switch_decides_over_the_memory_bound(monkeypatch):
    monkeypatch.setenv(runner.OVERLAP_ENV, "1")
    assert runner.notebooks_at_once(9) == turns.AT_ONCE and runner.whole_notebook_turns(79.2) is False
    monkeypatch.setenv(runner.OVERLAP_ENV, "0")
    assert runner.notebooks_at_once(9) == 1 and runner.whole_notebook_turns(79.2) is False


@pytest.mark.parametrize("whole", [True, False])
def test_the_kernels_get_the_turn_file_and_whole_turns_only_when_asked(monkeypatch, tmp_path, whole):
    monkeypatch.delenv(turns.ENV, raising=False)
    monkeypatch.delenv(turns.WHOLE_ENV, raising=False)
    with runner.engine_turns(tmp_path, turns.AT_ONCE, whole=whole):
        assert os.environ[turns.ENV] == str(tmp_path / runner.TURN_FILE)
        assert turns.whole() is whole
    assert turns.ENV not in os.environ and turns.WHOLE_ENV not in os.environ
    with runner.engine_turns(tmp_path, 1, whole=True):  # one notebook at a time: no turns at all
        assert turns.ENV not in os.environ and not turns.whole()


def test_the_index_says_why_a_notebooks_cases_waited_for_the_one_before_it():
    words = "the 79 GiB GPU the ranks share is under 100 GiB"
    page = runner._profile_and_sizing_notes({"whole_notebook_turns": words, "notebooks_at_once": 2})
    assert "One notebook's cases at a time:" in page and words in page and "Two notebooks at a time" not in page
    control = runner._profile_and_sizing_notes({"notebooks_at_once": 2})
    assert "One notebook's cases at a time" not in control and "Two notebooks at a time" in control
