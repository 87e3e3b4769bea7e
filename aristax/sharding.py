"""Sharding specs of every parameter, in one place, applied by one helper.

Names end in the letters of their dimensions (``ffw_up_edf``: [E, D, F]). Axis names
are mesh axes: "expert" is the expert-parallel axis; None is replicated. The NNX
metadata key for shardings has changed names across Flax versions, so only
``sharded_param`` writes it (through ``nnx.with_partitioning``).
"""

from __future__ import annotations

from collections.abc import Callable

import jax
from flax import nnx

EXPERT_AXIS = "expert"
DATA_AXIS = "data"

PARAM_AXES: dict[str, tuple[str | None, ...]] = {
    "router_weight_de": (None, None),
    "ffw_gate_edf": (EXPERT_AXIS, None, None),
    "ffw_up_edf": (EXPERT_AXIS, None, None),
    "ffw_down_efd": (EXPERT_AXIS, None, None),
    "shared_gate_df": (None, None),
    "shared_up_df": (None, None),
    "shared_down_fd": (None, None),
}


def sharded_param(
    name: str,
    init: Callable[..., jax.Array],
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    dtype,
) -> nnx.Param:
    """An ``nnx.Param`` initialised by ``init`` and annotated with ``PARAM_AXES[name]``.

    The annotation is metadata only (no eager placement), so a module builds the same
    way on one device or under a mesh; ``nnx.get_partition_spec`` reads it back and
    ``aristax.parallel`` places the arrays.
    """
    axes = PARAM_AXES[name]
    if len(axes) != len(shape):
        raise ValueError(f"PARAM_AXES[{name!r}]={axes} does not match shape {shape}")
    value = nnx.with_partitioning(init, axes)(rngs.params(), shape, dtype)
    return nnx.Param(value, eager_sharding=False)


def param_partition_specs(module: nnx.Module) -> dict:
    """Nested dict (module attribute paths) of the ``PartitionSpec`` of every parameter."""
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
