"""Reference grouped GEMM: ``jax.lax.ragged_dot``. The test oracle and the default."""

from __future__ import annotations

import jax


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
    """
    return jax.lax.ragged_dot(
        lhs, rhs, group_sizes, preferred_element_type=preferred_element_type
    )
