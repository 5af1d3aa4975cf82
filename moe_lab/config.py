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
threading (`--timeout 1e20` once became a cluster fault of rank 0)."""
MIN_SECONDS = 1.0
"""The shortest timeout the lab takes: timeouts are what engine calls and collectives may wait, and a process group's
is whole microseconds, so a timeout of 1e-300 s starts the engines and ends as a cluster fault (exit 3), not as bad
input (exit 2)."""
SECONDS_RULE = f"finite, >= {MIN_SECONDS:g} and <= {MAX_SECONDS:.0f} (a week)"
MAX_DIM = 2**24
"""The largest size of a layer's dimension (hidden, experts, top-k, ffn, tokens per rank): 16 777 216. One such
dimension times another is already more than any machine holds; beyond it a plan's numbers mean nothing."""
MAX_REPEATS = 10_000
"""The most repetitions of anything (trials, timing rounds, reruns, training steps, stacked layers): more is a typo
— one case would run for days."""
MAX_SEED = 2**63 - 1
"""Seeds are 0..2**63-1: torch's generators take a signed 64-bit seed."""
MAX_RANKS_PER_GPU = 16
"""The most ranks that may share one GPU (virtual EP over gloo): the seed report's EP=4 on one GPU uses 4; 16 ranks
each hold a CUDA context (~0.5 GiB) and their share of the layer, and more turns a GPU run into a scheduling test."""
ENGINES_PER_CPU = 4
"""CPU engines per CPU this process may use (`max_cpu_engines`): every engine is a Python process with torch and
megatron-core imported (~0.5 GiB) that spins in gloo collectives; the lab's largest CPU runs are 8 engines on 2 cores
(the fault tests), and hundreds of engines on one machine only exhaust its processes and memory."""


def seconds_ok(v) -> bool:
    """The timeout rule, stated once: a real number of seconds in [MIN_SECONDS, MAX_SECONDS] (NaN, infinities and
    bools fail)."""
    return isinstance(v, (int, float)) and not isinstance(v, bool) and MIN_SECONDS <= v <= MAX_SECONDS


def check_seconds(name: str, value) -> float:
    """`value` as seconds by `seconds_ok`, or a ValueError naming `name`, the value and the rule."""
    if not seconds_ok(value):
        raise ValueError(f"{name} ({value!r}) must be a number of seconds, {SECONDS_RULE}")
    return float(value)


def usable_cpus() -> int:
    """The CPUs this process may run on (its affinity where the OS says it, e.g. under Slurm or taskset)."""
    import os

    try:
        return len(os.sched_getaffinity(0)) or 1
    except (AttributeError, OSError):
        return os.cpu_count() or 1


def max_cpu_engines() -> int:
    """The most CPU engines one machine starts: ENGINES_PER_CPU x its usable CPUs."""
    return ENGINES_PER_CPU * usable_cpus()


def check_cut(cut, seq_len: int, name: str = "cut") -> int:
    """The truncation rule, stated once: the first `cut` tokens are kept and the rest zeroed, so cut is a whole
    number in 1..seq_len-1. Returns cut; raises ValueError naming `name` (the flag or key the user wrote)."""
    if not isinstance(cut, int) or isinstance(cut, bool) or not 0 < cut < seq_len:
        raise ValueError(f"{name} ({cut!r}) must be an integer in 1..seq_len-1 ({seq_len - 1})")
    return cut


SCORE_FUNCTIONS = ("softmax", "sigmoid", "sqrtsoftplus")  # moe_router_score_function (sqrtsoftplus: 0.18+)
DROP_POLICIES = ("probs", "position")  # moe_token_drop_policy: which tokens an over-capacity expert drops

MEGATRON_OPTIONS = ("moe_enable_routing_replay", "moe_permute_fusion", "moe_router_fusion")
"""TransformerConfig booleans the lab can turn on (the layer is built with them: they are part of its identity)."""


def check_choice(name: str, value, allowed) -> None:
    if value not in allowed:
        raise ValueError(f"{name} ({value!r}) must be one of {', '.join(map(repr, allowed))}")


def check_positive(name: str, value, most: int | None = None) -> None:
    """A whole number >= 1 (and <= `most` where given), or a ValueError naming `name`, the value and the rule."""
    if not isinstance(value, int) or isinstance(value, bool) or value < 1 or (most is not None and value > most):
        raise ValueError(f"{name} ({value!r}) must be a positive integer" + (f" <= {most}" if most else ""))


def check_count(name: str, value, *, least: int = 1, most: int = MAX_REPEATS, zero: str = "") -> None:
    """A whole number in least..most (`zero`: what 0 means, said in the message when 0 is allowed)."""
    if not isinstance(value, int) or isinstance(value, bool) or not least <= value <= most:
        what = f"0 ({zero}) or a positive integer <= {most}" if zero else f"an integer in {least}..{most}"
        raise ValueError(f"{name} ({value!r}) must be {what}")


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
    seed: int = 123
    """Seed for weights and tokens: same seed → bitwise same weights and tokens on every rank."""
    deterministic: bool = False
    """`torch.use_deterministic_algorithms(True)` (+ NCCL_ALGO=Ring on GPU, set at cluster start)."""
    options: tuple[str, ...] = ()
    """megatron-core TransformerConfig switches turned on for the layer, from MEGATRON_OPTIONS (checked against the
    release; e.g. 'moe_enable_routing_replay', 'moe_permute_fusion')."""
    # Router and expert features of production MoE models. The defaults are the seed report's layer; a field
    # left at its default is not passed to megatron, so the seed layer is built exactly as before.
    score_function: str = "softmax"
    """`moe_router_score_function`: 'softmax' (Mixtral, Qwen3), 'sigmoid' (DeepSeek-V3, Moonlight), 'sqrtsoftplus'
    (megatron-core 0.18+)."""
    pre_softmax: bool = False
    """`moe_router_pre_softmax`: softmax over all experts before the top-k (needed for top-1 softmax routing)."""
    expert_bias: bool = False
    """`moe_router_enable_expert_bias`: the aux-loss-free per-expert bias added to the scores for the top-k choice
    only (sigmoid routing). The lab seeds it (std `EXPERT_BIAS_STD`) so that it changes which experts win."""
    num_groups: int = 0
    """`moe_router_num_groups`: group-limited routing's expert groups (0 = off; DeepSeek-V3: 8)."""
    group_topk: int = 0
    """`moe_router_group_topk`: groups each token may use (0 = off; DeepSeek-V3: 4)."""
    topk_scaling_factor: float = 0.0
    """`moe_router_topk_scaling_factor`: the routing weights are multiplied by it (0 = not set; DeepSeek-V3: 2.5)."""
    shared_ffn: int = 0
    """`moe_shared_expert_intermediate_size`: hidden size of the shared expert(s) run on every token (0 = none)."""
    gated: bool = False
    """`gated_linear_unit` with SiLU (SwiGLU experts, as every preset model has); False: the seed layer's GELU MLP."""
    capacity_factor: float = 0.0
    """`moe_expert_capacity_factor`: each expert takes at most factor x its even share of tokens, dropping the rest
    (0 = no dropping)."""
    drop_policy: str = "probs"
    """`moe_token_drop_policy`: over capacity, drop the lowest-probability tokens ('probs') or the last ('position')."""
    pad_to_capacity: bool = False
    """`moe_pad_expert_input_to_capacity`: pad every expert's input to its capacity (needs capacity_factor)."""
    model: str = ""
    """The preset this layer was made from (`moe_lab.models`), e.g. 'qwen3-30b-a3b x0.125'; '' for hand-set sizes."""

    def __post_init__(self):
        for name in ("hidden", "num_experts", "topk", "ffn_hidden", "seq_len"):
            check_positive(name, getattr(self, name), MAX_DIM)
        for name in ("probs_fp32_gather", "deterministic", "pre_softmax", "expert_bias", "gated", "pad_to_capacity"):
            if not isinstance(getattr(self, name), bool):
                raise ValueError(f"{name} ({getattr(self, name)!r}) must be True or False")
        check_count("seed", self.seed, least=0, most=MAX_SEED)
        if isinstance(self.options, list):  # from JSON
            object.__setattr__(self, "options", tuple(self.options))
        if not isinstance(self.options, tuple) or any(o not in MEGATRON_OPTIONS for o in self.options):
            raise ValueError(f"options ({self.options!r}) must be a tuple of {', '.join(MEGATRON_OPTIONS)}")
        check_choice("dtype", self.dtype, DTYPES)
        check_choice("dispatcher", self.dispatcher, DISPATCHERS)
        check_choice("router_dtype", self.router_dtype, ROUTER_DTYPES)
        self._check_router_features()
        if self.topk > self.num_experts:
            raise ValueError(f"topk ({self.topk}) must be <= num_experts ({self.num_experts})")

    def _check_router_features(self) -> None:
        """megatron-core's own rules for the router features (TransformerConfig.__post_init__), checked here so that
        a bad combination is one line before any engine starts."""
        check_choice("score_function", self.score_function, SCORE_FUNCTIONS)
        check_choice("drop_policy", self.drop_policy, DROP_POLICIES)
        for name in ("num_groups", "group_topk", "shared_ffn"):
            check_count(name, getattr(self, name), least=0, most=MAX_DIM, zero="off")
        for name in ("topk_scaling_factor", "capacity_factor"):
            v = getattr(self, name)
            if not isinstance(v, (int, float)) or isinstance(v, bool) or not 0 <= v < float("inf"):
                raise ValueError(f"{name} ({v!r}) must be 0 (not set) or a positive finite number")
        if not isinstance(self.model, str):
            raise ValueError(f"model ({self.model!r}) must be a preset label (str)")
        if self.expert_bias and self.score_function != "sigmoid":
            raise ValueError(f"expert_bias needs score_function 'sigmoid' (megatron-core's rule); it is "
                             f"{self.score_function!r}")
        if bool(self.num_groups) != bool(self.group_topk):
            raise ValueError(f"num_groups ({self.num_groups}) and group_topk ({self.group_topk}) are set together "
                             "(group-limited routing) or both left 0")
        if self.num_groups:
            if self.num_experts % self.num_groups:
                raise ValueError(f"num_experts ({self.num_experts}) must be divisible by num_groups ({self.num_groups})")
            if self.group_topk > self.num_groups:
                raise ValueError(f"group_topk ({self.group_topk}) must be <= num_groups ({self.num_groups})")
            if self.topk % self.group_topk or self.topk // self.group_topk > self.num_experts // self.num_groups:
                raise ValueError(f"topk ({self.topk}) must be a multiple of group_topk ({self.group_topk}) with at "
                                 f"most num_experts / num_groups ({self.num_experts // self.num_groups}) per group")
        if self.pad_to_capacity and not self.capacity_factor:
            raise ValueError("pad_to_capacity needs capacity_factor > 0 (megatron-core's rule)")
        if self.topk == 1 and self.score_function == "softmax" and not self.pre_softmax:
            raise ValueError("topk 1 with softmax routing needs pre_softmax=True (megatron-core's rule: a softmax over "
                             "one score has a zero gradient)")

    def features(self) -> dict:
        """The router/expert features set away from the seed layer's defaults (field → value), in field order."""
        base = MoEConfig()
        return {k: getattr(self, k) for k in ROUTER_FEATURES if getattr(self, k) != getattr(base, k)}

    def label(self) -> str:
        """The layer in words (findings, cards): sizes, then the preset and every feature that is set."""
        s = (f"hidden {self.hidden}, {self.num_experts} experts, top-{self.topk}, ffn {self.ffn_hidden}, "
             f"{self.seq_len} tokens, {self.dtype}")
        return describe_features(s, self.model, self.features())

    @classmethod
    def seed_report(cls, **overrides) -> "MoEConfig":
        """The config of the truncation test in Megatron-LM #1421 (hidden 4096, 64 experts, top-6, 1024 tokens)."""
        base = dict(hidden=4096, num_experts=64, topk=6, ffn_hidden=16384, seq_len=1024, dtype="bf16")
        base.update(overrides)
        return cls(**base)

    def replace(self, **changes) -> "MoEConfig":
        return dataclasses.replace(self, **changes)

    def asdict(self) -> dict:
        return dataclasses.asdict(self)


ROUTER_FEATURES = ("score_function", "pre_softmax", "expert_bias", "num_groups", "group_topk", "topk_scaling_factor",
                   "shared_ffn", "gated", "capacity_factor", "drop_policy", "pad_to_capacity")
"""MoEConfig fields that map to megatron-core router/expert features (releases.FEATURE_FIELDS names each one)."""


def describe_features(sizes: str, model: str, features: dict) -> str:
    """`sizes` + the preset's name + the features set, e.g. '... bf16; preset qwen3-30b-a3b x0.125; gated'. A layer
    with neither is `sizes` alone (the seed layer's label is unchanged)."""
    words = []
    for k, v in features.items():
        words.append(k.replace("_", " ") if v is True else f"{k.replace('_', ' ')} {v}")
    extra = ([f"preset {model}"] if model else []) + words
    return sizes + ("; " + ", ".join(extra) if extra else "")


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
        check_choice("device", self.device, DEVICES)
        check_choice("launcher", self.launcher, LAUNCHERS)
        opts = self.launcher_options
        if not isinstance(opts, dict) or not all(isinstance(k, str) and k for k in opts):
            raise ValueError(f"launcher_options ({opts!r}) must be a dict of ipyparallel setting names to values, "
                             "e.g. {'mpi_args': ['--oversubscribe']}")
        object.__setattr__(self, "launcher_options", copy.deepcopy(opts))  # frozen: the caller's dict can't change it
        if not isinstance(self.profile_root, str):
            raise ValueError(f"profile_root ({self.profile_root!r}) must be a directory path (str), or '' for the default")
        check_positive("engines", self.engines)
        check_positive("ranks_per_gpu", self.ranks_per_gpu)
        if self.device == "cpu" and self.ranks_per_gpu != 1:
            raise ValueError(f"ranks_per_gpu ({self.ranks_per_gpu}) must be 1 on device 'cpu'")
        if self.engines % self.ranks_per_gpu:
            raise ValueError(f"engines ({self.engines}) must be a multiple of ranks_per_gpu ({self.ranks_per_gpu})")
        if self.ranks_per_gpu > MAX_RANKS_PER_GPU:
            raise ValueError(f"ranks_per_gpu ({self.ranks_per_gpu}) must be <= {MAX_RANKS_PER_GPU}: {self.engines} "
                             f"engines on {self.engines // self.ranks_per_gpu} GPU(s) would put {self.ranks_per_gpu} "
                             f"ranks on each; give at most {MAX_RANKS_PER_GPU} engines per GPU, or more GPUs")
        if self.device == "cpu" and self.launcher == "local" and self.engines > max_cpu_engines():
            raise ValueError(f"engines ({self.engines}) must be <= {max_cpu_engines()} on this machine's "
                             f"{usable_cpus()} CPU(s) ({ENGINES_PER_CPU} CPU engines per CPU at most): give fewer "
                             "engines, or a launcher that starts them on other machines (mpi, slurm, ssh)")
        for name in ("timeout_s", "start_timeout_s"):
            check_seconds(name, getattr(self, name))

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
