"""What every experiment's findings share: reading a comparison (k of N trials, n of numel), a cost against its noise
floor (wall or compute), the rule that ranks remedies only where their intervals are apart, and the guard that turns
a record the code cannot read into a finding that says so (verdict code never raises on a record)."""

from __future__ import annotations

import logging
import math
from typing import Callable

from .model import (FAIL, NA, NOT_MEASURED, PASS, Cost, Count, Evidence, Finding, case_keys, commits_of,
                    placement_label, subject_of)

log = logging.getLogger(__name__)

TRANSPORT_BOUND = 0.5
"""Collectives above this share of the plain forward: the wall ratio measures transport; the compute ratio is the cost."""


def vt(v) -> tuple:
    try:
        return tuple(int(x) for x in str(v).split(".")[:3])
    except ValueError:
        return (0, 0, 0)


def applicable(c: dict | None) -> bool:
    return bool(c) and c.get("applicable", True)


def equal(c: dict) -> bool:
    """Bitwise equal in every trial (a comparison of one rank with itself, n/a, counts as equal)."""
    return (not c.get("applicable", True)) or bool(c["bitwise_equal"])


def _count_of(value, name: str) -> int:
    """A count field as an int: a whole, finite, non-negative number; anything else is a ValueError that names it
    (`guarded` turns it into a NOT MEASURED finding: an impossible value is never rendered as a result)."""
    ok = (isinstance(value, int) and not isinstance(value, bool)) or (isinstance(value, float) and value.is_integer())
    if not ok or value < 0:
        raise ValueError(f"{name} ({value!r}) is not a count: the record is invalid")
    return int(value)


def trials(c: dict) -> tuple[int, int]:
    """(trials in which the compared tensors differed, trials). A comparison of no trial, or one that differed in
    more trials than it ran, is a ValueError naming the field."""
    n = _count_of(c.get("trials", 1), "trials")  # an older record without the field: one trial
    if n < 1:
        raise ValueError(f"trials ({n}): a comparison of no trial measured nothing; the record is invalid")
    k = c.get("n_differ")
    if k is None:  # an older record: one trial, or no per-trial count
        k = 0 if c["bitwise_equal"] else n
    k = _count_of(k, "n_differ")
    if k > n:
        raise ValueError(f"n_differ ({k}) exceeds trials ({n}): the record is invalid")
    return k, n


def trials_text(c: dict) -> str:
    k, n = trials(c)
    return f"in all {n} trial(s)" if k == 0 else f"in {k} of {n} trial(s)"


def count(c: dict, what: str, of: int | None = None) -> Count:
    """The worst trial's mismatch count with its denominator (`of` overrides numel: a gradient's carrying elements).
    A count larger than its denominator is a ValueError (an impossible record is not rendered as a fraction > 1)."""
    n = _count_of(c["n_mismatch"], "n_mismatch")
    total = _count_of(of if of is not None else c["numel"], "numel")
    if n > total:
        raise ValueError(f"n_mismatch ({n:,}) exceeds its denominator ({total:,} {what}): the record is invalid")
    return Count(n, total, what)


def _max(v, unit: str) -> str:
    """'max 29152 ULP' / 'max abs 0.000977'; a value that is not a finite number says so instead of 'nan'."""
    if not _num(v):
        return f"max {unit} not finite ({v!r})" if isinstance(v, (int, float)) else f"max {unit} not recorded"
    return f"max {v:.0f} {unit}" if unit == "ULP" else f"max {unit} {v:.3g}"


def describe(c: dict, what: str = "elements", of: int | None = None) -> str:
    """'bitwise equal in all 3 trial(s)' / '9,983 of 32,768 elements (0.305) differ in 3 of 3 trial(s), max 29152 ULP,
    max abs 0.000977; allclose(1e-3) passes' — the tolerance check shown for what it is, never as the verdict."""
    if not c.get("applicable", True):
        return f"not applicable ({c.get('reason', 'one rank')})"
    if c["bitwise_equal"]:
        return "bitwise equal " + trials_text(c)
    text = f"{count(c, what, of).text()} differ {trials_text(c)}, {_max(c.get('max_ulp'), 'ULP')}, " \
        f"{_max(c.get('max_abs'), 'abs')}"
    if "allclose_1e3" in c:
        text += f"; allclose(1e-3) {'passes' if c['allclose_1e3'] else 'fails'}"
    return text


def _num(x) -> bool:
    return isinstance(x, (int, float)) and not isinstance(x, bool) and math.isfinite(x)


def _ci(x):
    return tuple(x) if isinstance(x, (list, tuple)) and len(x) == 2 else None


def cost(rec: dict | None, floor: dict | None, where: dict | None = None) -> Cost | None:
    """A record's cost against its setting's A/A noise floor. Where the plain forward spent more than half its time in
    collectives (virtual EP: gloo through the host), the cost is the compute ratio (wall minus collectives) with the
    wall ratio beside it; where that share was not measured, the wall ratio is the figure and says so."""
    c = (rec or {}).get("cost") if isinstance(rec, dict) and "cost" in rec else rec
    if not isinstance(c, dict) or not c:
        return None
    f = floor.get("cost") if isinstance(floor, dict) and "cost" in floor and "ratio" not in floor else floor
    f = f if isinstance(f, dict) else {}
    share = c.get("collective_share")
    if isinstance(share, dict):  # {'plain': s, 'with': s}: the plain forward's share decides
        share = share.get("plain", share.get("without"))
    env = c.get("environment") or {}
    env_text = ", ".join(f"{k}={v}" for k, v in sorted(env.items()) if v not in (None, False)) if isinstance(env, dict) else str(env)
    placement = c.get("placement") or (placement_label(where) if where else "")
    comp = c.get("compute") if isinstance(c.get("compute"), dict) else None
    bound = c.get("transport_bound")
    if bound is None and _num(share):
        bound = share > TRANSPORT_BOUND
    if bound and comp:
        fc = f.get("compute") if isinstance(f.get("compute"), dict) else {}
        return Cost(ratio=comp.get("ratio"), ci=_ci(comp.get("ci")), floor_ci=_ci(fc.get("ci")), figure="compute",
                    wall_ratio=c.get("ratio"), wall_ci=_ci(c.get("ci")), collective_share=share if _num(share) else None,
                    placement=placement, environment=env_text, rounds=int(comp.get("rounds") or 0))
    return Cost(ratio=c.get("ratio"), ci=_ci(c.get("ci")), floor_ci=_ci(f.get("ci")), figure="wall",
                wall_ratio=c.get("ratio"), wall_ci=_ci(c.get("ci")), collective_share=share if _num(share) else None,
                placement=placement, environment=env_text, rounds=int(c.get("rounds") or 0))


def choose(candidates: list[tuple[str, Cost | None]], simplicity: Callable[[str], tuple]) -> dict:
    """Of the settings that hold (name, cost), which to name and how it is justified — never ranked inside the noise:
    'free' (interval inside the noise floor: tied, the simplest named — a cost whose interval only overlaps the floor
    reaches past it, so it is ranked with the others, never called free); 'tied' (the cheapest's interval overlaps
    others': tied, the simplest of the tied named); 'cheapest' (resolved from every other); invalid costs are never
    ranked nor 'no measurable cost'. Returns {'name', 'basis', 'tied': [names], 'invalid': [names], 'cost'}."""
    if not candidates:
        return {"name": None, "basis": "none holds", "tied": [], "invalid": [], "cost": None}
    valid = [(n, c) for n, c in candidates if c is not None and c.valid]
    invalid = [n for n, c in candidates if c is None or not c.valid]
    free = [(n, c) for n, c in valid if c.inside_floor]
    if free:
        best = min(free, key=lambda x: simplicity(x[0]))
        return {"name": best[0], "basis": "free", "tied": [n for n, _ in free], "invalid": invalid, "cost": best[1]}
    if valid:
        low = min(valid, key=lambda x: x[1].ratio)
        tied = [(n, c) for n, c in valid if c.ci[0] <= low[1].ci[1] and low[1].ci[0] <= c.ci[1]]
        if len(tied) > 1:
            best = min(tied, key=lambda x: simplicity(x[0]))
            return {"name": best[0], "basis": "tied", "tied": [n for n, _ in tied], "invalid": invalid, "cost": best[1]}
        return {"name": low[0], "basis": "cheapest", "tied": [low[0]], "invalid": invalid, "cost": low[1]}
    best = min(candidates, key=lambda x: simplicity(x[0]))
    return {"name": best[0], "basis": "cost not measured", "tied": [n for n, _ in candidates], "invalid": invalid,
            "cost": best[1]}


def choice_text(ch: dict, costs: dict[str, Cost | None]) -> str:
    """The words for a `choose` result, naming every tied setting with its cost."""
    def one(n):
        c = costs.get(n)
        return f"{n} ({c.text() if c is not None else 'cost not measured'})"

    if ch["name"] is None:
        return "no setting tried holds in every trial"
    if ch["basis"] == "free":
        return ("at no measurable cost (interval inside the A/A noise floor): " + "; ".join(one(n) for n in ch["tied"])
                + (f" — tied; the one with fewest changes named: {ch['name']}" if len(ch["tied"]) > 1 else ""))
    if ch["basis"] == "tied":
        return (f"tied on cost (their intervals overlap, not ranked): {'; '.join(one(n) for n in ch['tied'])} — "
                f"the one with fewest changes named: {ch['name']}")
    if ch["basis"] == "cheapest":
        return f"cheapest, resolved from the others: {one(ch['name'])}"
    return f"{ch['name']} (no valid cost measured: " + ", ".join(ch["invalid"]) + ")"


COST_ENV = ("CUBLAS_WORKSPACE_CONFIG", "NCCL_ALGO")
"""Engine environment a remedy can bring with it that changes kernels (cuBLAS workspace: split-K; NCCL algorithm)."""


def env_clause(rec: dict | None, plain: dict | None) -> str:
    """Where `rec`'s engines ran with another COST_ENV than the plain record's (deterministic cells on GPUs set
    CUBLAS_WORKSPACE_CONFIG=:4096:8 and NCCL_ALGO=Ring), the clause that says so — its cost includes them. '' when
    both ran alike or a record has no `env` field (older records: nothing to say)."""
    if not isinstance(rec, dict) or not isinstance(plain, dict):
        return ""
    a, b = rec.get("env"), plain.get("env")
    if not isinstance(a, dict) or not isinstance(b, dict):
        return ""
    diff = [k for k in COST_ENV if a.get(k) != b.get(k)]
    if not diff:
        return ""
    said = ", ".join(f"{k}={a[k]}" if a.get(k) is not None else f"{k} unset" for k in diff)
    base = ", ".join(f"{k}={b[k]}" if b.get(k) is not None else f"{k} unset" for k in diff)
    return f" (its engines ran with {said}, the plain cell's with {base}: the cost includes that)"


def fix_words(name: str | None, tried: int) -> str:
    """A fix's answer in a few words: 'fix found: router fp32' / 'no fix found (3 tried)'."""
    return f"fix found: {name}" if name else f"no fix found ({tried} tried)"


def trial_words(t: tuple[int, int] | None) -> str:
    """', 3/3 trials': the trials in which the difference showed (k of N), or, where it showed in none, the trials it
    held in ('in all 3 trials'); '' where trials were not counted."""
    if not t:
        return ""
    return f", in {t[0]}/{t[1]} trials" if t[0] else f", in all {t[1]} trials"


def guarded(experiment: str, question: str, recs: list, build: Callable[[], list[Finding]]) -> list[Finding]:
    """build(); a record it cannot read becomes one NOT MEASURED finding naming the field (an older layout)."""
    try:
        return build()
    except (KeyError, TypeError, ValueError, AttributeError, IndexError, ZeroDivisionError) as e:
        log.info("%s: records not readable: %r", experiment, e)
        r0 = next((r for r in recs if isinstance(r, dict)), {})
        what = f"missing field {e.args[0]!r}" if isinstance(e, KeyError) else f"{type(e).__name__}: {e}"
        return [Finding(experiment, question, subject_of(r0), NOT_MEASURED,
                        f"{len(recs)} record(s) could not be read ({what}; an older or partial record layout) — "
                        "nothing is claimed from them", Evidence(records=case_keys(recs)), card=True,
                        commits=commits_of(recs), short="records not readable")]


def groups(recs: list[dict], *fields, axes: tuple[str, ...] = ()) -> dict[tuple, list[dict]]:
    """Records by subject (release, dispatcher, placement, layer, + fields): findings never merge across them.
    `axes`: layer-config fields left out of the subject (`subject_of`), so one group spans them."""
    out: dict = {}
    for r in recs:
        try:
            s = subject_of(r, axes=axes)
        except (KeyError, TypeError, ValueError, AttributeError):  # unreadable: its own group, guarded() says so
            s = {"release": "?", "dispatcher": "?", "placement": "?", "layer": "?"}
        key = (s["release"], s["dispatcher"], s["placement"], s["layer"]) + tuple(str(r.get(f)) for f in fields)
        out.setdefault(key, []).append(r)
    return dict(sorted(out.items(), key=lambda kv: (vt(kv[0][0]),) + tuple(str(x) for x in kv[0][1:])))


def within_factor(a: float, b: float, factor: float) -> bool:
    """Two magnitudes within `factor` of each other (two zeros agree; a zero and a non-zero never do)."""
    if a == 0 or b == 0:
        return a == b
    return max(a, b) / min(a, b) <= factor


def status_of(ok: bool) -> str:
    return PASS if ok else FAIL


__all__ = ["vt", "applicable", "equal", "trials", "trials_text", "count", "describe", "cost", "choose", "choice_text",
           "env_clause", "COST_ENV",
           "within_factor", "guarded", "groups", "status_of", "TRANSPORT_BOUND", "NA", "NOT_MEASURED"]
