"""Lancet overlap: the MoE layer split along the token (batch) dimension into k chunks.

Letters: T tokens, Tc tokens in one chunk, D model dim, E experts, K experts per
token, C capacity, k number of chunks.

Lancet (Jiang et al., MLSys 2024, section 2.3 "Challenge 1", Fig. 5c) partitions the
MoE layer along the batch so the all-to-all of chunk i can overlap the computation
of chunk i+1 (and the non-MoE ops around the layer). Splitting naively changes the
result in capacity mode: each micro-batch would get capacity C/k. Lancet instead
*carries* capacity between partitions, so the chunked layer makes exactly the
unchunked layer's keep/drop decisions and any chunk may send 0..C rows to an expert
(irregular exchanges). Here:

1. **One routing pass over all T tokens** (router logits are [T, E], cheap). This
   is required anyway: the load-balancing losses, expert_load and the
   "probability" drop policy are batch-global (Lancet 5.1: batch-prioritized gates
   can only be partitioned *after* the gate).
2. **Keep decisions** (``keep_decisions``), bit-for-bit those of
   ``aristax.dispatch.capacity_dispatch`` on the whole batch:
     * "position" (GShard: all top-1 choices in token order, then all top-2, ...):
       the order is global across the batch, so "places used by chunks < i" alone
       is not enough (chunk 0's top-2 choices rank *after* chunk 1's top-1
       choices). The carry is a table per (rank r, expert e): chunk i's assignment (t, r)
       to expert e gets place
         sum_{r' < r} total[r', e] + carry_i[r, e] + (rank of t among chunk i's
         rank-r assignments to e, token order),
       where total[r, e] counts rank-r assignments to e over the whole batch and
       carry_i[r, e] those in chunks < i; it is kept when place < C. Each chunk
       computes its own decisions from the carry (``carried_keep_position``).
     * "probability" (tokens by their top weight over the whole batch): a chunk's
       decision depends on every other chunk's weights, so the decisions come
       from one global ``capacity_dispatch`` (a sort of T weights).
     * expert choice: the router itself picks, globally; its picks are the kept set.
   ``capacity_carry`` reports, per chunk, how many places each expert already used
   (the quantity Lancet's gating operators pass along).
3. **Per chunk**: dispatch of the chunk's *kept* assignments in expert order (a dropless
   layout of only the kept assignments: the chunk sends 0..C rows to an expert), experts
   (or the expert-parallel exchange, see ``aristax.parallel.expert_parallel``), and
   combine. Each token's output only depends on its own kept assignments, so the chunked
   layer equals ``aristax.moe.moe``: outputs, gradients and aux (num_dropped,
   expert_load, losses).

Under ``jit`` the k chunks are independent programs, so XLA's scheduler may overlap
chunk i's collectives with chunk i+1's compute (async collectives on GPU/TPU). On one
CPU device there is nothing to overlap; chunking then only costs.
"""

from __future__ import annotations

from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aristax import dispatch as dispatch_lib
from aristax import routing as routing_lib
from aristax.config import MoEConfig
from aristax.moe import (MoEParams, check_inputs, layer_body, make_dispatch, routed_experts,
                         router_input)

Bounds = tuple[tuple[int, int], ...]


def chunk_bounds(num_tokens: int, num_chunks: int) -> Bounds:
    """Static [start, stop) token ranges of ``num_chunks`` chunks covering T tokens.

    Chunk sizes differ by at most one (the first T % k chunks get one more token), so
    k need not divide T.
    """
    if not isinstance(num_chunks, (int, np.integer)) or num_chunks < 1:
        raise ValueError(f"num_chunks={num_chunks!r} must be a positive integer (1 = no "
                         "chunking)")
    if num_chunks > num_tokens:
        raise ValueError(f"num_chunks={num_chunks} exceeds the T={num_tokens} tokens to "
                         "split; use num_chunks <= T")
    base, extra = divmod(num_tokens, int(num_chunks))
    sizes = [base + (i < extra) for i in range(int(num_chunks))]
    stops = np.cumsum(sizes)
    return tuple((int(s - n), int(s)) for s, n in zip(stops, sizes))


def num_chunks_from_plan(plan: Any, op: str = "dispatch") -> int:
    """k for the layer: the Lancet partition count of ``op`` in a planner ``Plan``.

    ``plan.partitions`` is ``aristax.planner.lancet.PartitionPlan`` over
    ``plan.op_names`` (the block ops of ``aristax.planner.costs.block_ops``); the
    dispatch all-to-all's count is the number of chunks the exchange runs in.
    """
    names = tuple(getattr(plan, "op_names", ()))
    if op not in names:
        raise ValueError(f"op={op!r} is not one of the plan's op_names {names}; pass the "
                         "name of the dispatch all-to-all op")
    return int(plan.partitions.counts(len(names))[names.index(op)])


# ------------------------------------------------------------ keep decisions
def _rank_counts(routing: routing_lib.Routing) -> jax.Array:
    """int32[T, K, E]: one-hot of each assignment's expert (0 for unassigned)."""
    onehot = jax.nn.one_hot(routing.expert_ids, routing.num_experts, dtype=jnp.int32)
    return onehot * routing.mask[..., None].astype(jnp.int32)


def carried_keep_position(routing: routing_lib.Routing, capacity: int,
                          bounds: Bounds) -> jax.Array:
    """"position" keep decisions, computed chunk by chunk with carried capacity.

    Args:
      routing: the whole batch's ``Routing`` (ids, mask [T, K]).
      capacity: C places (rows) per expert.
      bounds: ``chunk_bounds(T, k)``.
    Returns:
      bool[T, K], equal to ``capacity_dispatch(routing, C, "position").kept`` (see
      the module docstring for the place formula and the carry table [K, E]).
    """
    onehot = _rank_counts(routing)  # [T, K, E]
    total = jnp.sum(onehot, axis=0)  # [K, E] rank-r assignments per expert, whole batch
    base = jnp.cumsum(total, axis=0) - total  # [K, E] places taken by ranks < r
    carry = jnp.zeros_like(total)  # [K, E] rank-r places taken by chunks < i
    kept = []
    for start, stop in bounds:
        oh = onehot[start:stop]  # [Tc, K, E]
        within = jnp.cumsum(oh, axis=0) - oh  # earlier tokens of this chunk, same rank
        place = jnp.sum(oh * (base[None] + carry[None] + within), axis=-1)  # [Tc, K]
        kept.append(routing.mask[start:stop] & (place < capacity))
        carry = carry + jnp.sum(oh, axis=0)
    return jnp.concatenate(kept, axis=0)


def keep_decisions(routing: routing_lib.Routing, config: MoEConfig,
                   bounds: Bounds) -> tuple[jax.Array, jax.Array]:
    """The unchunked layer's kept assignments and its dropped count.

    Args:
      routing: the whole batch's ``Routing`` ([T, K]; expert ids may be physical slots).
      config: the layer's ``MoEConfig``.
      bounds: ``chunk_bounds(T, k)``.
    Returns:
      (kept bool[T, K], num_dropped int32[]): dropless keeps every routed assignment;
      "position" uses ``carried_keep_position``; "probability" and expert choice
      use one global ``make_dispatch`` (their decisions are batch-global).
    """
    T = routing.expert_ids.shape[0]
    C = config.capacity(T)
    if config.router != "expert_choice" and C is None:
        return routing.mask, jnp.zeros((), jnp.int32)
    if config.router != "expert_choice" and config.drop_policy == "position":
        kept = carried_keep_position(routing, C, bounds)
    else:
        kept = make_dispatch(routing, config).kept
    routed = jnp.sum(routing.mask, dtype=jnp.int32)
    return kept, routed - jnp.sum(kept, dtype=jnp.int32)


def capacity_carry(routing: routing_lib.Routing, kept: jax.Array, bounds: Bounds) -> jax.Array:
    """int32[k, E]: places of each expert already used by chunks < i (Lancet's carry).

    Row i is what chunk i's gate learns from the chunks before it; row i plus chunk
    i's own kept count never exceeds C.
    """
    used = jnp.sum(_rank_counts(routing.replace(mask=kept)), axis=1)  # [T, E]
    per_chunk = jnp.stack([jnp.sum(used[a:b], axis=0) for a, b in bounds])  # [k, E]
    return jnp.cumsum(per_chunk, axis=0) - per_chunk


def chunk_routing(routing: routing_lib.Routing, kept: jax.Array, start: int,
                  stop: int) -> routing_lib.Routing:
    """Rows start..stop of ``routing`` with ``mask`` = the kept assignments ([Tc, K])."""
    return jax.tree.map(lambda a: a[start:stop], routing.replace(mask=kept))


# ------------------------------------------------------------ single device
def chunk_experts(xc: jax.Array, routing: routing_lib.Routing, params: MoEParams,
                  config: MoEConfig) -> jax.Array:
    """One chunk on one device: xc[Tc, D] (compute dtype), routing [Tc, K] with mask =
    kept assignments -> routed-expert output [Tc, D] in the accumulation dtype (dropless
    layout of the kept assignments, so the fused ``moe_mlp`` kernels serve it too)."""
    return routed_experts(xc, dispatch_lib.dropless_dispatch(routing), routing.weights,
                          params, config, dropless=True)


def chunked_moe(
    x: jax.Array,
    params: MoEParams,
    config: MoEConfig,
    *,
    num_chunks: int = 1,
    bias: jax.Array | None = None,
    jitter_rng: jax.Array | None = None,
    seq_len: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """``aristax.moe.moe`` computed in ``num_chunks`` token chunks (Lancet, Fig. 5c).

    Args:
      x: [T, D]. params, config, bias, jitter_rng, seq_len: as ``aristax.moe.moe``.
      num_chunks: k in [1, T] (need not divide T); e.g. ``num_chunks_from_plan(plan)``.
    Returns:
      (y[T, D], aux), equal to ``aristax.moe.moe(x, ...)`` including drops.
    """
    seq_len = check_inputs(x, params, config, bias=bias, seq_len=seq_len)
    bounds = chunk_bounds(x.shape[0], num_chunks)

    def in_chunks(xc, routing, _):  # the whole batch routed once, its keep decisions
        kept, num_dropped = keep_decisions(routing, config, bounds)
        y = jnp.concatenate([chunk_experts(xc[a:b], chunk_routing(routing, kept, a, b),
                                           params, config) for a, b in bounds], axis=0)
        return y, num_dropped, None

    return layer_body(x, router_input(x, config, jitter_rng), params, config, bias, seq_len,
                      in_chunks)
