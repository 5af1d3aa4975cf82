"""Controller side: which devices the engines get — one rank per GPU (NCCL), several ranks sharing a GPU (virtual EP,
gloo), or CPU engines (gloo) — checked before anything starts, memory per GPU included."""

from __future__ import annotations

import logging
import re

from ..config import ClusterConfig

logger = logging.getLogger(__name__)


def visible_gpus() -> int:
    """GPUs torch can see from the controller (0 without CUDA), without importing torch where that can be known
    otherwise: a torch built without CUDA or ROCm sees none, which its version file says (importing torch takes 1.5 s
    on a 2-core CPU, paid by every command that picks the device itself); a CUDA build with every GPU visible (no
    CUDA_VISIBLE_DEVICES) and no MIG sees the GPUs the driver's NVML counts — seconds a cold GPU command would
    otherwise spend importing torch before its engines start. Any other build or setting is asked, importing torch."""
    if _torch_build() == (None, None):
        return 0
    names = _nvml_names()
    if names is not None:
        return len(names)
    import torch

    return torch.cuda.device_count() if torch.cuda.is_available() else 0


def _nvml_names() -> list[str] | None:
    """The names of the GPUs CUDA numbers as NVML does, from NVML's Python binding, where that holds without
    asking CUDA: a CUDA build of torch, every GPU visible (no CUDA_VISIBLE_DEVICES), none in MIG mode, and all of one
    kind (CUDA's default order, fastest first, then matches NVML's in every name). None otherwise, or without the
    binding or a driver."""
    import os

    build = _torch_build()
    if not (build and build[0]) or "CUDA_VISIBLE_DEVICES" in os.environ:
        return None
    try:
        import pynvml
    except ImportError:
        return None
    try:
        pynvml.nvmlInit()
    except Exception:  # noqa: BLE001 - no driver: torch is asked, and says so
        return None
    try:
        names = []
        for i in range(pynvml.nvmlDeviceGetCount()):
            h = pynvml.nvmlDeviceGetHandleByIndex(i)
            try:
                if pynvml.nvmlDeviceGetMigMode(h)[0]:
                    return None
            except pynvml.NVMLError:  # a GPU without MIG support
                pass
            name = pynvml.nvmlDeviceGetName(h)
            names.append(name.decode() if isinstance(name, bytes) else str(name))
        return names if len(set(names)) <= 1 else None
    except Exception:  # noqa: BLE001 - any NVML failure: torch is asked
        return None
    finally:
        try:
            pynvml.nvmlShutdown()
        except Exception:  # noqa: BLE001
            pass


_BUILD = re.compile(r"""^(cuda|hip)\s*(?::[^=\n]*)?=\s*(None|'[^'\n]*'|"[^"\n]*")\s*$""", re.M)


def _torch_build() -> tuple | None:
    """(cuda, hip) as the installed torch's torch/version.py sets them, each a version string or None; None where
    the file cannot be found or read as expected (then torch itself is asked)."""
    import importlib.util
    from pathlib import Path

    try:
        spec = importlib.util.find_spec("torch")
        if spec is None or not spec.origin:
            return None
        text = (Path(spec.origin).parent / "version.py").read_text()
    except (OSError, ImportError, ValueError):
        return None
    found = {k: (None if v == "None" else v.strip("'\"")) for k, v in _BUILD.findall(text)}
    return (found["cuda"], found["hip"]) if found.keys() == {"cuda", "hip"} else None


def gpu_name(index: int = 0) -> str | None:
    """The name torch gives GPU `index` ("NVIDIA H200"), as the engines report it; None without CUDA. NVML's name
    where it is CUDA's (`_nvml_names`: the controller need not import torch), else torch's."""
    names = _nvml_names()
    if names and index < len(names):
        return names[index]
    import torch

    if not torch.cuda.is_available():
        return None
    return torch.cuda.get_device_name(index)


def _count(name: str, value, *, allow_none: bool = True) -> None:
    if value is None and allow_none:
        return
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


def default_config(device: str | None = None, engines: int | None = None, *, gpus: int | None = None,
                   n_gpu: int | None = None, **kw) -> ClusterConfig:
    """The cluster for `engines` ranks on `device` (default: cuda if a GPU is visible, else 4 CPU engines).

    cuda: the ranks are spread evenly over `gpus` GPUs (default: all visible, or fewer when there are fewer
    engines): engines = GPUs → one rank per GPU on NCCL; engines = k x GPUs → k ranks share each GPU over gloo
    (virtual EP). Anything else is refused with the rule. `n_gpu` overrides the visible count (tests).
    With a launcher other than 'local' the engines run elsewhere: device and engines must be given, and each node
    checks its own GPUs when its engines join (engine.dist.setup).
    """
    _count("engines", engines)
    _count("gpus", gpus)
    if kw.get("launcher", "local") != "local":
        if device is None or not engines:
            raise ValueError(f"launcher ({kw['launcher']!r}) starts engines on other machines: give device "
                             f"({device!r}) and engines ({engines!r}) explicitly, e.g. device='cuda', engines=16")
        return ClusterConfig(device=device, engines=engines, **kw)
    if n_gpu is None:
        n_gpu = visible_gpus() if device in (None, "cuda") else 0
    if device is None:
        device = "cuda" if n_gpu else "cpu"
    if device != "cuda":
        if gpus is not None:
            raise ValueError(f"gpus ({gpus}) applies to device 'cuda' only")
        return ClusterConfig(device=device, engines=engines or 4, **kw)
    if n_gpu == 0:
        raise ValueError("device ('cuda') needs a GPU, but torch sees none; use device='cpu'")
    if gpus is not None and gpus > n_gpu:
        raise ValueError(f"gpus ({gpus}) must be <= the visible GPUs ({n_gpu})")
    used = gpus or (min(engines, n_gpu) if engines else n_gpu)
    engines = engines or used
    if engines % used:
        raise ValueError(f"engines ({engines}) must be a multiple of the GPUs used ({used}): each GPU gets the same "
                         f"number of ranks, e.g. engines {used} (one rank per GPU) or {2 * used} (2 per GPU, "
                         "virtual EP)")
    return ClusterConfig(device="cuda", engines=engines, ranks_per_gpu=engines // used, **kw)


def gpu_free_bytes(n: int) -> list[int]:
    """Free memory of the first `n` GPUs, bytes: NVML's Python binding, else `nvidia-smi`, else torch (a CUDA
    context on each GPU, made by the controller before any engine: seconds on a cold start, and memory held)."""
    got = _driver_bytes(n, "free")
    if got is not None:
        return got
    import torch

    return [int(torch.cuda.mem_get_info(i)[0]) for i in range(n)]


def gpu_total_bytes(n: int) -> list[int] | None:
    """Total memory of the first `n` visible GPUs, bytes (NVML's Python binding, else `nvidia-smi`); None where
    neither says (no torch here: a cold command must not make a CUDA context for it)."""
    return _driver_bytes(n, "total")


def _driver_bytes(n: int, field: str) -> list[int] | None:
    """`field` ('free', 'total') of the first `n` visible GPUs' memory, bytes, as the driver says it: NVML's Python
    binding, else `nvidia-smi`; None where neither does (or CUDA_VISIBLE_DEVICES names fewer than `n`)."""
    import os

    vis = os.environ.get("CUDA_VISIBLE_DEVICES")
    idx = [int(x) for x in vis.split(",") if x.strip().isdigit()][:n] if vis else list(range(n))
    if len(idx) != n:
        return None
    try:
        import pynvml

        pynvml.nvmlInit()
        try:
            return [int(getattr(pynvml.nvmlDeviceGetMemoryInfo(pynvml.nvmlDeviceGetHandleByIndex(i)), field))
                    for i in idx]
        finally:
            pynvml.nvmlShutdown()
    except Exception:  # noqa: BLE001 - no NVML binding: the driver's own tool
        pass
    got = _smi_bytes(f"memory.{field}")
    return [got[i] for i in idx] if got and all(i in got for i in idx) else None


def _smi_bytes(field: str) -> dict[int, int] | None:
    """{NVML index: `field` (memory.free, memory.total) in bytes} from `nvidia-smi` (indices as NVML numbers them, as
    the binding's above); None where it is missing, fails or says something else."""
    import shutil
    import subprocess

    smi = shutil.which("nvidia-smi")
    if not smi:
        return None
    try:
        out = subprocess.run([smi, f"--query-gpu=index,{field}", "--format=csv,noheader,nounits"],
                             capture_output=True, text=True, timeout=30, stdin=subprocess.DEVNULL)
        if out.returncode != 0:
            return None
        rows = [line.split(",") for line in out.stdout.strip().splitlines()]
        return {int(i): int(float(f)) * 2 ** 20 for i, f in rows}
    except (OSError, ValueError, subprocess.TimeoutExpired):
        return None


def from_settings(settings, *, engines: int | None = None) -> ClusterConfig:
    """The cluster of a run config's `ClusterSettings` (plain data; `engines` overrides its own), built when a cluster
    is about to start or by the runner's preflight before anything launches: the GPUs are probed here (never when a
    profile loads), a side-by-side release is looked up, and a launcher and its options are checked."""
    from .launchers import launcher_settings

    if settings.megatron:
        from ..release_dirs import path_for

        path_for(settings.megatron)  # installed side by side? (one line saying how if not)
    ccfg = default_config(device=settings.device, engines=engines or default_engines(settings), gpus=settings.gpus,
                          timeout_s=float(settings.timeout_s),
                          start_timeout_s=float(settings.start_timeout_s), launcher=settings.launcher,
                          launcher_options=settings.options())
    launcher_settings(ccfg)
    return ccfg


def default_engines(settings) -> int | None:
    """A `ClusterSettings`' engines; 0 means the device's default: one per GPU — or, on a machine with ONE GPU,
    `one_gpu_engines` ranks sharing it (virtual EP: the seed report's EP=4 on one GPU); 4 on CPU."""
    if settings.engines:
        return settings.engines
    if settings.device == "cuda" and settings.one_gpu_engines and settings.launcher == "local":
        if visible_gpus() == 1:
            return int(settings.one_gpu_engines)
    return None


__all__ = ["visible_gpus", "gpu_name", "default_config", "gpu_free_bytes", "gpu_total_bytes", "from_settings",
           "default_engines"]
