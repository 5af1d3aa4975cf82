"""All-to-alls through buffers the ranks share (`engine.ipc_collectives`), on real engines: CPU engines with the
switch on (shared memory; CUDA IPC is the same code with another buffer, tests/gpu). gloo's bytes for every dtype,
uneven and empty parts, buffers that grow and a group of two; a first-call check that can fail (its control); split
sizes that disagree refused by name; and a real MoE forward and backward bitwise the same with them and without."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles
from tests.cluster.test_reduce_scatter_as_all_to_all import forward_backward, same_bits

pytestmark = pytest.mark.cluster

P = profiles.load("cpu")

# (seed, dtype, most rows a rank sends another, row width): the third is larger than the first two (the buffers grow),
# the fourth smaller again; seed 0 has equal parts (no split sizes)
CASES = [(0, "bfloat16", 16, 64), (1, "bfloat16", 40, 64), (2, "bfloat16", 900, 96), (3, "bfloat16", 8, 64),
         (4, "float32", 30, 48), (5, "float32", 700, 64), (6, "float64", 50, 32), (7, "int64", 20, 16),
         (8, "float64", 60, 32)]


@ipp.interactive
def _all_to_alls(cases, wrong_source=False, pair=False):
    """Each case's all-to-all through the shims (so through the shared buffers) and through gloo's own, compared
    bitwise; STATS' changes. `wrong_source`: every rank reads rank j ^ 1's part for rank j's (the check's control);
    `pair`: on a group of ranks 0 and 1 (made on every rank, used by those two)."""
    import os

    import torch
    import torch.distributed as dist

    from moe_lab.engine import ipc_collectives as ipc
    from moe_lab.engine.dist import STATE

    dev, rank = STATE["torch_device"], dist.get_rank()
    a2a = dist.all_to_all_single  # the gloo shims' (lists for split sizes; the shared buffers when installed)
    gloo = a2a.__wrapped__
    group = dist.new_group([0, 1]) if pair else None
    if pair and rank > 1:
        return {"skipped": True}
    world, me = dist.get_world_size(group), dist.get_rank(group)
    switch, was = os.environ.get(ipc.SWITCH), ipc.describe()
    os.environ[ipc.SWITCH] = "1"
    ipc.uninstall()
    assert ipc.install(dev.type)
    plan = ipc.plan
    if wrong_source:
        ipc.plan = lambda sends, me_: [(j ^ 1, off, n) for j, off, n in plan(sends, me_)]
    before = dict(ipc.STATS)
    equal, dtypes = [], []
    try:
        for seed, dtype_name, most, width in cases:
            dtype = getattr(torch, dtype_name)
            rows = torch.randint(0, most + 1, (world, world), generator=torch.Generator().manual_seed(seed))
            if seed == 0 or wrong_source:
                rows[:] = most  # equal parts: the same offsets in every rank's buffer
            g = torch.Generator().manual_seed(1000 * seed + rank)
            x = torch.randn(int(rows[me].sum()), width, generator=g) * 1e3
            x = (x.to(torch.int64) if dtype == torch.int64 else x.to(dtype)).to(dev)
            if x.is_floating_point() and x.numel():
                x.view(-1)[0] = float("nan")  # NaNs travel as any other bytes (and the check compares bytes)
            out_s, in_s = rows[:, me].tolist(), rows[me].tolist()
            out = torch.full((sum(out_s), width), 7, dtype=dtype, device=dev)
            if seed == 0:
                a2a(out, x, group=group)
            else:
                a2a(out, x, out_s, in_s, group=group)
            ref = torch.empty_like(out)
            gloo(ref, x, out_s, in_s, group=group)
            equal.append(bool(torch.equal(out.view(-1).view(torch.uint8), ref.view(-1).view(torch.uint8))))
            dtypes.append(dtype_name)
    finally:
        ipc.plan = plan
        ipc.uninstall()
        os.environ.pop(ipc.SWITCH) if switch is None else os.environ.update({ipc.SWITCH: switch})
        if was is not None:
            ipc.install(dev.type)
    return {"equal": equal, "dtypes": len(set(dtypes)),
            **{k: ipc.STATS[k] - before[k] for k in ("ipc_all_to_all", "ipc_checked", "ipc_kept_gloo")}}


def test_all_to_alls_through_shared_buffers_give_gloos_bytes(cpu_cluster):
    for r in cpu_cluster.run(_all_to_alls, CASES):
        assert r["equal"] == [True] * len(CASES)
        # each dtype's first call is checked against gloo's (and returns gloo's bytes); every later one is shared
        assert (r["ipc_checked"], r["ipc_kept_gloo"]) == (r["dtypes"], 0) == (4, 0)
        assert r["ipc_all_to_all"] == len(CASES) - r["dtypes"]


def test_a_wrong_source_fails_the_first_calls_check_and_the_group_keeps_gloo(cpu_cluster):
    # the control: parts read from the wrong rank's buffer. The first call's check sees it on every rank, the dtype
    # keeps gloo's path, and every call still gives gloo's bytes
    for r in cpu_cluster.run(_all_to_alls, CASES[:3], True):
        assert r["equal"] == [True] * 3
        assert (r["ipc_checked"], r["ipc_kept_gloo"], r["ipc_all_to_all"]) == (1, 1, 0)


def test_a_group_of_two_shares_its_own_buffers(cpu_cluster):
    per_rank = cpu_cluster.run(_all_to_alls, CASES[:4], False, True)
    assert [r.get("skipped", False) for r in per_rank] == [False, False, True, True]
    for r in per_rank[:2]:
        assert r["equal"] == [True] * 4 and (r["ipc_checked"], r["ipc_all_to_all"]) == (1, 3)


@ipp.interactive
def _no_room_on_one_rank():
    """Rank 1 cannot allocate its buffer for the second call (as a full GPU refuses it): that call takes gloo on every
    rank; the third, with room again, shares buffers. Then a layout switch drops every group's buffers."""
    import os

    import torch
    import torch.distributed as dist

    from moe_lab.engine import dist as edist, ipc_collectives as ipc

    rank, world = dist.get_rank(), dist.get_world_size()
    switch = os.environ.get(ipc.SWITCH)
    os.environ[ipc.SWITCH] = "1"
    ipc.uninstall()
    ipc.install("cpu")
    allocate = ipc._allocate

    def refused(size, device):
        raise torch.cuda.OutOfMemoryError(f"no room for {size} bytes")

    counts = []
    try:
        for call in range(3):
            x = torch.randn(world * 64, 8).double()  # 2 KiB a part (the buffers of parities 0 and 1 are new)
            out, ref = torch.empty_like(x), torch.empty_like(x)
            ipc._allocate = refused if (call == 1 and rank == 1) else allocate
            dist.all_to_all_single(out, x)
            dist.all_to_all_single.__wrapped__(ref, x)
            counts.append([bool(torch.equal(out, ref))] + [ipc.STATS[k] for k in
                                                          ("ipc_checked", "ipc_all_to_all", "ipc_out_of_memory")])
        held = ipc.buffer_bytes()
        edist.init_parallel_state(tp=1, ep=world // 2)  # a layout switch, as a case of another layout makes
        after_switch = ipc.buffer_bytes()
        edist.init_parallel_state(tp=1, ep=world)
    finally:
        ipc._allocate = allocate
        ipc.uninstall()
        os.environ.pop(ipc.SWITCH) if switch is None else os.environ.update({ipc.SWITCH: switch})
    return {"counts": counts, "held": held, "after_switch": after_switch}


def test_a_rank_without_room_for_its_buffer_sends_that_call_through_gloo_on_every_rank(cpu_cluster):
    per_rank = cpu_cluster.run(_no_room_on_one_rank)
    for rank, r in enumerate(per_rank):
        (eq0, c0, n0, o0), (eq1, c1, n1, o1), (eq2, c2, n2, o2) = r["counts"]
        assert eq0 and eq1 and eq2
        assert (c1 - c0, n1 - n0) == (0, 0) and o1 - o0 == (1 if rank == 1 else 0)  # the second call: gloo's
        assert (c2 - c1, n2 - n1, o2 - o1) == (0, 1, 0)  # the third: shared again
        # a buffer of 1 MiB for each parity (rank 1 had no room for the second); none after the switch
        assert r["held"] == (1 if rank == 1 else 2) << 20 and r["after_switch"] == 0, r


@ipp.interactive
def _disagreeing_split_sizes():
    """A checked call, then one in which rank 0 expects its parts in other sizes than they are sent."""
    import os

    import torch
    import torch.distributed as dist

    from moe_lab.engine import ipc_collectives as ipc

    rank, world = dist.get_rank(), dist.get_world_size()
    switch = os.environ.get(ipc.SWITCH)
    os.environ[ipc.SWITCH] = "1"
    ipc.uninstall()
    ipc.install("cpu")
    try:
        x = torch.randn(4 * world, 8)
        dist.all_to_all_single(torch.empty_like(x), x, [4] * world, [4] * world)  # the dtype's check
        out_s = [5, 3] + [4] * (world - 2) if rank == 0 else [4] * world
        try:
            dist.all_to_all_single(torch.empty_like(x), x, out_s, [4] * world)
            return {"error": None}
        except ValueError as e:
            return {"error": str(e)}
    finally:
        ipc.uninstall()
        os.environ.pop(ipc.SWITCH) if switch is None else os.environ.update({ipc.SWITCH: switch})


def test_split_sizes_the_ranks_disagree_on_are_refused_by_name_without_a_hang(cpu_cluster):
    # every rank sees every rank's sizes in the call's gather, so every rank refuses it, naming the same ranks
    errors = [r["error"] for r in cpu_cluster.run(_disagreeing_split_sizes)]
    assert len(set(errors)) == 1 and "rank 0 expects 160 bytes from rank 0, which sends it 128" in errors[0], errors


@ipp.interactive
def _forward_backward_both_ways(cfg_dict, forward_backward, same_bits):
    import os

    from moe_lab.engine import dist, ipc_collectives as ipc, toolkit

    s = toolkit.setup(cfg_dict)
    switch, was = os.environ.get(ipc.SWITCH), ipc.describe()
    ipc.uninstall()
    without = forward_backward(s)
    os.environ[ipc.SWITCH] = "1"
    ipc.install(s.tokens.device.type)
    try:
        n0, kept0 = ipc.STATS["ipc_all_to_all"], ipc.STATS["ipc_kept_gloo"]
        forward_backward(s)  # the first call of each dtype checks it against gloo's
        n1 = ipc.STATS["ipc_all_to_all"]
        shared = forward_backward(s)
        n2 = ipc.STATS["ipc_all_to_all"]
        placement = toolkit.placement()
    finally:
        ipc.uninstall()
        os.environ.pop(ipc.SWITCH) if switch is None else os.environ.update({ipc.SWITCH: switch})
        if was is not None:
            ipc.install(s.tokens.device.type)
    dist.release_caches()
    return {"same": same_bits(shared, without), "first": n1 - n0, "shared": n2 - n1, "grads": len(shared[2]),
            "transport": placement.get("transport"), "kept_gloo": ipc.STATS["ipc_kept_gloo"] - kept0}


@pytest.mark.parametrize("dispatcher", ["alltoall", "allgather"])
def test_a_forward_and_backward_are_bitwise_the_same_through_shared_buffers(cpu_cluster, cpu_layer, dispatcher):
    # allgather: 2048 x 256 bf16 tokens, so its gathers and reduce-scatters (1 MiB a rank) go as all-to-alls too
    width = cpu_layer.config().layer.ffn_hidden
    cfg = P.layer.replace(seq_len=2048 if dispatcher == "allgather" else P.layer.seq_len, dispatcher=dispatcher,
                          ffn_hidden=width)
    for r in cpu_cluster.run(_forward_backward_both_ways, cfg.asdict(), forward_backward, same_bits):
        assert r["same"] == [True, True, True] and r["grads"] > 0, r
        assert r["shared"] >= 2 and r["transport"] == "shared memory" and r["kept_gloo"] == 0, r
