"""Where a number came from: moe_lab version and git commit, torch / CUDA / cuBLAS / NCCL / driver / GPU (name and
UUID), the CPU (model, the ISA flags that pick kernels, torch's CPU capability, the oneDNN / BLAS build: CPU GEMMs are
batch invariant on some CPUs only), megatron-core, and the environment variables and torch switches that change
numerics. Runs on both sides: the controller adds the commit, each engine its own libraries and switches (they
are what its kernels ran under)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

NUMERICS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_MIN_NCHANNELS",
                "NCCL_MAX_NCHANNELS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NVIDIA_TF32_OVERRIDE",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLASLT_WORKSPACE_SIZE", "TORCH_BLAS_PREFER_CUBLASLT",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "OMP_NUM_THREADS", "ONEDNN_MAX_CPU_ISA",
                "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS", "ATEN_CPU_CAPABILITY",
                "MOE_LAB_NO_CPU_BF16")
"""Environment variables that change which kernels run or how they reduce; recorded with every measurement."""
CPU_ENV = ("ONEDNN_MAX_CPU_ISA", "DNNL_MAX_CPU_ISA", "ONEDNN_DEFAULT_FPMATH_MODE", "MKL_ENABLE_INSTRUCTIONS",
           "ATEN_CPU_CAPABILITY", "MOE_LAB_NO_CPU_BF16")
"""Of those, the ones that pick the CPU's kernels (oneDNN's ISA cap and fp32 math mode, MKL's, ATen's vector ISA)."""

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """moe_lab's version, git commit and whether the tree was dirty, and a hash of the package's sources (what a
    resumed run must share with the records it reuses)."""
    from .version import __version__

    h = hashlib.sha256()
    for f in sorted(PACKAGE.rglob("*.py")) + sorted(PACKAGE.rglob("*.json")):
        h.update(f.relative_to(PACKAGE).as_posix().encode())
        h.update(f.read_bytes())
    out = {"moe_lab": __version__, "source_sha": h.hexdigest()[:16], "commit": None, "dirty": None}
    if os.environ.get("MOE_LAB_COMMIT"):  # set by whoever copied the tree to a machine without its git history
        return {**out, "commit": os.environ["MOE_LAB_COMMIT"], "dirty": None}
    root = PACKAGE.parent
    try:
        out["commit"] = subprocess.run(["git", "-C", str(root), "rev-parse", "--short=12", "HEAD"], capture_output=True,
                                       text=True, timeout=5, check=True).stdout.strip() or None
        st = subprocess.run(["git", "-C", str(root), "status", "--porcelain", "--untracked-files=no", "--", "moe_lab"],
                            capture_output=True, text=True, timeout=5, check=True).stdout
        out["dirty"] = bool(st.strip())
    except (OSError, subprocess.SubprocessError):
        pass  # not a git checkout (an installed wheel): the source hash still identifies the code
    return out


def numerics_env() -> dict:
    """The NUMERICS_ENV variables set in this process (unset ones are left out)."""
    return {k: os.environ[k] for k in NUMERICS_ENV if k in os.environ}


def torch_switches() -> dict:
    """torch's process-wide switches that change kernels or their reduction order."""
    import torch

    m = torch.backends.cuda.matmul
    out = {"deterministic_algorithms": torch.are_deterministic_algorithms_enabled(),
           "allow_tf32": bool(m.allow_tf32), "float32_matmul_precision": torch.get_float32_matmul_precision()}
    for name in ("allow_bf16_reduced_precision_reduction", "allow_fp16_reduced_precision_reduction"):
        v = getattr(m, name, None)
        out[name] = v if isinstance(v, bool) else str(v)
        if hasattr(m, name + "_split_k"):
            out[name + "_split_k"] = bool(getattr(m, name + "_split_k"))
    if torch.cuda.is_available():
        try:
            out["preferred_blas_library"] = str(torch.backends.cuda.preferred_blas_library()).rsplit(".", 1)[-1]
        except Exception:  # noqa: BLE001 - older torch
            pass
    return out


def cuda_libraries() -> dict:
    """CUDA runtime torch was built with, cuBLAS and driver versions, where they can be read (None elsewhere)."""
    import importlib.metadata

    import torch

    out = {"cuda": torch.version.cuda, "cublas": None, "driver": None}
    for dist in ("nvidia-cublas", "nvidia-cublas-cu13", "nvidia-cublas-cu12"):
        try:
            out["cublas"] = importlib.metadata.version(dist)
            break
        except importlib.metadata.PackageNotFoundError:
            continue
    try:  # "NVRM version: NVIDIA UNIX Open Kernel Module for x86_64  580.159.04  Release Build ..."
        import re

        m = re.search(r"Kernel Module.*?\s(\d+\.\d+(?:\.\d+)?)\s", Path("/proc/driver/nvidia/version").read_text())
        out["driver"] = m.group(1) if m else None
    except OSError:
        pass
    return out


def parse_cpuinfo(text: str) -> dict:
    """The first processor's model name and flags in /proc/cpuinfo's text ('Features' on Arm)."""
    model, flags = None, None
    for line in text.splitlines():
        key, sep, val = line.partition(":")
        key = key.strip()
        if not sep:
            continue
        if key == "model name" and model is None:
            model = val.strip() or None
        elif key in ("flags", "Features") and flags is None:
            flags = val.split()
        if model is not None and flags is not None:
            break
    return {"model": model, "flags": flags or []}


def isa_flags(flags) -> dict:
    """The CPU flags that decide which GEMM kernels run: every avx512* and amx* flag (sorted), avx2 and fma."""
    fl = set(flags)
    return {"isa": sorted(f for f in fl if f.startswith(("avx512", "amx"))), "avx2": "avx2" in fl, "fma": "fma" in fl}


def parse_torch_config(text: str) -> dict:
    """oneDNN / MKL versions and the BLAS / LAPACK names from `torch.__config__.show()`."""
    import re

    def find(pattern):
        m = re.search(pattern, text)
        return m.group(1) if m else None

    return {"onednn": find(r"(?:MKL-DNN|oneDNN)\s+v?([0-9][\w.]*)"),
            "mkl": find(r"Math Kernel Library Version\s+([0-9][\w.]*)"),
            "blas": find(r"BLAS_INFO=([^,\s]+)"), "lapack": find(r"LAPACK_INFO=([^,\s]+)")}


@functools.lru_cache(maxsize=1)
def _torch_cpu_build() -> dict:
    import torch

    cpu = getattr(torch.backends, "cpu", None)
    try:
        capability = cpu.get_cpu_capability() if cpu is not None else None
    except Exception:  # noqa: BLE001 - a torch without it
        capability = None
    try:
        build = parse_torch_config(torch.__config__.show())
    except Exception:  # noqa: BLE001
        build = parse_torch_config("")
    return {"capability": capability, "mkldnn": bool(torch.backends.mkldnn.is_available()), **build}


def cpu_info(*, with_torch: bool = True) -> dict:
    """The CPU a number was measured on: its model, the ISA flags that pick kernels (`isa_flags`), the CPU_ENV
    variables set, and, with torch importable (and `with_torch`), torch's CPU capability (its vector ISA), whether
    oneDNN is there, and the oneDNN / MKL / BLAS build. Usable on the controller without torch (with_torch=False,
    or torch missing: the torch fields are left out)."""
    import platform

    try:
        text = Path("/proc/cpuinfo").read_text()
    except OSError:
        text = ""
    p = parse_cpuinfo(text)
    out = {"model": p["model"] or platform.processor() or platform.machine() or None, **isa_flags(p["flags"]),
           "env": {k: os.environ[k] for k in CPU_ENV if k in os.environ}}
    if with_torch:
        try:
            import torch  # noqa: F401
        except ImportError:
            return out
        out.update(_torch_cpu_build())
    return out


def gpu_uuid(index) -> str | None:
    """The UUID of CUDA device `index` as torch reports it (tells apart GPUs of the same name), or None."""
    import torch

    try:
        u = getattr(torch.cuda.get_device_properties(index), "uuid", None)
    except Exception:  # noqa: BLE001 - no such device, or a torch without it
        return None
    return str(u) if u is not None else None


__all__ = ["code_version", "numerics_env", "torch_switches", "cuda_libraries", "cpu_info", "gpu_uuid",
           "parse_cpuinfo", "isa_flags", "parse_torch_config", "NUMERICS_ENV", "CPU_ENV"]
