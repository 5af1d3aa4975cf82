"""bench's equality rule: on GPU only deterministic-mode configs are held equal between the two paths; a fresh spawn's
rendezvous port."""

import pytest

from moe_lab.tools import bench
from moe_lab.config import MoEConfig


def _runs(values: dict) -> list[dict]:
    return [{name: {"truncation": v} for name, v in values.items()}]


def test_gpu_holds_only_deterministic_configs_equal():
    cfgs = [MoEConfig(dispatcher="allgather"), MoEConfig(dispatcher="allgather", deterministic=True)]
    names = [bench.label(c) for c in cfgs]
    assert names == ["allgather/none", "allgather/none/det"]
    warm = _runs({names[0]: 1, names[1]: 2})
    fresh_nondet_differs = _runs({names[0]: 9, names[1]: 2})
    sw = bench._sweep(cfgs, [1.0], [2.0], warm, fresh_nondet_differs, 1.0, device="cuda")
    assert sw["results_equal"] and sw["n_compared"] == 1
    assert sw["run_to_run"] == ["allgather/none: fresh run 1 differs from warm run 1 in ['truncation']"]
    # the same difference on CPU is a real mismatch: nothing there excuses it
    cpu = bench._sweep(cfgs, [1.0], [2.0], warm, fresh_nondet_differs, 1.0, device="cpu")
    assert not cpu["results_equal"] and cpu["n_compared"] == 2 and cpu["run_to_run"] == []
    # and a deterministic config that differs on GPU is one too
    det_differs = _runs({names[0]: 1, names[1]: 7})
    gpu = bench._sweep(cfgs, [1.0], [2.0], warm, det_differs, 1.0, device="cuda")
    assert not gpu["results_equal"] and gpu["mismatches"][0].startswith("allgather/none/det")


def test_capture_overhead_from_rounds_cancels_drift_between_rounds():
    # round 2 is twice as slow for every mode (drift): per-round ratios are unaffected, the medians' ratio would be too
    t = {"plain": [1.0, 2.0, 1.0, 1.0], "fingerprint": [1.02, 2.04, 1.02, 1.02], "capture": [1.0, 2.0, 1.0, 1.0],
         "capture_fingerprints": [2.0, 4.0, 2.0, 2.0]}
    slow_rank = {m: [x * 1.5 if i == 0 else x for i, x in enumerate(v)] for m, v in t.items()}
    cap = bench._capture([{"times_s": t, "stages": 3}, {"times_s": slow_rank, "stages": 3}], MoEConfig())
    # round 1 is bounded by the slow rank, in every mode: the ratio is the same in every round
    assert round(cap["overhead_pct"]["fingerprint"], 6) == 2.0
    assert [round(x, 6) for x in cap["overhead_ci_pct"]["fingerprint"]] == [2.0, 2.0]
    assert cap["overhead_pct"]["capture_fingerprints"] == 100.0 and cap["rounds"] == 4


def test_capture_only_checks_rounds_before_starting_anything():
    import pytest

    with pytest.raises(ValueError, match=r"rounds \(1\) must be an integer >= 2"):
        bench.capture_overhead(device="cpu", rounds=1)


def test_a_fresh_spawns_rendezvous_port_is_below_the_ephemeral_range(tmp_path, monkeypatch):
    """Chosen before rank 0 binds it: from below the OS's ephemeral range (which no bind to port 0 or outgoing
    connection takes meanwhile) and out of the next choices; the control: where that range does not exist, the OS's
    own pick, which lies inside it."""
    from moe_lab.controller import ports

    monkeypatch.setattr(ports, "registry_path", lambda: tmp_path / "ports.json")
    span = ports.candidate_range()
    if span is None:
        pytest.skip(f"this OS leaves no port range below its ephemeral one ({ports.EPHEMERAL})")
    low = int(ports.EPHEMERAL.read_text().split()[0])
    picked = [bench.rendezvous_port() for _ in range(20)]
    assert all(span[0] <= p < low for p in picked) and len(set(picked)) == 20
    monkeypatch.setattr(ports, "candidate_range", lambda: None)
    assert bench.rendezvous_port() >= low
