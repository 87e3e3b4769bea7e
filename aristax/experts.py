"""Expert MLPs: routed experts over grouped rows, shared experts over every token.

Letters: M rows in expert order, D model dim, F hidden dim, E experts. GEMMs take
inputs in the compute dtype and accumulate in float32 (float64 for float64 inputs).

  swiglu: down(silu(x Wg) * x Wu)   (Shazeer 2020, "GLU Variants", eq. 6)
  geglu:  down(gelu(x Wg) * x Wu)   (ibid.; exact erf GELU, as torch's default)
  gelu:   down(gelu(x Wu))
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aristax.config import accumulation_dtype
from aristax.pallas_kernels import frontdoor, ragged_dot
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.moe_mlp.reference import hidden as _hidden


def expert_mlp(
    rows: jax.Array,
    group_sizes: jax.Array,
    gate_edf: jax.Array | None,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    activation: str,
    implementation: str | Sequence[str] | None = None,
) -> jax.Array:
    """Routed experts over rows grouped by expert.

    Args:
      rows: [M, D] in the compute dtype; expert e owns ``group_sizes[e]`` consecutive
        rows (rows past the sum give zeros).
      group_sizes: int32[E].
      gate_edf: [E, D, F] (None for "gelu"). up_edf: [E, D, F]. down_efd: [E, F, D].
      implementation: the layer's rule, as for its other ops: each GEMM runs on the
        first ``ragged_dot`` backend named that serves it, else on the reference
        (None: the platform's default choice).
    Returns:
      [M, D] in the accumulation dtype (float32, or float64 for float64 rows).
    """
    dtype = rows.dtype
    acc = accumulation_dtype(dtype)
    if implementation is not None:
        implementation = frontdoor.with_reference(implementation, ragged_dot_api.BACKENDS)

    def gemm(lhs, rhs):
        return ragged_dot(lhs, rhs.astype(dtype), group_sizes,
                          preferred_element_type=acc, implementation=implementation)

    gate = None if gate_edf is None else gemm(rows, gate_edf)
    hidden = _hidden(gate, gemm(rows, up_edf), activation)
    return gemm(hidden.astype(dtype), down_efd)


def dense_mlp(
    x: jax.Array,
    gate_df: jax.Array | None,
    up_df: jax.Array,
    down_fd: jax.Array,
    *,
    activation: str,
) -> jax.Array:
    """One dense MLP on every token (the shared experts): x[T, D] -> [T, D] accumulated
    in float32 (float64 for float64 x)."""
    dtype = x.dtype
    acc = accumulation_dtype(dtype)

    def gemm(lhs, rhs):
        return jnp.dot(lhs, rhs.astype(dtype), preferred_element_type=acc)

    gate = None if gate_df is None else gemm(x, gate_df)
    return gemm(_hidden(gate, gemm(x, up_df), activation).astype(dtype), down_fd)
