"""#22 item 4: imports run one way. Every `import` of moe_lab (module level and inside functions) is read from the
source with `ast`, and the layers' rules (docs/architecture.md) are checked: the engine never reaches the controller,
the experiments never install releases (tools) nor render pages (reporting), findings are records → words (no engine,
controller or experiment), the pure modules import only each other. A control feeds the checker a module that
breaks a rule, so an empty list of violations means something."""

from __future__ import annotations

import ast
import subprocess
import sys
from pathlib import Path

import moe_lab

ROOT = Path(moe_lab.__file__).parent
SUBPACKAGES = ("controller", "engine", "experiments", "findings", "reporting", "tools", "cli")
# Torch-free modules used on both sides: they import only each other.
PURE = ("config", "layout", "models", "params", "releases", "release_dirs", "results", "stats", "fsio", "metrics",
        "provenance", "__version__")
# layer → layers it must never import ("base" = the pure modules; `profiles` loads and checks a profile in the
# controller's process, so it counts as the controller's).
FORBIDDEN = {
    "base": set(SUBPACKAGES) | {"profiles"},
    "engine": {"controller", "experiments", "findings", "reporting", "tools", "cli", "profiles"},
    "controller": {"experiments", "findings", "reporting", "tools", "cli"},
    "experiments": {"reporting", "tools", "cli"},
    "findings": {"engine", "controller", "experiments", "reporting", "tools", "cli", "profiles"},
    "tools": {"reporting", "cli"},
    "reporting": {"cli"},
}


def layer_of(module: str) -> str:
    """'moe_lab.engine.compat' → 'engine'; 'moe_lab.config' → 'base'; 'moe_lab.profiles' → 'profiles'."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "moe_lab":
        return "outside"
    if parts[1] in SUBPACKAGES:
        return parts[1]
    if parts[1] in PURE:
        return "base"
    return parts[1]


def imports_of(source: str, module: str, *, is_package: bool = False) -> set[str]:
    """The moe_lab modules `source` (the text of `module`) imports, at any depth of the file."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            if node.module:
                out.add(target)
            else:  # `from .. import results, profiles`: each name may be a module
                out.update(f"{target}.{a.name}" for a in node.names)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "moe_lab"}


def violations(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """`modules`: {name: (source, is_package)} → one line per import that breaks a layer rule."""
    bad = []
    for name, (src, is_pkg) in sorted(modules.items()):
        frm = layer_of(name)
        for target in sorted(imports_of(src, name, is_package=is_pkg)):
            to = layer_of(target)
            if to in FORBIDDEN.get(frm, ()):
                bad.append(f"{name} ({frm}) imports {target} ({to})")
    return bad


def package_modules() -> dict[str, tuple[str, bool]]:
    out = {}
    for f in ROOT.rglob("*.py"):
        rel = f.relative_to(ROOT.parent).with_suffix("")
        parts = list(rel.parts)
        is_pkg = parts[-1] == "__init__"
        if is_pkg:
            parts = parts[:-1]
        out[".".join(parts)] = (f.read_text(), is_pkg)
    return out


def test_the_package_keeps_its_layers():
    mods = package_modules()
    assert len(mods) > 60 and {"moe_lab.engine.compat", "moe_lab.experiments.protocol"} <= set(mods)
    assert violations(mods) == []


def test_the_checker_sees_a_broken_rule():
    """The control: the imports the layers forbid are reported, relative and absolute, inside functions too."""
    mods = {
        "moe_lab.experiments.fake": ("def f():\n    from ..tools import versions\n", False),
        "moe_lab.engine.fake": ("from moe_lab.controller import cluster\n", False),
        "moe_lab.findings.fake": ("from ..experiments.probe import case\n", False),
        "moe_lab.config": ("import moe_lab.reporting.plots\n", False),  # a pure module's name, a forbidden import
        "moe_lab.findings": ("from . import labels\nfrom .. import results\n", True),  # allowed: own layer, pure
    }
    assert violations(mods) == [
        "moe_lab.config (base) imports moe_lab.reporting.plots (reporting)",
        "moe_lab.engine.fake (engine) imports moe_lab.controller (controller)",
        "moe_lab.experiments.fake (experiments) imports moe_lab.tools (tools)",
        "moe_lab.findings.fake (findings) imports moe_lab.experiments.probe (experiments)",
    ]


def test_the_controller_side_looks_releases_up_without_torch():
    """Loading a profile, the protocol and a release's folder leaves torch (and pip) unimported."""
    code = ("import sys, moe_lab.profiles, moe_lab.experiments.protocol, moe_lab.release_dirs, moe_lab.results\n"
            "moe_lab.profiles.load('cpu', {'releases': ['installed', '0.12.3']})\n"
            "print(sorted(m for m in ('torch', 'pip', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
