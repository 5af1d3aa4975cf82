"""What a question is: one folder of `moe_lab.questions` whose `__init__` exports `QUESTION`, a `Question` naming its
number, words, notebook, typed parameters, the protocol experiments that run its cases, its findings, figures and
(where it has one) how two reports of it compare. The registry (`moe_lab.questions.QUESTIONS`) is every such folder.

The modules a question names are imported when first used, not when the registry loads: the registry is read by
the controller, the CLI and the tests without torch, and an engine that imports one question's experiment does not
import every other question's."""

from __future__ import annotations

import importlib
import re
from dataclasses import dataclass, field
from types import ModuleType
from typing import Callable

_NUMBER = re.compile(r"^\d\d$")
ANSWER_COLUMNS = ("diverges", "where", "fix", "cost", "truncation", "gradients", "training", "expected")
"""The answer table's columns, in order: what a user asks of every subject (`moe_lab.findings.answers`)."""


@dataclass(frozen=True)
class Question:
    number: str
    """Two digits: the notebook's number and the order of the index's sections."""
    name: str
    """The question's folder (a Python identifier)."""
    text: str
    """The question in one sentence, as the index and the README's table ask it."""
    notebook: str
    """The notebook's file name in notebooks/, without .ipynb; it starts with the number."""
    package: str
    """The question's package (its folder's `__name__`)."""
    runs: tuple[str, ...] = ("experiment",)
    """Modules of the folder that run cases on the protocol (`experiments.protocol.run`), in the order they run."""
    experiments: tuple[str, ...] = ()
    """The `experiment` names its records carry (each run module's NAME)."""
    findings: tuple[str, ...] = ("findings",)
    """Modules of the folder with `findings(records) -> [Finding]`; a question's findings are theirs in order."""
    answers: dict[str, str] = field(default_factory=dict)
    """Which column of the answer table each of its card findings fills: the finding's `question` → one of
    `ANSWER_COLUMNS` (a card finding not named here is left out of the table, kept in the evidence)."""
    fallback_answers: dict[str, str] = field(default_factory=dict)
    """Findings (card or not) that fill a column only where no other question's finding fills it for the subject
    (e.g. 03's own plain-ranks answer, where 01 did not run)."""
    figures: str | None = "figures"
    """The module of the folder with the notebook's figures (None: it draws none of its own)."""
    verdicts: tuple[str, ...] = ()
    """Modules of the folder whose `verdict(records)` make the notebook's verdict cell, in order (empty: its run
    modules); each is given the records of its own experiment (its NAME) where it has one."""
    compare: str | None = None
    """The module of the folder with `rows(a, b, factor) -> [dict]` over the two reports' matched cases (and the subject
    fields that belong to a verdict): how the same question in two reports compares (`moe_lab.reporting.compare`)."""
    params: type | None = None
    """Its typed parameters (`moe_lab.params.Section` or `Flat`), or None where it reads only the common keys."""
    axes: tuple[str, ...] = ()
    """Layer-config fields the question varies within one subject (left out of a finding's subject, e.g. seq_len)."""
    max_cuts: int | None = None
    """The most of a sized cpu-profile run's cuts (`reporting.budget.STEPS`, each halving the layer's GEMM work) its
    cases take, where a smaller layer no longer shows its effect (None: as many as the run takes)."""
    max_cuts_why: str = ""
    """Why, in words the run's sizing note quotes: what was measured at the next cut."""

    def __post_init__(self):
        if not _NUMBER.match(self.number):
            raise ValueError(f"question {self.name!r}: number {self.number!r} must be two digits, e.g. '09'")
        if not self.name.isidentifier():
            raise ValueError(f"question number {self.number}: name {self.name!r} must be a Python identifier")
        if not self.notebook.startswith(self.number + "_"):
            raise ValueError(f"question {self.number}: notebook {self.notebook!r} must start with '{self.number}_'")
        if not self.text.strip().endswith("?"):
            raise ValueError(f"question {self.number}: its text must ask a question (end with '?'): {self.text!r}")
        bad = sorted((set(self.answers.values()) | set(self.fallback_answers.values())) - set(ANSWER_COLUMNS))
        if bad:
            raise ValueError(f"question {self.number}: answers name column(s) {bad}; the columns are {ANSWER_COLUMNS}")
        if self.max_cuts is not None and not (isinstance(self.max_cuts, int) and not isinstance(self.max_cuts, bool)
                                              and self.max_cuts >= 0 and self.max_cuts_why.strip()):
            raise ValueError(f"question {self.number}: max_cuts ({self.max_cuts!r}) must be a whole number >= 0 "
                             f"with max_cuts_why saying what was measured at the next cut")
        if not self.runs or not self.experiments or not self.findings:
            raise ValueError(f"question {self.number}: runs, experiments and findings must each name at least one")

    def module(self, name: str) -> ModuleType:
        return importlib.import_module(f"{self.package}.{name}")

    def run_modules(self) -> list[ModuleType]:
        return [self.module(m) for m in self.runs]

    def findings_of(self, records: list[dict]) -> list:
        """Its findings from its own records (`of_question` picks those)."""
        out = []
        for m in self.findings:
            out += self.module(m).findings(records)
        return out

    def verdict(self, records: list[dict]) -> str:
        """The notebook's verdict cell from its records, as the notebook prints it (each module's verdict, a blank
        line between)."""
        out = []
        for m in (self.module(name) for name in (self.verdicts or self.runs)):
            name = getattr(m, "NAME", None)
            out.append(m.verdict([r for r in records if name is None or r.get("experiment") in (None, name)]))
        return "\n\n".join(out)

    def figures_module(self) -> ModuleType | None:
        return self.module(self.figures) if self.figures else None

    def compare_rows(self) -> Callable | None:
        return self.module(self.compare).rows if self.compare else None

    def owns(self, record: dict) -> bool:
        """A record is the question's when it names its notebook, or (records without one) one of its experiments."""
        if not isinstance(record, dict):
            return False
        nb = record.get("notebook")
        return nb == self.number if nb else record.get("experiment") in self.experiments


__all__ = ["Question", "ANSWER_COLUMNS"]
