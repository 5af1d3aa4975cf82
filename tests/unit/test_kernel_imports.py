"""A notebook's kernel reads records, draws and words findings; torch (~1.5 s to import, paid by each of the
notebooks' kernels) is the engines'. Every module a notebook imports, and the records the engines send back, must
not pull torch into the kernel, except notebook 04: its tolerance table is computed with torch's bf16 in the kernel."""

import json
import subprocess
import sys
from pathlib import Path

import pytest

ROOT = Path(__file__).resolve().parents[2]
NEEDS_TORCH = {"04"}  # truncation's tolerance table rounds values to bf16 with torch in the kernel


def _imports(nb: Path) -> str:
    cells = [c for c in json.loads(nb.read_text())["cells"] if c["cell_type"] == "code"]
    return "\n".join(line for c in cells for line in "".join(c["source"]).splitlines()
                     if line.startswith(("import ", "from ")))


@pytest.mark.parametrize("nb", sorted((ROOT / "notebooks").glob("[0-9][0-9]_*.ipynb")), ids=lambda p: p.name[:2])
def test_a_notebooks_imports_leave_torch_to_the_engines(nb):
    code = _imports(nb) + "\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT / "notebooks", capture_output=True, text=True,
                         timeout=120)
    assert out.returncode == 0, out.stderr[-2000:]
    imported = out.stdout.strip().splitlines()[-1] == "True"
    assert imported == (nb.name[:2] in NEEDS_TORCH), (
        f"{nb.name}: its imports {'pull torch into' if imported else 'no longer need torch in'} the kernel"
        + ("; import torch inside the engine-side functions that need it" if imported else
           f"; take {nb.name[:2]} out of NEEDS_TORCH"))


def test_the_check_sees_torch_when_a_module_imports_it():
    """The control: the same check on a line that imports torch says so."""
    code = "import moe_lab.engine.toolkit\nimport sys\nprint('torch' in sys.modules)"
    out = subprocess.run([sys.executable, "-c", code], cwd=ROOT, capture_output=True, text=True, timeout=120)
    assert out.stdout.strip().splitlines()[-1] == "True"

