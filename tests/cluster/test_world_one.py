"""World 1 is a valid cluster: one CPU engine. Cross-rank comparisons are not applicable and say why; reruns and
truncation are measured; the CLI and every experiment run through."""

import json
import subprocess
import sys

import pytest

from moe_lab import profiles
from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.controller.cluster import Cluster
from moe_lab.questions.localise import experiment as localise
from moe_lab.experiments import probe, protocol
from moe_lab.questions.reproduce import experiment as reproduce
from moe_lab.questions.truncation import experiment as truncation, verdict as truncation_verdict

pytestmark = pytest.mark.cluster


@pytest.fixture(scope="module")
def one():
    with Cluster(ClusterConfig(device="cpu", engines=1, timeout_s=120)) as c:
        yield c


def test_probe_at_world_one(one):
    rec = probe.run(one, MoEConfig(), trials=2, detail=True)
    assert rec["world"] == 1 and rec["ep"] == 1
    assert rec["cross_rank"] == {"applicable": False, "reason": "world size 1: there is no other rank to compare with",
                                 "trials": 2}
    assert rec["rerun"]["bitwise_equal"] and rec["rerun"]["trials"] == 2 and rec["truncation"]["numel"] == 90 * 256
    assert "not applicable (world size 1" in probe.headline(rec)
    assert reproduce.attribution(rec) == "n/a"
    assert "nothing to compare across ranks" in reproduce.verdict([rec])


def test_localise_and_truncation_at_world_one(one):
    P = profiles.load("cpu", {"engines": 1, "dispatchers": ["allgather"], "trials": 1})
    recs = protocol.run(localise, P, cluster=one)
    cases = [r for r in recs if r["kind"] == "case"]
    assert len(cases) == 3 and all(c["first_divergent_stage"] is None and not c["cross_rank_applicable"] for c in cases)
    assert "one rank — no stage compared" in localise.verdict(recs)
    assert "[N/A]" in localise.verdict(recs) and "[PASS]" not in localise.verdict(recs)  # nothing compared: no PASS
    cases = truncation.cases(P, emulations=["splitk_bf16"], remedies=["tiled_experts"], rounds=2, ms=[64, 128])
    recs = protocol.run(truncation, P, cluster=one, cases=cases)
    by = {r["remedy"]: r for r in recs if r["kind"] == "case"}
    assert set(by) == {"none", "tiled_experts"} and all(r["world"] == 1 for r in recs)
    assert by["tiled_experts"]["truncation"]["bitwise_equal"] and by["none"]["truncation"]["trials"] == 1
    assert [r["kind"] for r in recs].count("kernel") == 6 * 2 * 2  # states x linears x M
    assert truncation_verdict.verdict(recs).startswith("megatron-core")


def test_cli_probe_with_one_engine_and_zero_engines():
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "probe", "--device", "cpu", "--engines", "1", "--json",
                        "--trials", "1"], capture_output=True, text=True, timeout=300)
    assert r.returncode == 0, r.stderr[-2000:]
    rec = json.loads(r.stdout.strip().splitlines()[0])
    assert rec["world"] == 1 and rec["cross_rank"]["applicable"] is False and rec["rerun"]["bitwise_equal"]
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "probe", "--engines", "0"], capture_output=True,
                       text=True, timeout=60)
    assert r.returncode == 2 and r.stderr.strip().splitlines() == [
        "moe-lab probe: error: argument --engines: 0 must be >= 1 (see moe-lab probe -h)"]
