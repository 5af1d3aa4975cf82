"""The rule that says whether a bf16 run's gap is what rounding gives: measured bands, not a hand-set threshold.

The truth is the same function computed in fp64 from the same bf16 weights and tokens (upcast), so a bf16 run's
distance to it is its arithmetic's rounding alone. Per element, a run's error is counted in ULPs of the truth's bf16
value (the spacing of bf16 numbers at `round_bf16(truth)`), signed, and relative (`(run - truth) / |truth|`).

Statistics (`error_stats`), per group of elements (the whole tensor, each expert's tokens, each stage — whatever
labels the caller gives): the median, p99, p99.9 and max of |error| in ULP; the mean signed error in ULP (a bias) and
its standard error; the same quantiles of |relative error|; and each ULP statistic's own sampling noise, measured
from the data as the largest |difference| between the statistic on two halves of the group's elements over
`SPLITS` interleaved splits (even/odd elements, then alternate pairs, fours, eights).

Judging (`judge_runs`), for each group g and statistic s: the band of the known-correct set C (reruns and other
correct layouts, or the runs a user declares known-good) is [lo, hi], the range of s_g over C — leave-one-out for a
run of C (its band is the others'). A run is out of band where

    s_g(run) > hi + (hi - lo) + noise_g,s

(noise: the largest split-half noise of that statistic among the run and the band's runs), and its bias is out of
band where the mean signed error is farther than 4 standard errors outside [lo - w, hi + w] of C's means (w = hi -
lo) and itself more than 4 standard errors from zero. A token whose top-k set differs from the truth's is out of
band where its margin (k-th minus (k+1)-th router score of the truth, in ULP) exceeds twice the band's limit on the
max |error| of the router scores (`flip_limit`); and where more of its tokens go to another number of experts than
the truth routes them to than the known-correct runs do (`judge_counts`: rounding never changes that number, a
capacity drop does). A band needs two distinct computations (bitwise reruns are one);
with fewer, the run is not judged — and so is each group whose band runs all computed it alike (equal statistics:
one computation of that group, e.g. a tensor that only the judged layout reduces in another order), which its verdict
lists (`unjudged_groups`). A run out of band anywhere is "not explained by rounding"
(naming the first group in the order the statistics were given — stages first to last —, the statistic, its value
and the band). A pair of in-band runs is "expected", with the tolerance the pair needs (`pair_gap`).

Torch-free at import: everything here works on numpy arrays (float64 views of bf16 values; `as_float64` takes a
torch tensor too) and on the plain dicts a record carries.
"""

from __future__ import annotations

import math
from dataclasses import asdict, dataclass, field, replace
from typing import Iterable, Mapping, Sequence

import numpy as np

ULP_STATISTICS = ("median", "p99", "p999", "max")
"""The quantiles of |error in ULP| judged per group, in order (p999: the 99.9th percentile)."""
BIAS = "mean"
"""The signed mean error in ULP, judged as a bias."""
BIAS_SIGMAS = 4.0
"""How many standard errors a bias must clear (from zero and from the widened band of C's means) to be out of band."""
ALL = "all"
"""The group every element belongs to."""
QUANTILES = {"median": 50.0, "p99": 99.0, "p999": 99.9, "max": 100.0}
"""Each ULP statistic as a percentile (numpy's 'linear')."""
BF16_MIN_NORMAL_EXP = -126
BF16_MANTISSA = 8  # significand bits, the implicit one included


def as_float64(x) -> np.ndarray:
    """A flat float64 numpy array of `x` (numpy array, torch tensor of any float dtype, or a sequence); bf16 and fp32
    values are exact in float64."""
    if hasattr(x, "detach"):  # a torch tensor, without importing torch here
        x = x.detach().to("cpu")
        if str(x.dtype) in ("torch.bfloat16", "torch.float16"):
            x = x.float()
        x = x.double().numpy()
    return np.asarray(x, dtype=np.float64).reshape(-1)


def round_bf16(x: np.ndarray) -> np.ndarray:
    """`x` rounded to the nearest bf16 value (ties to even), as float64; NaN and inf kept."""
    x = np.asarray(x, dtype=np.float64)
    f = x.astype(np.float32)  # fp64 -> fp32 rounds once; the double rounding this can make is at most one bf16 ULP
    bits = f.view(np.uint32).astype(np.uint64)
    rounded = ((bits + 0x7FFF + ((bits >> 16) & 1)) & 0xFFFF0000).astype(np.uint32)
    out = rounded.view(np.float32).astype(np.float64)
    return np.where(np.isfinite(x), out, x)


def bf16_ulp(truth: np.ndarray) -> np.ndarray:
    """The spacing of bf16 values at the truth's bf16 value: 2**(exponent - 7), at least the subnormal spacing 2**-133."""
    r = np.abs(round_bf16(truth))
    r = np.where(np.isfinite(r), r, np.finfo(np.float32).max)
    _, e = np.frexp(r)  # r = m * 2**e with m in [0.5, 1): exponent(r) = e - 1
    e = np.maximum(e - 1, BF16_MIN_NORMAL_EXP)
    return np.ldexp(1.0, e - (BF16_MANTISSA - 1))


def errors(run, truth) -> tuple[np.ndarray, np.ndarray]:
    """Per element: the signed error in ULPs of the truth's bf16 value, and the signed relative error (0 where the
    truth is 0 and the run too; inf where only the truth is 0)."""
    r, t = as_float64(run), as_float64(truth)
    if r.shape != t.shape:
        raise ValueError(f"run and truth must have as many elements: {r.size} vs {t.size}")
    d = r - t
    ulp = d / bf16_ulp(t)
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(t != 0, d / np.abs(t), np.where(d == 0, 0.0, np.inf))
    return ulp, rel


def _quantiles(a: np.ndarray) -> dict[str, float]:
    if a.size == 0:
        return {s: float("nan") for s in ULP_STATISTICS}
    qs = np.percentile(a, [QUANTILES[s] for s in ULP_STATISTICS])
    return {s: float(v) for s, v in zip(ULP_STATISTICS, qs)}


SPLITS = 4
"""Interleaved half-splits a statistic's noise is measured over (`error_stats`): element i is in half (i >> j) & 1
for j < SPLITS."""


def split_noise(a, quantiles=None) -> dict[str, float]:
    """Each ULP statistic's noise in flat group `a` (see `SPLITS`); `quantiles` computes the statistics (numpy's by
    default; `rule_torch` passes its own for a tensor on the engine's device)."""
    quantiles = quantiles or _quantiles
    n = len(a)
    if n < 2:
        return {s: float("inf") for s in ULP_STATISTICS}
    # interleaved halves only (element i in half (i >> j) & 1 for j = 0, 1, ...): contiguous halves would split a
    # bias confined to some tokens apart and count it as noise; strided views cost no shuffle of the whole group
    diffs = []
    for j in range(SPLITS):
        block = 1 << j
        m = n - n % (2 * block)
        if m < 2:
            break
        pairs = a[:m].reshape(-1, 2, block)
        x, y = quantiles(pairs[:, 0].reshape(-1)), quantiles(pairs[:, 1].reshape(-1))
        diffs.append({s: abs(x[s] - y[s]) for s in ULP_STATISTICS})
    return {s: float(max(d[s] for d in diffs)) for s in ULP_STATISTICS}


def _one_group(ulp: np.ndarray, rel: np.ndarray) -> dict:
    a = np.abs(ulp)
    n = int(a.size)
    stats = {"n": n, **_quantiles(a)}
    stats["mean"] = float(ulp.mean()) if n else float("nan")
    stats["mean_se"] = float(ulp.std(ddof=1) / math.sqrt(n)) if n > 1 else float("inf")
    # each statistic's sampling noise: the largest |difference| of the statistic between the two halves of the
    # group's elements over SPLITS interleaved splits (even/odd elements, pairs, fours, ...) — one split's
    # difference alone can land near zero by chance, and a tail quantile's noise keeps a band of near-copies honest
    stats["noise"] = split_noise(a)
    rq = _quantiles(np.abs(rel[np.isfinite(rel)]))
    stats["rel"] = {s: rq[s] for s in ("median", "p99", "max")}
    return stats


def error_stats(run, truth, labels=None, *, prefix: str = "", masks: Mapping[str, np.ndarray] | None = None,
                keep=None) -> dict[str, dict]:
    """A run's error statistics against the truth, per group: `prefix + "all"` for every element, then
    `prefix + str(label)` for each distinct label (in sorted order) where `labels` gives one per element (e.g. the
    expert a token went to in the truth, repeated over the hidden dimension; a negative integer label or None-like
    value leaves an element out of every labelled group, not out of "all").

    Each group's dict: n, median / p99 / p999 / max of |error in ULP|, mean (signed, ULP), mean_se, noise (per ULP
    statistic: the split-half difference) and rel (median / p99 / max of |relative error|). Plain floats, for a
    record's JSON.

    `masks`: more groups, name → boolean mask over the elements (they may overlap: a token's elements belong to each
    of its k experts), after the labelled groups. `keep`: a boolean mask of the elements measured at all (e.g. not
    the tokens whose routing flipped, which are judged by their margin instead); every group is taken within it."""
    ulp, rel = errors(run, truth)
    kept = np.ones(ulp.shape, bool) if keep is None else np.asarray(keep, bool).reshape(-1)
    if kept.shape != ulp.shape:
        raise ValueError(f"keep must give one flag per element: {kept.size} for {ulp.size} elements")
    out = {prefix + ALL: _one_group(ulp[kept], rel[kept])}
    if labels is not None:
        lab = np.asarray(labels).reshape(-1)
        if lab.shape != ulp.shape:
            raise ValueError(f"labels must give one label per element: {lab.size} labels for {ulp.size} elements")
        labelled = kept.copy()
        if lab.dtype.kind in "iu":
            labelled &= lab >= 0
        for g in sorted(set(lab[labelled].tolist())):
            m = labelled & (lab == g)
            out[f"{prefix}{g}"] = _one_group(ulp[m], rel[m])
    for name, mask in (masks or {}).items():
        m = np.asarray(mask, bool).reshape(-1)
        if m.shape != ulp.shape:
            raise ValueError(f"mask {name!r} must give one flag per element: {m.size} for {ulp.size} elements")
        out[prefix + name] = _one_group(ulp[m & kept], rel[m & kept])
    return out


@dataclass(frozen=True)
class Band:
    """The known-correct runs' range of one statistic in one group, and the limit a run may reach."""
    lo: float
    hi: float
    noise: float
    runs: tuple[str, ...]
    """The runs the band was measured from."""

    @property
    def limit(self) -> float:
        return self.hi + (self.hi - self.lo) + self.noise


@dataclass(frozen=True)
class Departure:
    """One statistic of one group out of band: what was measured against what the known-correct runs allow."""
    group: str
    statistic: str
    value: float
    band: Band
    sigmas: float | None = None
    """For a bias: how many standard errors the mean lies outside the widened band (None for a ULP quantile)."""

    def words(self) -> str:
        if self.statistic == COUNT:
            band = (f"every known-correct run: {self.band.lo:,.0f}" if self.band.lo == self.band.hi else
                    f"the known-correct runs: {self.band.lo:,.0f}–{self.band.hi:,.0f}")
            return (f"routing: {self.value:,.0f} tokens routed to another number of experts than the truth routes them "
                    f"to (rounding reorders a token's router scores, never how many experts it goes to; {band})")
        if self.statistic == FLIP:
            return (f"routing: a token's top-k set differs from the truth's at a margin of {self.value:.3g} ULP, beyond "
                    f"the {self.band.limit:.3g} ULP two router scores can move by the known-correct runs' rounding")
        if self.statistic == BIAS:
            return (f"{self.group}: mean signed error {self.value:+.3g} ULP, {self.sigmas:.1f} standard errors outside "
                    f"the known-correct runs' means [{self.band.lo:+.3g}, {self.band.hi:+.3g}] widened by their spread")
        return (f"{self.group}: {self.statistic} |error| {self.value:.3g} ULP > limit {self.band.limit:.3g} (known-"
                f"correct runs [{self.band.lo:.3g}, {self.band.hi:.3g}], noise {self.band.noise:.3g})")


@dataclass(frozen=True)
class RunVerdict:
    """One run against the known-correct set: in band everywhere, or where it departs."""
    run: str
    in_band: bool
    departures: tuple[Departure, ...] = ()
    """Every group and statistic out of band, in the order the groups were given (stages first to last)."""
    band_runs: tuple[str, ...] = ()
    """The runs its bands came from (leave-one-out: not the run itself)."""
    judged: bool = True
    """False where there was no known-correct run to measure a band from (fewer than two: no spread)."""
    unjudged_groups: tuple[str, ...] = ()
    """Groups left unjudged because every known-correct run computed them alike (their statistics equal: one
    computation, a band of no measured width), e.g. a tensor only one layout reduces in another order."""

    @property
    def first(self) -> Departure | None:
        return self.departures[0] if self.departures else None

    def _ratios(self) -> list[float]:
        return [d.value / d.band.limit for d in self.departures
                if d.statistic not in (BIAS, COUNT) and d.band.limit > 0]

    def excess(self) -> float:
        """How far the worst ULP departure lies past its limit, as a ratio value / limit (1.0 when in band)."""
        return max(self._ratios(), default=1.0)

    def excess_words(self) -> str:
        """`excess` as words ("51.2x its limit"), or "" where no departure has a ratio (a bias, or tokens routed to
        another number of experts, whose known-correct band is zero)."""
        r = self._ratios()
        return f"{max(r):.3g}x its limit" if r else ""

    def asdict(self) -> dict:
        return asdict(self)


def _fingerprint(group_stats: dict) -> tuple:
    return tuple(group_stats.get(k) for k in ("n", *ULP_STATISTICS, BIAS))


def _band(values: Sequence[float], noises: Sequence[float], runs: Sequence[str]) -> Band:
    return Band(lo=float(min(values)), hi=float(max(values)), noise=float(max(noises)), runs=tuple(runs))


def judge_run(run: str, stats: Mapping[str, dict], band_stats: Mapping[str, Mapping[str, dict]], *,
              min_runs: int = 2) -> RunVerdict:
    """One run's statistics (`error_stats`' dicts, any number of prefixes merged) against the known-correct runs'
    (run name → their statistics, the run itself left out by the caller). Groups the run has and the band's runs
    lack are not judged. With fewer than `min_runs` known-correct runs — or fewer than `min_runs` distinct ones (bitwise
    reruns of one computation have the same statistics) — there is no measured spread: `judged` is False (`min_runs`
    1: a band of one run, its width zero, its noise the statistics' own)."""
    names = [n for n in band_stats if n != run]
    # bitwise reruns repeat one computation: a band's spread needs min_runs distinct ones
    distinct = {repr(sorted((g, _fingerprint(v)) for g, v in band_stats[n].items())) for n in names}
    if len(names) < min_runs or len(distinct) < min_runs:
        return RunVerdict(run=run, in_band=True, band_runs=tuple(names), judged=False)
    deps, alike = [], []
    for g, s in stats.items():
        others = [band_stats[n][g] for n in names if g in band_stats[n]]
        if len(others) < min_runs or not s.get("n"):
            continue
        if len({_fingerprint(o) for o in others}) < min_runs:  # the band's runs are one computation of this group
            alike.append(g)
            continue
        for st in ULP_STATISTICS:
            vals = [o[st] for o in others]
            if any(not math.isfinite(v) for v in vals) or not math.isfinite(s[st]):
                continue
            noise = max([s["noise"][st]] + [o["noise"][st] for o in others])
            b = _band(vals, [noise], names)
            if s[st] > b.limit:
                deps.append(Departure(group=g, statistic=st, value=float(s[st]), band=b))
        means = [o[BIAS] for o in others]
        b = _band(means, [0.0], names)
        w = b.hi - b.lo
        m, se = s[BIAS], s["mean_se"]
        outside = max(b.lo - w - m, m - (b.hi + w), 0.0)
        if se > 0 and math.isfinite(se) and abs(m) > BIAS_SIGMAS * se and outside > BIAS_SIGMAS * se:
            deps.append(Departure(group=g, statistic=BIAS, value=float(m), band=b, sigmas=float(outside / se)))
        elif se == 0 and outside > 0 and m != 0:
            deps.append(Departure(group=g, statistic=BIAS, value=float(m), band=b, sigmas=float("inf")))
    return RunVerdict(run=run, in_band=not deps, departures=tuple(deps), band_runs=tuple(names),
                      unjudged_groups=tuple(alike))


FLIP = "flip margin"
"""The statistic of the routing group: the largest margin (k-th minus (k+1)-th router score of the truth, in ULPs of
bf16 at the k-th) among the tokens whose top-k set differs from the truth's."""
ROUTING = "routing"


def flip_limit(band_stats: Mapping[str, Mapping[str, dict]], scores_group: str) -> float | None:
    """The largest margin a rounding flip can have: twice the known-correct runs' limit on the max |error| of the
    router scores (each of the two scores at the boundary may be off by that much); None without two such runs."""
    vals = [s[scores_group] for s in band_stats.values() if scores_group in s and s[scores_group].get("n")]
    if len(vals) < 2:
        return None
    b = _band([v["max"] for v in vals], [v["noise"]["max"] for v in vals], tuple(band_stats))
    return 2.0 * b.limit


def judge_flips(run_verdict: RunVerdict, flipped_margins: Sequence[float], limit: float | None) -> RunVerdict:
    """`run_verdict` with a routing departure added where a token flipped at a margin beyond `limit` (`flip_limit`):
    flips at margins of a few ULP are what rounding gives; one at a larger margin is not."""
    if limit is None or not len(flipped_margins):
        return run_verdict
    worst = float(max(flipped_margins))
    if worst <= limit:
        return run_verdict
    d = Departure(group=ROUTING, statistic=FLIP, value=worst, band=Band(lo=limit, hi=limit, noise=0.0,
                                                                        runs=run_verdict.band_runs))
    return replace(run_verdict, in_band=False, departures=(d, *run_verdict.departures))


COUNT = "experts per token"
"""The other statistic of the routing group: tokens routed to another number of experts than the truth routes them
to. Rounding can reorder a token's router scores, never change how many experts the token goes to; a capacity drop
does, and at any margin."""


def judge_counts(run_verdict: RunVerdict, count: int | None, band_counts: Sequence[int | None]) -> RunVerdict:
    """`run_verdict` with a routing departure added where more of its tokens go to another number of experts than
    the truth's than the known-correct runs' range allows (its top plus its width, as any band): zero where every
    known-correct run routes each token to as many experts as the truth does. Not judged without a count (a record
    that holds none) or with fewer than two known-correct counts."""
    counts = [c for c in band_counts if c is not None]
    if count is None or len(counts) < 2:
        return run_verdict
    b = _band(counts, [0.0], run_verdict.band_runs)
    if count <= b.limit:
        return run_verdict
    d = Departure(group=ROUTING, statistic=COUNT, value=float(count), band=b)
    return replace(run_verdict, in_band=False, departures=(d, *run_verdict.departures))


def judge_runs(stats_by_run: Mapping[str, Mapping[str, dict]],
               known_good: Iterable[str] | None = None, *,
               flipped_margins: Mapping[str, Sequence[float]] | None = None,
               scores_group: str = "router.logits/all",
               leave_out: Mapping[str, Iterable[str]] | None = None,
               routed_counts: Mapping[str, int | None] | None = None) -> dict[str, RunVerdict]:
    """Every run judged against the known-correct set C (`known_good`, default: every run): a run of C against the
    others of C (leave-one-out), any other run against all of C. Returns run name → `RunVerdict`, in the given order.

    `flipped_margins`: per run, the truth's margins (ULP) of its tokens whose top-k set differs from the truth's;
    judged against `flip_limit` of its band's `scores_group` (a routing departure comes first: routing precedes the
    expert outputs).

    `routed_counts`: per run, its tokens routed to another number of experts than the truth routes them to (None:
    not counted); judged against the band's counts (`judge_counts`), its departure placed first.

    `leave_out`: per run, more runs its band leaves out besides itself — e.g. a layout's own reruns, so that a layout
    is held to the other layouts and not to copies of itself."""
    names = list(stats_by_run)
    good = list(names if known_good is None else known_good)
    unknown = [n for n in good if n not in stats_by_run]
    if unknown:
        raise ValueError(f"known_good names runs without statistics: {unknown}; the runs are {names}")
    band = {n: stats_by_run[n] for n in good}
    out = {}
    for n in names:
        out_of_band = {n, *((leave_out or {}).get(n, ()))}
        others = {k: v for k, v in band.items() if k not in out_of_band}
        v = judge_run(n, stats_by_run[n], others)
        if flipped_margins and v.judged:
            v = judge_flips(v, flipped_margins.get(n, ()), flip_limit(others, scores_group))
        if routed_counts and v.judged:
            v = judge_counts(v, routed_counts.get(n), [routed_counts.get(k) for k in others])
        out[n] = v
    return out


def bf16_ordered(x: np.ndarray) -> np.ndarray:
    """bf16 values (given as float64, exactly representable) mapped to int64 so adjacent bf16 values differ by 1."""
    b = (as_float64(x).astype(np.float32).view(np.uint32) >> 16).astype(np.int64)
    mag = b & 0x7FFF
    return np.where(b & 0x8000, -mag, mag)


def _all_bf16(x: np.ndarray) -> bool:
    finite = np.isfinite(x)
    return bool(np.array_equal(round_bf16(x[finite]), x[finite]))


@dataclass(frozen=True)
class Tolerance:
    """What a pair of bf16 runs needs to pass a tolerance check: |A - B| measured, and the `assert_close` that
    passes on it (rtol: the ULP p99.9 among elements at least the median magnitude, at bf16's widest relative
    spacing 2**-7 per ULP; atol: the largest remainder |A - B| - rtol |B|)."""
    n: int
    differ: int
    """Elements whose bits differ (of n)."""
    p999_ulp: float
    max_ulp: float
    p999_abs: float
    max_abs: float
    max_rel: float
    atol: float
    rtol: float

    @property
    def bitwise_fraction(self) -> float:
        return self.differ / self.n if self.n else 0.0

    def assert_close(self) -> str:
        return f"torch.testing.assert_close(a, b, atol={self.atol:.3g}, rtol={self.rtol:.3g})"

    def words(self) -> str:
        return (f"{self.differ:,} of {self.n:,} elements differ in their bits; |A-B| p99.9 {self.p999_ulp:.3g} ULP "
                f"({self.p999_abs:.3g}), max {self.max_ulp:.3g} ULP ({self.max_abs:.3g}), max rel {self.max_rel:.3g}; "
                f"{self.assert_close()}")

    def asdict(self) -> dict:
        return asdict(self)


def pair_gap(a, b) -> Tolerance:
    """The gap between two runs and the tolerance it needs. bf16 values (float64 views of them, or bf16 tensors):
    the ULP gap counts the bf16 values between A and B. Values finer than bf16 (fp32 main gradients): |A - B| in ULPs
    of B's bf16 value, the unit `errors` measures in."""
    x, y = as_float64(a), as_float64(b)
    if x.shape != y.shape:
        raise ValueError(f"a and b must have as many elements: {x.size} vs {y.size}")
    n = int(x.size)
    d = np.abs(x - y)
    if _all_bf16(x) and _all_bf16(y):
        ulp = np.abs(bf16_ordered(x) - bf16_ordered(y)).astype(np.float64)
    else:
        ulp = d / bf16_ulp(y)
    differ = int((ulp != 0).sum())
    if n == 0 or differ == 0:
        return Tolerance(n=n, differ=0, p999_ulp=0.0, max_ulp=0.0, p999_abs=0.0, max_abs=0.0, max_rel=0.0,
                         atol=0.0, rtol=0.0)
    denom = np.maximum(np.abs(x), np.abs(y))
    with np.errstate(divide="ignore", invalid="ignore"):
        rel = np.where(denom > 0, d / denom, 0.0)
    p999_ulp = float(np.percentile(ulp, 99.9))
    # rtol from the ULP gap where values are not near a cancellation (|B| at least its median): there a ULP is a
    # relative step of at most 2**-7; the elements near zero, many ULPs apart by little, are what atol covers
    large = np.abs(y) >= np.median(np.abs(y))
    rtol = max(float(np.percentile(ulp[large], 99.9)), 1.0) * 2.0 ** -7
    atol = float(np.max(np.maximum(d - rtol * np.abs(y), 0.0)))
    return Tolerance(n=n, differ=differ, p999_ulp=p999_ulp, max_ulp=float(ulp.max()),
                     p999_abs=float(np.percentile(d, 99.9)), max_abs=float(d.max()), max_rel=float(rel.max()),
                     atol=atol, rtol=rtol)


@dataclass(frozen=True)
class PairVerdict:
    """Two runs: expected (both in band; their gap is what reordering gives) with the tolerance they need, or not
    explained by rounding (naming the run farther from the truth, by how much, and where it first departs)."""
    a: str
    b: str
    expected: bool
    tolerance: Tolerance | None
    why: str
    farther: tuple[str, ...] = field(default_factory=tuple)
    """The run(s) out of band (empty when expected)."""
    judged: bool = True

    def __str__(self) -> str:
        head = ("expected: both are bf16 computations of the truth of the same quality" if self.expected else
                "not explained by rounding") if self.judged else "not judged"
        tol = f"\n  gap: {self.tolerance.words()}" if self.tolerance is not None else ""
        return f"{self.a} vs {self.b}: {head}\n  {self.why}{tol}"

    def asdict(self) -> dict:
        return asdict(self)


def pair_verdict(a: RunVerdict, b: RunVerdict, tolerance: Tolerance | None = None) -> PairVerdict:
    """The verdict on a pair from its two runs' verdicts (and the gap between them, where the caller measured it)."""
    if not (a.judged and b.judged):
        return PairVerdict(a.run, b.run, expected=False, tolerance=tolerance, judged=False,
                           why="fewer than two known-correct runs to measure a band from; no verdict")
    bad = [v for v in (a, b) if not v.in_band]
    if not bad:
        return PairVerdict(a.run, b.run, expected=True, tolerance=tolerance,
                           why="both within the known-correct runs' bands in every group and statistic")
    why = "; ".join(f"{v.run} is farther from the truth than the known-correct runs ("
                    + (f"worst ULP statistic {v.excess_words()}; " if v.excess_words() else "")
                    + f"{len(v.departures)} group statistic(s) out of band); first departs at {v.first.words()}"
                    for v in bad)
    return PairVerdict(a.run, b.run, expected=False, tolerance=tolerance, why=why, farther=tuple(v.run for v in bad))


__all__ = ["ULP_STATISTICS", "QUANTILES", "BF16_MANTISSA", "BF16_MIN_NORMAL_EXP", "BIAS", "BIAS_SIGMAS", "ALL",
           "as_float64", "split_noise", "round_bf16", "bf16_ulp", "errors",
           "error_stats", "Band", "Departure", "RunVerdict", "judge_run", "judge_runs", "bf16_ordered", "Tolerance",
           "pair_gap", "PairVerdict", "pair_verdict", "FLIP", "COUNT", "ROUTING", "flip_limit", "judge_flips",
           "judge_counts", "judge"]


def _bf16_values(x, name: str) -> np.ndarray:
    """A run's values as float64, checked to be bf16 values (a torch bf16 tensor, or numbers bf16 represents)."""
    dtype = str(getattr(x, "dtype", ""))
    if dtype.startswith("torch.") and dtype != "torch.bfloat16":
        raise ValueError(f"{name} is a {dtype} tensor; the oracle judges bf16 runs: pass the bf16 output as saved "
                         f"(or {name}.bfloat16() if it was bf16 before it was cast)")
    try:
        v = as_float64(x)
    except (TypeError, ValueError) as e:
        raise ValueError(f"{name} must be a torch tensor or a numpy array of numbers: {e}") from None
    fin = np.isfinite(v)
    if not np.array_equal(round_bf16(v[fin]), v[fin]):
        bad = int((round_bf16(v[fin]) != v[fin]).sum())
        raise ValueError(f"{name}: {bad:,} of {v.size:,} values are not bf16 values; the oracle judges bf16 runs "
                         f"(cast the saved output with .bfloat16() / round it to bf16 before judging)")
    return v


def judge(a, b, truth=None, known_good: Sequence = (), *, labels=None) -> PairVerdict:
    """Is the gap between two bf16 outputs `a` and `b` (torch tensors or numpy arrays, same shape) expected?

    With `truth` (the same computation in fp64 — or any higher precision — from the same bf16 inputs): each run's
    error to it, per element in ULPs of the truth's bf16 value, is judged against the band of `known_good` (outputs
    of runs you know to be correct: other layouts, reruns), or, where fewer than two are given, `a` against `b` and
    `b` against `a` (a band of one run: its width zero, the statistics' own noise). Without `truth`, the known-good
    runs stand in for it: each run is measured against the mean of the known-good runs but one (every run against
    a mean of as many runs; a known-good run against the others'), which needs at least two known-good runs.

    `labels`: one group label per element (e.g. the expert a token went to, repeated over the hidden size): every
    group is judged too. Returns a `PairVerdict`: `.expected`, `.tolerance` (the gap and the
    `torch.testing.assert_close` it needs), `.why`, and a `str()` to read. A shape or dtype mismatch, or values
    that are not bf16, is a ValueError that says which.
    """
    va, vb = _bf16_values(a, "a"), _bf16_values(b, "b")
    shape_a, shape_b = tuple(getattr(a, "shape", va.shape)), tuple(getattr(b, "shape", vb.shape))
    if shape_a != shape_b:
        raise ValueError(f"a and b must have one shape: {shape_a} vs {shape_b}")
    da, db = str(getattr(a, "dtype", "")), str(getattr(b, "dtype", ""))
    if da.startswith("torch.") != db.startswith("torch.") or (da.startswith("torch.") and da != db):
        raise ValueError(f"a and b must have one dtype: {da or type(a).__name__} vs {db or type(b).__name__}")
    good = [_bf16_values(g, f"known_good[{i}]") for i, g in enumerate(known_good)]
    for i, (g, raw) in enumerate(zip(good, known_good)):
        if tuple(getattr(raw, "shape", g.shape)) != shape_a:
            raise ValueError(f"known_good[{i}] has shape {tuple(getattr(raw, 'shape', g.shape))}; a has {shape_a}")
    t = None
    if truth is not None:
        t = as_float64(truth)
        if tuple(getattr(truth, "shape", t.shape)) != shape_a:
            raise ValueError(f"truth has shape {tuple(getattr(truth, 'shape', t.shape))}; a and b have {shape_a}")
    elif len(good) < 2:
        raise ValueError(f"without a truth the oracle needs at least two known-good runs to stand in for it "
                         f"(got {len(good)}): pass truth= (the fp64 computation from the same bf16 inputs) or "
                         f"known_good=(run1, run2, ...)")
    runs = {"a": va, "b": vb, **{f"known_good[{i}]": g for i, g in enumerate(good)}}
    stats = {}
    for name, v in runs.items():
        if t is not None:
            ref = t
        else:
            others = [g for j, g in enumerate(good) if f"known_good[{j}]" != name]
            ref = np.mean(others[: len(good) - 1], axis=0)
        stats[name] = error_stats(v, ref, labels)
    kg = [n for n in runs if n.startswith("known_good")]
    if len(kg) >= 2:
        verdicts = judge_runs(stats, known_good=kg)
    else:  # a against b and b against a, with the known-good run (if one) in both bands
        verdicts = {n: judge_run(n, stats[n], {k: stats[k] for k in runs if k != n}, min_runs=1) for n in ("a", "b")}
    v = pair_verdict(verdicts["a"], verdicts["b"], pair_gap(va, vb))
    basis = ("against the truth given" if t is not None else
             f"against the mean of {len(good) - 1} known-good run(s) standing in for the truth")
    band = (f"the band of {len(kg)} known-good runs" if len(kg) >= 2 else "each other (a band of one run)")
    return PairVerdict(v.a, v.b, expected=v.expected, tolerance=v.tolerance, judged=v.judged, farther=v.farther,
                       why=f"{v.why} (errors {basis}, held to {band})")
