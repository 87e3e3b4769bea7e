"""aristax: Mixture-of-Experts layers, kernels, expert parallelism and planning for JAX."""

from aristax.config import MoEConfig, RouterConfig
from aristax.layers import MoE, moe_linen
from aristax.moe import MoEParams, moe
from aristax.routing import Routing, route
from aristax.sharding import LOGICAL_AXES, MoEAxes

__version__ = "0.1.0"

__all__ = [
    "LOGICAL_AXES",
    "MoE",
    "MoEAxes",
    "MoEConfig",
    "MoEParams",
    "RouterConfig",
    "Routing",
    "moe",
    "moe_linen",
    "route",
]
