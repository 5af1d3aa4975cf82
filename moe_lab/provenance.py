"""Where a number came from: moe_lab version and git commit, torch / CUDA / cuBLAS / NCCL / driver / GPU, megatron-core,
and the environment variables and torch switches that change numerics (#14). Runs on both sides: the controller
adds the commit, each engine its own libraries and switches (they are what its kernels ran under)."""

from __future__ import annotations

import functools
import hashlib
import os
import subprocess
from pathlib import Path

NUMERICS_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO", "NCCL_PROTO", "NCCL_NVLS_ENABLE", "NCCL_MIN_NCHANNELS",
                "NCCL_MAX_NCHANNELS", "TORCH_NCCL_ASYNC_ERROR_HANDLING", "NVIDIA_TF32_OVERRIDE",
                "TORCH_ALLOW_TF32_CUBLAS_OVERRIDE", "CUBLASLT_WORKSPACE_SIZE", "TORCH_BLAS_PREFER_CUBLASLT",
                "TORCH_SYMM_MEM_DISABLE_MULTICAST", "NVSHMEM_DISABLE_NVLS", "OMP_NUM_THREADS")
"""Environment variables that change which kernels run or how they reduce; recorded with every measurement."""

PACKAGE = Path(__file__).resolve().parent


@functools.lru_cache(maxsize=1)
def code_version() -> dict:
    """moe_lab's version, git commit and whether the tree was dirty, and a hash of the package's sources (what a
    resumed run must share with the records it reuses)."""
    from . import __version__

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


__all__ = ["code_version", "numerics_env", "torch_switches", "cuda_libraries", "NUMERICS_ENV"]
