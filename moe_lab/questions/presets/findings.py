"""Notebook 07's findings: per model preset and dispatcher, the answers of 01-04 on the preset's layer —
do the ranks agree and why not (01's attribution rule on the plain bf16 cell), which stage first parts (02, from the
cell's captured forward), which setting makes ranks and reruns bitwise equal in every trial, at what cost (03's rule:
never ranked inside overlapping intervals). Each is the other notebook's finding, built from these records and
filed under this experiment; a preset whose plain cell is missing says so instead of answering."""

from __future__ import annotations

import dataclasses

from ..promotion import findings as promotion
from ..reproduce import findings as reproduce
from ...findings.common import groups, guarded
from ..localise.findings import collective_of, stage_words
from ...findings.model import FAIL, NA, NOT_MEASURED, PASS, Evidence, Finding, case_keys, commits_of, subject_of

EXPERIMENT = "presets"
STAGE = "first divergent stage"


def _ours(fs: list[Finding]) -> list[Finding]:
    return [dataclasses.replace(f, experiment=EXPERIMENT) for f in fs]


def _stage(plain: dict) -> Finding:
    """Where the plain cell's ranks first part (the captured forward's first divergent stage)."""
    subj = subject_of(plain)
    ev = Evidence(records=case_keys([plain]),
                  notes=[f"probs travel in {plain.get('probs_dtype')}, the combine ({plain.get('combine_op')}) runs in "
                         f"{plain.get('combine_dtype')}"])
    who = f"{plain['dispatcher']}, plain bf16"
    if not plain["cross_rank"].get("applicable", True):
        return Finding(EXPERIMENT, STAGE, subj, NA, f"{who}: one rank — no stage compared", ev, card=True,
                       commits=commits_of([plain]), short="one rank: nothing compared")
    where = plain.get("first_divergent_stage")
    if where is None:
        return Finding(EXPERIMENT, STAGE, subj, PASS, f"{who}: every captured stage agrees across ranks in the "
                       "captured forward", ev, card=True, commits=commits_of([plain]),
                       short="no captured stage differs")
    inside = plain.get("first_divergent_kind") in ("copies", "copies/expert")
    coll = collective_of({**plain, "probs_gather_dtype": plain.get("probs_dtype")})
    f = Finding(EXPERIMENT, STAGE, subj, FAIL, f"{who}: first divergent stage {where}"
                + (" — identical copies of a token differ within one rank there" if inside else "")
                + (f"; it is the collective {coll}" if coll else ""), ev, card=True, commits=commits_of([plain]),
                short=stage_words(where, coll, inside, None))
    f.subject["first_stage"], f.subject["collective"] = where, coll
    return f


def _group(cells: list[dict]) -> list[Finding]:
    """The group's findings, each claim opening with the preset's name (scaled ones say so): the same sentences
    are made for every preset, and the CLI's `findings`, the cards and the README list them side by side."""
    model = (cells[0].get("config") or {}).get("model") or "?"
    return [dataclasses.replace(f, claim=f"{model}: {f.claim}") for f in _answers(cells)]


def _answers(cells: list[dict]) -> list[Finding]:
    plain = next((r for r in cells if promotion.is_plain(r)), None)
    if plain is None:
        return [Finding(EXPERIMENT, promotion.QUESTION, subject_of(cells[0]), NOT_MEASURED,
                        f"{cells[0]['dispatcher']}: the plain bf16 cell was not measured, so nothing is said about "
                        "whether the ranks agree or what fixes them", Evidence(records=case_keys(cells)), card=True,
                        commits=commits_of(cells), short="plain cell not measured")]
    out = _ours(reproduce.findings([dict(plain, kind="case")]))
    out.append(_stage(plain))
    out += _ours([f for f in promotion.findings(cells) if f.question != promotion.PLAIN_RANKS])
    return out


def _groups(records: list[dict]):
    """(cells, findings) per preset x release x dispatcher (records of cells that ran)."""
    ran = [r for r in records if isinstance(r, dict) and "skipped" not in r]
    for _key, cells in groups(ran).items():
        yield cells, guarded(EXPERIMENT, "your model", cells, lambda cells=cells: _group(cells))


def findings(records: list[dict]) -> list[Finding]:
    return [f for _cells, fs in _groups(records) for f in fs]  # no cell ran: none (the headline: NOT MEASURED)


def rows(records: list[dict]) -> list[dict]:
    """One row per preset x release x dispatcher, each cell a finding's words (`Finding.short`, the answer table's),
    never a number of its own and never a test's badge on a location or a remedy."""
    from ...findings.answers import cost_cell

    out = []
    for cells, fs in _groups(records):
        by_q = {f.question: f for f in fs}
        agree, stage, fix = by_q.get(reproduce.QUESTION), by_q.get(STAGE), by_q.get(promotion.QUESTION)
        c = cells[0]
        cost = cost_cell(fix.evidence.cost) if fix is not None and fix.remedy else None
        out.append({
            "model": (c.get("config") or {}).get("model") or "?", "release": c.get("megatron_core"),
            "dispatcher": c.get("dispatcher"),
            "ranks diverge? (plain bf16)": agree.short if agree else "not measured",
            "first divergent stage": stage.short if stage is not None else "not measured",
            "fix": fix.short if fix else "not measured",
            "cost of the fix": cost.text if cost else "—",
        })
    return out


__all__ = ["findings", "rows", "EXPERIMENT"]
