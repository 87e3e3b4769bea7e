"""Pallas Mosaic GPU (Hopper) permute and its backward: row gathers by per-row TMA.

Letters: T tokens, D model dim, K slots per token, M = T*K rows, BR/BD tile sizes.

Hopper's TMA has no gather, so a tile of BR gathered rows is BR one-row TMA copies
GMEM -> SMEM, all counted by one barrier (BR arrivals); a row that must read as zero
(past ``num_valid``) copies from a one-row zero array instead, so every row still
arrives exactly once. A persistent loop (``grid=(SMs,)``) walks the (row block,
column block) tiles.

  ``permute``      rows[p] = x[sort_order[p] // K] for p < nv, else 0
  ``permute_bwd``  dx[t] = sum_k drows[pos[t, k]] over the slots with pos < nv
                   (pos the inverse of sort_order), accumulated in float32

Tiles leave through ``ragged_dot.mosaic_gpu``'s ladder of power-of-two TMA stores, so
M and T need not be multiples of the tile. ``combine`` and ``combine_bwd`` raise
``NotImplementedError`` (the front door then runs the next backend): their
per-row weights need a row-vector broadcast that Mosaic GPU's layout inference does
not resolve here (the lowering did not finish), and a weighted gather is no
tensor-core work that Mosaic GPU would speed up.

Constraints (``NotImplementedError`` otherwise): D a multiple of 64 (TMA boxes of
64..256 columns); float32, bfloat16 or float16; compiled only on Hopper, or the CPU
when cross-lowering with ``jax.export``. Interpret mode runs the Mosaic GPU
interpreter with its race detector (``ragged_dot.mosaic_gpu.races_found``).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels.permute.reference import inverse_order, valid_count
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg
from aristax.pallas_kernels.tiling import varying_like

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGN = 64  # D must be a multiple of this
MAX_TOP_K = 64  # the slot loop of permute_bwd is unrolled


@dataclasses.dataclass(frozen=True)
class GatherTiles:
    """block_rows gathered rows x block_d columns per tile (block_d <= 256, the widest
    TMA box)."""

    block_rows: int = 64
    block_d: int = 256

    @classmethod
    def for_shape(cls, d_model: int) -> GatherTiles:
        """64 rows (a warpgroup); the widest of 256/128/64 columns that divides D."""
        return cls(block_d=next(b for b in (256, 128, ALIGN) if d_model % b == 0))


def _check(arr: jax.Array, top_k: int, interpret) -> None:
    """NotImplementedError (the front door then tries the next backend) when unserved."""
    reasons = (
        None if jnp.dtype(arr.dtype) in DTYPES else
        f"dtype {arr.dtype} (Mosaic GPU permute: float32/bfloat16/float16)",
        None if arr.shape[1] % ALIGN == 0 else
        f"D={arr.shape[1]} must be a multiple of {ALIGN} (TMA row boxes)",
        None if top_k <= MAX_TOP_K else f"top_k={top_k} > {MAX_TOP_K}",
        mg._platform_reason(interpret),
    )
    for reason in reasons:
        if reason:
            raise NotImplementedError(f"mosaic_gpu permute: {reason}")


def _gather_rows(src_gmem, zero_gmem, buf, barrier, source_row, col0, block_d) -> None:
    """buf[r] = src[row] or 0 for r < len(buf), ``source_row(r) -> (row, keep)``."""

    @pl.loop(0, buf.shape[0])
    def _(r):
        row, keep = source_row(r)
        dst = buf.at[pl.ds(r, 1)]

        @pl.when(keep)
        def _():
            plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(row, 1), pl.ds(col0, block_d)],
                                    dst, barrier)

        @pl.when(jnp.logical_not(keep))
        def _():
            plgpu.copy_gmem_to_smem(zero_gmem.at[:, pl.ds(col0, block_d)], dst, barrier)

    plgpu.barrier_wait(barrier)


def _each_tile(num_rows: int, d: int, dtype, tiles: GatherTiles, tile_fn) -> None:
    """``tile_fn(row0, col0, buf, barrier)`` for every (row block, column block), spread
    over the SMs; buf: SMEM [block_rows, block_d] of ``dtype``, barrier: block_rows
    arrivals (one per gathered row)."""
    br, bd = tiles.block_rows, tiles.block_d

    def scope(buf, barrier):
        @plgpu.nd_loop((pl.cdiv(num_rows, br), d // bd), collective_axes="sm")
        def _(info):
            rb, db = info.index
            tile_fn(rb * br, db * bd, buf, barrier)

    pl.run_scoped(scope, plgpu.SMEM((br, bd), dtype), plgpu.Barrier(num_arrivals=br))


def _permute_body(order_gmem, nv_gmem, x_gmem, zero_gmem, out_gmem, *, top_k: int,
                  tiles: GatherTiles):
    (M, D), T = out_gmem.shape, x_gmem.shape[0]
    br, nv = tiles.block_rows, nv_gmem[0]

    def tile(row0, col0, buf, barrier):
        def source_row(r):
            p = jnp.minimum(row0 + r, M - 1)
            return jnp.minimum(order_gmem[p] // top_k, T - 1), row0 + r < nv

        _gather_rows(x_gmem, zero_gmem, buf, barrier, source_row, col0, tiles.block_d)
        mg._store_rows(buf[...], out_gmem, row0, 0, jnp.minimum(M - row0, br), col0,
                       min(br, M))

    _each_tile(M, D, x_gmem.dtype, tiles, tile)


def _permute_bwd_body(pos_gmem, nv_gmem, drows_gmem, zero_gmem, out_gmem, *, top_k: int,
                      tiles: GatherTiles):
    (T, D), M = out_gmem.shape, drows_gmem.shape[0]
    br, nv = tiles.block_rows, nv_gmem[0]

    def tile(t0, col0, buf, barrier):
        acc = jnp.zeros(buf.shape, jnp.float32)
        for k in range(top_k):
            def source_row(r, k=k):
                pos = pos_gmem[jnp.minimum(t0 + r, T - 1) * top_k + k]
                return jnp.minimum(pos, M - 1), pos < nv

            _gather_rows(drows_gmem, zero_gmem, buf, barrier, source_row, col0,
                         tiles.block_d)
            acc = acc + buf[...].astype(jnp.float32)
        mg._store_rows(acc.astype(out_gmem.dtype), out_gmem, t0, 0,
                       jnp.minimum(T - t0, br), col0, min(br, T))

    _each_tile(T, D, drows_gmem.dtype, tiles, tile)


def _launch(body, out_type, interpret, *args):
    out = plgpu.kernel(
        body, out_type=out_type, grid=(mg._num_programs(interpret),), grid_names=("sm",),
        compiler_params=mg._COMPILER_PARAMS, interpret=mg._interpret_arg(interpret),
    )(*args)
    return varying_like(out, *args)


def _zero_row(d: int, dtype) -> jax.Array:
    return jnp.zeros((1, d), dtype)


def permute(x, sort_order, num_valid=None, *, top_k: int, interpret=False,
            tiles: GatherTiles | None = None):
    """Mosaic GPU ``reference.permute``: rows [M, D] in x's dtype."""
    _check(x, top_k, interpret)
    M, D = sort_order.shape[0], x.shape[1]
    tiles = tiles or GatherTiles.for_shape(D)
    body = functools.partial(_permute_body, top_k=top_k, tiles=tiles)
    nv = valid_count(num_valid, M).reshape(1)
    return _launch(body, jax.ShapeDtypeStruct((M, D), x.dtype), interpret,
                   sort_order.astype(jnp.int32), nv, x, _zero_row(D, x.dtype))


def permute_bwd(drows, sort_order, num_valid, *, top_k: int, x_dtype, interpret=False,
                tiles: GatherTiles | None = None):
    """dx [T, D] in x_dtype: the sum of each token's valid rows of drows."""
    _check(drows, top_k, interpret)
    (M, D), T = drows.shape, sort_order.shape[0] // top_k
    tiles = tiles or GatherTiles.for_shape(D)
    pos = inverse_order(sort_order.astype(jnp.int32))
    body = functools.partial(_permute_bwd_body, top_k=top_k, tiles=tiles)
    nv = valid_count(num_valid, M).reshape(1)
    return _launch(body, jax.ShapeDtypeStruct((T, D), x_dtype), interpret,
                   pos, nv, drows, _zero_row(D, drows.dtype))


def combine(rows, sort_order, weights, num_valid=None, *, interpret=False):
    raise NotImplementedError("Mosaic GPU combine is not implemented (module docstring)")


def combine_bwd(dy, rows, sort_order, weights, num_valid, *, interpret=False):
    raise NotImplementedError("Mosaic GPU combine backward is not implemented "
                              "(module docstring)")
