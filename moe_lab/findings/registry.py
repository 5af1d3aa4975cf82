"""The experiments whose records become findings, in notebook order: the index, `moe-lab findings` and the README
iterate this registry and know no notebook by number."""

from __future__ import annotations

from dataclasses import dataclass
from typing import Callable

from . import compound, layouts, localise, presets, promotion, reproduce, training, truncation
from .model import FAIL, MIXED, NA, NOT_MEASURED, PASS, Finding


@dataclass(frozen=True)
class Experiment:
    notebook: str
    name: str
    question: str
    findings: Callable[[list[dict]], list[Finding]]


EXPERIMENTS = (
    Experiment("01", reproduce.EXPERIMENT, "Same tokens on every EP rank: do the outputs agree? And under another "
               "layout?", lambda recs: reproduce.findings(recs) + layouts.findings(recs)),
    Experiment("02", localise.EXPERIMENT, "Which stage and which collective first diverge?", localise.findings),
    Experiment("03", promotion.EXPERIMENT, "Which fp32/fp64 / deterministic setting makes ranks agree, at what cost?",
               promotion.findings),
    Experiment("04", truncation.EXPERIMENT, "Do the first tokens stay bitwise equal when the rest are zeroed?",
               truncation.findings),
    Experiment("05", compound.EXPERIMENT, "Do the gradients agree too, and how do differences grow with depth?",
               compound.findings),
    Experiment("06", training.EXPERIMENT, "Trained at EP 1, 2, 4: how soon and how far do runs part, and why?",
               training.findings),
    Experiment("07", presets.EXPERIMENT, "Your model: do a production MoE layer's EP ranks agree, where do they part, "
               "and which setting fixes it at what cost?", presets.findings),
)
BY_NAME = {e.name: e for e in EXPERIMENTS}
NOTEBOOK_EXPERIMENTS = {"01": (reproduce.EXPERIMENT, layouts.EXPERIMENT)}
"""Notebooks that answer more than one experiment's question: their records carry either name."""


def of_notebook(records: list[dict], exp: Experiment) -> list[dict]:
    names = NOTEBOOK_EXPERIMENTS.get(exp.notebook, (exp.name,))
    return [r for r in records if isinstance(r, dict) and (r.get("notebook") == exp.notebook
                                                            or (not r.get("notebook") and r.get("experiment") in names))]


def findings(records: list[dict]) -> dict[str, list[Finding]]:
    """Every experiment's findings from a report's records: notebook number → findings."""
    return {e.notebook: e.findings(of_notebook(records, e)) for e in EXPERIMENTS}


def headline(fs: list[Finding]) -> tuple[str, str]:
    """One status and line over an experiment's card findings (all of them where none is a card's): no PASS without
    a measured finding — nothing measured is NOT MEASURED (or N/A where everything was not applicable)."""
    top = [f for f in fs if f.card] or list(fs)
    if not top:
        return NOT_MEASURED, "no records: nothing was measured"
    st = {f.status for f in top}
    measured = [f for f in top if f.status in (PASS, FAIL, MIXED)]
    if not measured:
        status = NOT_MEASURED if NOT_MEASURED in st else NA
    else:
        status = FAIL if FAIL in st else MIXED if MIXED in st else PASS
    pick = [f for f in top if f.status == status] or top
    n = {s: sum(f.status == s for f in top) for s in (PASS, FAIL, MIXED, NOT_MEASURED, NA) if any(f.status == s for f in top)}
    counts = ", ".join(f"{k} {v}" for k, v in n.items())
    return status, f"{counts} of {len(top)} finding(s): " + "; ".join(f.claim.split(" — ")[0] for f in pick[:3])


__all__ = ["EXPERIMENTS", "BY_NAME", "Experiment", "findings", "headline", "of_notebook"]
