"""The one owner of engine sets, with fake clusters: which cluster serves each group, what is restarted,
what goes back to the run's shared cluster, and what is stopped at the end."""

import pytest

from moe_lab.config import ClusterConfig
from moe_lab.controller import engine_sets, shared
from moe_lab.controller.cluster import ClusterError

BASE = ClusterConfig(device="cpu", engines=2)
OLD = BASE.replace(extra_path=("/releases/0.11.0",))
MID = BASE.replace(extra_path=("/releases/0.12.3",))


class FakeCluster:
    made: list = []

    def __init__(self, config, attached=False):
        self.config, self.attached, self.client, self.events = config, attached, None, []
        FakeCluster.made.append(self)

    def start(self):
        self.client = object()
        self.events.append("start")
        return self

    def launch(self):
        self.events.append("launch")
        return self

    def warm(self, **changes):
        self.events.append("warm")
        return True

    def restart_engines(self, **changes):
        self.config = self.config.replace(**changes)
        self.events.append(("restart", tuple(sorted(changes))))
        return self

    def stop(self, graceful=True):
        self.events.append(("stop", graceful) if not self.attached else "detach")
        self.client = None

    def run(self, fn, *args, what="", timeout=None, **kw):
        self.events.append(("run", fn.__name__))
        return [True] * self.config.engines


@pytest.fixture
def world(monkeypatch):
    """A run whose shared cluster has BASE: `attach` hands out a fresh attached client of it, like controller.shared."""
    FakeCluster.made = []
    attached = []

    def attach(config):
        if config != BASE:
            return None
        c = FakeCluster(config, attached=True).start()
        attached.append(c)
        return c

    monkeypatch.setattr(shared, "attach", attach)
    monkeypatch.setattr(shared, "serves", lambda config: config == BASE)
    monkeypatch.setattr("moe_lab.controller.cluster.Cluster", FakeCluster)
    monkeypatch.setattr("moe_lab.controller.spares.prestart_wanted", lambda cfg: False)
    monkeypatch.setattr("moe_lab.controller.spares.keep_wanted", lambda cfg: False)
    yield attached
    engine_sets.stop_kept()  # nothing kept outlives a test


def test_a_release_detour_goes_back_to_the_shared_cluster_without_a_restart(world):
    sets = engine_sets.EngineSets()
    assert sets.ensure(OLD).events == ["start"] and not sets.current.attached  # its own: the shared one has BASE
    own = sets.current
    assert sets.ensure(MID) is own and own.events[-1] == ("restart", ("extra_path",))
    back = sets.ensure(BASE)
    assert back.attached and back is world[0]  # the shared cluster again
    assert own.events[-1] == ("stop", True)  # the detour's own cluster ended, not restarted back
    sets.close()
    assert back.events[-1] == "detach"  # never stopped, only detached
    assert sum(e == "start" for c in FakeCluster.made for e in c.events) == 2  # own + one attach; no third start


def test_without_a_shared_cluster_the_own_cluster_is_restarted_back_and_stopped_at_close(world, monkeypatch):
    monkeypatch.setattr(shared, "attach", lambda config: None)
    monkeypatch.setattr(shared, "serves", lambda config: False)
    sets = engine_sets.EngineSets()
    own = sets.ensure(OLD)
    assert sets.ensure(BASE) is own and own.events[-1] == ("restart", ("extra_path",))  # the control: a restart
    sets.close(KeyboardInterrupt())
    assert own.events[-1] == ("stop", False)  # after Ctrl-C: no waiting on engines that may be mid-collective


def test_the_shared_cluster_is_detached_not_restarted_and_the_callers_cluster_is_never_stopped(world):
    sets = engine_sets.EngineSets()
    first = sets.ensure(BASE)
    assert first.attached
    own = sets.ensure(MID)
    assert own is not first and first.events[-1] == "detach" and not own.attached
    sets.close()
    assert own.events[-1] == ("stop", True)

    mine = FakeCluster(BASE).start()
    sets = engine_sets.EngineSets(mine)
    assert sets.ensure(MID) is mine and mine.events[-1] == ("restart", ("extra_path",))  # restarted in place
    sets.close(ClusterError("engine 1 died"))
    assert all(not (isinstance(e, tuple) and e[0] == "stop") for e in mine.events)  # the caller's: not stopped


def test_a_first_group_of_its_own_is_launched_ahead_and_the_same_cluster_serves_it(world, monkeypatch):
    """Launched before the engines' turn (the wait ticks it), then started by `ensure`: one cluster, no second
    start. The controls: nothing is launched for a group the shared cluster serves, for a caller's cluster, or where
    launching early is not wanted; a second close does nothing."""
    monkeypatch.setattr("moe_lab.controller.spares.prestart_wanted", lambda cfg: True)
    sets = engine_sets.EngineSets()
    assert sets.launch_ahead(OLD) is True
    ahead = FakeCluster.made[-1]
    sets.tick()
    assert ahead.events == ["launch", "warm"] and ahead.client is None
    assert sets.ensure(OLD) is ahead and ahead.events == ["launch", "warm", "start"]
    assert len(FakeCluster.made) == 1
    sets.close()
    sets.close()
    assert ahead.events.count(("stop", True)) == 1

    n = len(FakeCluster.made)
    assert engine_sets.EngineSets().launch_ahead(BASE) is False  # the shared cluster serves it
    assert engine_sets.EngineSets(FakeCluster(BASE).start()).launch_ahead(OLD) is False  # the caller's cluster
    monkeypatch.setattr("moe_lab.controller.spares.prestart_wanted", lambda cfg: False)
    assert engine_sets.EngineSets().launch_ahead(OLD) is False
    assert len(FakeCluster.made) == n + 1  # only the caller's, made by the test


def test_a_cluster_launched_ahead_for_a_wait_that_was_interrupted_is_stopped(world, monkeypatch):
    monkeypatch.setattr("moe_lab.controller.spares.prestart_wanted", lambda cfg: True)
    sets = engine_sets.EngineSets()
    sets.launch_ahead(OLD)
    sets.close(KeyboardInterrupt())
    assert FakeCluster.made[-1].events == ["launch", ("stop", False)]


def test_changes_name_only_the_start_fields_that_differ():
    assert engine_sets.changes(BASE, BASE) == {}
    assert engine_sets.changes(BASE, OLD) == {"extra_path": ("/releases/0.11.0",)}
    assert engine_sets.changes(BASE, BASE.replace(env=(("NCCL_ALGO", "Ring"),))) == {"env": (("NCCL_ALGO", "Ring"),)}


@pytest.fixture
def keeping(world, monkeypatch):
    monkeypatch.setattr("moe_lab.controller.spares.keep_wanted", lambda cfg: True)
    return world


def _first_run_keeps(target):
    sets = engine_sets.EngineSets()
    own = sets.ensure(target)
    sets.close()
    assert own.events == ["start", ("run", "release_caches")] and own.client is not None  # kept, layers dropped
    assert engine_sets.kept() is own
    return own


def test_a_runs_own_cluster_is_kept_and_the_next_run_that_needs_it_takes_it(keeping, monkeypatch):
    own = _first_run_keeps(OLD)
    sets = engine_sets.EngineSets()
    assert engine_sets.kept() is None  # the next run holds it now
    monkeypatch.setattr("moe_lab.controller.spares.prestart_wanted", lambda cfg: True)  # launching early is on ...
    assert sets.launch_ahead(OLD) is False  # ... but nothing is launched: the kept engines serve the first group
    assert sets.ensure(OLD) is own and len(FakeCluster.made) == 1  # no cold start
    sets.close()
    assert engine_sets.kept() is own and ("stop", True) not in own.events


def test_a_kept_cluster_the_next_run_does_not_need_is_stopped(keeping):
    own = _first_run_keeps(OLD)
    sets = engine_sets.EngineSets()
    other = sets.ensure(MID)  # another release: the kept engines do not serve it
    assert other is not own and own.events[-1] == ("stop", True) and other.events[0] == "start"
    sets.close()
    assert engine_sets.kept() is other

    engine_sets.stop_kept()
    own = _first_run_keeps(OLD)
    sets = engine_sets.EngineSets()
    assert sets.ensure(BASE).attached  # the shared cluster serves this run: the kept one ends with it
    sets.close()
    assert own.events[-1] == ("stop", True) and engine_sets.kept() is None


def test_a_kept_cluster_nobody_asks_for_is_stopped_after_its_time(keeping):
    import time

    own = FakeCluster(OLD).start()
    engine_sets.keep(own, seconds=0.05)
    deadline = time.monotonic() + 5
    while engine_sets.kept() is not None and time.monotonic() < deadline:
        time.sleep(0.01)
    assert engine_sets.kept() is None and own.events[-1] == ("stop", True)


def test_nothing_is_kept_after_a_failure_or_where_keeping_is_not_wanted(keeping, monkeypatch):
    sets = engine_sets.EngineSets()
    own = sets.ensure(OLD)
    sets.close(KeyboardInterrupt())
    assert own.events == ["start", ("stop", False)] and engine_sets.kept() is None
    monkeypatch.setattr("moe_lab.controller.spares.keep_wanted", lambda cfg: False)  # the control
    sets = engine_sets.EngineSets()
    own = sets.ensure(OLD)
    sets.close()
    assert own.events == ["start", ("stop", True)] and engine_sets.kept() is None


def test_keeping_is_wanted_in_a_notebook_kernel_where_launching_early_is(monkeypatch):
    from moe_lab.controller import spares

    monkeypatch.delenv("MOE_LAB_KEEP_ENGINES", raising=False)
    monkeypatch.setattr(spares, "prestart_wanted", lambda cfg: True)
    import ipyparallel  # noqa: F401 - imports ipykernel: a command or a test is still no notebook kernel

    assert not spares.in_notebook_kernel() and not spares.keep_wanted(BASE)  # a command's one run: nobody asks again
    monkeypatch.setattr(spares, "in_notebook_kernel", lambda: True)
    assert spares.keep_wanted(BASE)
    monkeypatch.setattr(spares, "prestart_wanted", lambda cfg: False)
    assert not spares.keep_wanted(BASE)
    monkeypatch.setattr(spares, "prestart_wanted", lambda cfg: True)
    monkeypatch.setenv("MOE_LAB_KEEP_ENGINES", "1")
    assert spares.keep_wanted(BASE) and not spares.keep_wanted(BASE.replace(launcher="mpi"))
    monkeypatch.setenv("MOE_LAB_KEEP_ENGINES", "2")
    with pytest.raises(ValueError, match="MOE_LAB_KEEP_ENGINES"):
        spares.keep_wanted(BASE)


def test_gpu_engines_are_not_kept_beside_a_runs_shared_cluster(monkeypatch):
    """In a `moe-lab run` whose notebooks share a cluster, another notebook's cases run on the same GPU beside a kept
    cluster, which holds GPU memory with its layers dropped: GPU engines are not kept there. CPU engines there are, and
    GPU engines in a kernel with no shared cluster (a notebook run by hand) are (the controls)."""
    from moe_lab.controller import shared, spares

    monkeypatch.delenv("MOE_LAB_KEEP_ENGINES", raising=False)
    monkeypatch.setattr(spares, "prestart_wanted", lambda cfg: True)
    monkeypatch.setattr(spares, "in_notebook_kernel", lambda: True)
    gpu = ClusterConfig(device="cuda", engines=4, ranks_per_gpu=4)
    monkeypatch.delenv(shared.ENV, raising=False)
    assert spares.keep_wanted(gpu) and spares.keep_wanted(BASE)
    monkeypatch.setenv(shared.ENV, "/tmp/run/.moe_lab-cluster.json")
    assert not spares.keep_wanted(gpu) and spares.keep_wanted(BASE)
    monkeypatch.setenv("MOE_LAB_KEEP_ENGINES", "1")  # asked for: kept anyway
    assert spares.keep_wanted(gpu)
