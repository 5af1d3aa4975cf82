"""Imports run one way. Every `import` of moe_lab (module level and inside functions) is read from the
source with `ast`, and the layers' rules (docs/architecture.md) are checked: the engine never reaches the controller,
the experiments never install releases (tools) nor render pages (reporting), findings are records → words (no engine,
controller or experiment), the pure modules import only each other. The import graph of every module has no ring
(strongly connected components, Tarjan), and no module reads or writes another module's private names (`from x
import _y`, `x._y`, or an attribute `_y` that another module's class owns). Each check has a control that feeds it
what it must catch, so an empty list of violations means something."""

from __future__ import annotations

import ast
import re
import subprocess
import sys
from pathlib import Path

import moe_lab

ROOT = Path(moe_lab.__file__).parent
SUBPACKAGES = ("controller", "engine", "experiments", "findings", "reporting", "tools", "cli")
# Torch-free modules used on both sides: they import only each other.
PURE = ("config", "layout", "models", "params", "records", "releases", "release_dirs", "results", "stats", "fsio",
        "metrics", "provenance", "version")
# layer → layers it must never import ("base" = the pure modules; `profiles` loads and checks a profile in the
# controller's process, so it counts as the controller's). A question folder's modules belong to the layers of what
# they do (`QUESTION_LAYERS`); its `__init__` (the Question), `params` and `questions.spec` are "question" (data, no
# torch); the registry (`moe_lab.questions`) is "questions".
FORBIDDEN = {
    "base": set(SUBPACKAGES) | {"profiles", "question", "questions"},
    "engine": {"controller", "experiments", "findings", "reporting", "tools", "cli", "profiles", "question",
               "questions"},
    "controller": {"experiments", "findings", "reporting", "tools", "cli", "question", "questions"},
    "experiments": {"reporting", "tools", "cli", "questions"},
    "findings": {"engine", "controller", "experiments", "reporting", "tools", "cli", "profiles", "questions"},
    "question": {"engine", "controller", "experiments", "findings", "reporting", "tools", "cli", "profiles"},
    "questions": {"engine", "controller", "experiments", "reporting", "tools", "cli", "profiles"},
    "tools": {"reporting", "cli"},
    "reporting": {"cli"},
}
QUESTION_LAYERS = {"experiment": "experiments", "layouts": "experiments", "verdict": "experiments",
                   "findings": "findings", "layouts_findings": "findings", "compare": "findings",
                   "figures": "reporting", "params": "question", "QUESTION": "question", "record": "question",
                   "layouts_record": "question", "rule": "findings", "gradients": "experiments",
                   "trajectory": "experiments", "gradients_findings": "findings", "gradients_params": "question",
                   "gradients_figures": "reporting", "rule_torch": "experiments", "memory": "question"}
"""A question folder's modules → their layer; an unknown module name in a folder is an error (say its layer here)."""


def layer_of(module: str) -> str:
    """'moe_lab.engine.compat' → 'engine'; 'moe_lab.config' → 'base'; 'moe_lab.profiles' → 'profiles'."""
    parts = module.split(".")
    if len(parts) < 2 or parts[0] != "moe_lab":
        return "outside"
    if parts[1] == "questions":
        if len(parts) == 2:
            return "questions"
        if len(parts) == 3:  # the spec, or a question's package (its __init__: the Question)
            return "question"
        if parts[3] not in QUESTION_LAYERS:
            raise ValueError(f"{module}: a question folder's module of no known layer (tests/unit/test_layering.py "
                             f"QUESTION_LAYERS)")
        return QUESTION_LAYERS[parts[3]]
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


def edges_of(source: str, module: str, known: set[str], *, is_package: bool = False) -> set[str]:
    """The moe_lab modules `module` imports, at any depth of the file (inside functions and `if TYPE_CHECKING:`
    too), each resolved to the module itself: `from . import layer` → moe_lab.engine.layer, `from .dist import
    STATE` → moe_lab.engine.dist. `known`: every module's name."""
    package = module if is_package else module.rsplit(".", 1)[0]
    out = set()
    for node in ast.walk(ast.parse(source)):
        if isinstance(node, ast.ImportFrom):
            if node.level:
                base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                target = ".".join(base + ([node.module] if node.module else []))
            else:
                target = node.module or ""
            for a in node.names:
                out.add(f"{target}.{a.name}" if f"{target}.{a.name}" in known else target)
        elif isinstance(node, ast.Import):
            out.update(a.name for a in node.names)
    return {m for m in out if m.split(".")[0] == "moe_lab" and m != module}


def import_graph(modules: dict[str, tuple[str, bool]]) -> dict[str, set[str]]:
    known = set(modules)
    return {name: edges_of(src, name, known, is_package=is_pkg) & known for name, (src, is_pkg) in modules.items()}


def rings(graph: dict[str, set[str]]) -> list[list[str]]:
    """The import rings of `graph` (module → modules it imports): every strongly connected component of more than
    one module, or a module that imports itself (Tarjan), each sorted; sorted."""
    index: dict[str, int] = {}
    low: dict[str, int] = {}
    stack: list[str] = []
    on_stack: set[str] = set()
    out = []

    def visit(v: str) -> None:
        index[v] = low[v] = len(index)
        stack.append(v)
        on_stack.add(v)
        for w in sorted(graph.get(v, ())):
            if w not in index:
                visit(w)
                low[v] = min(low[v], low[w])
            elif w in on_stack:
                low[v] = min(low[v], index[w])
        if low[v] == index[v]:
            comp = []
            while True:
                w = stack.pop()
                on_stack.discard(w)
                comp.append(w)
                if w == v:
                    break
            if len(comp) > 1 or v in graph.get(v, ()):
                out.append(sorted(comp))

    for v in sorted(graph):
        if v not in index:
            visit(v)
    return sorted(out)


_PRIVATE = re.compile(r"^_[A-Za-z0-9]\w*$")  # _x, never __x__
SELF = {"self", "cls"}


def _owned(tree: ast.AST) -> set[str]:
    """Private attributes the classes of a module own: `self._x = ...` in a method, `_x: T` in a class body, a
    method `def _x`."""
    out = set()
    for node in ast.walk(tree):
        if isinstance(node, ast.ClassDef):
            for item in node.body:
                if isinstance(item, ast.AnnAssign) and isinstance(item.target, ast.Name):
                    out.add(item.target.id)
                elif isinstance(item, (ast.FunctionDef, ast.AsyncFunctionDef)):
                    out.add(item.name)
        elif isinstance(node, ast.Attribute) and isinstance(node.ctx, ast.Store) \
                and isinstance(node.value, ast.Name) and node.value.id in SELF:
            out.add(node.attr)
    return {a for a in out if _PRIVATE.match(a)}


def private_reaches(modules: dict[str, tuple[str, bool]]) -> list[str]:
    """One line per place a module reads or writes another module's private name: `from x import _y`, `x._y`
    where x is a moe_lab module, or `obj._y` (not self/cls) where `_y` is an attribute another module's class owns
    and this one's do not."""
    known = set(modules)
    trees = {name: ast.parse(src) for name, (src, _) in modules.items()}
    owners: dict[str, set[str]] = {}
    for name, tree in trees.items():
        for a in _owned(tree):
            owners.setdefault(a, set()).add(name)
    bad = []
    for name, tree in sorted(trees.items()):
        is_pkg = modules[name][1]
        package = name if is_pkg else name.rsplit(".", 1)[0]
        aliases: dict[str, str] = {}  # local name → the moe_lab module it is bound to
        for node in ast.walk(tree):
            if isinstance(node, ast.ImportFrom):
                if node.level:
                    base = package.split(".")[: len(package.split(".")) - (node.level - 1)]
                    target = ".".join(base + ([node.module] if node.module else []))
                else:
                    target = node.module or ""
                if target.split(".")[0] != "moe_lab":
                    continue
                for a in node.names:
                    if f"{target}.{a.name}" in known:
                        aliases[a.asname or a.name] = f"{target}.{a.name}"
                    elif _PRIVATE.match(a.name) and target != name:
                        bad.append(f"{name} imports {target}.{a.name}")
            elif isinstance(node, ast.Import):
                for a in node.names:
                    if a.name in known and a.asname:
                        aliases[a.asname] = a.name
        own = _owned(tree)
        for node in ast.walk(tree):
            if not (isinstance(node, ast.Attribute) and _PRIVATE.match(node.attr)):
                continue
            how = "writes" if isinstance(node.ctx, ast.Store) else "reads"
            if isinstance(node.value, ast.Name) and aliases.get(node.value.id, name) != name:
                bad.append(f"{name} {how} {aliases[node.value.id]}.{node.attr}")
            elif not (isinstance(node.value, ast.Name) and node.value.id in SELF) and node.attr not in own \
                    and owners.get(node.attr, set()) - {name}:
                bad.append(f"{name} {how} {ast.unparse(node)} (owned by {', '.join(sorted(owners[node.attr]))})")
    return sorted(set(bad))


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
        "moe_lab.questions.x.findings": ("from .experiment import NAME\nfrom . import QUESTION\n", False),
        "moe_lab.questions.x.experiment": ("def f():\n    from .figures import draw\n", False),
        "moe_lab.questions.x": ("from .params import P\nfrom ..spec import Question\n", True),  # allowed: data
        "moe_lab.questions.x.figures": ("from .findings import frame\nfrom ...reporting import plots\n", False),
        "moe_lab.experiments.fake2": ("from ..questions import QUESTIONS\n", False),  # shared code reaching up
    }
    assert violations(mods) == [
        "moe_lab.config (base) imports moe_lab.reporting.plots (reporting)",
        "moe_lab.engine.fake (engine) imports moe_lab.controller (controller)",
        "moe_lab.experiments.fake (experiments) imports moe_lab.tools (tools)",
        "moe_lab.experiments.fake2 (experiments) imports moe_lab.questions (questions)",
        "moe_lab.findings.fake (findings) imports moe_lab.experiments.probe (experiments)",
        "moe_lab.questions.x.experiment (experiments) imports moe_lab.questions.x.figures (reporting)",
        "moe_lab.questions.x.findings (findings) imports moe_lab.questions.x.experiment (experiments)",
    ]


def test_the_package_has_no_import_ring():
    """No module imports one that imports it back, directly or through others, at module level or inside a
    function: controller/ (cluster → calls, bring_up, spares, restart, attached → state) and engine/ (toolkit →
    layer, capture → forward_pass) run one way."""
    graph = import_graph(package_modules())
    assert {"moe_lab.engine.forward_pass", "moe_lab.controller.state"} <= set(graph)
    assert "moe_lab.engine.forward_pass" in graph["moe_lab.engine.layer"]  # the edges are the modules themselves
    assert rings(graph) == []


def test_the_ring_checker_sees_a_ring():
    """The control: a ring through a function-local import, one under TYPE_CHECKING and a three-module ring are
    reported, and a graph's self-loop; a tree with a shared leaf (a diamond) is not."""
    mods = {
        "moe_lab.engine": ("", True),
        "moe_lab.engine.toolkit": ("from . import layer\n", False),
        "moe_lab.engine.layer": ("def f():\n    from .toolkit import forward\n", False),
        "moe_lab.controller": ("", True),
        "moe_lab.controller.cluster": ("from . import calls, state\n", False),
        "moe_lab.controller.calls": ("from typing import TYPE_CHECKING\nif TYPE_CHECKING:\n"
                                     "    from .cluster import Cluster\n", False),
        "moe_lab.controller.state": ("", False),
        "moe_lab.a": ("from moe_lab import b\n", False),
        "moe_lab.b": ("import moe_lab.c\n", False),
        "moe_lab.c": ("from .a import x\n", False),
        "moe_lab.top": ("from . import left, right\n", False),
        "moe_lab.left": ("from .leaf import x\n", False),
        "moe_lab.right": ("from . import leaf\n", False),
        "moe_lab.leaf": ("", False),
    }
    graph = import_graph(mods)
    assert graph["moe_lab.engine.layer"] == {"moe_lab.engine.toolkit"}
    assert rings(graph) == [["moe_lab.a", "moe_lab.b", "moe_lab.c"],
                            ["moe_lab.controller.calls", "moe_lab.controller.cluster"],
                            ["moe_lab.engine.layer", "moe_lab.engine.toolkit"]]
    assert rings({k: v for k, v in graph.items() if k in ("moe_lab.top", "moe_lab.left", "moe_lab.right",
                                                          "moe_lab.leaf")}) == []
    assert rings({"x": {"x", "y"}, "y": set()}) == [["x"]]


def test_no_module_reaches_into_another_ones_privates():
    """controller/ and engine/ use each other's public names only, and no module uses theirs: the parts of the
    controller work on `state.ClusterState`'s public fields, the training stack builds through
    `layer.fresh_layers`, an experiment marks its backward in a capture through `Cache.in_stage`."""
    assert private_reaches(package_modules()) == []


def test_the_private_checker_sees_a_reach():
    """The control: a private name imported, read through a module alias, and another module's class's private
    attribute or method read and written (the controller's parts writing `cluster._spare`) are reported; a class's
    own private attributes, in its module, and a private attribute no moe_lab class owns, are not."""
    mods = {
        "moe_lab.engine": ("", True),
        "moe_lab.engine.layer": ("def _build(): pass\n", False),
        "moe_lab.engine.train": ("from . import layer as layer_mod\nfrom .layer import _generator\n"
                                 "def f():\n    return layer_mod._build()\n", False),
        "moe_lab.controller": ("", True),
        "moe_lab.controller.cluster": ("class Cluster:\n    _ipp: object = None\n    def __init__(self):\n"
                                       "        self._spare = None\n        self._spare = self._spare\n"
                                       "    def _close(self):\n        self._close_client()\n", False),
        "moe_lab.controller.spares": ("def take(cluster):\n    sp, cluster._spare = cluster._spare, None\n"
                                      "    cluster._close()\n    return cluster._ipp, cluster.client._engines\n",
                                      False),
    }
    assert private_reaches(mods) == [
        "moe_lab.controller.spares reads cluster._close (owned by moe_lab.controller.cluster)",
        "moe_lab.controller.spares reads cluster._ipp (owned by moe_lab.controller.cluster)",
        "moe_lab.controller.spares reads cluster._spare (owned by moe_lab.controller.cluster)",
        "moe_lab.controller.spares writes cluster._spare (owned by moe_lab.controller.cluster)",
        "moe_lab.engine.train imports moe_lab.engine.layer._generator",
        "moe_lab.engine.train reads moe_lab.engine.layer._build",
    ]


def test_the_controller_side_looks_releases_up_without_torch():
    """Loading a profile, the protocol and a release's folder leaves torch (and pip) unimported."""
    code = ("import sys, moe_lab.profiles, moe_lab.experiments.protocol, moe_lab.release_dirs, moe_lab.results\n"
            "moe_lab.profiles.load('cpu', {'releases': ['installed', '0.12.3']})\n"
            "print(sorted(m for m in ('torch', 'pip', 'megatron') if m in sys.modules))")
    out = subprocess.run([sys.executable, "-c", code], capture_output=True, text=True, timeout=120, check=True)
    assert out.stdout.strip() == "[]"
