"""Dispatch and combine: token order <-> expert order.

Letters: T tokens, D model dim, E experts, K slots per token, C capacity, M rows in
expert order (M = T*K dropless, M = E*C with capacity).

Two layouts, one ``Dispatch`` pytree:
  * dropless: a stable sort of the T*K assignments by expert; rows [T*K, D], experts
    see ``group_sizes`` rows each, unassigned slots sort to the end (zero rows).
  * capacity: rows [E*C, D] = [E, C, D] flattened; expert e owns rows e*C..e*C+C-1;
    assignments beyond C per expert are dropped, and counted.
"""

from __future__ import annotations

import flax.struct
import jax
import jax.numpy as jnp

from aristax.config import DROP_POLICIES, accumulation_dtype
from aristax.routing import Routing


@flax.struct.dataclass
class Dispatch:
    """How tokens are laid out for the experts, and back.

    Attributes:
      row_slot: int32[M] flat slot t*K + k that feeds each row (0 on padding rows).
        Dropless it is a permutation of the T*K slots, the kernels' ``sort_order``.
      row_valid: bool[M] row holds a token (False: padding, zero row).
      slot: int32[T, K] row that holds each slot's output (meaningless where not kept).
      kept: bool[T, K] slot is processed by an expert (routed and not dropped).
      group_sizes: int32[E] rows per expert (dropless: its load; capacity: C).
      num_routed: int32[] slots routed by the router.
      num_dropped: int32[] routed slots dropped for lack of capacity.
    """

    row_slot: jax.Array
    row_valid: jax.Array
    slot: jax.Array
    kept: jax.Array
    group_sizes: jax.Array
    num_routed: jax.Array
    num_dropped: jax.Array

    @property
    def row_token(self) -> jax.Array:
        """int32[M] token that feeds each row."""
        return self.row_slot // self.slot.shape[1]


def _flat_expert_ids(routing: Routing) -> jax.Array:
    """int32[T*K] expert of each slot, E for unassigned slots (they sort last)."""
    E = routing.num_experts
    return jnp.where(routing.mask, routing.expert_ids, E).reshape(-1)


def dropless_dispatch(routing: Routing) -> Dispatch:
    """Stable sort of the T*K assignments into expert order (no drops)."""
    T, K = routing.expert_ids.shape
    E = routing.num_experts
    flat = _flat_expert_ids(routing)
    order = jnp.argsort(flat, stable=True).astype(jnp.int32)  # row -> flat slot
    counts = jnp.bincount(flat, length=E + 1).astype(jnp.int32)
    inverse = jnp.zeros_like(order).at[order].set(jnp.arange(T * K, dtype=order.dtype))
    num_routed = jnp.sum(counts[:E], dtype=jnp.int32)
    return Dispatch(
        row_slot=order,
        row_valid=jnp.arange(T * K, dtype=jnp.int32) < num_routed,
        slot=inverse.reshape(T, K),
        kept=routing.mask,
        group_sizes=counts[:E],
        num_routed=num_routed,
        num_dropped=jnp.zeros((), jnp.int32),
    )


def _priority_order(routing: Routing, policy: str) -> jax.Array:
    """int32[T*K] flat slots from most to least entitled to a place in its expert."""
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
    by_expert = jnp.argsort(flat[prio], stable=True)
    slot_in_expert_order = prio[by_expert]  # flat slots sorted by (expert, priority)
    counts = jnp.bincount(flat, length=E + 1).astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    place_sorted = jnp.arange(T * K, dtype=jnp.int32) - starts[flat[slot_in_expert_order]]
    place = jnp.zeros(T * K, jnp.int32).at[slot_in_expert_order].set(place_sorted)
    kept = (flat < E) & (place < C)
    slot = jnp.where(kept, flat * C + place, E * C)  # E*C: out of range, never read
    row_slot = jnp.zeros(E * C, jnp.int32).at[slot].set(
        jnp.arange(T * K, dtype=jnp.int32), mode="drop")
    row_valid = jnp.zeros(E * C, bool).at[slot].set(True, mode="drop")
    num_routed = jnp.sum(counts[:E], dtype=jnp.int32)
    return Dispatch(
        row_slot=row_slot,
        row_valid=row_valid,
        slot=slot.reshape(T, K).astype(jnp.int32),
        kept=kept.reshape(T, K),
        group_sizes=jnp.full((E,), C, jnp.int32),
        num_routed=num_routed,
        num_dropped=num_routed - jnp.sum(kept, dtype=jnp.int32),
    )


def permute(x: jax.Array, dispatch: Dispatch) -> jax.Array:
    """Gather tokens into expert order: x[T, D] -> rows[M, D] (padding rows are 0)."""
    rows = jnp.take(x, dispatch.row_token, axis=0)
    return jnp.where(dispatch.row_valid[:, None], rows, jnp.zeros((), x.dtype))


def combine(rows: jax.Array, dispatch: Dispatch, weights: jax.Array) -> jax.Array:
    """Weighted sum back into token order: rows[M, D], weights[T, K] -> y[T, D].

    y[t] = sum_k weights[t, k] * rows[slot[t, k]] over kept slots, accumulated in at
    least float32, at full precision (a weighted sum, as the combine kernels compute
    it; JAX's default precision would round its float32 terms to TF32 on a GPU).
    """
    acc = accumulation_dtype(rows.dtype, weights.dtype)
    w = jnp.where(dispatch.kept, weights.astype(acc), 0.0)
    gathered = jnp.take(rows, dispatch.slot, axis=0, mode="fill", fill_value=0)  # [T,K,D]
    gathered = jnp.where(dispatch.kept[..., None], gathered.astype(acc), 0.0)
    return jnp.einsum("tk,tkd->td", w, gathered, precision=jax.lax.Precision.HIGHEST)
