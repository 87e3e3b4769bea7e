"""Small helpers shared by the kernel backends: tile-size integers, the output types
and operand casts that let kernels run inside ``shard_map``, and running ops that have
no sharding rule on inputs typed on a mesh with Explicit axes (``on_auto_axes``; the
core uses it too). Imports only JAX."""

from __future__ import annotations

from collections.abc import Callable

import jax
from jax.sharding import AxisType, PartitionSpec as P

# Most experts per token a kernel serves: its loops over the K choices are unrolled.
MAX_TOP_K = 64


def next_pow2(n: int) -> int:
    """Smallest power of two >= n (>= 1): Triton block shapes must be powers of two."""
    return 1 << max(0, int(n) - 1).bit_length()


def is_pow2(x: int) -> bool:
    return isinstance(x, int) and x > 0 and x & (x - 1) == 0


def out_type(shape: tuple[int, ...], dtype, *operands: jax.Array) -> jax.ShapeDtypeStruct:
    """A ``pallas_call`` output type that varies over every manual mesh axis some
    operand varies over.

    Inside ``shard_map(check_vma=True)`` (the default, as in ``aristax.parallel``) a
    kernel output must say how it varies; outside one the set is empty and ignored.
    """
    varying = _union_varying(operands)
    return jax.ShapeDtypeStruct(shape, dtype,
                                manual_axis_type=jax.sharding.ManualAxisType(varying=varying))


def _varying(a) -> frozenset:
    return jax.typeof(a).manual_axis_type.varying if isinstance(a, jax.Array) else frozenset()


def _union_varying(arrays) -> frozenset:
    return frozenset().union(*(_varying(a) for a in arrays))


def _cast_varying(a, axes: frozenset):
    """a made to vary over ``axes`` too (None and Python scalars pass through)."""
    if not isinstance(a, jax.Array):
        return a
    missing = axes - _varying(a)
    return jax.lax.pcast(a, tuple(sorted(missing)), to="varying") if missing else a


def vary_alike(*operands) -> tuple:
    """The operands, each cast to vary over every manual mesh axis one of them varies
    over (``jax.lax.pcast(..., to="varying")``; a no-op outside ``shard_map``).

    A kernel's outputs vary like the union of its operands (``out_type``), so its
    ``custom_vjp`` backward returns cotangents that do too, and JAX requires each to
    match its primal's type. A front door therefore casts its operands first; the
    cast's transpose (a psum) then sums an invariant operand's gradient over the
    devices, as autodiff does for plain JAX ops.
    """
    axes = _union_varying(operands)
    return tuple(_cast_varying(a, axes) for a in operands)


def varying_like(out, *operands):
    """``out`` (a pytree) cast to vary over every manual mesh axis some operand varies
    over: ``plgpu.kernel`` traces its kernel with the varying-axes check off and returns
    invariant outputs, which ``shard_map(check_vma=True)`` must see as varying."""
    axes = _union_varying(operands)
    return jax.tree.map(lambda a: _cast_varying(a, axes), out)


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
