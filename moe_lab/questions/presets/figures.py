"""Notebook 07's figures: per model preset, the settings grid's mismatch (03's grid, drawn per model instead of per
release). Records → seaborn figures; no numerics here."""

from __future__ import annotations

from ..promotion.figures import sweep_heatmap


def preset_grid(records: list[dict], metric: str = "cross_rank", ax=None):
    """Each preset's cells (dispatcher x setting) by model: the `metric` comparison's mismatch fraction (worst trial);
    'cross_rank': the EP ranks against each other, 'rerun': a rerun on one rank against the first forward."""
    return sweep_heatmap(records, metric, ax=ax, by="model")
