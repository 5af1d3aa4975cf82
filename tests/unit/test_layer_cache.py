"""The engines' layer cache on a GPU: the layers it keeps and the one being built fit in a share of the rank's part
of the GPU, so measuring a layout's cases together (two dispatchers' EP 1 seed layers, 17 GB a rank each, on four
ranks sharing one H200) never holds two layers that together do not fit. Runs the real `get_layer` with the build
and the GPU replaced: no GPU, no megatron."""

import pytest
import torch

from moe_lab.config import MoEConfig
from moe_lab.engine import layer
from moe_lab.layout import Layout

GB = 2**30


def test_evictions_drop_the_least_recently_used_until_the_new_layer_fits():
    cached = {"a": 17 * GB, "b": 4 * GB, "c": 4 * GB}
    assert layer.evictions(cached, 17 * GB, 35 * GB) == ["a"]
    assert layer.evictions(cached, 4 * GB, 35 * GB) == []
    assert layer.evictions(cached, 30 * GB, 35 * GB) == ["a", "b"]
    assert layer.evictions(cached, 40 * GB, 35 * GB) == ["a", "b", "c"]  # too big even alone: all go, it is built
    assert layer.evictions({}, 17 * GB, 35 * GB) == []


class FakeLayer(torch.nn.Module):
    def __init__(self, n):
        super().__init__()
        self.w = torch.nn.Parameter(torch.empty(n, dtype=torch.bfloat16, device="meta"))


@pytest.mark.parametrize("share_gb, kept", [(35, 1), (80, 2)])
def test_two_dispatchers_layers_of_one_layout_are_kept_only_where_both_fit(monkeypatch, share_gb, kept):
    """Two layers of one shape and layout (allgather, then alltoall), 17 GB a rank each: a 35 GB share keeps one
    (the first is dropped before the second is built); an 80 GB share keeps both (the control)."""
    built = []

    def build(cfg, lay):
        built.append(cfg.dispatcher)
        return FakeLayer(17 * GB // 2), 1

    lay = Layout(ep=1)
    monkeypatch.setitem(layer.STATE, "device", "cuda")
    monkeypatch.setitem(layer.STATE, "layers", {})
    monkeypatch.setattr(layer, "parallel_state_for", lambda layout: lay)
    monkeypatch.setattr(layer, "build", build)
    monkeypatch.setattr(layer, "gpu_share_bytes", lambda: share_gb * GB)
    monkeypatch.setattr(torch.cuda, "empty_cache", lambda: None)
    cfg = MoEConfig()
    first = layer.get_layer(cfg, lay)
    second = layer.get_layer(cfg.replace(dispatcher="alltoall"), lay)
    assert built == ["allgather", "alltoall"] and first is not second
    assert len(layer.STATE["layers"]) == kept
    assert list(layer.STATE["layers"].values())[-1] is second
    other = layer.get_layer(cfg.replace(hidden=cfg.hidden * 2), lay)  # another shape: no estimate, nothing dropped
    assert len(layer.STATE["layers"]) == min(kept + 1, layer.MAX_LAYERS) and other is not second


def test_release_caches_drops_what_cases_keep_and_nothing_of_the_engine(monkeypatch):
    """What a notebook leaves on engines another run takes next: layers, stacks, 01's layout references and 08's fp64
    truths go; the engine's own state (rank, device, what it prepared) stays."""
    from moe_lab.engine import dist

    state = {"layers": {"k": 1}, "stacks": {"s": 2}, "rank": 0, "device": "cpu", "prepared": True}
    monkeypatch.setattr(dist, "STATE", state)
    dist.case_cache("layout_references")["r"] = 3
    dist.case_cache("oracle_truths")["t"] = 4
    assert dist.case_cache("oracle_truths") == {"t": 4}  # the same cache each time it is asked for
    assert dist.release_caches()
    assert state == {"layers": {}, "stacks": {}, "rank": 0, "device": "cpu", "prepared": True}
