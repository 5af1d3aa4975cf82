"""moe_lab: reproduce, localise and fix numerical divergence of megatron-core MoE layers under expert parallelism.

Where code runs: `controller/` (the notebook or CLI process: the cluster of engines), `engine/` (inside each engine:
process group, the layer, capture, the measurement toolkit), `experiments/` (one module per notebook question on one
protocol, and the remedies), `reporting/` (figures, the notebook runner), `tools/` (bench, scale plan, installing
megatron-core releases, wheels), `cli/` (`moe-lab`). `config`, `metrics`, `stats`, `results` (results.json),
`releases` and `release_dirs` are pure and used on both sides.
"""

from .config import ClusterConfig, MoEConfig
from .version import __version__

__all__ = ["ClusterConfig", "MoEConfig", "Cluster", "__version__"]


def __getattr__(name):  # `moe_lab.Cluster` without importing torch for `import moe_lab`
    if name == "Cluster":
        from .controller.cluster import Cluster

        return Cluster
    raise AttributeError(f"module 'moe_lab' has no attribute {name!r}")
