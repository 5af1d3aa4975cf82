"""The bookkeeping of all-to-alls through shared buffers (`engine.ipc_collectives`) without engines: where each rank
reads its parts, the bytes of a call's parts, the switch, and the gloo shims' hook (in a fresh interpreter: the shims
patch torch process-wide). The buffers themselves are exercised on CPU engines (tests/cluster) and GPUs (tests/gpu)."""

import subprocess
import sys
import textwrap

import pytest
import torch
from hypothesis import given, settings
from hypothesis import strategies as st

from moe_lab.engine import ipc_collectives as ipc


@st.composite
def _sends(draw):
    world = draw(st.integers(2, 8))
    return [[draw(st.integers(0, 40)) for _ in range(world)] for _ in range(world)]


@settings(max_examples=200, deadline=None)
@given(_sends())
def test_each_rank_reads_what_every_rank_put_in_its_buffer_for_it(sends):
    world = len(sends)
    # rank j's buffer: its parts for ranks 0..world-1 in order, each byte naming (sender, receiver, index)
    buffers = [[(j, k, i) for k in range(world) for i in range(sends[j][k])] for j in range(world)]
    for me in range(world):
        got = []
        for j, offset, n in ipc.plan(sends, me):
            got += buffers[j][offset:offset + n]
        assert got == [(j, me, i) for j in range(world) for i in range(sends[j][me])]  # the all-to-all's output


def test_a_plan_with_the_wrong_offsets_reads_another_ranks_part():
    # the control of the property above: offsets of the sender's first part read rank 0's part for every rank
    sends = [[2, 3], [1, 4]]
    buffers = [[(j, k, i) for k in range(2) for i in range(sends[j][k])] for j in range(2)]
    got = [b for j, _, n in ipc.plan(sends, 1) for b in buffers[j][0:n]]
    assert got != [(j, 1, i) for j in range(2) for i in range(sends[j][1])]


def test_part_bytes_by_rows_and_equal_parts_and_what_is_refused():
    x = torch.zeros(6, 5, dtype=torch.bfloat16)  # 10 bytes a row
    assert ipc.part_bytes(x, [1, 0, 5], 3) == [10, 0, 50]
    assert ipc.part_bytes(x, None, 3) == [20, 20, 20]
    with pytest.raises(ValueError, match="do not split evenly over 4 ranks"):
        ipc.part_bytes(x, None, 4)
    with pytest.raises(ValueError, match="2 split sizes for a group of 3 ranks"):
        ipc.part_bytes(x, [3, 3], 3)
    with pytest.raises(ValueError, match=r"split sizes \[1, 1, 1\] do not add up to 6 rows"):
        ipc.part_bytes(x, [1, 1, 1], 3)


def test_the_switch_on_cuda_by_default_on_cpu_when_asked(monkeypatch):
    monkeypatch.delenv(ipc.SWITCH, raising=False)
    assert ipc.wanted("cuda") and not ipc.wanted("cpu")
    monkeypatch.setenv(ipc.SWITCH, "0")
    assert not ipc.wanted("cuda")
    monkeypatch.setenv(ipc.SWITCH, "1")
    assert ipc.wanted("cpu")
    monkeypatch.setenv(ipc.SWITCH, "yes")
    with pytest.raises(ValueError, match=f"{ipc.SWITCH}='yes': give 0 .off. or 1 .on."):
        ipc.wanted("cuda")


def test_the_gloo_shims_all_to_all_hands_a_call_to_the_transport_and_takes_it_back():
    code = """
        import socket, torch, torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        from moe_lab.engine import shims
        shims.apply_gloo_shims()
        calls = []
        def transport(gloo, output, input, out_splits, in_splits, group):
            calls.append((out_splits, in_splits))
            output.fill_(-1)
            return len(calls) == 1  # the first call taken, the second handed back to gloo
        shims.set_all_to_all_transport(transport)
        x, out = torch.arange(4.0), torch.empty(4)
        dist.all_to_all_single(out, x, torch.tensor([4]), torch.tensor([4]))
        print(out.tolist(), calls)
        dist.all_to_all_single(out, x, torch.tensor([4]), torch.tensor([4]))
        print(out.tolist())
        shims.set_all_to_all_transport(None)
        out.zero_(); dist.all_to_all_single(out, x, async_op=True).wait()
        print(out.tolist(), len(calls))
        dist.destroy_process_group()
    """
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    assert out.stdout.split("\n")[:3] == ["[-1.0, -1.0, -1.0, -1.0] [([4], [4])]", "[0.0, 1.0, 2.0, 3.0]",
                                          "[0.0, 1.0, 2.0, 3.0] 2"]
