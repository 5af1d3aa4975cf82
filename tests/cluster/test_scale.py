"""Scale plan against the real layer on 4 gloo engines (EP=4): parameter bytes exactly, forward peaks closely."""

import pytest

from moe_lab.cli import scale as scale_cli
from moe_lab.tools import scale_measure
from moe_lab.config import MoEConfig

pytestmark = pytest.mark.cluster

# Large enough that the [rows x hidden] tensors dominate the router's small ones; 16 MiB of experts per engine.
LAYER = MoEConfig(hidden=1024, num_experts=8, topk=4, ffn_hidden=2048, seq_len=512)


@pytest.mark.parametrize("dispatcher,router_dtype,deterministic", [
    ("allgather", "none", False), ("allgather", "fp32", True), ("alltoall", "none", False), ("alltoall", "fp64", False),
])
def test_calculation_matches_the_real_layer(cpu_cluster, dispatcher, router_dtype, deterministic):
    cfg = LAYER.replace(dispatcher=dispatcher, router_dtype=router_dtype, deterministic=deterministic)
    per_rank = cpu_cluster.run(scale_measure.measure_layer, cfg.asdict(), cut=90, what="scale measure_layer")
    rec = scale_measure.compare_measured(cfg, 4, per_rank, device="cpu")
    # parameters: exactly what the calculation says, on every rank
    assert rec["params_equal"], [(r["param_bytes"], r["param_bytes_calc"]) for r in rec["ranks"]]
    assert all(r["param_bytes"] == 8 * 1024 * 2 + 2 * 2 * 2048 * 1024 * 2 for r in rec["ranks"])
    assert all(r["buffer_bytes"] == 0 for r in rec["ranks"])
    # the rows fed into the calculation: every token's topk rows, seen by EP ranks (same tokens on every rank)
    for key in ("counts", "counts_truncation"):
        assert sum(sum(r[key]) for r in rec["ranks"]) == 4 * cfg.seq_len * cfg.topk, key
        assert all(len(r[key]) == cfg.num_experts // 4 for r in rec["ranks"])
    # the truncated input: its zero tokens all go to the same topk experts, so one rank pair gets ~EP x the rows
    rows_t = sorted(sum(r["counts_truncation"]) for r in rec["ranks"])
    assert rows_t[-1] > 3 * rows_t[0]
    # forward peaks (torch's CPU allocator, with the measured rows fed in). What the forward's own thread allocates
    # is the same on every run: every tensor the calculation names is there — at least 95 % of it on the busiest
    # rank of each input, 85 % on the others (router-sized tensors the timeline rounds; read 0.955-1.000 on the CI
    # machine). Above the calculation there may be more than it names, by what no load or timing decides but the
    # CPU does (the GEMM's own workspace: oneDNN on AVX-512/AMX) and, in the whole process's peak, by what gloo's
    # worker threads allocate meanwhile (allgather: 4 MiB) if it overlaps the peak, which timing decides: reported,
    # held to a sanity band only (the busiest rank's whole-process ratio read 1.065-1.072 on a loaded AMX host)
    for key in ("forward", "forward_truncation"):
        own = [r[key + "_own"] / r[key + "_calc"] for r in rec["ranks"]]
        ratios = [r[key + "_ratio"] for r in rec["ranks"]]
        print(key, "own thread / calculated:", [round(x, 3) for x in own], "whole process / calculated:",
              [round(x, 3) for x in ratios], "other threads' bytes:", [r[key + "_other_threads"] for r in rec["ranks"]])
        busiest = max(range(len(own)), key=lambda i: rec["ranks"][i][key + "_calc"])
        assert own[busiest] >= 0.95 and all(x >= 0.85 for x in own), (key, own)
        assert all(0.5 <= x <= 2.0 for x in own + ratios), (key, own, ratios)
    print(scale_cli.format_measured([rec]))
