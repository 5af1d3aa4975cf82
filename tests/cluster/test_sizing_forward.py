"""The forward a gpu-profile run on virtual EP is sized from (`reporting.budget.measure_forward_on_engines`), run on
real engines: every rank times it, and the layer it built is gone afterwards (a sized run's notebooks build theirs at
another size). Measured here on CPU engines, the same code as on ranks sharing a GPU."""

import ipyparallel as ipp
import pytest

from moe_lab import profiles
from moe_lab.reporting import budget

pytestmark = pytest.mark.cluster

P = profiles.load("cpu")


@ipp.interactive
def _cached_layers():
    from moe_lab.engine.dist import STATE

    return len(STATE.get("layers") or {})


@ipp.interactive
def _build_only(cfg_dict, layout):
    from moe_lab.engine import toolkit

    toolkit.setup(cfg_dict, layout)


def test_the_sizing_forward_is_timed_on_every_rank_and_leaves_no_layer(cpu_cluster):
    layout = P.layout.on(4).asdict()
    per_rank = cpu_cluster.run(budget.measure_forward_on_engines, P.layer.asdict(), layout)
    assert len(per_rank) == 4 and all(isinstance(t, float) and 0 < t < 60 for t in per_rank)
    assert cpu_cluster.run(_cached_layers) == [0, 0, 0, 0]
    cpu_cluster.run(_build_only, P.layer.asdict(), layout)  # the control: a case's set-up keeps its layer
    assert cpu_cluster.run(_cached_layers) == [1, 1, 1, 1]
    cpu_cluster.run(budget.measure_forward_on_engines, P.layer.asdict(), layout)  # and the timing drops it too
    assert cpu_cluster.run(_cached_layers) == [0, 0, 0, 0]
