"""Large reduce-scatters sent through gloo as one all-to-all and a local sum
(`engine.shims._reduce_scatter_as_all_to_all`), on real engines: gloo's own bits where the first call's check agreed,
gloo's own path where it did not, megatron's bound reduce-scatter replaced, and a real MoE forward and backward
bitwise the same with the shim and without it."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles

pytestmark = pytest.mark.cluster

P = profiles.load("cpu")


@ipp.interactive
def _reduce_scatters(numel, threshold, wrong_order=False):
    import torch
    import torch.distributed as dist
    from megatron.core.tensor_parallel import mappings

    from moe_lab.engine import shims

    rank, world = dist.get_rank(), dist.get_world_size()
    patched = dist.reduce_scatter_tensor
    own = patched.__wrapped__  # gloo's reduce-scatter
    g = torch.Generator().manual_seed(rank)
    # magnitudes spread over many binades: a sum in another order rounds differently
    x = (torch.randn(numel * world, generator=g) * torch.exp(3 * torch.randn(numel * world, generator=g))).bfloat16()
    calls = []
    a2a, ar = dist.all_to_all_single, dist.all_reduce
    dist.all_to_all_single = lambda *args, **kw: (calls.append(1), a2a(*args, **kw))[1]  # only counts later wrappers
    dist.all_reduce = lambda *args, **kw: (calls.append(1), ar(*args, **kw))[1]
    counts = lambda: {k: shims._APPLIED[k] for k in  # noqa: E731
                      ("reduce_scatter_as_all_to_all", "reduce_scatter_checked", "reduce_scatter_kept_gloo")}
    before = counts()
    saved, shims.GATHER_AS_ALL_TO_ALL_BYTES = shims.GATHER_AS_ALL_TO_ALL_BYTES, threshold
    order = shims._in_gloos_order
    if wrong_order:  # the check's control: a local sum in ascending rank order, which gloo's is not
        shims._in_gloos_order = lambda r, w: list(range(w))
    outs = []
    try:
        for _ in range(2):  # the first call checks the shape, the second takes the verdict
            outs.append(torch.empty(numel, dtype=torch.bfloat16))
            patched(outs[-1], x.clone())
    finally:
        dist.all_to_all_single, dist.all_reduce = a2a, ar
        shims.GATHER_AS_ALL_TO_ALL_BYTES, shims._in_gloos_order = saved, order
    after = counts()
    ref = torch.empty(numel, dtype=torch.bfloat16)
    own(ref, x.clone())
    # the control: the same parts summed in ascending rank order (not gloo's) — the bitwise check must see it
    parts = torch.empty_like(x)
    a2a(parts, x)
    parts = parts.view(world, -1)
    ascending = parts[0] + parts[1]
    for j in range(2, world):
        ascending = ascending + parts[j]
    return {"equal": [bool(torch.equal(o, ref)) for o in outs], "control_equal": bool(torch.equal(ascending, ref)),
            "bound": mappings.dist_reduce_scatter_func is patched, "later_wrapper_called": len(calls),
            **{k: after[k] - before[k] for k in after}}


def test_a_reduce_scatter_through_the_all_to_all_gives_gloos_bits_and_a_wrong_order_does_not(cpu_cluster):
    for r in cpu_cluster.run(_reduce_scatters, 1 << 20, 1 << 20):  # 2 MiB a rank
        assert r["equal"] == [True, True] and not r["control_equal"]
        assert r["bound"] and r["later_wrapper_called"] == 0
        assert (r["reduce_scatter_checked"], r["reduce_scatter_kept_gloo"], r["reduce_scatter_as_all_to_all"]) \
            == (1, 0, 1)


def test_a_shape_whose_check_disagrees_keeps_gloos_own_reduce_scatter(cpu_cluster):
    # the local sum in the wrong order on a new shape: its first call's check fails on every rank that gets a wrong
    # bit, so the shape keeps gloo's path and both calls give gloo's bits
    for r in cpu_cluster.run(_reduce_scatters, (1 << 20) + 2, 1 << 20, True):
        assert r["equal"] == [True, True]
        assert (r["reduce_scatter_checked"], r["reduce_scatter_kept_gloo"], r["reduce_scatter_as_all_to_all"]) \
            == (1, 1, 0)


def test_an_odd_length_keeps_gloos_own_path_unchecked(cpu_cluster):
    # 2^20 + 1 elements a rank: gloo's chunks cut across the parts, so the order read off gloo is not its order
    for r in cpu_cluster.run(_reduce_scatters, (1 << 20) + 1, 1 << 20):
        assert r["equal"] == [True, True]
        assert (r["reduce_scatter_checked"], r["reduce_scatter_as_all_to_all"]) == (0, 0)


def test_a_small_reduce_scatter_takes_gloos_own_path(cpu_cluster):
    for r in cpu_cluster.run(_reduce_scatters, 1 << 10, 1 << 20):
        assert r["equal"] == [True, True]
        assert (r["reduce_scatter_checked"], r["reduce_scatter_as_all_to_all"]) == (0, 0)


@ipp.interactive
def forward_backward(s) -> tuple:
    """One forward + backward of a case's layer on this rank (`toolkit.setup`'s case): its output, the input's
    gradient and the parameters' gradients — what a way of moving the collectives' bytes must leave bitwise the same.
    Handed to the engine functions as an argument (tests/cluster/test_ipc_collectives.py too)."""
    import torch

    from moe_lab.engine import compat

    tokens = s.tokens.detach().clone().requires_grad_(True)
    for p in s.layer.parameters():
        p.grad = None
    with torch.enable_grad():
        out = compat.moe_output(s.layer(tokens))
        out.float().square().sum().backward()
    return out.detach(), tokens.grad.detach(), [p.grad.clone() for p in s.layer.parameters() if p.grad is not None]


@ipp.interactive
def same_bits(a: tuple, b: tuple) -> list[bool]:
    """`forward_backward`'s three results of two runs compared bitwise: output, input gradient, parameter gradients."""
    import torch

    return [torch.equal(a[0], b[0]), torch.equal(a[1], b[1]),
            len(a[2]) == len(b[2]) and all(torch.equal(x, y) for x, y in zip(a[2], b[2]))]


@ipp.interactive
def _forward_backward_both_ways(cfg_dict, forward_backward, same_bits):
    from moe_lab.engine import dist, shims, toolkit

    s = toolkit.setup(cfg_dict)
    n0, kept0 = shims._APPLIED["reduce_scatter_as_all_to_all"], shims._APPLIED["reduce_scatter_kept_gloo"]
    forward_backward(s)  # the first call of each shape checks it against gloo's own
    n1 = shims._APPLIED["reduce_scatter_as_all_to_all"]
    with_shim = forward_backward(s)
    n2 = shims._APPLIED["reduce_scatter_as_all_to_all"]
    threshold = shims.GATHER_AS_ALL_TO_ALL_BYTES
    shims.GATHER_AS_ALL_TO_ALL_BYTES = 1 << 62
    try:
        without = forward_backward(s)
        n3 = shims._APPLIED["reduce_scatter_as_all_to_all"]
    finally:
        shims.GATHER_AS_ALL_TO_ALL_BYTES = threshold
    dist.release_caches()
    return {"same": same_bits(with_shim, without), "kept_gloo": shims._APPLIED["reduce_scatter_kept_gloo"] - kept0,
            "first": n1 - n0, "with": n2 - n1, "without": n3 - n2, "grads": len(with_shim[2])}


def test_a_forward_and_backward_are_bitwise_the_same_with_and_without_the_all_to_all(cpu_cluster, cpu_layer):
    # 2048 x 256 bf16: 1 MiB of combine a rank; the experts' width (not the combine's) cut for a slow bf16 GEMM
    width = cpu_layer.config().layer.ffn_hidden
    cfg = P.layer.replace(seq_len=2048, dispatcher="allgather", ffn_hidden=width)
    per_rank = cpu_cluster.run(_forward_backward_both_ways, cfg.asdict(), forward_backward, same_bits)
    for r in per_rank:
        assert r["same"] == [True, True, True] and r["grads"] > 0
        assert r["kept_gloo"] == 0 and r["with"] >= 1 and r["without"] == 0
