"""The preload server's parts that need no cluster: where it applies, how its engines are known among a cluster's
processes, a server that cannot import said and not used, and an engine prepared once for one configuration."""

import json
import sys
import time

import pytest

from moe_lab.config import ClusterConfig
from moe_lab.controller import preloaded, processes
from moe_lab.engine import dist
from moe_lab.engine.preload import ENGINE_NAME, MARK


@pytest.mark.parametrize("cfg,env,want", [
    (ClusterConfig(device="cpu"), None, sys.platform == "linux"),
    (ClusterConfig(device="cpu"), "0", False),
    (ClusterConfig(device="cuda"), None, sys.platform == "linux"),
    (ClusterConfig(device="cuda"), "0", False),
    (ClusterConfig(device="cpu", launcher="ssh"), "1", False),  # engines on other hosts: not forked here
    (ClusterConfig(device="cpu", launcher_options={"engine_cmd": ["my-engine"]}), "1", False),
])
def test_where_engines_are_forked(cfg, env, want, monkeypatch):
    if env is None:
        monkeypatch.delenv(preloaded.PRELOAD_ENV, raising=False)
    else:
        monkeypatch.setenv(preloaded.PRELOAD_ENV, env)
    assert preloaded.wanted(cfg) is want


class _Proc:
    def __init__(self, cmdline, name):
        self.info = {"cmdline": cmdline}
        self._name = name

    def name(self):
        return self._name


def test_a_forked_engine_is_an_engine_and_its_server_is_not():
    server_cmd = [sys.executable, "-c", f"from {MARK} import main; main()", "--profile", "/tmp/p"]
    assert processes.is_engine(_Proc(server_cmd, ENGINE_NAME))
    assert not processes.is_engine(_Proc(server_cmd, "python3"))  # the server: same command line, its own name
    assert processes.is_engine(_Proc([sys.executable, "-m", "ipyparallel.engine", "--profile-dir=/tmp/p"], "python"))
    assert not processes.is_engine(_Proc([sys.executable, "-m", "ipyparallel.controller"], "python"))


def test_a_server_that_cannot_prepare_says_why_and_is_not_asked_again(tmp_path, caplog):
    """A server given arguments dist.prepare does not take ends at once with the error; the launcher then starts
    engines as processes (fork answers None) and the cluster's lookup skips it."""
    (tmp_path / "profile").mkdir()
    server = preloaded.PreloadServer(str(tmp_path / "profile"), {"device": "cpu", "no_such_argument": 1})
    t0 = time.monotonic()
    assert server.ready(timeout=60) is False
    assert "no_such_argument" in server.failed, server.failed
    assert time.monotonic() - t0 < 30
    assert server.fork([sys.executable, "-m", "ipyparallel.engine"], {}, str(tmp_path), str(tmp_path / "e.log")) \
        is None
    assert server.proc.poll() is not None
    assert any("cannot serve" in r.getMessage() for r in caplog.records)


def test_an_engine_is_prepared_for_one_configuration(monkeypatch):
    """torch and megatron-core are imported once a process: a second prepare for another release path or environment
    is refused (naming both), the same one again is not."""
    monkeypatch.setattr(dist, "STATE", {"prepared": ("cpu", (), (("A", "1"),), False)})
    monkeypatch.setenv("A", "1")
    dist.prepare(device="cpu", env={"A": "1"})
    with pytest.raises(RuntimeError, match=r"prepared for device cpu, release path none, environment \{'A': '1'\}; "
                                           r"it cannot be prepared for device cpu, release path \['/r'\]"):
        dist.prepare(device="cpu", extra_path=("/r",), env={"A": "1"})
    with pytest.raises(RuntimeError, match="environment none"):
        dist.prepare(device="cpu")


def test_the_server_is_told_what_an_engine_prepares():
    cfg = ClusterConfig(device="cpu", extra_path=("/r",), env={"X": "1"}, deterministic=True)
    assert json.loads(json.dumps(preloaded.prepare_of(cfg))) == {
        "device": "cpu", "extra_path": ["/r"], "env": {"X": "1"}, "deterministic": True}


def test_a_fork_that_could_not_use_cuda_is_told_apart_from_one_that_could(monkeypatch):
    """torch marks a fork 'bad' for CUDA once the parent called the CUDA runtime; the server asks a child it forks.
    Both answers are planted (this CPU build never marks a fork), each must come back."""
    import torch

    from moe_lab.engine import preload

    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: False)
    assert preload.fork_forbids_cuda() is False
    monkeypatch.setattr(torch.cuda, "_is_in_bad_fork", lambda: True)
    assert preload.fork_forbids_cuda() is True


def test_the_servers_imports_count_gpus_through_nvml_and_leave_the_engines_setting_as_it_was(monkeypatch):
    from moe_lab.engine import preload

    seen = {}
    monkeypatch.setattr(dist, "prepare", lambda **kw: seen.setdefault("during", preload.os.environ.get(
        preload.NVML_CHECK)))
    monkeypatch.delenv(preload.NVML_CHECK, raising=False)
    preload._preload({"device": "cpu"})
    assert seen["during"] == "1" and preload.NVML_CHECK not in preload.os.environ
    monkeypatch.setenv(preload.NVML_CHECK, "0")
    preload._preload({"device": "cpu"})
    assert preload.os.environ[preload.NVML_CHECK] == "0"
