"""Where ranks go, without GPUs: one rank per GPU over NCCL, k ranks sharing a GPU over gloo (virtual EP), world 1,
the per-GPU memory check, and the refusals — each one line naming the value and the rule."""

import pytest

from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.controller.placement import default_config
from moe_lab.tools.scale_plan import check_memory
from moe_lab.engine.dist import gpu_index

GIB = 2**30


@pytest.mark.parametrize("engines, gpus, n_gpu, rpg, backend, placement", [
    (4, None, 1, 4, "gloo", "4 ranks share each GPU (virtual EP)"),  # the seed report's EP=4 on one GPU
    (None, None, 1, 1, "nccl", "one rank per GPU"),  # world 1
    (2, None, 2, 1, "nccl", "one rank per GPU"),
    (1, None, 2, 1, "nccl", "one rank per GPU"),  # fewer engines than GPUs: that many GPUs
    (8, None, 4, 2, "gloo", "2 ranks share each GPU (virtual EP)"),
    (4, 1, 8, 4, "gloo", "4 ranks share each GPU (virtual EP)"),  # virtual EP on request, on one GPU of eight
])
def test_placement(engines, gpus, n_gpu, rpg, backend, placement):
    c = default_config(device="cuda", engines=engines, gpus=gpus, n_gpu=n_gpu)
    assert (c.ranks_per_gpu, c.backend, c.placement) == (rpg, backend, placement)
    assert c.engines == (engines or n_gpu)


@pytest.mark.parametrize("kw, message", [
    (dict(device="cuda", engines=6, n_gpu=4), r"engines \(6\) must be a multiple of the GPUs used \(4\)"),
    (dict(device="cuda", engines=0, n_gpu=1), r"engines \(0\) must be a positive integer"),
    (dict(device="cpu", engines=0), r"engines \(0\) must be a positive integer"),
    (dict(device="cuda", engines=4, n_gpu=0), r"device \('cuda'\) needs a GPU"),
    (dict(device="cuda", gpus=3, n_gpu=2), r"gpus \(3\) must be <= the visible GPUs \(2\)"),
    (dict(device="cpu", gpus=1), r"gpus \(1\) applies to device 'cuda' only"),
])
def test_bad_placements_are_refused_with_the_rule(kw, message):
    with pytest.raises(ValueError, match=message):
        default_config(**kw)


def test_config_rules():
    assert ClusterConfig(device="cpu", engines=1).placement == "1 CPU engines"
    with pytest.raises(ValueError, match=r"ranks_per_gpu \(2\) must be 1 on device 'cpu'"):
        ClusterConfig(device="cpu", engines=2, ranks_per_gpu=2)
    with pytest.raises(ValueError, match=r"engines \(6\) must be a multiple of ranks_per_gpu \(4\)"):
        ClusterConfig(device="cuda", engines=6, ranks_per_gpu=4)


def test_gpu_of_each_rank():
    assert [gpu_index(rank=r, local_rank=r, local_world=4, n_gpu=1, ranks_per_gpu=4) for r in range(4)] == [0] * 4
    assert [gpu_index(rank=r, local_rank=r, local_world=8, n_gpu=4, ranks_per_gpu=2) for r in range(8)] == \
        [0, 0, 1, 1, 2, 2, 3, 3]
    assert gpu_index(rank=1, local_rank=1, local_world=2, n_gpu=2) == 1
    with pytest.raises(RuntimeError, match="start at most 4 engines on each node"):
        gpu_index(rank=5, local_rank=5, local_world=8, n_gpu=2, ranks_per_gpu=2)


def test_memory_check_refuses_what_does_not_fit_before_anything_starts():
    seed = MoEConfig.seed_report()
    four = ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4)
    ok = check_memory([seed], four, free=[130 * GIB])
    assert ok["ranks_per_gpu"] == 4 and 4 * GIB < ok["per_rank_bytes"] < 8 * GIB  # 16 experts of 256 MiB + activations
    assert ok["need_bytes"] == 4 * ok["per_rank_bytes"]
    with pytest.raises(ValueError) as e:
        check_memory([seed], four, free=[10 * GIB])
    msg = str(e.value)
    assert "4 rank(s) per GPU need" in msg and "only 10.0 GiB is free" in msg and "use fewer ranks per GPU" in msg
    assert check_memory([seed], ClusterConfig(device="cpu", engines=4)) is None  # CPU: nothing to check


def _fake_smi(tmp_path, monkeypatch, body: str):
    smi = tmp_path / "bin" / "nvidia-smi"
    smi.parent.mkdir(exist_ok=True)
    smi.write_text("#!/bin/sh\n" + body)
    smi.chmod(0o755)
    monkeypatch.setenv("PATH", f"{smi.parent}:/usr/bin:/bin")
    monkeypatch.setitem(__import__("sys").modules, "pynvml", None)  # no NVML binding: the tool is asked


def test_free_gpu_memory_comes_from_nvidia_smi_without_a_cuda_context(tmp_path, monkeypatch):
    from moe_lab.controller import placement

    _fake_smi(tmp_path, monkeypatch, 'echo "0, 143000"\necho "1, 1024"\n')
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placement.gpu_free_bytes(2) == [143000 * 2 ** 20, 1024 * 2 ** 20]
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "1")
    assert placement.gpu_free_bytes(1) == [1024 * 2 ** 20]


def test_total_gpu_memory_comes_from_nvidia_smi_and_is_none_where_it_cannot_say(tmp_path, monkeypatch):
    from moe_lab.controller import placement

    _fake_smi(tmp_path, monkeypatch, 'case "$1" in *memory.total*) echo "0, 81559";; *) echo "0, 100";; esac\n')
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    assert placement.gpu_total_bytes(1) == [81559 * 2 ** 20]  # the total, not the free
    assert placement.gpu_free_bytes(1) == [100 * 2 ** 20]
    assert placement.gpu_total_bytes(2) is None  # a GPU it does not list
    _fake_smi(tmp_path, monkeypatch, "exit 9\n")
    assert placement.gpu_total_bytes(1) is None  # no torch asked: None


@pytest.mark.parametrize("body", ["exit 9\n", 'echo "garbage"\n', 'echo "0, 10"\n'])
def test_a_failing_or_short_nvidia_smi_falls_back_to_torch(tmp_path, monkeypatch, body):
    """The control: where the tool fails, says something else or lacks a GPU asked for, torch answers (here a
    stand-in that says so)."""
    import types

    from moe_lab.controller import placement

    _fake_smi(tmp_path, monkeypatch, body)
    monkeypatch.setenv("CUDA_VISIBLE_DEVICES", "0,1")
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(mem_get_info=lambda i: (7 + i, 100)))
    monkeypatch.setitem(__import__("sys").modules, "torch", fake)
    assert placement.gpu_free_bytes(2) == [7, 8]


@pytest.mark.parametrize("text, build, gpus_asked", [
    ("__version__ = '2.13.0+cpu'\ncuda: Optional[str] = None\nhip: Optional[str] = None\n", (None, None), False),
    ("__version__ = '2.11.0+cu130'\ncuda: Optional[str] = '13.0'\nhip: Optional[str] = None\n", ("13.0", None), True),
    ("cuda = None\nhip = '6.2.4'\n", (None, "6.2.4"), True),  # ROCm: torch.cuda is HIP there, torch is asked
    ("cuda = None\n", None, True),  # a file not as expected: torch is asked
])
def test_a_cpu_build_of_torch_is_known_from_its_version_file_without_importing_it(tmp_path, monkeypatch, text,
                                                                                   build, gpus_asked):
    import importlib.util
    import sys
    import types

    from moe_lab.controller import placement

    pkg = tmp_path / "torch"
    pkg.mkdir()
    (pkg / "__init__.py").write_text("")
    (pkg / "version.py").write_text(text)
    real = importlib.util.find_spec
    monkeypatch.setattr(importlib.util, "find_spec",
                        lambda name, *a: importlib.util.spec_from_file_location("torch", pkg / "__init__.py")
                        if name == "torch" else real(name, *a))
    asked = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(is_available=lambda: asked.append(1) or True,
                                                            device_count=lambda: 3))
    monkeypatch.setitem(sys.modules, "torch", fake)
    monkeypatch.setattr(placement, "_nvml_names", lambda: None)  # no NVML binding: torch is the one asked
    assert placement._torch_build() == build
    assert placement.visible_gpus() == (3 if gpus_asked else 0) and bool(asked) == gpus_asked


class FakeNVML:
    """NVML's Python binding (pynvml) as far as `placement` uses it."""

    class NVMLError(Exception):
        pass

    def __init__(self, names, mig=(), no_mig=(), fail_init=False):
        self.names, self.mig, self.no_mig, self.fail_init, self.shut = names, set(mig), set(no_mig), fail_init, 0

    def nvmlInit(self):
        if self.fail_init:
            raise self.NVMLError("Driver Not Loaded")

    def nvmlShutdown(self):
        self.shut += 1

    def nvmlDeviceGetCount(self):
        return len(self.names)

    def nvmlDeviceGetHandleByIndex(self, i):
        return i

    def nvmlDeviceGetMigMode(self, h):
        if h in self.no_mig:  # a GPU without MIG
            raise self.NVMLError("Not Supported")
        return (1, 1) if h in self.mig else (0, 0)

    def nvmlDeviceGetName(self, h):
        return self.names[h].encode() if h % 2 else self.names[h]  # older bindings return bytes


@pytest.mark.parametrize("nvml, env, via_nvml", [
    (FakeNVML(["NVIDIA H200"] * 2, no_mig={0}), {}, True),
    (FakeNVML(["NVIDIA H200"] * 2), {"CUDA_VISIBLE_DEVICES": "1"}, False),  # CUDA's numbering differs
    (FakeNVML(["NVIDIA H200", "NVIDIA H100 80GB HBM3"]), {}, False),  # two kinds: CUDA's order may not be NVML's
    (FakeNVML(["NVIDIA H200"] * 2, mig={1}), {}, False),  # MIG: CUDA sees instances, not GPUs
    (FakeNVML(["NVIDIA H200"], fail_init=True), {}, False),  # no driver
    (None, {}, False),  # no binding
])
def test_a_cuda_build_counts_and_names_gpus_through_nvml_without_importing_torch(monkeypatch, nvml, env, via_nvml):
    """The GPUs and their name come from NVML only where NVML numbers them as CUDA does; otherwise torch is asked
    (the control: a torch that says 3 GPUs named 'torch's GPU')."""
    import sys
    import types

    from moe_lab.controller import placement

    monkeypatch.setattr(placement, "_torch_build", lambda: ("13.0", None))
    monkeypatch.delenv("CUDA_VISIBLE_DEVICES", raising=False)
    for k, v in env.items():
        monkeypatch.setenv(k, v)
    monkeypatch.setitem(sys.modules, "pynvml", nvml)  # None: `import pynvml` raises ImportError
    asked = []
    fake = types.SimpleNamespace(cuda=types.SimpleNamespace(
        is_available=lambda: asked.append("is_available") or True, device_count=lambda: 3,
        get_device_name=lambda i: "torch's GPU"))
    monkeypatch.setitem(sys.modules, "torch", fake)
    gpus, name = placement.visible_gpus(), placement.gpu_name(0)
    if via_nvml:
        assert (gpus, name, asked) == (2, "NVIDIA H200", []) and nvml.shut == 2
        assert placement.gpu_name(1) == "NVIDIA H200"  # a name NVML returned as bytes
    else:
        assert (gpus, name) == (3, "torch's GPU") and asked
