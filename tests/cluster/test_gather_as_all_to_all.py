"""Large all-gathers sent through gloo as one all-to-all (`engine.shims._gather_as_all_to_all`), on real engines: the
same bytes in the same places as gloo's own all-gather, megatron's bound gather replaced, and a real MoE forward
bitwise the same with the shim and without it."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles

pytestmark = pytest.mark.cluster

P = profiles.load("cpu")


@ipp.interactive
def _gathers(numel):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from moe_lab.engine import shims

    rank, world = dist.get_rank(), dist.get_world_size()
    patched = dist.all_gather_into_tensor
    own = patched.__wrapped__  # gloo's all-gather
    g = torch.Generator().manual_seed(rank)
    x = torch.randn(numel, generator=g).to(torch.bfloat16)
    a = torch.empty(numel * world, dtype=torch.bfloat16)
    b = torch.empty_like(a)
    calls = []
    a2a = dist.all_to_all_single
    dist.all_to_all_single = lambda *args, **kw: (calls.append(1), a2a(*args, **kw))[1]  # only counts later wrappers
    before = shims._APPLIED["all_gather_as_all_to_all"]
    try:
        patched(a, x)
    finally:
        dist.all_to_all_single = a2a
    own(b, x)
    swapped = b.view(world, -1)[[1, 0] + list(range(2, world))].reshape(-1)  # the control: ranks 0 and 1 swapped
    return {"equal": bool(torch.equal(a, b)), "control_equal": bool(torch.equal(a, swapped)),
            "bound": mappings.dist_all_gather_func is patched, "applied": "all_gather_as_all_to_all" in shims.applied(),
            "later_wrapper_called": len(calls), "as_a2a": shims._APPLIED["all_gather_as_all_to_all"] - before}


@pytest.mark.parametrize("numel", [1 << 20, 1 << 10])  # 2 MiB a rank: the all-to-all; 2 KiB: gloo's own
def test_a_gather_through_the_all_to_all_puts_every_byte_where_gloos_all_gather_does(cpu_cluster, numel):
    for r in cpu_cluster.run(_gathers, numel):
        assert r["equal"] and not r["control_equal"]
        assert r["bound"] and r["applied"] and r["later_wrapper_called"] == 0
        assert r["as_a2a"] == (1 if numel >= 1 << 19 else 0)


@ipp.interactive
def _forward_both_ways(cfg_dict):
    import torch

    from moe_lab.engine import shims, toolkit

    s = toolkit.setup(cfg_dict)
    n0 = shims._APPLIED["all_gather_as_all_to_all"]
    with_shim = toolkit.forward(s.layer, s.tokens)
    n1 = shims._APPLIED["all_gather_as_all_to_all"]
    threshold = shims.GATHER_AS_ALL_TO_ALL_BYTES
    shims.GATHER_AS_ALL_TO_ALL_BYTES = 1 << 62
    try:
        without = toolkit.forward(s.layer, s.tokens)
        n2 = shims._APPLIED["all_gather_as_all_to_all"]
    finally:
        shims.GATHER_AS_ALL_TO_ALL_BYTES = threshold
    from moe_lab.engine import dist

    dist.release_caches()
    hidden_bytes = s.tokens.numel() * s.tokens.element_size()
    return {"equal": bool(torch.equal(with_shim, without)), "hidden_bytes": hidden_bytes, "with": n1 - n0,
            "without": n2 - n1}


def test_a_forward_that_gathers_megabytes_is_bitwise_the_same_with_and_without_the_all_to_all(cpu_cluster):
    cfg = P.layer.replace(seq_len=2048, dispatcher="allgather")  # 2048 x 256 bf16: 1 MiB of hidden states a rank
    per_rank = cpu_cluster.run(_forward_both_ways, cfg.asdict())
    assert all(r["equal"] for r in per_rank)
    assert per_rank[0]["hidden_bytes"] >= 1 << 20
    assert all(r["with"] >= 1 and r["without"] == 0 for r in per_rank)  # the tokens' gather took the all-to-all
