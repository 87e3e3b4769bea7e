"""Expert parallelism: meshes from plans, token exchange, the EP MoE forward.

``aristax.MoE`` calls ``expert_parallel_moe`` when a mesh with an "expert" axis is
active (``with jax.set_mesh(mesh):``) or given explicitly (``MoE(..., mesh=mesh)``).
"""

from aristax.parallel.collectives import (
    EXCHANGES,
    complete_rounds,
    default_exchange,
    exchange,
    hierarchical_all_to_all,
    ragged_all_to_all_emulated,
    ragged_args,
    rounds_from_schedule,
    scheduled_all_to_all,
)
from aristax.parallel.distributed import initialize_distributed, resolve_distributed
from aristax.parallel.expert_parallel import (
    expert_parallel_moe,
    expert_parallel_options,
    tokens_per_shard,
)
from aristax.parallel.measure import fit_alpha_beta, measure_topology
from aristax.parallel.mesh import (
    EMPTY_SLOT,
    HIERARCHICAL_AXES,
    MESH_AXES,
    expert_axes_of,
    expert_permutation,
    inverse_permutation,
    layout_expert_weights,
    layout_experts,
    logical_slots,
    mesh_from_plan,
)
from aristax.parallel.overlap import chunk_bounds, chunked_moe, num_chunks_from_plan

__all__ = [
    "EMPTY_SLOT",
    "EXCHANGES",
    "HIERARCHICAL_AXES",
    "MESH_AXES",
    "chunk_bounds",
    "chunked_moe",
    "complete_rounds",
    "default_exchange",
    "exchange",
    "expert_axes_of",
    "expert_parallel_moe",
    "expert_parallel_options",
    "expert_permutation",
    "fit_alpha_beta",
    "hierarchical_all_to_all",
    "initialize_distributed",
    "inverse_permutation",
    "layout_expert_weights",
    "layout_experts",
    "logical_slots",
    "measure_topology",
    "mesh_from_plan",
    "num_chunks_from_plan",
    "ragged_all_to_all_emulated",
    "ragged_args",
    "resolve_distributed",
    "rounds_from_schedule",
    "scheduled_all_to_all",
    "tokens_per_shard",
]
