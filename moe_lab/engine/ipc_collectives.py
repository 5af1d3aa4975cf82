"""All-to-alls between ranks of one machine through buffers they share, instead of gloo's sockets.

Ranks that share a GPU (virtual EP) run every collective over gloo, which stages CUDA tensors through host memory and
sends them over TCP: on one H100 with 4 ranks most of a MoE forward is that transport (docs/bench.md). Where every
rank of a group sits on the same GPU, each rank instead copies its input into a device buffer of its own that the
others have opened through CUDA IPC, and reads its parts straight out of theirs: the same bytes in the same places
(a copy, no arithmetic), at device-copy speed (on one H100, 4 ranks: 128 MiB a rank 74-78 ms through gloo, 2 ms
here; docs/bench.md). On CPU engines the buffers are shared memory, off unless switched on: there the copies and the
exchange cost more than gloo's sockets (4 engines on 2 cores: 1 MiB 1.2-1.5 ms against gloo's 0.7-0.8).

One call on a group: the rank writes its input into its buffer (one of two, alternating by call), waits for the copy,
then one small gloo exchange tells every rank every rank's part sizes (and whether a buffer moved); each rank then
copies its parts out of the others' buffers. That exchange is also the barrier: a rank reaches it only after waiting
for its device work, its reads of the previous call included, so a buffer is written again two calls later, never
while a peer still reads it. The buffers are per group of ranks (a tuple of global ranks), so the calls on one group
stay in the order every rank issues them; a layout switch drops them (room for the next layout's layer), and a rank
with no room for its buffer says so in the exchange, which sends that call through gloo on every rank.

Not assumed equal to gloo: the first call of every (group, dtype) runs gloo's all-to-all as well, every rank says
whether its output agreed (a MIN all-reduce), and the group keeps gloo for that dtype where any rank disagreed
(`STATS` counts the verdicts). The small collectives it uses are torch's own functions, called through
`distributed_c10d`, so a ledger of collectives (engine.capture) still sees one all-to-all.

`install(device)` routes the gloo shims' all-to-all (engine.shims, through which large all-gathers and reduce-scatters
also go) through here; `uninstall()` takes it back. The switch MOE_LAB_IPC_COLLECTIVES: unset = on for ranks that
share a GPU, 0 = off, 1 = on for CPU engines too.
"""

from __future__ import annotations

import logging
import platform

import torch
from torch.distributed import distributed_c10d as c10d

from .. import switches

logger = logging.getLogger(__name__)

SWITCH = "MOE_LAB_IPC_COLLECTIVES"
MAX_BUFFER_BYTES = 4 << 30
"""A rank's input or output of an all-to-all (bytes) beyond which the call takes gloo on every rank (its two buffers
would hold twice this)."""

STATS = {"ipc_all_to_all": 0, "ipc_checked": 0, "ipc_kept_gloo": 0, "ipc_too_large": 0, "ipc_out_of_memory": 0}

_DTYPES = {dt: i for i, dt in enumerate((torch.float64, torch.float32, torch.bfloat16, torch.float16, torch.int64,
                                         torch.int32, torch.int16, torch.int8, torch.uint8, torch.bool))}


def wanted(device: str) -> bool:
    """Whether engines on `device` route their all-to-alls through shared buffers, by the switch."""
    forced = switches.forced(SWITCH)
    return forced if forced is not None else device == "cuda"


def plan(sends: list[list[int]], me: int) -> list[tuple[int, int, int]]:
    """The reads of rank `me` (index in the group): for each rank j in order, (j, offset in j's buffer, bytes), from
    every rank's bytes sent to each rank (`sends[j][k]`: rank j to rank k, its input's parts in rank order)."""
    return [(j, sum(row[:me]), row[me]) for j, row in enumerate(sends)]


def part_bytes(tensor: torch.Tensor, splits: list[int] | None, world: int) -> list[int]:
    """Bytes of `tensor` for each of `world` ranks: rows by `splits` along dim 0, or equal parts without them."""
    total = tensor.numel() * tensor.element_size()
    if splits is None:
        if tensor.numel() % world:
            raise ValueError(f"all_to_all_single: {tensor.numel()} elements do not split evenly over {world} ranks")
        return [total // world] * world
    if len(splits) != world:
        raise ValueError(f"all_to_all_single: {len(splits)} split sizes for a group of {world} ranks")
    if sum(splits) != (tensor.shape[0] if tensor.dim() else 1):
        raise ValueError(f"all_to_all_single: split sizes {splits} do not add up to {tensor.shape[0]} rows")
    row = total // tensor.shape[0] if tensor.dim() and tensor.shape[0] else 0
    return [s * row for s in splits]


class _Group:
    """One group of ranks' buffers: this rank's two (by call parity) and the others' as opened here."""

    def __init__(self, ranks: tuple[int, ...], me: int, device: torch.device):
        self.ranks, self.me, self.device = ranks, me, device
        self.calls = 0
        self.own: list[torch.Tensor | None] = [None, None]
        self.generation = [0, 0]  # bumped when this rank's buffer of a parity is replaced
        self.peers: list[list[torch.Tensor | None]] = [[None] * len(ranks), [None] * len(ranks)]
        self.seen = [[0] * len(ranks), [0] * len(ranks)]  # generation of each rank's buffer as opened here
        self.verdicts: dict[torch.dtype, bool] = {}

    def buffer(self, parity: int, nbytes: int) -> torch.Tensor | None:
        """This rank's buffer of `parity`, of at least `nbytes` (a larger one replaces it, an eighth to spare); None
        where the device has no room for it (the call then takes gloo on every rank: `_ipc_all_to_all`)."""
        own = self.own[parity]
        if own is not None and own.numel() >= nbytes:
            return own
        self.own[parity] = own = None  # let the allocator reuse it for the larger one
        self.generation[parity] += 1  # the others reopen this rank's buffer at the next call that uses it
        size = -(-(nbytes + nbytes // 8) // (1 << 20)) << 20
        if self.device.type == "cuda":
            torch.cuda.ipc_collect()  # buffers the others have let go of since they were replaced
        try:
            self.own[parity] = _allocate(size, self.device)
        except torch.cuda.OutOfMemoryError:
            STATS["ipc_out_of_memory"] += 1
            return None
        return self.own[parity]


_GROUPS: dict[tuple[int, ...], _Group | None] = {}
_INSTALLED: dict[str, object] = {}


def _allocate(size: int, device: torch.device) -> torch.Tensor:
    buf = torch.empty(size, dtype=torch.uint8, device=device)
    if device.type == "cpu":  # moved into a shared-memory file the other processes can map
        storage = buf.untyped_storage()
        storage._share_filename_cpu_()
        buf = torch.empty(0, dtype=torch.uint8).set_(storage)
    return buf


def _export(buf: torch.Tensor):
    if buf.device.type == "cuda":
        from torch.multiprocessing.reductions import reduce_tensor

        return reduce_tensor(buf)[1]
    return buf.untyped_storage()._share_filename_cpu_()


def _open(handle, device: torch.device) -> torch.Tensor:
    if device.type == "cuda":
        from torch.multiprocessing.reductions import rebuild_cuda_tensor

        return rebuild_cuda_tensor(*handle)
    storage = torch.UntypedStorage._new_shared_filename_cpu(*handle)
    return torch.empty(0, dtype=torch.uint8).set_(storage)


def _wait(device: torch.device) -> None:
    if device.type == "cuda":
        torch.cuda.current_stream(device).synchronize()


def _place(device: torch.device) -> tuple:
    """What must be the same on every rank of a group for it to share buffers: the machine, and the GPU by UUID."""
    if device.type == "cuda":
        props = torch.cuda.get_device_properties(device)
        return platform.node(), "cuda", str(getattr(props, "uuid", "")) or f"index {device.index}"
    return platform.node(), "cpu", ""


def _group_of(group, device: torch.device) -> _Group | None:
    """This call's group of ranks, set up at its first call on every rank of it (a collective: every rank says where
    it sits); None where its ranks do not share one GPU (or one machine, on CPU) or it is not a gloo group."""
    ranks = tuple(c10d.get_process_group_ranks(group if group is not None else c10d._get_default_group()))
    if ranks in _GROUPS:
        return _GROUPS[ranks]
    if c10d.get_backend(group) != "gloo" or len(ranks) < 2:
        _GROUPS[ranks] = None
        return None
    places: list = [None] * len(ranks)
    c10d.all_gather_object(places, _place(device), group=group)
    me = c10d.get_rank(group)
    _GROUPS[ranks] = g = _Group(ranks, me, device) if len(set(places)) == 1 else None
    logger.debug("group %s: %s", ranks, "shares buffers" if g else f"keeps gloo (ranks at {sorted(set(places))})")
    return g


def _ipc_all_to_all(g: _Group, group, output: torch.Tensor, input: torch.Tensor, out_splits, in_splits) -> bool:
    world = len(g.ranks)
    sends = part_bytes(input, in_splits, world)
    receives = part_bytes(output, out_splits, world)
    total = sum(sends)
    parity = g.calls % 2
    fits = total <= MAX_BUFFER_BYTES and sum(receives) <= MAX_BUFFER_BYTES
    if fits and total:
        buf = g.buffer(parity, total)
        if buf is None:
            fits = False
        else:
            buf[:total].copy_(input.contiguous().view(-1).view(torch.uint8))
    _wait(g.device)
    row = torch.tensor([int(fits), g.generation[parity], _DTYPES.get(input.dtype, -1), *sends, *receives],
                       dtype=torch.int64)
    table = torch.empty(world, row.numel(), dtype=torch.int64)
    c10d.all_to_all_single(table, row.repeat(world, 1), group=group)  # an all-gather in one round, not a ring's
    g.calls += 1
    fits_all, gens, dtypes = table[:, 0].tolist(), table[:, 1].tolist(), table[:, 2].tolist()
    sent, expected = table[:, 3:3 + world].tolist(), table[:, 3 + world:].tolist()
    for k in range(world):  # every rank checks every rank's parts, so all of them refuse a call alike
        for j in range(world):
            if sent[j][k] != expected[k][j]:
                raise ValueError(f"all_to_all_single: rank {g.ranks[k]} expects {expected[k][j]} bytes from rank "
                                 f"{g.ranks[j]}, which sends it {sent[j][k]}: the ranks' split sizes disagree")
    if not all(fits_all) or len(set(dtypes)) != 1 or -1 in dtypes:  # too large, or no room on some rank: gloo
        STATS["ipc_too_large"] += int(any(n > MAX_BUFFER_BYTES for n in table[:, 3:3 + world].sum(1).tolist()))
        return False
    if gens != g.seen[parity]:  # the same on every rank: each one's view of all generations, its own included
        handles: list = [None] * world
        own = g.own[parity]
        c10d.all_gather_object(handles, None if own is None else _export(own), group=group)
        for j in range(world):
            if j != g.me and gens[j] != g.seen[parity][j]:
                g.peers[parity][j] = None if handles[j] is None else _open(handles[j], g.device)
        g.seen[parity] = gens
    plan_ = plan(sent, g.me)
    out = output if output.is_contiguous() else torch.empty_like(output, memory_format=torch.contiguous_format)
    out_bytes = out.view(-1).view(torch.uint8)
    at = 0
    for j, offset, n in plan_:
        if n:
            src = g.own[parity] if j == g.me else g.peers[parity][j]
            out_bytes[at:at + n].copy_(src[offset:offset + n])
        at += n
    if out is not output:
        output.copy_(out)
    return True


def _same_bytes(a: torch.Tensor, b: torch.Tensor) -> bool:
    """Bitwise equal, NaNs included (torch.equal calls two NaNs different)."""
    return torch.equal(a.contiguous().view(-1).view(torch.uint8), b.contiguous().view(-1).view(torch.uint8))


def all_to_all(gloo_all_to_all, output, input, out_splits, in_splits, group) -> bool:
    """The all-to-all of `input` into `output` through shared buffers where `group`'s ranks share one GPU (or one
    machine, on CPU engines); False where it is gloo's to do (the caller calls `gloo_all_to_all`). Every rank of a
    group decides alike: from the group, the switch and what the call's small exchange tells all of them."""
    device = input.device
    if device.type != output.device.type:
        return False
    g = _group_of(group, device)
    if g is None:
        return False
    if input.dtype not in g.verdicts:
        if not _ipc_all_to_all(g, group, output, input, out_splits, in_splits):
            return False
        mine = output.clone()
        gloo_all_to_all(output, input.contiguous(), out_splits, in_splits, group=group)
        agreed = torch.tensor([int(_same_bytes(mine, output))], dtype=torch.int32)
        c10d.all_reduce(agreed, op=c10d.ReduceOp.MIN, group=group)
        g.verdicts[input.dtype] = ok = bool(agreed.item())
        STATS["ipc_checked"] += 1
        STATS["ipc_kept_gloo"] += int(not ok)
        if not ok:
            logger.warning("group %s: an all-to-all of %s through shared buffers did not give gloo's bytes on every "
                           "rank; this group keeps gloo for it", g.ranks, input.dtype)
        return True  # gloo's own result is in output
    if not g.verdicts[input.dtype]:
        return False
    if not _ipc_all_to_all(g, group, output, input, out_splits, in_splits):
        return False
    STATS["ipc_all_to_all"] += 1
    return True


def install(device: str) -> bool:
    """Route the gloo shims' all-to-all through shared buffers where `wanted(device)`; True when routed."""
    from . import shims

    if not wanted(device):
        return False
    shims.set_all_to_all_transport(all_to_all)
    _INSTALLED["device"] = device
    return True


def uninstall() -> None:
    """gloo's own all-to-all again; the buffers are dropped (every group sets up again at its next call)."""
    from . import shims

    shims.set_all_to_all_transport(None)
    _INSTALLED.clear()
    _GROUPS.clear()


def describe() -> str | None:
    """The transport's words for placement: None where gloo carries everything."""
    if not _INSTALLED:
        return None
    return "CUDA IPC" if _INSTALLED["device"] == "cuda" else "shared memory"


def forget_groups() -> None:
    """Drop every group's buffers; the next call on a group sets it up again. Every rank calls it at the same point
    (a layout switch, a notebook's end), so the groups set up again alike; a buffer the others still hold open is
    freed once they let go (the allocator collects it when it needs the room)."""
    _GROUPS.clear()


def buffer_bytes() -> int:
    """Bytes of the buffers this rank holds for its groups."""
    return sum(b.numel() for g in _GROUPS.values() if g is not None for b in g.own if b is not None)


__all__ = ["SWITCH", "MAX_BUFFER_BYTES", "STATS", "wanted", "plan", "part_bytes", "all_to_all", "install",
           "uninstall", "describe", "forget_groups", "buffer_bytes"]
