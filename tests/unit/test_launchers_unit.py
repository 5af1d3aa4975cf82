"""Launchers without a cluster: rank / local-rank assignment from engines' nodes, GPU choice per engine, the
launcher fields of ClusterConfig and their checks against ipyparallel's own launcher classes, profile wiring."""

import shutil

import pytest

from moe_lab import profiles
from moe_lab.controller.launchers import assign_ranks, launcher_settings, profile_parent
from moe_lab.controller.placement import default_config, from_settings
from moe_lab.config import LAUNCHERS, ClusterConfig
from moe_lab.engine.dist import gpu_index

# ---------------------------------------------------------------------------------------------- ranks from nodes


def test_ranks_are_contiguous_per_node_and_the_lowest_engine_is_rank_0():
    """Engines registered interleaved across two nodes (as a batch system may start them): ranks of one node are
    contiguous, engine 0's node comes first even though its name sorts last, ids ascend within a node."""
    engines = [(0, "node-b"), (1, "node-a"), (2, "node-b"), (3, "node-a"), (4, "node-b"), (5, "node-a")]
    placed = assign_ranks(engines)
    assert [p["rank"] for p in placed] == [0, 1, 2, 3, 4, 5]
    assert [(p["engine"], p["node"]) for p in placed] == [
        (0, "node-b"), (2, "node-b"), (4, "node-b"), (1, "node-a"), (3, "node-a"), (5, "node-a")]
    assert [p["local_rank"] for p in placed] == [0, 1, 2, 0, 1, 2]
    assert {p["local_world"] for p in placed} == {3}


def test_ranks_follow_mpi_ranks_with_by_slot_mapping():
    """mpiexec engines take their MPI rank as id; with by-slot mapping (ranks 0-3 on the first host) the ranks
    here are the MPI ranks and the local ranks the MPI local ranks."""
    engines = [(i, "gpu-a" if i < 4 else "gpu-b") for i in range(8)]
    placed = assign_ranks(engines)
    assert [p["engine"] for p in placed] == list(range(8))
    assert [p["local_rank"] for p in placed] == [0, 1, 2, 3, 0, 1, 2, 3]


def test_uneven_nodes_and_input_order_do_not_matter():
    engines = [(7, "z"), (3, "y"), (5, "x"), (4, "y"), (9, "x")]
    placed = assign_ranks(engines)
    assert placed == assign_ranks(list(reversed(engines)))
    assert [(p["engine"], p["local_rank"], p["local_world"]) for p in placed] == [
        (3, 0, 2), (4, 1, 2), (5, 0, 2), (9, 1, 2), (7, 0, 1)]
    assert assign_ranks([]) == []


def test_one_node_keeps_engine_id_order():
    """On one machine (the local launcher) the mapping is what it always was: sorted ids, local rank = rank."""
    placed = assign_ranks([(12, "vm"), (10, "vm"), (11, "vm"), (13, "vm")])
    assert [p["engine"] for p in placed] == [10, 11, 12, 13]
    assert [p["local_rank"] for p in placed] == [0, 1, 2, 3]


# ---------------------------------------------------------------------------------------------- GPU per engine


@pytest.mark.parametrize("kw, expected", [
    (dict(rank=5, local_rank=1, local_world=4, n_gpu=8), 1),   # a node with a GPU per engine: its local rank
    (dict(rank=5, local_rank=3, local_world=4, n_gpu=1), 0),   # srun --gpus-per-task=1: each engine sees its own
    (dict(rank=5, local_rank=None, local_world=None, n_gpu=4), 1),  # old call (no local rank): rank % GPUs
])
def test_gpu_index(kw, expected):
    assert gpu_index(**kw) == expected


@pytest.mark.parametrize("kw, needle", [
    (dict(rank=2, local_rank=2, local_world=4, n_gpu=2), "4 engines run on"),
    (dict(rank=0, local_rank=0, local_world=1, n_gpu=0), "torch sees no GPU"),
])
def test_gpu_index_refuses_more_engines_than_gpus_on_a_node(kw, needle):
    with pytest.raises(RuntimeError, match=needle):
        gpu_index(**kw)


# ---------------------------------------------------------------------------------------------- config


def test_launcher_defaults():
    c = ClusterConfig()
    assert c.launcher == "local" and c.launcher_options == {} and c.profile_root == ""
    assert LAUNCHERS == ("local", "mpi", "slurm", "ssh")


@pytest.mark.parametrize("kwargs, needles", [
    (dict(launcher="foo"), ["launcher ('foo') must be one of 'local', 'mpi', 'slurm', 'ssh'"]),
    (dict(launcher="MPI"), ["launcher ('MPI')"]),
    (dict(launcher_options=["mpi_args"]), ["launcher_options (['mpi_args']) must be a dict"]),
    (dict(launcher_options={1: "x"}), ["launcher_options ({1: 'x'})"]),
    (dict(profile_root=3), ["profile_root (3)"]),
])
def test_launcher_bad_input_names_field_and_value(kwargs, needles):
    with pytest.raises(ValueError) as exc:
        ClusterConfig(**kwargs)
    for needle in needles:
        assert needle in str(exc.value)


def test_launcher_options_are_copied_and_replace_keeps_them():
    opts = {"mpi_args": ["--oversubscribe"]}
    c = ClusterConfig(launcher="mpi", launcher_options=opts)
    opts["mpi_args"].append("--bogus")
    assert c.launcher_options == {"mpi_args": ["--oversubscribe"]}
    assert c.replace(timeout_s=5).launcher_options == c.launcher_options
    hash(c)  # still hashable: the options dict is left out of the hash


def test_default_config_needs_device_and_engines_for_other_machines():
    with pytest.raises(ValueError, match=r"launcher \('slurm'\) starts engines on other machines: give device"):
        default_config(engines=16, launcher="slurm")
    with pytest.raises(ValueError, match="give device"):
        default_config(device="cuda", launcher="ssh")
    c = default_config(device="cuda", engines=16, launcher="slurm")  # no GPU needed here: the nodes check theirs
    assert (c.device, c.engines, c.launcher) == ("cuda", 16, "slurm")


# ---------------------------------------------------------------------------------------------- ipyparallel settings


def test_local_launcher_settings():
    kw = launcher_settings(ClusterConfig())
    assert kw["engines"] == "local" and "controller_ip" not in kw and dict(kw["config"]) == {}


def test_options_go_to_the_engine_launcher_class_or_the_named_class():
    if not shutil.which("ssh"):
        pytest.skip("no ssh client on PATH")
    cfg = ClusterConfig(launcher="ssh", engines=3, launcher_options={
        "engines": {"gpu-a": 2, "gpu-b": {"n": 1}}, "remote_python": "/opt/py/bin/python3",
        "Cluster.controller_location": "login-1"})
    kw = launcher_settings(cfg)
    assert kw["engines"] == "ssh" and kw["controller_ip"] == "*"
    assert kw["config"].SSHEngineSetLauncher.remote_python == "/opt/py/bin/python3"
    assert kw["config"].Cluster.controller_location == "login-1"


def test_a_given_controller_ip_is_kept():
    cfg = ClusterConfig(launcher="local", launcher_options={"Cluster.controller_ip": "10.1.2.3", "delay": 0.2})
    kw = launcher_settings(cfg)
    assert "controller_ip" not in kw and kw["config"].Cluster.controller_ip == "10.1.2.3"
    assert kw["config"].LocalEngineSetLauncher.delay == 0.2


@pytest.mark.parametrize("options, needle", [
    ({"mpi_arg": ["-x"]}, "launcher_options['mpi_arg']: LocalEngineSetLauncher has no setting 'mpi_arg'"),
    ({"Cluster.controler_ip": "*"}, "Cluster has no setting 'controler_ip'"),
    ({"IPEngine.use_mpi": False}, "'IPEngine' is neither ipyparallel's Cluster nor one of its launcher classes"),
])
def test_misspelt_options_are_refused_naming_the_class(options, needle):
    with pytest.raises(ValueError) as exc:
        launcher_settings(ClusterConfig(launcher_options=options))
    assert needle in str(exc.value)


def test_missing_launcher_commands_are_named(monkeypatch):
    monkeypatch.setenv("PATH", "/nonexistent")
    for launcher, cmd in (("mpi", "mpiexec"), ("slurm", "sbatch"), ("ssh", "ssh")):
        with pytest.raises(ValueError, match=f"launcher \\('{launcher}'\\) runs '{cmd}', which is not on PATH"):
            launcher_settings(ClusterConfig(launcher=launcher, engines=2))


@pytest.mark.parametrize("hosts, needle", [
    (None, "needs launcher_options['engines'] = {host: engines on it}"),
    ({"a": 1}, "places 1 engines on 1 host(s), but engines is 2"),
    ({"a": 0, "b": 2}, "launcher_options['engines']['a'] (0) must be a positive number"),
])
def test_ssh_hosts_must_place_every_engine(hosts, needle, monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda cmd: "/usr/bin/" + cmd)
    opts = {} if hosts is None else {"engines": hosts}
    with pytest.raises(ValueError) as exc:
        launcher_settings(ClusterConfig(launcher="ssh", engines=2, launcher_options=opts))
    assert needle in str(exc.value)


def test_profile_parent(tmp_path, monkeypatch):
    monkeypatch.setenv("HOME", str(tmp_path))
    assert profile_parent(ClusterConfig()) is None  # the temp dir, as always
    assert profile_parent(ClusterConfig(launcher="slurm")) == str(tmp_path / ".moe_lab" / "ipp")
    assert (tmp_path / ".moe_lab" / "ipp").is_dir()
    assert profile_parent(ClusterConfig(profile_root=str(tmp_path / "shared"))) == str(tmp_path / "shared")


# ---------------------------------------------------------------------------------------------- profiles (moe-lab run)


def test_profile_carries_the_launcher_to_the_cluster_config(monkeypatch):
    monkeypatch.setattr(shutil, "which", lambda cmd: "/usr/bin/" + cmd)
    params = profiles.load("cpu", {"launcher": "slurm", "engines": 8,
                                   "launcher_options": {"timelimit": "01:00:00", "queue": "gpu"}})
    ccfg = from_settings(params.cluster)
    assert (ccfg.launcher, ccfg.engines, ccfg.launcher_options["queue"]) == ("slurm", 8, "gpu")
    assert ccfg.start_timeout_s == 120  # the default; a job that queues needs more:
    assert from_settings(profiles.load("cpu", {"start_timeout_s": 1800}).cluster).start_timeout_s == 1800


@pytest.mark.parametrize("overrides, needle", [
    ({"launcher": "pbs"}, "launcher ('pbs') must be one of"),
    ({"launcher_options": ["x"]}, "launcher_options (['x']) must be a JSON object"),
    ({"start_timeout_s": 0}, "start_timeout_s (0) must be a positive number of seconds"),
])
def test_profile_bad_launcher(overrides, needle):
    with pytest.raises(ValueError) as exc:
        profiles.load("cpu", overrides)
    assert needle in str(exc.value)


def test_profile_bad_launcher_option_is_refused_before_any_notebook():
    params = profiles.load("cpu", {"launcher_options": {"mpi_arg": []}})
    with pytest.raises(ValueError, match="has no setting 'mpi_arg'"):
        from_settings(params.cluster)


def test_launcher_ranks_order_the_engines_when_every_engine_has_one():
    """After a restart under mpiexec the hub still holds ids 0 and 1, so MPI rank 1 may register as engine 2 and
    MPI rank 0 as engine 3: the MPI ranks decide, not the ids."""
    placed = assign_ranks([(2, "vm"), (3, "vm")], {2: 1, 3: 0})
    assert [p["engine"] for p in placed] == [3, 2] and [p["local_rank"] for p in placed] == [0, 1]
    # Two nodes: the node of MPI rank 0 first, whatever its name and engine id.
    placed = assign_ranks([(10, "a"), (11, "b"), (12, "a"), (13, "b")], {10: 2, 11: 0, 12: 3, 13: 1})
    assert [p["engine"] for p in placed] == [11, 13, 10, 12]
    # Not distinct (a local cluster inside one Slurm job: every engine inherits SLURM_PROCID=0) or missing: ids.
    assert [p["engine"] for p in assign_ranks([(5, "vm"), (4, "vm")], {5: 0, 4: 0})] == [4, 5]
    assert [p["engine"] for p in assign_ranks([(5, "vm"), (4, "vm")], {5: 0})] == [4, 5]


def test_the_hub_pings_every_250_ms_with_ipyparallels_30_s_allowance_and_a_users_own_args_replace_ours(monkeypatch):
    from moe_lab.controller import ports
    from moe_lab.controller.launchers import HEARTBEAT_ALLOWANCE_S, HEARTBEAT_MS, controller_settings

    monkeypatch.setattr(ports, "reserve", lambda *a, **k: None)  # the ports: the next test

    def args(cfg):
        return controller_settings(launcher_settings(cfg), cfg)["controller_args"]

    ours = args(ClusterConfig(device="cpu", engines=2))
    assert ours == [f"--HeartMonitor.period={HEARTBEAT_MS}", "--HeartMonitor.max_heartmonitor_misses=120"]
    assert HEARTBEAT_MS * 120 == HEARTBEAT_ALLOWANCE_S * 1000 == 3000 * 10  # ipyparallel's 10 missed 3 s pings
    mine = ["--HeartMonitor.period=1000"]
    cfg = ClusterConfig(device="cpu", engines=2, launcher_options={"Cluster.controller_args": mine})
    # the controller refuses a setting given twice: the user's replaces ours, the other of ours stays
    assert args(cfg) == ours[1:] + mine
    other = ["--IPController.ip=127.0.0.1"]
    cfg = ClusterConfig(device="cpu", engines=2, launcher_options={"Cluster.controller_args": other})
    assert args(cfg) == ours + other


def test_local_engines_get_reserved_controller_ports_unless_the_user_sets_ports(monkeypatch):
    from moe_lab.controller import ports
    from moe_lab.controller.launchers import controller_settings

    monkeypatch.setattr(ports, "reserve", lambda *a, **k: [20001, 20002])

    def args(cfg):
        return controller_settings(launcher_settings(cfg), cfg)["controller_args"]

    assert args(ClusterConfig(device="cpu", engines=2))[-1] == "--IPController.ports=20001,20002"
    mine = ["--IPController.ports=30000-30030"]
    cfg = ClusterConfig(device="cpu", engines=2, launcher_options={"Cluster.controller_args": mine})
    assert [a for a in args(cfg) if "ports" in a] == mine
    monkeypatch.setattr(ports, "reserve", lambda *a, **k: None)  # no range below the ephemeral one: ipyparallel's
    assert not [a for a in args(ClusterConfig(device="cpu", engines=2)) if "ports" in a]
