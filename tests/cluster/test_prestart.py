"""The next engines launched early (Cluster.prestart / launch / warm, protocol.run): a restart or a group's own
cluster then finds its engines registered and their imports done. A spare set warmed for another config is never
used (the control), and nothing launched early outlives the run. A release switch (`restart_engines`) keeps the
controller, and a stopped cluster leaves no engine of any set it had."""

import dataclasses
import os
import time

import psutil
import pytest

from moe_lab import profiles
from moe_lab.config import ClusterConfig
from moe_lab.controller import processes, shared
from moe_lab.controller.cluster import Cluster
from moe_lab.controller.spares import prestart_wanted
from moe_lab import releases
from moe_lab.experiments import protocol
from moe_lab.questions.reproduce import experiment as reproduce

pytestmark = pytest.mark.cluster

OTHER = "0.12.3"  # installed side by side (cached; notebook 03 and test_cluster use it too)
P = profiles.load("cpu", {"dispatchers": ["allgather"], "router_dtypes": ["none"], "trials": 1, "engines": 2,
                          "hidden": 32, "num_experts": 4, "topk": 2, "ffn_hidden": 64, "seq_len": 16, "cut": 8})


def _engines(c) -> list[int]:
    return sorted(p.pid for p in processes.cluster_processes(c.profile_dir) if processes.is_engine(p))


def _warm_until_sent(c, **changes) -> None:
    import time

    deadline = time.monotonic() + 120
    while not c.warm(**changes):
        assert time.monotonic() < deadline, "the spare engines never registered"
        time.sleep(0.1)


def test_a_release_switch_takes_its_warmed_spare_keeps_the_controller_and_stops_clean(other_release):
    """A release switch restarts only the engines: the same controller, profile and watchdog, the old engine
    processes gone, new engine ids — the spare set warmed for that release (`Cluster.prestart`: registered, and
    imported before the restart asked, so the restart's own import call finds the imports done). The cluster answers
    a forward on that release, then switches back with no spare (fresh engines of the installed release). When the
    block ends no engine of either set is left and the profile is gone; a second stop does nothing. The control:
    the next test (a spare warmed for another release is not used)."""
    import psutil

    from moe_lab.config import MoEConfig
    from moe_lab.experiments import probe

    other = other_release
    cfg = MoEConfig(hidden=32, num_experts=4, topk=2, ffn_hidden=64, seq_len=16, dispatcher="allgather")
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        ipp_cluster, profile, reaper = c.state.ipp, c.profile_dir, c.state.reaper.pid
        old_ids, old = list(c.engine_ids), [p["pid"] for p in c.procs]
        assert c.summary()["megatron_core"] == releases.installed_version()
        with pytest.raises(ValueError, match="cannot change"):
            c.restart_engines(engines=3)
        assert c.prestart() and c.prestart()  # a second call keeps the one spare set
        _warm_until_sent(c, extra_path=other)
        spare_ids = list(c.state.spare["ids"])
        assert len(_engines(c)) == 8  # 2 engines + their nannies, twice
        c.restart_engines(extra_path=other)
        assert c.engine_ids == spare_ids and c.summary()["megatron_core"] == OTHER
        assert c.state.ipp is ipp_cluster and c.profile_dir == profile and c.state.reaper.pid == reaper
        assert set(c.engine_ids).isdisjoint(old_ids) and not set(old) & set(_engines(c)) and len(_engines(c)) == 4
        assert not any(psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE for p in old)
        assert c.timings["imports_s"] < 0.5, c.timings  # warm: the imports were done before the restart
        assert 0 < c.timings["restart_s"] and c.timings["ready_s"] == c.timings["restart_s"]
        a, b = c.run(probe.on_engine, probe.case(cfg, cut=8, repeats=0).payload(2), what="a forward on 0.12.3")
        assert a["trials"][0]["rerun"]["bitwise_equal"] and a["out_shape"] == [16, 1, 32]

        c.restart_engines(extra_path=())
        assert c.summary()["megatron_core"] == releases.installed_version()
        assert all(h["ok"] for h in c.health_check())
        pids = [p["pid"] for p in c.procs] + old
    deadline = time.monotonic() + 15
    while any(_alive(p) for p in pids) and time.monotonic() < deadline:
        time.sleep(0.2)
    assert not any(_alive(p) for p in pids) and not os.path.exists(profile)
    c.stop()  # idempotent


def _alive(pid: int) -> bool:
    import psutil

    try:
        return psutil.Process(pid).status() != psutil.STATUS_ZOMBIE
    except psutil.NoSuchProcess:
        return False


def test_a_spare_warmed_for_another_release_is_not_used(other_release):
    """The control: the spare imported 0.12.3; a restart that asks for the installed release must not get it."""
    other = other_release
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120, extra_path=other)) as c:
        assert c.summary()["megatron_core"] == OTHER
        c.prestart()
        _warm_until_sent(c, extra_path=other)
        spare_ids = list(c.state.spare["ids"])
        c.restart_engines(extra_path=(), env=(("MOE_LAB_TEST_X", "1"),))
        assert c.summary()["megatron_core"] == releases.installed_version()
        fresh = [s for s in c.state.preload_servers.values() if s.prepare["env"] == {"MOE_LAB_TEST_X": "1"}]
        if fresh:  # forked from a preload server that imported the installed release with the restart's environment
            assert {psutil.Process(p["pid"]).ppid() for p in c.procs} == {fresh[0].proc.pid}
        else:  # engines of their own import torch + megatron-core themselves
            assert c.timings["imports_s"] > 0.5, c.timings
        assert not set(c.engine_ids) & set(spare_ids) and len(_engines(c)) == 4
        assert c.run(os.getenv, "MOE_LAB_TEST_X") == ["1", "1"]


def test_a_spare_forked_for_a_release_serves_that_release_and_no_other(other_release, monkeypatch):
    """With the restart's changes known (what a run's prefetch passes), the spare set is forked from a preload server
    for them: the restart to that release takes it with its imports done. The controls: warm() for another release
    refuses it, and a restart for another release does not use it (fresh engines of that release)."""
    from moe_lab.controller import preloaded, spares

    monkeypatch.setenv(preloaded.PRELOAD_ENV, "1")
    other = other_release
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        assert c.prestart(extra_path=other)
        target = c.config.replace(extra_path=other)
        assert c.state.spare["preloaded"] == spares.prepare_args(target)
        assert not c.warm(extra_path=())  # forked for 0.12.3: never imported for the installed release
        _warm_until_sent(c, extra_path=other)
        spare_ids = list(c.state.spare["ids"])
        c.restart_engines(extra_path=other)
        assert c.engine_ids == spare_ids and c.summary()["megatron_core"] == OTHER
        assert c.timings["imports_s"] < 0.5, c.timings
        assert c.prestart(extra_path=())  # forked for the installed release ...
        spare_pids = {launcher.pid for launcher in c.state.ipp.engines[c.state.spare["set"]].launchers.values()}
        assert len(spare_pids) == 2
        c.restart_engines(extra_path=other, env={"MOE_LAB_TEST_X": "1"})  # ... but the restart asks for another
        assert c.summary()["megatron_core"] == OTHER and c.run(os.getenv, "MOE_LAB_TEST_X") == ["1", "1"]
        assert not spare_pids & {p["pid"] for p in c.placement}  # (engine set ids repeat within a second)


def test_the_gpu_warm_up_runs_its_collectives_on_every_rank(cpu_cluster):
    """dist.warm_up is what bring-up runs on GPUs; here on CPU ranks (same collectives, same shapes on every rank)."""
    from moe_lab.engine import dist

    t = cpu_cluster.run(dist.warm_up, what="warm-up")
    assert len(t) == cpu_cluster.world and all(x > 0 for x in t)
    assert all(h["ok"] for h in cpu_cluster.health_check())


def test_prestart_wanted_follows_cores_gpus_and_the_override(monkeypatch):
    monkeypatch.delenv("MOE_LAB_PRESTART", raising=False)
    monkeypatch.setattr(os, "cpu_count", lambda: 2)
    assert not prestart_wanted(ClusterConfig(device="cpu", engines=4))  # the CI machine: 2 cores, 4 engines
    assert prestart_wanted(ClusterConfig(device="cpu", engines=1))
    assert prestart_wanted(ClusterConfig(device="cuda", engines=4))
    assert not prestart_wanted(ClusterConfig(device="cuda", engines=4, launcher="mpi"))
    monkeypatch.setenv("MOE_LAB_PRESTART", "1")
    assert prestart_wanted(ClusterConfig(device="cpu", engines=4))
    monkeypatch.setenv("MOE_LAB_PRESTART", "0")
    assert not prestart_wanted(ClusterConfig(device="cuda", engines=4))


def _two_release_cases():
    cases = reproduce.cases(P)
    return cases + [dataclasses.replace(c, release=OTHER) for c in cases]


@pytest.fixture(scope="module")
def plain(other_release):
    """The control of this module's protocol runs: another release's group, then the installed one's, with nothing
    launched early and no shared cluster — one cluster of its own, restarted back for the second group, and nothing
    of it left afterwards. CPU forwards are deterministic, so a case's records are these in any order of the groups
    and on any engine set."""
    mp = pytest.MonkeyPatch()
    mp.setenv("MOE_LAB_PRESTART", "0")
    mp.delenv(shared.ENV, raising=False)
    cases = reproduce.cases(P)
    before = _our_ipp_processes()
    try:
        recs = protocol.run(reproduce, P, cases=[dataclasses.replace(c, release=OTHER) for c in cases] + cases)
    finally:
        mp.undo()
    _assert_none_left(before)
    return recs


def _by_release(recs: list[dict]) -> dict:
    return {r["megatron_core"]: (r["rerun"]["n_mismatch"], r["cross_rank"]["n_mismatch"]) for r in recs}


def test_protocol_starts_the_next_groups_engines_early_and_measures_the_same(plain, monkeypatch, caplog):
    """Two releases in one run: the second group's engines are launched while the first runs; each release's
    records are those of the run without it (`plain`: the same mismatch counts)."""
    import logging

    monkeypatch.setenv("MOE_LAB_PRESTART", "1")
    with caplog.at_level(logging.INFO, logger="moe_lab.controller.cluster"):
        early = protocol.run(reproduce, P, cases=_two_release_cases())
    assert "launched 2 spare engines" in caplog.text and "(launched early)" in caplog.text
    assert [r["megatron_core"] for r in early] == [releases.installed_version(), OTHER]
    assert _by_release(early) == _by_release(plain) and len(_by_release(plain)) == 2


def test_after_a_shared_cluster_the_next_groups_own_cluster_is_launched_early(other_release, tmp_path, monkeypatch,
                                                                             caplog):
    import logging

    import psutil

    monkeypatch.setenv("MOE_LAB_PRESTART", "1")
    before = _our_ipp_processes()
    with shared.for_run(protocol.shared_config(P), tmp_path / "cluster.json") as c:
        with caplog.at_level(logging.INFO, logger="moe_lab.controller.engine_sets"):
            recs = protocol.run(reproduce, P, cases=_two_release_cases())
        assert "launching the next group's own cluster now" in caplog.text
        assert [r["shared_cluster"] for r in recs] == [True, False]
        assert [r["megatron_core"] for r in recs] == [releases.installed_version(), OTHER]
        assert all(h["ok"] for h in c.health_check())  # the shared cluster stays for the next notebook
    left = _our_ipp_processes() - before
    assert not [p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def test_after_another_releases_group_the_next_group_goes_back_to_the_shared_cluster(plain, tmp_path, monkeypatch,
                                                                                    caplog):
    """Another release first, then the installed one: the second group runs on the run's shared cluster again (no
    restart back of the first group's own engines, which stop); without a shared cluster (the control, `plain`) it
    runs on the own cluster restarted back. The records are the same either way (CPU forwards are deterministic)."""
    import logging

    monkeypatch.setenv("MOE_LAB_PRESTART", "0")
    cases = reproduce.cases(P)
    cases = [dataclasses.replace(c, release=OTHER) for c in cases] + cases
    before = _our_ipp_processes()
    assert [r["shared_cluster"] for r in plain] == [False, False]
    with shared.for_run(protocol.shared_config(P), tmp_path / "cluster.json") as c:
        with caplog.at_level(logging.INFO, logger="moe_lab.controller.engine_sets"):
            recs = protocol.run(reproduce, P, cases=cases)
        assert "back on the run's shared cluster" in caplog.text
        assert [r["shared_cluster"] for r in recs] == [False, True]
        assert all(h["ok"] for h in c.health_check())
    assert [r["megatron_core"] for r in recs] == [r["megatron_core"] for r in plain] == [
        OTHER, releases.installed_version()]
    assert [r["cross_rank"]["n_mismatch"] for r in recs] == [r["cross_rank"]["n_mismatch"] for r in plain]
    _assert_none_left(before)


def _assert_none_left(before: set[int]) -> None:
    """No ipyparallel process this test process started since `before` is still running."""
    import psutil

    left = _our_ipp_processes() - before
    assert not [p for p in left if psutil.pid_exists(p) and psutil.Process(p).status() != psutil.STATUS_ZOMBIE]


def _our_ipp_processes() -> set[int]:
    """The ipyparallel controllers, engines and nannies this test process started (not another session's)."""
    import psutil

    out = set()
    for p in psutil.Process().children(recursive=True):
        try:
            if any("ipyparallel" in a for a in p.cmdline()):
                out.add(p.pid)
        except psutil.Error:  # gone meanwhile
            continue
    return out


def test_launching_early_never_waits_for_a_preload_servers_imports(monkeypatch):
    """A set launched early whose preload server is new (another environment: its own server, still importing) is
    forked once the server's imports are done — between cases, by `warm` — so `prestart` and `Cluster.launch`
    return at once instead of holding the controller (and the engines at work) for the imports. The control: the
    imports took longer than the calls that started them; the set then serves the restart (forked from that
    server) and the cluster's start."""
    from moe_lab.controller import preloaded

    monkeypatch.setenv(preloaded.PRELOAD_ENV, "1")
    env = (("MOE_LAB_TEST_EARLY", "1"),)
    with Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120)) as c:
        t0 = time.perf_counter()
        assert c.prestart(env=env)
        took = time.perf_counter() - t0
        server = next(s for s in c.state.preload_servers.values() if s.prepare["env"] == dict(env))
        assert c.state.spare["set"] is None or server.settled()  # not forked while the server imports
        _warm_until_sent(c, env=env)
        assert server.info["imports_s"] > took, (server.info, took)  # the control: prestart did not wait for them
        c.restart_engines(env=env)
        assert {psutil.Process(p["pid"]).ppid() for p in c.procs} == {server.proc.pid}
        assert c.run(os.getenv, "MOE_LAB_TEST_EARLY") == ["1", "1"]

    early = Cluster(ClusterConfig(device="cpu", engines=2, timeout_s=120, env=env))
    try:
        t0 = time.perf_counter()
        early.launch()
        took = time.perf_counter() - t0
        early.start()
        server = next(iter(early.state.preload_servers.values()))
        assert server.info["imports_s"] > took, (server.info, took)
        assert {psutil.Process(p["pid"]).ppid() for p in early.procs} == {server.proc.pid}
    finally:
        early.stop()


def _engines_here() -> set[int]:
    """Engine processes under this test process (forked ones included: their command line is their server's; an
    engine's nanny counts too)."""
    out = set()
    for q in psutil.Process().children(recursive=True):
        try:
            q.info = {"cmdline": q.cmdline()}
            if processes.is_engine(q):
                out.add(q.pid)
        except psutil.Error:
            continue
    return out


def _run_behind_the_turn(tmp_path, monkeypatch, prestart: str) -> tuple[list[dict], int, float, float]:
    """protocol.run of the installed release's cases on a cluster of its own while this test holds the engines'
    turn (another notebook's cases) for 8 s — where launching early is on, until its engines have been seen for 3 s
    too (a preload server's imports on a busy machine can take longer than 8 s), at most 90 s → (records, engines
    seen during the wait, seconds from the turn's release to the run's end, seconds of the whole run)."""
    import fcntl
    import threading

    from moe_lab.controller import turns

    monkeypatch.setenv("MOE_LAB_PRESTART", prestart)
    monkeypatch.delenv(shared.ENV, raising=False)
    tmp_path.mkdir(parents=True, exist_ok=True)
    monkeypatch.setenv(turns.ENV, str(tmp_path / "turn"))
    fd = os.open(tmp_path / "turn", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    out: dict = {}
    t0 = time.monotonic()

    def run():
        try:
            out["recs"] = protocol.run(reproduce, P)
        except BaseException as e:  # noqa: BLE001 - said by the test
            out["error"] = e
        out["end"] = time.monotonic()

    already = _engines_here()  # another test's cluster (a module fixture) is not this run's
    th = threading.Thread(target=run, daemon=True)
    th.start()
    seen: set[int] = set()
    try:
        first_seen = None
        while True:
            now = time.monotonic()
            enough = now - t0 >= 8.0 and (prestart != "1" or (first_seen is not None and now - first_seen >= 3.0))
            if enough or now - t0 >= 90.0:
                break
            assert th.is_alive(), f"the run ended while another held the engines' turn: {out}"
            seen |= _engines_here() - already
            if seen and first_seen is None:
                first_seen = now
            time.sleep(0.1)
    finally:
        released = time.monotonic()
        os.close(fd)
    th.join(300)
    assert "error" not in out and not th.is_alive(), out
    return out["recs"], len(seen), out["end"] - released, out["end"] - t0


def test_a_run_waiting_for_the_engines_turn_launches_its_own_cluster_meanwhile(tmp_path, monkeypatch):
    """A run whose cases need a cluster of their own (no shared one serves them: notebook 04's EP 1 part on one GPU)
    launches it before it waits for the engines' turn, so its engines register and import while the other
    notebook's cases hold the engines; the control (launching early off) starts nothing until its turn. The records
    are the same (CPU forwards are deterministic); nothing is left afterwards."""
    before = _our_ipp_processes()
    ahead, seen_ahead, after_ahead, whole_ahead = _run_behind_the_turn(tmp_path / "a", monkeypatch, "1")
    _assert_none_left(before)
    cold, seen_cold, after_cold, whole_cold = _run_behind_the_turn(tmp_path / "c", monkeypatch, "0")
    _assert_none_left(before)
    print(f"TIME after the turn's release: launched ahead {after_ahead:.1f} s, control {after_cold:.1f} s "
          f"(whole runs {whole_ahead:.1f} / {whole_cold:.1f} s)")
    assert seen_ahead >= P.cluster.engines and seen_cold == 0  # (their nannies are counted too)
    key = [(r["case_key"], r["cross_rank"]["n_mismatch"], r["rerun"]["n_mismatch"]) for r in ahead]
    assert key == [(r["case_key"], r["cross_rank"]["n_mismatch"], r["rerun"]["n_mismatch"]) for r in cold] and key


def test_interrupted_while_waiting_for_the_turn_the_cluster_launched_ahead_is_stopped(tmp_path, monkeypatch):
    import fcntl

    from moe_lab.controller import engine_sets, turns

    monkeypatch.setenv("MOE_LAB_PRESTART", "1")
    monkeypatch.delenv(shared.ENV, raising=False)
    monkeypatch.setenv(turns.ENV, str(tmp_path / "turn"))
    fd = os.open(tmp_path / "turn", os.O_RDWR | os.O_CREAT, 0o644)
    fcntl.flock(fd, fcntl.LOCK_EX)
    before = _our_ipp_processes()
    launched = []
    real = engine_sets.EngineSets.launch_ahead

    def launch_then_interrupt_the_wait(self, target):
        launched.append(real(self, target))
        monkeypatch.setattr(self, "tick", lambda: (_ for _ in ()).throw(KeyboardInterrupt()))
        return launched[-1]

    monkeypatch.setattr(engine_sets.EngineSets, "launch_ahead", launch_then_interrupt_the_wait)
    try:
        with pytest.raises(KeyboardInterrupt):
            protocol.run(reproduce, P)
    finally:
        os.close(fd)
    assert launched == [True]
    _assert_none_left(before)


def _run_twice(monkeypatch, keep: str) -> tuple[list[dict], list[dict], set[int], set[int], object]:
    """Two protocol.runs of the installed release's cases on a cluster of their own, one after the other, as two cells
    of a notebook → (records, records, engines of the first run, of the second, the cluster kept after the second)."""
    from moe_lab.controller import engine_sets

    monkeypatch.setenv("MOE_LAB_KEEP_ENGINES", keep)
    monkeypatch.setenv("MOE_LAB_PRESTART", "0")
    monkeypatch.delenv(shared.ENV, raising=False)
    already = _engines_here()  # another test's cluster (a module fixture) is not these runs'
    first, engines = [], []
    for _ in range(2):
        recs = protocol.run(reproduce, P)
        first.append(recs)
        k = engine_sets.kept()
        engines.append(_engines_here() - already)
        if k is not None:  # its layers dropped: nothing of the last run's cases holds memory while it waits
            held = "len(__import__('moe_lab.engine.dist', fromlist=['STATE']).STATE.get('layers', {}))"
            assert k.run(eval, held) == [0] * P.cluster.engines
    return first[0], first[1], engines[0], engines[1], engine_sets.kept()


def test_a_notebooks_next_run_takes_the_engines_its_last_run_kept(monkeypatch, caplog):
    """Two runs on a cluster of their own, as two cells of one notebook (06's training cases, then its routing
    replay): the second takes the engines the first kept — the same processes, no cold start — and measures the
    same; stopping the kept cluster leaves nothing. The control (keeping off): the second run starts new engines
    and nothing is left between the runs."""
    import logging

    from moe_lab.controller import engine_sets

    before = _our_ipp_processes()
    try:
        with caplog.at_level(logging.INFO, logger="moe_lab.controller.engine_sets"):
            a, b, first, second, kept = _run_twice(monkeypatch, "1")
        assert "using the engines kept from this process's last run" in caplog.text
        assert kept is not None and first and first == second
    finally:
        engine_sets.stop_kept()
    _assert_none_left(before)
    ca, cb, cfirst, csecond, ckept = _run_twice(monkeypatch, "0")
    assert ckept is None and not cfirst and not csecond  # the control: every run stops its own engines
    _assert_none_left(before)
    key = [(r["case_key"], r["cross_rank"]["n_mismatch"], r["rerun"]["n_mismatch"]) for r in a]
    assert key and all(key == [(r["case_key"], r["cross_rank"]["n_mismatch"], r["rerun"]["n_mismatch"])
                               for r in recs] for recs in (b, ca, cb))


def test_kept_engines_nobody_asks_for_are_stopped_from_their_timer(monkeypatch):
    """The kept cluster's expiry stops real engines from its timer thread (as a notebook kernel idles past `KEEP_S`):
    nothing of it is left, and nothing is kept any more."""
    from moe_lab.controller import engine_sets

    before = _our_ipp_processes()
    try:
        _run_twice(monkeypatch, "1")  # (a second run: the kept engines are taken and kept again)
        c = engine_sets.take_kept()
        assert c is not None and c.client is not None
        engine_sets.keep(c, seconds=0.5)
        deadline = time.monotonic() + 30
        while (engine_sets.kept() is not None or c.client is not None) and time.monotonic() < deadline:
            time.sleep(0.2)
        assert engine_sets.kept() is None and c.client is None
    finally:
        engine_sets.stop_kept()  # a failed check leaves no engines to the next test
    _assert_none_left(before)
