"""Hold one placement's findings against another's (#17): e.g. one rank per GPU over NCCL against the same EP as
virtual EP on one GPU (ranks sharing it over gloo). Per case of notebooks 01, 02 and 04 that both report: do the
verdicts agree (diverges or not and why, first divergent stage, remedy bitwise in every trial), and are the mismatch
magnitudes within a factor of 2 of each other. Where they disagree, the row says which mechanism only one of the two
placements exercises (NCCL's own reduction order — ring or tree — and NVLink exist only with one rank per GPU).
Notebook 06's runs are held against each other whole: is each training trajectory (its loss bits and weight
fingerprints, every step) the same bits in both record sets — e.g. the same profile on two machines or two days —
and is its layout's weight divergence at step K of the same size. Text only: reads records, measures nothing."""

from __future__ import annotations

from ..findings import labels
from ..findings import training as train_f

FACTOR = 2.0


def _attr(r: dict) -> str:
    return labels.attribution(r["cross_rank"], r["rerun"])


def _within(a: float, b: float, factor: float = FACTOR) -> bool:
    if a == 0 or b == 0:
        return a == b
    return max(a, b) / min(a, b) <= factor


def _placement(records: list[dict]) -> str:
    r = next((x for x in records if x.get("placement")), {})
    gpus = sorted({f"{x['gpu']} {str(x.get('gpu_uuid', ''))[:8]}" for x in records if x.get("gpu")})
    cpus = sorted({x["cpu"].get("model", "CPU") for x in records if isinstance(x.get("cpu"), dict)})
    machine = f" on {', '.join(gpus)}" if gpus else f" on {', '.join(cpus)}" if cpus else ""
    return f"{r.get('world')} ranks, {r.get('placement')}, {r.get('backend')}{machine}"


def _train_key(r: dict) -> tuple:
    return (r["label"], r["steps"], r["tokens"], r["precision"], r.get("megatron_core"))


def _drift(r: dict, pool: list[dict]) -> float:
    """||Δw|| / ||w|| at the last step of run `r` against its reference layout's run in `pool` (0 for the reference)."""
    ref = train_f.reference_of(r, pool)
    return 0.0 if ref is None or ref is r else train_f.weight_divergence(r, ref)[-1]


def _train_rows(a: list[dict], b: list[dict], factor: float) -> list[dict]:
    """Notebook 06: per training run both sets hold with the same configuration, its trajectory's bits (equal, or
    the step after which they part and where), and its weight divergence from its reference layout at step K."""
    ra = [r for r in a if r.get("notebook") == "06" and r.get("kind") == "train" and r.get("available")]
    rb = [r for r in b if r.get("notebook") == "06" and r.get("kind") == "train" and r.get("available")]
    ka, kb = {_train_key(r): r for r in ra}, {_train_key(r): r for r in rb}
    rows = []
    for k in sorted(set(ka) & set(kb), key=str):
        x, y = ka[k], kb[k]
        if x.get("config") != y.get("config"):
            continue
        t = train_f.first_difference(x, y)
        det = "deterministic" if x["deterministic"] else "not deterministic"
        why = "" if t is None else (f"parts after step {t} of {x['steps']} (in {train_f.where_parted(x, y, t)})"
                                    + ("" if x["deterministic"] else "; without deterministic mode one machine's "
                                       "reruns may part too"))
        da, db = _drift(x, ra), _drift(y, rb)
        rows.append({"notebook": "06", "case": k[0], "what": f"trajectory bits, {det}",
                     "a": f"loss at step {x['steps']} {x['loss'][-1]:.6g}, ||Δw||/||w|| vs reference {da:.2g}",
                     "b": f"loss at step {y['steps']} {y['loss'][-1]:.6g}, ||Δw||/||w|| vs reference {db:.2g}",
                     "agree": t is None, "within_factor": _within(da, db, factor), "why": why,
                     "deterministic": bool(x["deterministic"])})
    return rows


def compare(a: list[dict], b: list[dict], *, factor: float = FACTOR) -> list[dict]:
    """Rows (notebook, case, what, a, b, agree, within_factor, why) for every case both record sets hold."""
    rows = []
    why_nccl = ("NCCL's own reduction order (ring/tree) and NVLink are exercised only with one rank per GPU; "
                "gloo reduces on the host in one fixed order")
    ka = {(r["dispatcher"], r["router_dtype"]): r for r in a if r.get("notebook") == "01"}
    kb = {(r["dispatcher"], r["router_dtype"]): r for r in b if r.get("notebook") == "01"}
    for k in sorted(set(ka) & set(kb)):
        ra, rb = ka[k], kb[k]
        va, vb = _attr(ra), _attr(rb)
        fa, fb = ra["cross_rank"].get("mismatch_frac", 0.0), rb["cross_rank"].get("mismatch_frac", 0.0)
        rows.append({"notebook": "01", "case": f"{k[0]}/router {k[1]}", "what": "cross-rank verdict",
                     "a": f"{va} ({fa:.3g})", "b": f"{vb} ({fb:.3g})", "agree": va == vb,
                     "within_factor": _within(fa, fb, factor), "why": "" if va == vb else why_nccl})
    ca = {(r["dispatcher"], r["variant"]): r for r in a if r.get("notebook") == "02" and r.get("record") == "case"}
    cb = {(r["dispatcher"], r["variant"]): r for r in b if r.get("notebook") == "02" and r.get("record") == "case"}
    for k in sorted(set(ca) & set(cb)):
        sa, sb = ca[k]["first_divergent_stage"], cb[k]["first_divergent_stage"]
        fa, fb = ca[k].get("out_mismatch_frac") or 0.0, cb[k].get("out_mismatch_frac") or 0.0
        rows.append({"notebook": "02", "case": f"{k[0]}/{k[1]}", "what": "first divergent stage", "a": str(sa),
                     "b": str(sb), "agree": sa == sb, "within_factor": _within(fa, fb, factor),
                     "why": "" if sa == sb else why_nccl})
    ta = {(r["dispatcher"], r["remedy"], r.get("tile")): r for r in a if r.get("notebook") == "04"
          and r.get("kind") == "case" and r.get("available") and not r.get("emulated")}
    tb = {(r["dispatcher"], r["remedy"], r.get("tile")): r for r in b if r.get("notebook") == "04"
          and r.get("kind") == "case" and r.get("available") and not r.get("emulated")}
    for k in sorted(set(ta) & set(tb), key=str):
        ha = ta[k]["truncation"]["bitwise_equal"] and ta[k]["rerun"]["bitwise_equal"]
        hb = tb[k]["truncation"]["bitwise_equal"] and tb[k]["rerun"]["bitwise_equal"]
        fa, fb = ta[k]["truncation"]["mismatch_frac"], tb[k]["truncation"]["mismatch_frac"]
        rows.append({"notebook": "04", "case": f"{k[0]}/{labels.rem_label(k[1], k[2])}", "what": "holds in every trial",
                     "a": str(ha), "b": str(hb), "agree": ha == hb, "within_factor": _within(fa, fb, factor),
                     "why": "" if ha == hb else "the combine's collectives differ (see 02); GEMMs are the same kernels"})
    return rows + _train_rows(a, b, factor)


def summary(a: list[dict], b: list[dict], *, factor: float = FACTOR) -> str:
    rows = compare(a, b, factor=factor)
    if not rows:
        return "No case is in both record sets."
    lines = [f"A: {_placement(a)}; B: {_placement(b)}; {len(rows)} cases in both.",
             f"verdicts agree in {sum(r['agree'] for r in rows)} of {len(rows)}; mismatch magnitudes within "
             f"{factor:g}x in {sum(r['within_factor'] for r in rows)} of {len(rows)}."]
    train = [r for r in rows if r["notebook"] == "06"]
    if train:
        parts = []
        for det, name in ((True, "with deterministic mode"), (False, "without it")):
            sub = [r for r in train if r["deterministic"] == det]
            if sub:
                parts.append(f"{name} {sum(r['agree'] for r in sub)} of {len(sub)}")
        lines.append("06: training trajectories bitwise equal (loss bits and weight fingerprints, every step) "
                     + "; ".join(parts) + ".")
    for r in rows:
        if not r["agree"] or not r["within_factor"]:
            lines.append(f"- {r['notebook']} {r['case']} ({r['what']}): A {r['a']}, B {r['b']}"
                         + (f" — {r['why']}" if r["why"] else " — magnitudes differ by more than the factor"))
    return "\n".join(lines)


__all__ = ["compare", "summary", "FACTOR"]
