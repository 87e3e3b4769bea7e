"""The expert-parallel MoE layer: ``aristax.moe.moe`` over a ("data", "expert") mesh.

Letters: T tokens (global), Tl = T / (R*W) tokens per device, D model dim, F expert
hidden dim, E experts, K experts per token, C capacity, W expert-parallel group size
("expert" axis), R groups ("data" axis), B rows per (source, destination) exchange
buffer. Experts are stored in ``num_slots`` physical slots (E without an
``expert_perm``), El = num_slots / W slots per device.

Per device, inside ``jax.shard_map`` (GShard / DeepSpeed-MoE expert parallelism):

  x[Tl, D] --route (aristax.moe.route_tokens, logical ids)--> ids -> physical slots
    --dispatch (aristax.dispatch, local)--> rows[M, D] sorted by slot = by owner
    --exchange over "expert"--> [W*B, D] rows for my El experts from every source
    --regroup by local expert, aristax.experts.expert_mlp--> back in source order
    --exchange back--> rows[M, D] --aristax.dispatch.combine--> y[Tl, D]

With ``config.implementation`` naming kernels, as in ``aristax.moe.moe``: the fused
``route`` kernel routes (and, dropless without an expert permutation, gives the local
dispatch), and the fused ``moe_mlp`` runs the local experts, where they serve.

The expert axis may be a pair of mesh axes, e.g. ("node", "local") on a
("data", "node", "local") mesh: experts are sharded over both (node-major), and the
"hierarchical" exchange (Tutel 2DH, ``aristax.parallel.collectives``) moves rows over
"local" then "node"; every result equals the flat ("data", "expert") mesh's.

Semantics, compared with the single-device ``aristax.moe.moe`` on the whole batch:
  * Dropless (``capacity_factor=None``): identical outputs, gradients and aux (in
    float32; with a 16-bit ``dtype`` the expert outputs travel back in that dtype, so
    results may differ from ``moe``'s by rounding). The
    exchange buffer defaults to B = Tl*K, the worst case (every assignment of a
    source going to one device), so nothing can overflow. A smaller
    ``buffer_size`` trades memory for overflow: rows past B for a destination
    (the highest slots of that destination first) are not processed, contribute 0
    like a capacity drop, and are counted in ``aux["num_overflow"]``,
    ``aux["num_dropped"]`` and ``aux["dropped_fraction"]``.
  * Capacity: capacity is per *source shard*, as in GShard: each device computes
    C = ceil(capacity_factor * Tl * K / E) over its own Tl tokens and drops by the
    drop policy among them. Outputs equal ``moe`` applied to each shard separately
    (not to the whole batch); ``num_dropped`` is the sum over shards. Buffers are
    exactly B = El*C, so capacity mode never overflows.
  * aux: counts and sums are all-reduced over every token axis, so lb_loss, z_loss,
    expert_load (logical order), nonfinite_tokens and seq_aux_loss (per-sequence
    counts all-reduced, so sequences may straddle shards) equal the single-device
    layer's on the whole batch. router_logits is [T, E], sharded like x.
  * Router jitter draws its noise for the whole [T, D] batch outside the map, so it
    equals the single-device layer's noise for the same key.
  * Expert choice routing is batch-global and is rejected (ValueError).
"""

from __future__ import annotations

import dataclasses
import functools
import math
from collections.abc import Sequence
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from aristax import dispatch as dispatch_lib
from aristax.config import MoEConfig
from aristax.moe import (MoEParams, check_inputs, check_tokens, fused_experts, layer_body,
                         make_dispatch, routed_mlp, router_input)
from aristax.pallas_kernels import frontdoor
from aristax.parallel import collectives, overlap
from aristax.parallel.collectives import check_exchange, default_exchange, rounds_from_schedule
from aristax.parallel.mesh import (EMPTY_SLOT, expert_axes_of, expert_permutation,
                                   inverse_permutation)
from aristax.sharding import DATA_AXIS, EXPERT_AXIS, EXPERT_FIELDS, PARAM_DIMS
_SCALAR_AUX = ("loss", "lb_loss", "seq_aux_loss", "z_loss", "dropped_fraction",
               "num_dropped", "num_overflow", "nonfinite_tokens", "unchosen_tokens")


# ------------------------------------------------------------------ layout
def send_layout(group_sizes: jax.Array, num_devices: int, buffer_size: int):
    """Per-destination blocks of rows sorted by physical slot, clipped to B rows.

    Args:
      group_sizes: int32[num_slots] rows per physical slot (slots s*El .. s*El + El - 1
        belong to device s); num_devices: W; buffer_size: B.
    Returns:
      input_offsets int32[W] (first row of each destination's block), send_sizes
      int32[W] (<= B) and sent_counts int32[W, El] rows per (destination, local
      expert) that fit in B.
    """
    counts = group_sizes.reshape(num_devices, -1)  # [W, El]
    block = jnp.sum(counts, axis=1, dtype=jnp.int32)
    offsets = jnp.cumsum(block, dtype=jnp.int32) - block
    cum = jnp.minimum(jnp.cumsum(counts, axis=1, dtype=jnp.int32), buffer_size)
    sent = jnp.diff(cum, axis=1, prepend=jnp.zeros((num_devices, 1), jnp.int32))
    return offsets, jnp.minimum(block, buffer_size), sent


def rows_sent(input_offsets: jax.Array, send_sizes: jax.Array, num_rows: int) -> jax.Array:
    """bool[M]: the row travels (lies in the first send_sizes[j] rows of block j)."""
    r = jnp.arange(num_rows, dtype=jnp.int32)[:, None]
    inside = (r >= input_offsets[None, :]) & (r < input_offsets[None, :] + send_sizes[None, :])
    return jnp.any(inside, axis=1)


def regroup_order(recv_counts: jax.Array, buffer_size: int) -> tuple[jax.Array, jax.Array]:
    """Order the received [W*B] rows by local expert (sources in order within one).

    Args:
      recv_counts: int32[W, El] rows from source i for local expert e (rows of one
        source are contiguous from i*B and sorted by expert).
    Returns:
      order int32[W*B] (received row of each expert-sorted row; padding last) and
      group_sizes int32[El].
    """
    pos = jnp.arange(buffer_size, dtype=jnp.int32)
    cum = jnp.cumsum(recv_counts, axis=1, dtype=jnp.int32)  # [W, El]
    local_expert = jnp.sum(pos[None, :, None] >= cum[:, None, :], axis=-1, dtype=jnp.int32)
    order = dispatch_lib.stable_order(local_expert.reshape(-1), recv_counts.shape[1] + 1)
    return order, jnp.sum(recv_counts, axis=0, dtype=jnp.int32)


def local_experts(recv: jax.Array, recv_counts: jax.Array, params: MoEParams, config: MoEConfig,
                  buffer_size: int) -> jax.Array:
    """Run this device's El experts on the received rows: [W*B, D] -> [W*B, D] (acc dtype),
    each output row in its received place (padding rows give 0).

    The received rows are tokens with one assignment each (K = 1, weight 1), so the fused
    ``moe_mlp`` serves them when ``config.implementation`` picks it: its gather prologue
    reads them in expert order and its epilogue writes each back in place."""
    order, sizes = regroup_order(recv_counts, buffer_size)
    ones = jnp.ones((recv.shape[0], 1), recv.dtype)
    out = fused_experts(recv, order, ones, sizes, jnp.sum(sizes), params, config,
                        input_weights=False)  # input-side weights were applied before
    if out is not None:
        return out
    out = routed_mlp(jnp.take(recv, order, axis=0), sizes, params, config)
    if config.expert_bias:  # padding rows (last in expert order) would hold the biases
        out = jnp.where((jnp.arange(out.shape[0]) < jnp.sum(sizes))[:, None], out, 0)
    return jnp.zeros_like(out).at[order].set(out, unique_indices=True)


# ------------------------------------------------------------------ the map body
def _exchange_experts(xc, dispatch, weights, params, config, *, W, B, expert_axis, exchange,
                      schedule=None):
    """Dispatch rows out, run the local experts, bring them back and combine.

    Args:
      xc: [Tc, D] tokens (compute dtype); dispatch: their ``Dispatch`` in physical slot
        order; weights: [Tc, K] combine weights; W: devices on ``expert_axis``; B: rows
        per (source, destination); exchange, schedule: as ``collectives.exchange``.
    Returns:
      (y[Tc, D] routed output in the accumulation dtype, num_overflow int32[]).
    """
    rows = dispatch_lib.permute(xc, dispatch)  # [M, D] sorted by slot
    if config.weight_side == "input":  # the weights scale the experts' input (Llama 4)
        rows = dispatch_lib.weight_rows(rows, dispatch.sort_order, weights)
        weights = jnp.ones_like(weights)
    M = rows.shape[0]
    offsets, sizes, sent_counts = send_layout(dispatch.group_sizes, W, B)
    recv_counts = jax.lax.all_to_all(sent_counts, expert_axis, 0, 0, tiled=True)
    exchange_kw = dict(axis_name=expert_axis, buffer_size=B, exchange=exchange,
                       schedule=schedule,
                       recv_sizes=jnp.sum(recv_counts, axis=1, dtype=jnp.int32))
    recv = collectives.exchange(rows, offsets, sizes, **exchange_kw)
    out = local_experts(recv, recv_counts, params, config, B).astype(xc.dtype)
    back = collectives.exchange(out, offsets, sizes, reverse=True, num_rows=M, **exchange_kw)
    sent = rows_sent(offsets, sizes, M)
    num_overflow = jnp.sum(dispatch.row_valid & ~sent, dtype=jnp.int32)
    kept = dispatch.kept & jnp.take(sent, dispatch.row_of, mode="fill", fill_value=False)
    return dispatch_lib.combine(back, dispatch.replace(kept=kept), weights), num_overflow


def _chunked_exchange(xc, routing, physical, config, chunk_buffer, num_chunks,
                      **exchange_experts_kw):
    """Lancet chunks (``aristax.parallel.overlap``) of one device's tokens: the shard's
    keep decisions once (on the logical ``routing``: capacity is per logical expert,
    whatever its replicas), then dispatch/exchange/experts/combine per chunk of the
    ``physical`` routing (ids = slots).

    Returns (y[Tl, D], kept-slot ``Dispatch`` counts: num_routed, num_dropped, overflow).
    """
    Tl = xc.shape[0]
    bounds = overlap.chunk_bounds(Tl, num_chunks)
    kept, num_dropped = overlap.keep_decisions(routing, config, bounds)
    ys, num_overflow = [], jnp.zeros((), jnp.int32)
    for a, b in bounds:
        r = overlap.chunk_routing(physical, kept, a, b)
        y, over = _exchange_experts(xc[a:b], dispatch_lib.dropless_dispatch(r), r.weights,
                                    B=chunk_buffer(Tl, b - a), config=config,
                                    **exchange_experts_kw)
        ys.append(y)
        num_overflow = num_overflow + over
    return jnp.concatenate(ys, axis=0), num_dropped, num_overflow


def tie_replicas(w: jax.Array, phys_to_log: Sequence[int]) -> jax.Array:
    """``w`` [num_slots, ...] itself; in the backward, each slot's gradient is the sum
    over the slots holding its logical expert (``phys_to_log``, ``EMPTY_SLOT`` < 0 for
    none). So the copies of a replicated expert all get the logical expert's gradient,
    as on one device, and stay equal under any optimizer that updates elementwise
    (each copy alone would get only its share of the tokens' gradient)."""
    return _tied(w, tuple(int(e) for e in phys_to_log))


@functools.partial(jax.custom_vjp, nondiff_argnums=(1,))
def _tied(w, phys_to_log):
    return w


def _tied_fwd(w, phys_to_log):
    return w, None


def _tied_bwd(phys_to_log, _, g):
    seg = np.asarray(phys_to_log)
    seg = np.where(seg < 0, seg.max() + 1 + np.arange(len(seg)), seg)  # empty: alone
    sharding = jax.typeof(g).sharding  # sharded in its type only on Explicit axes
    explicit = any(a is not None for a in sharding.spec)
    if explicit:  # there the sum over slots needs the slots in one place first
        g = jax.sharding.reshard(g, NamedSharding(sharding.mesh, P()))
    idx = jnp.asarray(seg, jnp.int32)
    tied = jax.ops.segment_sum(g, idx, num_segments=int(seg.max()) + 1)[idx]
    return (jax.sharding.reshard(tied, sharding) if explicit else tied,)


_tied.defvjp(_tied_fwd, _tied_bwd)


def replica_tables(phys_to_log: Sequence[int], num_experts: int) -> tuple[np.ndarray, np.ndarray]:
    """Slots of each logical expert: (slots int32[E, Rmax] padded with the first slot,
    counts int32[E]) from the physical -> logical map int[num_slots] (``EMPTY_SLOT``
    slots belong to no expert and receive no rows)."""
    phys_to_log = np.asarray(phys_to_log)
    where = [np.flatnonzero(phys_to_log == e) for e in range(num_experts)]
    width = max(len(w) for w in where)
    slots = np.stack([np.concatenate([w, np.full(width - len(w), w[0])]) for w in where])
    return slots.astype(np.int32), np.asarray([len(w) for w in where], np.int32)


def replicated_routing(routing, tables, axes, num_slots: int):
    """``routing`` with ids = physical slots, each logical expert's tokens split over its
    replicas round-robin by *global* token index (token t -> replica t % count[e]).

    The result's ``logits``/``probs`` are zeros [Tl, num_slots] so that the dispatch's
    ``num_experts`` is num_slots (only their shape is read; XLA drops them).
    """
    slots, counts = (jnp.asarray(a) for a in tables)
    Tl = routing.expert_ids.shape[0]
    t = jax.lax.axis_index(axes).astype(jnp.int32) * Tl + jnp.arange(Tl, dtype=jnp.int32)
    ids = routing.expert_ids
    replica = t[:, None] % counts[ids]  # [Tl, K]
    placeholder = jnp.zeros((Tl, num_slots), routing.logits.dtype)
    return routing.replace(expert_ids=slots[ids, replica], logits=placeholder,
                           probs=placeholder)


def _local_moe(x, router_in, params, bias, *, config, slot_of_expert, axes, expert_axis, W,
               num_shards, buffer_size, exchange, seq_len, num_chunks=1, chunk_buffer=None,
               schedule=None, replicas=None):
    """One device's share: x[Tl, D] -> (y[Tl, D], aux), the layer's ``layer_body``
    with the exchange as its routed experts and sums over the token shards. See the
    module docstring.

    slot_of_expert: int[E], the physical slot of each logical expert (None: identity;
    a layout with replicas or empty slots passes ``replicas``, ``replica_tables``)."""
    exchange_experts_kw = dict(params=params, W=W, expert_axis=expert_axis,
                               exchange=exchange, schedule=schedule)

    def exchanged(xc, routing, fused_dispatch):
        if replicas is not None:
            physical = replicated_routing(routing, replicas, axes, params.up_edf.shape[0] * W)
        else:
            physical = routing if slot_of_expert is None else routing.replace(
                expert_ids=jnp.asarray(slot_of_expert)[routing.expert_ids])
        if num_chunks > 1 or replicas is not None:
            return _chunked_exchange(xc, routing, physical, config, chunk_buffer, num_chunks,
                                     **exchange_experts_kw)
        dispatch = (fused_dispatch if fused_dispatch is not None and slot_of_expert is None
                    else make_dispatch(physical, config))
        y, num_overflow = _exchange_experts(xc, dispatch, routing.weights, config=config,
                                            B=buffer_size(x.shape[0]), **exchange_experts_kw)
        return y, dispatch.num_dropped, num_overflow

    return layer_body(x, router_in, params, config, bias, seq_len, exchanged,
                      reduce=functools.partial(jax.lax.psum, axis_name=axes),
                      num_shards=num_shards,
                      token_offset=jax.lax.axis_index(axes).astype(jnp.int32) * x.shape[0])


# ------------------------------------------------------------------ front door
EXPERT_CHOICE_REFUSAL = (
    "MoEConfig.router='expert_choice' picks tokens over the whole batch, which expert "
    "parallelism (each rank routing its own tokens) cannot: use a token-choice router "
    "(e.g. 'softmax_topk') for an expert-parallel layer, or run expert choice on a layer "
    "without plan= or an expert mesh axis (num_chunks included)")


def expert_parallel_options(plan, mesh, *, platform: str | None = None,
                            exchange: str | None = None) -> dict[str, Any]:
    """``expert_parallel_moe`` keyword arguments that carry out ``plan`` on ``mesh``.

    Args:
      plan: the ``aristax.planner.Plan`` the mesh was built from (``mesh_from_plan``).
      mesh: its mesh: ("data", "expert") or ("data", "node", "local").
      platform: "cpu", "gpu", ...; None: ``jax.default_backend()``.
      exchange: the all-to-all strategy (``EXCHANGES``); None: the plan's (below).
    Raises:
      ValueError: the mesh is not the plan's (no expert axis, or not a "data" axis of
        ``len(plan.groups)`` groups and expert axes of one group's devices).
    Returns:
      {"expert_perm": the plan's physical layout (None when it is the identity),
       "expert_axis": "expert" or ("node", "local"),
       "exchange": "hierarchical" when the groups span several nodes (Tutel 2DH: the
         slow inter-node links carry one message per node pair), else the
         platform's ("ragged" on GPU/TPU, "padded" on CPU),
       "num_chunks": the Lancet partition count of the dispatch all-to-all
         (1 when the plan has none),
       "schedule": with ``exchange="scheduled"``, the plan's Aurora order as rounds
         (``rounds_from_schedule`` of the group whose all-to-all takes longest: every
         group runs one program), else None}.
    """
    groups, group = len(plan.groups), len(plan.groups[0])
    expert_axis = expert_axes_of(mesh)
    expert_size = math.prod(mesh.shape[a] for a in _expert_axes(expert_axis))
    if (mesh.shape.get(DATA_AXIS) != groups or expert_size != group
            or math.prod(mesh.shape.values()) != groups * group):
        raise ValueError(
            f"mesh {dict(mesh.shape)} is not the plan's: it has {groups} expert-parallel "
            f"groups of {group} devices (a {DATA_AXIS!r} axis of {groups} and expert axes of "
            f"{group} devices in all); build the mesh with mesh_from_plan(plan, devices)")
    perm = expert_permutation(plan, allow_replicas=True)
    identity = len(perm) == plan.num_experts and np.array_equal(perm, np.arange(len(perm)))
    chunks = (overlap.num_chunks_from_plan(plan) if "dispatch" in getattr(plan, "op_names", ())
              else 1)
    if exchange is None:
        exchange = ("hierarchical" if isinstance(expert_axis, tuple)
                    else default_exchange(platform))
    check_exchange(exchange)
    if exchange == "hierarchical" and not isinstance(expert_axis, tuple):
        raise ValueError(
            f"exchange='hierarchical' needs a plan mesh that splits each group over "
            f"('node', 'local'), not {expert_axis!r}: build it with mesh_from_plan(plan, "
            "devices, topology=topology, hierarchical=True), or leave MoEConfig.exchange "
            "None for the plan's own")
    schedule = (rounds_from_schedule(max(plan.schedules, key=lambda s: s.makespan))
                if exchange == "scheduled" else None)
    return {
        "expert_perm": None if identity else tuple(int(p) for p in perm),
        "expert_axis": expert_axis,
        "exchange": exchange,
        "num_chunks": chunks,
        "schedule": schedule,
    }


def _expert_axes(expert_axis) -> tuple[str, ...]:
    """``expert_axis`` as a tuple of mesh axis names (a str is one axis)."""
    if isinstance(expert_axis, str):
        return (expert_axis,)
    axes = tuple(expert_axis)
    if not axes or not all(isinstance(a, str) for a in axes) or len(set(axes)) != len(axes):
        raise ValueError(f"expert_axis={expert_axis!r} must be a mesh axis name or a tuple of "
                         "distinct names, e.g. ('node', 'local')")
    return axes


def _token_axes(mesh, expert_axis, token_axes) -> tuple[str, ...]:
    """``token_axes`` as a tuple; None: "data" if the mesh has it, then the expert axes."""
    if token_axes is None:
        return tuple(dict.fromkeys(
            a for a in (DATA_AXIS,) + _expert_axes(expert_axis) if a in mesh.axis_names))
    return (token_axes,) if isinstance(token_axes, str) else tuple(token_axes)


def tokens_per_shard(num_tokens: int, mesh, expert_axis=EXPERT_AXIS, token_axes=None) -> int:
    """Tl: how many of ``num_tokens`` tokens each shard of ``expert_parallel_moe`` holds
    (``expert_axis`` and ``token_axes`` as there)."""
    axes = _token_axes(mesh, expert_axis, token_axes)
    return num_tokens // int(np.prod([mesh.shape[a] for a in axes]))


def _param_specs(params: MoEParams, expert_axis) -> MoEParams:
    def spec(name):
        if getattr(params, name) is None:
            return None
        return P(*(expert_axis if role == "expert" else None for role in PARAM_DIMS[name]))

    return MoEParams(**{name: spec(name) for name in PARAM_DIMS})


def _place(a, mesh, spec):
    """Give ``a`` the sharding ``spec`` on ``mesh`` (reshard under Explicit axes)."""
    if a is None:
        return None
    explicit = any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types)
    sharding = NamedSharding(mesh, spec)
    if explicit:
        return jax.sharding.reshard(a, sharding)
    return jax.lax.with_sharding_constraint(a, sharding)


def _explicit_spec(x, mesh):
    """x's PartitionSpec under a mesh with Explicit axes (None under Auto axes)."""
    if not any(t == jax.sharding.AxisType.Explicit for t in mesh.axis_types):
        return None
    spec = getattr(jax.typeof(x).sharding, "spec", None)
    return tuple(spec) if spec is not None else ()


def _resolve_mesh(mesh):
    if mesh is None:
        mesh = jax.sharding.get_abstract_mesh()
    if mesh is None or mesh.empty:
        raise ValueError("expert_parallel_moe needs a mesh: pass mesh=... or call it under "
                         "`with jax.set_mesh(mesh):`")
    return mesh


def _validate(x, config, mesh, expert_axis, token_axes, expert_perm, buffer_size):
    """Check the mesh axes, the router, the implementation, ``expert_perm`` (the physical
    -> logical map int[num_slots], or None) and ``buffer_size`` against each other
    (``ValueError`` naming the argument). Returns (W, the number of token shards)."""
    expert_axes = _expert_axes(expert_axis)
    if any(a not in mesh.axis_names for a in expert_axes):
        raise ValueError(f"expert_axis={expert_axis!r} is not a mesh axis {mesh.axis_names}; "
                         "build the mesh with mesh_from_plan or name the axis")
    missing = [a for a in token_axes if a not in mesh.axis_names]
    if missing:
        raise ValueError(f"token_axes={token_axes} name axes {missing} missing from the mesh "
                         f"{mesh.axis_names}")
    if len(set(token_axes)) != len(token_axes) or not set(expert_axes) <= set(token_axes):
        raise ValueError(f"token_axes={token_axes} must be distinct mesh axes that include the "
                         f"expert axes {expert_axes} (each expert-parallel rank routes its own "
                         "tokens); e.g. token_axes=None: ('data',) + the expert axes")
    if config.router == "expert_choice":
        raise ValueError(EXPERT_CHOICE_REFUSAL)
    if ("mosaic_gpu" in frontdoor.named(config.implementation)
            and frontdoor.resolve_interpret(None) and mesh.size > 1):
        raise ValueError(
            f"MoEConfig.implementation={config.implementation!r}: Mosaic GPU kernels cannot "
            "run in interpret mode inside the expert-parallel shard_map (JAX's Mosaic GPU "
            "interpreter deadlocks when several devices of one process run it); on the CPU "
            "use implementation='triton' or None, and 'mosaic_gpu' on a GPU")
    W = int(np.prod([mesh.shape[a] for a in expert_axes]))
    num_slots = config.num_experts
    if expert_perm is not None:
        num_slots = _check_expert_perm(expert_perm, config.num_experts, W)
    if num_slots % W:
        raise ValueError(f"MoEConfig.num_experts={num_slots} is not a multiple of the "
                         f"{expert_axis!r} axis size W={W}; use E % W == 0 or a smaller "
                         "expert axis")
    shards = int(np.prod([mesh.shape[a] for a in token_axes]))
    T = x.shape[0]
    if T % shards:
        raise ValueError(f"x has T={T} tokens, not a multiple of the {shards} token shards "
                         f"(mesh axes {token_axes}); pad the batch")
    if buffer_size is not None and (not isinstance(buffer_size, (int, np.integer))
                                    or isinstance(buffer_size, bool) or buffer_size < 1):
        raise ValueError(f"buffer_size={buffer_size!r} must be a positive int or None "
                         "(worst case Tl*K)")
    return W, shards


def _check_expert_perm(expert_perm, num_experts: int, W: int) -> int:
    """Check ``expert_perm``, the physical -> logical map, for E experts over W devices;
    returns its num_slots."""
    perm = np.asarray(expert_perm).reshape(-1)
    if perm.size and not np.issubdtype(perm.dtype, np.integer):
        raise ValueError(f"expert_perm must hold integer expert ids (or EMPTY_SLOT="
                         f"{EMPTY_SLOT}), got dtype {perm.dtype}")
    E, held = num_experts, sorted(set(perm.tolist()) - {EMPTY_SLOT})
    if perm.size < E or perm.size % W or held != list(range(E)) or perm.min() < EMPTY_SLOT:
        raise ValueError(
            f"expert_perm must map num_slots physical slots to logical experts (or "
            f"EMPTY_SLOT={EMPTY_SLOT}), every one of range(num_experts={E}) at least once, "
            f"with num_slots >= E and num_slots % W == 0 (W={W}); got {perm.size} slots "
            f"holding {held}")
    return perm.size


def mesh_platform(mesh) -> str:
    """The platform ``mesh`` runs on ("cpu", "gpu", ...): its devices', else its abstract
    device's (a mesh to cross-lower for), else JAX's default backend."""
    if isinstance(mesh, jax.sharding.Mesh):
        return mesh.devices.flat[0].platform
    device = getattr(mesh, "abstract_device", None)
    return jax.default_backend() if device is None else device.platform


def _check_exchange(exchange, expert_axes, expert_axis, schedule, platform: str) -> str:
    """``exchange`` (None: ``platform``'s), checked against the expert axes,
    ``schedule`` and the platform."""
    exchange = check_exchange(exchange or default_exchange(platform))
    if exchange == "ragged" and platform == "cpu":
        raise ValueError("exchange='ragged' runs jax.lax.ragged_all_to_all, which XLA:CPU "
                         "does not implement: on a CPU mesh use 'ragged_emulated' (the same "
                         "exchange, emulated), 'padded', or None (the platform's)")
    if exchange == "hierarchical" and len(expert_axes) != 2:
        raise ValueError(f"exchange='hierarchical' needs expert_axis=(outer, inner), two mesh "
                         f"axes such as ('node', 'local'), not {expert_axis!r}")
    if schedule is not None and exchange != "scheduled":
        raise ValueError(f"schedule= is used by exchange='scheduled' only, not {exchange!r}; "
                         "pass exchange='scheduled' or drop schedule")
    return exchange


def expert_parallel_moe(
    x: jax.Array,
    params: MoEParams,
    config: MoEConfig,
    mesh: jax.sharding.Mesh | jax.sharding.AbstractMesh | None = None,
    *,
    bias: jax.Array | None = None,
    jitter_rng: jax.Array | None = None,
    seq_len: int | None = None,
    expert_perm: Sequence[int] | None = None,
    exchange: str | None = None,
    buffer_size: int | None = None,
    expert_axis: str | tuple[str, ...] = EXPERT_AXIS,
    token_axes: Sequence[str] | None = None,
    num_chunks: int = 1,
    schedule: Sequence[Sequence[tuple[int, int]]] | None = None,
) -> tuple[jax.Array, dict[str, Any]]:
    """``aristax.moe.moe`` with experts sharded over ``mesh`` (see the module docstring).

    Args:
      x: [T, D] tokens; sharded over ``token_axes`` (T % (R*W) == 0).
      params: ``MoEParams``; expert weights [num_slots, ...] in *physical* order
        (logical order [E, ...] when ``expert_perm`` is None; see
        ``aristax.parallel.layout_experts``), sharded over ``expert_axis`` (each device
        holds El = num_slots/W slots).
      config: ``MoEConfig`` (token-choice router; capacity is per source shard).
      mesh: a ``Mesh``/``AbstractMesh`` with ``expert_axis``; None: the mesh set by
        ``jax.set_mesh``. The outputs are placed on it: of Explicit axes, JAX
        differentiates them eagerly only under ``jax.set_mesh`` (or in ``jit``).
      bias, jitter_rng, seq_len: as in ``aristax.moe.moe`` (T % seq_len == 0).
      expert_perm: int[num_slots], the logical expert in each physical slot
        (``Plan.replicas`` style: device w holds slots w*El .. (w+1)*El - 1), e.g.
        ``expert_permutation(plan)``; None: identity. num_slots = E: a permutation.
        ``EMPTY_SLOT`` (-1) entries pad devices that hold fewer experts.
        num_slots > E: replicated experts (every logical expert in >= 1 slot,
        num_slots % W == 0; ``layout_experts(params, expert_perm)`` lays the weights
        out): each logical expert's tokens are split over its replicas round-robin by
        global token index; capacity stays per logical expert, so outputs and aux
        equal the unreplicated layer's, and each replica's gradient is its logical
        expert's gradient (``tie_replicas``: the replicas' shares summed), so that
        replicas trained by an elementwise optimizer stay equal.
      exchange: the all-to-all strategy, one of ``EXCHANGES``; None: "padded" on CPU,
        "ragged" on GPU/TPU; "hierarchical": Tutel 2DH (intra-node then inter-node
        all_to_all) over an ``expert_axis`` pair.
      buffer_size: B rows per (source, destination) in dropless mode; None: Tl*K
        (never overflows). Ignored in capacity mode (B = El*C).
      expert_axis: the expert-parallel mesh axis, or a tuple of axes taken together
        (node-major: experts are sharded over ``P(("node", "local"))``, device
        (n, l) holds the El slots of expert-parallel rank n*Wl + l, Wl the inner size; W the
        product of their sizes). ``exchange="hierarchical"`` needs a pair
        (outer = inter-node, inner = intra-node). token_axes: mesh axes the tokens
        are split over (default: "data" if present, then the expert axes).
      num_chunks: k Lancet chunks of each device's Tl tokens (1 <= k <= Tl; e.g.
        ``overlap.num_chunks_from_plan(plan)``): keep decisions are made once per
        shard, then each chunk is exchanged and computed on its own so XLA can
        overlap chunk i's exchange with chunk i+1's compute. Equals ``num_chunks=1``
        exactly, drops included (``aristax.parallel.overlap``). Per-chunk buffers:
        min(El*C, Tc*K) in capacity mode, min(buffer_size, Tc*K) dropless (a
        ``buffer_size`` smaller than Tc*K may overflow differently than unchunked).
      schedule: ``exchange="scheduled"`` only: ppermute rounds of (src, dst) pairs on
        the expert axis, e.g. ``rounds_from_schedule(plan.schedules[0])``.
    Returns:
      (y[T, D], aux) as ``moe``; aux also has num_overflow (int32[]). Under Explicit
      mesh axes y and router_logits keep x's sharding; under Auto axes they come
      out sharded over ``token_axes``.
    """
    mesh = _resolve_mesh(mesh)
    layout = _checked_layout(
        x, params, config, mesh, bias=bias, seq_len=seq_len, expert_perm=expert_perm,
        exchange=exchange, buffer_size=buffer_size, expert_axis=expert_axis,
        token_axes=token_axes, num_chunks=num_chunks, schedule=schedule)
    x_spec = _explicit_spec(x, mesh)
    router_in = router_input(x, config, jitter_rng)
    y, aux = _sharded_forward(x, router_in, params, bias, layout=layout)
    if x_spec is not None:  # Explicit axes: the output keeps the input's sharding
        row = P(x_spec[0] if len(x_spec) else None, None)
        y = _place(y, mesh, P(*x_spec) if len(x_spec) == 2 else row)
        aux["router_logits"] = _place(aux["router_logits"], mesh, row)
    return y, aux


def _checked_layout(x, params, config, mesh, *, bias, seq_len, expert_perm, exchange,
                    buffer_size, expert_axis, token_axes, num_chunks, schedule):
    """``expert_parallel_moe``'s arguments checked (a ``ValueError`` naming the argument)
    and gathered into its static ``ShardedLayout``."""
    expert_axes = _expert_axes(expert_axis)
    expert_axis = expert_axes[0] if len(expert_axes) == 1 else expert_axes
    token_axes = _token_axes(mesh, expert_axis, token_axes)
    check_tokens(x, config)
    W, shards = _validate(x, config, mesh, expert_axis, token_axes, expert_perm, buffer_size)
    num_slots = config.num_experts if expert_perm is None else len(expert_perm)
    if params.up_edf.shape[0] != num_slots:
        raise ValueError(f"params hold {params.up_edf.shape[0]} experts but the layout has "
                         f"{num_slots} physical slots; lay the weights out with "
                         "layout_experts(params, expert_perm)")
    seq_len = check_inputs(x, params, config, bias=bias, seq_len=seq_len, num_slots=num_slots)
    exchange = _check_exchange(exchange, expert_axes, expert_axis, schedule,
                               mesh_platform(mesh))
    Tl = x.shape[0] // shards
    if isinstance(num_chunks, (int, np.integer)) and num_chunks > Tl:
        raise ValueError(f"num_chunks={num_chunks} exceeds the {Tl} tokens of each token "
                         f"shard (T={x.shape[0]} over {shards} shards); use num_chunks <= {Tl}")
    overlap.chunk_bounds(Tl, num_chunks)  # validates num_chunks early
    return ShardedLayout(
        config, mesh, None if expert_perm is None else tuple(map(int, np.ravel(expert_perm))),
        token_axes, expert_axis, W, shards, None if buffer_size is None else int(buffer_size),
        exchange, seq_len, int(num_chunks),
        None if schedule is None else tuple(tuple(map(tuple, r)) for r in schedule),
        _param_specs(params, expert_axis))


@dataclasses.dataclass(frozen=True)
class ShardedLayout:
    """What one compiled expert-parallel layer depends on besides its arrays, as
    ``expert_parallel_moe`` checked it (hashable: ``jax.jit``'s static argument).
    ``expert_perm``: the physical -> logical map int[num_slots] (None: identity);
    W: devices on the expert axes; shards: token shards."""

    config: MoEConfig
    mesh: jax.sharding.Mesh
    expert_perm: tuple[int, ...] | None
    token_axes: Any
    expert_axis: Any
    W: int
    shards: int
    buffer_size: int | None
    exchange: str
    seq_len: int | None
    num_chunks: int
    schedule: tuple | None
    param_specs: MoEParams


@functools.partial(jax.jit, static_argnames=("layout",))
def _sharded_forward(x, router_in, params, bias, *, layout: ShardedLayout):
    """The ``shard_map`` of ``_local_moe`` over ``layout``: (y, aux). Jitted with the
    layout static, so eager calls (a notebook) reuse one compilation per layout from
    ``jax.jit``'s own cache (a bare ``shard_map`` runs op by op eagerly: 10 s a call for
    a small layer on 8 CPU devices); inside a caller's ``jit`` it is inlined."""
    (config, mesh, expert_perm, token_axes, expert_axis, W, shards, buffer_size, exchange,
     seq_len, num_chunks, schedule, param_specs) = (getattr(layout, f.name)
                                                     for f in dataclasses.fields(layout))
    slot_of_expert, replicas = None, None  # logical -> physical; replicated layouts
    num_slots = config.num_experts if expert_perm is None else len(expert_perm)
    if expert_perm is not None:
        if num_slots == config.num_experts:
            slot_of_expert = inverse_permutation(expert_perm)
        else:
            replicas = replica_tables(expert_perm, config.num_experts)
    E_local = num_slots // W

    def buffers(tl):
        if config.capacity(tl) is not None:
            return E_local * config.capacity(tl)
        return buffer_size or tl * config.top_k

    def chunk_buffers(tl, tc):
        return min(buffers(tl), tc * config.top_k)

    body = functools.partial(
        _local_moe, config=config, slot_of_expert=slot_of_expert, axes=token_axes,
        expert_axis=expert_axis, W=W, num_shards=shards, buffer_size=buffers,
        exchange=exchange, seq_len=seq_len, num_chunks=num_chunks, chunk_buffer=chunk_buffers,
        replicas=replicas, schedule=schedule)
    tok = P(token_axes, None)
    aux_specs = {k: P() for k in _SCALAR_AUX} | {"expert_load": P(), "router_logits": tok}
    # Pallas interpret mode (kernels named, on the CPU) fails JAX 0.10's varying-manual-
    # axes check inside shard_map ("Scan carry input and output got mismatched varying
    # manual axes"): there the check is off. Compiled kernels keep it.
    sharded = jax.shard_map(
        body, mesh=mesh, in_specs=(tok, tok, param_specs, P()), out_specs=(tok, aux_specs),
        check_vma=not frontdoor.interprets(config.implementation))

    # placed inside the jit: eagerly, an abstract mesh (jax.set_mesh read under a trace
    # such as nnx.grad) cannot constrain single-device arrays
    params = MoEParams(**{name: _place(getattr(params, name), mesh, getattr(param_specs, name))
                          for name in PARAM_DIMS})
    if replicas is not None:  # the copies of an expert train as one
        params = params.replace(**{name: tie_replicas(getattr(params, name), expert_perm)
                                   for name in EXPERT_FIELDS
                                   if getattr(params, name) is not None})
    return sharded(_place(x, mesh, tok), _place(router_in, mesh, tok), params,
                   _place(bias, mesh, P()))
