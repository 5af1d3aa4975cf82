"""engine.dist.threads_for: a GPU engine's torch threads are its node's cores split between the engines there (never
below one), so engines that do CPU work at once do not oversubscribe the node."""

import os

import pytest

from moe_lab.engine import dist


@pytest.mark.parametrize("cores, local_world, want", [
    (16, 4, 4), (16, 1, 16), (16, None, 16), (16, 3, 5), (2, 4, 1), (1, 8, 1), (128, 8, 16)])
def test_the_nodes_cores_split_between_its_engines(monkeypatch, cores, local_world, want):
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: set(range(cores)), raising=False)
    assert dist.threads_for(local_world) == want


def test_the_cores_this_process_may_run_on_count_not_the_machines(monkeypatch):
    """Where the process is confined to some cores (a container, taskset), those are what is split."""
    monkeypatch.setattr(os, "sched_getaffinity", lambda pid: {0, 1, 2, 3}, raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 64)
    assert dist.threads_for(2) == 2
