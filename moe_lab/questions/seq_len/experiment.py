"""Notebook 09: the same layer (the profile's, router dtype 'none') at several sequence lengths — do the EP ranks
part at every length, and as much? Each case is the probe's (`experiments.probe`: the same tokens on every rank, in
`trials` trials, against a rerun on one rank), so a length's verdict follows 01's rule: EP order only where the ranks
differ in every trial and a rerun never does. The truncation comparison the probe also makes cuts at half the
sequence (`cut` = seq_len // 2), so every length has one."""

from __future__ import annotations

from typing import TYPE_CHECKING

if TYPE_CHECKING:
    from ...run_config import RunConfig

from . import QUESTION
from ...experiments import probe
from ...experiments.probe import on_engine  # noqa: F401 - the engine side is the probe's
from .params import SeqLenParams

NAME = "seq_len"
NOTEBOOK = QUESTION.number


def cases(config: RunConfig):
    base = config.layer
    return [probe.case(base.replace(seq_len=n, dispatcher=d, router_dtype="none"), cut=n // 2,
                       trials=config.run.trials, experiment=NAME, release=config.release, layout=config.layout)
            for n in config.params(SeqLenParams).seq_lens for d in config.run.dispatchers]


def records(case, per_rank):
    return probe.records(case, per_rank)


def verdict(records: list[dict]) -> str:
    """Notebook 09's verdict: its findings, rendered."""
    from ...findings import render
    from . import findings as found

    return render.verdict(found.findings(records))


__all__ = ["cases", "on_engine", "records", "verdict"]
