"""Reference router: plain ``jnp``/``lax``. The test oracle and the default backend.

Letters: T tokens, D model dim, E experts, K experts per token (top_k).

One call runs the whole token-choice router and the dropless expert order:

  logits[t, e] = sum_d x[t, d] w_router[d, e]                        (router GEMM)
  scores       = softmax(logits) over E  | sigmoid(logits)          (Switch eq. 1 /
                                                                     DeepSeek-V3 eq. 15)
  ids[t]       = top_k(scores[t] + bias)    (bias selects only: DeepSeek-V3 eq. 16)
  weights[t,k] = scores[t, ids[t,k]]  (/ sum_k of them when ``normalize``)
  sort_order   = stable argsort of the T*K flat assignments (t*K + k) by expert id

Tokens whose logits are not all finite are routed nowhere, as ``aristax.routing``
does: their weights are 0, their assignments sort after every routed assignment (as if they went
to a virtual expert E) and ``counts`` leaves them out, so ``sum(counts)`` is the
number of routed assignments. This is exactly the layout of
``aristax.dispatch.dropless_dispatch``: ``sort_order`` is its ``sort_order`` too, and the
inverse permutation is its ``row_of``.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

SCORES = ("softmax", "sigmoid")


class RouteOutput(NamedTuple):
    """What ``route`` returns.

    Attributes:
      logits: float32[T, E] raw router logits (float64 for float64 inputs).
      expert_ids: int32[T, K] experts of each token, best first.
      weights: float32[T, K] combine weight of each assignment (0 for non-finite tokens).
      counts: int32[E] routed assignments per expert (the grouped GEMM's group sizes).
      sort_order: int32[T*K] flat assignment (t*K + k) held by each row in expert order.
    """

    logits: jax.Array
    expert_ids: jax.Array
    weights: jax.Array
    counts: jax.Array
    sort_order: jax.Array


def check(x: jax.Array, w_router: jax.Array, top_k: int, *, interpret: bool = False) -> None:
    """The reference serves every call (the backend protocol's ``check``)."""
    del x, w_router, top_k, interpret


def accumulation_dtype(*dtypes) -> jnp.dtype:
    """float64 if any input is float64, else float32 (the router's math dtype)."""
    wide = any(jnp.dtype(d) == jnp.float64 for d in dtypes)
    return jnp.dtype(jnp.float64 if wide else jnp.float32)


def router_logits(x: jax.Array, w_router: jax.Array) -> jax.Array:
    """logits[T, E] = x[T, D] @ w_router[D, E] in the accumulation dtype (full precision)."""
    acc = accumulation_dtype(x.dtype, w_router.dtype)
    return jnp.dot(x.astype(acc), w_router.astype(acc), precision=jax.lax.Precision.HIGHEST)


def finite_tokens(logits: jax.Array) -> jax.Array:
    """bool[T]: every logit of the token is finite (others are routed nowhere)."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


def router_scores(logits: jax.Array, score: str) -> jax.Array:
    """[T, E] softmax over experts or elementwise sigmoid of finite logits."""
    if score == "softmax":
        return jax.nn.softmax(logits, axis=-1)
    return jax.nn.sigmoid(logits)


def select_experts(scores: jax.Array, bias: jax.Array | None, top_k: int) -> jax.Array:
    """int32[T, K]: top_k of scores + bias (ties: lowest expert index, as lax.top_k)."""
    select = scores if bias is None else scores + bias.astype(scores.dtype)
    return jax.lax.top_k(select, top_k)[1].astype(jnp.int32)


def gate_weights(scores: jax.Array, ids: jax.Array, normalize: bool) -> jax.Array:
    """[T, K] = scores[t, ids[t, k]], divided by their sum over k when ``normalize``
    (``normalize_rows``)."""
    weights = jnp.take_along_axis(scores, ids, axis=-1)
    if normalize:
        weights = normalize_rows(weights)
    return weights


def normalize_rows(w: jax.Array) -> jax.Array:
    """w / sum(w) over the last axis. A row summing below the smallest normal float
    (sigmoid scores of logits under about -87 underflow to 0) becomes 0, not 0/0 = NaN,
    and passes no gradient."""
    total = jnp.sum(w, axis=-1, keepdims=True)
    ok = total >= jnp.finfo(w.dtype).tiny
    return jnp.where(ok, w / jnp.where(ok, total, 1.0), 0.0)


def expert_order(
    ids: jax.Array, finite: jax.Array, num_experts: int
) -> tuple[jax.Array, jax.Array]:
    """counts int32[E] and sort_order int32[T*K], the dropless layout.

    The key of assignment t*K + k is ids[t, k], or E for a non-finite token; sort_order is
    the stable argsort of the keys, so rows of one expert keep assignment order.
    """
    key = jnp.where(finite[:, None], ids, num_experts).reshape(-1)
    sort_order = jnp.argsort(key, stable=True).astype(jnp.int32)
    counts = jnp.bincount(key, length=num_experts + 1)[:num_experts].astype(jnp.int32)
    return counts, sort_order


def route(
    x: jax.Array,
    w_router: jax.Array,
    bias: jax.Array | None,
    *,
    top_k: int,
    score: str,
    normalize: bool,
    interpret: bool = False,
) -> RouteOutput:
    """The token-choice router and its expert order (see the module docstring).

    Args:
      x: [T, D] tokens. w_router: [D, E]. bias: float[E] selection bias or None.
      top_k: K. score: "softmax" or "sigmoid". normalize: renormalise the K weights.
      interpret: ignored (the reference is plain XLA); kept for a uniform signature.
    Returns:
      ``RouteOutput``.
    """
    del interpret
    logits = router_logits(x, w_router)
    finite = finite_tokens(logits)
    scores = router_scores(jnp.where(finite[:, None], logits, 0.0), score)
    ids = select_experts(scores, bias, top_k)
    weights = jnp.where(finite[:, None], gate_weights(scores, ids, normalize), 0.0)
    counts, sort_order = expert_order(ids, finite, w_router.shape[1])
    return RouteOutput(logits, ids, weights, counts, sort_order)


# Pieces the kernel backends share: jnp glue around their kernels, outside them.


def block_bases(hist: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """counts int32[E] and base int32[NB, Ep]: first row of each (block, expert).

    base[b, e] = sum_{e' < e} counts[e'] + sum_{b' < b} hist[b', e] (exclusive
    prefix sums over experts, then over blocks).
    """
    counts = jnp.sum(hist, axis=0, dtype=jnp.int32)  # int32 also under jax_enable_x64
    starts = jnp.cumsum(counts, dtype=jnp.int32) - counts
    base = starts[None, :] + jnp.cumsum(hist, axis=0, dtype=jnp.int32) - hist
    return counts[:num_experts], base


def nonfinite_rows(logits: jax.Array, num_routed: jax.Array, top_k: int) -> jax.Array:
    """int32[T]: first row of each non-finite token's K assignments (after all routed rows),
    -1 for finite tokens."""
    nonfinite = ~jnp.all(jnp.isfinite(logits), axis=-1)
    before = jnp.cumsum(nonfinite, dtype=jnp.int32) - nonfinite.astype(jnp.int32)
    return jnp.where(nonfinite, num_routed + top_k * before, -1).astype(jnp.int32)
