"""Kernels for the MoE hot path, one op per folder, each behind one front door.

Every op takes ``implementation=`` (a backend name or an ordered list); the default
runs everywhere and falls back to the plain jnp/lax reference.
"""

from aristax.pallas_kernels.moe_mlp import api as _moe_mlp_api
from aristax.pallas_kernels.moe_mlp import moe_mlp
from aristax.pallas_kernels.permute import api as _permute_api
from aristax.pallas_kernels.permute import combine, permute
from aristax.pallas_kernels.ragged_dot import api as _ragged_dot_api
from aristax.pallas_kernels.ragged_dot import ragged_dot
from aristax.pallas_kernels.route import RouteOutput, route
from aristax.pallas_kernels.route import api as _route_api

# Every backend name some op registers: what ``MoEConfig.implementation`` may name.
BACKEND_NAMES: tuple[str, ...] = tuple(sorted(
    set(_moe_mlp_api.BACKENDS) | set(_permute_api.BACKENDS) | set(_ragged_dot_api.BACKENDS)
    | set(_route_api.BACKENDS)))

__all__ = ["BACKEND_NAMES", "RouteOutput", "combine", "moe_mlp", "permute", "ragged_dot",
           "route"]
