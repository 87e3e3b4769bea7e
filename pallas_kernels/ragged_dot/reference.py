"""Reference grouped GEMM on ``jax.lax``: the test oracle and the fallback everywhere.

Follows the backend interface of ``api.py`` (``check``, ``gmm``, ``tgmm``) and also
keeps ``ragged_dot``, which the front door calls for "reference" so that gradients
come from plain JAX autodiff of ``jax.lax.ragged_dot`` (the oracle the Pallas
backends' ``custom_vjp`` is tested against).

Letters: M rows, K contraction, N output columns, G groups.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from aristax.pallas_kernels.tiling import on_auto_axes, row_spec


def row_groups(group_sizes: jax.Array, num_rows: int) -> jax.Array:
    """int32[M]: the group of each of M rows laid out group by group (``group_sizes``
    int[G] consecutive from row 0); rows past the sum get G - 1."""
    ends = jnp.cumsum(group_sizes, dtype=jnp.int32)
    rows = jnp.arange(num_rows, dtype=jnp.int32)
    return jnp.minimum(jnp.searchsorted(ends, rows, side="right"),
                       group_sizes.shape[0] - 1).astype(jnp.int32)


def check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype, *,
          interpret: bool = False) -> None:
    """The reference serves every call the front door validated."""
    del lhs, rhs, group_sizes, out_dtype, interpret


def ragged_dot(
    lhs: jax.Array,
    rhs: jax.Array,
    group_sizes: jax.Array,
    *,
    preferred_element_type=None,
) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)] where rows are grouped consecutively by group_sizes.

    Args:
      lhs: [M, K]. rhs: [G, K, N]. group_sizes: int32[G], sum <= M; rows past the
        sum produce zeros.
    Returns:
      [M, N] in ``preferred_element_type`` (default: the result type of lhs, rhs).

    XLA:CPU computes every row against every group's weights and masks the result,
    so an inf or NaN in one group's weights (also an empty group's) turns every row
    NaN (0 * inf), where the Pallas kernels read only each row's own group.

    Inputs typed on a mesh with Explicit axes (e.g. made under ``jax.set_mesh``):
    jax 0.10 has no sharding rule for ``ragged_dot_general`` (NotImplementedError,
    also in its transpose), so the op runs with those axes made Auto
    (``jax.sharding.auto_axes``); the result keeps lhs's row sharding.
    """
    op = functools.partial(_lax_ragged_dot, preferred_element_type=preferred_element_type)
    return on_auto_axes(op, lhs, rhs, group_sizes, out_sharding=lambda: row_spec(lhs))


def _lax_ragged_dot(lhs, rhs, group_sizes, preferred_element_type):
    """``jax.lax.ragged_dot``, whose NotImplementedError under ``jax.vmap`` names the
    way around it (the weights are shared, so ``vmap`` batches lhs and not rhs)."""
    try:
        return jax.lax.ragged_dot(lhs, rhs, group_sizes,
                                  preferred_element_type=preferred_element_type)
    except NotImplementedError as err:
        if "vmap" not in str(err):
            raise
        raise NotImplementedError(
            "aristax's grouped GEMM cannot be jax.vmap-ed over tokens with shared expert "
            "weights (jax.lax.ragged_dot has no batching rule for that): give the MoE "
            "layer all tokens at once (x [..., D] is flattened, e.g. [batch, seq, D]), or "
            f"loop with jax.lax.map ({err})") from None


def gmm(lhs, rhs, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Backend-interface grouped GEMM: lhs[M, K], rhs[G, K, N] -> [M, N] in out_dtype.

    ``tiles`` and ``interpret`` are accepted for the interface and ignored.
    """
    del tiles, interpret
    return ragged_dot(lhs, rhs, group_sizes, preferred_element_type=out_dtype)


def tgmm(lhs, dout, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Transposed grouped GEMM: out[g] = lhs[rows of g]^T @ dout[rows of g].

    Args:
      lhs: [M, K]. dout: [M, N]. group_sizes: int32[G] (rows past the sum are
        ignored; empty groups give zeros).
    Returns:
      [G, K, N] in ``out_dtype``.
    """
    del tiles, interpret
    dims = jax.lax.RaggedDotDimensionNumbers(
        dot_dimension_numbers=(([0], [0]), ([], [])),
        lhs_ragged_dimensions=[0],
        rhs_group_dimensions=[],
    )
    return jax.lax.ragged_dot_general(
        lhs, dout, group_sizes, dims, preferred_element_type=out_dtype
    )
