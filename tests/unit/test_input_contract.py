"""Every flag and every -p value is checked where it is parsed — one line on stderr, exit 2, nothing
started — for the inputs that used to be accepted or to end in a traceback. The controls: the same flags with good
values parse (a check that refused everything would pass the refusals)."""

import pytest

from moe_lab import cli

REFUSED = [
    (["probe", "--trials", "0"], "--trials: 0 must be >= 1"),
    (["probe", "--engines", "-1"], "--engines"),
    (["probe", "--seq", "1"], "--seq: 1 must be >= 2"),
    (["probe", "--timeout", "inf"], "must be finite"),
    (["probe", "--start-timeout", "nan"], "must be finite"),
    (["run", "--timeout", "0"], ">= 1"),
    (["run", "--timeout", "-5"], ">= 1"),
    (["probe", "--timeout", "1e-300"], ">= 1"),
    (["probe", "--seq", "100000000000000000000"], "--seq: 100000000000000000000 must be <= 16777216"),
    (["scale", "--seq", "100000000000000000000"], "--seq: 100000000000000000000 must be <= 16777216"),
    (["scale", "--reserve-gib", "inf"], "--reserve-gib: 'inf': GiB held back must be finite, >= 0, <= 139"),
    (["scale", "--tflops", "0"], "--tflops: '0': TFLOP/s must be finite, > 0"),
    (["scale", "--imbalance", "nan"], "--imbalance: 'nan'"),
    (["preflight", "--gpu-memory", "-1"], "--gpu-memory: '-1': GiB per GPU must be finite, > 0"),
    (["preflight", "--gpu-memory", "nan"], "--gpu-memory: 'nan': GiB per GPU must be finite"),
    (["run", "-p", "releases="], "the value of 'releases' is empty"),
    (["run", "-p", "=3"], "the key is empty"),
    (["run", "--launcher-option", "delay="], "the value of 'delay' is empty"),
    (["run", "--timeout", "1e20"], "a week"),
    (["run", "--only", ""], "give notebook numbers"),
    (["run", "--only", "01,1"], "notebook 01 given twice"),
    (["run", "--profile", ""], "empty --profile"),
    (["bench", "--repeats", "0"], "--repeats"),
    (["bench", "--capture-only", "0"], "--capture-only"),
]


@pytest.mark.parametrize("argv,said", REFUSED, ids=[" ".join(a) or "empty" for a, _ in REFUSED])
def test_a_bad_flag_is_one_line_and_exit_2(argv, said, capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(argv)
    err = capsys.readouterr().err.strip()
    assert e.value.code == 2 and said in err and len(err.splitlines()) == 1, err


def test_good_values_of_the_same_flags_parse():
    ap = cli.build_parser()
    a = ap.parse_args(["probe", "--trials", "1", "--seq", "2", "--timeout", "1", "--start-timeout", "604800"])
    assert (a.trials, a.seq, a.timeout, a.start_timeout) == (1, 2, 1.0, 604800.0)
    assert ap.parse_args(["run", "--only", "1,03", "--timeout", "60"]).only == "01,03"
    assert ap.parse_args(["run", "--timeout", "90.5"]).timeout == 91  # papermill takes whole seconds: rounded up
    assert ap.parse_args(["scale", "--seq", "16777216", "--reserve-gib", "0", "--tflops", "1"]).seq == 2**24
    assert ap.parse_args(["preflight", "--gpu-memory", "141"]).gpu_memory == 141.0


P_REFUSED = [
    ("releases=5", "must be a list of 'installed' or X.Y.Z strings"),
    ("releases=[1]", "must be a list of 'installed' or X.Y.Z strings"),
    ("releases=0.99.0", "0.99.0 is not supported"),
    ("releases=0.11.0,0.11.0", "names a release twice"),
    ("timeout_s=Infinity", "must be a positive number of seconds (finite, >= 1 and <= 604800 (a week))"),
    ("timeout_s=NaN", "must be a positive number of seconds (finite, >= 1 and <= 604800 (a week))"),
    ("timeout_s=1e-300", "timeout_s (1e-300) must be a positive number of seconds (finite, >= 1"),
    ("layouts=ep3", "notebook 01: layouts entry 'ep3' on 4 ranks: layout tp 1 × ep 3: world (4) must be a multiple"),
    ("compound_settings=bogus", "compound_settings (['bogus']) must be a list of settings from 'plain'"),
    ("truncation_remedies=bogus", "truncation_remedies entry ('bogus') must be 'none' or '+'-joined names"),
    ("training.settings=bogus", "training.settings ('bogus') must be a non-empty list of distinct str values"),
    ("training.settings=[\"router fp32\"]", "training.settings (['router fp32']) must include 'plain'"),
    ("depth_layers=\"abc\"", "depth_layers ('abc') must be a positive integer"),
    ("trials=0", "trials (0) must be a positive integer"),
    ("seq_len=1", "seq_len (1)"),
]


@pytest.mark.parametrize("kv,said", P_REFUSED, ids=[k for k, _ in P_REFUSED])
def test_a_bad_parameter_is_refused_before_any_notebook_starts(kv, said, tmp_path, capsys):
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "-p", kv, "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and said in err and len(err.splitlines()) == 1, err
    assert not (tmp_path / "r" / "01_reproduce_ep_divergence.ipynb").exists()


def test_a_profile_without_seq_len_takes_the_layer_default(tmp_path):
    """A JSON profile that leaves seq_len out is the MoEConfig default, not a KeyError."""
    import json

    from moe_lab import profiles
    from moe_lab.config import MoEConfig

    p = tmp_path / "p.json"
    base = {"device": "cpu", "engines": 2, "dispatchers": ["allgather"], "router_dtypes": ["none"]}
    p.write_text(json.dumps({**base, "cut": 10}))
    assert profiles.load(str(p)).run.cut == 10 and MoEConfig().seq_len > 10
    p.write_text(json.dumps({**base, "cut": MoEConfig().seq_len}))  # control: the cut rule still holds
    with pytest.raises(ValueError, match="cut"):
        profiles.load(str(p))


def test_version_says_the_commit(capsys):
    with pytest.raises(SystemExit) as e:
        cli.main(["--version"])
    out = capsys.readouterr().out
    assert e.value.code == 0 and out.startswith("moe-lab ") and " commit " in out and " source " in out


def test_a_key_no_code_reads_is_unknown(tmp_path, capsys):
    """`repeats` was validated and read by nothing; it is no longer a parameter, so -p repeats=3 is refused like
    any unknown key (the control: trials, which notebooks read, is taken)."""
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "-p", "repeats=3", "--out", str(tmp_path / "r")])
    assert rc == 2 and "unknown key(s) ['repeats']" in capsys.readouterr().err
    from moe_lab import profiles

    assert profiles.load("cpu", {"trials": 2}).run.trials == 2


def test_files_the_run_reads_fail_in_one_line_naming_the_path(tmp_path, capsys):
    """Results.json that is a directory, or a FIFO (whose read would wait for a writer): one line with the path and
    the reason, exit 2, no notebook started (the control: an empty folder is taken, see the notebook tests). The
    run lock is the folder's own (an flock on it), so no file in the folder can stand in its way."""
    import os

    out = tmp_path / "r1"
    (out / "results.json").mkdir(parents=True)
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "--out", str(out)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "results.json cannot be read (Is a directory)" in err and len(err.splitlines()) == 1, err
    out2 = tmp_path / "r2"
    out2.mkdir()
    os.mkfifo(out2 / "results.json")
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "--out", str(out2)])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "results.json cannot be read (not a regular file: a FIFO (named pipe))" in err, err
    assert len(err.splitlines()) == 1, err
    assert not list(out.glob("*.ipynb")) and not list(out2.glob("*.ipynb"))


def test_compare_on_records_of_another_shape_is_one_line(tmp_path, capsys):
    """`compare` on a record whose notebook is not a string (not a report's results.json): one line naming the file,
    exit 2, no traceback. Records that only lack fields (an older schema) are read as `moe-lab findings` reads them:
    their cases are NOT MEASURED on both sides, exit 0 — the control, with the well-formed record beside it."""
    import json

    for name in ("a", "b"):
        (tmp_path / name).mkdir()
        (tmp_path / name / "results.json").write_text(json.dumps([{"notebook": ["01"], "router_dtype": "none"}]))
    rc = cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and "record 0 has notebook ['01'] (list)" in err and len(err.splitlines()) == 1, err
    old = {"notebook": "01", "kind": "case", "router_dtype": "none"}
    good = {"notebook": "01", "kind": "case", "dispatcher": "allgather", "router_dtype": "none", "world": 4,
            "cross_rank": {"numel": 10, "n_mismatch": 3, "mismatch_frac": 0.3, "bitwise_equal": False, "n_differ": 3,
                           "trials": 3},
            "rerun": {"numel": 10, "n_mismatch": 0, "mismatch_frac": 0.0, "bitwise_equal": True, "n_differ": 0,
                      "trials": 3}}
    for name in ("a", "b"):
        (tmp_path / name / "results.json").write_text(json.dumps([old, good]))
    assert cli.main(["compare", str(tmp_path / "a"), str(tmp_path / "b")]) == 0
    out = capsys.readouterr().out
    assert "Verdicts agree in 2 of 2 cases held by both (1 of them not measured" in out
    assert "A NOT MEASURED, B NOT MEASURED" in out and "A FAIL (attribution ep), B FAIL (attribution ep)" in out


@pytest.mark.parametrize("under", ["proc", "file"])
def test_an_unusable_wheelhouse_folder_is_one_line(under, tmp_path, capsys):
    """`wheelhouse -o` under /proc or under a file: one line, exit 2, before any download."""
    if under == "file":
        (tmp_path / "f").write_text("")
        target = str(tmp_path / "f" / "wheels")
    else:
        target = "/proc/moe-lab-wheels"
    rc = cli.main(["wheelhouse", "-o", target])
    err = capsys.readouterr().err.strip()
    assert rc == 2 and f"-o ({target}) is not a writable directory" in err and len(err.splitlines()) == 1, err


def test_versions_install_without_an_index_is_one_failure_line_and_exit_3(tmp_path):
    """`versions install` with no package index reachable: exit 3 (a failure, not bad input), the last
    line names the release and pip's reason, no traceback on stderr, the traceback in --log, no partial folder left."""
    import os
    import subprocess
    import sys

    env = {**os.environ, "MOE_LAB_CACHE": str(tmp_path / "cache"), "PIP_CONFIG_FILE": os.devnull,
           "PIP_INDEX_URL": "http://127.0.0.1:9/simple", "PIP_RETRIES": "0", "PIP_TIMEOUT": "2",
           "PIP_NO_CACHE_DIR": "1", "PIP_FIND_LINKS": ""}
    r = subprocess.run([sys.executable, "-m", "moe_lab.cli", "--log", str(tmp_path / "err.log"), "versions", "install",
                        "0.13.0"], capture_output=True, text=True, timeout=240, env=env)
    lines = r.stderr.strip().splitlines()
    assert r.returncode == 3, r.stderr
    assert lines[-1].startswith("moe-lab versions: failed: pip install megatron-core==0.13.0: pip exited")
    assert "Traceback" not in r.stderr and "Traceback" in (tmp_path / "err.log").read_text()
    left = [p for p in (tmp_path / "cache").rglob("*") if p.name.startswith(".partial")]
    assert not left, left
