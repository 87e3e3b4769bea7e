"""The front door of the grouped GEMM: validation, backend choice, and the custom_vjp.

Letters: M rows, K contraction, N output columns, G groups.

A backend is a module in this folder (the protocol of ``frontdoor``) with
  ``check(lhs, rhs, group_sizes, out_dtype, *, interpret)``: raise
      NotImplementedError with the reason when it cannot serve lhs[M, K] @ rhs[G, K, N]
      (forward and backward) in that mode;
  ``gmm(lhs[M, K], rhs[G, K, N], group_sizes, *, out_dtype, tiles, interpret)``
      -> [M, N]: out[m] = lhs[m] @ rhs[group of m], zeros past sum(group_sizes);
  ``tgmm(lhs[M, K], dout[M, N], group_sizes, *, out_dtype, tiles, interpret)``
      -> [G, K, N]: out[g] = lhs[rows of g]^T @ dout[rows of g];
and one frozen tiles dataclass (gmm fields, and ``tgmm_*`` fields for tgmm); and
optionally ``gmm_t(lhs[M, N], rhs[G, K, N], group_sizes, ...)`` -> [M, K]:
out[m] = lhs[m] @ rhs[group of m]^T, which the backward then runs for dlhs instead of
transposing rhs in memory for gmm. Backends
are tried in order (``frontdoor.choose``); the first whose ``check`` passes serves.

The gradient of a Pallas backend is this file's ``custom_vjp``, the same for every
backend: for out = ragged_dot(lhs, rhs),
  dlhs = gmm(dout, rhs^T)   (rhs^T = swapaxes(rhs, 1, 2): [G, N, K]; or gmm_t(dout, rhs))
  drhs = tgmm(lhs, dout)
with dout cast to the input dtype and float32 accumulation; group_sizes gets none.
Each of the two falls back to the reference when the backend's ``check`` refuses it.
The backward runs at the ``jax.default_matmul_precision`` of the forward call.
"reference" itself is ``jax.lax.ragged_dot`` under plain JAX autodiff: the oracle.
"""

from __future__ import annotations

import functools
from collections.abc import Sequence
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.ragged_dot import mosaic_gpu, reference, triton, xla
from aristax.pallas_kernels.tiling import vary_alike

OP = "ragged_dot"
BACKENDS: dict[str, ModuleType] = {
    "reference": reference, "triton": triton, "mosaic_gpu": mosaic_gpu, "xla": xla}
# Preferred order per ``jax.default_backend()``. On an H200 (gpu_check.py, bf16,
# uniform groups) Mosaic GPU's forward took 2.07 ms against Triton's 2.69 at the
# Mixtral shape (8192 rows, D 4096, F 14336, E 8) and 0.22 against 0.27 ms fine-grained
# (16384 rows, D 2048, F 768, E 128); forward and backward 6.6 against 8.6 and 0.89
# against 1.01 ms. "xla" follows them on a GPU, for what both refuse (other dtypes,
# empty operands; or a JAX without Triton): on an H100 its forward took 4.08 ms against
# Mosaic GPU's 2.62 (Mixtral) and 4.57 against 0.32 (fine-grained), forward and
# backward 20.0 against 7.6 and 14.8 against 1.09; on an H200 (2026-11-27) forward and
# backward 16.9-18.9 against jax.lax.ragged_dot's 60.9-61.0 ms (Mixtral) and
# 14.1-20.5 against 62.2-62.3 (fine-grained), forward 4.0-6.2 against 9.4-10.1.
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("mosaic_gpu", "triton", "xla", "reference"),
    "cuda": ("mosaic_gpu", "triton", "xla", "reference"),
    "cpu": ("xla", "reference"),
}


def _validate(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array) -> None:
    if lhs.ndim != 2:
        raise ValueError(f"lhs must be [M, K]; got shape {lhs.shape}")
    if rhs.ndim != 3:
        raise ValueError(f"rhs must be [G, K, N]; got shape {rhs.shape}")
    if lhs.shape[1] != rhs.shape[1]:
        raise ValueError(
            f"lhs [M, K]={lhs.shape} and rhs [G, K, N]={rhs.shape} disagree on K"
        )
    if group_sizes.shape != (rhs.shape[0],) or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        raise ValueError(
            f"group_sizes must be an integer array of shape [G]=({rhs.shape[0]},); got "
            f"{group_sizes.dtype}{list(group_sizes.shape)}"
        )


def _choose(names: Sequence[str], lhs, rhs, group_sizes, out_dtype, interpret) -> str:
    """The first of ``names`` whose ``check`` accepts lhs[M, K] @ rhs[G, K, N]."""
    return frontdoor.choose(OP, BACKENDS, names, lhs, rhs, group_sizes, out_dtype,
                            interpret=interpret)


def row_alignment(num_rows: int, num_groups: int, dtype,
                  implementation: str | Sequence[str] | None = None) -> int:
    """The multiple that groups of a [num_rows, .] @ [num_groups, ., .] call in ``dtype``
    should be laid out in, for the backend that would serve it (``implementation`` as
    in ``ragged_dot``): the "xla" backend's ``align`` (its loops then skip masks,
    read-modify-writes and padded copies), else 1. A caller that lays each group out
    from a multiple of it, zero-padded to one (``dispatch.align_groups``), gets the
    same result faster. The padding adds up to num_groups * (align - 1) rows, and the
    backend picks its tiles from the padded count: the multiple is the largest align
    of any count up to num_rows + num_groups * (MAX_ALIGN - 1), which every smaller
    power-of-two align divides."""
    names = frontdoor.candidates(OP, BACKENDS, DEFAULT_ORDER, implementation)
    lhs = jax.ShapeDtypeStruct((num_rows, 1), dtype)
    rhs = jax.ShapeDtypeStruct((num_groups, 1, 1), dtype)
    sizes = jax.ShapeDtypeStruct((num_groups,), jnp.int32)
    name = _choose(names, lhs, rhs, sizes, dtype, frontdoor.resolve_interpret(None))
    if name != "xla":
        return 1
    most = num_rows + num_groups * (xla.MAX_ALIGN - 1)
    return max(xla.XlaTiles.for_shape(rows, num_groups).align for rows in (num_rows, most))


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _kernel_ragged_dot(lhs, rhs, group_sizes, name, out_dtype, interpret, tiles, precision):
    """lhs[M, K], rhs[G, K, N] -> [M, N] by backend ``name``'s gmm. ``precision``:
    ``frontdoor.matmul_precision()`` at the call, for the backward."""
    del precision  # the forward is traced in the caller's context
    return BACKENDS[name].gmm(lhs, rhs, group_sizes, out_dtype=out_dtype, tiles=tiles,
                              interpret=interpret)


def _kernel_ragged_dot_fwd(lhs, rhs, group_sizes, name, out_dtype, interpret, tiles,
                           precision):
    out = _kernel_ragged_dot(lhs, rhs, group_sizes, name, out_dtype, interpret, tiles,
                             precision)
    return out, (lhs, rhs, group_sizes)


def _kernel_ragged_dot_bwd(name, out_dtype, interpret, tiles, precision, residuals, dout):
    """dlhs[M, K] = gmm(dout, rhs^T), drhs[G, K, N] = tgmm(lhs, dout); none for sizes."""
    with jax.default_matmul_precision(precision):
        return frontdoor.guard_second_derivative(OP, name, functools.partial(
            _ragged_dot_grads, name, interpret, tiles), residuals, dout)


def gmm_t(name: str, lhs, rhs, group_sizes, *, out_dtype, tiles, interpret) -> jax.Array:
    """[M, K]: lhs[m] @ rhs[group of m]^T for lhs [M, N], rhs [G, K, N], by backend
    ``name``: its own ``gmm_t`` (rhs read transposed in place) where it has one, else
    its gmm on a transposed copy of rhs."""
    backend = BACKENDS[name]
    if hasattr(backend, "gmm_t"):
        return backend.gmm_t(lhs, rhs, group_sizes, out_dtype=out_dtype, tiles=tiles,
                             interpret=interpret)
    return backend.gmm(lhs, jnp.swapaxes(rhs, 1, 2), group_sizes, out_dtype=out_dtype,
                       tiles=tiles, interpret=interpret)


def _ragged_dot_grads(name, interpret, tiles, residuals, dout):
    lhs, rhs, group_sizes = residuals
    dout = dout.astype(lhs.dtype)
    rhs_t = jnp.swapaxes(rhs, 1, 2)
    names = (name, "reference")
    dlhs_name = _choose(names, dout, rhs_t, group_sizes, lhs.dtype, interpret)
    drhs_name = _choose(names, lhs, rhs, group_sizes, rhs.dtype, interpret)
    dlhs = gmm_t(dlhs_name, dout, rhs, group_sizes, out_dtype=lhs.dtype, tiles=tiles,
                 interpret=interpret)
    drhs = BACKENDS[drhs_name].tgmm(lhs, dout, group_sizes, out_dtype=rhs.dtype,
                                    tiles=tiles, interpret=interpret)
    return dlhs, drhs, None


_kernel_ragged_dot.defvjp(_kernel_ragged_dot_fwd, _kernel_ragged_dot_bwd)


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
    implementation: str | Sequence[str] | None = None,
    interpret: bool | None = None,
    tiles: Any = None,
) -> jax.Array:
    """Grouped GEMM: out[m] = lhs[m] @ rhs[group of row m].

    Args:
      lhs: [M, K], rows grouped consecutively. rhs: [G, K, N].
      group_sizes: int[G] rows per group (an array, list or tuple), in [0, 2**31 - 1]
        (refused outside it when concrete). Rows past
        sum(group_sizes) give zeros; groups past row M lose those rows, as in
        ``jax.lax.ragged_dot``.
      preferred_element_type: accumulation/output dtype (e.g. float32 for bf16 inputs).
      implementation: backend name or ordered list of names from ``BACKENDS``; None =
        the best available for the platform (``DEFAULT_ORDER``), ending in "reference".
        A backend that cannot serve the call is skipped for the next.
      interpret: run Pallas backends in interpret mode; None = iff the default JAX
        backend is the CPU (pass False to lower for GPU, e.g. under ``jax.export``).
      tiles: tile sizes of the serving backend (e.g. ``triton.TritonTiles``), or a
        mapping {backend name: tiles}; None = each backend's shape heuristic.
    Returns:
      [M, N] in ``preferred_element_type`` (default: the promoted input dtype).
    """
    group_sizes = frontdoor.group_sizes_array(OP, group_sizes)  # range-checked if concrete
    _validate(lhs, rhs, group_sizes)
    group_sizes = group_sizes.astype(jnp.int32)
    out_dtype = jnp.dtype(preferred_element_type if preferred_element_type is not None
                          else jnp.promote_types(lhs.dtype, rhs.dtype))
    names = frontdoor.candidates(OP, BACKENDS, DEFAULT_ORDER, implementation)
    interpret = frontdoor.resolve_interpret(interpret)
    name = _choose(names, lhs, rhs, group_sizes, out_dtype, interpret)
    if name == "reference":
        return reference.ragged_dot(
            lhs, rhs, group_sizes, preferred_element_type=preferred_element_type)
    return _kernel_ragged_dot(*vary_alike(lhs, rhs, group_sizes), name, out_dtype, interpret,
                              frontdoor.tiles_for(tiles, name), frontdoor.matmul_precision())
