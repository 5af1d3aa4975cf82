"""The cpu profile's time on this CPU: measured at the start of a run, and the layer sized so the run holds its budget.

On a CPU the bf16 GEMM decides how long the cpu profile takes: torch's CPU build sends bf16 GEMMs to oneDNN only where
the CPU has bf16 instructions (AVX-512 BF16, AMX); an AVX2-only CPU takes torch's own loop, 9-50x its fp32 GEMM
(docs/bench.md). So a run on the cpu profile first times one bf16 expert GEMM on an engine (`REFERENCE_SHAPE`, one
thread, as the engines run), predicts each notebook's cases' time from it with the line `CALIBRATION` measured on two
runs of the profile (seconds = fixed + per_ms x the GEMM's ms), adds what the run spends outside cases, and, where the
prediction is over the budget, runs a smaller layer: the experts' ffn width and the tokens per forward halved in turn
(each step halves the GEMMs' work, `STEPS`), as few steps as the prediction says hold it. The report says what was
measured, what was predicted and what was cut; records carry the layer they ran, so a sized run's cases are its own.

Torch-free: the measurement runs on an engine (`engine.kernels.gemm_ms`), this module only does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass

REFERENCE_SHAPE = (64, 256, 512)
"""(M, K, N) of the timed GEMM: one expert's GEMM in the cpu profile's layer (128 tokens x top-4 / 8 experts rows,
hidden 256, ffn 512; x[M, K] @ w[N, K].T). Small M is where the AVX2 loop is slowest against fp32 (50x at M 128,
9x at M 1024 on the AVX2 EPYC: docs/bench.md), so the reference is the layer's own M, not a large one."""

CALIBRATION = {
    "machine": "2-core AMD EPYC with avx512_bf16, torch 2.13.0+cpu, two notebooks at a time, 2026-12-05 11:27-11:38 "
               "UTC (docs/bench.md)",
    "gemm_ms": (0.10, 1.08),
    "start_s": 41.6,
    "notebooks": {"01": (9.8, 11.8), "02": (1.6, 2.2), "03": (12.8, 26.5), "04": (11.0, 17.3), "05": (31.8, 179.3),
                  "06": (16.8, 14.9), "07": (11.0, 15.3), "08": (15.2, 15.5), "09": (1.6, 3.8)},
}
"""Two runs of the cpu profile on one machine, both at the profile's layer (the second with `--budget 0`): oneDNN's
bf16 GEMM, and torch's own loop (MOE_LAB_NO_CPU_BF16=1, ATEN_CPU_CAPABILITY=avx2). `gemm_ms`: the reference GEMM's ms in each;
`notebooks`: number → the seconds its cases took on the engines in the first run, in the second (the sum of their
`case_wall_s`: one notebook's cases at a time, the GEMMs' part of a run); `start_s`: the rest of the first run (153 s
in all) — the command's start and the cluster's, kernel starts, notebook 03's release switches, and the figures and
pages that running two notebooks at a time did not hide (38.5 s of the second run's 325 s). A notebook not listed
(one added since) is left out of the prediction."""

STEPS = (("ffn_hidden", 2), ("seq_len", 2), ("ffn_hidden", 2), ("seq_len", 2), ("ffn_hidden", 2))
"""The cuts, in order, each halving the GEMMs' work: the experts' ffn width (the expert GEMMs' N), the tokens per
forward (their M; the truncation cut and notebook 09's lengths follow), and so on in turn, down to 1/32 of the work
(ffn 64, 32 tokens: every expert still gets rows from several tokens at top-4 of 8)."""

DEFAULT_BUDGET_S = 300.0
"""The cpu profile's budget for a run (the command's start to its end; set-up excluded)."""


@dataclass(frozen=True)
class Sizing:
    """What a run was sized to, and why: every number the report says."""

    gemm_ms: float
    """The timed bf16 GEMM on this CPU (ms, median)."""
    fp32_ms: float
    """The same GEMM in fp32 (ms): how far bf16 is from the CPU's plain speed."""
    budget_s: float
    predicted_full_s: float
    """The notebooks' predicted seconds at the profile's layer."""
    predicted_s: float
    """...at the layer run (equal to predicted_full_s when nothing was cut)."""
    overrides: dict
    """The profile keys changed (empty: the profile's layer)."""
    held: bool
    """Whether the prediction at the layer run is within the budget."""

    def words(self) -> str:
        speed = (f"this CPU's bf16 expert GEMM ({'x'.join(map(str, REFERENCE_SHAPE))}) took {self.gemm_ms:.2f} ms, "
                 f"{self.gemm_ms / self.fp32_ms:.1f}x its fp32 GEMM" if self.fp32_ms > 0 else
                 f"this CPU's bf16 expert GEMM took {self.gemm_ms:.2f} ms")
        full = f"{speed}; at the profile's layer the run was predicted to take {self.predicted_full_s:.0f} s"
        if not self.overrides:
            return (f"{full} (budget {self.budget_s:.0f} s): it ran at the profile's layer"
                    + ("." if self.held else ", over the budget (the layer is too small to cut)."))
        cut = ", ".join(f"{k} {v}" for k, v in self.overrides.items())
        how = "a smaller layer" if self.held else "the smallest layer the sizing cuts to"
        return (f"{full}, over its budget of {self.budget_s:.0f} s, so it ran {how} ({cut}): predicted "
                f"{self.predicted_s:.0f} s{'' if self.held else ', still over the budget'}. Each question's effect "
                f"is measured on that layer; a run at the profile's layer: --budget 0.")


def predict(gemm_ms: float, notebooks, calibration: dict = CALIBRATION, work: float = 1.0) -> float:
    """Seconds for a run of `notebooks` (numbers) at a GEMM time of `gemm_ms`, with the GEMMs' work scaled by `work`:
    the start, and each notebook's line through its two calibration runs (the fixed part does not scale; the GEMM
    part does)."""
    lo, hi = calibration["gemm_ms"]
    total = float(calibration.get("start_s", 0.0))
    for nb in notebooks:
        t = calibration["notebooks"].get(nb)
        if t is None:
            continue
        per_ms = (t[1] - t[0]) / (hi - lo) if hi > lo else 0.0
        per_ms = max(per_ms, 0.0)  # a notebook that ran faster with the slower GEMM: noise, no GEMM part
        fixed = t[0] - per_ms * lo
        if fixed < 0:  # the two runs' line crosses zero above 0 ms (noise): through the origin and the slow run
            per_ms, fixed = t[1] / hi, 0.0
        total += fixed + per_ms * gemm_ms * work
    return total


def size(gemm_ms: float, fp32_ms: float, layer: dict, notebooks, *, budget_s: float = DEFAULT_BUDGET_S,
         calibration: dict = CALIBRATION) -> Sizing:
    """The first prefix of `STEPS` whose predicted time holds `budget_s` (all of them where none does).
    `layer`: the profile's values of the keys the steps cut (ffn_hidden, seq_len, cut, seq_lens)."""
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget ({budget_s!r}) must be a positive number of seconds (0 turns sizing off)")
    full = predict(gemm_ms, notebooks, calibration)
    overrides: dict = {}
    work, predicted = 1.0, full
    cur = dict(layer)
    for key, factor in STEPS:
        if predicted <= budget_s:
            break
        if cur.get(key, 0) // factor < 2 * factor:  # the layer would be too small to split: stop cutting
            break
        cur[key] = cur[key] // factor
        overrides[key] = cur[key]
        if key == "seq_len":
            if "cut" in cur:
                cur["cut"] = max(1, cur["cut"] // factor)
                overrides["cut"] = cur["cut"]
            if cur.get("seq_lens"):
                cur["seq_lens"] = [max(2, n // factor) for n in cur["seq_lens"]]
                overrides["seq_lens"] = cur["seq_lens"]
        work /= factor
        predicted = predict(gemm_ms, notebooks, calibration, work)
    return Sizing(gemm_ms=gemm_ms, fp32_ms=fp32_ms, budget_s=float(budget_s), predicted_full_s=full,
                  predicted_s=predicted, overrides=overrides, held=predicted <= budget_s)


def measure_on_engine() -> dict:
    """Runs on an engine: the reference GEMM's median ms in bf16 and in fp32, on one thread."""
    import torch

    from ..engine.kernels import gemm_ms

    m, k, n = REFERENCE_SHAPE
    threads = torch.get_num_threads()
    torch.set_num_threads(1)
    try:
        return {"bf16_ms": gemm_ms(k, n, m, dtype=torch.bfloat16, repeats=5),
                "fp32_ms": gemm_ms(k, n, m, dtype=torch.float32, repeats=5)}
    finally:
        torch.set_num_threads(threads)


__all__ = ["Sizing", "size", "predict", "measure_on_engine", "REFERENCE_SHAPE", "CALIBRATION", "STEPS",
           "DEFAULT_BUDGET_S"]
