"""Notebook 07 in two reports, per case `moe_lab.reporting.compare` matched: on a model preset's layer, do the ranks
agree and why not (01's attribution), the first divergent stage (02's), and which setting fixes it (03's remedy). The
magnitude is the plain cell's: the output elements that differ across ranks (worst trial, worst rank pair)."""

from __future__ import annotations

from ..promotion.compare import magnitude as plain_cell_magnitude
from ..reproduce.compare import side_by_side

DETAILS = ("attribution", "first_stage", "collective")
"""Subject fields that are the verdict's words, not the case's identity."""


def axes(finding, records: list[dict]) -> dict:
    """The preset a case is about (its layer names it too, but another preset is another case, never the same case
    on another layer)."""
    models = sorted({str((r.get("config") or {}).get("model")) for r in records if isinstance(r.get("config"), dict)})
    return {"model": ", ".join(models)} if models else {}


rows = side_by_side(plain_cell_magnitude)
