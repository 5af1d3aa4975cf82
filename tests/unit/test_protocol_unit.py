"""The experiment protocol without engines: one key per measurement, checks before anything starts, records
streamed case by case and resumed, never reused for another parameter. A fake cluster runs each rank's engine
function in this process."""

import json

import pytest

from moe_lab.config import ClusterConfig, MoEConfig
from moe_lab.experiments import protocol
from moe_lab.experiments.protocol import Case
from moe_lab import results

CPU = ClusterConfig(device="cpu", engines=2)
ENV = {"device": "cpu", "world": 2, "backend": "gloo", "ranks_per_gpu": None, "gpu": None, "megatron_core": "0.16.1"}


def _case(**kw):
    base = dict(experiment="fake", moe=MoEConfig(), cut=90, knobs={"remedy": "none"})
    base.update(kw)
    return Case(**base)


def test_the_key_covers_the_whole_measurement():
    k0 = protocol.case_key(_case(), ENV, CPU)
    assert k0 == protocol.case_key(_case(), dict(ENV), CPU)  # the same measurement, the same key
    changes = [
        dict(case=_case(moe=MoEConfig(seq_len=96))), dict(case=_case(moe=MoEConfig(seed=7))),
        dict(case=_case(moe=MoEConfig(hidden=128))), dict(case=_case(moe=MoEConfig(dispatcher="alltoall"))),
        dict(case=_case(cut=60)), dict(case=_case(knobs={"remedy": "no_splitk"})), dict(case=_case(kind="routing")),
        dict(case=_case(experiment="other")), dict(case=_case(engine_env=(("CUBLAS_WORKSPACE_CONFIG", ":4096:8"),))),
        dict(env=dict(ENV, megatron_core="0.12.3")), dict(env=dict(ENV, world=4)), dict(env=dict(ENV, device="cuda")),
        dict(env=dict(ENV, gpu="NVIDIA H200")), dict(env=dict(ENV, ranks_per_gpu=4, backend="gloo")),
        dict(ccfg=CPU.replace(env=(("NCCL_ALGO", "Tree"),))),
    ]
    keys = {protocol.case_key(ch.get("case", _case()), ch.get("env", ENV), ch.get("ccfg", CPU)) for ch in changes}
    assert len(keys) == len(changes) and k0 not in keys


def test_key_fields_name_the_layer_and_the_machine():
    f = protocol.key_fields(_case(), ENV, CPU)
    assert f["config"]["seq_len"] == 128 and f["world"] == 2 and f["megatron_core"] == "0.16.1" and f["source"]


def test_checks_run_before_anything_starts():
    with pytest.raises(ValueError, match=r"num_experts \(8\) must be divisible by ep \(3\)"):
        protocol.check_all([_case()], ClusterConfig(device="cpu", engines=3))
    with pytest.raises(ValueError, match=r"cut \(128\) must be an integer in 1..seq_len-1"):
        protocol.check_all([_case(cut=128)], CPU)
    with pytest.raises(ValueError, match=r"router_dtype \('fp32'\) needs megatron-core >= 0.12.0"):
        protocol.check_all([_case(moe=MoEConfig(router_dtype="fp32"), release="0.11.0")], CPU)

    class Hook:
        @staticmethod
        def not_applicable(case, version):
            return "no router dtype before 0.12" if case.moe.router_dtype != "none" and version < "0.12" else None

    skipped = protocol.check_all([_case(moe=MoEConfig(router_dtype="fp32"), release="0.11.0")], CPU, Hook)
    assert list(skipped.values()) == ["no router dtype before 0.12"]


class FakeCluster:
    """Two 'ranks' that run the engine function here; `fail_at` raises on that call (an engine death)."""

    def __init__(self, fail_at=None):
        self.config, self.calls, self.fail_at, self.client = CPU, [], fail_at, object()
        self.info = [dict(ENV, rank=r, pid=100 + r, torch="2.13.0") for r in range(2)]

    def run(self, fn, payload, what=""):
        self.calls.append(payload)
        if self.fail_at is not None and len(self.calls) == self.fail_at:
            raise KeyboardInterrupt("engine died")
        return [fn(payload, rank=r) for r in range(2)]

    def stop(self, graceful=True):
        pass


class Fake:
    NAME, NOTEBOOK = "fake", "99"

    @staticmethod
    def cases(params):
        return [_case(moe=MoEConfig(seq_len=params["seq_len"]), knobs={"i": i}, label=f"case {i}") for i in range(3)]

    @staticmethod
    def on_engine(payload, rank=0):
        return {"rank": rank, "value": payload["knobs"]["i"] * 10 + rank}

    @staticmethod
    def records(case, per_rank):
        return [{"value": max(r["value"] for r in per_rank)}]


def test_records_stream_case_by_case_and_a_rerun_resumes(tmp_path, monkeypatch):
    monkeypatch.setattr(protocol, "expected_env", lambda ccfg, release, det: dict(ENV))
    path = tmp_path / "results.json"
    with pytest.raises(KeyboardInterrupt):
        protocol.run(Fake, {"seq_len": 128}, cluster=FakeCluster(fail_at=3), results=path)
    assert [r["value"] for r in results.load(path)] == [1, 11]  # the two finished cases are kept
    c = FakeCluster()
    recs = protocol.run(Fake, {"seq_len": 128}, cluster=c, results=path)
    assert [r["value"] for r in recs] == [1, 11, 21] and len(c.calls) == 1  # only the missing case ran
    r0 = recs[0]
    assert r0["notebook"] == "99" and r0["experiment"] == "fake" and r0["i"] == 0 and r0["case_key"]
    assert r0["torch"] == "2.13.0" and "pid" not in r0 and r0["code"]["source_sha"]  # env + provenance, once
    assert len(results.load(path)) == 3


def test_another_layer_parameter_is_never_served_from_the_file(tmp_path, monkeypatch):
    """A second run into the same file with another seq_len measures everything again."""
    monkeypatch.setattr(protocol, "expected_env", lambda ccfg, release, det: dict(ENV))
    path = tmp_path / "results.json"
    protocol.run(Fake, {"seq_len": 128}, cluster=FakeCluster(), results=path)
    c = FakeCluster()
    recs = protocol.run(Fake, {"seq_len": 96}, cluster=c, results=path)
    assert len(c.calls) == 3 and all(r["config"]["seq_len"] == 96 for r in recs)
    assert sorted(r["config"]["seq_len"] for r in results.load(path)) == [96] * 3 + [128] * 3


def test_a_corrupt_results_file_is_refused_before_anything_is_measured(tmp_path, monkeypatch):
    monkeypatch.setattr(protocol, "expected_env", lambda ccfg, release, det: dict(ENV))
    path = tmp_path / "results.json"
    path.write_text("[{")
    c = FakeCluster()
    with pytest.raises(results.ResultsFileError, match="not valid JSON"):
        protocol.run(Fake, {"seq_len": 128}, cluster=c, results=path)
    assert c.calls == [] and path.read_text() == "[{"


def test_not_applicable_cases_get_a_record_that_says_why(tmp_path, monkeypatch):
    monkeypatch.setattr(protocol, "expected_env", lambda ccfg, release, det: dict(ENV))

    class Partly(Fake):
        @staticmethod
        def not_applicable(case, version):
            return "not in this release" if case.knobs["i"] == 1 else None

    c = FakeCluster()
    recs = protocol.run(Partly, {"seq_len": 128}, cluster=c, results=tmp_path / "r.json")
    assert [r.get("skipped") for r in recs] == [None, "not in this release", None] and len(c.calls) == 2
    in_file = json.loads((tmp_path / "r.json").read_text())
    assert [r["skipped"] for r in in_file if "skipped" in r] == ["not in this release"] and len(in_file) == 3


def test_note_run_counts_add_up_within_a_run_and_restart_with_the_next(tmp_path, monkeypatch):
    """cases-NN.json: the keys a notebook's run showed and how many cases it measured and reused;
    two protocol runs inside one notebook run add up, a new `moe-lab run` (another run id) starts again."""
    import json

    from moe_lab.experiments import protocol

    res = tmp_path / "results.json"
    monkeypatch.setattr(protocol, "RUN_ID", "run-a")
    protocol.note_run(res, "03", ["k1", "k2"], measured=2, reused=0)
    protocol.note_run(res, "03", ["k2", "k3"], measured=1, reused=1)
    d = json.loads((tmp_path / "cases-03.json").read_text())
    assert d == {"run_id": "run-a", "keys": ["k1", "k2", "k3"], "measured": 3, "reused": 1}
    monkeypatch.setattr(protocol, "RUN_ID", "run-b")
    protocol.note_run(res, "03", ["k1"], measured=0, reused=1)
    assert json.loads((tmp_path / "cases-03.json").read_text()) == {"run_id": "run-b", "keys": ["k1"], "measured": 0,
                                                                    "reused": 1}
    assert protocol.resume_line("promotion", 0, 72, 4) == ("promotion: 0 case(s) measured now, 72 reused from "
                                                           "results.json (same key: code, layer, environment), 4 not "
                                                           "applicable to their release")


def test_the_engines_measure_a_layouts_cases_together_and_the_records_keep_case_order(tmp_path, monkeypatch):
    """A change of layout remakes megatron's process groups on every rank: the cases of one parallel state run
    together, each state where its first case stands (the first case first), and the records come back in case
    order. Sequence parallelism is not a state of its own. Control: the measured order differs from case order."""
    from moe_lab.layout import Layout

    monkeypatch.setattr(protocol, "expected_env", lambda ccfg, release, det: dict(ENV))
    specs = ["ep2", "tp2,ep1", "ep2", "tp2,ep1,sp", "ep1", "tp2,ep1", "ep1"]

    class Layouts(Fake):
        @staticmethod
        def cases(params):
            return [_case(layout=Layout.parse(s), knobs={"i": i}, label=s) for i, s in enumerate(specs)]

    c = FakeCluster()
    recs = protocol.run(Layouts, {}, cluster=c, results=tmp_path / "r.json")
    measured = [p["knobs"]["i"] for p in c.calls]
    assert measured == [0, 2, 1, 3, 5, 4, 6] and measured != sorted(measured)
    assert [r["value"] for r in recs] == [i * 10 + 1 for i in range(len(specs))]  # case order
    states = [Layouts.cases({})[i].layout.on(2).parallel_state for i in measured]
    switches = sum(a != b for a, b in zip(states, states[1:]))
    assert switches == 2 and len(set(states)) == 3  # each state once, against 5 switches in case order
    resumed = FakeCluster()  # a resumed run measures only what is missing, in the same grouping
    (tmp_path / "r.json").write_text(json.dumps([r for r in recs if r["value"] not in (21, 51)]))
    protocol.run(Layouts, {}, cluster=resumed, results=tmp_path / "r.json")
    assert [p["knobs"]["i"] for p in resumed.calls] == [2, 5]
