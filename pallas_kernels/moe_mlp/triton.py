"""Pallas Triton fused expert MLP: two kernels, no permuted copy of x, no [M, D] rows.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
M = T*K rows in expert order, nv = the valid rows (rows >= nv take no part).

Kernel 1 (``_gate_up_kernel``, grid (schedule steps, F tiles)):
  the gather prologue loads the rows x[sort_order[m] // K] straight from x (indexed
  loads, masked past nv), runs the gate and up grouped GEMMs over D chunks with two
  float32 accumulators, applies the activation in the epilogue and stores
  h[M, F] in the compute dtype.
Kernel 2 (``_down_combine_kernel``, grid (schedule steps, D tiles)):
  the down grouped GEMM h @ down[e] (float32), then the epilogue multiplies each row
  by its routing weight weights.flat[sort_order[m]] and scatter-adds it into
  y[sort_order[m] // K] with float32 atomics (``plgpu.atomic_add``): the combine.

Both walk ``triton_common.gmm_schedule`` (a tile straddling two experts is
visited once per expert; each visit touches only its expert's rows), so the
schedule, its masks and the tile heuristics are those of the grouped GEMM.

Atomics: y is a zero buffer [T + 1, D] aliased to the output; every lane that must
not add (a row outside the visit's expert or past nv, a column past D) is sent to
the spare row T with the value 0, and compiled kernels also mask it off. Pallas
interpret mode runs atomics without masks and as a gather + set, so only the spare
row may receive two lanes of one call; the valid lanes of one call are distinct
(token, column) pairs because a token's K assignments go to K distinct experts. The
summation order of a token's K terms is not fixed on a GPU (float32 rounding only).

The exact GELU needs erfc, which Pallas Triton does not lower: ``_erfc`` is the
Chebyshev fit of Numerical Recipes (2nd ed., section 6.2, ``erfcc``; fractional error
< 1.2e-7 in exact arithmetic). In float32 it stays within 8e-7 of XLA's erfc
(relative) for |z| <= 3; beyond (GELU inputs below -4.2, outputs below 5e-5 in
magnitude) the rounding of exp(-z^2) makes it a few 1e-6 relative, < 1e-9 absolute.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aristax.pallas_kernels.moe_mlp.activation import activate
from aristax.pallas_kernels.ragged_dot.triton import TritonTiles
from aristax.pallas_kernels.tiling import MAX_TOP_K, out_type
from aristax.pallas_kernels.triton_common import (
    DTYPES, GROUP, ROW_HI, ROW_LO, TILE, KernelTiles, gmm_schedule, load, mask2d, steps_if,
    tail_mask,
)


@dataclasses.dataclass(frozen=True)
class MoeMlpTiles:
    """Tiles of the fused expert MLP, forward and backward.

    Attributes:
      gate_up: kernel 1; block_m rows, block_n hidden (F) columns, block_k over D.
      down: kernel 2; block_m rows, block_n model (D) columns, block_k over F.
      backward: ``ragged_dot``'s ``TritonTiles`` for the backward's grouped GEMMs,
        or None for its per-shape heuristic.
    Block sizes are powers of 2, at least 16 (``TritonTiles``' rules).
    """

    gate_up: KernelTiles = KernelTiles(64, 64, 32, 4, 3)
    down: KernelTiles = KernelTiles(64, 64, 32, 4, 3)
    backward: TritonTiles | None = None

    def __post_init__(self):
        for name in ("gate_up", "down"):
            try:
                TritonTiles(**dataclasses.asdict(getattr(self, name)))
            except (TypeError, ValueError) as err:
                raise ValueError(f"MoeMlpTiles.{name}: {err}") from None
        if self.backward is not None and not isinstance(self.backward, TritonTiles):
            raise ValueError(f"MoeMlpTiles.backward must be TritonTiles or None; got "
                             f"{type(self.backward).__name__}")

    @classmethod
    def for_shape(cls, m: int, d: int, f: int, dtype, *, gated: bool = True) -> MoeMlpTiles:
        """Heuristic tiles for M rows, x[., D], hidden F: ``TritonTiles.for_shape`` of
        each GEMM (rows @ [D, F], h @ [F, D]); kernel 1 holds two accumulators when
        gated, so its F tile is at most 64 wide. Untuned."""
        gate_up = TritonTiles.for_shape(m, d, f, dtype).gmm
        if gated and gate_up.block_n > 64:
            gate_up = dataclasses.replace(gate_up, block_n=64, num_warps=4)
        return cls(gate_up=gate_up, down=TritonTiles.for_shape(m, f, d, dtype).gmm)


def check(x: jax.Array, weights: jax.Array, up_edf: jax.Array, *,
          interpret: bool = False) -> None:
    """NotImplementedError with the reason when this backend cannot serve.

    Serves x [T, D] and weights [T, K] in bfloat16, float16 or float32 (the expert
    weights are cast to x's dtype), T, D, F, E >= 1 and K <= ``MAX_TOP_K`` (the
    backward's permute kernels unroll K). The backward uses the "triton" backends
    of ``ragged_dot`` and ``permute``, which serve whatever this accepts.
    """
    del interpret
    for name, arr in (("x", x), ("weights", weights)):
        if arr.dtype not in DTYPES:
            raise NotImplementedError(f"triton: {name} dtype {arr.dtype} not in "
                                      f"{[str(d) for d in DTYPES]}")
    if 0 in x.shape or 0 in up_edf.shape:
        raise NotImplementedError(f"triton: empty operand x{list(x.shape)}, "
                                  f"up_edf{list(up_edf.shape)}")
    if weights.shape[1] > MAX_TOP_K:
        raise NotImplementedError(f"triton: top_k={weights.shape[1]} > {MAX_TOP_K}")


def backward_tiles(tiles: MoeMlpTiles | None) -> TritonTiles | None:
    """The ragged_dot tiles of the backward GEMMs (None: ragged_dot's heuristic)."""
    return None if tiles is None else tiles.backward


def _visit(sched_ref, nv_ref, block_m: int):
    """(group, first row, rows int32[BM], in_group [BM], live [BM], any live) of this
    program's schedule step; live = in the step's group and below nv."""
    step = pl.program_id(0)
    group = sched_ref[GROUP, step]
    row_lo, row_hi = sched_ref[ROW_LO, step], sched_ref[ROW_HI, step]
    row0 = sched_ref[TILE, step] * block_m
    rows = row0 + jnp.arange(block_m, dtype=jnp.int32)
    nv = nv_ref[0]
    in_group = (rows >= row_lo) & (rows < row_hi)
    any_live = (row_hi > row_lo) & (jnp.maximum(row_lo, row0) < nv)
    return group, row0, rows, in_group, in_group & (rows < nv), any_live


def _assignments(order_ref, rows, live):
    """int32[BM] flat assignment sort_order[row] of each live row (0 elsewhere)."""
    safe = jnp.minimum(rows, order_ref.shape[0] - 1)
    return plgpu.load(order_ref.at[safe], mask=live, other=0)


def _gate_up_kernel(sched_ref, order_ref, nv_ref, x_ref, *refs, tiles: KernelTiles,
                    top_k: int, activation: str):
    """One (step, F tile) program: h[rows, f tile] = act(x[tok] @ gate[e], x[tok] @ up[e]).

    sched_ref int32[5, S]; order_ref int32[M]; nv_ref int32[1]; x_ref [T, D];
    refs = (gate_ref [E, D, F],)? + (up_ref [E, D, F], h_ref [M, F]).
    """
    *gate_ref, up_ref, h_ref = refs
    gate_ref = gate_ref[0] if gate_ref else None
    (t, d), (m, f) = x_ref.shape, h_ref.shape
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    group, row0, rows, in_group, live, any_live = _visit(sched_ref, nv_ref, bm)
    tokens = jnp.minimum(_assignments(order_ref, rows, live) // top_k, t - 1)
    col0 = pl.program_id(1) * bn
    col_ok = tail_mask(col0, bn, f)
    mats = (up_ref,) if gate_ref is None else (up_ref, gate_ref)

    def weight_tile(ref, k0, k_ok):
        return load(ref.at[group, pl.ds(k0, bk), pl.ds(col0, bn)], mask2d(k_ok, col_ok))

    def body(step, accs):
        k0 = step * bk
        k_ok = tail_mask(k0, bk, d)
        cols = jnp.minimum(k0 + jnp.arange(bk, dtype=jnp.int32), d - 1)
        a = plgpu.load(x_ref.at[tokens[:, None], cols[None, :]],
                       mask=mask2d(live, k_ok), other=0)
        return tuple(acc + plgpu.dot(a, weight_tile(ref, k0, k_ok))
                     for acc, ref in zip(accs, mats))

    zeros = jnp.zeros((bm, bn), jnp.float32)
    accs = lax.fori_loop(0, steps_if(any_live, pl.cdiv(d, bk)), body,
                         (zeros,) * len(mats))
    h = activate(accs[1] if gate_ref is not None else None, accs[0], activation)
    h = jnp.where(live[:, None], h, 0.0)  # 0 * inf weights would give NaN
    plgpu.store(h_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], h.astype(h_ref.dtype),
                mask=mask2d(in_group & (rows < m), col_ok))


def _down_combine_kernel(sched_ref, order_ref, nv_ref, w_ref, h_ref, down_ref, _y_in,
                         y_ref, *, tiles: KernelTiles, top_k: int, masked: bool):
    """One (step, D tile) program: y[tok, d tile] += w[assignment] * (h[rows] @ down[e]).

    w_ref [M] flat weights; h_ref [M, F]; down_ref [E, F, D]; y_ref f32[T + 1, D]
    (aliased to the zero buffer ``_y_in``; row T is the spare row).
    """
    (f, d), spare = down_ref.shape[1:], y_ref.shape[0] - 1
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    group, row0, rows, _, live, any_live = _visit(sched_ref, nv_ref, bm)
    col0 = pl.program_id(1) * bn
    col_ok = tail_mask(col0, bn, d)

    def body(step, acc):
        k0 = step * bk
        k_ok = tail_mask(k0, bk, f)
        a = load(h_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)], mask2d(live, k_ok))
        b = load(down_ref.at[group, pl.ds(k0, bk), pl.ds(col0, bn)], mask2d(k_ok, col_ok))
        return acc + plgpu.dot(a, b)

    acc = lax.fori_loop(0, steps_if(any_live, pl.cdiv(f, bk)), body,
                        jnp.zeros((bm, bn), jnp.float32))
    flat = _assignments(order_ref, rows, live)
    w = plgpu.load(w_ref.at[flat], mask=live, other=0).astype(jnp.float32)
    cols = col0 + jnp.arange(bn, dtype=jnp.int32)
    adds = live[:, None] & (cols < d)[None, :]
    target = jnp.where(adds, (flat // top_k)[:, None], spare)
    plgpu.atomic_add(y_ref, (target, jnp.minimum(cols, d - 1)[None, :]),
                     jnp.where(adds, acc * w[:, None], 0.0), mask=adds if masked else None)


def _resolve(tiles, m: int, d: int, f: int, dtype, gated: bool) -> MoeMlpTiles:
    """The caller's MoeMlpTiles, or the heuristic's when None."""
    if tiles is None:
        return MoeMlpTiles.for_shape(m, d, f, dtype, gated=gated)
    if not isinstance(tiles, MoeMlpTiles):
        raise TypeError(f"triton: tiles must be MoeMlpTiles or None; got {type(tiles).__name__}")
    return tiles


def gate_up(x, sort_order, num_valid, group_sizes, gate_edf, up_edf, *, activation: str,
            top_k: int, tiles: KernelTiles, interpret: bool = False) -> jax.Array:
    """Kernel 1: h [M, F] in x's dtype, h[m] = act(x[tok] @ gate[e], x[tok] @ up[e])
    for rows m of expert e below num_valid (0 past num_valid; rows past
    sum(group_sizes) are left unwritten)."""
    m, (_, _, f) = sort_order.shape[0], up_edf.shape
    schedule = gmm_schedule(group_sizes, m, tiles.block_m)
    weights = (up_edf,) if gate_edf is None else (gate_edf, up_edf)
    return pl.pallas_call(
        functools.partial(_gate_up_kernel, tiles=tiles, top_k=top_k, activation=activation),
        out_shape=out_type((m, f), x.dtype, x, sort_order, group_sizes, *weights),
        grid=(schedule.shape[1], pl.cdiv(f, tiles.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret,
        name="moe_mlp_gate_up",
    )(schedule, sort_order, num_valid.reshape(1), x, *weights)


def down_combine(h, sort_order, weights, num_valid, group_sizes, down_efd, *,
                 tiles: KernelTiles, interpret: bool = False) -> jax.Array:
    """Kernel 2: y [T, D] float32, y[t] = sum_k weights[t, k] (h @ down[e])[row of
    assignment (t, k)] over rows below num_valid."""
    (t, top_k), (m, _), d = weights.shape, h.shape, down_efd.shape[2]
    schedule = gmm_schedule(group_sizes, m, tiles.block_m)
    y = pl.pallas_call(
        functools.partial(_down_combine_kernel, tiles=tiles, top_k=top_k,
                          masked=not interpret),
        out_shape=out_type((t + 1, d), jnp.float32, h, weights, sort_order, down_efd),
        grid=(schedule.shape[1], pl.cdiv(d, tiles.block_n)),
        input_output_aliases={6: 0},
        compiler_params=plgpu.CompilerParams(num_warps=tiles.num_warps,
                                             num_stages=tiles.num_stages),
        interpret=interpret,
        name="moe_mlp_down_combine",
    )(schedule, sort_order, num_valid.reshape(1), weights.reshape(-1), h, down_efd,
      jnp.zeros((t + 1, d), jnp.float32))
    return y[:t]


def moe_mlp(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf, down_efd, *,
            activation: str, tiles: MoeMlpTiles | None = None,
            interpret: bool = False) -> jax.Array:
    """The fused forward (``reference.moe_mlp``'s contract): y [T, D] float32.

    Args:
      x: [T, D]. sort_order: int32[M]. weights: [T, K]. group_sizes: int32[E].
      num_valid: int32[]. gate_edf: [E, D, F] or None; up_edf: [E, D, F];
      down_efd: [E, F, D], all in x's dtype. activation: "swiglu"|"geglu"|"gelu".
      tiles: MoeMlpTiles or None (``MoeMlpTiles.for_shape``). interpret: Pallas
      interpret mode (CPU).
    """
    check(x, weights, up_edf)
    (m, d, f) = sort_order.shape[0], x.shape[1], up_edf.shape[2]
    tiles = _resolve(tiles, m, d, f, x.dtype, gate_edf is not None)
    h = gate_up(x, sort_order, num_valid, group_sizes, gate_edf, up_edf,
                activation=activation, top_k=weights.shape[1], tiles=tiles.gate_up,
                interpret=interpret)
    return down_combine(h, sort_order, weights, num_valid, group_sizes, down_efd,
                        tiles=tiles.down, interpret=interpret)
