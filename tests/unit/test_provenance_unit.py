"""Provenance of the CPU and GPU a number was measured on: /proc/cpuinfo and torch's build string parsed by hand,
the ISA env vars, the GPU UUID, and what the records carry (rank 0's description, every rank's GPU UUID) — none of
it in the resume key."""

from __future__ import annotations

from pathlib import Path
from types import SimpleNamespace

import pytest

from moe_lab import provenance
from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.experiments import protocol

XEON = """processor\t: 0
vendor_id\t: GenuineIntel
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu vme sse2 avx avx2 fma avx512f avx512bw avx512_bf16 avx512_fp16 amx_bf16 amx_tile amx_int8 avx512vl
bogomips\t: 4000.00

processor\t: 1
model name\t: Intel(R) Xeon(R) Platinum 8480+
flags\t\t: fpu
"""
EPYC = "processor\t: 0\nmodel name\t: AMD EPYC\nflags\t\t: fpu sse2 avx fma avx2 bmi2\n"
CONFIG = """PyTorch built with:
  - Intel(R) oneAPI Math Kernel Library Version 2024.2-Product Build 20240605 for Intel(R) 64 architecture applications
  - Intel(R) MKL-DNN v3.12.0 (Git Hash 80afa71049cd69a3df32adcccb623b12cd7baa22)
  - CPU capability usage: AVX512
  - Build settings: BLAS_INFO=mkl, BUILD_TYPE=Release, LAPACK_INFO=open, TORCH_VERSION=2.13.0, USE_MKLDNN=ON,
"""


def test_cpuinfo_model_and_the_flags_that_pick_kernels():
    p = provenance.parse_cpuinfo(XEON)
    assert p["model"] == "Intel(R) Xeon(R) Platinum 8480+" and "amx_bf16" in p["flags"]  # the first processor's
    assert provenance.isa_flags(p["flags"]) == {
        "isa": ["amx_bf16", "amx_int8", "amx_tile", "avx512_bf16", "avx512_fp16", "avx512bw", "avx512f", "avx512vl"],
        "avx2": True, "fma": True}
    assert provenance.isa_flags(provenance.parse_cpuinfo(EPYC)["flags"]) == {"isa": [], "avx2": True, "fma": True}
    assert provenance.parse_cpuinfo("") == {"model": None, "flags": []}
    arm = provenance.parse_cpuinfo("processor\t: 0\nFeatures\t: fp asimd sve\n")
    assert arm["model"] is None and provenance.isa_flags(arm["flags"]) == {"isa": [], "avx2": False, "fma": False}


def test_torch_build_string_parsed():
    assert provenance.parse_torch_config(CONFIG) == {"onednn": "3.12.0", "mkl": "2024.2", "blas": "mkl",
                                                     "lapack": "open"}
    assert provenance.parse_torch_config("no such lines") == {"onednn": None, "mkl": None, "blas": None,
                                                              "lapack": None}


def test_cpu_info_without_torch_and_with_it(monkeypatch):
    real = Path.read_text
    monkeypatch.setattr(Path, "read_text", lambda self, *a, **k: XEON if str(self) == "/proc/cpuinfo"
                        else real(self, *a, **k))
    for k in provenance.CPU_ENV:
        monkeypatch.delenv(k, raising=False)
    monkeypatch.setenv("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16")
    bare = provenance.cpu_info(with_torch=False)
    assert bare == {"model": "Intel(R) Xeon(R) Platinum 8480+", "isa": provenance.isa_flags(
        provenance.parse_cpuinfo(XEON)["flags"])["isa"], "avx2": True, "fma": True,
        "env": {"ONEDNN_MAX_CPU_ISA": "AVX512_CORE_BF16"}}
    import torch

    full = provenance.cpu_info()
    assert {k: full[k] for k in bare} == bare
    assert full["capability"] == torch.backends.cpu.get_cpu_capability() and full["mkldnn"] is True
    assert full["blas"] and full["onednn"]  # this torch's own build string


def test_cpu_info_falls_back_to_platform_without_proc(monkeypatch):
    import platform

    def no_proc(self, *a, **k):
        raise OSError("no /proc")

    monkeypatch.setattr(Path, "read_text", no_proc)
    monkeypatch.setattr(platform, "processor", lambda: "arm")
    got = provenance.cpu_info(with_torch=False)
    assert got["model"] == "arm" and got["isa"] == [] and not got["avx2"]


def test_the_cpu_isa_variables_are_numerics_env(monkeypatch):
    for k in ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS"):
        assert k in provenance.NUMERICS_ENV and k in provenance.CPU_ENV
        monkeypatch.setenv(k, "X")
        assert provenance.numerics_env()[k] == "X"


def test_gpu_uuid(monkeypatch):
    import torch

    props = {0: SimpleNamespace(uuid="58389ef6-1f0c-1a2b-9c3d-0123456789ab", name="NVIDIA H200"),
             1: SimpleNamespace(name="old torch: no uuid")}

    def get(i):
        if i not in props:
            raise RuntimeError("invalid device ordinal")
        return props[i]

    monkeypatch.setattr(torch.cuda, "get_device_properties", get)
    assert provenance.gpu_uuid(0) == "58389ef6-1f0c-1a2b-9c3d-0123456789ab"
    assert provenance.gpu_uuid(1) is None and provenance.gpu_uuid(7) is None


def _info(rank, uuid):
    return {"rank": rank, "pid": 100 + rank, "local_rank": rank, "ep_rank": rank, "gpu_index": rank, "host": "h",
            "megatron_path": "/m", "device": "cuda", "world": 2, "backend": "nccl", "ranks_per_gpu": 1,
            "gpu": "NVIDIA H200", "gpu_uuid": uuid, "megatron_core": "0.16.1", "t_setup_s": 1.0,
            "cpu": {"model": "Intel(R) Xeon(R) Platinum 8480+", "isa": ["amx_bf16"], "avx2": True, "fma": True,
                    "env": {}}}


def test_records_carry_rank0s_gpu_uuid_every_ranks_uuids_and_the_cpu_but_the_key_does_not():
    cluster = SimpleNamespace(info=[_info(0, "GPU-b"), _info(1, "GPU-a")], attached=False)
    env = protocol.environment(cluster)
    assert env["gpu_uuid"] == "GPU-b" and env["gpu_uuids"] == ["GPU-a", "GPU-b"]
    assert env["cpu"]["model"].startswith("Intel") and env["cpu"]["isa"] == ["amx_bf16"]
    assert not {"pid", "rank", "gpu_index", "host", "t_setup_s"} & set(env)  # per-rank fields stay out
    cpu = SimpleNamespace(info=[dict(_info(0, None), device="cpu", gpu=None)], attached=False)
    assert protocol.environment(cpu)["gpu_uuids"] is None and protocol.environment(cpu)["gpu_uuid"] is None
    # another GPU of the same name, another CPU: the same measurement, the same key (ENV_KEY has neither)
    case = protocol.Case(experiment="x", moe=MoEConfig())
    ccfg = ClusterConfig(device="cuda", engines=2)
    other = dict(env, gpu_uuid="GPU-c", gpu_uuids=["GPU-c", "GPU-d"], cpu={"model": "AMD EPYC"})
    assert protocol.case_key(case, env, ccfg) == protocol.case_key(case, other, ccfg)
    assert "gpu_uuid" not in protocol.ENV_KEY and "cpu" not in protocol.ENV_KEY


@pytest.mark.parametrize("flags,expected", [("avx2 fma", []), ("amx_tile avx512f", ["amx_tile", "avx512f"])])
def test_isa_list_is_sorted_and_only_avx512_amx(flags, expected):
    assert provenance.isa_flags(flags.split())["isa"] == expected
