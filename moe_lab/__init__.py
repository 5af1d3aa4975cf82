"""moe_lab: reproduce, localise and fix numerical divergence of megatron-core MoE layers under expert parallelism."""

from .config import ClusterConfig, MoEConfig

__version__ = "0.1.0"
__all__ = ["ClusterConfig", "MoEConfig", "__version__"]
