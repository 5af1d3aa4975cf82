"""Engines started by ipyparallel's MPI launcher (Open MPI's mpiexec, on this one machine, CPU/gloo): started by
mpiexec, ranks and local ranks from their node, a real MoE forward, a restart, nothing left after stop; and the
same through `moe-lab probe --launcher mpi`. Slurm and SSH cannot run here (no cluster): their bad input is checked.
"""

import json
import os
import shutil
import subprocess
import time

import pytest
from cli_run import cli, refused_before_engines

from moe_lab.controller.cluster import Cluster
from moe_lab.controller.processes import cluster_processes
from moe_lab.engine import dist
from moe_lab.experiments import probe
from moe_lab.config import ClusterConfig, MoEConfig

pytestmark = pytest.mark.cluster

SMALL = MoEConfig(hidden=32, num_experts=4, topk=2, ffn_hidden=64, seq_len=16)


def _mpi_options() -> dict:
    """What a user gives on this machine: Open MPI refuses root unless told, and may count fewer slots than engines."""
    if not shutil.which("mpiexec"):
        pytest.skip("mpiexec not on PATH: apt-get install openmpi-bin (.ci/run installs it)")
    try:
        import mpi4py  # noqa: F401 - `ipengine --mpi` imports it
    except ImportError:
        pytest.skip("mpi4py not installed: pip install mpi4py (.ci/run installs it)")
    opts: dict = {}
    version = subprocess.run(["mpiexec", "--version"], capture_output=True, text=True, timeout=30).stdout
    if "Open MPI" in version or "OpenRTE" in version:
        opts["mpi_args"] = ["--oversubscribe"]
        if os.geteuid() == 0:
            opts["environment"] = {"OMPI_ALLOW_RUN_AS_ROOT": "1", "OMPI_ALLOW_RUN_AS_ROOT_CONFIRM": "1"}
    return opts


def _alive(pid: int) -> bool:
    try:
        with open(f"/proc/{pid}/stat") as f:
            return f.read().split()[2] != "Z"
    except FileNotFoundError:
        return False


def test_mpi_launcher_ranks_forward_restart_and_clean_stop(tmp_path):
    opts = _mpi_options()
    t0 = time.monotonic()
    cfg = ClusterConfig(device="cpu", engines=2, launcher="mpi", launcher_options=opts, timeout_s=120,
                        profile_root=str(tmp_path))
    with Cluster(cfg) as c:
        ready_s = time.monotonic() - t0
        mpiexec = next(iter(c.state.ipp.engines.values()))
        assert mpiexec.args[0] == "mpiexec" and "--mpi" in mpiexec.args  # ipyparallel's own MPIEngineSetLauncher
        mpiexec_pid = mpiexec.pid

        # Started by mpiexec: every engine sees its MPI rank; engine id = MPI rank (ipengine --mpi) = our rank.
        env = c.run(dist.launcher_env)
        assert [e["OMPI_COMM_WORLD_RANK"] for e in env] == ["0", "1"]
        assert [e["OMPI_COMM_WORLD_SIZE"] for e in env] == ["2", "2"]
        place = c.placement
        assert [p["rank"] for p in place] == [0, 1] and c.engine_ids == [0, 1]
        assert [p["local_rank"] for p in place] == [0, 1] and {p["local_world"] for p in place} == {2}
        assert len({p["node"] for p in place}) == 1 and c.rendezvous[0] == "127.0.0.1"
        assert [i["local_rank"] for i in c.info] == [0, 1] and [i["rank"] for i in c.info] == [0, 1]
        assert c.profile_dir.startswith(str(tmp_path))

        rec = probe.run(c, SMALL, cut=8, repeats=0)
        assert rec["world"] == 2 and rec["ep"] == 2 and rec["backend"] == "gloo"
        assert rec["cross_rank"]["numel"] == 16 * 32 and rec["rerun"]["bitwise_equal"]

        # A restart goes through mpiexec again; the ranks are mapped again.
        t1 = time.monotonic()
        old_pids = [p["pid"] for p in place]
        c.restart_engines(env=(("MOE_LAB_TEST", "restarted"),))
        restart_s = time.monotonic() - t1
        assert [e["OMPI_COMM_WORLD_RANK"] for e in c.run(dist.launcher_env)] == ["0", "1"]
        assert [p["local_rank"] for p in c.placement] == [0, 1]
        assert not any(_alive(p) for p in old_pids)
        assert c.run(os.getenv, "MOE_LAB_TEST") == ["restarted", "restarted"]
        assert probe.run(c, SMALL, cut=8, repeats=0)["rerun"]["bitwise_equal"]
        pids = [p["pid"] for p in c.placement]
        profile = c.profile_dir
        new_mpiexec_pid = next(iter(c.state.ipp.engines.values())).pid

    deadline = time.monotonic() + 15
    while time.monotonic() < deadline and (cluster_processes(profile) or any(map(_alive, pids))):
        time.sleep(0.2)
    assert cluster_processes(profile) == [] and not os.path.exists(profile)
    assert not any(_alive(p) for p in pids + [mpiexec_pid, new_mpiexec_pid])
    print(f"mpi launcher: ready {ready_s:.1f} s, restart {restart_s:.1f} s, total {time.monotonic() - t0:.1f} s")



def test_probe_with_the_mpi_launcher():
    opts = _mpi_options()
    flags = [a for k, v in opts.items() for a in ("--launcher-option", f"{k}={json.dumps(v)}")]
    r = cli("probe", "--device", "cpu", "--engines", "2", "--launcher", "mpi", *flags, "--hidden", "32",
             "--experts", "4", "--topk", "2", "--ffn", "64", "--seq", "16", "--cut", "8", "--json", "--timeout", "120")
    assert r.returncode == 0, r.stderr[-3000:]
    (rec,) = [json.loads(line) for line in r.stdout.strip().splitlines()]
    assert rec["world"] == 2 and rec["cross_rank"]["numel"] == 16 * 32 and rec["truncation"]["bitwise_equal"]


@pytest.mark.parametrize("args, message", [
    (["--launcher", "mpi"], "launcher ('mpi') starts engines on other machines: give device"),
    (["--launcher", "mpi", "--device", "cpu", "--engines", "2", "--launcher-option", "mpi_arg=[]"],
     "MPIEngineSetLauncher has no setting 'mpi_arg'"),
    (["--launcher", "ssh", "--device", "cpu", "--engines", "2", "--launcher-option", 'engines={"gpu-a": 1}'],
     "places 1 engines on 1 host(s), but engines is 2"),
    (["--launcher-option", "mpi_args"], "expected key=value"),
])
def test_bad_launcher_input_is_one_line_before_engines(args, message):
    if "ssh" in args and not shutil.which("ssh"):
        pytest.skip("no ssh client on PATH")
    if "mpi" in args and not shutil.which("mpiexec") and "mpi_arg=[]" in args:
        pytest.skip("mpiexec not on PATH")
    refused_before_engines(args, message)


def test_slurm_without_sbatch_is_refused_before_anything_starts():
    if shutil.which("sbatch"):
        pytest.skip("sbatch is on PATH: this is a Slurm node")
    r = cli("probe", "--launcher", "slurm", "--device", "cuda", "--engines", "16", timeout=60)
    assert r.returncode == 2 and "runs 'sbatch', which is not on PATH" in r.stderr, r.stderr


@pytest.mark.parametrize("args, message", [
    (["--launcher", "slurm", "--launcher-option", 'queue="gpu"', "-p", "engines=8"], "runs 'sbatch', which is not on PATH"),
    (["--launcher-option", "mpi_arg=[]"], "LocalEngineSetLauncher has no setting 'mpi_arg'"),
])
def test_run_passes_the_launcher_to_the_notebooks_cluster_and_checks_it_first(args, message, tmp_path):
    """`moe-lab run --launcher ...` reaches the profile's cluster config (what every notebook starts), checked before
    any notebook runs."""
    if "slurm" in args and shutil.which("sbatch"):
        pytest.skip("sbatch is on PATH: this is a Slurm node")
    r = cli("run", "--profile", "cpu", "--only", "01", "--out", str(tmp_path / "out"), *args, timeout=60)
    assert r.returncode == 2 and message in r.stderr, r.stderr
    assert not (tmp_path / "out").exists()  # nothing ran
