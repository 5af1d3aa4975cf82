"""Notebook 06 in two reports, per case `moe_lab.reporting.compare` matched: do the layouts' trajectories stay bitwise
equal to the reference layout's, is that the layout or run-to-run, which setting keeps them equal (the finding's
status and remedy). The magnitude of 'layouts agree' is its largest weight divergence from the reference layout at
step K (||Δw|| / ||w||, from the weights' sketches: two estimates are told apart only beyond the sketches' own band,
`findings.sketch_band`, where it is wider than the factor).

Across the two sides, every run both hold (same stack, setting, mode, layout and run index) is held whole: is its
trajectory — each step's loss bits and weight fingerprints — the same bits in both, or after which step and where
(forward or backward) do they part."""

from __future__ import annotations

import math

from .findings import QUESTION, first_difference, layout_of, reference_of, sketch_band, weight_divergence, \
    where_parted


def _runs(records: list[dict]) -> list[dict]:
    return [r for r in records if r.get("kind") == "train" and r.get("available")]


def _run_id(r: dict) -> tuple:
    return (r.get("layers"), r.get("setting"), bool(r.get("deterministic")), layout_of(r), r.get("run"))


def _drift(case: dict) -> tuple[float | None, dict | None]:
    """The largest ||Δw|| / ||w|| at step K of the finding's other layouts' run 0 against its reference layout's."""
    if case["finding"].question != QUESTION:
        return None, None
    runs = _runs(case["records"])
    try:
        ref = reference_of(runs[0], runs) if runs else None
        ws = [weight_divergence(r, ref)[-1] for r in runs if ref is not None and r is not ref and r.get("run") == 0]
    except (KeyError, TypeError, ValueError, IndexError, ZeroDivisionError):
        return None, None
    return (max(ws), ref) if ws else (None, None)


def _trajectories(x: dict, y: dict) -> tuple[str, list[tuple]]:
    """The runs both findings rest on, held across the sides: (words, [(id of A's run, id of B's run, deterministic,
    same bits)])."""
    ra = {}
    for r in _runs(x["records"]):
        try:
            ra.setdefault(_run_id(r), r)
        except (KeyError, TypeError, ValueError):
            continue
    rb = {}
    for r in _runs(y["records"]):
        try:
            rb.setdefault(_run_id(r), r)
        except (KeyError, TypeError, ValueError):
            continue
    both = [k for k in ra if k in rb]
    if not both:
        return "", []
    held, parted, unread = [], [], []
    for k in both:
        p, q = ra[k], rb[k]
        try:
            steps_p, steps_q = len(p["loss_hex"]), len(q["loss_hex"])
            if steps_p != steps_q:
                unread.append(f"{k[3]} run {k[4]}: A ran {steps_p} steps, B {steps_q}")
                continue
            t = first_difference(p, q)
            where = None if t is None else where_parted(p, q, t)
        except (KeyError, TypeError, IndexError):
            unread.append(f"{k[3]} run {k[4]}: a record lacks its loss bits or weight fingerprints")
            continue
        held.append((id(p), id(q), k[2], t is None))
        if t is not None:
            parted.append(f"{k[3]} run {k[4]} after step {t} of {steps_p} (in {where})")
    words = (f"trajectories (every step's loss bits and weight fingerprints) the same bits on both sides in "
             f"{sum(h[3] for h in held)} of {len(held)} run(s) held by both")
    if parted:
        words += "; parted: " + ", ".join(parted[:3]) + (f" and {len(parted) - 3} more" if len(parted) > 3 else "")
    if unread:
        words += "; not compared: " + "; ".join(unread)
    return words, held


def rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    """Per matched pair (a[i], b[i]: {'finding', 'records'}): the weight divergences side by side (told apart beyond
    `factor` or the sketches' band, whichever is wider) and the trajectories of the runs both rest on."""
    out = []
    for x, y in zip(a, b):
        (da, ref_a), (db, ref_b) = _drift(x), _drift(y)
        row = {"what": "largest ||Δw||/||w|| at step K against the reference layout" if da is not None
               or db is not None else "", "a": da, "b": db}
        ok = lambda v: isinstance(v, float) and math.isfinite(v) and v >= 0  # noqa: E731
        if ok(da) and ok(db):
            band = max(factor, sketch_band(ref_a), sketch_band(ref_b))
            row["within_factor"] = da == db if da == 0 or db == 0 else max(da, db) / min(da, db) <= band
        row["bits"], row["trajectories"] = _trajectories(x, y)
        out.append(row)
    return out


def summary(rows_: list[dict]) -> list[str]:
    """One line over every run the matched findings rest on (each counted once; `moe_lab.reporting.compare` passes
    only pairs of one release, layer and numerics environment): how many are the same bits in both reports, with
    deterministic mode and without it."""
    seen = {}
    for r in rows_:
        for ia, ib, det, same in r.get("trajectories", ()):
            seen[(ia, ib)] = (det, same)
    if not seen:
        return []
    parts = []
    for det, name in ((True, "with deterministic mode"), (False, "without it")):
        sub = [same for d, same in seen.values() if d == det]
        if sub:
            parts.append(f"{name} {sum(sub)} of {len(sub)}")
    return ["06: runs held by both whose trajectories (every step's loss bits and weight fingerprints) are the same "
            "bits in A and B — " + "; ".join(parts) + "."]
