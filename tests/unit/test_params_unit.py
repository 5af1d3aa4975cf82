"""Every notebook's parameters are one typed dataclass (defaults once, checks once), profiles are checked
against them, and no key is validated that nothing reads (the old `repeats`)."""

from __future__ import annotations

import dataclasses
import re
from pathlib import Path

import pytest

from moe_lab import profiles
from moe_lab import profiles as P
from moe_lab.questions.compound.params import CompoundParams
from moe_lab.questions.reproduce.params import LayoutParams
from moe_lab.questions.truncation.params import TruncationParams
import moe_lab
from moe_lab.config import MoEConfig

ROOT = Path(moe_lab.__file__).parent


def _read_anywhere(key: str, texts: dict[str, str]) -> list[str]:
    """The package files (other than the ones that declare keys) that read `key`: as a string or an attribute."""
    pat = re.compile(rf"[\"']{re.escape(key)}[\"']|\.{re.escape(key)}\b")
    return [name for name, t in texts.items() if pat.search(t)]


def _unread(keys, texts) -> list[str]:
    moe_fields = {f.name for f in dataclasses.fields(MoEConfig)}
    return sorted(k for k in keys if not (k in profiles._MOE_KEYS and k in moe_fields) and not _read_anywhere(k, texts))


def _without_checks(path: Path) -> str:
    """A file's text with what only declares, validates or parses keys blanked: `profiles.check` and its key sets,
    `profiles._typed` (the flat profile → the run config's sections), the dataclasses' `__post_init__` and their
    field declarations (the questions' and the run config's). What is left reads keys (or nothing does)."""
    import ast

    text = path.read_text()
    lines = text.splitlines()
    for node in ast.walk(ast.parse(text)):
        declares = isinstance(node, ast.ClassDef) and path.name in ("params.py", "run_config.py")
        names_keys = isinstance(node, ast.Assign) and any(getattr(t, "id", "") in ("_COMMON", "_KNOWN", "_MOE_KEYS")
                                                          for t in node.targets)
        if names_keys or isinstance(node, ast.FunctionDef) and node.name in ("check", "__post_init__", "_typed"):
            for i in range(node.lineno - 1, node.end_lineno):
                lines[i] = ""
        if declares:
            for item in node.body:
                if isinstance(item, ast.AnnAssign) or (isinstance(item, ast.Expr) and isinstance(item.value,
                                                                                                ast.Constant)):
                    for i in range(item.lineno - 1, item.end_lineno):
                        lines[i] = ""
    return "\n".join(lines)


def _package_texts() -> dict[str, str]:
    return {str(f.relative_to(ROOT)): _without_checks(f) for f in ROOT.rglob("*.py")}


def test_every_key_a_profile_may_hold_is_read_by_the_code():
    texts = _package_texts()
    assert _unread(profiles._KNOWN, texts) == []
    for section in P.SECTIONS.values():  # the fields of 06's and 07's objects too
        assert _unread(section.__dataclass_fields__, texts) == [], section.__name__


def test_the_unread_key_check_sees_an_unread_key():
    """The control: a key nothing reads (the old `repeats`) and a made-up one are reported; a read one is not."""
    assert _unread({"repeats_of_nothing", "zz_never", "layout_reference"}, _package_texts()) == \
        ["repeats_of_nothing", "zz_never"]


def test_each_key_has_one_owner():
    owners = {}
    for c in P.FLAT:
        for k in c.__dataclass_fields__:
            assert k not in owners, f"{k} in {owners.get(k)} and {c.__name__}"
            owners[k] = c.__name__
    assert not set(owners) & profiles._COMMON and not set(owners) & set(P.SECTIONS)
    assert profiles._KNOWN == set(profiles._MOE_KEYS) | profiles._COMMON | P.FLAT_KEYS | set(P.SECTIONS)


def test_defaults_come_from_the_dataclass_and_a_profile_value_wins():
    from moe_lab.questions.compound import experiment as compound
    from moe_lab.questions.reproduce import layouts

    cpu = profiles.load("cpu", {"dispatchers": ["allgather"]})
    raw = cpu.raw()
    without = profiles.parse({k: v for k, v in raw.items() if k not in (
        "depth_layers", "depth_settings", "layouts", "layout_reference", "layout_router_dtypes")})
    depth = [c for c in compound.cases(without) if c.kind == "depth"]
    assert {c.knobs["setting"] for c in depth} == set(CompoundParams.depth_settings)
    assert max(c.knobs["layers"] for c in depth) == CompoundParams.depth_layers
    with pytest.raises(ValueError, match="layouts entry 'tp2,ep2,etp1'|layouts entry 'ep4'"):
        layouts.cases(without.with_overrides(engines=2))  # the default layouts need 4 ranks: refused, named
    lay = layouts.cases(without.with_overrides(engines=4))
    assert [c.knobs["layout_spec"] for c in lay[:len(LayoutParams.layouts)]] == list(LayoutParams.layouts)
    mine = layouts.cases(without.with_overrides(engines=4, layouts=["ep4", "ep2"], layout_reference="ep2"))
    assert [c.knobs["layout_spec"] for c in mine][:2] == ["ep2", "ep4"]  # the reference first


@pytest.mark.parametrize("kv, said", [
    ({"layouts": "ep1;ep1"}, "must be a non-empty list of distinct layouts"),
    ({"layouts": ["ep1", "tp0"]}, "layouts entry"),
    ({"layout_router_dtypes": ["bf16"]},
     "layout_router_dtypes (['bf16']) must be a non-empty list of none, fp32, fp64"),
    ({"probs_fp32_gather": [0, 1]}, "probs_fp32_gather ([0, 1]) must be a non-empty list of true/false"),
    ({"deterministic": []}, "deterministic ([]) must be a non-empty list of true/false"),
    ({"truncation_engines": [0]}, "truncation_engines ([0]) must be a list of positive integers"),
    ({"truncation_tiles": "256"}, "truncation_tiles ('256') must be a list of positive integers"),
    ({"depth_layers": 0}, "depth_layers (0) must be a positive integer"),
    ({"depth_ffn_hidden": -1}, "depth_ffn_hidden (-1) must be 0"),
    ({"depth_settings": []}, "depth_settings ([]) must be a non-empty list"),
    ({"sweep_router_dtypes": ["fp16"]}, "sweep_router_dtypes (['fp16'])"),
    ({"releases": ["0.12.3", "0.12.3"]}, "names a release twice"),
])
def test_each_notebooks_dataclass_refuses_bad_values_in_one_line(kv, said):
    with pytest.raises(ValueError) as e:
        profiles.load("cpu", kv)
    assert said in str(e.value) and "\n" not in str(e.value) and str(e.value).startswith("profile 'cpu': ")


def test_a_p_string_becomes_the_list_it_means():
    p = profiles.load("cpu", {"layouts": "ep1;tp2,ep2", "releases": "installed,0.12.3",
                              "truncation_remedies": "deterministic,no_splitk"})
    assert p.raw()["layouts"] == ["ep1", "tp2,ep2"] and p.raw()["releases"] == ["installed", "0.12.3"]
    assert TruncationParams.of(p).truncation_remedies == ("deterministic", "no_splitk")
    assert LayoutParams.of(p).order() == ["ep1", "tp2,ep2"]
