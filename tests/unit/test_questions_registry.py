"""The registry of questions (`moe_lab.questions`): every question folder is registered with its notebook, its run
modules follow the protocol, its findings, figures and compare rows load, and a malformed question is refused."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moe_lab import profiles, questions
from moe_lab.questions.spec import Question

ROOT = Path(__file__).resolve().parents[2]
PROTOCOL = ("NAME", "NOTEBOOK", "cases", "on_engine", "records", "verdict")


def test_every_question_has_its_notebook_and_every_numbered_notebook_is_a_question():
    on_disk = {p.stem for p in (ROOT / "notebooks").glob("*.ipynb") if re.match(r"^\d\d_", p.name)}
    assert on_disk == {q.notebook for q in questions.QUESTIONS}
    assert [q.number for q in questions.QUESTIONS] == sorted(q.number for q in questions.QUESTIONS)
    assert len({q.name for q in questions.QUESTIONS}) == len(questions.QUESTIONS)


@pytest.mark.parametrize("q", questions.QUESTIONS, ids=lambda q: q.number)
def test_a_questions_modules_have_the_protocols_parts(q):
    mods = q.run_modules()
    for m in mods:
        missing = [a for a in PROTOCOL if not hasattr(m, a)]
        assert not missing, f"{m.__name__} lacks {missing}"
        assert m.NOTEBOOK == q.number
    assert tuple(m.NAME for m in mods) == q.experiments
    assert q.findings_of([]) == [] or all(f.status for f in q.findings_of([]))  # no records: nothing claimed as PASS
    assert q.figures_module() is not None
    if q.compare:
        assert q.compare_rows()([], [], 2.0) == []
    for e in q.experiments:
        assert questions.by_experiment(e) is q


@pytest.mark.parametrize("q", [q for q in questions.QUESTIONS if q.params is not None], ids=lambda q: q.number)
def test_a_questions_parameters_are_checked_when_the_profile_loads(q):
    """Each question's typed parameters take part in the profile check: a wrong value of its first field is refused
    with a message that names it (the control: the defaults load)."""
    profiles.load("cpu")
    field = next(iter(q.params.__dataclass_fields__))
    key = field if q.params in profiles.FLAT else q.params.KEY
    bad = {field: 12345} if q.params in profiles.FLAT else {q.params.KEY: {field: "not-a-valid!"}}
    with pytest.raises(ValueError, match=re.escape(field)):
        profiles.load("cpu", bad)
    assert key in profiles._KNOWN


def test_no_two_questions_own_one_profile_key():
    owners: dict[str, str] = {}
    for c in questions.params_types():
        keys = [c.KEY] if c not in profiles.FLAT else list(c.__dataclass_fields__)
        for k in keys:
            assert k not in owners, f"{k} is {owners[k]}'s and {c.__name__}'s"
            owners[k] = c.__name__
    assert not set(owners) & profiles._COMMON


def test_records_are_the_question_of_their_notebook_or_else_their_experiment():
    q01 = questions.BY_NUMBER["01"]
    assert q01.owns({"notebook": "01", "experiment": "probe"})
    assert q01.owns({"experiment": "layouts"})  # a record written without a notebook
    assert not q01.owns({"notebook": "02", "experiment": "reproduce"})  # the notebook decides
    assert not q01.owns(["not", "a", "record"])


BASE = dict(number="10", name="example", text="Does it work?", notebook="10_example", package="moe_lab.questions.x",
            experiments=("example",))


@pytest.mark.parametrize("change, says", [
    ({"number": "9"}, "two digits"),
    ({"name": "not-an-identifier"}, "identifier"),
    ({"notebook": "11_example"}, "must start with '10_'"),
    ({"text": "It works."}, "ask a question"),
    ({"experiments": ()}, "at least one"),
])
def test_a_malformed_question_is_refused(change, says):
    Question(**BASE)  # the control: the well-formed one is accepted
    with pytest.raises(ValueError, match=re.escape(says)):
        Question(**{**BASE, **change})


def test_the_registry_refuses_a_folder_without_a_question(tmp_path, monkeypatch):
    """A sub-package of moe_lab.questions that exports no QUESTION is an error naming the folder, not skipped."""
    import importlib
    import sys

    pkg = tmp_path / "moe_lab_questions_probe"
    (pkg / "stray").mkdir(parents=True)
    (pkg / "__init__.py").write_text("")
    (pkg / "stray" / "__init__.py").write_text("X = 1\n")
    monkeypatch.syspath_prepend(str(tmp_path))
    mod = importlib.import_module("moe_lab_questions_probe")
    monkeypatch.setattr(questions, "__path__", mod.__path__)
    monkeypatch.setattr(questions, "__name__", "moe_lab_questions_probe")
    with pytest.raises(TypeError, match="stray"):
        questions._discover()
    sys.modules.pop("moe_lab_questions_probe.stray", None)


def test_a_question_is_a_frozen_value():
    q = questions.QUESTIONS[0]
    with pytest.raises(dataclasses.FrozenInstanceError):
        q.number = "99"


@pytest.mark.parametrize("q", questions.QUESTIONS, ids=lambda q: q.number)
def test_a_notebooks_parameters_cell_says_how_to_choose_the_device_and_a_model(q):
    """Opened in JupyterLab on a GPU node, the parameters cell tells the reader how to run the gpu profile and how to
    aim it at their model (it says 'cpu' by default; `moe-lab run` chooses by itself)."""
    import nbformat

    nb = nbformat.read(ROOT / "notebooks" / f"{q.notebook}.ipynb", as_version=4)
    cell = next(c for c in nb.cells if "parameters" in c.metadata.get("tags", []))
    assert '"gpu"' in cell.source and '"model"' in cell.source and "preflight" in cell.source, q.number
    compile(cell.source, q.notebook, "exec")  # still runs as it is
