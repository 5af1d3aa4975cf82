"""The cluster is usable from a notebook: %%px cells run on every engine, in rank order."""

import nbformat
import papermill as pm
import pytest

pytestmark = pytest.mark.notebook

CELLS = [
    "from moe_lab.controller.cluster import Cluster\nfrom moe_lab.config import ClusterConfig\n"
    "c = Cluster(ClusterConfig(device='cpu', engines=2, timeout_s=60)).start()\nc.activate()",
    "%%px\nimport torch, torch.distributed as dist\nr = dist.get_rank()\n"
    "x = torch.ones(1) * (r + 1)\ndist.all_reduce(x)\ns = float(x)",
    "ranks, sums = c.view.pull('r'), c.view.pull('s')\nc.stop()\nassert ranks == [0, 1], ranks\nassert sums == [3.0, 3.0], sums\n"
    "print('px ok', ranks, sums)",
]


def test_px_cells_run_on_every_rank(tmp_path):
    nb = nbformat.v4.new_notebook()
    nb.cells = [nbformat.v4.new_code_cell(src) for src in CELLS]
    nb.metadata["kernelspec"] = {"name": "python3", "display_name": "Python 3", "language": "python"}
    src, out = tmp_path / "px.ipynb", tmp_path / "px.out.ipynb"
    nbformat.write(nb, src)
    pm.execute_notebook(str(src), str(out), kernel_name="python3", progress_bar=False, execution_timeout=300)
    done = nbformat.read(out, as_version=4)
    text = "".join(o.get("text", "") for o in done.cells[-1].outputs)
    assert "px ok [0, 1] [3.0, 3.0]" in text
