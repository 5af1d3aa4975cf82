"""Controller side: how engines are started (ipyparallel's launchers: local, mpi, slurm, ssh) and which rank each gets."""

from __future__ import annotations

import os
import shutil
import sys
from collections import Counter

from ..config import ClusterConfig

SHARED_PROFILE_ROOT = "~/.moe_lab/ipp"  # default for launchers that start engines elsewhere: home is shared on clusters


def assign_ranks(engines: list[tuple[int, str]], launcher_ranks: dict[int, int] | None = None) -> list[dict]:
    """Rank order for engines given as (engine id, node): the ranks of one node are contiguous, the node of the first
    engine comes first (so that engine is rank 0, as on one machine), the other nodes by name, and engines keep their
    order within a node. local_rank is the engine's index on its node (its GPU there), local_world the engines on
    that node.

    "Order" is the engine id, or the rank the launcher gave each process (`launcher_ranks`: engine id → MPI rank or
    SLURM_PROCID) when every engine has a distinct one: ids follow registration, and an engine that asks for its MPI
    rank as id gets another one while the hub still holds an engine of that id (after a restart).
    """
    if not engines:
        return []
    lr = launcher_ranks or {}
    use_lr = len({lr.get(eid) for eid, _ in engines} - {None}) == len(engines)

    def order(e):
        return (lr[e[0]], e[0]) if use_lr else (e[0],)

    first = min(engines, key=order)[1]
    counts = Counter(node for _, node in engines)
    seen: Counter = Counter()
    placed = []
    for rank, (eid, node) in enumerate(sorted(engines, key=lambda e: (e[1] != first, e[1], order(e)))):
        placed.append(dict(rank=rank, engine=eid, node=node, local_rank=seen[node], local_world=counts[node]))
        seen[node] += 1
    return placed

def launcher_rank(env: dict) -> int | None:
    """The rank mpiexec (Open MPI, PMIx, MPICH/PMI) or srun gave a process, from dist.launcher_env; None if none."""
    for key in ("OMPI_COMM_WORLD_RANK", "PMIX_RANK", "PMI_RANK", "SLURM_PROCID"):
        if str(env.get(key, "")).isdigit():
            return int(env[key])
    return None


def profile_parent(cfg: ClusterConfig) -> str | None:
    """Directory for the private profile: cfg.profile_root, else the temp dir on one machine and ~/.moe_lab/ipp
    for launchers whose engines run elsewhere (a Slurm node's /tmp is its own; home is shared)."""
    if not cfg.profile_root and cfg.launcher == "local":
        return None
    root = os.path.expanduser(cfg.profile_root or SHARED_PROFILE_ROOT)
    os.makedirs(root, exist_ok=True)
    return root

_LAUNCHER_COMMAND = {"mpi": ("mpi_cmd", "install Open MPI or MPICH (e.g. apt-get install openmpi-bin) or set "
                                        "launcher_options['mpi_cmd']"),
                     "slurm": ("submit_command", "run on a Slurm login node, or set launcher_options['submit_command']"),
                     "ssh": ("ssh_cmd", "install an ssh client, or set launcher_options['ssh_cmd']")}

def launcher_settings(cfg: ClusterConfig) -> dict:
    """Keyword arguments of ipyparallel's Cluster for cfg.launcher: engines=<launcher>, a traitlets Config from
    launcher_options, and, for engines on other hosts, a controller listening on every interface.

    Each option is checked against the traits of the class it names (traitlets would ignore a misspelt name), and
    the launcher's command (mpiexec, sbatch, ssh) must be on PATH: bad input fails here, before anything starts.
    """
    from ipyparallel.cluster import launcher as ipl
    from traitlets.config import Config

    engine_cls = ipl.find_launcher_class(cfg.launcher, "engine")
    conf = Config()
    for key, value in cfg.launcher_options.items():
        cls_name, _, trait = key.rpartition(".")
        cls = _ipp_class(cls_name, key) if cls_name else engine_cls
        traits = cls.class_traits(config=True)
        if trait not in traits:
            raise ValueError(f"launcher_options[{key!r}]: {cls.__name__} has no setting {trait!r}; "
                             f"its settings are {', '.join(sorted(traits))}")
        conf[cls.__name__][trait] = _checked_value(key, cls, traits[trait], value)
    mine = conf[engine_cls.__name__] if engine_cls.__name__ in conf else {}
    if cfg.launcher in _LAUNCHER_COMMAND:
        trait, fix = _LAUNCHER_COMMAND[cfg.launcher]
        cmd = mine.get(trait) or engine_cls.class_traits()[trait].default()
        if not shutil.which(cmd[0]):
            raise ValueError(f"launcher ({cfg.launcher!r}) runs {cmd[0]!r}, which is not on PATH: {fix}")
    if cfg.launcher == "mpi":
        import importlib.util

        if importlib.util.find_spec("mpi4py") is None:
            raise ValueError("launcher ('mpi') starts `ipengine --mpi`, which imports mpi4py: "
                             f"{sys.executable} -m pip install mpi4py")
    if cfg.launcher == "ssh":
        _check_ssh_hosts(mine.get("engines"), cfg.engines)
    kwargs: dict = dict(engines=cfg.launcher, config=conf)
    if cfg.launcher != "local" and not ("Cluster" in conf and "controller_ip" in conf["Cluster"]):
        kwargs["controller_ip"] = "*"  # engines on other hosts connect to it; the key in the profile signs messages
    return kwargs

HEARTBEAT_MS = 250
"""The hub's ping period. An engine counts as registered only after the hub has seen it answer a ping, so with
ipyparallel's 3 s default every cluster start waits 3-6 s for nothing (measured: 5.7 s to register 4 bare engines,
1.5 s at 300 ms). The heart answers from its own thread outside the GIL, so a busy engine still answers."""
HEARTBEAT_ALLOWANCE_S = 30
"""How long an engine may miss pings before the hub drops it: ipyparallel's default allowance (10 missed 3 s pings),
kept, so a stopped or starved engine is treated as before."""


PORT_SETTINGS = ("--IPController.ports", "--IPController.engine_ports", "--IPController.client_ports")


def controller_settings(settings: dict, cfg: ClusterConfig) -> dict:
    """`settings` (launcher_settings) with the controller's heartbeat at HEARTBEAT_MS and the same allowance, and —
    for local engines — its ports from `ports.reserve` (none another process can take before it binds them); a
    user's own `Cluster.controller_args` come after ours and replace ours of the same setting (the controller
    refuses a setting given twice), and a user's own ports keep ours out."""
    from . import ports

    conf = settings.get("config")
    own = list(conf["Cluster"]["controller_args"]) if conf is not None and "Cluster" in conf \
        and "controller_args" in conf["Cluster"] else []
    theirs = {str(a).split("=", 1)[0] for a in own}
    misses = max(1, round(HEARTBEAT_ALLOWANCE_S * 1000 / HEARTBEAT_MS))
    ours = [f"--HeartMonitor.period={HEARTBEAT_MS}", f"--HeartMonitor.max_heartmonitor_misses={misses}"]
    if cfg.launcher == "local" and not theirs & set(PORT_SETTINGS):
        reserved = ports.reserve()
        if reserved:
            ours.append(f"--IPController.ports={','.join(map(str, reserved))}")
    return dict(settings, controller_args=[a for a in ours if a.split("=", 1)[0] not in theirs] + own)


def _checked_value(key: str, cls, trait, value):
    """`value` as the trait takes it (its own validation, as ipyparallel would run it when the cluster starts — a
    traceback from deep inside the launch otherwise), or a one-line ValueError saying what the setting takes."""
    from traitlets import HasTraits, TraitError

    validate = getattr(trait, "validate", None)  # a trait of any value (traitlets' Any) has none
    try:
        return validate(HasTraits(), value) if validate else value
    except (TraitError, TypeError, ValueError) as e:
        raise ValueError(f"launcher_options[{key!r}] ({value!r}): {cls.__name__}.{trait.name} takes {trait.info()}, "
                         f"e.g. --launcher-option '{key}=...' with a JSON value of that type") from None


def check_devices(cfg: ClusterConfig, visible: int) -> None:
    """Engines on this machine's GPUs (device 'cuda', launcher 'local') need engines / ranks_per_gpu of the
    `visible` GPUs: NCCL refuses two ranks on one GPU ('Duplicate GPU detected') long after the engines started.
    Refused here with the fix: ranks_per_gpu (virtual EP over gloo), or `placement.default_config`, which chooses it
    from the GPUs it sees."""
    if cfg.device != "cuda" or cfg.launcher != "local":
        return
    need = cfg.engines // cfg.ranks_per_gpu
    if need <= visible:
        return
    if visible == 0:
        raise ValueError("device ('cuda') needs a GPU, but torch sees none; use device='cpu'")
    from ..config import MAX_RANKS_PER_GPU

    share = cfg.engines // visible
    if cfg.engines % visible:
        fix = f"give engines a multiple of {visible}, with ranks_per_gpu = engines / {visible}"
    elif share > MAX_RANKS_PER_GPU:
        fix = f"give at most {MAX_RANKS_PER_GPU * visible} engines ({MAX_RANKS_PER_GPU} per GPU)"
    else:
        fix = (f"give ranks_per_gpu={share} (virtual EP: {share} ranks share each GPU over gloo) or "
               f"engines={visible * cfg.ranks_per_gpu}")
    raise ValueError(f"engines ({cfg.engines}) with ranks_per_gpu ({cfg.ranks_per_gpu}) need {need} GPUs, but torch "
                     f"sees {visible}: {fix}; controller.placement.default_config(device='cuda', engines="
                     f"{cfg.engines}) chooses the ranks per GPU from the GPUs it sees")


def _ipp_class(name: str, key: str):
    import ipyparallel as ipp
    from ipyparallel.cluster import launcher as ipl

    cls = ipp.Cluster if name == "Cluster" else getattr(ipl, name, None)
    if not isinstance(cls, type) or not hasattr(cls, "class_traits"):
        raise ValueError(f"launcher_options[{key!r}]: {name!r} is neither ipyparallel's Cluster nor one of its "
                         "launcher classes (e.g. 'Cluster.controller_ip', 'MPILauncher.mpi_args')")
    return cls

def _check_ssh_hosts(hosts, engines: int) -> None:
    """ipyparallel's ssh launcher starts engines only where launcher_options['engines'] puts them."""
    if not isinstance(hosts, dict) or not hosts:
        raise ValueError("launcher ('ssh') needs launcher_options['engines'] = {host: engines on it}, "
                         "e.g. {'gpu-a': 8, 'gpu-b': 8}")
    placed = 0
    for host, n in hosts.items():
        n = n.get("n", 1) if isinstance(n, dict) else n
        if not isinstance(n, int) or isinstance(n, bool) or n < 1:
            raise ValueError(f"launcher_options['engines'][{host!r}] ({n!r}) must be a positive number of engines")
        placed += n
    if placed != engines:
        raise ValueError(f"launcher_options['engines'] places {placed} engines on {len(hosts)} host(s), "
                         f"but engines is {engines}: make them equal")


__all__ = ["assign_ranks", "check_devices", "controller_settings", "launcher_rank", "launcher_settings", "profile_parent",
           "SHARED_PROFILE_ROOT"]
