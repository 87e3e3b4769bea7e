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
from jax.sharding import AxisType, PartitionSpec as P

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


def explicit_mesh(*arrays):
    """The abstract mesh with Explicit axes that some input is typed on, else None."""
    for a in arrays:
        mesh = jax.typeof(a).sharding.mesh
        if not mesh.empty and AxisType.Explicit in mesh.axis_types:
            return mesh
    return None


def row_spec(a: jax.Array) -> P:
    """The PartitionSpec of a [rows, columns] result that keeps ``a``'s row sharding."""
    spec = jax.typeof(a).sharding.spec
    return P(spec[0] if spec else None, None)


def on_auto_axes(fn: Callable, *args, out_sharding):
    """``fn(*args)``; where some array of ``args`` is typed on a mesh with Explicit axes
    (e.g. made under ``jax.set_mesh``), with those axes made Auto
    (``jax.sharding.auto_axes``), for ops that have no sharding rule on Explicit axes
    (sort, gather, ``ragged_dot``). ``out_sharding``: PartitionSpecs of the outputs
    there, or a function of no arguments that returns them (called only there)."""
    mesh = explicit_mesh(*jax.tree.leaves(args))
    if mesh is None:
        return fn(*args)
    if callable(out_sharding):
        out_sharding = out_sharding()
    axes = tuple(n for n, t in zip(mesh.axis_names, mesh.axis_types) if t == AxisType.Explicit)
    with jax.sharding.use_abstract_mesh(mesh):
        # arrays typed on no mesh (weights on one device) are typed replicated on it
        # first: called eagerly, their gradients came back typed on the mesh's Auto twin,
        # which no later op on the Explicit mesh (an optimizer update) accepts
        args = jax.tree.map(
            lambda a: jax.sharding.reshard(a, P()) if jax.typeof(a).sharding.mesh.empty else a,
            args)
        return jax.sharding.auto_axes(fn, axes=axes, out_sharding=out_sharding)(*args)
