"""A device out of memory is a fault, not a finding: the engine functions that turn a setting a machine cannot run
into a record ("available": False, the same on every rank, before any collective) raise it again, because it can
strike one rank of several while the others wait in a collective (one H100, four ranks of the gpu profile: one rank's
out-of-memory in notebook 05 left the run waiting on the collective timeout). The controller then names the rank,
says what to do and stops the engines at once. The controls: any other RuntimeError still makes the record."""

import importlib

import pytest
import torch

from moe_lab.controller import diagnosis
from moe_lab.engine import toolkit

OOM = torch.OutOfMemoryError("CUDA out of memory. Tried to allocate 128.00 MiB. GPU 0 has a total capacity of 79.18 GiB")
OTHER = RuntimeError("no Triton here")

WRAPPERS = [("moe_lab.questions.compound.experiment", "engine_backward", {"kind": "backward"}),
            ("moe_lab.questions.training.experiment", "engine_train", {}),
            ("moe_lab.questions.oracle.gradients", "engine_gradients", {}),
            ("moe_lab.questions.oracle.trajectory", "engine_trajectory", {})]


@pytest.fixture(autouse=True)
def rank0(monkeypatch):
    monkeypatch.setattr(toolkit.tdist, "get_rank", lambda *a: 0)  # torch.distributed's, as every wrapper asks it


def test_unavailable_records_a_setting_and_raises_an_out_of_memory():
    assert toolkit.unavailable(OTHER) == {"rank": 0, "available": False, "reason": "RuntimeError: no Triton here"}
    with pytest.raises(torch.OutOfMemoryError):
        toolkit.unavailable(OOM)
    assert toolkit.is_out_of_memory(RuntimeError("CUDA out of memory. Tried to allocate 2 GiB")) and \
        not toolkit.is_out_of_memory(OTHER)


@pytest.mark.parametrize("module, inner, payload", WRAPPERS)
def test_every_engine_wrapper_raises_an_out_of_memory_and_records_anything_else(monkeypatch, module, inner, payload):
    mod = importlib.import_module(module)
    for err, raised in ((OOM, True), (OTHER, False)):
        def boom(*a, **k):
            raise err

        monkeypatch.setattr(mod, inner, boom)
        if raised:
            with pytest.raises(torch.OutOfMemoryError):
                mod.on_engine(payload)
        else:
            assert mod.on_engine(payload)["available"] is False


def test_truncations_batch_invariant_remedy_records_its_failure_but_not_an_out_of_memory(monkeypatch):
    from moe_lab.questions.truncation import experiment as truncation

    payload = {"kind": "case", "moe": {}, "cut": 90, "knobs": {"emulation": "real", "remedy": "batch_invariant_mode",
                                                               "tile": 0}}
    for err, raised in ((OOM, True), (OTHER, False)):
        def boom(*a, **k):
            raise err

        monkeypatch.setattr(truncation, "engine_case", boom)
        if raised:
            with pytest.raises(torch.OutOfMemoryError):
                truncation.on_engine(payload)
        else:
            assert truncation.on_engine(payload)["available"] is False


def test_the_controllers_line_says_what_to_do_about_an_out_of_memory():
    hint = diagnosis.out_of_memory_hint("OutOfMemoryError: CUDA out of memory. Tried to allocate 128.00 MiB")
    assert "fewer ranks per GPU" in hint and "moe-lab preflight" in hint
    assert diagnosis.out_of_memory_hint("RuntimeError: no Triton here") == ""
