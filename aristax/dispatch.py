"""Dispatch and combine: token order <-> expert order.

Letters: T tokens, D model dim, E experts, K experts per token, C capacity, M rows in
expert order (M = T*K dropless, M = E*C with capacity). An assignment (t, k) is token
t's k-th expert choice, flat index t*K + k; a row is a place in the expert-ordered
layout (``aristax.parallel`` calls the experts' storage places "slots").

Two layouts, one ``Dispatch`` pytree:
  * dropless: a stable sort of the T*K assignments by expert; rows [T*K, D], experts
    see ``group_sizes`` rows each, unrouted assignments sort to the end (zero rows).
  * capacity: rows [E*C, D] = [E, C, D] flattened; expert e owns rows e*C..e*C+C-1;
    assignments beyond C per expert are dropped, and counted.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from aristax.config import DROP_POLICIES, accumulation_dtype
from aristax.experts import row_groups
from aristax.pallas_kernels.tiling import vary_alike
from aristax.routing import Routing


@flax.struct.dataclass
class Dispatch:
    """How tokens are laid out for the experts, and back.

    Attributes:
      sort_order: int32[M] the flat assignment t*K + k that feeds each row (0 on
        padding rows). Dropless it is a permutation of the T*K assignments, exactly
        the kernels' ``sort_order`` (``pallas_kernels.route``/``permute``).
      row_valid: bool[M] row holds a token (False: padding, zero row).
      row_of: int32[T, K] the row that holds each assignment (its output's place;
        meaningless where not kept). Dropless it is the inverse of ``sort_order``.
      kept: bool[T, K] assignment is processed by an expert (routed and not dropped).
      group_sizes: int32[E] rows per expert (dropless: its load; capacity: C).
      num_routed: int32[] assignments routed by the router.
      num_dropped: int32[] routed assignments dropped for lack of capacity.
    """

    sort_order: jax.Array
    row_valid: jax.Array
    row_of: jax.Array
    kept: jax.Array
    group_sizes: jax.Array
    num_routed: jax.Array
    num_dropped: jax.Array


def stable_order(keys: jax.Array, num_keys: int) -> jax.Array:
    """int32[..., N]: ``jnp.argsort(keys, axis=-1, stable=True)`` of the int keys
    [..., N] in [0, num_keys), sorted as the one int32 key ``key * N + position`` (unique,
    so any sort is stable) where that fits in int32, else by ``jnp.argsort``.

    XLA:CPU sorts one int32 operand about 4x faster than the (key, index) pairs of an
    argsort: 32768 keys in [0, 65) (T 4096, K 8, E 64) took 2.2 ms against 9.0 ms on
    the project's 2-core Xeon VM, 0.55 ms against 2.1 ms at 8192 keys in [0, 9).
    """
    n = keys.shape[-1]
    if num_keys * n >= 2 ** 31:
        return jnp.argsort(keys, axis=-1, stable=True).astype(jnp.int32)
    position = jnp.arange(n, dtype=jnp.int32)
    return jnp.sort(keys.astype(jnp.int32) * n + position, axis=-1) % n


def _flat_expert_ids(routing: Routing) -> jax.Array:
    """int32[T*K] expert of each assignment, E for unassigned ones (they sort last)."""
    E = routing.num_experts
    return jnp.where(routing.mask, routing.expert_ids, E).reshape(-1)


def dropless_dispatch(routing: Routing) -> Dispatch:
    """Stable sort of the T*K assignments into expert order (no drops)."""
    T, K = routing.expert_ids.shape
    E = routing.num_experts
    flat = _flat_expert_ids(routing)
    sort_order = stable_order(flat, E + 1)  # row -> assignment
    counts = jnp.bincount(flat, length=E + 1).astype(jnp.int32)
    row_of = jnp.zeros_like(sort_order).at[sort_order].set(
        jnp.arange(T * K, dtype=sort_order.dtype))
    num_routed = jnp.sum(counts[:E], dtype=jnp.int32)
    return Dispatch(
        sort_order=sort_order,
        row_valid=jnp.arange(T * K, dtype=jnp.int32) < num_routed,
        row_of=row_of.reshape(T, K),
        kept=routing.mask,
        group_sizes=counts[:E],
        num_routed=num_routed,
        num_dropped=jnp.zeros((), jnp.int32),
    )


def align_groups(dispatch: Dispatch, multiple: int) -> Dispatch:
    """A dropless ``dispatch`` with each expert's rows from a multiple of ``multiple``
    and its group size rounded up to one (the rows added are padding: invalid, zero
    after ``permute``, never read by ``combine``). Rows: the static bound
    ceil((M + E * (multiple - 1)) / multiple) * multiple. ``multiple`` = 1 returns
    ``dispatch``. For a grouped GEMM that runs whole tiles faster
    (``pallas_kernels.ragged_dot.api.row_alignment``)."""
    if multiple == 1:
        return dispatch
    M, E = dispatch.sort_order.shape[0], dispatch.group_sizes.shape[0]
    rows = -(-(M + E * (multiple - 1)) // multiple) * multiple
    sizes = dispatch.group_sizes
    padded = (sizes + multiple - 1) // multiple * multiple
    ends = jnp.cumsum(sizes, dtype=jnp.int32)
    row = jnp.arange(M, dtype=jnp.int32)
    expert = row_groups(sizes, M)
    moved = (jnp.cumsum(padded, dtype=jnp.int32) - padded)[expert] + row - (ends - sizes)[expert]
    new_row = jnp.where(dispatch.row_valid, moved, rows).astype(jnp.int32)  # rows: dropped
    return dispatch.replace(
        sort_order=jnp.zeros(rows, jnp.int32).at[new_row].set(dispatch.sort_order,
                                                              mode="drop"),
        row_valid=jnp.zeros(rows, bool).at[new_row].set(True, mode="drop"),
        row_of=jnp.take(new_row, dispatch.row_of, mode="clip"),
        group_sizes=padded.astype(jnp.int32))


def _priority_order(routing: Routing, policy: str) -> jax.Array:
    """int32[T*K] flat assignments from most to least entitled to a place in its
    expert."""
    T, K = routing.expert_ids.shape
    if policy == "position":  # all top-1 choices in token order, then top-2, ...
        return jnp.arange(T * K, dtype=jnp.int32).reshape(T, K).T.reshape(-1)
    if policy == "probability":  # V-MoE batch prioritized routing: top-1 choices of
        # all tokens by their highest routing weight (ties in token order), then top-2, ...
        by_weight = jnp.argsort(-jnp.max(routing.weights, axis=1), stable=True)
        return (by_weight[None, :].astype(jnp.int32) * K
                + jnp.arange(K, dtype=jnp.int32)[:, None]).reshape(-1)
    raise ValueError(f"drop_policy={policy!r} is invalid: choose one of {DROP_POLICIES}")


def capacity_dispatch(routing: Routing, capacity: int, policy: str = "position") -> Dispatch:
    """Fixed capacity C per expert (GShard); overflowing assignments are dropped.

    An assignment's place within its expert is its rank among that expert's
    assignments in ``policy`` order; it is kept when the place is < C.
    """
    T, K = routing.expert_ids.shape
    E, C = routing.num_experts, capacity
    flat = _flat_expert_ids(routing)
    prio = _priority_order(routing, policy)
    by_expert = stable_order(flat[prio], E + 1)
    by_priority = prio[by_expert]  # flat assignments sorted by (expert, priority)
    counts = jnp.bincount(flat, length=E + 1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    place_sorted = jnp.arange(T * K, dtype=jnp.int32) - starts[flat[by_priority]]
    place = jnp.zeros(T * K, jnp.int32).at[by_priority].set(place_sorted)
    kept = (flat < E) & (place < C)
    row_of = jnp.where(kept, flat * C + place, E * C)  # E*C: out of range, never read
    sort_order = jnp.zeros(E * C, jnp.int32).at[row_of].set(
        jnp.arange(T * K, dtype=jnp.int32), mode="drop")
    row_valid = jnp.zeros(E * C, bool).at[row_of].set(True, mode="drop")
    num_routed = jnp.sum(counts[:E], dtype=jnp.int32)
    return Dispatch(
        sort_order=sort_order,
        row_valid=row_valid,
        row_of=row_of.reshape(T, K).astype(jnp.int32),
        kept=kept.reshape(T, K),
        group_sizes=jnp.full((E,), C, jnp.int32),
        num_routed=num_routed,
        num_dropped=num_routed - jnp.sum(kept, dtype=jnp.int32),
    )


def permute(x: jax.Array, dispatch: Dispatch) -> jax.Array:
    """Gather tokens into expert order: x[T, D] -> rows[M, D] (padding rows are 0).

    Backward: dx[t] = sum of drows over t's kept assignments, gathered through
    ``row_of`` (rows and kept assignments are one to one): no scatter-add, which
    XLA:CPU runs slowly.
    Inside ``shard_map`` the operands are cast to vary alike first (``vary_alike``), so
    the ``custom_vjp``'s cotangents type like its inputs."""
    return _permute(*vary_alike(x, dispatch.sort_order, dispatch.row_valid, dispatch.row_of,
                                dispatch.kept))


@jax.custom_vjp
def _permute(x, sort_order, row_valid, row_of, kept):
    rows = jnp.take(x, sort_order // row_of.shape[1], axis=0, mode="clip")  # in range
    return jnp.where(row_valid[:, None], rows, jnp.zeros((), x.dtype))


def _permute_fwd(x, sort_order, row_valid, row_of, kept):
    return (_permute(x, sort_order, row_valid, row_of, kept),
            (sort_order, row_valid, row_of, kept))


def _permute_bwd(residuals, drows):
    sort_order, row_valid, row_of, kept = residuals
    ones = jnp.ones(row_of.shape, accumulation_dtype(drows.dtype))
    dx = _weighted_rows(drows, row_of, kept, ones)
    return dx.astype(drows.dtype), None, None, None, None


_permute.defvjp(_permute_fwd, _permute_bwd)


def weight_rows(rows: jax.Array, sort_order: jax.Array, weights: jax.Array) -> jax.Array:
    """rows[p] * weights.flat[sort_order[p]]: each row [M, D] times the weight of its
    assignment (weights [T, K]), in rows' dtype (the product in at least float32). For
    routing weights applied to the experts' input (``MoEConfig.weight_side="input"``);
    padding rows are zero and stay zero."""
    acc = accumulation_dtype(rows.dtype, weights.dtype)
    scale = jnp.take(weights.reshape(-1).astype(acc), sort_order, mode="clip")
    return (rows.astype(acc) * scale[:, None]).astype(rows.dtype)


def combine(rows: jax.Array, dispatch: Dispatch, weights: jax.Array) -> jax.Array:
    """Weighted sum back into token order: rows[M, D], weights[T, K] -> y[T, D].

    y[t] = sum_k weights[t, k] * rows[row_of[t, k]] over kept assignments, accumulated in at
    least float32, elementwise (full precision on every platform, as the combine
    kernels compute it; a dot at JAX's default precision would be TF32 on a GPU).
    Backward, by gathers (no scatter-add): drows[r] = weight of row r's assignment *
    dy[row r's token] on valid rows, dweights[t, k] = <dy[t], rows[row_of[t, k]]>. (One
    gather of dy into row order serving both costs more on XLA:CPU: it and drows are
    then materialised, [M, D] each, where these fuse into their consumers.)
    """
    return _combine(*vary_alike(rows, weights, dispatch.sort_order, dispatch.row_valid,
                                dispatch.row_of, dispatch.kept))


def _weighted_rows(rows, row_of, kept, w) -> jax.Array:
    """sum_k w[t, k] * rows[row_of[t, k]] over kept assignments: [T, D] in w's dtype.
    A sum of K products per element (exact in float32 on every platform), which XLA
    fuses with the gather instead of materialising [T, K, D] for a batched dot."""
    out = jnp.zeros((row_of.shape[0], rows.shape[1]), w.dtype)
    for k in range(row_of.shape[1]):  # clip: an assignment not kept may point past the rows
        picked = jnp.take(rows, row_of[:, k], axis=0, mode="clip")
        out = out + jnp.where(kept[:, k, None], w[:, k, None] * picked.astype(w.dtype), 0.0)
    return out


@jax.custom_vjp
def _combine(rows, weights, sort_order, row_valid, row_of, kept):
    acc = accumulation_dtype(rows.dtype, weights.dtype)
    return _weighted_rows(rows, row_of, kept, weights.astype(acc))


def _combine_fwd(rows, weights, sort_order, row_valid, row_of, kept):
    y = _combine(rows, weights, sort_order, row_valid, row_of, kept)
    return y, (rows, weights, sort_order, row_valid, row_of, kept)


def _combine_bwd(residuals, dy):
    rows, weights, sort_order, row_valid, row_of, kept = residuals
    K = row_of.shape[1]
    w_row = jnp.take(jnp.where(kept, weights.astype(dy.dtype), 0.0).reshape(-1), sort_order,
                     mode="clip")
    drows = jnp.where(row_valid[:, None],
                      w_row[:, None] * jnp.take(dy, sort_order // K, axis=0, mode="clip"), 0.0)
    dweights = jnp.stack([  # clip: an assignment not kept may point past the rows
        jnp.where(kept[:, k], jnp.sum(dy * jnp.take(rows, row_of[:, k], axis=0, mode="clip"
                                                     ).astype(dy.dtype), axis=1),
                  0.0) for k in range(K)], axis=1)
    return drows.astype(rows.dtype), dweights.astype(weights.dtype), None, None, None, None


_combine.defvjp(_combine_fwd, _combine_bwd)
