"""`moe-lab probe` end to end, and bad input rejected in one line before any engine starts."""

import json

import pytest
from cli_run import cli, refused_before_engines


@pytest.mark.parametrize("args, message", [
    (["--experts", "6", "--engines", "4"], "num_experts (6) must be divisible by ep (4)"),
    (["--topk", "9", "--experts", "8"], "topk (9) must be <= num_experts (8)"),
    (["--device", "cuda"], "device ('cuda') needs a GPU"),
    (["--cut", "200", "--seq", "128"], "--cut (200) must be an integer in 1..seq_len-1 (127)"),
    (["--hidden", "0"], "argument --hidden: 0 must be >= 1"),
    (["--megatron", "0.99.0"], "not installed"),
])
def test_bad_input_is_one_line_before_engines(args, message):
    refused_before_engines(args, message)


@pytest.mark.parametrize("args", [["--dispatcher", "flex"], ["--router-dtype", "bf16"]])
def test_unknown_choices_are_refused_by_the_parser(args):
    r = cli("probe", *args, timeout=60)
    assert r.returncode == 2 and "must be one of" in r.stderr


@pytest.mark.cluster
def test_probe_prints_one_json_line_per_router_dtype():
    r = cli("probe", "--device", "cpu", "--engines", "4", "--dispatcher", "allgather",
             "--router-dtype", "none,fp32", "--json", "--timeout", "180")
    assert r.returncode == 0, r.stderr[-3000:]
    lines = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert [rec["router_dtype"] for rec in lines] == ["none", "fp32"]
    for rec in lines:
        for key in ("torch", "megatron_core", "nccl", "device", "backend", "world", "config"):
            assert key in rec
        for cmp in ("cross_rank", "rerun", "truncation"):
            assert {"mismatch_frac", "max_abs", "max_ulp", "allclose_1e3"} <= set(rec[cmp])
    none, fp32 = lines
    assert none["cross_rank"]["mismatch_frac"] > 0 and fp32["cross_rank"]["mismatch_frac"] == 0


@pytest.mark.cluster
def test_probe_summary_is_the_findings():
    """Without --json, probe ends with notebook 01's findings over its records (EP=2: a + b = b + a)."""
    r = cli("probe", "--device", "cpu", "--engines", "2", "--dispatcher", "allgather", "--router-dtype", "none",
             "--timeout", "180")
    assert r.returncode == 0, r.stderr[-3000:]
    assert "[PASS] allgather, router none: ranks bitwise equal" in r.stderr and "Verdict: [PASS]" in r.stderr
