"""History belongs to git: the package, the notebooks and the tests cite no issue of this project ("#24", "before
#23", "issue #7"); upstream citations (Megatron-LM #1421, SGLang #23729, a GitHub issues/ URL) are kept."""

from __future__ import annotations

import re
from pathlib import Path

ROOT = Path(__file__).resolve().parents[2]
OWN_ISSUE = re.compile(r"(?<![\w/&:])#\d{1,3}\b")  # not a CSS colour (color:#222) or an HTML entity (&#8212;)
UPSTREAM = re.compile(r"(Megatron-LM|SGLang|TransformerEngine|PyTorch|NVIDIA|issues/)\s*#?\d")


def citations(text: str) -> list[str]:
    """Lines of `text` that cite an issue number of this project (upstream issues are not citations of it)."""
    return [f"{i}: {line.strip()[:100]}" for i, line in enumerate(text.splitlines(), 1)
            if OWN_ISSUE.search(line) and not UPSTREAM.search(line)]


def _files():
    for pattern in ("moe_lab/**/*.py", "notebooks/*.ipynb", "tests/**/*.py", ".ci/*.py", ".ci/*.sh"):
        for f in ROOT.glob(pattern):
            if f.name != Path(__file__).name:
                yield f


def test_no_code_cites_an_issue_of_this_project():
    bad = {str(f.relative_to(ROOT)): c for f in _files() if (c := citations(f.read_text()))}
    assert bad == {}


def test_the_check_sees_a_citation():
    """The control: the forms history took in this code are caught; upstream issue numbers are not."""
    assert citations('"""Notebook 06 (#24): ..."""') and citations("# every experiment before #24")
    assert citations("x = 1  # issue #7: noticed within 30 s") and citations('"""#25 item 3: an engine ..."""')
    assert not citations("grew from Megatron-LM #1421 (the seed report)")
    assert not citations("SGLang #23729: DP-attention diverged") and not citations('ZERO = "#cfe8d4"')
    assert not citations("body{color:#222}")
