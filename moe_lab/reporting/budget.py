"""A profile's time on this machine: measured at the start of a run, and the work sized so the run holds its budget.

On a CPU the bf16 GEMM decides how long the cpu profile takes: torch's CPU build sends bf16 GEMMs to oneDNN only where
the CPU has bf16 instructions (AVX-512 BF16, AMX); an AVX2-only CPU takes torch's own loop, 9-50x its fp32 GEMM
(docs/bench.md). So a run on the cpu profile first times one bf16 expert GEMM on an engine (`REFERENCE_SHAPE`, one
thread, as the engines run), predicts each notebook's cases' time from it with the line `CALIBRATION` measured on two
runs of the profile (seconds = fixed + per_ms x the GEMM's ms), adds what the run spends outside cases, and, where the
prediction is over the budget, runs a smaller layer: the experts' ffn width and the tokens per forward halved in turn
(each step halves the GEMMs' work, `STEPS`), as few steps as the prediction says hold it; a question whose effect a
smaller layer loses (`Question.max_cuts`) stops at its own cuts. The report says what was measured, what was
predicted and what was cut; records carry the layer they ran, so a sized run's cases are its own.

On one GPU shared by the ranks (virtual EP over gloo) the transport decides much of how long the gpu profile takes:
gloo sends a collective device → host → loopback TCP → host → device (most of a forward), the all-to-alls
through CUDA IPC buffers far less (engine.ipc_collectives; docs/bench.md). So a gpu-profile run
there first times a plain forward of the profile's layer on the shared cluster (`measure_forward_on_engines`), scales
each notebook's cases from `VIRTUAL_EP_CALIBRATION` (one H200's whole-profile run) by it, and, where the prediction is
over `GPU_BUDGET_S`, cuts what `VIRTUAL_EP_STEPS` allows, in turn: notebook 06's training steps, every cost's paired
rounds, 06's steps again (not the tokens per forward, which changed an answer). A cut's saving comes from the
calibration run's own records (`STEPS_FIXED_SHARE`, `TOKENS_FIXED_SHARE`, the notebooks' `cost_share`): the part of
a case that does not shrink with the work.

Torch-free: the measurements run on engines (`engine.kernels.gemm_ms`, `engine.toolkit.time_forward`), this module
only does the arithmetic.
"""

from __future__ import annotations

from dataclasses import dataclass, field

from .. import stats

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


VIRTUAL_EP_CALIBRATION = {
    "machine": "one H200 (GPU-d846b66b, 16-core Xeon), 4 ranks sharing it over gloo, torch 2.11.0+cu130, "
               "megatron-core 0.16.1, the gpu profile at 360181b, 2026-12-05 evening "
               "(reports/published/gpu-h200x1-2026-12-05-whole-profile)",
    "forward_ms": 159.6,
    "start_s": 207.1,
    "notebooks": {"01": 43.6, "02": 9.0, "03": 70.0, "04": 97.9, "05": 188.1, "06": 187.4, "07": 103.4, "08": 35.7,
                  "09": 21.2},
    "speed_fixed_share": 0.365,
    "cost_share": {"03": 0.282, "04": 0.529, "05": 0.165, "06": 0.009, "07": 0.275},
}
"""The calibration run on virtual EP. `forward_ms`: its plain forward of the profile's layer (notebook 09's allgather
case at 1024 tokens, router dtype none: the median of its trials' forwards, slowest rank); `notebooks`: the sum of each
notebook's cases' `case_wall_s` (`moe-lab timing` of the folder); `start_s`: the rest of the run — its 983 s over two
device calls less the cases' 756.3 s and the second call's cluster start (19.6 s): cluster start, kernel starts,
figures and pages not hidden behind the other notebook, and 99 s of engines idle between cases.
`speed_fixed_share`: the part of a case's time that does not follow the measured forward's speed, fitted on the first
sized run on another machine (reports/published/gpu-h100x1-2026-12-05-sized: one H100, a 94 ms forward, 12 steps and
512 tokens): its seven finished notebooks' cases took 254.3 s where scaling whole cases by the forward's speed (0.589)
predicted 202.7 s; the share that stays at the calibration's pace solves 0.739 = share + (1 - share) x 0.589.
`cost_share`: the part of each notebook's cases its paired cost rounds took in the calibration run (its records: each
cost's rounds + 1 warm-up x the median seconds of the fns a round runs; barriers and syncs between them not counted,
so the share is low and a cut of the rounds is predicted to save less than it does). One H100's records at e032c6d
gave 0.28, 0.51, 0.16 and 0.016 for 03-06."""

TOKENS_FIXED_SHARE = 0.31
"""The part of a seed-layer case that does not shrink with the tokens per forward: notebook 09's cases of the
calibration run at 256, 1024 and 4096 tokens lie on a line whose intercept is 0.30 of the 1024-token case (allgather:
1.39, 2.90, 8.26 s) and 0.33 (alltoall: 0.91, 1.84, 5.87 s)."""

STEPS_FIXED_SHARE = 0.26
"""The part of a notebook-06 training run that does not shrink with its steps, at most: in the calibration run a
4-layer run took 8.1-8.6 s against 2.0-3.3 s with 1 layer (ep4, deterministic), so of a 1-layer run's 2.6 s, 0.67 s
(0.26) does not scale with the layers' work; the per-step work it holds scales with the steps too, so this overstates
what a halving keeps, and the prediction errs long."""

VIRTUAL_EP_STEPS = (("training.steps", 2), ("cost_rounds", 3), ("training.steps", 2))
"""The cuts on virtual EP, in turn: notebook 06's steps halved (its runs part after step 1 in every published report,
at 12 steps as at 25); every cost's paired rounds down to 3 (`COST_ROUND_KEYS`: on virtual EP a cost is mostly gloo's
transport — `stats.headline_cost` reads its compute figure —, and a cost's words give its interval the confidence its
rounds do, 75 % for 3: `stats.interval_words`); 06's steps halved again (6 of 25: still past the step the runs
part). The tokens per forward are not cut, though they set most of a case's transport: on one H100 the allgather
dispatcher's answer at 512 tokens (run-to-run nondeterminism besides the EP order, the first divergent stage
inside one rank, combine.pre; reports/published/gpu-h100x1-2026-12-05-sized) is not the one at the profile's 1024 on
the same kind of GPU (the EP order alone, first at the bf16 reduce-scatter; reports/published/gpu-h100x1-2026-12-05):
a smaller case that does not show the same effect. `TOKENS_FIXED_SHARE` stays for the prediction of that run."""

COST_ROUND_KEYS = ("cost_rounds", "training.cost_rounds", "presets.cost_rounds")
"""The profile keys of paired cost rounds the ("cost_rounds", n) cut sets: the questions' own, 06's and 07's."""

ROUNDS_KEY = {"06": "training.cost_rounds", "07": "presets.cost_rounds"}
"""Which of `COST_ROUND_KEYS` sets a notebook's cost rounds (the others: "cost_rounds")."""

VIRTUAL_EP_KEYS = (*dict.fromkeys(k for k, _ in VIRTUAL_EP_STEPS if k != "cost_rounds"), *COST_ROUND_KEYS)
"""Every profile key a virtual-EP cut sets (`virtual_ep_work` reads them; one given by the run turns sizing off)."""


def virtual_ep_work(config) -> dict:
    """The profile's values of `VIRTUAL_EP_KEYS` in `config` (a `run_config.RunConfig`): what the cuts start from."""
    from ..questions.presets.params import PresetParams
    from ..questions.training.params import TrainParams

    train = config.params(TrainParams)
    return {"training.steps": train.steps, "cost_rounds": config.rounds(),
            "training.cost_rounds": train.cost_rounds,
            "presets.cost_rounds": config.params(PresetParams).cost_rounds}


def layer_work(config) -> dict:
    """The profile's values in `config` (a `run_config.RunConfig`) of the keys `STEPS` cut: ffn_hidden, seq_len, the
    truncation cut and notebook 09's lengths — what `size` and `cut` start from."""
    from ..questions.seq_len.params import SeqLenParams

    return {"ffn_hidden": config.layer.ffn_hidden, "seq_len": config.layer.seq_len, "cut": config.run.cut,
            "seq_lens": list(config.params(SeqLenParams).seq_lens)}


TOKENS_SCALED = ("01", "02", "03", "04", "05", "07", "08", "09")
"""The notebooks whose cases run the profile's layer at its tokens per forward (06 runs its training preset)."""

GPU_BUDGET_S = 570.0
"""The gpu profile's budget for a run on one GPU shared by its ranks (the command's start to its end): the goal of
10 minutes less 5 %, as the prediction misses from one H100 to another, most of all where it runs short: on one it
predicted 622 s for a run whose first six notebooks alone took 530 s, on another 567 s for runs of 446 and 451 s
(docs/bench.md, 'Fifteenth pass')."""


@dataclass(frozen=True)
class _Outcome:
    """What every sizing says: its budget, its predictions and its cuts."""

    budget_s: float
    predicted_full_s: float
    """The notebooks' predicted seconds at the profile's work."""
    predicted_s: float
    """...at the work run (equal to predicted_full_s when nothing was cut)."""
    overrides: dict
    """The profile keys changed (empty: the profile's work)."""
    held: bool
    """Whether the prediction at the work run is within the budget."""

    def _words(self, measured: str, work: str, less: str, least: str, nothing_left: str) -> str:
        full = f"{measured}; at the profile's {work} the run was predicted to take {self.predicted_full_s:.0f} s"
        if not self.overrides:
            return (f"{full} (budget {self.budget_s:.0f} s): it ran {'at ' if work == 'layer' else ''}the profile's "
                    f"{work}" + ("." if self.held else f", over the budget ({nothing_left})."))
        cut = ", ".join(f"{k} {v}" for k, v in self.overrides.items())
        how = less if self.held else least
        size = "on that layer" if work == "layer" else "at that size"
        return (f"{full}, over its budget of {self.budget_s:.0f} s, so it ran {how} ({cut}): predicted "
                f"{self.predicted_s:.0f} s{'' if self.held else ', still over the budget'}. Each question's effect "
                f"is measured {size}; a run at the profile's {'layer' if work == 'layer' else 'size'}: --budget 0.")


@dataclass(frozen=True)
class Sizing(_Outcome):
    """What a cpu-profile run was sized to, and why: every number the report says."""

    gemm_ms: float = 0.0
    """The timed bf16 GEMM on this CPU (ms, median)."""
    fp32_ms: float = 0.0
    """The same GEMM in fp32 (ms): how far bf16 is from the CPU's plain speed."""
    kept: dict = field(default_factory=dict)
    """Notebook → the overrides it ran at, where its question's most cuts (`Question.max_cuts`) stopped it short of
    the run's: a bigger layer than the others' (empty overrides: the profile's own)."""
    kept_why: dict = field(default_factory=dict)
    """Notebook → why its cuts stop there (`Question.max_cuts_why`)."""

    def words(self) -> str:
        speed = (f"this CPU's bf16 expert GEMM ({'x'.join(map(str, REFERENCE_SHAPE))}) took {self.gemm_ms:.2f} ms, "
                 f"{self.gemm_ms / self.fp32_ms:.1f}x its fp32 GEMM" if self.fp32_ms > 0 else
                 f"this CPU's bf16 expert GEMM took {self.gemm_ms:.2f} ms")
        out = self._words(speed, "layer", "a smaller layer", "the smallest layer the sizing cuts to",
                          "the layer is too small to cut")
        for nb, ov in sorted(self.kept.items()):
            at = f"a bigger layer ({', '.join(f'{k} {v}' for k, v in ov.items())})" if ov else "the profile's layer"
            out += f" Notebook {nb} ran at {at}, its question's most cuts: {self.kept_why.get(nb, '')}."
        return out


def _halve(cur: dict, overrides: dict, key: str, factor: int) -> None:
    """Cut `key` of `cur` by `factor`, into `overrides` too; the tokens per forward take the truncation cut and
    notebook 09's lengths along."""
    cur[key] = cur[key] // factor
    overrides[key] = cur[key]
    if key == "seq_len":
        if "cut" in cur:
            cur["cut"] = max(1, cur["cut"] // factor)
            overrides["cut"] = cur["cut"]
        if cur.get("seq_lens"):
            cur["seq_lens"] = [max(2, n // factor) for n in cur["seq_lens"]]
            overrides["seq_lens"] = cur["seq_lens"]


def _splits(cur: dict, key: str, factor: int) -> bool:
    """Whether `key` of `cur` is still big enough to cut by `factor` (the cut leaves at least 2 x factor)."""
    return cur.get(key, 0) // factor >= 2 * factor


def cut(layer: dict, steps: int) -> dict:
    """The overrides of `layer` (the keys `STEPS` cut: ffn_hidden, seq_len, cut, seq_lens) after the first `steps`
    cuts, each halving the GEMMs' work, stopping where the layer is too small to split: the layer a sized run takes at
    that many cuts, for a caller that chose the number itself (the tests, from their own GEMM timing)."""
    if not (isinstance(steps, int) and not isinstance(steps, bool) and 0 <= steps <= len(STEPS)):
        raise ValueError(f"steps ({steps!r}) must be a whole number from 0 to {len(STEPS)}")
    cur, overrides = dict(layer), {}
    for key, factor in STEPS[:steps]:
        if not _splits(cur, key, factor):
            break
        _halve(cur, overrides, key, factor)
    return overrides


def predict(gemm_ms: float, notebooks, calibration: dict = CALIBRATION, work: float = 1.0,
            work_of: dict | None = None) -> float:
    """Seconds for a run of `notebooks` (numbers) at a GEMM time of `gemm_ms`, with the GEMMs' work scaled by `work`
    (`work_of`: notebook → its own scale, where it differs): the start, and each notebook's line through its two
    calibration runs (the fixed part does not scale; the GEMM part does)."""
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
        total += fixed + per_ms * gemm_ms * (work_of or {}).get(nb, work)
    return total


def size(gemm_ms: float, fp32_ms: float, layer: dict, notebooks, *, budget_s: float = DEFAULT_BUDGET_S,
         calibration: dict = CALIBRATION, floors: dict | None = None) -> Sizing:
    """The first prefix of `STEPS` whose predicted time holds `budget_s` (all of them where none does).
    `layer`: the profile's values of the keys the steps cut (ffn_hidden, seq_len, cut, seq_lens). `floors`: notebook
    → (its most cuts, why) (`Question.max_cuts`): such a notebook stops at its own cuts, and is predicted at its own
    layer, while the others are cut further."""
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget ({budget_s!r}) must be a positive number of seconds (0 turns sizing off)")
    floors = {nb: f for nb, f in (floors or {}).items() if nb in notebooks}
    full = predict(gemm_ms, notebooks, calibration)
    overrides: dict = {}
    taken: list[int] = []  # the factors of the cuts taken, in order
    predicted = full
    cur = dict(layer)

    def work(n_cuts: int) -> float:
        out = 1.0
        for f in taken[:n_cuts]:
            out /= f
        return out

    for key, factor in STEPS:
        if predicted <= budget_s:
            break
        if not _splits(cur, key, factor):  # the layer would be too small to split: stop cutting
            break
        _halve(cur, overrides, key, factor)
        taken.append(factor)
        predicted = predict(gemm_ms, notebooks, calibration, work(len(taken)),
                            work_of={nb: work(most) for nb, (most, _) in floors.items()})
    kept = {nb: cut(layer, most) for nb, (most, _) in floors.items() if most < len(taken)}
    return Sizing(gemm_ms=gemm_ms, fp32_ms=fp32_ms, budget_s=float(budget_s), predicted_full_s=full,
                  predicted_s=predicted, overrides=overrides, held=predicted <= budget_s, kept=kept,
                  kept_why={nb: floors[nb][1] for nb in kept})


@dataclass(frozen=True)
class VirtualEpSizing(_Outcome):
    """A gpu-profile run on one GPU shared by its ranks: what it was sized to, and why."""

    forward_ms: float = 0.0
    """A plain forward of the profile's layer on this cluster (ms: median of 5 after a warm-up, slowest rank)."""
    reference_ms: float = 0.0
    """The same forward in the calibration run."""
    ranks: int = 0
    transport: str | None = None
    """What carried the ranks' all-to-alls where not gloo (engine.ipc_collectives: 'CUDA IPC'); None: gloo."""

    def words(self) -> str:
        speed = (f"{self.ranks} ranks share this GPU over gloo{stats.carried(self.transport)}: a plain forward of the "
                 f"profile's layer took {self.forward_ms:.0f} ms ({self.reference_ms:.0f} ms in the calibration run on "
                 f"one H200, every collective over gloo)")
        return self._words(speed, "work", "less work", "the least work the sizing cuts to", "nothing left to cut")


def predict_virtual_ep(forward_ms: float, notebooks, calibration: dict = VIRTUAL_EP_CALIBRATION, *,
                       tokens: float = 1.0, steps: float = 1.0, rounds: dict | None = None) -> float:
    """Seconds for a run of `notebooks` on virtual EP whose plain forward takes `forward_ms`, at `tokens` and `steps`
    times the profile's, and `rounds` (notebook → the fraction of its cost rounds' time kept; 1 where not given): the
    calibration run's start, and each notebook's cases scaled by the forward's speed (all but their
    `speed_fixed_share`), their part that shrinks with the work (1 - the fixed share) scaled by it, and the cost
    rounds' part of what is left (`cost_share`) by `rounds`."""
    fixed_speed = calibration.get("speed_fixed_share", 0.0)
    speed = fixed_speed + (1 - fixed_speed) * forward_ms / calibration["forward_ms"]
    total = float(calibration.get("start_s", 0.0))
    shares = calibration.get("cost_share", {})
    for nb in notebooks:
        t = calibration["notebooks"].get(nb)
        if t is None:
            continue
        cost = shares.get(nb, 0.0)
        if nb in TOKENS_SCALED:
            work, fixed = tokens, TOKENS_FIXED_SHARE
        elif nb == "06":
            work, fixed = steps, STEPS_FIXED_SHARE
        else:
            work, fixed = 1.0, 1.0
        kept = (rounds or {}).get(nb, 1.0)
        total += t * speed * (fixed + (1 - fixed) * work) * (1 - cost * (1 - kept))
    return total


def size_virtual_ep(forward_ms: float, ranks: int, layer: dict, notebooks, *, budget_s: float = GPU_BUDGET_S,
                    calibration: dict = VIRTUAL_EP_CALIBRATION, transport: str | None = None) -> VirtualEpSizing:
    """The first prefix of `VIRTUAL_EP_STEPS` whose prediction holds `budget_s` (all of them where none does; a cut
    with nothing to take is passed over). `layer`: the profile's training.steps and the `COST_ROUND_KEYS`' values."""
    if not (isinstance(budget_s, (int, float)) and budget_s > 0):
        raise ValueError(f"budget ({budget_s!r}) must be a positive number of seconds (0 turns sizing off)")
    if not (isinstance(forward_ms, (int, float)) and forward_ms > 0):
        raise ValueError(f"the measured forward ({forward_ms!r} ms) must be a positive number")
    full = predict_virtual_ep(forward_ms, notebooks, calibration)
    cur, overrides = dict(layer), {}
    steps, rounds, predicted = 1.0, {}, full
    for key, value in VIRTUAL_EP_STEPS:
        if predicted <= budget_s:
            break
        if key == "cost_rounds":  # every cost's rounds down to `value` (+1 warm-up round each, as they run)
            keys = [k for k in COST_ROUND_KEYS if isinstance(cur.get(k), int) and cur[k] > value]
            if not keys:
                continue
            for k in keys:
                cur[k] = overrides[k] = value
            rounds = {nb: (value + 1) / (layer[its] + 1)  # each cost's rounds run after one warm-up round
                      for nb in calibration["notebooks"] if (its := ROUNDS_KEY.get(nb, "cost_rounds")) in keys}
        else:  # 06's steps halved, where 06 runs and has steps to halve
            if "06" not in notebooks or cur.get(key, 0) // value < 2:
                continue
            steps /= value
            _halve(cur, overrides, key, value)
        predicted = predict_virtual_ep(forward_ms, notebooks, calibration, steps=steps, rounds=rounds)
    return VirtualEpSizing(forward_ms=float(forward_ms), reference_ms=float(calibration["forward_ms"]), ranks=ranks,
                           transport=transport, budget_s=float(budget_s), predicted_full_s=full, predicted_s=predicted,
                           overrides=overrides, held=predicted <= budget_s)


def measure_forward_on_engines(cfg_dict: dict, layout: dict) -> float:
    """Runs on every rank at once: a plain forward of the layer `cfg_dict` at `layout`, the median seconds of 5 after
    a warm-up (the controller takes the slowest rank's, as the probe's t_forward_s does). The layer is dropped
    afterwards: a sized run's notebooks build theirs at another size."""
    from ..engine import dist, toolkit

    s = toolkit.setup(cfg_dict, layout)
    try:
        toolkit.forward(s.layer, s.tokens)
        return toolkit.time_forward(s.layer, s.tokens, 5)
    finally:
        del s
        dist.release_caches()


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
           "DEFAULT_BUDGET_S", "VirtualEpSizing", "size_virtual_ep", "predict_virtual_ep", "measure_forward_on_engines",
           "VIRTUAL_EP_CALIBRATION", "VIRTUAL_EP_STEPS", "COST_ROUND_KEYS", "ROUNDS_KEY", "VIRTUAL_EP_KEYS",
           "virtual_ep_work", "layer_work", "TOKENS_SCALED", "TOKENS_FIXED_SHARE", "STEPS_FIXED_SHARE", "GPU_BUDGET_S", "cut"]
