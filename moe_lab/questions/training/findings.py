"""Notebook 06's findings: how soon and how far runs at different layouts part (first differing step against the
reference layout and whether the forward or the backward parted first, relative loss difference and weight
divergence at step K), whether that exceeds the run-to-run effect, and which setting keeps the trajectories bitwise
equal across layouts for K steps, at what cost per step.

Every number comes from two records (a run and its reference: the first layout listed, run 0, same stack, setting
and mode; a layout is named by its spec, e.g. 'ep4', 'tp2,ep2,sp'): loss bits (`loss_hex`), weight fingerprints, the
weights' random-projection sketches (||Δw|| / ||w|| estimated from SKETCH projections), and the packed top-k experts
and boundary margins of every token (routing flips: top-k slots that changed, over tokens x k). Pure Python: no
torch."""

from __future__ import annotations

import array
import base64
import math
import statistics
import zlib

from ...layout import Layout
from ...findings.common import choice_text, choose, cost, fix_words, groups, guarded
from ...findings.model import FAIL, MIXED, NA, NOT_MEASURED, PASS, Count, Evidence, Finding, case_keys, commits_of
from ...findings.model import subject_of as _subject_of


def subject_of(rec: dict, **extra) -> dict:
    """A run's subject: its layer says the tokens of a step's global batch (the profile's seq_len is not used by a
    training run, whose every step draws `tokens` tokens)."""
    cfg = rec.get("config") if isinstance(rec, dict) else None
    if isinstance(cfg, dict) and isinstance(rec.get("tokens"), int):
        rec = {**rec, "config": {**cfg, "seq_len": rec["tokens"]}}
    return _subject_of(rec, **extra)

EXPERIMENT = "training"
QUESTION = "layouts agree"
RUN_TO_RUN = "layout vs run-to-run"
FIX = "fix: layouts"
FINITE = "loss finite"


def unpack(text: str, code: str) -> list:
    """The engine's packed tensor (zlib + base64 of uint8 'B' or float32 'f' bytes) as a list."""
    a = array.array(code)
    a.frombytes(zlib.decompress(base64.b64decode(text)))
    return a.tolist()


def first_difference(a: dict, b: dict) -> int | None:
    """The first step (1..K) after which the loss bits or the weights differ between two runs; None: equal for all K
    steps (the initial weights, step 0, are compared too: 0 means they started apart)."""
    if a["weights_fp"][0] != b["weights_fp"][0]:
        return 0
    K = min(len(a["loss_hex"]), len(b["loss_hex"]))
    for t in range(K):
        if a["loss_hex"][t] != b["loss_hex"][t] or a["weights_fp"][t + 1] != b["weights_fp"][t + 1]:
            return t + 1
    return None


def where_parted(a: dict, b: dict, t: int) -> str:
    """What differs first at step t (first_difference's answer): the initial weights (t = 0); the loss of step t,
    whose forward ran on equal weights — the forward depends on the layout; or only the weights after step t, the
    loss bits of step t equal — the backward, the gradient reduce or the update."""
    if t == 0:
        return "the initial weights"
    if a["loss_hex"][t - 1] != b["loss_hex"][t - 1]:
        return f"the forward: step {t}'s loss bits, on equal weights"
    return f"the backward or the gradient reduce: the weights after step {t}, its loss bits equal"


def rel_loss(a: dict, b: dict) -> list[float]:
    """|loss_a − loss_b| / |loss_b| per step."""
    return [abs(x - y) / abs(y) if y else math.inf * (x != y) for x, y in zip(a["loss"], b["loss"])]


def weight_divergence(a: dict, b: dict) -> list[float]:
    """||w_a − w_b|| / ||w_b|| per step (0 = initial), estimated from the weights' random projections (JL: the mean
    square of a projection of Δw is ||Δw||²), exactly 0 where the fingerprints agree."""
    out = []
    for fa, fb, sa, sb, nb in zip(a["weights_fp"], b["weights_fp"], a["weights_sketch"], b["weights_sketch"],
                                  b["weights_norm"]):
        if fa == fb:
            out.append(0.0)
            continue
        d = math.sqrt(sum((x - y) ** 2 for x, y in zip(sa, sb)) / len(sa))
        out.append(d / nb if nb else math.inf)
    return out


SKETCH_Z = 3.3
"""Two-sided z of the sketch band (~99.9 %)."""


def sketch_band(a: dict) -> float:
    """How far apart two ||Δw|| estimates from `a`'s sketches may lie by estimation alone: each squared estimate is
    ||Δw||² times a chi-square with m degrees of freedom over m (m random projections); with that chi-square's
    ~99.9 % quantiles (Wilson–Hilferty), one estimate may exceed another by sqrt(upper / lower) with nothing else
    different. Two estimates are told apart only beyond this factor (inf: no projections)."""
    m = len(a["weights_sketch"][0]) if a.get("weights_sketch") else 0
    if not m:
        return math.inf
    c = 2 / (9 * m)
    lo = 1 - c - SKETCH_Z * math.sqrt(c)
    if lo <= 0:
        return math.inf
    return math.sqrt((1 - c + SKETCH_Z * math.sqrt(c)) ** 3 / lo ** 3)


def non_finite(r: dict) -> int | None:
    """The first step (1..K) whose loss is not a finite number, None if every loss is."""
    return next((t for t, x in enumerate(r.get("loss") or [], start=1)
                 if not isinstance(x, (int, float)) or not math.isfinite(x)), None)


def steps_text(rs: list[dict]) -> str:
    """'50 steps' — read from the runs a claim compares (a range where they ran different numbers of steps)."""
    ks = sorted({len(r["loss"]) for r in rs})
    return f"{ks[0]} steps" if len(ks) == 1 else f"{ks[0]}–{ks[-1]} steps"


def flips(a: dict, b: dict) -> list[list[dict]]:
    """Per layer, per step: top-k slots of `a` not in `b`'s top-k for the same token ({'n', 'of', 'margins'}: the
    count, tokens x k, and `a`'s top-k boundary margin of every flipped token)."""
    k = int(a["topk"])
    out = []
    for la, lb in zip(a["routing"], b["routing"]):
        per = []
        for sa, sb in zip(la, lb):
            ia, ib = unpack(sa["topk"], "B"), unpack(sb["topk"], "B")
            if sa["topk"] == sb["topk"]:
                per.append({"n": 0, "of": len(ia), "margins": []})
                continue
            ma = unpack(sa["margin"], "f")
            n, margins = 0, []
            for tok in range(len(ia) // k):
                d = len(set(ia[tok * k:(tok + 1) * k]) - set(ib[tok * k:(tok + 1) * k]))
                if d:
                    n += d
                    margins.append(ma[tok])
            per.append({"n": n, "of": len(ia), "margins": margins})
        out.append(per)
    return out


def _axis(r: dict) -> tuple:
    return (r["layers"], r["setting"], bool(r["deterministic"]))


def layout_of(r: dict) -> str:
    """A run's layout as its spec ('ep4', 'tp2,ep2,sp'), from the layout fields stamped on its record."""
    return Layout(tp=r.get("tp", 1), ep=r["ep"], etp=r.get("etp", 0),
                  sequence_parallel=bool(r.get("sequence_parallel", False))).spec()


def _order(r: dict) -> tuple:
    """Layouts in a sentence: TP 1 by EP, then the TP x EP layouts."""
    return (r.get("tp", 1), r["ep"], r.get("etp", 0), bool(r.get("sequence_parallel")), r["run"])


def reference_of(r: dict, recs: list[dict]) -> dict | None:
    """The run `r` is compared with: its group's reference layout (the record's `reference_layout`, else EP 1's
    or the smallest EP's at TP 1), run 0, same stack, setting and mode."""
    same = [x for x in recs if x.get("available") and _axis(x) == _axis(r)]
    if not same:
        return None
    ref = r.get("reference_layout") or layout_of(min(same, key=_order))
    return next((x for x in same if layout_of(x) == ref and x["run"] == 0), None)


def frame(records: list[dict]) -> list[dict]:
    """Tidy rows for the figures: per run against its reference, per step (and layer): relative loss difference,
    weight divergence, routing flips (fraction of tokens x k) and the flipped tokens' median margin."""
    recs = [r for r in records if isinstance(r, dict) and r.get("kind") == "train" and r.get("available")]
    rows = []
    for r in recs:
        ref = reference_of(r, recs)
        if ref is None or ref is r:
            continue
        who = {"setting": r["setting"], "layers": r["layers"], "deterministic": bool(r["deterministic"]),
               "ep": r["ep"], "layout": layout_of(r), "run": r["run"], "reference": layout_of(ref),
               "what": f"{layout_of(r)} run {r['run']}"}
        wd = weight_divergence(r, ref)
        for t, (rl, w) in enumerate(zip(rel_loss(r, ref), wd[1:]), start=1):
            rows.append({**who, "step": t, "rel_loss": rl, "weight_div": w, "layer": None})
        for li, per in enumerate(flips(r, ref)):
            for t, f in enumerate(per, start=1):
                rows.append({**who, "step": t, "layer": li + 1, "flips": f["n"] / f["of"] if f["of"] else 0.0,
                             "n_flips": f["n"], "of": f["of"],
                             "margin": statistics.median(f["margins"]) if f["margins"] else None})
    return rows


def _part(r: dict, ref: dict) -> str:
    """'ep4 run 0: first differs after step 2 of 50; at step 50 |Δloss|/loss 3.1e-04, ||Δw||/||w|| 2.2e-03,
    routing flips 5 of 128 top-k slots (layer 1)'."""
    K = len(r["loss"])
    t = first_difference(r, ref)
    who = f"{layout_of(r)} run {r['run']}"
    if t is None:
        return f"{who}: bitwise equal to {layout_of(ref)} run 0 for all {K} steps (loss bits and weights)"
    rl, wd = rel_loss(r, ref)[-1], weight_divergence(r, ref)[-1]
    bad = non_finite(r) or non_finite(ref)
    if bad or not (math.isfinite(rl) and math.isfinite(wd)):
        return (f"{who}: first differs after step {t} of {K} (in {where_parted(r, ref, t)}); the loss or the weights "
                f"are not finite" + (f" from step {bad}" if bad else "") + " — no distance is given")
    fl = flips(r, ref)
    last = ", ".join(f"layer {i + 1}: {per[-1]['n']} of {per[-1]['of']}" for i, per in enumerate(fl))
    tot = sum(f["n"] for per in fl for f in per)
    return (f"{who}: first differs after step {t} of {K} (in {where_parted(r, ref, t)}); at step {K} |Δloss|/loss "
            f"{rl:.2g}, ||Δw||/||w|| {wd:.2g}, "
            f"routing flips at step {K} ({last} top-k slots), {tot} over all steps")


def _layouts(sub: list[dict]) -> list[Finding]:
    """Per (stack, setting, mode): does every other layout's run 0 stay bitwise equal to the reference layout's?"""
    out = []
    avail = [r for r in sub if r.get("available")]
    for axis in dict.fromkeys(_axis(r) for r in avail):
        rs = [r for r in avail if _axis(r) == axis]
        ref = reference_of(rs[0], rs)
        layers, setting, det = axis
        mode = "deterministic" if det else "not deterministic"
        subj = {**subject_of(rs[0]), "setting": setting, "stack": f"{layers} layer(s)", "mode": mode}
        head = f"{layers} layer(s), {setting}, {mode}"
        others = [r for r in rs if r is not ref and r["run"] == 0]
        if ref is None or not others:
            why = "the reference layout's run 0 was not measured" if ref is None else "only one layout measured"
            out.append(Finding(EXPERIMENT, QUESTION, subj, NOT_MEASURED, f"{head}: {why} — nothing compared",
                               Evidence(records=case_keys(rs)), card=setting == "plain", commits=commits_of(rs),
                               short=f"{head}: {why}"))
            continue
        parts = [_part(r, ref) for r in sorted(others, key=_order)]
        equal = all(first_difference(r, ref) is None for r in others)
        fl = [f for r in others for per in flips(r, ref) for f in per]
        counts = [Count(sum(f["n"] for f in fl), sum(f["of"] for f in fl), "top-k slots flipped over every step, "
                        "layer and layout")] if fl else []
        margins = [m for f in fl for m in f["margins"]]
        notes = ([f"flipped tokens' top-k margin: median {statistics.median(margins):.3g}, max {max(margins):.3g} "
                  "(router logits)"] if margins else [])
        parted = [t for t in (first_difference(r, ref) for r in others) if t is not None]
        short = (f"{head}: {len(others)} layout(s) equal to {layout_of(ref)}, {len(ref['loss'])} steps" if equal else
                 f"{head}: {len(parted)} of {len(others)} layout(s) part, first after step {min(parted)}")
        out.append(Finding(EXPERIMENT, QUESTION, subj, PASS if equal else FAIL,
                           f"{head}, against {layout_of(ref)}: " + "; ".join(parts),
                           Evidence(records=case_keys([ref] + others), counts=counts, notes=notes),
                           card=setting == "plain", commits=commits_of(rs), short=short))
    return out


def _against_reruns(sub: list[dict]) -> list[Finding]:
    """Per plain (stack, mode): the layout effect (ep ≠ reference, run 0) against the run-to-run effect (run 1 vs run
    0 at each layout), by first differing step and weight divergence at step K."""
    out = []
    avail = [r for r in sub if r.get("available") and r["setting"] == "plain"]
    for axis in dict.fromkeys(_axis(r) for r in avail):
        rs = [r for r in avail if _axis(r) == axis]
        ref = reference_of(rs[0], rs)
        layers, _, det = axis
        mode = "deterministic" if det else "not deterministic"
        subj = {**subject_of(rs[0]), "setting": "plain", "stack": f"{layers} layer(s)", "mode": mode}
        head = f"{layers} layer(s), plain, {mode}"
        layout = [r for r in rs if ref is not None and r is not ref and r["run"] == 0]
        reruns = [(r, next((x for x in rs if layout_of(x) == layout_of(r) and x["run"] == 0), None))
                  for r in rs if r["run"] > 0]
        reruns = [(r, b) for r, b in reruns if b is not None]
        if not layout or not reruns:
            why = "no second layout" if not layout else "no rerun"
            out.append(Finding(EXPERIMENT, RUN_TO_RUN, subj, NOT_MEASURED, f"{head}: {why} measured — the layout "
                               "effect is not told apart from run-to-run", Evidence(records=case_keys(rs)),
                               commits=commits_of(rs)))
            continue
        K = len(ref["loss"])
        lay_t = [first_difference(r, ref) for r in layout]
        run_t = [first_difference(r, b) for r, b in reruns]
        lay_ws = [weight_divergence(r, ref)[-1] for r in layout]
        run_ws = [weight_divergence(r, b)[-1] for r, b in reruns]
        finite = all(math.isfinite(w) for w in lay_ws + run_ws)
        lay_w, run_w = (max(lay_ws), max(run_ws)) if finite else (math.nan, math.nan)
        band = sketch_band(ref)
        n_run = sum(t is not None for t in run_t)
        first_lay = min((t for t in lay_t if t is not None), default="-")
        first_run = min((t for t in run_t if t is not None), default="-")
        said = (f"layout: {sum(t is not None for t in lay_t)} of {len(layout)} layout(s) part from {layout_of(ref)} "
                f"(first after step {first_lay}), ||Δw||/||w|| at step {K} up to {lay_w:.2g}; run-to-run: {n_run} of "
                f"{len(reruns)} rerun(s) part (first after step {first_run}), up to {run_w:.2g}"
                if finite else
                f"layout: {sum(t is not None for t in lay_t)} of {len(layout)} layout(s) part from {layout_of(ref)} "
                f"(first after step {first_lay}); run-to-run: {n_run} of {len(reruns)} rerun(s) part (first after "
                f"step {first_run}); ||Δw||/||w|| at step {K} is not finite for at least one run (non-finite weights)")
        if all(t is None for t in lay_t):
            status, verdict_ = PASS, "no layout effect: every layout bitwise equal to the reference"
            short = "no layout effect"
        elif not det:
            status, verdict_ = MIXED, ("not told apart: without deterministic mode a rerun may part on its own, so a "
                                       "layout difference can be run-to-run; see the deterministic runs")
            short = "layout not told apart from run-to-run"
        elif n_run == 0:
            status, verdict_ = FAIL, ("the layout effect is the layout's own: every rerun is bitwise equal, the layouts "
                                      "part")
            short = "the layout's own effect (reruns equal)"
        elif not finite:
            status, verdict_ = MIXED, "not told apart: a weight divergence is not finite"
            short = "not told apart (non-finite weights)"
        elif lay_w > run_w * band:
            status, verdict_ = FAIL, (f"the layout effect exceeds the run-to-run effect (reruns part too, less far: "
                                      f"beyond the sketches' estimation band, x{band:.2f})")
            short = "layout effect exceeds run-to-run"
        elif lay_w > run_w:
            status, verdict_ = MIXED, (f"not told apart: the layout's estimate is larger, but within the sketches' "
                                       f"estimation band (x{band:.2f}) of the run-to-run one")
            short = "layout not told apart from run-to-run"
        else:
            status, verdict_ = MIXED, "the run-to-run effect is as large as the layout effect or larger"
            short = "run-to-run as large as the layout effect"
        out.append(Finding(EXPERIMENT, RUN_TO_RUN, subj, status, f"{head}: {verdict_} — {said}",
                           Evidence(records=case_keys(rs)), card=bool(det), commits=commits_of(rs),
                           short=f"{head}: {short}"))
    return out


def simplicity(name: str) -> tuple:
    return (name.count("+"), len(name))


def _fix(sub: list[dict]) -> list[Finding]:
    """Which setting (deterministic mode alone, or a non-plain setting) keeps every layout bitwise equal to its
    reference layout for K steps, and its cost per step (paired rounds against the plain step, A/A floor)."""
    avail = [r for r in sub if r.get("available")]
    tried = {}
    for r in avail:
        if r["setting"] != "plain":
            tried.setdefault(r["setting"], []).append(r)
    plain_det = [r for r in avail if r["setting"] == "plain" and r["deterministic"]]
    if plain_det:  # deterministic mode alone: the plain setting's deterministic runs, of every stack measured
        tried["deterministic mode"] = plain_det
    plain_fail = any(f.status == FAIL for f in _layouts([r for r in avail if r["setting"] == "plain"]))
    if not tried or not plain_fail:
        return []
    holds, costs, said, compared = [], {}, [], {}
    for name, rs in tried.items():
        timed = next((r for r in rs if r.get("cost")), None)
        c = cost(timed["cost"], timed.get("floor"), timed) if timed else None
        parted, runs = [], []
        for layers in sorted({r["layers"] for r in rs}):  # every stack: a setting holds only if it holds on each
            st = [r for r in rs if r["layers"] == layers]
            ref = reference_of(st[0], st)
            others = [r for r in st if r is not ref and r["run"] == 0]
            if ref is None or not others:
                continue
            runs += [ref] + others
            ts = [first_difference(r, ref) for r in others]
            if any(t is not None for t in ts):
                parted.append(f"{layers} layer(s) part after step {min(t for t in ts if t is not None)}")
        if not runs:
            continue
        if not parted:
            holds.append(name)
            costs[name] = c
            compared[name] = runs
        else:
            said.append(f"{name}: {', '.join(parted)}" + (f" (cost per step {c.text()})" if c is not None else ""))
    r0 = avail[0]
    subj = subject_of(r0)
    ch = choose([(n, costs[n]) for n in holds], simplicity)
    steps = steps_text(compared[ch["name"]] if ch["name"] else [r for rs in tried.values() for r in rs])
    claim = (f"trajectories bitwise equal across layouts for {steps} — "
             + (choice_text(ch, costs) if ch["name"] else f"no setting tried holds ({len(said)} tried)")
             + (f"; not: {'; '.join(said)}" if said else ""))
    keys = case_keys([r for n in (holds or list(tried)) for r in tried[n]])
    return [Finding(EXPERIMENT, FIX, subj, PASS if ch["name"] else FAIL, claim, Evidence(records=keys, cost=ch["cost"]),
                    remedy=ch["name"], card=True, commits=commits_of(avail),
                    short=fix_words(ch["name"], len(holds) + len(said)) + f", {steps}")]


def _finite(sub: list[dict]) -> list[Finding]:
    """A run whose loss went non-finite (NaN or inf) is a finding of its own: a FAIL naming the run and the step."""
    out = []
    for r in (x for x in sub if x.get("available")):
        t = non_finite(r)
        if t is not None:
            out.append(Finding(EXPERIMENT, FINITE, {**subject_of(r), "setting": r["setting"], "run": r["run"],
                                                    "layout": layout_of(r)}, FAIL,
                               f"{r['setting']}, {r['layers']} layer(s), {layout_of(r)} run {r['run']}: the loss is not "
                               f"finite from step {t} of {len(r['loss'])} ({r['loss'][t - 1]!r})",
                               Evidence(records=case_keys([r])), card=True, commits=commits_of([r]),
                               short=f"loss not finite from step {t} ({layout_of(r)} run {r['run']})"))
    return out


def _spec_or_ep(r: dict) -> str:
    try:
        return layout_of(r)
    except (KeyError, ValueError, TypeError):
        return f"ep {r.get('ep')}"


def findings(records: list[dict]) -> list[Finding]:
    recs = [r for r in records if isinstance(r, dict) and r.get("kind") == "train"]
    out: list[Finding] = []
    for _key, sub in groups(recs).items():
        out += guarded(EXPERIMENT, QUESTION, sub, lambda sub=sub: _layouts(sub))
        out += guarded(EXPERIMENT, RUN_TO_RUN, sub, lambda sub=sub: _against_reruns(sub))
        out += guarded(EXPERIMENT, FIX, sub, lambda sub=sub: _fix(sub))
        out += guarded(EXPERIMENT, FINITE, sub, lambda sub=sub: _finite(sub))
        for r in (x for x in sub if x.get("available") is False):
            out.append(Finding(EXPERIMENT, "setting", {**subject_of(r), "setting": r.get("setting")}, NA,
                               f"{r.get('setting')}, {_spec_or_ep(r)}: not run here ({r.get('reason')})",
                               Evidence(records=case_keys([r])), commits=commits_of([r])))
    return out


__all__ = ["findings", "frame", "first_difference", "rel_loss", "weight_divergence", "flips", "unpack",
           "reference_of", "layout_of", "where_parted", "EXPERIMENT"]
