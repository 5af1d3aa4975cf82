"""The CPU and gloo shims (`engine/shims.py`), each next to a control that shows what fails without it. They patch
torch and megatron-core process-wide, so every check runs in a fresh interpreter (as an engine would)."""

import subprocess
import sys
import textwrap


def _run(code: str) -> list[str]:
    out = subprocess.run([sys.executable, "-c", textwrap.dedent(code)], capture_output=True, text=True, timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    return out.stdout.strip().splitlines()


def test_cpu_shims_map_cuda_calls_to_the_cpu_and_say_what_they_patched():
    lines = _run("""
        import torch
        from moe_lab.engine import shims
        try:
            torch.cuda.current_device()
            print("control: current_device answered")
        except Exception as e:
            print("control:", type(e).__name__)
        first = shims.apply_cpu_shims()
        print(torch.cuda.current_device(), type(torch.cuda.Stream()).__name__, torch.cuda.current_stream().query())
        torch.cuda.synchronize(); torch.zeros(2).record_stream(None)
        print(sorted(first) == sorted(shims.apply_cpu_shims()) == sorted(shims.applied()))  # idempotent
        print(sorted(first))
    """)
    assert lines[0].startswith("control:") and lines[0] != "control: current_device answered"  # no CUDA here
    assert lines[1] == "cpu _NoStream True" and lines[2] == "True"
    patched = set(eval(lines[3]))
    assert {"current_device", "streams", "synchronize", "record_stream", "all_to_all_single_lists"} <= patched


def test_gloo_all_to_all_takes_split_sizes_as_tensors_only_with_the_shim():
    lines = _run("""
        import os, socket, torch, torch.distributed as dist
        s = socket.socket(); s.bind(("127.0.0.1", 0)); port = s.getsockname()[1]; s.close()
        dist.init_process_group("gloo", init_method=f"tcp://127.0.0.1:{port}", rank=0, world_size=1)
        x, out = torch.arange(4.0), torch.empty(4)
        try:
            dist.all_to_all_single(out, x, torch.tensor([4]), torch.tensor([4]))  # what megatron's dispatcher passes
            print("control: accepted")
        except TypeError:
            print("control: TypeError")
        from moe_lab.engine import shims
        shims.apply_gloo_shims()
        dist.all_to_all_single(out, x, torch.tensor([4]), torch.tensor([4]))
        print(out.tolist())
        dist.destroy_process_group()
    """)
    assert lines == ["control: TypeError", "[0.0, 1.0, 2.0, 3.0]"]


def test_te_general_gemm_is_defined_where_a_release_leaves_it_out():
    lines = _run("""
        from megatron.core.transformer.moe import moe_utils
        from moe_lab.engine import shims
        from moe_lab.releases import installed_version, parse_version
        had = hasattr(moe_utils, "te_general_gemm")
        print(installed_version(), had, shims.fix_missing_te(), moe_utils.te_general_gemm is None or had,
              shims.fix_missing_te())
    """)
    version, had, first, defined, second = lines[0].split()
    assert defined == "True" and second == "False"  # defined afterwards, and only once
    if (0, 13, 0) <= tuple(int(x) for x in version.split(".")[:3]) < (0, 17, 0):
        assert (had, first) == ("False", "True")  # 0.13-0.16 without TransformerEngine: the shim is needed
