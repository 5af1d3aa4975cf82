"""Runs on engines: process group, megatron parallel_state, health check, teardown. One engine = one rank."""

from __future__ import annotations

import datetime
import faulthandler
import logging
import os
import platform
import signal
import socket
import sys
import threading
import time

logger = logging.getLogger(__name__)

# Engine-process state. `rank` is the torch.distributed rank, never the ipyparallel engine id.
STATE: dict = {}
GLOO_LAZY_INIT = "TORCH_GLOO_LAZY_INIT"  # torch's switch: gloo groups connect at their first collective
# What a launcher tells each process it starts (mpiexec: Open MPI / MPICH / PMIx; srun: Slurm): reported by identify.
LAUNCHER_ENV = ("OMPI_COMM_WORLD_RANK", "OMPI_COMM_WORLD_LOCAL_RANK", "OMPI_COMM_WORLD_SIZE", "PMI_RANK", "PMI_SIZE",
                "PMIX_RANK", "SLURM_JOB_ID", "SLURM_PROCID", "SLURM_LOCALID", "SLURM_NODEID", "CUDA_VISIBLE_DEVICES")


def free_port() -> int:
    """A TCP port free on this host right now (the OS picks; a busy one is never returned)."""
    with socket.socket(socket.AF_INET, socket.SOCK_STREAM) as s:
        s.bind(("", 0))
        return s.getsockname()[1]


def identify(stack_file: str | None = None) -> dict:
    """Where this engine runs (pid, host, main thread), so the controller can watch it; the first call on an engine.

    With `stack_file`, SIGUSR1 makes the engine append every thread's Python stack to it, even while it is blocked
    in a collective: the controller uses that to say which rank waits where when a call hangs.
    """
    if stack_file:
        old = STATE.pop("stack_fh", None)
        os.makedirs(os.path.dirname(stack_file), exist_ok=True)
        STATE["stack_fh"] = open(stack_file, "a")  # kept open: faulthandler writes to its fd from a signal handler
        faulthandler.register(signal.SIGUSR1, file=STATE["stack_fh"], all_threads=True, chain=False)
        if old is not None:
            old.close()
    return {"pid": os.getpid(), "node": platform.node(), "address": host_address(),
            "main_thread": threading.main_thread().ident, "stack_file": stack_file,
            "launcher_env": launcher_env()}


def launcher_env() -> dict:
    """The variables a launcher set for this process (see LAUNCHER_ENV): shows how the engine was started."""
    return {k: os.environ[k] for k in LAUNCHER_ENV if k in os.environ}


def open_store(*, world: int, timeout_s: float, port: int = 0) -> int:
    """Rank 0: open the rendezvous TCPStore and return its port. `port=0` lets the OS pick a free one, held from
    here on, so no other process can take it before the others connect; a busy `port` falls back to that."""
    from torch.distributed import TCPStore

    timeout = datetime.timedelta(seconds=timeout_s)
    try:
        store = TCPStore("0.0.0.0", port, world, True, timeout=timeout, wait_for_workers=False)
    except Exception as e:  # noqa: BLE001 - torch raises DistNetworkError (a RuntimeError) on EADDRINUSE
        if not port:
            raise
        logger.warning("rendezvous port %d is busy (%s); using one the OS picks", port, str(e).splitlines()[0][:200])
        store = TCPStore("0.0.0.0", 0, world, True, timeout=timeout, wait_for_workers=False)
    STATE["store"] = store
    return store.port


def host_address() -> str:
    """An address of this host that engines on other hosts can reach: the host name's address, unless that is
    loopback (Debian maps the host name to 127.0.1.1 in /etc/hosts), then the first IPv4 address of an interface
    that is up and not loopback. Nothing is sent to find it. 127.0.0.1 when there is none."""
    try:
        addr = socket.gethostbyname(socket.gethostname())
    except OSError:
        addr = ""
    if addr and not addr.startswith("127."):
        return addr
    return _interface_address() or "127.0.0.1"


def _interface_address() -> str | None:
    import psutil

    stats = psutil.net_if_stats()
    for name, addrs in sorted(psutil.net_if_addrs().items()):
        if name == "lo" or name.startswith(("docker", "veth", "virbr", "br-")) or not getattr(
                stats.get(name), "isup", False):
            continue
        for a in addrs:
            if a.family == socket.AF_INET and not a.address.startswith("127."):
                return a.address
    return None


NO_CPU_BF16_ENV = "MOE_LAB_NO_CPU_BF16"
"""Set to 1 in the environment of `moe-lab run` (the engines inherit it): CPU engines run bf16 GEMMs as a CPU without
bf16 instructions does (see `prepare`)."""


def prepare(*, device: str, extra_path: tuple = (), env: dict | None = None, deterministic: bool = False) -> float:
    """Environment and the slow imports (torch, megatron-core), before the rendezvous: engines finish them at
    different times, and the process-group timeout should not have to cover that. Returns seconds taken."""
    t0 = time.perf_counter()
    asked = (device, tuple(extra_path), tuple(sorted((env or {}).items())), bool(deterministic))
    done = STATE.setdefault("prepared", asked)
    if done != asked:
        # torch and megatron-core are imported once per process: another release or environment cannot follow
        raise RuntimeError(f"this engine was prepared for {_said(done)}; it cannot be prepared for {_said(asked)} "
                           "(start engines for it: Cluster.restart_engines)")
    for p in reversed(extra_path):
        if p not in sys.path:
            sys.path.insert(0, p)
    os.environ.update(env or {})
    if device == "cuda":
        # NVLink multicast stays off on shared hosts (KINDS.md); Ring keeps NCCL reductions in a fixed order.
        os.environ.setdefault("NCCL_NVLS_ENABLE", "0")
        os.environ.setdefault("TORCH_NCCL_ASYNC_ERROR_HANDLING", "1")
        if deterministic:
            os.environ["NCCL_ALGO"] = "Ring"
            os.environ.setdefault("CUBLAS_WORKSPACE_CONFIG", ":4096:8")
    import torch.distributed  # noqa: F401
    from megatron.core import parallel_state  # noqa: F401

    from .. import switches

    if device == "cpu" and switches.forced(NO_CPU_BF16_ENV):
        # torch's CPU build sends a bf16 GEMM to oneDNN only where the CPU has bf16 instructions; elsewhere (AVX2
        # only) it takes its own slow loop. Turning oneDNN off takes that loop on any CPU: the AVX2 machines' speed,
        # for sizing and benchmarks (docs/bench.md), with ATEN_CPU_CAPABILITY=avx2 for their vector width.
        torch.backends.mkldnn.enabled = False

    from . import compat, shims  # noqa: F401 - imported with megatron-core (engine warm-up)

    return time.perf_counter() - t0


def _said(prepared: tuple) -> str:
    device, path, env, deterministic = prepared
    return (f"device {device}, release path {list(path) or 'none'}, environment {dict(env) or 'none'}"
            f"{', deterministic' if deterministic else ''}")


SHARE_CORES = "MOE_LAB_SHARE_CORES"


def threads_for(local_world: int | None) -> int:
    """A GPU engine's torch threads: its node's cores split between the engines there. torch's default (every core)
    in each of them oversubscribes the node as soon as ranks do CPU work at once (the host side of gloo's collectives
    on virtual EP, the fp64 statistics), and idle OpenMP threads spin on the cores gloo's own threads need."""
    try:
        cores = len(os.sched_getaffinity(0))
    except (AttributeError, OSError):  # not Linux
        cores = os.cpu_count() or 1
    return max(1, cores // max(1, local_world or 1))


def setup(*, rank: int, world: int, master_addr: str, master_port: int, device: str, timeout_s: float,
          extra_path: tuple = (), env: dict | None = None, deterministic: bool = False,
          local_rank: int | None = None, local_world: int | None = None, ranks_per_gpu: int = 1) -> dict:
    """Join the process group and set up megatron parallel_state (EP over the whole world: every case sets its own
    layout's before it runs, `engine.layer.parallel_state_for`).

    Backend: NCCL with one rank per GPU; gloo on CPU and when `ranks_per_gpu` > 1 ranks share a GPU (virtual EP:
    NCCL refuses two ranks on one device, gloo runs every collective megatron's dispatchers use on CUDA tensors,
    staged through the host, but for the all-to-alls, which the ranks' shared buffers carry: engine.ipc_collectives).
    `local_rank` / `local_world`: this engine's index among the engines on its node, and
    how many run there (the controller knows them from every engine's node); the GPU follows from them.
    """
    t0 = time.perf_counter()
    prepare(device=device, extra_path=extra_path, env=env, deterministic=deterministic)
    import torch
    import torch.distributed as tdist

    from .. import switches
    from . import compat, ipc_collectives, shims

    if device == "cuda":
        gpu = gpu_index(rank=rank, local_rank=local_rank, local_world=local_world, n_gpu=torch.cuda.device_count(),
                        ranks_per_gpu=ranks_per_gpu)
        torch.cuda.set_device(gpu)
        dev = torch.device("cuda", gpu)
        backend = "nccl" if ranks_per_gpu == 1 else "gloo"
        if switches.forced(SHARE_CORES) is not False:
            torch.set_num_threads(threads_for(local_world))
        shims.fix_missing_te()
        if backend == "gloo":
            shims.apply_gloo_shims()
            ipc_collectives.install(device)
    else:
        torch.set_num_threads(1)  # N engines share the cores; oversubscription only slows every rank
        shims.apply_cpu_shims()
        ipc_collectives.install(device)
        dev = torch.device("cpu")
        backend = "gloo"
        gpu = None
    local_rank = rank if local_rank is None else local_rank
    timeout = datetime.timedelta(seconds=timeout_s)
    store = STATE.pop("store", None) if rank == 0 else None
    if store is None or store.port != master_port:  # rank 0 normally holds the store from open_store()
        store = tdist.TCPStore(master_addr, master_port, world, rank == 0, timeout=timeout, wait_for_workers=False)
    if backend == "gloo":
        # A gloo group connects its ranks at its first collective, not when it is made: megatron makes ~20 groups
        # per layout (pipeline, context, embedding, ...) of which a MoE layer uses a few, and every layout switch
        # makes them again (measured on 4 CPU engines: 0.41 → 0.18 s a switch). Set before any group exists.
        os.environ.setdefault(GLOO_LAZY_INIT, "1")
    kwargs = dict(backend=backend, store=store, rank=rank, world_size=world, timeout=timeout)
    if backend == "nccl":
        kwargs["device_id"] = dev  # eager NCCL init: a bad GPU fails here, not in the first collective
    tdist.init_process_group(**kwargs)
    t_pg = time.perf_counter() - t0
    STATE.update(rank=rank, world=world, device=device, torch_device=dev, backend=backend, gpu_index=gpu,
                 local_rank=local_rank, ranks_per_gpu=ranks_per_gpu, timeout_s=timeout_s, host=platform.node(),
                 layers={})
    init_parallel_state(tp=1, ep=world)
    t_warm = warm_up() if device == "cuda" else 0.0
    info = describe()
    info.update(t_process_group_s=t_pg, t_warm_up_s=t_warm, t_setup_s=time.perf_counter() - t0)
    return info


def warm_up() -> float:
    """A process's one-time GPU costs, paid at bring-up instead of by the first question: cuBLAS / cuBLASLt handles
    and workspaces (GEMMs in bf16, fp32, fp64), the kernels a MoE forward uses first (softmax, top-k, sort,
    scatter/index add), and the process group's collectives on device tensors (gloo stages them through pinned host
    buffers). Small shapes; returns seconds taken."""
    import torch
    import torch.distributed as tdist

    t0 = time.perf_counter()
    dev, world = STATE["torch_device"], STATE["world"]
    for dt in (torch.bfloat16, torch.float32, torch.float64):
        a = torch.randn(256, 512, device=dev, dtype=dt)
        w = torch.randn(1024, 512, device=dev, dtype=dt)
        torch.nn.functional.linear(a, w).sum()
        (a.t() @ a).sum()
    logits = torch.randn(256, 64, device=dev).softmax(-1)
    probs, idx = torch.topk(logits, 6, dim=-1)
    order = idx.flatten().argsort(stable=True)
    out = torch.zeros(256, 512, device=dev, dtype=torch.bfloat16)
    src = torch.randn(order.numel(), 512, device=dev, dtype=torch.bfloat16)
    out.index_add_(0, order % 256, src)
    out.scatter_add_(0, (order % 256)[:, None].expand(-1, 512), src)
    x = torch.randn(world * 64, 512, device=dev, dtype=torch.bfloat16)
    y = torch.empty(world * x.shape[0], 512, device=dev, dtype=torch.bfloat16)
    tdist.all_gather_into_tensor(y, x)
    tdist.reduce_scatter_tensor(x, y)
    tdist.all_to_all_single(torch.empty_like(x), x)
    tdist.all_reduce(probs.float().sum(0))
    if dev.type == "cuda":
        torch.cuda.synchronize(dev)
    return time.perf_counter() - t0


def gpu_index(*, rank: int, local_rank: int | None, local_world: int | None, n_gpu: int,
              ranks_per_gpu: int = 1) -> int:
    """The GPU of this engine among the `n_gpu` it sees: local_rank // ranks_per_gpu when its node has a GPU for each
    group of `ranks_per_gpu` engines; 0 when the launcher gave each engine one GPU of its own (e.g.
    `srun --gpus-per-task=1`: each sees one); rank % GPUs without a local rank (one node). Anything else is refused,
    naming the node."""
    node = platform.node()
    if n_gpu == 0:
        raise RuntimeError(f"rank {rank}: device='cuda' but torch sees no GPU on {node}")
    if local_rank is None:
        return (rank // ranks_per_gpu) % n_gpu
    need = -(-(local_world or 1) // ranks_per_gpu)
    if n_gpu >= need:
        return local_rank // ranks_per_gpu
    if n_gpu == 1 and ranks_per_gpu == 1:
        return 0
    raise RuntimeError(f"rank {rank}: {local_world} engines run on {node} at {ranks_per_gpu} per GPU, but this engine "
                       f"sees {n_gpu} GPU(s): start at most {n_gpu * ranks_per_gpu} engines on each node")


def init_parallel_state(*, tp: int, ep: int, etp: int | None = None) -> None:
    """(Re)initialise megatron parallel_state for (tp, ep, etp) if it differs from the current layout (etp None:
    megatron's default, = tp)."""
    from megatron.core import parallel_state as ps

    etp = etp or tp
    if STATE.get("parallel") == (tp, ep, etp) and ps.model_parallel_is_initialized():
        return
    if ps.model_parallel_is_initialized():
        ps.destroy_model_parallel()
        STATE["layers"], STATE["stacks"] = {}, {}  # they hold the old groups: drop them before the groups go
        _destroy_groups(STATE.pop("megatron_groups", ()))
        from . import ipc_collectives

        ipc_collectives.forget_groups()  # the old layout's buffers: room for the next layout's layer
    before = _process_groups()
    from . import compat

    kw = {} if etp == tp else {"expert_tensor_parallel_size": etp}  # the seed layout calls megatron as before
    kw.update(compat.parallel_state_kwargs(STATE.get("backend")))
    ps.initialize_model_parallel(tensor_model_parallel_size=tp, expert_model_parallel_size=ep, **kw)
    STATE["megatron_groups"] = [g for g in _process_groups() if g not in before]
    if STATE["device"] == "cuda":  # (also when ranks share a GPU: the seed only sets RNG states)
        from megatron.core import tensor_parallel

        tensor_parallel.model_parallel_cuda_manual_seed(1234)
    STATE["parallel"] = (tp, ep, etp)
    STATE["layers"] = {}
    STATE["stacks"] = {}


def _process_groups() -> list:
    from torch.distributed import distributed_c10d as c10d

    return list(c10d._world.pg_map)


def _destroy_groups(groups) -> None:
    """Destroy the process groups megatron made for the previous layout. `destroy_model_parallel` only forgets them:
    each gloo group keeps its threads, and a case that switches layouts (notebook 01's layouts: ~20 groups a switch)
    would leave hundreds of busy threads per engine (measured: ~890 after the layout tests, the machine then spent
    three quarters of its time in the kernel). Every rank destroys the same groups in the same order."""
    import torch.distributed as tdist

    for g in groups:
        try:
            tdist.destroy_process_group(g)
        except (ValueError, RuntimeError) as e:  # already gone (megatron destroys its gloo DP groups itself)
            logger.debug("process group %r not destroyed: %s", g, e)


def thread_count() -> int:
    """This process's OS threads (Linux /proc; -1 elsewhere): what a leak of process groups shows in."""
    try:
        with open("/proc/self/status") as f:
            return next(int(line.split()[1]) for line in f if line.startswith("Threads:"))
    except (OSError, StopIteration, ValueError):
        return -1


def describe() -> dict:
    """Versions, placement and numerics switches of this rank, for every result record."""
    import torch
    import torch.distributed as tdist
    from megatron.core import parallel_state as ps

    from .. import provenance, stats
    from . import compat, ipc_collectives

    cuda = STATE.get("device") == "cuda"
    nccl = None
    if cuda:
        try:
            nccl = ".".join(map(str, torch.cuda.nccl.version()))
        except Exception:  # noqa: BLE001 - a torch without NCCL reports none
            nccl = None
    libs = provenance.cuda_libraries() if cuda else {"cuda": None, "cublas": None, "driver": None}
    rpg = STATE.get("ranks_per_gpu", 1)
    transport = ipc_collectives.describe()
    return {
        "rank": tdist.get_rank(),
        "world": tdist.get_world_size(),
        "backend": tdist.get_backend(),
        "device": STATE.get("device"),
        "gpu": torch.cuda.get_device_name(STATE["gpu_index"]) if cuda else None,
        "gpu_uuid": provenance.gpu_uuid(STATE["gpu_index"]) if cuda else None,
        "gpu_index": STATE.get("gpu_index"),
        "gpu_memory_bytes": torch.cuda.get_device_properties(STATE["gpu_index"]).total_memory if cuda else None,
        "ranks_per_gpu": rpg if cuda else None,
        "placement": ("one rank per GPU" if rpg == 1 else f"{rpg} ranks share each GPU (virtual EP)"
                      + stats.carried(transport)) if cuda
        else f"{tdist.get_world_size()} CPU engines" + stats.carried(transport),
        "transport": transport,
        "host": STATE.get("host"),
        "local_rank": STATE.get("local_rank"),
        "pid": os.getpid(),
        "python": platform.python_version(),
        "torch": str(torch.__version__),  # a plain str: unpickling TorchVersion imports torch in the kernel
        **libs,
        "megatron_core": compat.installed_version(),
        "megatron_path": os.path.dirname(sys.modules["megatron.core"].__file__),
        "nccl": nccl,
        "tp": ps.get_tensor_model_parallel_world_size(),
        "ep": ps.get_expert_model_parallel_world_size(),
        "ep_rank": ps.get_expert_model_parallel_rank(),
        "env": provenance.numerics_env(),
        "switches": provenance.torch_switches(),
        "cpu": provenance.cpu_info(),
        "torch_threads": torch.get_num_threads(),  # a GPU engine's share of its node's cores (threads_for)
    }


def health_check() -> dict:
    """An all-reduce whose result every rank verifies: sum of (rank + 1) over ranks = world (world + 1) / 2."""
    import torch
    import torch.distributed as tdist

    t0 = time.perf_counter()
    rank, world = tdist.get_rank(), tdist.get_world_size()
    x = torch.tensor([float(rank + 1)], device=STATE["torch_device"], dtype=torch.float64)
    tdist.all_reduce(x)
    expected = world * (world + 1) / 2
    got = float(x.item())
    if got != expected:
        raise RuntimeError(f"rank {rank}: health all-reduce gave {got}, expected {expected}")
    return {"rank": rank, "ok": True, "sum": got, "t_s": time.perf_counter() - t0}


def case_cache(name: str) -> dict:
    """This rank's cache `name` of what a question keeps between its cases (01's layout references, 08's fp64
    truths); `release_caches` drops every one of them."""
    return STATE.setdefault("case_caches", {}).setdefault(name, {})


def release_caches() -> bool:
    """Drop this rank's cached layers and stacks, and the questions' `case_cache`s, with the GPU memory they held;
    the process group stays. What a notebook leaves behind on a cluster shared by a run's notebooks
    (controller.attached.detach), or a run on a cluster it keeps for the next (controller.engine_sets.keep)."""
    import gc

    import torch

    from . import ipc_collectives

    STATE["layers"], STATE["stacks"] = {}, {}
    STATE.pop("case_caches", None)
    ipc_collectives.forget_groups()  # every rank drops its shared buffers here, so each group sets up again alike
    gc.collect()
    if STATE.get("device") == "cuda":
        torch.cuda.empty_cache()
    return True


def teardown() -> bool:
    """Destroy parallel_state and the process group; safe to call twice or before setup finished."""
    try:
        from megatron.core import parallel_state as ps

        if ps.model_parallel_is_initialized():
            ps.destroy_model_parallel()
    except Exception:  # noqa: BLE001 - teardown must reach destroy_process_group
        logger.exception("destroy_model_parallel failed")
    import torch.distributed as tdist

    if tdist.is_initialized():
        tdist.destroy_process_group()
    from . import ipc_collectives

    ipc_collectives.forget_groups()
    kept = {k: STATE[k] for k in ("stack_fh", "prepared") if k in STATE}
    STATE.clear()
    STATE.update(kept)  # the stack dump handler and what the imports were made for stay with the process
    return True
