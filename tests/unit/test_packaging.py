"""environment.yml and pyproject.toml must name the same dependencies (and the layout of the design card exists)."""

import json
import re
import tomllib
from pathlib import Path

import yaml

ROOT = Path(__file__).resolve().parents[2]


def _name(req: str) -> str:
    return re.split(r"[<>=!~\[ ;]", req.strip(), maxsplit=1)[0].lower().replace("_", "-")


def test_environment_yml_agrees_with_pyproject():
    project = tomllib.loads((ROOT / "pyproject.toml").read_text())["project"]
    runtime = {_name(r) for r in project["dependencies"]}
    test = {_name(r) for r in project["optional-dependencies"]["test"]}
    env = yaml.safe_load((ROOT / "environment.yml").read_text())
    pip = next(d["pip"] for d in env["dependencies"] if isinstance(d, dict) and "pip" in d)
    env_names = {_name(r) for r in pip if not r.startswith("-e")}
    missing = (runtime | test) - env_names
    assert not missing, f"in pyproject.toml but not environment.yml: {sorted(missing)}"
    extra = env_names - runtime - test
    assert not extra, f"in environment.yml but not pyproject.toml: {sorted(extra)}"
    py = next(d for d in env["dependencies"] if isinstance(d, str) and d.startswith("python"))
    assert py.split("=")[1] >= project["requires-python"].lstrip(">=")


def test_design_card_layout():
    for p in ("README.md", "environment.yml", "notebooks", "moe_lab", "tests", "reports", "pyproject.toml", ".ci/run"):
        assert (ROOT / p).exists(), p
    nbs = sorted(p.name for p in (ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb"))
    assert nbs and nbs[0].startswith("01_")


def test_notebooks_are_committed_without_outputs():
    import nbformat

    for p in (ROOT / "notebooks").glob("*.ipynb"):
        raw = json.loads(p.read_text())
        assert all(c.get("id") for c in raw["cells"]), f"{p.name}: a cell without an id (nbformat 4.5 wants one)"
        nb = nbformat.read(p, as_version=4)
        for cell in nb.cells:
            if cell.cell_type == "code":
                assert not cell.outputs and cell.execution_count is None, f"{p.name} has outputs"
        assert any("parameters" in c.get("metadata", {}).get("tags", []) for c in nb.cells), f"{p.name}: no parameters cell"


def test_every_subpackage_is_a_package_an_install_keeps():
    """A folder of modules without __init__.py works from a checkout but is left out of a wheel (find_packages)."""
    from setuptools import find_packages

    found = set(find_packages(str(ROOT), include=["moe_lab*"]))
    folders = {".".join(p.parent.relative_to(ROOT).parts) for p in (ROOT / "moe_lab").rglob("*.py")
               if "__pycache__" not in p.parts}
    assert folders <= found, f"not packages (add __init__.py): {sorted(folders - found)}"
