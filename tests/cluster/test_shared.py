"""One warm cluster for a run's notebooks (controller.shared): a notebook attaches when its cases need exactly that
cluster, starts its own otherwise, leaves the shared engines running (their cached layers dropped) or, after a fault,
ended — and never attaches when no run shares one (the control)."""

import json

import pytest

from moe_lab import profiles
from moe_lab.controller import shared
from moe_lab.experiments import probe, protocol
from moe_lab.questions.reproduce import experiment as reproduce

P = profiles.load("cpu", {"dispatchers": ["allgather"], "router_dtypes": ["none"], "trials": 1})


def _on_engines(c, expr: str) -> list:
    """`expr` evaluated on every engine, in rank order (executed there: nothing of this module has to travel)."""
    c.view.execute(f"import os; from moe_lab.engine.dist import STATE; _moe_lab_t = {expr}", block=True)
    return c.view.pull("_moe_lab_t", block=True)


@pytest.fixture(scope="module")
def run_cluster(tmp_path_factory):
    path = tmp_path_factory.mktemp("shared") / "cluster.json"
    with shared.for_run(protocol.shared_config(P), path) as c:
        yield c, path
    assert not path.exists() and shared.ENV not in __import__("os").environ


def test_a_notebook_attaches_and_leaves_the_engines_running_without_its_layers(run_cluster):
    c, _ = run_cluster
    pids = _on_engines(c, "os.getpid()")
    probe.run(c, P.layer)  # the control: a case run on the engines leaves its layer cached there
    assert _on_engines(c, "len(STATE.get('layers', {}))") == [1, 1, 1, 1]
    recs = protocol.run(reproduce, P)
    assert recs and all(r["shared_cluster"] for r in recs)
    assert recs[0]["cross_rank"]["n_mismatch"] > 0  # the CPU effect, measured on the shared engines
    assert _on_engines(c, "os.getpid()") == pids and all(h["ok"] for h in c.health_check())
    assert _on_engines(c, "len(STATE.get('layers', {}))") == [0, 0, 0, 0]


def test_without_a_shared_cluster_a_notebook_starts_its_own(run_cluster, monkeypatch):
    monkeypatch.delenv(shared.ENV)
    recs = protocol.run(reproduce, P)
    assert recs and not any(r["shared_cluster"] for r in recs)


def test_other_cases_start_their_own_cluster_and_the_shared_one_stays(run_cluster):
    c, _ = run_cluster
    recs = protocol.run(reproduce, P.with_overrides(engines=2))
    assert recs[0]["world"] == 2 and not recs[0]["shared_cluster"]
    assert all(h["ok"] for h in c.health_check())


def test_an_attached_cluster_is_never_restarted(run_cluster):
    a = shared.attach(protocol.shared_config(P))
    assert a is not None and a.attached
    with pytest.raises(ValueError, match="cannot be restarted"):
        a.restart_engines(extra_path=("/nowhere",))
    a.stop()
    assert all(h["ok"] for h in run_cluster[0].health_check())


def test_attach_refuses_a_missing_file_or_another_config(tmp_path, monkeypatch):
    monkeypatch.setenv(shared.ENV, str(tmp_path / "gone.json"))
    assert shared.attach(protocol.shared_config(P)) is None
    f = tmp_path / "other.json"
    f.write_text(json.dumps({"config": "another"}))
    monkeypatch.setenv(shared.ENV, str(f))
    assert shared.attach(protocol.shared_config(P)) is None
    monkeypatch.delenv(shared.ENV)
    assert shared.attach(protocol.shared_config(P)) is None


def test_after_a_fault_the_shared_engines_are_ended_and_nobody_attaches(tmp_path):
    path = tmp_path / "cluster.json"
    with shared.for_run(protocol.shared_config(P), path) as c:
        a = shared.attach(protocol.shared_config(P))
        assert a is not None
        a.stop(graceful=False)  # what a ClusterError or Ctrl-C in a notebook does
        assert shared.attach(protocol.shared_config(P)) is None
        with pytest.raises(Exception):
            c.health_check()


def test_a_run_whose_cluster_cannot_start_goes_on_without_one(tmp_path, monkeypatch):
    """Each notebook then starts its own and reports the failure in its page, as without sharing."""
    import os

    monkeypatch.delenv(shared.ENV, raising=False)  # this module's run_cluster may be up (tests spread over workers)

    bad = protocol.shared_config(P).replace(launcher_options={"no_such_setting": 1})  # refused before any process
    with shared.for_run(bad, tmp_path / "cluster.json") as c:
        assert c is None and shared.ENV not in os.environ and not (tmp_path / "cluster.json").exists()
