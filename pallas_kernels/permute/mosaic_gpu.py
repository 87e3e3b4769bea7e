"""Pallas Mosaic GPU (Hopper) permute and combine, forward and backward: row gathers by
per-row TMA.

Letters: T tokens, D model dim, K experts per token, M = T*K rows, BR/BD tile sizes.

Hopper's TMA has no gather, so a tile of BR gathered rows is BR one-row TMA copies
GMEM -> SMEM, all counted by one barrier (BR arrivals); a row that must read as zero
(past ``num_valid``) copies from a one-row zero array instead, so every row still
arrives exactly once. A persistent loop (``grid=(SMs,)``) walks the tiles.

  ``permute``      rows[p] = x[sort_order[p] // K] for p < nv, else 0
  ``permute_bwd``  dx[t] = sum_k drows[pos[t, k]] over the assignments with pos < nv
                   (pos the inverse of sort_order), accumulated in float32
  ``combine``      y[t] = sum_k w[t, k] rows[pos[t, k]] over kept assignments, float32
  ``combine_bwd``  drows[p] = w.flat[s] dy[s // K] (s = sort_order[p], p < nv) and
                   dweights[t, k] = <dy[t], rows[pos[t, k]]> (kept assignments)

Per-row weights are applied by a loop over the tile's rows in SMEM (a scalar times
one row, in float32): Mosaic GPU's layout inference did not resolve the [BR] x
[BR, BD] broadcast of a weight column here (the lowering did not finish).
``dweights`` walks row blocks of tokens, each over all column blocks, and sums each
row's products with one reduction per row.

Tiles leave through ``mosaic_gpu_common.store_rows``' ladder of power-of-two TMA stores, so
M and T need not be multiples of the tile.

Constraints (``NotImplementedError`` otherwise): D a multiple of 64 (TMA boxes of
64..256 columns), of 128 for combine (``mosaic_gpu_common.WARPGROUP_ROW``); float32, bfloat16 or float16;
compiled only on Hopper, or the CPU when cross-lowering with ``jax.export``.
Interpret mode runs the Mosaic GPU interpreter with its race detector
(``mosaic_gpu_common.races_found``). ``gpu_check.py`` ran them on an H100 and an H200
(results/gpu_check_h*.json).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.permute.reference import inverse_order, valid_count
from aristax.pallas_kernels.tiling import MAX_TOP_K

DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGN = 64  # D must be a multiple of this (permute and its backward); combine and its
# backward: of ``mosaic_gpu_common.WARPGROUP_ROW`` (128)


@dataclasses.dataclass(frozen=True)
class GatherTiles:
    """block_rows gathered rows x block_d columns per tile (block_d <= 256, the widest
    TMA box)."""

    block_rows: int = 64
    block_d: int = 256

    @classmethod
    def for_shape(cls, d_model: int, align: int = ALIGN) -> GatherTiles:
        """64 rows (a warpgroup); the widest of 256/128/64 columns (at least ``align``)
        that divides D."""
        return cls(block_d=next(b for b in (256, 128, 64)
                                if d_model % b == 0 and b >= align))


def check(op: str, top_k: int, *arrays: jax.Array, interpret=False) -> None:
    """NotImplementedError with the reason unless ``op`` ("permute" or "combine", each
    with its backward) serves ``arrays`` (its [rows, D] operands) with K = top_k."""
    align = ALIGN if op == "permute" else mgpu.WARPGROUP_ROW
    d = arrays[0].shape[1]
    mgpu.raise_if(
        f"mosaic_gpu {op}",
        *(None if jnp.dtype(a.dtype) in DTYPES else
          f"dtype {a.dtype} (float32/bfloat16/float16)" for a in arrays),
        None if d % align == 0 else
        f"D={d} must be a multiple of {align} (" + (
            "TMA row boxes)" if align == ALIGN else "a tile row spans 128 threads)"),
        None if top_k <= MAX_TOP_K else f"top_k={top_k} > {MAX_TOP_K}",
        mgpu.platform_reason(interpret),
    )


def _scale_rows(buf, dst, scale_of_row, *, accumulate: bool = False) -> None:
    """dst[r] = (dst[r] +) float32(buf[r]) * scale_of_row(r) for every row r, cast to
    dst's dtype; buf, dst: SMEM [BR, BD], ``scale_of_row(r) -> float32[]``."""

    @pl.loop(0, buf.shape[0])
    def _(r):
        y = buf[r].astype(jnp.float32) * scale_of_row(r)
        dst[r] = (dst[r].astype(jnp.float32) + y if accumulate else y).astype(dst.dtype)


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


def _gather_body(order_gmem, scale_gmem, nv_gmem, src_gmem, zero_gmem, out_gmem, *,
                 top_k: int, tiles: GatherTiles):
    """out[p] = scale[s] * src[s // K] with s = sort_order[p] for p < nv, else 0
    (scale = 1 when ``scale_gmem`` is None: permute; else combine's drows)."""
    (M, D), T = out_gmem.shape, src_gmem.shape[0]
    br, nv = tiles.block_rows, nv_gmem[0]

    def flat_of_row(r):
        return order_gmem[jnp.minimum(r, M - 1)]

    def tile(row0, col0, buf, barrier, scaled=None):
        def source_row(r):
            return jnp.minimum(flat_of_row(row0 + r) // top_k, T - 1), row0 + r < nv

        mgpu.gather_rows(src_gmem, zero_gmem, buf, barrier, source_row, col0, tiles.block_d)
        if scaled is not None:
            _scale_rows(buf, scaled, lambda r: jnp.where(
                row0 + r < nv, scale_gmem[flat_of_row(row0 + r)], 0.0))
        mgpu.store_smem_rows(buf if scaled is None else scaled, out_gmem, row0, 0,
                            jnp.minimum(M - row0, br), col0, min(br, M))

    if scale_gmem is None:
        _each_tile(M, D, src_gmem.dtype, tiles, tile)
    else:
        pl.run_scoped(
            lambda scaled: _each_tile(M, D, src_gmem.dtype, tiles,
                                      functools.partial(tile, scaled=scaled)),
            plgpu.SMEM((br, tiles.block_d), out_gmem.dtype))


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

            mgpu.gather_rows(drows_gmem, zero_gmem, buf, barrier, source_row, col0,
                         tiles.block_d)
            acc = acc + buf[...].astype(jnp.float32)
        mgpu.store_rows(acc.astype(out_gmem.dtype), out_gmem, t0, 0,
                       jnp.minimum(T - t0, br), col0, min(br, T))

    _each_tile(T, D, drows_gmem.dtype, tiles, tile)


def _combine_body(pos_gmem, w_gmem, nv_gmem, rows_gmem, zero_gmem, out_gmem, *,
                  top_k: int, tiles: GatherTiles):
    """out[t] = sum_k w.flat[t*K + k] rows[pos[t*K + k]] over the assignments with pos < nv,
    in float32."""
    (T, D), M = out_gmem.shape, rows_gmem.shape[0]
    br, nv = tiles.block_rows, nv_gmem[0]

    def scope(acc):
        def tile(t0, col0, buf, barrier):
            for k in range(top_k):
                def flat(r, k=k):
                    return jnp.minimum(t0 + r, T - 1) * top_k + k

                def source_row(r):
                    pos = pos_gmem[flat(r)]
                    return jnp.minimum(pos, M - 1), pos < nv

                def weight(r):
                    return jnp.where(pos_gmem[flat(r)] < nv, w_gmem[flat(r)], 0.0)

                mgpu.gather_rows(rows_gmem, zero_gmem, buf, barrier, source_row, col0,
                             tiles.block_d)
                _scale_rows(buf, acc, weight, accumulate=k > 0)
            mgpu.store_smem_rows(acc, out_gmem, t0, 0, jnp.minimum(T - t0, br), col0,
                                min(br, T))

        _each_tile(T, D, rows_gmem.dtype, tiles, tile)

    pl.run_scoped(scope, plgpu.SMEM((br, tiles.block_d), jnp.float32))


def _assignment_dots_body(pos_gmem, nv_gmem, dy_gmem, rows_gmem, dy_zero, rows_zero, out_gmem,
                    *, top_k: int, tiles: GatherTiles):
    """out[t*K + k] = <dy[t], rows[pos[t*K + k]]> (0 where pos >= nv), float32; out is
    padded to whole row blocks of tokens: [cdiv(T, BR) * BR * K]."""
    (T, D), M = dy_gmem.shape, rows_gmem.shape[0]
    br, bd, nv = tiles.block_rows, tiles.block_d, nv_gmem[0]

    def scope(dy_buf, row_buf, dots, barrier):
        @plgpu.nd_loop((pl.cdiv(T, br),), collective_axes="sm")
        def _(info):
            t0 = info.index[0] * br

            @pl.loop(0, br * top_k)
            def _(i):
                dots[i] = jnp.float32(0)

            @pl.loop(0, D // bd)
            def _(db):
                mgpu.gather_rows(dy_gmem, dy_zero, dy_buf, barrier,
                             lambda r: (jnp.minimum(t0 + r, T - 1), True), db * bd, bd)
                for k in range(top_k):
                    def source_row(r, k=k):
                        pos = pos_gmem[jnp.minimum(t0 + r, T - 1) * top_k + k]
                        return jnp.minimum(pos, M - 1), pos < nv

                    mgpu.gather_rows(rows_gmem, rows_zero, row_buf, barrier, source_row,
                                 db * bd, bd)

                    @pl.loop(0, br)
                    def _(r, k=k):
                        dots[r * top_k + k] += jnp.sum(row_buf[r].astype(jnp.float32) *
                                                       dy_buf[r].astype(jnp.float32))

            plgpu.commit_smem()
            for c in range(0, br * top_k, 256):  # TMA boxes hold <= 256 elements
                n = min(256, br * top_k - c)
                plgpu.copy_smem_to_gmem(dots.at[pl.ds(c, n)],
                                        out_gmem.at[pl.ds(t0 * top_k + c, n)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((br, bd), dy_gmem.dtype),
                  plgpu.SMEM((br, bd), rows_gmem.dtype),
                  plgpu.SMEM((br * top_k,), jnp.float32), plgpu.Barrier(num_arrivals=br))


def _gather(src, sort_order, scale, num_valid, *, top_k: int, out_dtype, interpret,
            tiles: GatherTiles | None):
    """``_gather_body`` launched: [M, D] in out_dtype."""
    M, D = sort_order.shape[0], src.shape[1]
    tiles = tiles or GatherTiles.for_shape(D)
    kw = dict(top_k=top_k, tiles=tiles)
    args = [sort_order.astype(jnp.int32), valid_count(num_valid, M).reshape(1), src,
            mgpu.zero_row(D, src.dtype)]
    if scale is None:
        body = lambda order, *refs: _gather_body(order, None, *refs, **kw)  # noqa: E731
    else:
        body = functools.partial(_gather_body, **kw)
        args.insert(1, scale.reshape(-1).astype(jnp.float32))
    return mgpu.launch(body, jax.ShapeDtypeStruct((M, D), out_dtype), interpret)(*args)


def permute(x, sort_order, num_valid=None, *, top_k: int, interpret=False,
            tiles: GatherTiles | None = None):
    """Mosaic GPU ``reference.permute``: rows [M, D] in x's dtype."""
    check("permute", top_k, x, interpret=interpret)
    return _gather(x, sort_order, None, num_valid, top_k=top_k, out_dtype=x.dtype,
                   interpret=interpret, tiles=tiles)


def permute_bwd(drows, sort_order, num_valid, *, top_k: int, x_dtype, interpret=False,
                tiles: GatherTiles | None = None):
    """dx [T, D] in x_dtype: the sum of each token's valid rows of drows."""
    check("permute", top_k, drows, interpret=interpret)
    (M, D), T = drows.shape, sort_order.shape[0] // top_k
    body = functools.partial(_permute_bwd_body, top_k=top_k,
                             tiles=tiles or GatherTiles.for_shape(D))
    return mgpu.launch(body, jax.ShapeDtypeStruct((T, D), x_dtype), interpret)(
        inverse_order(sort_order.astype(jnp.int32)), valid_count(num_valid, M).reshape(1),
        drows, mgpu.zero_row(D, drows.dtype))


def combine(rows, sort_order, weights, num_valid=None, *, interpret=False,
            tiles: GatherTiles | None = None):
    """Mosaic GPU ``reference.combine``: y [T, D] in float32."""
    (M, D), (T, K) = rows.shape, weights.shape
    check("combine", K, rows, interpret=interpret)
    body = functools.partial(_combine_body, top_k=K,
                             tiles=tiles or GatherTiles.for_shape(D, mgpu.WARPGROUP_ROW))
    return mgpu.launch(body, jax.ShapeDtypeStruct((T, D), jnp.float32), interpret)(
        inverse_order(sort_order.astype(jnp.int32)), weights.reshape(-1).astype(jnp.float32),
        valid_count(num_valid, M).reshape(1), rows, mgpu.zero_row(D, rows.dtype))


def combine_bwd(dy, rows, sort_order, weights, num_valid, *, interpret=False,
                tiles: GatherTiles | None = None):
    """Mosaic GPU ``reference.combine_bwd``: (drows [M, D] in rows' dtype, dweights
    [T, K] in weights' dtype)."""
    (T, K), D = weights.shape, rows.shape[1]
    check("combine", K, rows, dy, interpret=interpret)
    tiles = tiles or GatherTiles.for_shape(D, mgpu.WARPGROUP_ROW)
    drows = _gather(dy, sort_order, weights, num_valid, top_k=K, out_dtype=rows.dtype,
                    interpret=interpret, tiles=tiles)
    pos = inverse_order(sort_order.astype(jnp.int32))
    nv = valid_count(num_valid, T * K)
    padded = pl.cdiv(T, tiles.block_rows) * tiles.block_rows * K
    dots = mgpu.launch(functools.partial(_assignment_dots_body, top_k=K, tiles=tiles),
                       jax.ShapeDtypeStruct((padded,), jnp.float32), interpret)(
        pos, nv.reshape(1), dy, rows, mgpu.zero_row(D, dy.dtype), mgpu.zero_row(D, rows.dtype))
    dweights = jnp.where(pos < nv, dots[:T * K], 0.0).reshape(T, K)
    return drows, dweights.astype(weights.dtype)
