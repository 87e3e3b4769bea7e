"""Expert parallelism: meshes from plans, token exchange, the EP MoE forward.

``aristax.MoE`` calls ``expert_parallel_moe`` when a mesh with an "expert" axis is
active (``with jax.set_mesh(mesh):``) or given explicitly (``MoE(..., mesh=mesh)``).
"""

from aristax.parallel.collectives import (
    EXCHANGE_BACKENDS,
    default_backend,
    exchange,
    ragged_all_to_all_emulated,
    ragged_args,
)
from aristax.parallel.expert_parallel import expert_parallel_moe
from aristax.parallel.mesh import (
    MESH_AXES,
    expert_permutation,
    inverse_permutation,
    layout_experts,
    mesh_from_plan,
)

__all__ = [
    "EXCHANGE_BACKENDS",
    "MESH_AXES",
    "default_backend",
    "exchange",
    "expert_parallel_moe",
    "expert_permutation",
    "inverse_permutation",
    "layout_experts",
    "mesh_from_plan",
    "ragged_all_to_all_emulated",
    "ragged_args",
]
