"""Kernels for the MoE hot path, one op per folder, each behind one front door.

Every op takes ``implementation=`` (a backend name or an ordered list); the default
runs everywhere and falls back to the plain jnp/lax reference.
"""

from aristax.pallas_kernels.moe_mlp import moe_mlp
from aristax.pallas_kernels.permute import combine, permute
from aristax.pallas_kernels.ragged_dot import ragged_dot
from aristax.pallas_kernels.route import RouteOutput, route

__all__ = ["RouteOutput", "combine", "moe_mlp", "permute", "ragged_dot", "route"]
