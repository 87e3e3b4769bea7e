"""Token exchange between the devices of an expert-parallel group.

Letters: W devices on the exchange axis (the expert-parallel group size), B rows per
(source, destination) buffer, N rows on the sender, D the row width (any trailing shape).

One front door, ``exchange(x, input_offsets, send_sizes, ...)``:
  * forward: the sender's rows are contiguous per destination (block j starts at
    ``input_offsets[j]`` and its first ``send_sizes[j] <= B`` rows are sent). The
    receiver gets ``[W*B, ...]``: the rows of source i at i*B .. i*B + recv_sizes[i],
    zeros elsewhere.
  * ``reverse=True``: the inverse trip with the *same* sender layout arguments:
    ``x[W*B, ...]`` laid out as the forward returned it goes back, and each sender
    gets ``[N, ...]`` with block j's rows back at ``input_offsets[j]``, zeros elsewhere.

Exchanges (``EXCHANGES``, the all-to-all strategies):
  * "padded": fixed [W, B, ...] buffers and ``jax.lax.all_to_all``; runs everywhere.
  * "ragged": ``jax.lax.ragged_all_to_all`` (GPU/TPU; XLA:CPU does not implement it);
    only the rows in use travel.
  * "ragged_emulated": the "ragged" offsets with ``ragged_all_to_all_emulated`` (the
    documented semantics built from a dense ``all_to_all``); runs everywhere, and
    exists to test the ragged offsets end to end on CPU.
  * "scheduled": the "padded" buffers moved by a sequence of ``jax.lax.ppermute``
    rounds, each a partial permutation (src -> dst pairs with distinct sources and
    distinct destinations): the planner's Aurora rounds (``rounds_from_schedule``),
    completed with shift rounds for any pair the plan did not list (the plan's
    traffic is an estimate; real traffic may use every pair). The return trip runs
    the rounds transposed. Without a schedule: W-1 shift rounds (i -> i+s).
  * "hierarchical": the "padded" buffers moved in two stages (Tutel's 2DH
    all-to-all, Hwang et al., MLSys 2023): ``axis_name`` is a pair of mesh
    axes (outer, inner), e.g. ("node", "local"), and the W = Wn*Wl devices are
    numbered node-major (device (n, l) is n*Wl + l, as ``jax.lax.all_to_all`` over
    the pair numbers them). [W, B, ...] is viewed as [Wn, Wl, B, ...]; an all_to_all
    over the inner (intra-node) axis first gathers on device (n, l) every row of
    node n bound for local rank l of any node, then one all_to_all over the outer
    (inter-node) axis delivers them: Wn-1 inter-node messages of Wl*B rows per
    device instead of W-Wl messages of B rows. The return trip runs the stages in
    reverse order (outer, then inner). Same result as "padded" over the pair.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from aristax.config import EXCHANGES

Rounds = tuple[tuple[tuple[int, int], ...], ...]
_PLATFORM_EXCHANGE = {"cpu": "padded", "gpu": "ragged", "cuda": "ragged", "rocm": "ragged",
                     "tpu": "ragged"}


def default_exchange(platform: str | None = None) -> str:
    """The exchange for a platform: cpu -> "padded", gpu/tpu -> "ragged"."""
    platform = platform or jax.default_backend()
    return _PLATFORM_EXCHANGE.get(platform, "padded")


def check_exchange(exchange: str) -> str:
    """``exchange`` itself when it is one of ``EXCHANGES``, else a ``ValueError``."""
    if exchange not in EXCHANGES:
        raise ValueError(
            f"exchange={exchange!r} is invalid: choose one of {EXCHANGES} or None "
            "(chosen from the platform)")
    return exchange


def all_to_all_vector(v: jax.Array, axis_name: str) -> jax.Array:
    """v[W] -> out[W] with out[i] = v_i[me]: what source i holds for this device."""
    return jax.lax.all_to_all(v, axis_name, 0, 0, tiled=True)


def ragged_args(
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    *,
    axis_name: str,
    buffer_size: int,
    reverse: bool = False,
    recv_sizes: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array, jax.Array, jax.Array]:
    """Arguments of ``jax.lax.ragged_all_to_all`` for ``exchange`` (one slice per peer).

    Forward: send block j (``input_offsets[j]``, ``send_sizes[j]``) to device j, where
    it lands at ``me * B``; receive ``recv_sizes[i] = send_sizes_i[me]`` rows from
    each source i. Reverse: send the rows of source i back from ``i * B`` (sizes
    ``recv_sizes``) to source i's ``input_offsets_i[me]``.

    Args: int32[W] each, the sender's layout (``send_sizes[j] <= B``);
      ``recv_sizes`` (optional): int32[W] rows from each source when the caller
      already has them, which saves one small all_to_all.
    Returns:
      (input_offsets, send_sizes, output_offsets, recv_sizes), int32[W] each, in the
      order ``jax.lax.ragged_all_to_all`` takes them.
    """
    W = send_sizes.shape[0]
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    if recv_sizes is None:
        recv_sizes = all_to_all_vector(send_sizes, axis_name)
    recv_sizes = recv_sizes.astype(jnp.int32)
    if not reverse:
        return input_offsets, send_sizes, jnp.full((W,), me * buffer_size, jnp.int32), recv_sizes
    blocks = jnp.arange(W, dtype=jnp.int32) * buffer_size
    return blocks, recv_sizes, all_to_all_vector(input_offsets, axis_name), send_sizes


def ragged_all_to_all_emulated(
    operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *, axis_name
):
    """``jax.lax.ragged_all_to_all`` semantics (its docstring) with one slice per peer,
    built from a dense ``all_to_all`` of [W, N, ...] buffers. Differentiable; O(W*N)
    memory, so meant for tests and CPU."""
    W, N, M = send_sizes.shape[0], operand.shape[0], output.shape[0]
    rows = jnp.arange(N, dtype=jnp.int32)
    take = input_offsets[:, None] + rows[None, :]  # [W, N]
    valid = rows[None, :] < send_sizes[:, None]
    buf = jnp.take(operand, jnp.where(valid, take, 0), axis=0)
    buf = jnp.where(_expand(valid, buf), buf, jnp.zeros((), operand.dtype))
    recv = jax.lax.all_to_all(buf, axis_name, 0, 0)  # recv[i]: from source i
    where = all_to_all_vector(output_offsets, axis_name)  # where source i writes here
    dest = where[:, None] + rows[None, :]
    dest = jnp.where(rows[None, :] < recv_sizes[:, None], dest, M)  # M: dropped
    return output.at[dest.reshape(-1)].set(recv.reshape((W * N,) + operand.shape[1:]),
                                           mode="drop")


def _expand(mask: jax.Array, like: jax.Array) -> jax.Array:
    return mask.reshape(mask.shape + (1,) * (like.ndim - mask.ndim))


def rounds_from_schedule(schedule) -> Rounds:
    """Rounds of (src, dst) pairs from an ``aristax.planner.aurora.Schedule`` (local
    indices, ``plan.schedules[g]``).

    Aurora may split a pair's traffic over several rounds; the exchange moves a pair's
    whole block at once, so each pair is kept only in the round that carries most of
    its traffic (a subset of a partial permutation is one). Self-sends and rounds left
    empty are dropped.
    """
    best: dict[tuple[int, int], tuple[float, int]] = {}
    for n, r in enumerate(schedule.rounds):
        for i, j, amount in r.sends:
            pair = (int(i), int(j))
            if pair[0] != pair[1] and (pair not in best or amount > best[pair][0]):
                best[pair] = (float(amount), n)
    rounds: list[list[tuple[int, int]]] = [[] for _ in schedule.rounds]
    for pair, (_, n) in sorted(best.items()):
        rounds[n].append(pair)
    return tuple(tuple(r) for r in rounds if r)


def complete_rounds(rounds: Rounds | None, num_devices: int) -> Rounds:
    """Validate partial permutations and add shift rounds for the missing pairs.

    Args:
      rounds: tuple of rounds, each a tuple of (src, dst) with src != dst in
        [0, W), no source or destination twice in a round; None = no rounds.
    Returns:
      rounds covering every ordered pair (i, j), i != j, exactly once (a pair given
      again in a later round is left out there; rounds left empty are dropped).
    """
    W = num_devices
    rounds = tuple(tuple((int(i), int(j)) for i, j in r) for r in (rounds or ()))
    for n, r in enumerate(rounds):
        srcs, dsts = [i for i, _ in r], [j for _, j in r]
        if len(set(srcs)) != len(srcs) or len(set(dsts)) != len(dsts):
            raise ValueError(f"schedule round {n} {r} is not a partial permutation (a source "
                             "or destination appears twice); split it into several rounds")
        if any(not (0 <= i < W and 0 <= j < W) or i == j for i, j in r):
            raise ValueError(f"schedule round {n} {r} names a self-send or a device outside "
                             f"range({W}); use local indices on the exchange axis")
    covered: set[tuple[int, int]] = set()
    unique = []
    for r in rounds:
        r = tuple(p for p in r if p not in covered)
        covered.update(r)
        if r:
            unique.append(r)
    rounds = tuple(unique)
    extra = []
    for shift in range(1, W):
        missing = tuple((i, (i + shift) % W) for i in range(W) if (i, (i + shift) % W) not in covered)
        if missing:
            extra.append(missing)
    return rounds + tuple(extra)


def scheduled_all_to_all(buf: jax.Array, axis_name: str, rounds: Rounds) -> jax.Array:
    """``jax.lax.all_to_all(buf, axis_name, 0, 0)`` as ``ppermute`` rounds.

    Args:
      buf: [W, B, ...], block j for device j. rounds: ``complete_rounds`` output.
    Returns:
      [W, B, ...], block i from device i (own block copied locally).
    """
    W = buf.shape[0]
    me = jax.lax.axis_index(axis_name).astype(jnp.int32)
    out = jnp.zeros_like(buf)
    out = jax.lax.dynamic_update_index_in_dim(out, jnp.take(buf, me, axis=0), me, 0)
    for r in rounds:
        dst, src = np.full(W, -1, np.int32), np.full(W, -1, np.int32)
        for i, j in r:
            dst[i], src[j] = j, i
        send = jnp.take(buf, jnp.maximum(jnp.asarray(dst)[me], 0), axis=0)
        recv = jax.lax.ppermute(send, axis_name, perm=list(r))
        s = jnp.asarray(src)[me]
        updated = jax.lax.dynamic_update_index_in_dim(out, recv, jnp.maximum(s, 0), 0)
        out = jnp.where(s >= 0, updated, out)
    return out


def hierarchical_axes(axis_name) -> tuple[str, str]:
    """(outer, inner) mesh axes of the "hierarchical" exchange, validated."""
    if (not isinstance(axis_name, (tuple, list)) or len(axis_name) != 2
            or not all(isinstance(a, str) for a in axis_name) or axis_name[0] == axis_name[1]):
        raise ValueError(
            f"exchange='hierarchical' needs axis_name=(outer, inner), two distinct mesh axes "
            f"such as ('node', 'local'), not {axis_name!r}; pass expert_axis=('node', 'local') "
            "on a mesh with both axes")
    return str(axis_name[0]), str(axis_name[1])


def hierarchical_all_to_all(buf: jax.Array, axis_name, *, reverse: bool = False) -> jax.Array:
    """``jax.lax.all_to_all(buf, (outer, inner), 0, 0)`` in two stages (Tutel 2DH).

    Args:
      buf: [W, B, ...] with W = Wn*Wl; block j for device j = n*Wl + l (node-major).
      axis_name: (outer, inner) mesh axes of sizes Wn, Wl.
      reverse: run the outer stage first (the return trip); the result is the same.
    Returns:
      [W, B, ...], block i from device i.
    """
    outer, inner = hierarchical_axes(axis_name)
    Wn, Wl = jax.lax.axis_size(outer), jax.lax.axis_size(inner)
    if buf.shape[0] != Wn * Wl:
        raise ValueError(f"hierarchical_all_to_all: {buf.shape[0]} blocks for {Wn}x{Wl} "
                         f"devices on axes {(outer, inner)}")
    b = buf.reshape((Wn, Wl) + buf.shape[1:])  # [n', l'] = block for device (n', l')
    # inner: device (n, l) gets from (n, l'') its rows bound for (*, l) -> [n', l''];
    # outer: then from (n'', l) the rows bound for (n, l) -> [n'', l''] = source block.
    stages = ((inner, 1), (outer, 0))
    for name, axis in (stages[::-1] if reverse else stages):
        b = jax.lax.all_to_all(b, name, axis, axis)
    return b.reshape(buf.shape)


def _block_all_to_all(buf, axis_name, rounds, hierarchical=False, reverse=False):
    if hierarchical:
        return hierarchical_all_to_all(buf, axis_name, reverse=reverse)
    if rounds is None:
        return jax.lax.all_to_all(buf, axis_name, 0, 0)
    return scheduled_all_to_all(buf, axis_name, rounds)


def _padded(x, input_offsets, send_sizes, *, axis_name, buffer_size, reverse, num_rows,
            rounds=None, hierarchical=False):
    W, B = send_sizes.shape[0], buffer_size
    pos = jnp.arange(B, dtype=jnp.int32)
    idx = input_offsets[:, None] + pos[None, :]  # [W, B] rows of the sender's blocks
    valid = pos[None, :] < send_sizes[:, None]
    if not reverse:
        buf = jnp.take(x, jnp.where(valid, idx, 0), axis=0)
        buf = jnp.where(_expand(valid, buf), buf, jnp.zeros((), x.dtype))
        recv = _block_all_to_all(buf, axis_name, rounds, hierarchical)
        return recv.reshape((W * B,) + x.shape[1:])
    if rounds is not None:  # the return trip runs the rounds transposed
        rounds = tuple(tuple((j, i) for i, j in r) for r in rounds)
    back = _block_all_to_all(x.reshape((W, B) + x.shape[1:]), axis_name, rounds,
                             hierarchical, reverse=True)
    out = jnp.zeros((num_rows,) + x.shape[1:], x.dtype)
    dest = jnp.where(valid, idx, num_rows).reshape(-1)
    return out.at[dest].set(back.reshape((W * B,) + x.shape[1:]), mode="drop")


def exchange(
    x: jax.Array,
    input_offsets: jax.Array,
    send_sizes: jax.Array,
    *,
    axis_name: str,
    buffer_size: int,
    exchange: str = "padded",
    reverse: bool = False,
    num_rows: int | None = None,
    schedule: Rounds | None = None,
    recv_sizes: jax.Array | None = None,
) -> jax.Array:
    """Send row blocks to the devices of ``axis_name`` (or, ``reverse``, bring them back).

    Call inside ``shard_map``.

    Args:
      axis_name: the exchange axis, or a tuple of mesh axes taken together
        (node-major); "hierarchical" needs exactly (outer, inner).
      x: forward: [N, ...] the sender's rows; reverse: [W*B, ...] as the forward
        returned them.
      input_offsets: int32[W] first row of the block for each destination (sender).
      send_sizes: int32[W] rows sent to each destination, each <= ``buffer_size``
        (rows past it must be clipped by the caller and are not sent).
      buffer_size: B, static rows per (source, destination) pair.
      exchange: the all-to-all strategy, one of ``EXCHANGES``.
      reverse: the return trip (same ``input_offsets``/``send_sizes``).
      num_rows: N, rows of the reverse result (required when ``reverse``).
      schedule: ``exchange="scheduled"`` only: rounds of (src, dst) pairs (e.g.
        ``rounds_from_schedule(plan.schedules[g])``), completed by ``complete_rounds``;
        None: shift rounds. Same value for both trips.
      recv_sizes: "ragged" and "ragged_emulated" only: int32[W] rows received from each
        source when the caller knows them (the exchange then skips the collective that
        finds them).
    Returns:
      forward: [W*B, ...]; reverse: [N, ...] (see the module docstring).
    """
    check_exchange(exchange)
    if reverse and num_rows is None:
        raise ValueError("exchange(reverse=True) needs num_rows=N, the sender's row count")
    input_offsets = input_offsets.astype(jnp.int32)
    send_sizes = send_sizes.astype(jnp.int32)
    if schedule is not None and exchange != "scheduled":
        raise ValueError(f"schedule= is used by exchange='scheduled' only, not {exchange!r}")
    if exchange == "hierarchical":
        hierarchical_axes(axis_name)
    if exchange in ("padded", "scheduled", "hierarchical"):
        rounds = None if exchange != "scheduled" else complete_rounds(schedule,
                                                                     send_sizes.shape[0])
        return _padded(x, input_offsets, send_sizes, axis_name=axis_name,
                       buffer_size=buffer_size, reverse=reverse, num_rows=num_rows,
                       rounds=rounds, hierarchical=exchange == "hierarchical")
    W = send_sizes.shape[0]
    args = ragged_args(input_offsets, send_sizes, axis_name=axis_name,
                       buffer_size=buffer_size, reverse=reverse, recv_sizes=recv_sizes)
    out_rows = num_rows if reverse else W * buffer_size
    output = jnp.zeros((out_rows,) + x.shape[1:], x.dtype)
    if exchange == "ragged":
        return jax.lax.ragged_all_to_all(x, output, *args, axis_name=axis_name)
    return ragged_all_to_all_emulated(x, output, *args, axis_name=axis_name)
