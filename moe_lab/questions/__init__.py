"""The registry of questions: every sub-folder of this package that exports `QUESTION` (a `spec.Question`), in
notebook order. The runner, the index, `moe-lab findings`, `moe-lab compare`, the profile check, the README's
question table and the tests iterate it; no notebook number or question text is written anywhere else.

Adding a question is adding a folder here (its `__init__` with `QUESTION`, its params, experiment, findings and
figures), its notebook in notebooks/ and its test file."""

from __future__ import annotations

import importlib
import pkgutil

from ..findings.model import Finding
from ..findings.render import headline
from .spec import Question


def _discover() -> tuple[Question, ...]:
    found = []
    for info in pkgutil.iter_modules(__path__):
        if not info.ispkg:
            continue
        mod = importlib.import_module(f"{__name__}.{info.name}")
        q = getattr(mod, "QUESTION", None)
        if not isinstance(q, Question):
            raise TypeError(f"moe_lab/questions/{info.name}/ is a question folder without a QUESTION "
                            f"(moe_lab.questions.spec.Question) in its __init__.py")
        if q.name != info.name or q.package != mod.__name__:
            raise ValueError(f"moe_lab/questions/{info.name}/: QUESTION names folder {q.name!r} and package "
                             f"{q.package!r}; they must be the folder's own")
        found.append(q)
    found.sort(key=lambda q: q.number)
    numbers = [q.number for q in found]
    dup = sorted({n for n in numbers if numbers.count(n) > 1})
    if dup:
        raise ValueError(f"questions: number(s) {dup} used by more than one folder")
    return tuple(found)


QUESTIONS: tuple[Question, ...] = _discover()
BY_NUMBER = {q.number: q for q in QUESTIONS}
BY_NAME = {q.name: q for q in QUESTIONS}


def of_question(records: list[dict], q: Question) -> list[dict]:
    return [r for r in records if q.owns(r)]


def findings(records: list[dict]) -> dict[str, list[Finding]]:
    """Every question's findings from a report's records: notebook number → findings, in notebook order."""
    return {q.number: q.findings_of(of_question(records, q)) for q in QUESTIONS}


def by_experiment(name: str) -> Question:
    """The question whose records carry experiment `name`."""
    for q in QUESTIONS:
        if name in q.experiments:
            return q
    raise KeyError(f"no question runs experiment {name!r}; known: "
                   f"{sorted(e for q in QUESTIONS for e in q.experiments)}")


def params_types() -> list[type]:
    return [q.params for q in QUESTIONS if q.params is not None]


def table() -> str:
    """The README's question table, from the registry."""
    rows = ["| # | notebook | question |", "| --- | --- | --- |"]
    rows += [f"| {q.number} | `{q.notebook}` | {q.text} |" for q in QUESTIONS]
    return "\n".join(rows)


__all__ = ["QUESTIONS", "BY_NUMBER", "BY_NAME", "Question", "of_question", "findings", "by_experiment", "headline",
           "params_types", "table"]
