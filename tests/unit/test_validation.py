"""One validation of the whole run before anything starts: every rule of a value, where it lives (the config's
dataclasses, the question's typed parameters, the flag's type) and that `moe-lab run` / `moe-lab probe` apply them all
before a kernel, an engine or torch is started — one line on stderr, exit 2. Each rule has its control: a valid value
passes (a check that refused everything would pass the refusals). The property tests feed every `-p` key of the
profile schema (the common keys and every registered question's typed parameters) and every probe flag values of the
wrong type, non-finite, out of range or empty, with the launch stubbed to fail the test if it is reached."""

from __future__ import annotations

import json
import math
import os
import subprocess
import sys
from pathlib import Path

import pytest
from hypothesis import HealthCheck, given, settings, strategies as st

from moe_lab import cli, config as cfgmod, profiles
from moe_lab.config import MAX_DIM, MAX_RANKS_PER_GPU, MAX_SEED, ClusterConfig, MoEConfig, seconds_ok
from moe_lab.questions import params_types
from moe_lab.run_config import CLUSTER_KEYS, MOE_KEYS, RUN_KEYS

ROOT = Path(__file__).resolve().parents[2]


class Launched(Exception):
    """What the stubbed launch raises: the command got past its validation."""


@pytest.fixture
def no_launch(monkeypatch):
    """`run` and `probe` with their launch stubbed: the runner's run_all records its call (and returns 0) and a
    Cluster's start/launch raises `Launched`; returns the recorded run_all calls."""
    from moe_lab.controller import cluster
    from moe_lab.reporting import runner

    calls = []

    def run_all(**kw):
        calls.append(kw)
        return 0

    def launch(self, *a, **k):
        raise Launched(self.config)

    monkeypatch.setattr(runner, "run_all", run_all)
    monkeypatch.setattr(cluster.Cluster, "launch", launch)
    monkeypatch.setattr(cluster.Cluster, "start", launch)
    return calls


def _main(argv, capsys) -> tuple[int, str]:
    """cli.main in-process → (exit code, stderr); argparse's own exit is the same contract."""
    try:
        rc = cli.main(argv)
    except SystemExit as e:
        rc = e.code
    return rc, capsys.readouterr().err.strip()


def _refused(argv, capsys, said: str = "") -> str:
    rc, err = _main(argv, capsys)
    assert rc == 2, (argv, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, err
    assert said in err, (said, err)
    return err


# ------------------------------------------------------------------------------------------------- the rules


def test_the_timeout_rule_is_one_second_to_a_week():
    for bad in (1e-300, 0.5, 0, -1, math.nan, math.inf, True, "60", 604800.5):
        assert not seconds_ok(bad), bad
    for good in (1, 1.0, 90.5, 604800):
        assert seconds_ok(good), good
    with pytest.raises(ValueError, match=r"timeout_s \(1e-300\) must be a number of seconds, finite, >= 1"):
        ClusterConfig(timeout_s=1e-300)
    assert ClusterConfig(timeout_s=1, start_timeout_s=604800).timeout_s == 1


@pytest.mark.parametrize("field, bad, good", [
    ("hidden", MAX_DIM + 1, MAX_DIM), ("seq_len", 10**20, 4096), ("ffn_hidden", 0, 1),
    ("num_experts", MAX_DIM + 1, 64), ("seed", -1, 0), ("seed", MAX_SEED + 1, MAX_SEED),
    ("shared_ffn", MAX_DIM + 1, 0), ("num_groups", -1, 0),
])
def test_layer_sizes_and_seeds_have_bounds(field, bad, good):
    with pytest.raises(ValueError, match=rf"^{field} \({bad}\) must be"):
        MoEConfig(**{field: bad})
    assert getattr(MoEConfig(**{field: good}), field) == good


def test_cpu_engines_are_bounded_by_the_machine_s_cpus(monkeypatch):
    monkeypatch.setattr(cfgmod, "usable_cpus", lambda: 2)
    assert ClusterConfig(engines=8).engines == 8
    with pytest.raises(ValueError, match=r"engines \(9\) must be <= 8 on this machine's 2 CPU\(s\) \(4 CPU engines"):
        ClusterConfig(engines=9)
    # engines another launcher starts elsewhere, or GPU ranks, are not this machine's CPU engines
    assert ClusterConfig(engines=64, launcher="mpi").engines == 64
    assert ClusterConfig(device="cuda", engines=64).engines == 64


def test_ranks_per_gpu_has_a_bound():
    assert ClusterConfig(device="cuda", engines=MAX_RANKS_PER_GPU, ranks_per_gpu=MAX_RANKS_PER_GPU)
    with pytest.raises(ValueError, match=r"ranks_per_gpu \(17\) must be <= 16: 17 engines on 1 GPU\(s\)"):
        ClusterConfig(device="cuda", engines=17, ranks_per_gpu=17)


def test_more_ranks_than_gpus_is_refused_with_the_fix():
    from moe_lab.controller.launchers import check_devices

    with pytest.raises(ValueError, match=r"engines \(4\) with ranks_per_gpu \(1\) need 4 GPUs, but torch sees 1: "
                                         r"give ranks_per_gpu=4 \(virtual EP"):
        check_devices(ClusterConfig(device="cuda", engines=4), 1)
    with pytest.raises(ValueError, match=r"give at most 16 engines \(16 per GPU\)"):
        check_devices(ClusterConfig(device="cuda", engines=32, ranks_per_gpu=2), 1)
    with pytest.raises(ValueError, match="torch sees none"):
        check_devices(ClusterConfig(device="cuda", engines=1), 0)
    check_devices(ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4), 1)  # virtual EP on one GPU
    check_devices(ClusterConfig(device="cuda", engines=8), 8)
    check_devices(ClusterConfig(device="cuda", engines=16, launcher="slurm"), 0)  # the nodes check their own


def test_the_cluster_api_refuses_more_ranks_than_gpus_before_any_process(monkeypatch):
    """Cluster(ClusterConfig(device='cuda', engines=4)) on a one-GPU machine: a ValueError naming the fix, before
    the watchdog, the controller or an engine is started (the control: with ranks_per_gpu=4 it gets to the launch)."""
    from moe_lab.controller import cluster, processes

    def started(*a, **k):
        raise Launched("a process was started")

    monkeypatch.setattr(cluster, "visible_gpus", lambda: 1)
    monkeypatch.setattr(processes, "start_watchdog", started)
    with pytest.raises(ValueError, match=r"give ranks_per_gpu=4 \(virtual EP"):
        cluster.Cluster(ClusterConfig(device="cuda", engines=4)).start()
    with pytest.raises(Launched):
        cluster.Cluster(ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4)).start()


def test_launcher_option_values_are_checked_against_the_trait():
    from moe_lab.controller.launchers import launcher_settings

    with pytest.raises(ValueError, match=r"^launcher_options\['Cluster.controller_ip'\] \(5\): Cluster.controller_ip "
                                         r"takes a unicode string"):
        launcher_settings(ClusterConfig(launcher_options={"Cluster.controller_ip": 5}))
    with pytest.raises(ValueError, match=r"LocalEngineSetLauncher.delay takes a float"):
        launcher_settings(ClusterConfig(launcher_options={"delay": "soon"}))
    conf = launcher_settings(ClusterConfig(launcher_options={"Cluster.controller_ip": "127.0.0.1", "delay": 1,
                                                             "environment": {"A": "1"}}))["config"]
    assert conf["Cluster"]["controller_ip"] == "127.0.0.1" and conf["LocalEngineSetLauncher"]["delay"] == 1.0


def test_flag_types():
    import argparse

    from moe_lab.cli.argtypes import count, number, whole_seconds

    assert whole_seconds("90.5") == 91 and whole_seconds("1") == 1
    for bad in ("0.5", "nan", "inf", "1e20", "x"):
        with pytest.raises(argparse.ArgumentTypeError):
            whole_seconds(bad)
    gib = number("GiB per GPU", above=0)
    assert gib("141") == 141.0
    for bad in ("-1", "0", "nan", "inf", "-inf", "x"):
        with pytest.raises(argparse.ArgumentTypeError, match="GiB per GPU"):
            gib(bad)
    assert count(2, 10)("10") == 10
    with pytest.raises(argparse.ArgumentTypeError, match="11 must be <= 10"):
        count(2, 10)("11")


def test_key_value_pairs_refuse_an_empty_key_or_value():
    import argparse

    from moe_lab.cli.options import kv

    assert kv("training.steps=5") == ("training.steps", 5) and kv("layouts=ep1;ep4") == ("layouts", "ep1;ep4")
    assert kv("timeout_s=NaN")[1] != kv("timeout_s=NaN")[1]  # JSON's NaN, refused by the profile's rule
    for bad, said in (("releases=", "is empty"), ("releases= ", "is empty"), ("=5", "the key is empty"),
                      ("trials", "expected key=value")):
        with pytest.raises(argparse.ArgumentTypeError, match=said):
            kv(bad)


def test_a_profile_path_is_resolved_where_the_caller_is(tmp_path, monkeypatch):
    (tmp_path / "my.json").write_text((ROOT / "moe_lab/profiles/cpu.json").read_text())
    monkeypatch.chdir(tmp_path)
    assert profiles.locate("my.json") == str(tmp_path / "my.json")
    assert profiles.load("my.json").where == str(tmp_path / "my.json")
    assert profiles.locate("cpu") == "cpu"


def test_a_profile_that_is_no_readable_utf8_file_is_named(tmp_path, monkeypatch):
    with pytest.raises(ValueError, match=r"is a directory"):
        profiles.locate(str(tmp_path))
    fifo = tmp_path / "fifo.json"
    os.mkfifo(fifo)
    with pytest.raises(ValueError, match=r"fifo.json is not a regular file \(a FIFO"):
        profiles.load(str(fifo))  # refused without opening it: a read would wait for a writer
    latin = tmp_path / "latin.json"
    latin.write_bytes('{"device": "cpu", "_doc": "caf\xe9"}'.encode("latin-1"))
    with pytest.raises(ValueError, match=r"latin.json is not UTF-8 text \(byte 0xe9 at offset 30\)"):
        profiles.load(str(latin))
    with pytest.raises(ValueError, match=r"nope.json: No such file or directory"):
        profiles.locate(str(tmp_path / "nope.json"))
    with pytest.raises(ValueError, match="is empty"):
        profiles.locate("")
    monkeypatch.setattr(profiles, "MAX_PROFILE_BYTES", 10)
    big = tmp_path / "big.json"
    big.write_text("{}" * 10)
    with pytest.raises(ValueError, match="a profile is a JSON file of at most"):
        profiles.load(str(big))


def test_question_settings_and_remedies_are_the_experiments_own():
    """The names the parameters check (torch-free) are the ones the experiments run."""
    from moe_lab.experiments.remedies import REMEDIES
    from moe_lab.questions.compound import experiment as compound, params as compound_params
    from moe_lab.questions.training import experiment as training, params as training_params
    from moe_lab.questions.truncation.params import REMEDY_NAMES

    assert tuple(compound.SETTINGS) == compound_params.SETTING_NAMES
    assert tuple(training.SETTINGS) == training_params.SETTING_NAMES and training.REFERENCE == "plain"
    assert REMEDIES == REMEDY_NAMES


@pytest.mark.parametrize("override, said", [
    ({"training": {"settings": ["bogus"]}}, "training.settings (('bogus',)) must be a non-empty list of distinct"),
    ({"training": {"settings": ["router fp32"]}}, "must include 'plain'"),
    ({"training": 0}, "training (0) must be a JSON object"),
    ({"training": {"steps": 10**6}}, "training.steps (1000000) must be a positive integer <= 10000"),
    ({"compound_settings": "plain,bogus"}, "compound_settings (['plain', 'bogus']) must be a list of settings"),
    ({"depth_settings": "plain,plain"}, "names a setting twice"),
    ({"truncation_remedies": "deterministic+bogus"}, "truncation_remedies entry ('deterministic+bogus')"),
    ({"truncation_remedies": "no_splitk+no_splitk"}, "each once"),
    ({"truncation_engines": [10**30]}, "must be a list of positive integers <= 16777216"),
    ({"seq_lens": [64, 10**9]}, "seq_lens ([64, 1000000000]) must be a list of at least two distinct integers in"),
    ({"trials": 10**30}, "trials (1000000000000000000000000000000) must be a positive integer <= 10000"),
    ({"scale": True}, "scale (True) must be a number in (0, 1]"),
    ({"dispatchers": "allgather,allgather"}, "names a value twice"),
    ({"megatron": 5}, "megatron (5) must be a release installed side by side"),
    ({"wheels": ""}, "wheels ('') must be a folder of wheels"),
    ({"one_gpu_engines": 17}, "one_gpu_engines (17) must be a positive integer <= 16"),
])
def test_a_bad_parameter_is_refused_when_the_profile_loads(override, said):
    with pytest.raises(ValueError) as e:
        profiles.load("cpu", override)
    assert said in str(e.value), str(e.value)


def test_the_same_parameters_valid_load():
    """The controls of the refusals above."""
    c = profiles.load("cpu", {"training": {"settings": ["plain", "router fp32"]}, "compound_settings": "plain",
                              "truncation_remedies": "none,deterministic+tiled_experts", "truncation_engines": [1, 4],
                              "seq_lens": [64, 128], "trials": 10_000, "dispatchers": "allgather"})
    assert c.question("training").settings == ("plain", "router fp32") and c.run.trials == 10_000


@pytest.mark.parametrize("override, notebook, said, others_pass", [
    ({"layouts": "ep1;ep3"}, "01", "notebook 01: layouts entry 'ep3' on 4 ranks: layout tp 1 × ep 3: world (4)",
     True),
    ({"layouts": "ep1;tp2,ep2,sp", "seq_len": 127, "cut": 90}, "01",
     "layouts entry 'tp2,ep2,sp' on 4 ranks: layout tp 2 × ep 2, sequence parallel: seq_len (127) must be divisible "
     "by tp (2)", False),
    ({"training.tokens": 15}, "06", "notebook 06: training.tokens (15) must be divisible by the world (4 ranks", True),
    ({"training.eps": [1, 8]}, "06", "training: ep8 on 4 ranks: layout tp 1 × ep 8: world (4) must be a multiple",
     True),
    ({"training.num_experts": 6}, "06", "training: ep4 on 4 ranks: layout tp 1 × ep 4: num_experts (6)", True),
    ({"training.topk": 9}, "06", "training: the layer with {'hidden': 32, 'topk': 9, 'ffn_hidden': 64} overrides: "
                                 "topk (9) must be <= num_experts (8)", True),
    ({"truncation_engines": [1, 9]}, "04", "notebook 04: truncation_engines entry 9: engines (9) must be <= 8", True),
    ({"truncation_engines": [3]}, "04", "truncation_engines entry 3: layout tp 1 × ep 3: num_experts (8)", True),
    ({"presets.models": ["mixtral-8x7b"], "num_experts": 32, "engines": 16}, "07",
     "notebook 07: presets.models entry 'mixtral-8x7b'", True),
    ({"depth_ffn_hidden": 3, "tp": 2}, "05", "notebook 05: depth_ffn_hidden (3) on 4 ranks: layout tp 2 × ep 2: "
                                             "expert ffn (3) must be divisible by etp (2)", False),
])
def test_what_a_question_needs_of_the_world_is_checked_for_the_notebooks_run(override, notebook, said, others_pass,
                                                                             monkeypatch):
    from moe_lab.questions import QUESTIONS

    monkeypatch.setattr(cfgmod, "usable_cpus", lambda: 2 if "engines" not in override else 8)
    c = profiles.load("cpu", override)
    ccfg = ClusterConfig(engines=c.cluster.engines)
    with pytest.raises(ValueError) as e:
        c.check_world(ccfg, [notebook])
    assert said in str(e.value), str(e.value)
    if others_pass:  # the control: the notebooks that do not read these keys are not refused for them
        c.check_world(ccfg, [q.number for q in QUESTIONS if q.number != notebook])


@pytest.mark.parametrize("name, ccfg", [
    ("cpu", ClusterConfig(engines=4)),
    ("gpu", ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4)),  # one GPU: virtual EP
    ("gpu", ClusterConfig(device="cuda", engines=8)),
])
def test_the_shipped_profiles_fit_the_worlds_they_are_for(name, ccfg):
    # (the releases notebook 03 compares depend on this machine's Python; the worlds do not)
    profiles.load(name, {"releases": ["installed"]}).check_world(ccfg)


def test_the_cpu_memory_bound(monkeypatch):
    from moe_lab.tools import preflight

    big = MoEConfig(hidden=100_000, ffn_hidden=100_000)
    with pytest.raises(ValueError, match=r"4 CPU engines need 303.9 GiB \(75.5 GiB per rank for hidden 100000, 8 "
                                         r"experts, ffn 100000, 128 tokens on tp 1 × ep 4, \+ 0.5 GiB per engine "
                                         r"process\), but this machine has 20.0 GiB available"):
        preflight.check_host_memory([big], ClusterConfig(engines=4), available=20 * 2**30)
    small = preflight.check_host_memory([MoEConfig()], ClusterConfig(engines=4), available=20 * 2**30)
    assert small["need_bytes"] < 3 * 2**30 and small["engines"] == 4
    assert preflight.check_host_memory([big], ClusterConfig(device="cuda", engines=4), available=1) is None
    assert preflight.check_host_memory([big], ClusterConfig(engines=4, launcher="mpi"), available=1) is None
    assert preflight.available_memory() > 0


def test_out_that_names_no_folder_is_refused():
    from moe_lab.reporting import runner

    for bad in ("", "   "):
        with pytest.raises(ValueError, match=rf"--out {bad!r} names no folder"):
            runner.check_out(bad)
    assert runner.check_out(None) is None  # `make reports`: no --out, the default folder


# ------------------------------------------------------------------------------------- the CLI, in-process


def test_run_refuses_a_world_rule_before_anything_starts_and_passes_a_good_run_on(no_launch, capsys):
    _refused(["run", "--profile", "cpu", "--only", "06", "-p", "training.tokens=15"], capsys,
             "moe-lab run: error: profile 'cpu': notebook 06: training.tokens (15) must be divisible by the world")
    assert no_launch == []
    rc, err = _main(["run", "--profile", "cpu", "--only", "01", "-p", "training.tokens=15", "--timeout", "90.5"],
                    capsys)
    assert rc == 0 and len(no_launch) == 1, err
    assert no_launch[0]["timeout"] == 91 and no_launch[0]["profile"] == "cpu"


def test_run_hands_on_a_relative_profile_and_wheels_as_absolute_paths(no_launch, capsys, tmp_path, monkeypatch):
    (tmp_path / "my.json").write_text((ROOT / "moe_lab/profiles/cpu.json").read_text())
    (tmp_path / "wh").mkdir()
    monkeypatch.chdir(tmp_path)
    rc, err = _main(["run", "--profile", "my.json", "--only", "01", "-p", "wheels=wh"], capsys)
    assert rc == 0, err
    assert no_launch[0]["profile"] == str(tmp_path / "my.json")
    assert no_launch[0]["overrides"]["wheels"] == str(tmp_path / "wh")
    _refused(["run", "--profile", "my.json", "--only", "01", "-p", "wheels=nowhere"], capsys,
             "wheels ('" + str(tmp_path / "nowhere") + "') is not a folder")
    _refused(["run", "--profile", "nope.json"], capsys, f"{tmp_path / 'nope.json'}: No such file or directory")
    assert len(no_launch) == 1


@pytest.mark.parametrize("argv, said", [
    (["probe", "--device", "cpu", "--engines", "200"], "engines (200) must be <= "),
    (["probe", "--device", "cpu", "--hidden", "100000", "--ffn", "100000"], "GiB available"),
    (["probe", "--device", "cpu", "--launcher-option", "Cluster.controller_ip=5"], "takes a unicode string"),
    (["probe", "--device", "cpu", "--launcher-option", "controller_ip=5"], "has no setting 'controller_ip'"),
    (["probe", "--device", "cpu", "--engines", "3"], "--engines 3, --tp 1: layout tp 1 × ep 3: num_experts (8)"),
    (["probe", "--device", "cpu", "--tp", "3"], "world (4) must be a multiple of tp (3)"),
    (["probe", "--device", "cpu", "--seed", "-1"], "seed (-1) must be an integer in 0..9223372036854775807"),
    (["probe", "--device", "cpu", "--megatron", ""], "empty --megatron"),
    (["run", "--profile", "cpu", "--launcher-option", "Cluster.controller_ip=5"], "takes a unicode string"),
    (["run", "--profile", "cpu", "-p", "engines=200"], "engines (200) must be <= "),
    (["run", "--profile", "cpu", "-p", "seq_len=100000", "-p", "hidden=8192", "-p", "ffn_hidden=65536"],
     "GiB available"),
    (["run", "--profile", "cpu", "--timeout", "0.5"], "seconds must be finite, >= 1"),
])
def test_each_measured_input_is_one_line_and_exit_2(argv, said, no_launch, capsys, monkeypatch):
    monkeypatch.setattr(cfgmod, "usable_cpus", lambda: 2)
    _refused(argv, capsys, said)
    assert no_launch == []


def test_a_good_probe_gets_to_the_launch(no_launch, capsys):
    """The control of the probe refusals: the same command with good values reaches the (stubbed) cluster."""
    with pytest.raises(Launched) as e:
        cli.main(["probe", "--device", "cpu", "--engines", "2", "--json"])
    assert e.value.args[0].engines == 2


def test_a_bad_probe_is_refused_fast_and_without_torch(tmp_path):
    """`probe` refuses what it can check without torch (a layer, a cut, the engines a CPU holds, memory) in a
    fresh process without importing torch or megatron, within 3 s of main() (timed generously: the interpreter's
    own start is not counted; the machine may be loaded)."""
    code = ("import json, sys, time\n"
            "t0 = time.monotonic()\n"
            "from moe_lab.cli.main import main\n"
            "try:\n    rc = main(sys.argv[1:])\nexcept SystemExit as e:\n    rc = e.code\n"
            "print(json.dumps({'rc': rc, 's': time.monotonic() - t0, 'torch': 'torch' in sys.modules,"
            " 'megatron': any(m.startswith('megatron') for m in sys.modules)}))\n")
    for args in (["probe", "--topk", "9"], ["probe", "--device", "cpu", "--engines", "200"],
                 ["probe", "--device", "cpu", "--cut", "500"],
                 ["probe", "--device", "cpu", "--hidden", "100000", "--ffn", "100000"],
                 ["run", "--profile", "cpu", "-p", "training.settings=bogus"]):
        r = subprocess.run([sys.executable, "-c", code, *args], capture_output=True, text=True, timeout=120,
                           cwd=tmp_path)
        out = json.loads(r.stdout.strip().splitlines()[-1])
        assert out["rc"] == 2 and len(r.stderr.strip().splitlines()) == 1, (args, r.stderr)
        assert not out["torch"] and not out["megatron"], args
        assert out["s"] <= 3.0, (args, out)


# ----------------------------------------------------------------------------------- property: every -p key


def _schema_keys() -> list[str]:
    """Every key `-p` may set: the common keys (layer, cluster, run) and each registered question's typed parameters
    (a flat field is a key; a section's field is `section.field`, and the section itself is a key)."""
    keys = list(MOE_KEYS) + list(CLUSTER_KEYS) + list(RUN_KEYS)
    for cls in params_types():
        if issubclass(cls, profiles.Flat):
            keys += list(cls.__dataclass_fields__)
        else:
            keys += [cls.KEY] + [f"{cls.KEY}.{f}" for f in cls.__dataclass_fields__]
    return list(dict.fromkeys(keys))


SCHEMA_KEYS = _schema_keys()
INVALID = ["NaN", "Infinity", "-Infinity", "[[]]", "[null]", '{"bogus": 1}', "true", "-1", str(2**63), "zz-nothing",
           ""]
"""Values no key takes: non-finite, of the wrong type (a nested list, a null element, an object of an unknown key, a
bool), negative, beyond any bound, text that names nothing, and empty."""
GENERATED_INVALID = st.one_of(
    st.integers(max_value=-1).map(str),
    st.integers(min_value=2**63).map(str),
    st.text(st.characters(codec="utf-8", exclude_categories=("Cs", "Cc")), max_size=12).map(lambda t: "zz" + t),
    st.floats(min_value=604801, max_value=2**52).filter(lambda f: f != int(f)).flatmap(
        lambda f: st.sampled_from([repr(f), repr(-f)])),
)
"""Generated ones: negative and huge integers, text that names nothing ('zz…'), and fractions beyond a week of
seconds (the keys that take a fraction — the timeouts, scale, lr — are bounded below that)."""


def test_the_schema_covers_every_question_and_the_common_keys():
    assert {"hidden", "engines", "timeout_s", "launcher_options", "trials", "cut", "wheels", "megatron"} <= \
        set(SCHEMA_KEYS)
    assert {"training.tokens", "training.settings", "presets.models", "layouts", "compound_settings",
            "truncation_remedies", "seq_lens", "releases"} <= set(SCHEMA_KEYS)
    assert set(profiles.SECTIONS) <= set(SCHEMA_KEYS) and profiles.FLAT_KEYS <= set(SCHEMA_KEYS)


@pytest.mark.parametrize("key", SCHEMA_KEYS)
def test_each_key_refuses_each_invalid_value_in_one_line(key, no_launch, capsys):
    for value in INVALID:
        rc, err = _main(["run", "--profile", "cpu", "-p", f"{key}={value}"], capsys)
        assert rc == 2, (key, value, err)
        assert len(err.splitlines()) == 1 and "Traceback" not in err, (key, value, err)
    assert no_launch == []


@settings(max_examples=120, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(key=st.sampled_from(SCHEMA_KEYS), value=GENERATED_INVALID)
def test_every_key_refuses_generated_invalid_values_in_one_line(key, value, no_launch, capsys):
    rc, err = _main(["run", "--profile", "cpu", "-p", f"{key}={value}"], capsys)
    assert rc == 2, (key, value, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (key, value, err)
    assert no_launch == []


# ------------------------------------------------------------------------------ property: every probe flag


PROBE_FLAGS = {
    "--hidden": "count", "--experts": "count", "--topk": "count", "--ffn": "count", "--seq": "count",
    "--trials": "count", "--engines": "engines", "--tp": "count", "--cut": "int", "--seed": "int",
    "--timeout": "seconds", "--start-timeout": "seconds", "--scale": "scale", "--dispatcher": "name",
    "--router-dtype": "name", "--model": "name", "--megatron": "name", "--launcher-option": "option",
}


def _probe_invalid(kind: str):
    empty = st.sampled_from(["", " "])
    text = st.text(st.characters(codec="ascii", exclude_categories=("Cc",)), max_size=8).map(lambda t: "zz" + t)
    nonfinite = st.sampled_from(["nan", "inf", "-inf"])
    huge = st.integers(min_value=2**63).map(str)
    return {
        "count": st.one_of(empty, text, nonfinite, st.integers(max_value=0).map(str), huge),
        "engines": st.one_of(empty, text, st.integers(max_value=0).map(str),
                             st.integers(min_value=cfgmod.max_cpu_engines() + 1).map(str)),
        "int": st.one_of(empty, text, nonfinite, st.integers(max_value=-1).map(str), huge),
        "seconds": st.one_of(empty, text, nonfinite, st.floats(max_value=0.999, allow_nan=False).map(repr),
                             st.floats(min_value=604801, allow_infinity=False).map(repr)),
        "scale": st.one_of(empty, text, nonfinite, st.floats(max_value=0).map(repr),
                           st.floats(min_value=1.001, allow_infinity=False).map(repr)),
        "name": st.one_of(empty, text),
        "option": st.one_of(empty, text, text.map(lambda t: t + "="), text.map(lambda t: f"delay={t}")),
    }[kind]


@st.composite
def _probe_argv(draw):
    flag = draw(st.sampled_from(sorted(PROBE_FLAGS)))
    return flag, draw(_probe_invalid(PROBE_FLAGS[flag]))


@settings(max_examples=100, deadline=None, suppress_health_check=[HealthCheck.function_scoped_fixture])
@given(flag_value=_probe_argv())
def test_every_probe_flag_refuses_every_invalid_value_in_one_line(flag_value, no_launch, capsys):
    flag, value = flag_value
    rc, err = _main(["probe", "--device", "cpu", "--engines", "2", flag, value], capsys)
    assert rc == 2, (flag, value, err)
    assert len(err.splitlines()) == 1 and "Traceback" not in err, (flag, value, err)
