"""`moe-lab bench --quick` on 4 gloo engines: the warm sweep beats one fresh spawn per config, with equal results."""

import json

import pytest

from moe_lab.cli import bench as bench_cli
from moe_lab.tools import bench


@pytest.fixture(scope="module")
def quick(cpu_layer):
    """The quick bench at the layer for this CPU's bf16 GEMM (its default layer is the cpu profile's)."""
    at = cpu_layer.config()
    return bench.run(device="cpu", engines=4, quick=True, timeout_s=300, config=at.layer, cut=at.run.cut)


@pytest.mark.cluster
def test_warm_sweep_beats_fresh_spawns_with_equal_results(quick):
    sw = quick["sweep"]
    assert sw["results_equal"], sw["mismatches"]
    assert list(sw["results"]) == ["allgather/none", "allgather/fp32"]
    assert sw["ratio"] > 1  # a ratio, not an absolute time: the machine may be loaded
    # The compared results are the lab's finding, not empty dicts: bf16 allgather ranks differ, an fp32 router agrees.
    assert sw["results"]["allgather/none"]["cross_rank"]["mismatch_frac"] > 0
    assert sw["results"]["allgather/fp32"]["cross_rank"]["bitwise_equal"]
    assert quick["ready"]["cluster_median_s"] > 0 and quick["ready"]["fresh_median_s"] > 0


@pytest.mark.cluster
def test_fingerprints_move_under_one_percent_of_a_seed_output(quick):
    b = quick["bytes"]["seed_shape"]
    assert b["shape"] == [1024, 4096] and b["dtype"] == "bf16" and b["world"] == 4
    assert b["full_bytes"] == 4 * 1024 * 4096 * 2
    assert 0 < b["fingerprint_bytes"] < 0.01 * b["full_bytes"] and b["pct"] < 1


@pytest.mark.cluster
def test_record_carries_machine_targets_and_formats(quick):
    m = quick["machine"]
    assert m["cores"] and m["torch"] and m["megatron_core"] and m["python"] and m["date"]
    assert {t["name"] for t in quick["targets"]} == set(bench.TARGETS)
    assert all((t["reason"] is None) == t["met"] for t in quick["targets"])  # a missed target says why
    assert set(quick["capture"]["forward_ms"]) == {"plain", "fingerprint", "capture", "capture_fingerprints"}
    assert len(quick["memory"]["per_rank"]) == 4 and quick["memory"]["max_rss_bytes"] > 0
    json.dumps(quick)
    table = bench_cli.format_table(quick)
    assert "| sweep of 2 configs, results equal: yes |" in table
    assert "[1024 x 4096] bf16" in table and "load average" in table


def test_bad_input_is_refused_before_anything_starts(capsys):
    with pytest.raises(ValueError, match=r"repeats \(0\) must be a positive integer"):
        bench.run(repeats=0)
    from moe_lab import cli

    with pytest.raises(SystemExit) as e:  # refused by the flag's own type now (cli.argtypes), before bench.run
        cli.main(["bench", "--repeats", "0"])
    assert e.value.code == 2 and "moe-lab bench: error: argument --repeats: 0 must be >= 1" in capsys.readouterr().err
