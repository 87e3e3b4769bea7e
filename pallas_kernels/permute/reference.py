"""Reference permute and combine: plain ``jnp``. The test oracle and the default.

Letters: T tokens, D model dim, K experts per token, M = T*K rows in expert order.

``sort_order[p]`` is the flat assignment s = t*K + k held by row p (``route``'s output, the
stable sort of the assignments by expert); ``inverse_order`` gives pos[s], the row of assignment
s. Rows p >= ``num_valid`` (the routed assignments, ``sum(counts)``) are padding: permute
writes zeros there and combine ignores the assignments that land there. This is
``aristax.dispatch``'s dropless layout: the same ``sort_order``,
``row_valid = p < num_valid``, ``row_of = pos.reshape(T, K)``, ``kept = row_of <
num_valid``.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp


def check(op: str, top_k: int, *arrays: jax.Array, interpret: bool = False) -> None:
    """The reference serves every call (the backend protocol's ``check``)."""
    del op, top_k, arrays, interpret


def accumulation_dtype(*dtypes) -> jnp.dtype:
    """float64 if any input is float64, else float32 (combine's sum dtype)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def valid_count(num_valid: jax.Array | int | None, num_rows: int) -> jax.Array:
    """int32[]: the number of leading valid rows (all M when ``num_valid`` is None)."""
    return jnp.asarray(num_rows if num_valid is None else num_valid, jnp.int32).reshape(())


def inverse_order(sort_order: jax.Array) -> jax.Array:
    """int32[M] pos with pos[sort_order[p]] = p (the row that holds each assignment)."""
    M = sort_order.shape[0]
    return jnp.zeros((M,), jnp.int32).at[sort_order].set(jnp.arange(M, dtype=jnp.int32))


def permute(
    x: jax.Array,
    sort_order: jax.Array,
    num_valid: jax.Array | None = None,
    *,
    top_k: int,
    interpret: bool = False,
) -> jax.Array:
    """rows[p] = x[sort_order[p] // K] for p < num_valid, else 0.

    Args:
      x: [T, D]. sort_order: int32[M = T*K]. num_valid: int32[] or None (= M).
      top_k: K. interpret: ignored (uniform backend signature).
    Returns:
      rows [M, D] in x's dtype.
    """
    del interpret
    M = sort_order.shape[0]
    rows = jnp.take(x, sort_order // top_k, axis=0)
    valid = jnp.arange(M, dtype=jnp.int32) < valid_count(num_valid, M)
    return jnp.where(valid[:, None], rows, jnp.zeros((), x.dtype))


def combine(
    rows: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    num_valid: jax.Array | None = None,
    *,
    interpret: bool = False,
) -> jax.Array:
    """y[t] = sum_k weights[t, k] * rows[pos[t, k]] over assignments with pos < num_valid.

    Args:
      rows: [M, D] expert outputs in expert order. sort_order: int32[M].
      weights: [T, K]. num_valid: int32[] or None (= M). interpret: ignored.
    Returns:
      y [T, D] in the accumulation dtype (float32, or float64 for float64 inputs).
    """
    del interpret
    T, K = weights.shape
    acc = accumulation_dtype(rows.dtype, weights.dtype)
    pos = inverse_order(sort_order).reshape(T, K)
    kept = pos < valid_count(num_valid, T * K)
    w = jnp.where(kept, weights.astype(acc), 0.0)
    gathered = rows[pos.reshape(-1)].reshape(T, K, rows.shape[1])  # T = 0 keeps its shape
    gathered = jnp.where(kept[..., None], gathered.astype(acc), 0.0)
    return jnp.einsum("tk,tkd->td", w, gathered, precision=jax.lax.Precision.HIGHEST)


def permute_bwd(
    drows: jax.Array,
    sort_order: jax.Array,
    num_valid: jax.Array | None,
    *,
    top_k: int,
    x_dtype,
    interpret: bool = False,
) -> jax.Array:
    """The transpose of ``permute``: dx[t] = sum of drows[p] over valid rows p of t.

    Args:
      drows: [M, D]. sort_order: int32[M]. num_valid: int32[] or None. top_k: K.
      x_dtype: the dtype of dx. interpret: ignored.
    Returns:
      dx [T, D], summed in float32 (float64 for float64 drows).
    """
    del interpret
    M = sort_order.shape[0]
    valid = jnp.arange(M, dtype=jnp.int32) < valid_count(num_valid, M)
    d = jnp.where(valid[:, None], drows.astype(accumulation_dtype(drows.dtype)), 0.0)
    dx = jax.ops.segment_sum(d, sort_order // top_k, num_segments=M // top_k)
    return dx.astype(x_dtype)


def combine_bwd(
    dy: jax.Array,
    rows: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    num_valid: jax.Array | None,
    *,
    interpret: bool = False,
) -> tuple[jax.Array, jax.Array]:
    """The vjp of ``combine`` for dy [T, D].

    drows[p] = weights.flat[s] * dy[s // K] with s = sort_order[p] (valid p, else 0);
    dweights[t, k] = <dy[t], rows[pos[t, k]]> (kept assignments, else 0).

    Returns:
      (drows [M, D] in rows' dtype, dweights [T, K] in weights' dtype).
    """
    del interpret
    T, K = weights.shape
    acc = accumulation_dtype(dy.dtype, rows.dtype, weights.dtype)
    dy = dy.astype(acc)
    nv = valid_count(num_valid, T * K)
    valid = jnp.arange(T * K, dtype=jnp.int32) < nv
    scale = jnp.take(weights.reshape(-1).astype(acc), sort_order)
    drows = scale[:, None] * jnp.take(dy, sort_order // K, axis=0)
    drows = jnp.where(valid[:, None], drows, 0.0).astype(rows.dtype)
    pos = inverse_order(sort_order).reshape(T, K)
    gathered = jnp.take(rows, pos, axis=0).astype(acc)
    dweights = jnp.einsum("td,tkd->tk", dy, gathered, precision=jax.lax.Precision.HIGHEST)
    dweights = jnp.where(pos < nv, dweights, 0.0).astype(weights.dtype)
    return drows, dweights
