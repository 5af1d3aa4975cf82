"""Hold one placement's findings against another's: e.g. one rank per GPU over NCCL against the same EP as
virtual EP on one GPU (ranks sharing it over gloo). Per case of notebooks 01, 02 and 04 that both report: do the
verdicts agree (diverges or not and why, first divergent stage, remedy bitwise in every trial), and are the mismatch
magnitudes within a factor of 2 of each other. Where they disagree, the row says which mechanism only one of the two
placements exercises (NCCL's own reduction order — ring or tree — and NVLink exist only with one rank per GPU).
Notebook 06's runs are held against each other whole: is each training trajectory (its loss bits and weight
fingerprints, every step) the same bits in both record sets — e.g. the same profile on two machines or two days —
and is its layout's weight divergence at step K of the same size. Text only: reads records, measures nothing."""

from __future__ import annotations

FACTOR = 2.0


def _placement(records: list[dict]) -> str:
    r = next((x for x in records if x.get("placement")), {})
    gpus = sorted({f"{x['gpu']} {str(x.get('gpu_uuid', ''))[:8]}" for x in records if x.get("gpu")})
    cpus = sorted({x["cpu"].get("model", "CPU") for x in records if isinstance(x.get("cpu"), dict)})
    machine = f" on {', '.join(gpus)}" if gpus else f" on {', '.join(cpus)}" if cpus else ""
    return f"{r.get('world')} ranks, {r.get('placement')}, {r.get('backend')}{machine}"


def compare(a: list[dict], b: list[dict], *, factor: float = FACTOR) -> list[dict]:
    """Rows (notebook, case, what, a, b, agree, within_factor, why) for every case both record sets hold: each
    question's own rows (its folder's `compare`), in the registry's order."""
    from ..questions import QUESTIONS

    rows = []
    for q in QUESTIONS:
        rows_of = q.compare_rows()
        if rows_of is not None:
            rows += rows_of(a, b, factor)
    return rows


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
