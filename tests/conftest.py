"""Shared fixtures: one warm 4-engine gloo cluster for the whole session (tests/cluster), and a second one with
oneDNN's ISA capped (PIN_ISA) for tests that compare truncated forwards bitwise but are about something else; what
this CPU's bf16 GEMM does (`cpu_gemm`: batch invariant or not, measured in a subprocess with the engines'
environment) and the check of notebook 04's records against it (`truncation_story`). GPU markers skip where the
GPUs are missing, with the reason (`gpu`: one CUDA GPU; `multigpu`: two or more). The GEMM-heavy tests build a
smaller layer where this CPU's bf16 GEMM is a slow path (`cpu_layer`: the cpu profile's first sizing cut, chosen from
the same GEMM timing).

Why the CPU matters: oneDNN's bf16 GEMM on CPUs with AMX (Xeon with `amx_bf16`) is batch variant — the rows of
x[:m] @ w change with the total M (from M ~ 256 at the cpu profile's expert shapes) — so the real layer fails the
truncation test there; capped at AVX512_CORE_BF16 (and on CPUs without AMX, e.g. AVX2 only) it is batch invariant."""

import dataclasses
import functools
import json
import math
import os
import subprocess
import sys

import pytest

PIN_ISA = (("ONEDNN_MAX_CPU_ISA", "AVX512_CORE_BF16"),)
"""The engine environment of `cpu_cluster_pinned`: oneDNN without AMX. Harmless where oneDNN has no AMX to use; it is
in every record's numerics env (`env`, `cpu.env`), so a pinned measurement is never taken for the default."""


class CpuGemm:
    """This CPU's bf16 GEMM, measured apart from the test that relies on it: `moe_lab.engine.kernels` in a
    subprocess started with this process's environment plus `env` (what engines get: `ClusterConfig.env` on top of
    the controller's environment) and `threads` torch threads (CPU engines run one; a test's own GEMMs run in this
    process, at its thread count). oneDNN reads its ISA cap once per process, hence the subprocess."""

    def __init__(self):
        from moe_lab import profiles
        from moe_lab.questions.truncation import experiment as truncation

        p = profiles.load("cpu")
        self.profile_shapes = ((p.layer.hidden, p.layer.ffn_hidden), (p.layer.ffn_hidden, p.layer.hidden))  # fc1, fc2 (K, N)
        self.profile_ms = tuple(truncation.kernel_ms("cpu"))  # notebook 04's kernel probe

    @functools.lru_cache(maxsize=None)
    def _measure(self, shapes: tuple, ms: tuple, env: tuple, threads: int, speed: bool = False) -> dict:
        cmd = [sys.executable, "-m", "moe_lab.engine.kernels", "--ms", ",".join(map(str, ms)), "--threads",
               str(threads)] + (["--speed"] if speed else [])
        for k, n in shapes:
            cmd += ["--shape", f"{k},{n}"]
        r = subprocess.run(cmd, env={**os.environ, **dict(env)}, capture_output=True, text=True, timeout=300)
        assert r.returncode == 0, r.stderr[-2000:]
        return json.loads(r.stdout.strip().splitlines()[-1])

    def first_variant_m(self, shapes=None, ms=None, *, env=(), threads: int = 1) -> dict:
        """{"K,N": the first M whose first min(ms) rows differ from those rows alone, or None} per (K, N); default
        the cpu profile's expert GEMMs at notebook 04's Ms, under the engines' default environment."""
        shapes = tuple(tuple(s) for s in (shapes or self.profile_shapes))
        out = self._measure(shapes, tuple(ms or self.profile_ms), tuple(sorted(dict(env).items())), threads)
        return {s: v["first_variant_m"] for s, v in out["shapes"].items()}

    def slowdown(self, threads: int = 1) -> dict:
        """How much slower this CPU's bf16 GEMM is than its fp32 GEMM at the cpu profile's expert shapes, M = notebook
        04's largest (one thread, as an engine runs): {"K,N": {"bf16": ms, "fp32": ms}, "worst_ratio": r}. About 1
        or below where the CPU has bf16 instructions (AVX-512 BF16, AMX); 9-50 on an AVX2-only AMD EPYC (a slow
        path in torch 2.13's CPU build)."""
        out = self._measure(self.profile_shapes, self.profile_ms, (), threads, True)["shapes"]
        per = {s: v["gemm_ms"] for s, v in out.items()}
        return {**per, "worst_ratio": max(v["bf16"] / v["fp32"] for v in per.values())}

    def invariant(self, shapes=None, ms=None, *, env=(), threads: int = 1) -> bool:
        return all(m is None for m in self.first_variant_m(shapes, ms, env=env, threads=threads).values())


@pytest.fixture(scope="session")
def cpu_gemm():
    return CpuGemm()


BF16_FAST = 3.0
"""A CPU whose bf16 GEMM is at most this many times slower than its fp32 GEMM (`CpuGemm.slowdown`) runs the tests at
the cpu profile's layer, and the tiers' budgets are stated for it: AVX-512 BF16 and AMX CPUs are at about 1."""

MAX_TEST_CUTS = 1
"""The most `reporting.budget.STEPS` cuts a test layer takes: the first (ffn 256) halves the GEMMs' work and keeps
every verdict the tiers assert; at two (ffn 256 and 64 tokens, or ffn 128) notebook 04's emulated split-K no longer
fails the truncation test on the allgather (its GPU-like heuristic then splits K the same way at both row counts:
docs/bench.md), so a CPU slower still runs them at one cut, and the tier's budget test skips there with its
figures."""


@dataclasses.dataclass(frozen=True)
class CpuLayer:
    """The layer the notebook tier and the cluster tier's heaviest bf16 tests build: a profile's own where the bf16
    GEMM is fast, else halved by `reporting.budget.STEPS` — as a sized `make reports` would run it — as many times
    as bring the GEMM's slowdown within BF16_FAST (at most MAX_TEST_CUTS)."""

    ratio: float
    """This CPU's bf16 GEMM / its fp32 GEMM, the worse of the cpu profile's two expert shapes (one thread)."""
    cuts: int

    @property
    def left_ratio(self) -> float:
        """The slowdown the cuts leave: the GEMMs' work halves with each."""
        return self.ratio / 2 ** self.cuts

    def overrides(self, profile: str = "cpu") -> dict:
        """Profile keys → values that give `profile` (a name or a file) this layer (empty: its own)."""
        from moe_lab import profiles
        from moe_lab.reporting import budget

        return budget.cut(budget.layer_work(profiles.load(profile)), self.cuts)

    def config(self, profile: str = "cpu"):
        """`profile` (a name or a file) at this layer: its RunConfig (the layer, and the truncation cut with it)."""
        from moe_lab import profiles

        return profiles.load(profile, self.overrides(profile))

    def shapes(self, profile: str = "cpu") -> tuple:
        """The expert GEMMs' (K, N) at `profile`'s layer so cut: fc1, fc2 (as `CpuGemm.profile_shapes`)."""
        layer = self.config(profile).layer
        return (layer.hidden, layer.ffn_hidden), (layer.ffn_hidden, layer.hidden)

    def p_args(self, profile: str) -> list[str]:
        """`moe-lab run -p` arguments that give `profile` this layer."""
        return [a for k, v in self.overrides(profile).items() for a in ("-p", f"{k}={json.dumps(v)}")]

    def words(self, profile: str = "cpu") -> str:
        said = f"bf16 GEMM {self.ratio:.1f}x fp32"
        cut = self.overrides(profile)
        return f"{said}: " + (f"{self.cuts} cut(s), " + ", ".join(f"{k} {v}" for k, v in cut.items()) if cut else
                              "the profile's layer")


def cuts_for(ratio: float) -> int:
    """How many halvings of the GEMMs' work bring a bf16 slowdown of `ratio` within BF16_FAST (at most
    MAX_TEST_CUTS)."""
    return 0 if ratio <= BF16_FAST else min(MAX_TEST_CUTS, math.ceil(math.log2(ratio / BF16_FAST)))


@pytest.fixture(scope="session")
def cpu_layer(cpu_gemm) -> CpuLayer:
    """The layer for this CPU's bf16 GEMM (`CpuLayer`), said in the test log."""
    ratio = cpu_gemm.slowdown()["worst_ratio"]
    layer = CpuLayer(ratio=ratio, cuts=cuts_for(ratio))
    print(f"test layer: {layer.words()}")
    return layer


@pytest.fixture(scope="session")
def cpu_gemm_invariant(cpu_gemm):
    """Whether the CPU engines' bf16 GEMMs are batch invariant at the cpu profile's expert shapes (default env)."""
    return cpu_gemm.invariant()


def truncation_story(recs: list[dict], invariant: bool) -> None:
    """Notebook 04's records of the REAL CPU layer (not emulated), held against what this CPU's bf16 GEMM does
    (`invariant`, measured apart over several random draws): batch invariant → the kernel probe's real expert GEMMs
    are bitwise equal at every M and the real layer passes the truncation test. Batch variant (oneDNN on AMX) → the
    probe and the real layer may show it or not: on some Xeons AMX's rows differ in one element of 16,384 in half the
    draws, and the probe and the layer are one draw each. Either way reruns are bitwise equal (CPU and gloo are
    deterministic), and fixed-row tiles make the probe's rows and the real layer's first tokens bitwise equal."""
    real = [r for r in recs if not r.get("emulated") and "skipped" not in r]
    kern = [r for r in real if r.get("kind") == "kernel"]
    plain_k = [r for r in kern if r["remedy"] == "none"]
    assert plain_k, "no kernel probe of the real expert GEMMs in the records"
    varies = sorted({(r["linear"], r["M"]) for r in plain_k if not r["kernel"]["bitwise_equal"]})
    assert not (invariant and varies), ("the CPU GEMM measured apart is batch invariant, but notebook 04's kernel "
                                        f"probe says rows differ at {varies}")
    for r in kern:
        if "tiled_experts" in r["remedy"]:
            assert r["kernel"]["bitwise_equal"], ("fixed-row tiles did not make the real GEMM batch invariant", r["M"])
    cases = [r for r in real if r.get("kind") == "case" and r.get("available")]
    plain = [r for r in cases if r["remedy"] == "none"]
    assert plain, "no plain case of the real layer in the records"
    for r in cases:
        assert r["rerun"]["bitwise_equal"], (r["dispatcher"], r["remedy"], "a rerun differs on CPU")
        if "tiled_experts" in r["remedy"]:
            assert r["truncation"]["bitwise_equal"], (r["dispatcher"], r["remedy"], "tiles did not hold")
    for r in plain if invariant else ():
        assert r["truncation"]["bitwise_equal"], (
            f"{r['dispatcher']}: the real layer fails the truncation test ({r['truncation'].get('n_mismatch')} "
            "elements differ) on a CPU whose bf16 GEMM is batch invariant")


@pytest.fixture(scope="session", name="truncation_story")
def _truncation_story():
    return truncation_story


@pytest.fixture(scope="session")
def cpu_cluster():
    from moe_lab.config import ClusterConfig
    from moe_lab.controller.cluster import Cluster

    with Cluster(ClusterConfig(device="cpu", engines=4, timeout_s=180)) as c:
        yield c


@pytest.fixture(scope="session")
def cpu_cluster_pinned(cpu_gemm):
    """4 engines whose oneDNN is capped at AVX512_CORE_BF16 (PIN_ISA): batch-invariant bf16 GEMMs on CPUs with AMX
    too. For tests whose point is not the CPU's GEMM (EP order, atomics, depth) but that compare truncated forwards."""
    from moe_lab.config import ClusterConfig
    from moe_lab.controller.cluster import Cluster

    if not cpu_gemm.invariant(env=PIN_ISA):
        pytest.fail(f"bf16 GEMMs are batch variant even with {dict(PIN_ISA)} on this CPU "
                    f"({cpu_gemm.first_variant_m(env=PIN_ISA)}): the pinned cluster's premise does not hold")
    with Cluster(ClusterConfig(device="cpu", engines=4, timeout_s=180, env=PIN_ISA)) as c:
        yield c


def pytest_collection_modifyitems(config, items):
    import torch

    n = torch.cuda.device_count() if torch.cuda.is_available() else 0
    skips = {"gpu": (n < 1, "needs a CUDA GPU (run on the device machine: pytest -m gpu)"),
             "multigpu": (n < 2, f"needs >= 2 CUDA GPUs, {n} visible (pytest -m multigpu on a multi-GPU machine)")}
    for item in items:
        for marker, (skip, why) in skips.items():
            if skip and marker in item.keywords:
                item.add_marker(pytest.mark.skip(reason=why))
