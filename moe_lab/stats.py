"""Pure statistics of timings, one definition everywhere: a cost is the median over paired rounds of
(slowest rank's time with the change) / (slowest rank's time without it), with a distribution-free 95 % confidence
interval of that median (order statistics); an A/A run (plain against plain, same protocol) gives the noise floor.
A cost is worded by where its interval lies against the noise floor's (`against_floor`): inside it ("no measurable
cost"), overlapping it ("not told apart from the noise floor" — not the same claim: part of the interval lies
outside), above or below it (measured); costs inside the noise are never ranked.

Where the rounds also timed the collectives (toolkit.paired_rounds), a cost carries its compute figure (the same
statistic of wall − collective seconds), the collective share of each forward and whether the plain one is
transport-bound (collectives > half of it: virtual EP over gloo); `headline_cost` says which figure is the remedy's
cost, and an A/A floor carries the same fields, so a compute cost is judged against a compute floor."""

from __future__ import annotations

import math
import numbers
import statistics

LEVEL = 0.95


def _order_k(n: int, level: float) -> int:
    """The largest k with P(Binomial(n, 1/2) < k) <= (1 - level) / 2: the interval of the median of n values is
    x(k), x(n+1-k); 0 where no k holds (n < 6 at 95 %)."""
    alpha = (1 - level) / 2
    k, cdf = 0, 0.0
    for j in range(n):  # cdf = P(B < j + 1)
        cdf += math.comb(n, j) / 2**n
        if cdf > alpha:
            break
        k = j + 1
    return k


def median_ci(xs: list[float], level: float = LEVEL) -> tuple[float, float]:
    """A distribution-free confidence interval of the median: order statistics x(k), x(n+1-k) with the largest k
    such that P(Binomial(n, 1/2) < k) <= (1 - level) / 2. Needs n >= 6 at 95 %; fewer give (min, max)."""
    s = sorted(xs)
    n = len(s)
    if n == 0:
        return (math.nan, math.nan)
    k = _order_k(n, level)
    if k == 0:
        return (s[0], s[-1])
    return (s[k - 1], s[n - k])


def interval_confidence(n: int, level: float = LEVEL) -> float | None:
    """The confidence `median_ci` gives its interval of the median of `n` values: at least `level` from n = 6 at
    95 %; below that it is (min, max), whose confidence is 1 - 2 / 2**n (93.75 % for 5 rounds, 75 % for 3). None for
    n < 2."""
    if not isinstance(n, numbers.Integral) or isinstance(n, bool) or n < 2:
        return None
    n = int(n)
    k = max(_order_k(n, level), 1)  # (min, max) is x(1), x(n)
    return 1 - 2 * sum(math.comb(n, j) for j in range(k)) / 2**n  # 1 - 2 P(B < k)


def _ci_name(level: float) -> str:
    return f"{level * 100:.0f} % CI"


CI_NAME = _ci_name(LEVEL)


def _interval_name(n, level: float = LEVEL) -> str | None:
    """'95 % CI' where n rounds give that confidence, 'min–max of 3 rounds, a 75 % interval' where they are too few,
    None where n is not a count of rounds."""
    conf = interval_confidence(n, level)
    if conf is None:
        return None
    if conf >= level - 1e-12:
        return _ci_name(level)
    return f"min–max of {int(n)} rounds, a {conf * 100:.4g} % interval"


def interval_words(ci, rounds, level: float = LEVEL) -> str:
    """An interval of a median ratio worded by what it is: '95 % CI 1.03–1.12' where its rounds give that
    confidence, 'min–max of 3 rounds, a 75 % interval: 1.03–1.12' where too few rounds do, and 'interval 1.03–1.12'
    where the rounds were not recorded."""
    span = f"{ci[0]:.2f}–{ci[1]:.2f}"
    name = _interval_name(rounds, level)
    if name is None:
        return f"interval {span}"
    return f"{name} {span}" if name.endswith("CI") else f"{name}: {span}"


def interval_name(rounds) -> str:
    """What the intervals of several costs are, for a figure's title or a table's header: '95 % CI' where every
    cost's rounds give that confidence, 'min–max of 5 rounds, a 93.75 % interval' where they all have the same few
    rounds, 'interval (95 % CI from 6 rounds, min–max below)' where they differ or are not recorded."""
    names = {_interval_name(n) for n in rounds}
    if len(names) == 1 and None not in names:
        return names.pop()
    return f"interval ({CI_NAME} from 6 rounds, min–max below)"


def slowest(per_rank: list[list[float]]) -> list[float]:
    """Per round, the slowest rank's time: a collective forward is as slow as its slowest rank."""
    return [max(r[i] for r in per_rank) for i in range(min(len(r) for r in per_rank))]


def paired(with_change: list[float], without: list[float], level: float = LEVEL) -> dict:
    """Cost of a change from paired rounds (round i: with, then without, back to back): median ratio, its CI."""
    ratios = [a / b for a, b in zip(with_change, without) if b > 0]
    if not ratios:
        return {"ratio": None, "ci": None, "rounds": 0}
    lo, hi = median_ci(ratios, level)
    return {"ratio": statistics.median(ratios), "ci": [lo, hi], "rounds": len(ratios), "ratios": ratios,
            "t_with_s": statistics.median(with_change), "t_without_s": statistics.median(without)}


PLACEMENT_FIELDS = ("world", "ranks_per_gpu", "backend", "device", "transport")
TRANSPORT_BOUND = 0.5  # collective share of the plain forward above which its wall time is mostly transport


def collective_share(per_rank_wall: list[list[float]], per_rank_coll: list[list[float]]) -> float | None:
    """Median over rounds of the share of a forward spent inside collectives, per round that of the rank least bound
    by transport (min over ranks of collective / wall): a conservative reading of "the forward is transport"."""
    n = min(len(w) for w in per_rank_wall + per_rank_coll) if per_rank_wall else 0
    shares = []
    for i in range(n):
        s = [c[i] / w[i] for w, c in zip(per_rank_wall, per_rank_coll) if w[i] > 0]
        if s:
            shares.append(min(s))
    return statistics.median(shares) if shares else None


def carried(transport: str | None) -> str:
    """The words a placement adds where something other than its backend carried the all-to-alls
    (engine.ipc_collectives): ', all-to-alls through CUDA IPC'; '' where the backend carried everything."""
    return f", all-to-alls through {transport}" if transport else ""


def placement(world=None, ranks_per_gpu=None, backend=None, device=None, transport=None) -> str | None:
    """How the ranks that measured a cost sat, in words: '4 ranks share one GPU over gloo (virtual EP)', 'one rank
    per GPU over NCCL (2 GPUs)', '4 CPU engines over gloo'; with `transport` (what carried the all-to-alls where not
    the backend, engine.ipc_collectives): '4 ranks share one GPU over gloo, all-to-alls through CUDA IPC (virtual
    EP)'. None when the device is not known."""
    b = {"nccl": "NCCL"}.get(str(backend).lower(), backend) if backend else None
    over = (f" over {b}" if b else "") + carried(transport)
    if device == "cpu":
        return f"{world} CPU engine{'s' if world != 1 else ''}{over}" if world else f"CPU engines{over}"
    if device != "cuda":
        return None
    k = ranks_per_gpu or 1
    if k > 1:
        gpus = (world or k) // k
        where = "one GPU" if gpus == 1 else f"each of {gpus} GPUs"
        return f"{k} ranks share {where}{over} (virtual EP)"
    if world == 1:
        return f"one rank on one GPU{over}"
    return f"one rank per GPU{over}" + (f" ({world} GPUs)" if world else "")


def paired_cost(per_rank: list[dict], with_change: str, without: str, level: float = LEVEL, *,
                environment: dict | None = None) -> dict:
    """The cost of fn `with_change` against fn `without` from every rank's `toolkit.paired_rounds` result: `paired`
    of the slowest rank's wall time per round (the top-level ratio / ci / rounds / ratios / t_with_s / t_without_s,
    as ever), and where the rounds timed the collectives:
      compute            `paired` of per-round compute time, wall − collective seconds of each rank, slowest rank
      collective_share   {"with": s, "without": s}: median over rounds of collective / wall (`collective_share`)
      collective_calls   {"with": n, "without": n}: collectives per call (rank 0, first timed round)
      transport_bound    the plain forward's collective share > TRANSPORT_BOUND: read `compute` (headline_cost)
    and `placement` (words) with `placement_fields` (PLACEMENT_FIELDS) where the engines said
    it, and `environment` when given. A per-rank result without "wall_s" (an older engine: {name: [seconds]}) gives
    the wall figures only."""
    def wall(r):
        return (r["wall_s"] if "wall_s" in r else r)[with_change], (r["wall_s"] if "wall_s" in r else r)[without]

    walls = [wall(r) for r in per_rank]
    cost = paired(slowest([w for w, _ in walls]), slowest([p for _, p in walls]), level)
    colls = [r.get("collective_s", {}) if "wall_s" in r else {} for r in per_rank]
    if per_rank and all(with_change in c and without in c for c in colls):
        comp = {m: [[w - c for w, c in zip(r["wall_s"][m], cr[m])] for r, cr in zip(per_rank, colls)]
                for m in (with_change, without)}
        cost["compute"] = paired(slowest(comp[with_change]), slowest(comp[without]), level)
        cost["collective_share"] = {
            k: collective_share([r["wall_s"][m] for r in per_rank], [c[m] for c in colls])
            for k, m in (("with", with_change), ("without", without))}
        calls = per_rank[0].get("calls", {})
        cost["collective_calls"] = {k: (calls.get(m) or [None])[0] for k, m in (("with", with_change),
                                                                             ("without", without))}
        share = cost["collective_share"]["without"]
        cost["transport_bound"] = share is not None and share > TRANSPORT_BOUND
    where = per_rank[0].get("placement") if per_rank and "wall_s" in per_rank[0] else None
    if where:
        cost["placement"] = placement(**{k: where.get(k) for k in PLACEMENT_FIELDS})
        cost["placement_fields"] = dict(where)
    if environment is not None:
        cost["environment"] = environment
    return cost


def headline_cost(cost: dict | None) -> str | None:
    """Which figure of a cost is the remedy's cost: "compute" where the plain forward is transport-bound (its
    collectives more than half of it, e.g. virtual EP over gloo: the wall ratio is mostly transport and hides the
    compute path) and a compute figure was measured, else "wall"; None without a cost. `figure` returns it."""
    if not cost or cost.get("ratio") is None:
        return None
    if cost.get("transport_bound") and (cost.get("compute") or {}).get("ratio") is not None:
        return "compute"
    return "wall"


def figure(cost: dict | None, which: str | None = None) -> dict | None:
    """The {ratio, ci, rounds, ...} of `which` figure of a cost ("wall": the top level, "compute": its compute
    path; default: headline_cost). None where that figure was not measured (e.g. an A/A floor of an older record)."""
    which = which or headline_cost(cost)
    if not cost or which is None:
        return None
    return cost if which == "wall" else cost.get(which)


INSIDE, OVERLAPS, ABOVE, BELOW = "inside", "overlaps", "above", "below"
"""Where a cost's interval lies against the A/A noise floor's (`against_floor`)."""
FLOOR_WORDS = {INSIDE: "no measurable cost (interval inside the A/A noise floor)",
               OVERLAPS: "not told apart from the A/A noise floor (the intervals overlap; part of it lies outside)",
               BELOW: "measurably faster than plain — cause not measured"}
"""The words for each relation (ABOVE: measured, nothing added)."""


def _finite_pair(ci) -> bool:
    return (isinstance(ci, (list, tuple)) and len(ci) == 2
            and all(isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x) for x in ci)
            and ci[0] <= ci[1])


def against_floor(ci, floor_ci) -> str | None:
    """The one rule for a cost against its A/A noise floor: 'inside' (the cost's interval lies within the floor's),
    'overlaps' (they share part, not all), 'above' / 'below' (disjoint); None when either interval is missing or not
    a finite (lo, hi) pair."""
    if not _finite_pair(ci) or not _finite_pair(floor_ci):
        return None
    (lo, hi), (flo, fhi) = ci, floor_ci
    if lo > fhi:
        return ABOVE
    if hi < flo:
        return BELOW
    return INSIDE if flo <= lo and hi <= fhi else OVERLAPS


def measurable(cost: dict, floor: dict | None) -> bool | None:
    """Whether a cost is resolved against the A/A noise floor: its interval does not overlap the floor's.
    None when either is missing."""
    if not cost or cost.get("ci") is None or not floor or floor.get("ci") is None:
        return None
    return cost["ci"][0] > floor["ci"][1] or cost["ci"][1] < floor["ci"][0]


def describe(cost: dict, floor: dict | None = None) -> str:
    """'1.08x (95 % CI 1.03–1.12)' (`interval_words`: the interval's own confidence where its rounds are few), with the words of where the interval lies against the noise floor
    (`against_floor`: inside it, overlapping it, or below it)."""
    if not cost or cost.get("ratio") is None:
        return "n/a"
    text = f"{cost['ratio']:.2f}x ({interval_words(cost['ci'], cost.get('rounds'))})"
    rel = against_floor(cost.get("ci"), (floor or {}).get("ci"))
    if rel in FLOOR_WORDS:
        text += ", " + FLOOR_WORDS[rel]
    return text


__all__ = ["median_ci", "slowest", "paired", "paired_cost", "collective_share", "carried", "placement", "headline_cost",
           "figure", "measurable", "interval_confidence", "interval_words", "interval_name", "against_floor", "describe", "LEVEL", "TRANSPORT_BOUND", "INSIDE", "OVERLAPS",
           "ABOVE", "BELOW", "FLOOR_WORDS"]
