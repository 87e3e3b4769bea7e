"""Front doors of permute and combine: validation, backend choice, ``custom_vjp``s.

Letters: T tokens, D model dim, K slots per token, M = T*K rows in expert order.

Each backend provides four functions (forward and backward of both ops); the
``custom_vjp`` calls the first backend in the list that serves each of them
("mosaic_gpu" serves permute for D % 64 == 0, combine for D % 128 == 0).
permute's backward is an unweighted combine, combine's backward a weighted permute
(drows) and a per-slot dot (dweights), so no backward needs a scatter-add.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp

from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.permute import mosaic_gpu, reference, triton
from aristax.pallas_kernels.tiling import vary_alike

_BACKENDS = {"triton": triton, "mosaic_gpu": mosaic_gpu, "reference": reference}
PERMUTE = {name: mod.permute for name, mod in _BACKENDS.items()}
PERMUTE_BWD = {name: mod.permute_bwd for name, mod in _BACKENDS.items()}
COMBINE = {name: mod.combine for name, mod in _BACKENDS.items()}
COMBINE_BWD = {name: mod.combine_bwd for name, mod in _BACKENDS.items()}
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {"gpu": ("triton", "reference")}


def _check_order(op: str, sort_order, num_rows: int, num_valid) -> None:
    """ValueError unless sort_order is int[M] and num_valid a scalar or None."""
    if sort_order.shape != (num_rows,) or not jnp.issubdtype(sort_order.dtype, jnp.integer):
        raise ValueError(
            f"{op}: sort_order must be an integer array of shape [T*K] = [{num_rows}]; got "
            f"{sort_order.dtype}{list(sort_order.shape)}")
    if num_valid is not None and (jnp.shape(num_valid) not in ((), (1,))
                                  or not jnp.issubdtype(jnp.result_type(num_valid),
                                                        jnp.integer)):
        raise ValueError(f"{op}: num_valid must be an integer scalar (or None); got "
                         f"{jnp.result_type(num_valid)}{list(jnp.shape(num_valid))}")


def _validate_permute(x, sort_order, top_k, num_valid) -> None:
    if x.ndim != 2:
        raise ValueError(f"permute: x must be [T, D]; got shape {tuple(x.shape)}")
    if not frontdoor.is_count(top_k) or top_k < 1:
        raise ValueError(f"permute: top_k must be a positive int; got {top_k!r}")
    _check_order("permute", sort_order, x.shape[0] * top_k, num_valid)


def _validate_combine(rows, sort_order, weights, num_valid) -> None:
    if weights.ndim != 2:
        raise ValueError(f"combine: weights must be [T, K]; got shape {tuple(weights.shape)}")
    T, K = weights.shape
    if rows.ndim != 2 or rows.shape[0] != T * K:
        raise ValueError(f"combine: rows must be [T*K, D] = [{T * K}, D] (T, K from "
                         f"weights); got shape {tuple(rows.shape)}")
    _check_order("combine", sort_order, T * K, num_valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5))
def _permute(x, sort_order, num_valid, top_k, names, interpret):
    return frontdoor.call_first("permute", PERMUTE, names, x, sort_order, num_valid,
                                top_k=top_k, interpret=interpret)


def _permute_fwd(x, sort_order, num_valid, top_k, names, interpret):
    rows = _permute(x, sort_order, num_valid, top_k, names, interpret)
    return rows, (sort_order, num_valid, jnp.zeros((0,), x.dtype))


def _permute_bwd(top_k, names, interpret, residuals, drows):
    sort_order, num_valid, x_tag = residuals
    dx = frontdoor.call_first("permute backward", PERMUTE_BWD, names, drows, sort_order,
                              num_valid, top_k=top_k, x_dtype=x_tag.dtype,
                              interpret=interpret)
    return dx, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


@functools.partial(jax.custom_vjp, nondiff_argnums=(4, 5))
def _combine(rows, sort_order, weights, num_valid, names, interpret):
    return frontdoor.call_first("combine", COMBINE, names, rows, sort_order, weights,
                                num_valid, interpret=interpret)


def _combine_fwd(rows, sort_order, weights, num_valid, names, interpret):
    y = _combine(rows, sort_order, weights, num_valid, names, interpret)
    return y, (rows, sort_order, weights, num_valid)


def _combine_bwd(names, interpret, residuals, dy):
    rows, sort_order, weights, num_valid = residuals
    drows, dweights = frontdoor.call_first(
        "combine backward", COMBINE_BWD, names, dy, rows, sort_order, weights, num_valid,
        interpret=interpret)
    return drows, None, dweights, None


_combine.defvjp(_combine_fwd, _combine_bwd)


def permute(
    x: jax.Array,
    sort_order: jax.Array,
    *,
    top_k: int,
    num_valid: jax.Array | int | None = None,
    implementation: frontdoor.Implementation = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Gather tokens into expert order: rows[p] = x[sort_order[p] // K].

    Equals ``aristax.dispatch.permute`` with the dropless dispatch of the same
    routing (``row_slot = sort_order``, ``row_valid = p < num_valid``).

    Args:
      x: [T, D] tokens. sort_order: int[T*K] flat slot of each row (``route``).
      top_k: K. num_valid: routed rows (``sum(counts)``); rows past it are 0. None =
        all T*K rows.
      implementation: backend name or ordered list ("triton", "mosaic_gpu",
        "reference"); None = the platform default ("triton", then "reference", on GPU:
        Mosaic GPU's per-row TMA gathers took 2.8x Triton's time on an H200, 0.130
        against 0.046 ms at T 4096, D 4096, K 2; ``gpu_check.py``).
        interpret: Pallas interpret mode; None = on CPU.
    Returns:
      rows [T*K, D] in x's dtype. Backward: dx[t] = sum of drows over t's valid rows.
    """
    _validate_permute(x, sort_order, top_k, num_valid)
    names = frontdoor.candidates("permute", PERMUTE, DEFAULT_ORDER, implementation)
    nv = reference.valid_count(num_valid, sort_order.shape[0])
    return _permute(*vary_alike(x, sort_order.astype(jnp.int32), nv), int(top_k), names,
                    frontdoor.resolve_interpret(interpret))


def combine(
    rows: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    *,
    num_valid: jax.Array | int | None = None,
    implementation: frontdoor.Implementation = None,
    interpret: bool | None = None,
) -> jax.Array:
    """Weighted sum back into token order: y[t] = sum_k weights[t,k] rows[pos[t,k]].

    pos is the inverse of sort_order (the row of slot t*K + k); slots with
    pos >= num_valid are left out. Equals ``aristax.dispatch.combine`` with the
    dropless dispatch (``slot = pos``, ``kept = pos < num_valid``).

    Args:
      rows: [T*K, D] expert outputs in expert order. sort_order: int[T*K].
      weights: [T, K] combine weights. num_valid: routed rows, or None (= T*K).
      implementation, interpret: as in ``permute``.
    Returns:
      y [T, D] in float32 (float64 for float64 inputs). Backward: drows[p] =
      weight of row p's slot * dy[token], dweights[t, k] = <dy[t], rows[pos[t, k]]>.
    """
    _validate_combine(rows, sort_order, weights, num_valid)
    names = frontdoor.candidates("combine", COMBINE, DEFAULT_ORDER, implementation)
    nv = reference.valid_count(num_valid, sort_order.shape[0])
    return _combine(*vary_alike(rows, sort_order.astype(jnp.int32), weights, nv), names,
                    frontdoor.resolve_interpret(interpret))
