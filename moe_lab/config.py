"""Config dataclasses: what one MoE experiment and one cluster are, checked before anything launches."""

from __future__ import annotations

import copy
import dataclasses
from dataclasses import dataclass, field

DISPATCHERS = ("allgather", "alltoall")
ROUTER_DTYPES = ("none", "fp32", "fp64")
DTYPES = ("bf16", "fp16", "fp32")
DEVICES = ("cpu", "cuda")
LAUNCHERS = ("local", "mpi", "slurm", "ssh")  # ipyparallel engine launchers (its entry-point names)
MAX_SECONDS = 7 * 24 * 3600.0
"""The longest timeout the lab takes (a week; flags and profiles alike): larger values overflow the timers of zmq and
threading (#25: `--timeout 1e20` once became a cluster fault of rank 0)."""


def seconds_ok(v) -> bool:
    """The timeout rule, stated once: a real number of seconds, finite, in (0, MAX_SECONDS] (NaN and bools fail)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and 0 < v <= MAX_SECONDS


def check_cut(cut, seq_len: int, name: str = "cut") -> int:
    """The truncation rule, stated once (#22): the first `cut` tokens are kept and the rest zeroed, so cut is a whole
    number in 1..seq_len-1. Returns cut; raises ValueError naming `name` (the flag or key the user wrote)."""
    if not isinstance(cut, int) or isinstance(cut, bool) or not 0 < cut < seq_len:
        raise ValueError(f"{name} ({cut!r}) must be an integer in 1..seq_len-1 ({seq_len - 1})")
    return cut


MEGATRON_OPTIONS = ("moe_enable_routing_replay", "moe_permute_fusion", "moe_router_fusion")
"""TransformerConfig booleans the lab can turn on (the layer is built with them: they are part of its identity)."""


def _choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(map(repr, allowed))}")


def _positive(name: str, value) -> None:
    if not isinstance(value, int) or isinstance(value, bool) or value < 1:
        raise ValueError(f"{name} ({value!r}) must be a positive integer")


@dataclass(frozen=True, kw_only=True)
class MoEConfig:
    """One MoE layer and the input fed to it. The seed report's config is `MoEConfig.seed_report()`."""

    hidden: int = 256
    """Hidden size of the tokens entering the MoE layer."""
    num_experts: int = 8
    """Routed experts in the layer (across all EP ranks)."""
    topk: int = 4
    """Experts each token is routed to (>= 3 needed for order-dependent sums in the combine: a+b == b+a)."""
    ffn_hidden: int = 512
    """Hidden size of each expert's MLP."""
    seq_len: int = 128
    """Tokens fed to every rank (batch size is 1, as in the seed report)."""
    dtype: str = "bf16"
    """Parameter and activation dtype."""
    dispatcher: str = "allgather"
    """megatron-core token dispatcher: 'allgather' or 'alltoall'."""
    router_dtype: str = "none"
    """`moe_router_dtype`: 'none' keeps the activation dtype (megatron's default); 'fp32'/'fp64' promote."""
    probs_fp32_gather: bool = False
    """The seed reporter's fix: routing probs cast to fp32 before the dispatcher communicates them (a lab toggle)."""
    ep: int = 0
    """Expert-parallel size; 0 means the whole world / tp."""
    tp: int = 1
    """Tensor-parallel size (experts' TP follows it)."""
    seed: int = 123
    """Seed for weights and tokens: same seed → bitwise same weights and tokens on every rank."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms(True)` (+ NCCL_ALGO=Ring on GPU, set at cluster start)."""
    options: tuple[str, ...] = ()
    """megatron-core TransformerConfig switches turned on for the layer, from MEGATRON_OPTIONS (checked against the
    release; e.g. 'moe_enable_routing_replay', 'moe_permute_fusion')."""

    def __post_init__(self):
        for name in ("hidden", "num_experts", "topk", "ffn_hidden", "seq_len", "tp"):
            _positive(name, getattr(self, name))
        for name in ("probs_fp32_gather", "deterministic"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be True or False")
        if not isinstance(self.seed, int) or isinstance(self.seed, bool):
            raise ValueError(f"seed ({self.seed!r}) must be an integer")
        if not isinstance(self.ep, int) or isinstance(self.ep, bool) or self.ep < 0:
            raise ValueError(f"ep ({self.ep!r}) must be 0 (= world / tp) or a positive integer")
        if isinstance(self.options, list):  # from JSON
            object.__setattr__(self, "options", tuple(self.options))
        if not isinstance(self.options, tuple) or any(o not in MEGATRON_OPTIONS for o in self.options):
            raise ValueError(f"options ({self.options!r}) must be a tuple of {', '.join(MEGATRON_OPTIONS)}")
        _choice("dtype", self.dtype, DTYPES)
        _choice("dispatcher", self.dispatcher, DISPATCHERS)
        _choice("router_dtype", self.router_dtype, ROUTER_DTYPES)
        if self.topk > self.num_experts:
            raise ValueError(f"topk ({self.topk}) must be <= num_experts ({self.num_experts})")
        if self.ep and self.num_experts % self.ep:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by ep ({self.ep})")
        if self.hidden % self.tp or self.ffn_hidden % self.tp:
            raise ValueError(f"hidden ({self.hidden}) and ffn_hidden ({self.ffn_hidden}) must be divisible by tp ({self.tp})")

    @classmethod
    def seed_report(cls, **overrides) -> "MoEConfig":
        """The config of the truncation test in Megatron-LM #1421 (hidden 4096, 64 experts, top-6, 1024 tokens)."""
        base = dict(hidden=4096, num_experts=64, topk=6, ffn_hidden=16384, seq_len=1024, dtype="bf16")
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def resolved_ep(self, world: int) -> int:
        """EP for a world of `world` ranks, checked against it."""
        if not isinstance(world, int) or isinstance(world, bool) or world < 1:
            raise ValueError(f"world ({world!r}) must be a positive integer")
        ep = self.ep or world // self.tp
        if ep * self.tp != world:
            raise ValueError(f"ep ({ep}) * tp ({self.tp}) must equal the world size ({world})")
        if self.num_experts % ep:
            raise ValueError(f"num_experts ({self.num_experts}) must be divisible by ep ({ep})")
        return ep

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class Layout:
    """How a case's layer is split over the world (#24; the shape every case moves to): tensor, expert and expert-tensor
    parallel sizes and sequence parallelism. The rest of the world is data parallel: dense (router) parameters are
    replicated over world / tp ranks, expert parameters over world / (ep * etp) (megatron's expert-data-parallel group)."""

    tp: int = 1
    """Tensor-parallel size of the dense part."""
    ep: int = 1
    """Expert-parallel size: experts are split over `ep` ranks, each EP group sees its own tokens."""
    etp: int = 1
    """Expert tensor-parallel size (the lab builds etp = 1 only)."""
    sequence_parallel: bool = False
    """megatron's sequence parallelism (the lab builds False only)."""

    def __post_init__(self):
        for name in ("tp", "ep", "etp"):
            _positive(name, getattr(self, name))
        if not isinstance(self.sequence_parallel, bool):
            raise ValueError(f"sequence_parallel ({self.sequence_parallel!r}) must be True or False")
        if self.etp != 1 or self.sequence_parallel or self.tp != 1:
            raise ValueError(f"layout (tp {self.tp}, etp {self.etp}, sequence_parallel {self.sequence_parallel}) must "
                             "be tp 1, etp 1, no sequence parallelism: the lab's training step builds EP x DP only")

    def check(self, world: int, num_experts: int) -> None:
        """ValueError unless the layout fits `world` ranks and `num_experts` experts."""
        if world % (self.tp * self.ep):
            raise ValueError(f"ep ({self.ep}) * tp ({self.tp}) must divide the world size ({world})")
        if num_experts % self.ep:
            raise ValueError(f"num_experts ({num_experts}) must be divisible by ep ({self.ep})")

    def dp(self, world: int) -> int:
        """Data-parallel size of the dense parameters."""
        return world // self.tp

    def expert_dp(self, world: int) -> int:
        """Data-parallel size of the expert parameters (megatron's expert-data-parallel group)."""
        return world // (self.ep * self.etp)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


@dataclass(frozen=True, kw_only=True)
class ClusterConfig:
    """How the engines are started."""

    device: str = "cpu"
    """'cuda': engines on GPUs (NCCL with one rank per GPU, gloo when ranks share a GPU); 'cpu': CPU engines on gloo."""
    engines: int = 4
    """Number of engines (= torch.distributed world size)."""
    ranks_per_gpu: int = 1
    """cuda: ranks sharing each GPU. 1 = one rank per GPU over NCCL; k > 1 = virtual EP, k ranks per GPU over gloo
    (NCCL refuses two ranks on one GPU). `controller.placement.default_config` derives it from the GPUs it sees."""
    tp: int = 1
    """Tensor-parallel size given to `parallel_state.initialize_model_parallel`."""
    timeout_s: float = 120.0
    """Timeout of every collective (process-group timeout) and of every engine call."""
    start_timeout_s: float = 120.0
    """How long engines may take to register with the controller."""
    deterministic: bool = False
    """Set NCCL_ALGO=Ring and CUBLAS_WORKSPACE_CONFIG in the engines' environment before they start."""
    extra_path: tuple[str, ...] = field(default_factory=tuple)
    """Directories put first on the engines' sys.path (a megatron-core release from `moe-lab versions`)."""
    env: tuple[tuple[str, str], ...] = field(default_factory=tuple)
    """Extra environment variables for the engines."""
    launcher: str = "local"
    """How ipyparallel starts the engines: 'local' (processes on this machine), 'mpi' (mpiexec; engines need
    mpi4py), 'slurm' (an sbatch job of `srun` engines), 'ssh' (engines on the hosts of `launcher_options['engines']`).
    Ranks are grouped by node, the GPU of each engine is its index among the engines on its node, and the process
    group meets on rank 0's host."""
    launcher_options: dict = field(default_factory=dict, hash=False)
    """ipyparallel settings for the launcher, checked against its traits when the cluster starts: a plain key is a
    trait of the engine-set launcher (mpi: mpi_args, mpi_cmd; slurm: queue, account, timelimit, batch_template;
    ssh: engines, ssh_args, remote_python; any: environment), 'Class.trait' any ipyparallel class
    (e.g. 'Cluster.controller_ip')."""
    profile_root: str = ""
    """Where the cluster's private ipyparallel profile is made: '' = the temp dir for 'local', ~/.moe_lab/ipp for the
    other launchers (engines on other hosts need it on a shared file system; ssh creates it on each host)."""

    def __post_init__(self):
        _choice("device", self.device, DEVICES)
        _choice("launcher", self.launcher, LAUNCHERS)
        opts = self.launcher_options
        if not isinstance(opts, dict) or not all(isinstance(k, str) and k for k in opts):
            raise ValueError(f"launcher_options ({opts!r}) must be a dict of ipyparallel setting names to values, "
                             "e.g. {'mpi_args': ['--oversubscribe']}")
        object.__setattr__(self, "launcher_options", copy.deepcopy(opts))  # frozen: the caller's dict can't change it
        if not isinstance(self.profile_root, str):
            raise ValueError(f"profile_root ({self.profile_root!r}) must be a directory path (str), or '' for the default")
        _positive("engines", self.engines)
        _positive("ranks_per_gpu", self.ranks_per_gpu)
        if self.device == "cpu" and self.ranks_per_gpu != 1:
            raise ValueError(f"ranks_per_gpu ({self.ranks_per_gpu}) must be 1 on device 'cpu'")
        if self.engines % self.ranks_per_gpu:
            raise ValueError(f"engines ({self.engines}) must be a multiple of ranks_per_gpu ({self.ranks_per_gpu})")
        _positive("tp", self.tp)
        if self.engines % self.tp:
            raise ValueError(f"engines ({self.engines}) must be divisible by tp ({self.tp})")
        for name in ("timeout_s", "start_timeout_s"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool):
                raise ValueError(f"{name} ({v!r}) must be a number of seconds")
        if not self.timeout_s > 0 or not self.start_timeout_s > 0:
            raise ValueError(f"timeout_s ({self.timeout_s}) and start_timeout_s ({self.start_timeout_s}) must be > 0")

    def replace(self, **changes) -> "ClusterConfig":
        return dataclasses.replace(self, **changes)

    @property
    def backend(self) -> str:
        """The process group's backend: gloo on CPU and whenever ranks share a GPU, NCCL otherwise."""
        return "nccl" if self.device == "cuda" and self.ranks_per_gpu == 1 else "gloo"

    @property
    def placement(self) -> str:
        """How ranks sit on devices, in words (every record and report states it)."""
        if self.device == "cpu":
            return f"{self.engines} CPU engines"
        if self.ranks_per_gpu == 1:
            return "one rank per GPU"
        return f"{self.ranks_per_gpu} ranks share each GPU (virtual EP)"


@dataclass(frozen=True, kw_only=True)
class TrainParams:
    """Notebook 06's parameters (the profile's "training" object; #24): a stack of MoE layers trained on a fixed
    regression loss at several EP layouts, each run `reruns` times, with and without deterministic mode."""

    steps: int = 50
    """K: optimizer steps per run."""
    tokens: int = 64
    """Tokens of the global batch per step, split evenly over the data-parallel ranks."""
    stacks: tuple[int, ...] = (1, 2)
    """MoE layers per stack (residual: h <- h + moe(h)); the first stack runs every mode and setting, the others the
    plain setting in the last-listed mode."""
    eps: tuple[int, ...] = (1, 2, 4)
    """Expert-parallel sizes compared (the first is the reference layout); the rest of the world is data parallel."""
    reruns: int = 2
    """Runs of every plain layout of the first stack (run 1 is the rerun: the run-to-run effect)."""
    deep_reruns: int = 2
    """Runs of every layout of the other stacks (1: no rerun there; their run-to-run finding then says so)."""
    deterministic: tuple[bool, ...] = (False, True)
    """torch deterministic algorithms off / on for the first stack's plain layouts (other cases: the last listed)."""
    settings: tuple[str, ...] = ("plain", "router fp32", "router fp32 + fp32 grad reduce")
    """Settings run (experiments.training.SETTINGS); 'plain' is the reference."""
    hidden: int = 0
    """Layer overrides for training (0: the profile's layer)."""
    num_experts: int = 0
    topk: int = 0
    ffn_hidden: int = 0
    dispatcher: str = "allgather"
    """megatron-core token dispatcher of every training case."""
    lr: float = 1e-3
    """Adam learning rate (megatron OptimizerConfig's other defaults: weight decay 0.01, betas 0.9/0.999, eps 1e-8,
    clip_grad 1.0)."""
    cost_rounds: int = 5
    """Paired timing rounds (case step vs plain step) per remedy, at the largest EP; 0: no cost."""

    def __post_init__(self):
        for name in ("steps", "tokens", "reruns", "deep_reruns"):
            _positive(name, getattr(self, name))
        for name in ("hidden", "num_experts", "topk", "ffn_hidden", "cost_rounds"):
            v = getattr(self, name)
            if not isinstance(v, int) or isinstance(v, bool) or v < 0:
                raise ValueError(f"training.{name} ({v!r}) must be 0 (the profile's) or a positive integer")
        for name, kind in (("stacks", int), ("eps", int), ("deterministic", bool), ("settings", str)):
            v = getattr(self, name)
            if isinstance(v, list):
                v = tuple(v)
                object.__setattr__(self, name, v)
            if (not isinstance(v, tuple) or not v or len(set(v)) != len(v)
                    or not all(isinstance(x, kind) and (kind is not int or (not isinstance(x, bool) and x > 0))
                               for x in v)):
                raise ValueError(f"training.{name} ({v!r}) must be a non-empty list of distinct "
                                 f"{'positive integers' if kind is int else kind.__name__ + ' values'}")
        _choice("training.dispatcher", self.dispatcher, DISPATCHERS)
        if not isinstance(self.lr, (int, float)) or isinstance(self.lr, bool) or not 0 < self.lr < 1:
            raise ValueError(f"training.lr ({self.lr!r}) must be a number in (0, 1)")

    @classmethod
    def from_dict(cls, d: dict | None, where: str = "parameters") -> "TrainParams":
        """From a profile's "training" object ('_'-keys are comments): an unknown key is an error naming the allowed
        ones."""
        d = d or {}
        if not isinstance(d, dict):
            raise ValueError(f"{where}: training ({d!r}) must be a JSON object of {sorted(cls.__dataclass_fields__)}")
        d = {k: v for k, v in d.items() if not k.startswith("_")}
        unknown = set(d) - set(cls.__dataclass_fields__)
        if unknown:
            raise ValueError(f"{where}: training has unknown key(s) {sorted(unknown)}; allowed: "
                             f"{sorted(cls.__dataclass_fields__)}")
        return cls(**d)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)
