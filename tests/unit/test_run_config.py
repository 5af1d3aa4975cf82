"""The run config is parsed once (`profiles.load` → `run_config.RunConfig`): typed sections, nothing mutated,
`-p section.field` equal to its flat twin, unknown keys / sections / fields refused by name, and the cases every
question gives the SAME as before the config was typed (their keys, with a fixed fake environment and no engines,
against tests/unit/data/case_keys.json: the output of tests/unit/data/case_keys_gen.py on the code before)."""

from __future__ import annotations

import copy
import dataclasses
import json
import runpy
from pathlib import Path

import pytest

from moe_lab import profiles
from moe_lab.config import MoEConfig
from moe_lab.questions import QUESTIONS
from moe_lab.run_config import ClusterSettings, RunConfig, RunSettings

DATA = Path(__file__).parent / "data"
CPU = profiles.load("cpu").raw()


def test_every_questions_cases_keep_their_keys():
    gen = runpy.run_path(str(DATA / "case_keys_gen.py"))
    before = json.loads((DATA / "case_keys.json").read_text())
    now = gen["main"]()
    assert set(now) == set(before) and all(now[k] == before[k] for k in before)
    assert sum(len(v) for r in before.values() for v in r.values()) > 500  # a real list, every question in it
    assert {k.split(".")[0] for r in before.values() for k in r} == {q.name for q in QUESTIONS}
    # the control: a different profile gives different keys (the check can fail)
    import moe_lab.controller.placement as placement
    from unittest import mock

    with mock.patch.object(placement, "visible_gpus", return_value=8), \
            mock.patch("moe_lab.controller.launchers.launcher_settings", return_value=None):
        other = gen["keys"]("cpu", {"seq_len": 64, "cut": 32})
    assert other["reproduce.experiment"] != before["cpu {}"]["reproduce.experiment"]


def test_a_profile_parses_into_typed_sections():
    c = profiles.load("cpu")
    assert isinstance(c, RunConfig) and isinstance(c.layer, MoEConfig)
    assert isinstance(c.cluster, ClusterSettings) and isinstance(c.run, RunSettings)
    assert c.cluster.device == "cpu" and c.run.dispatchers == ("allgather", "alltoall") and c.run.trials == 3
    for q in QUESTIONS:  # every registered question's typed parameters, from the registry
        if q.params is not None:
            assert isinstance(c.question(q.name), q.params) and c.params(q.params) is c.question(q.name)
    with pytest.raises(dataclasses.FrozenInstanceError):
        c.run = None  # frozen
    with pytest.raises(KeyError, match="no question 'nope'"):
        c.question("nope")


def test_nothing_is_mutated(tmp_path):
    raw = {"device": "cpu", "engines": 2, "dispatchers": ["allgather"], "router_dtypes": ["none"],
           "training": {"steps": 3}}
    p = tmp_path / "p.json"
    p.write_text(json.dumps(raw))
    over = {"dispatchers": "allgather,alltoall", "layouts": "ep1;ep2", "training.steps": 5, "run.trials": 2}
    over0 = copy.deepcopy(over)
    c = profiles.load(str(p), over)
    assert over == over0 and json.loads(p.read_text()) == raw  # the overrides and the file as they were
    assert c.run.dispatchers == ("allgather", "alltoall") and c.question("training").steps == 5
    d = c.raw()
    d["dispatchers"].append("x")  # a copy: the config is unchanged
    assert c.run.dispatchers == ("allgather", "alltoall") and c.raw()["dispatchers"] == ["allgather", "alltoall"]
    flat = profiles.load("cpu", {"dispatchers": "allgather"})
    assert flat.raw()["dispatchers"] == ["allgather"]  # a -p string is the list it means, in the config only


def test_with_overrides_is_a_new_config():
    c = profiles.load("cpu")
    d = c.with_overrides(engines=2)
    assert (c.cluster.engines, d.cluster.engines) == (4, 2) and d.layer == c.layer
    assert c.replace(**{"layer.seq_len": 256}).layer.seq_len == 256 and c.layer.seq_len == 128


@pytest.mark.parametrize("dotted, flat", [
    ({"training.steps": 5}, {"training": {**CPU.get("training", {}), "steps": 5}}),
    ({"layer.seq_len": 256}, {"seq_len": 256}),
    ({"run.trials": 2}, {"trials": 2}),
    ({"run.dispatchers": "alltoall"}, {"dispatchers": ["alltoall"]}),
    ({"cluster.engines": 2}, {"engines": 2}),
    ({"seq_len.seq_lens": "64,96"}, {"seq_lens": [64, 96]}),
    ({"reproduce.layouts": "ep1;ep2"}, {"layouts": ["ep1", "ep2"]}),
    ({"presets.scale": 0.5}, {"presets": {**CPU.get("presets", {}), "scale": 0.5}}),
])
def test_section_field_equals_its_flat_twin(dotted, flat):
    a, b = profiles.load("cpu", dotted), profiles.load("cpu", flat)
    assert a == b and a.questions == b.questions and a.raw() == b.raw()
    assert a != profiles.load("cpu")  # the control: the override changed something


def test_a_dotted_training_field_keeps_the_profiles_other_training_fields():
    base = profiles.load("cpu").question("training")
    c = profiles.load("cpu", {"training.steps": 7}).question("training")
    assert c.steps == 7 and dataclasses.replace(c, steps=base.steps) == base


@pytest.mark.parametrize("over, said", [
    ({"nope": 1}, "unknown key(s) ['nope']"),
    ({"nope.x": 1}, "unknown section 'nope'"),
    ({"layer.nope": 1}, "section 'layer' has no field 'nope'"),
    ({"training.nope": 1}, "section 'training' has no field 'nope'"),
    ({"run.trials": 0}, "trials (0) must be a positive integer"),
])
def test_unknown_keys_sections_and_fields_are_refused_by_name(over, said):
    with pytest.raises(ValueError) as e:
        profiles.load("cpu", over)
    assert said in str(e.value) and str(e.value).startswith("profile 'cpu': ") and "\n" not in str(e.value)


def test_loading_probes_no_gpu(monkeypatch):
    import moe_lab.controller.placement as placement

    def boom():
        raise AssertionError("a GPU probe at load")

    monkeypatch.setattr(placement, "visible_gpus", boom)
    c = profiles.load("gpu", {"releases": ["installed"], "one_gpu_engines": 4})  # no probe here
    with pytest.raises(AssertionError, match="a GPU probe"):
        placement.from_settings(c.cluster)  # the control: building the cluster's config probes


def test_the_cli_refuses_a_bad_section_field_before_anything_starts(tmp_path, capsys):
    from moe_lab import cli

    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "-p", "training.nope=1", "--out", str(tmp_path / "r")])
    err = capsys.readouterr().err
    assert rc == 2 and "section 'training' has no field 'nope'" in err and not (tmp_path / "r").exists()
    rc = cli.main(["run", "--profile", "cpu", "--only", "01", "-p", "trainin.steps=1", "--out", str(tmp_path / "r")])
    assert rc == 2 and "unknown section 'trainin'" in capsys.readouterr().err


def test_public_settings_show_a_sections_zero_as_the_profiles_value():
    """A section's layer override of 0 means "the profile's": the report says which value that is (a set value, the
    control, is shown as set)."""
    from moe_lab import profiles

    p = profiles.load("cpu", {"training.num_experts": 0, "training.topk": 3})
    t = p.public()["training"]
    assert t["num_experts"] == f"{p.public()['num_experts']} (the profile's)" and t["topk"] == 3


def test_a_profiles_description_stays_through_overrides():
    c = profiles.load("gpu")
    assert c.about and "one H200" in c.about
    assert c.with_overrides({"trials": 2}).about == c.about == profiles.load("gpu", {"trials": 2}).about
    assert profiles.parse({"device": "cpu", "engines": 2, "dispatchers": ["allgather"],
                           "router_dtypes": ["none"]}).about == ""  # a profile without one says nothing
