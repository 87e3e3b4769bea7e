"""Plain-XLA backend of the fused expert MLP (the CPU default): a loop over each
expert's row tiles gathers each tile's tokens, runs the expert's gate/up GEMMs, the
activation and the down GEMM, and scatter-adds the weighted rows into y; a backward
loop of its own does the same for the gradients. No Pallas: compiled (never
interpreted) on every platform.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K per token, M = T*K
rows in expert order (row m holds assignment ``sort_order[m]``, token
``sort_order[m] // K``), b = ``XlaTiles.block_m``, a = ``XlaTiles.align``.

Why fused: the unfused layer (permute -> ``ragged_dot`` x 3 -> combine) writes and
reads [M, D] and [M, F] arrays between its steps, each a pass over memory (and its
first-touch page faults) on a CPU; here a tile's rows, pre-activations and outputs
stay in cache between its GEMMs, and only the tile's [b, F] pre-activations are
saved for the backward. On the project's 2-core Xeon VM a whole layer's forward +
backward took 0.60-0.72x the unfused path's time (experiments/benchmarks/moe_layer.py).

Schedule (``schedules``, ``group_tiles``): each group's n rows padded to
q = ceil(n / a) * a rows, the padded groups laid end to end (group g from
``pstart[g]``; at most P = M + E * (a - 1) padded rows); a group runs q // b tiles of b
rows, then one tile of each size s in b/2, b/4, ..., a whose bit is set in q % b, so
every tile lies in one group and only the last one of a group holds padding, which is
masked (gathered as zeros, never scattered). The loops are group-major: an outer
``lax.fori_loop`` over the groups that have rows (empty ones cost nothing), and in it
one loop per tile size, trip counts traced. So each expert's weights are sliced once
(XLA:CPU copies a dynamic slice before a dot) and, in the backward, its weight
gradients are accumulated in the loop and written once.

Forward, per tile of expert e (accumulation in float32, float64 for float64 x), with
w = weights.flat[assignment] and the optional biases bg, bu, bd:
  rows = x[tok];  gate, up = rows @ gate[e] + bg[e], rows @ up[e] + bu[e]
  h = act(gate, up);  y[tok] += w * (h.astype(x.dtype) @ down[e] + bd[e])
(with input-side weights, ``ExpertMlp.input_weights``: rows = w * x[tok] and y[tok] +=
the output unweighted), with the pre-activations saved per padded row (one [P, F]
array each for gate and up: no concatenation per tile). The backward runs the same
tiles and the formulas of ``api._kernel_grads`` (its docstring) extended to the
biases and input weights (``backward``), with dx scatter-added per token. It computes
every option of the unfused expert MLP (``EXTRAS``): all five activations, expert
biases and input-side weights.

Measured against the tile-major loops before (one loop per tile size over all groups,
one [P, 2F] array saved): a layer's forward + backward on the 2-core Xeon VM took
0.90-0.94x the time at E 8 (F 1024, 2 to 4 tiles per expert) and the same within
noise at E 32 and E 64 (F 256 and 128, 1 to 3 tiles per expert).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from aristax.pallas_kernels.moe_mlp import reference
from aristax.pallas_kernels.permute.reference import accumulation_dtype
from aristax.pallas_kernels.ragged_dot.xla import (
    SMALL_PRODUCT, XlaTiles, group_bounds, resolve_tiles,
)
from aristax.pallas_kernels.tiling import on_auto_axes, row_spec, varying_like


# The options beyond the plain MLP that this backend computes (``api.extras_of``): all.
EXTRAS = reference.EXTRAS
# Up to this F the backward accumulates gate's and up's weight gradients as one
# [D, 2F] product per tile (r^T [dgate | dup]; Eigen ran [512, 512]^T @ [512, 2F] at
# 1.2x the rate of two [512, F] ones): on the 2-core Xeon VM a layer's forward +
# backward (T 4096, 4 alternations) took 0.95x the time with it at F 128 (E 64) and
# 0.97x at F 256 (E 32), but 1.01-1.03x at F 1024 (E 8), where the per-tile
# concatenate of [512, 2F] costs more than the wider product saves. The dx rows then
# come from one [s, 2F] @ [2F, D] product too (the expert's [D, 2F] sliced once per
# group), with no [s, D] sum of two.
JOINED_WGRAD_MAX_F = 256


def check(x: jax.Array, weights: jax.Array, up_edf: jax.Array, *,
          interpret: bool = False) -> None:
    """Serves every call the front door validated (any floating dtype, any K)."""
    del x, weights, up_edf, interpret


def backward_tiles(tiles):
    """The backward runs the forward's tiles."""
    return tiles


class Schedule(NamedTuple):
    """Per group g: ``pstart`` (its first padded position), ``padded`` (its rows
    padded to a multiple of align), ``shift`` (padded position minus expert-order row)
    and ``end`` (padded position past its last real row); ``order`` the groups with
    rows first (ascending), ``count`` their number."""

    order: jax.Array
    count: jax.Array
    pstart: jax.Array
    padded: jax.Array
    shift: jax.Array
    end: jax.Array


def padded_rows(num_rows: int, num_groups: int, tiles: XlaTiles) -> int:
    """P: the static bound on the padded rows, M + E * (a - 1)."""
    return num_rows + num_groups * (tiles.align - 1)


def schedules(group_sizes: jax.Array, num_rows: int, tiles: XlaTiles) -> Schedule:
    """The padded layout of group_sizes int32[E] over ``num_rows`` rows (module docstring)."""
    a = tiles.align
    starts, ends = group_bounds(group_sizes, num_rows)
    n = ends - starts
    q = (n + a - 1) // a * a
    pstart = jnp.cumsum(q, dtype=jnp.int32) - q
    order = jnp.argsort(q == 0, stable=True).astype(jnp.int32)
    return Schedule(order, jnp.sum(q > 0, dtype=jnp.int32), pstart, q, pstart - starts,
                    pstart + n)


def group_tiles(sched: Schedule, g, tiles: XlaTiles) -> list[tuple[int, jax.Array, jax.Array]]:
    """(size, first padded position, count) of each run of group g's tiles: q // b
    tiles of b rows, then one tile of each size s in b/2, ..., a whose bit is set in
    q % b (count 0 or 1), laid end to end from ``pstart[g]``."""
    b, a = tiles.block_m, tiles.align
    q, lo = sched.padded[g], sched.pstart[g]
    runs, rest, size = [(b, lo, q // b)], q % b, b // 2
    while size >= a:
        runs.append((size, lo + q // b * b + rest // (2 * size) * (2 * size), rest // size % 2))
        size //= 2
    return runs


def _tiles_for(tiles, m: int, d: int, f: int, num_groups: int) -> XlaTiles:
    """The caller's tiles, else ``XlaTiles.for_shape``'s, of one tile size (its block_m)
    for products under ``SMALL_PRODUCT`` (one loop compiles in a fraction of the time
    of four, and at that size their speeds do not matter)."""
    if tiles is not None or m * d * f >= SMALL_PRODUCT:
        return resolve_tiles(tiles, m, num_groups)
    block = XlaTiles.for_shape(m, num_groups).block_m
    return XlaTiles(block_m=block, align=block)


def _group_tiles_run(sched: Schedule, tiles: XlaTiles, g, tile, carry):
    """``carry`` after ``tile(lo, size, carry)`` over group g's tiles (``group_tiles``)."""
    for size, first, count in group_tiles(sched, g, tiles):
        carry = lax.fori_loop(
            0, count, lambda t, c, size=size, first=first: tile(first + t * size, size, c), carry)
    return carry


def _rows_of_tile(sched: Schedule, g, lo, size: int, sort_order, nv, top_k: int,
                  num_tokens: int):
    """(assignment ids int32[size], tokens int32[size]) of group g's tile at padded
    position lo; rows that are padding or at/past nv get token ``num_tokens`` and
    assignment T*K (gathered as zeros, dropped when scattered)."""
    src = lo - sched.shift[g]
    ids = lax.dynamic_slice_in_dim(sort_order, src, size)
    j = jnp.arange(size, dtype=jnp.int32)
    valid = (lo + j < sched.end[g]) & (src + j < nv)
    return (jnp.where(valid, ids, num_tokens * top_k),
            jnp.where(valid, ids // top_k, num_tokens))


def _mats(gate, up):
    return (up,) if gate is None else (gate, up)


def _at(w, g) -> jax.Array:
    """w[g] for a traced g (w may be a NumPy array: the front door keeps its type)."""
    return lax.dynamic_index_in_dim(w, g, keepdims=False)


def _dot(a, b, contract: tuple[int, int], acc):
    return lax.dot_general(a, b, (((contract[0],), (contract[1],)), ((), ())),
                           preferred_element_type=acc)


def _biases_at(biases, g, acc) -> tuple:
    """Each bias's row g in the accumulation dtype (None stays None)."""
    return tuple(None if b is None else _at(b, g).astype(acc) for b in biases)


def _plus(a, b):
    return a if b is None else a + b


def _add(accs: tuple, terms) -> tuple:
    """accs + terms elementwise (None accumulators stay None)."""
    return tuple(None if a is None else a + t for a, t in zip(accs, terms))


def moe_mlp(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf, down_efd,
            biases=(None, None, None), *, mlp, tiles=None, interpret: bool = False):
    """y [T, D] in the accumulation dtype (``forward`` without its residuals)."""
    return forward(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf,
                   down_efd, biases, mlp=mlp, tiles=tiles, interpret=interpret)[0]


def forward(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf, down_efd,
            biases=(None, None, None), *, mlp, tiles=None, interpret: bool = False):
    """(y [T, D] accumulation dtype, saved: the pre-activations per padded row, one
    [P, F] array each for gate (when there is one) and up).

    Args as ``api.moe_mlp``: x [T, D]; sort_order int32[M]; weights [T, K];
    group_sizes int32[E]; num_valid int32[]; gate_edf [E, D, F] or None; up_edf
    [E, D, F]; down_efd [E, F, D] (all in x's dtype); biases (gate [E, F], up [E, F],
    down [E, D], each or None); mlp ``reference.ExpertMlp``; tiles XlaTiles or None.
    """
    del interpret
    (T, D), (E, _, F), M = x.shape, up_edf.shape, sort_order.shape[0]
    tiles = _tiles_for(tiles, M, D, F, E)
    n_pre = 1 if gate_edf is None else 2

    def run(x, sort_order, weights, group_sizes, num_valid, gate, up, down, biases):
        acc = accumulation_dtype(x.dtype)
        zeros = lambda shape: varying_like(jnp.zeros(shape, acc), x)  # noqa: E731
        y = zeros((T, D))
        saved = tuple(zeros((padded_rows(M, E, tiles), F)) for _ in range(n_pre))
        if 0 in (T, D, F, E, M):
            return y, saved
        sched = schedules(group_sizes, M, tiles)
        order = jnp.pad(sort_order, (0, tiles.block_m))
        w_flat = weights.reshape(-1).astype(acc)

        def group(i, carry):
            g = sched.order[i]
            mats, down_g = tuple(_at(m, g) for m in _mats(gate, up)), _at(down, g)
            gate_b, up_b, down_b = _biases_at(biases, g, acc)
            pre_b = (up_b,) if gate is None else (gate_b, up_b)

            def tile(lo, size, carry):
                y, saved = carry
                ids, tok = _rows_of_tile(sched, g, lo, size, order, num_valid,
                                         weights.shape[1], T)
                rows = jnp.take(x, tok, axis=0, mode="fill", fill_value=0)
                w = jnp.take(w_flat, ids, mode="fill", fill_value=0)[:, None]
                if mlp.input_weights:
                    rows = (rows.astype(acc) * w).astype(x.dtype)
                pre = tuple(_plus(_dot(rows, m, (1, 0), acc), b) for m, b in zip(mats, pre_b))
                h = mlp.hidden(pre).astype(x.dtype)
                out = _plus(_dot(h, down_g, (1, 0), acc), down_b)
                y = y.at[tok].add(out if mlp.input_weights else out * w, mode="drop")
                saved = tuple(lax.dynamic_update_slice_in_dim(s, p, lo, 0)
                              for s, p in zip(saved, pre))
                return y, saved
            return _group_tiles_run(sched, tiles, g, tile, carry)
        return lax.fori_loop(0, sched.count, group, (y, saved))

    return on_auto_axes(run, x, sort_order, weights, group_sizes, num_valid, gate_edf,
                        up_edf, down_efd, biases,
                        out_sharding=lambda: (row_spec(x), (P(),) * n_pre))


def _tile_grads(mlp: reference.ExpertMlp, x_rows, w, pre, dy_rows, mats, down, down_bias, *,
                joined_mats=None):
    """One tile's terms of ``backward`` from its x rows [s, D] (x's dtype), weights
    w [s, 1], saved pre-activations [s, F] each, dy rows [s, D] and its expert's mats,
    down and down bias [D] (or None), and ``joined_mats`` (its mats side by side,
    [D, 2F], or None), in the accumulation dtype of dy_rows: (dx rows [s, D],
    dweights [s], ddown [F, D], dmats (one [D, 2F] with ``joined_mats``, else one
    [D, F] per mat), dbias (one [F] per pre-activation, then [D])). With r
    the expert's input rows (w * x rows with ``mlp.input_weights``) and w_o = w (1
    with input weights):
      gh = dy_rows @ down^T;  dh = w_o gh;  dpre = act'(pre) dh;  dr = sum_i dpre_i W_i^T
      ddown = h^T (w_o dy_rows) (= (w_o h)^T dy_rows, the form taken where F < D),
      dbd = sum(w_o dy_rows), dW_i = r^T dpre_i,
      db_i = sum(dpre_i); output weights: dw = <h, gh> + <dy_rows, bd>, dx rows = dr;
      input weights: dw = <dr, x rows>, dx rows = w dr.
    """
    dtype, acc = x_rows.dtype, dy_rows.dtype
    rows = (x_rows.astype(acc) * w).astype(dtype) if mlp.input_weights else x_rows
    h, act_vjp = mlp.hidden_vjp(pre)
    h = h.astype(dtype)
    dout = dy_rows if mlp.input_weights else w * dy_rows
    gh = _dot(dy_rows.astype(dtype), down, (1, 1), acc)  # [s, F]
    dh = gh if mlp.input_weights else w * gh
    # h entered the down GEMM in the compute dtype
    d_pre = [d.astype(dtype) for d in act_vjp(dh.astype(dtype).astype(acc))]
    if joined_mats is not None:  # one [s, 2F] @ [2F, D] product, no [s, D] sum
        d_joined = jnp.concatenate(d_pre, axis=1)
        drows = _dot(d_joined, joined_mats, (1, 1), acc)
    else:
        drows = sum(_dot(d, m, (1, 1), acc) for d, m in zip(d_pre, mats))
    if mlp.input_weights:
        drows = drows.astype(dtype).astype(acc)
        dw, drows = jnp.sum(drows * x_rows.astype(acc), axis=1), w * drows
    else:
        dw = jnp.sum(h.astype(acc) * gh, axis=1)
        if down_bias is not None:
            dw = dw + jnp.sum(dy_rows * down_bias, axis=1)
    if joined_mats is not None:  # one [D, 2F] product: wider, faster on narrow F
        dmats = (_dot(rows, d_joined, (0, 0), acc),)
    else:
        dmats = tuple(_dot(rows, d, (0, 0), acc) for d in d_pre)
    dbias = [jnp.sum(d.astype(acc), axis=0) for d in d_pre] + [jnp.sum(dout, axis=0)]
    if mlp.input_weights or h.shape[1] >= dy_rows.shape[1]:
        ddown = _dot(h, dout.astype(dtype), (0, 0), acc)
    else:  # h^T (w dy) = (w h)^T dy: the row weights scale the narrower [s, F]
        ddown = _dot((w * h.astype(acc)).astype(dtype), dy_rows.astype(dtype), (0, 0), acc)
    return drows, dw, ddown, dmats, dbias


def backward(residuals, saved, dy, *, mlp, tiles=None, interpret: bool = False):
    """Gradients (dx, None, dweights, None, None, dgate, dup, ddown, dbiases) for
    dy [T, D], summed over the forward's tiles (``_tile_grads``).

    residuals: (x, sort_order, weights, group_sizes, num_valid, gate, up, down, biases)
    as the forward took them; saved: its pre-activations (``forward``). dx in x's
    dtype, dweights in weights', the weight and bias gradients in their dtypes (None
    for those that are None).
    """
    del interpret
    x, sort_order, weights, group_sizes, nv, gate_edf, up_edf, down_efd, biases = residuals
    (T, D), (E, _, F), M, K = x.shape, up_edf.shape, sort_order.shape[0], weights.shape[1]
    tiles = _tiles_for(tiles, M, D, F, E)
    mats_in = _mats(gate_edf, up_edf)
    bias_in = biases[1:] if gate_edf is None else biases  # like mats, then down's
    joined = gate_edf is not None and F <= JOINED_WGRAD_MAX_F

    def run(x, sort_order, weights, group_sizes, nv, saved, dy, down, mats, bias_in):
        dtype, acc = x.dtype, accumulation_dtype(x.dtype)
        zeros = lambda shape: varying_like(jnp.zeros(shape, acc), x, dy)  # noqa: E731
        zeros_like = lambda arrays: tuple(  # noqa: E731
            None if a is None else zeros(a.shape) for a in arrays)
        grads = (zeros((T, D)), zeros((T * K,)), zeros(down.shape), zeros_like(mats),
                 zeros_like(bias_in))
        if 0 not in (T, D, F, E, M):
            sched = schedules(group_sizes, M, tiles)
            order = jnp.pad(sort_order, (0, tiles.block_m))
            w_flat = weights.reshape(-1).astype(acc)
            dy = dy.astype(acc)

            def group(i, grads):
                dx, dw, ddown, dmats, dbias = grads
                g = sched.order[i]
                mats_g, down_g = tuple(_at(m, g) for m in mats), _at(down, g)
                joined_g = jnp.concatenate(mats_g, axis=1) if joined else None
                down_bias_g = _biases_at(bias_in[-1:], g, acc)[0]

                def tile(lo, size, carry):
                    dx, dw, ddown_g, dmats_g, dbias_g = carry
                    ids, tok = _rows_of_tile(sched, g, lo, size, order, nv, K, T)
                    drows, dw_rows, ddown_t, dmats_t, dbias_t = _tile_grads(
                        mlp, jnp.take(x, tok, axis=0, mode="fill", fill_value=0),
                        jnp.take(w_flat, ids, mode="fill", fill_value=0)[:, None],
                        tuple(lax.dynamic_slice_in_dim(s, lo, size) for s in saved),
                        jnp.take(dy, tok, axis=0, mode="fill", fill_value=0),
                        mats_g, down_g, down_bias_g, joined_mats=joined_g)
                    return (dx.at[tok].add(drows, mode="drop"),
                            dw.at[ids].set(dw_rows, mode="drop"), ddown_g + ddown_t,
                            _add(dmats_g, dmats_t), _add(dbias_g, dbias_t))
                dx, dw, ddown_g, dmats_g, dbias_g = _group_tiles_run(
                    sched, tiles, g, tile,
                    (dx, dw, zeros(down_g.shape),
                     (zeros((D, 2 * F)),) if joined else zeros_like(mats_g),
                     tuple(None if b is None else zeros(b.shape[1:]) for b in bias_in)))
                if joined:
                    dmats_g = jnp.split(dmats_g[0], 2, axis=1)
                put = lambda full, one: (  # noqa: E731
                    None if full is None else lax.dynamic_update_index_in_dim(full, one, g, 0))
                return (dx, dw, put(ddown, ddown_g), tuple(map(put, dmats, dmats_g)),
                        tuple(map(put, dbias, dbias_g)))
            grads = lax.fori_loop(0, sched.count, group, grads)
        dx, dw, ddown, dmats, dbias = grads
        cast = lambda ds, like: tuple(  # noqa: E731
            None if d is None else d.astype(a.dtype) for d, a in zip(ds, like))
        return (dx.astype(dtype), dw.reshape(weights.shape).astype(weights.dtype),
                ddown.astype(down.dtype), cast(dmats, mats), cast(dbias, bias_in))

    dx, dw, ddown, dmats, dbias = on_auto_axes(
        run, x, sort_order, weights, group_sizes, nv, saved, dy, down_efd, mats_in, bias_in,
        out_sharding=lambda: (row_spec(x), row_spec(weights), P(), tuple(P() for _ in mats_in),
                              tuple(None if b is None else P() for b in bias_in)))
    if gate_edf is None:
        dmats, dbias = (None,) + dmats, (None,) + dbias
    return (dx, None, dw, None, None, *dmats, ddown, dbias)
