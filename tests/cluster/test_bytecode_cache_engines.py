"""Engines started where the environment forbids writing bytecode and the lab's bytecode cache applies (forced on
here: this venv's torch holds its bytecode) import torch from the lab's own bytecode tree, which their imports wrote."""

import sys
from pathlib import Path

import pytest

from moe_lab import bytecode
from moe_lab.config import ClusterConfig
from moe_lab.controller.cluster import Cluster

pytestmark = pytest.mark.cluster


def test_engines_write_and_use_the_labs_bytecode_tree(monkeypatch, tmp_path):
    monkeypatch.setenv("MOE_LAB_CACHE", str(tmp_path))
    monkeypatch.setenv(bytecode.NO_WRITE_ENV, "1")
    monkeypatch.setenv(bytecode.SWITCH, "1")
    monkeypatch.delenv(bytecode.PREFIX_ENV, raising=False)
    tree = tmp_path / "bytecode"
    with Cluster(ClusterConfig(device="cpu", engines=1, timeout_s=180)) as c:
        prefixes = c.run(eval, "__import__('sys').pycache_prefix")
        no_write = c.run(eval, "__import__('sys').flags.dont_write_bytecode")
        torch_cached = c.run(eval, "__import__('torch').__cached__")
    assert prefixes == [str(tree)] and no_write == [0]
    assert all(Path(p).is_file() and Path(p).is_relative_to(tree) for p in torch_cached), torch_cached
    megatron = list(tree.rglob(f"megatron/core/parallel_state.{sys.implementation.cache_tag}.pyc"))
    assert megatron, "megatron-core's bytecode was not written to the tree"
    # the control: this (the test's) process was started without the cache and reads torch's own bytecode
    import torch

    assert not Path(torch.__cached__).is_relative_to(tree)
