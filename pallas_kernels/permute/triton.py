"""Pallas Triton permute and combine (forward and backward), all gathers.

Letters: T tokens, D model dim, K experts per token, M = T*K rows, BR/BD tile sizes.

Every step is a gather, so no kernel needs atomics:
  ``_inverse_kernel``   pos[sort_order[p]] = p (a permutation scatter, each assignment once)
  ``_gather_rows_kernel`` out[p] = scale[p] * src[sort_order[p] // K] for p < num_valid
      permute:      src = x,  scale = 1
      combine bwd:  src = dy, scale = weights.flat[sort_order[p]]       (drows)
  ``_gather_sum_kernel``  y[t] = sum_k w[t, k] * rows[pos[t, k]] (kept assignments, f32)
      combine:      w = weights
      permute bwd:  w = 1                                               (dx)
  ``_gather_dot_kernel``  dw[t, k] = <dy[t], rows[pos[t, k]]> (kept assignments, f32)
      combine bwd:                                                      (dweights)
All refs are whole arrays; tiles index them with power-of-two index vectors and
masks, so T, D, M need not be multiples of (or powers of) anything. Loads clamp
their indices; stores leave out-of-range indices unclamped and masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aristax.pallas_kernels.tiling import MAX_TOP_K, next_pow2, out_type

DTYPES = (jnp.float32, jnp.bfloat16, jnp.float16)


@dataclasses.dataclass(frozen=True)
class PermuteTiles:
    """Tile sizes shared by the permute/combine kernels, forward and backward."""

    block_rows: int = 32
    block_d: int = 128
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def for_shape(cls, num_rows: int, d_model: int) -> "PermuteTiles":
        """Heuristic: rows x D tiles of at most 32 x 128 (one 16 KiB f32 tile)."""
        block_rows = max(16, min(32, next_pow2(num_rows)))
        block_d = max(16, min(128, next_pow2(d_model)))
        return cls(block_rows=block_rows, block_d=block_d)

    def params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def _span(block: int, size: int, i) -> tuple[jax.Array, jax.Array, jax.Array]:
    """(indices, clamped indices, in-range mask) of block i of an axis of ``size``."""
    idx = i * block + jnp.arange(block, dtype=jnp.int32)
    return idx, jnp.minimum(idx, size - 1), idx < size


def _inverse_kernel(order_ref, pos_ref, *, tiles: PermuteTiles):
    """pos[sort_order[p]] = p for the rows p of this block."""
    M = order_ref.shape[0]
    p, safe_p, pmask = _span(tiles.block_rows, M, pl.program_id(0))
    flat = plgpu.load(order_ref.at[safe_p], mask=pmask, other=0)
    plgpu.store(pos_ref.at[jnp.where(pmask, flat, M)], p, mask=pmask)


def _gather_rows_kernel(src_ref, order_ref, scale_ref, nv_ref, out_ref, *, top_k: int,
                        tiles: PermuteTiles):
    """out[p, d] = scale[sort_order[p]] * src[sort_order[p] // K, d] (0 for p >= nv)."""
    (M, D), N = out_ref.shape, src_ref.shape[0]
    p, safe_p, pmask = _span(tiles.block_rows, M, pl.program_id(0))
    d, safe_d, dmask = _span(tiles.block_d, D, pl.program_id(1))
    valid = pmask & (p < nv_ref[0])
    flat = plgpu.load(order_ref.at[safe_p], mask=valid, other=0)
    token = jnp.minimum(flat // top_k, N - 1)
    tile = plgpu.load(src_ref.at[token[:, None], safe_d[None, :]],
                      mask=valid[:, None] & dmask[None, :], other=0)
    if scale_ref is not None:
        scale = plgpu.load(scale_ref.at[flat], mask=valid, other=0)
        tile = tile.astype(jnp.float32) * scale.astype(jnp.float32)[:, None]
    plgpu.store(out_ref.at[p[:, None], d[None, :]], tile.astype(out_ref.dtype),
                mask=pmask[:, None] & dmask[None, :])


def _assignment_tile(pos_ref, nv_ref, safe_t, tmask, k: int) -> tuple[jax.Array, jax.Array]:
    """(row int32[BR], kept bool[BR]) of assignment k of each token in the block."""
    kk = jnp.full_like(safe_t, k)
    row = plgpu.load(pos_ref.at[safe_t, kk], mask=tmask, other=0)
    return row, tmask & (row < nv_ref[0])


def _gather_sum_kernel(rows_ref, pos_ref, w_ref, nv_ref, y_ref, *, tiles: PermuteTiles):
    """y[t, d] = sum_k w[t, k] rows[pos[t, k], d] over kept assignments (w = 1 if None)."""
    (T, D), (M, K) = y_ref.shape, (rows_ref.shape[0], pos_ref.shape[1])
    t, safe_t, tmask = _span(tiles.block_rows, T, pl.program_id(0))
    d, safe_d, dmask = _span(tiles.block_d, D, pl.program_id(1))
    acc = jnp.zeros((tiles.block_rows, tiles.block_d), jnp.float32)
    for k in range(K):
        row, kept = _assignment_tile(pos_ref, nv_ref, safe_t, tmask, k)
        tile = plgpu.load(rows_ref.at[jnp.minimum(row, M - 1)[:, None], safe_d[None, :]],
                          mask=kept[:, None] & dmask[None, :], other=0).astype(jnp.float32)
        if w_ref is not None:
            w = plgpu.load(w_ref.at[safe_t, jnp.full_like(safe_t, k)], mask=kept, other=0)
            tile = tile * w.astype(jnp.float32)[:, None]
        acc = acc + tile
    plgpu.store(y_ref.at[t[:, None], d[None, :]], acc.astype(y_ref.dtype),
                mask=tmask[:, None] & dmask[None, :])


def _gather_dot_kernel(dy_ref, rows_ref, pos_ref, nv_ref, dw_ref, *, tiles: PermuteTiles):
    """dw[t, k] = sum_d dy[t, d] rows[pos[t, k], d] for kept assignments, else 0."""
    (T, D), (M, K) = dy_ref.shape, (rows_ref.shape[0], pos_ref.shape[1])
    t, safe_t, tmask = _span(tiles.block_rows, T, pl.program_id(0))
    kcols = jnp.arange(next_pow2(K), dtype=jnp.int32)
    per_k = [_assignment_tile(pos_ref, nv_ref, safe_t, tmask, k) for k in range(K)]

    def body(j, acc):
        _, safe_d, dmask = _span(tiles.block_d, D, j)
        dy = plgpu.load(dy_ref.at[safe_t[:, None], safe_d[None, :]],
                        mask=tmask[:, None] & dmask[None, :], other=0).astype(jnp.float32)
        for k, (row, kept) in enumerate(per_k):
            tile = plgpu.load(rows_ref.at[jnp.minimum(row, M - 1)[:, None], safe_d[None, :]],
                              mask=kept[:, None] & dmask[None, :], other=0)
            part = jnp.sum(dy * tile.astype(jnp.float32), axis=1)
            acc = acc + jnp.where(kcols[None, :] == k, part[:, None], 0.0)
        return acc

    acc = jnp.zeros((tiles.block_rows, kcols.shape[0]), jnp.float32)
    acc = jax.lax.fori_loop(0, pl.cdiv(D, tiles.block_d), body, acc)
    plgpu.store(dw_ref.at[t[:, None], kcols[None, :]], acc.astype(dw_ref.dtype),
                mask=tmask[:, None] & (kcols < K)[None, :])


def check(op: str, top_k: int, *arrays: jax.Array, interpret: bool = False) -> None:
    """NotImplementedError with the reason unless ``op`` ("permute" or "combine", each
    with its backward) serves ``arrays`` (the operands its kernels read) with K = top_k."""
    del interpret  # interpreted on CPU, compiled on any GPU Triton supports
    for arr in arrays:
        if arr.dtype not in DTYPES:
            raise NotImplementedError(f"dtype {arr.dtype} (Triton {op}: f32/bf16/f16)")
        if 0 in arr.shape:
            raise NotImplementedError(f"empty operand of shape {arr.shape}")
    if top_k > MAX_TOP_K:
        raise NotImplementedError(f"top_k={top_k} > {MAX_TOP_K}")


def _call(kernel, out_shape, grid, interpret: bool, tiles: PermuteTiles, name: str, *args):
    """One ``pallas_call`` with whole-array refs and the tiles' compiler params."""
    return pl.pallas_call(kernel, out_shape=out_shape, grid=grid, interpret=interpret,
                          compiler_params=tiles.params(), name=name)(*args)


def _nv(num_valid, M: int) -> jax.Array:
    """int32[1] valid-row count for the kernels (M when None)."""
    return jnp.asarray(M if num_valid is None else num_valid, jnp.int32).reshape(1)


def inverse_order(sort_order: jax.Array, *, interpret: bool = False,
                  tiles: PermuteTiles | None = None) -> jax.Array:
    """int32[M] pos with pos[sort_order[p]] = p."""
    M = sort_order.shape[0]
    tiles = tiles or PermuteTiles.for_shape(M, 1)
    return _call(functools.partial(_inverse_kernel, tiles=tiles),
                 out_type((M,), jnp.int32, sort_order), (pl.cdiv(M, tiles.block_rows),),
                 interpret, tiles, "inverse_order", sort_order.astype(jnp.int32))


def gather_rows(src, sort_order, scale_flat, num_valid, *, top_k: int, out_dtype,
                interpret: bool = False, tiles: PermuteTiles | None = None) -> jax.Array:
    """[M, D]: row p = scale_flat[sort_order[p]] * src[sort_order[p] // K] (p < nv)."""
    M, D = sort_order.shape[0], src.shape[1]
    tiles = tiles or PermuteTiles.for_shape(M, D)
    kernel = functools.partial(_gather_rows_kernel, top_k=top_k, tiles=tiles)
    if scale_flat is None:
        kernel = functools.partial(_drop_arg, kernel, 2)
        args = (src, sort_order, _nv(num_valid, M))
    else:
        args = (src, sort_order, scale_flat, _nv(num_valid, M))
    grid = (pl.cdiv(M, tiles.block_rows), pl.cdiv(D, tiles.block_d))
    return _call(kernel, out_type((M, D), out_dtype, *args), grid, interpret, tiles,
                 "permute_gather", *args)


def gather_sum(rows, pos, weights, num_valid, *, out_dtype, interpret: bool = False,
               tiles: PermuteTiles | None = None) -> jax.Array:
    """[T, D]: y[t] = sum_k weights[t, k] rows[pos[t, k]] over pos < nv (weights 1
    when None), accumulated in float32."""
    T, (M, D) = pos.shape[0], rows.shape
    tiles = tiles or PermuteTiles.for_shape(T, D)
    kernel = functools.partial(_gather_sum_kernel, tiles=tiles)
    if weights is None:
        kernel = functools.partial(_drop_arg, kernel, 2)
        args = (rows, pos, _nv(num_valid, M))
    else:
        args = (rows, pos, weights, _nv(num_valid, M))
    grid = (pl.cdiv(T, tiles.block_rows), pl.cdiv(D, tiles.block_d))
    return _call(kernel, out_type((T, D), out_dtype, *args), grid, interpret, tiles,
                 "combine_gather_sum", *args)


def gather_dot(dy, rows, pos, num_valid, *, out_dtype, interpret: bool = False,
               tiles: PermuteTiles | None = None) -> jax.Array:
    """[T, K]: dw[t, k] = <dy[t], rows[pos[t, k]]> over pos < nv, else 0."""
    (T, K), (M, D) = pos.shape, rows.shape
    tiles = tiles or PermuteTiles.for_shape(T, D)
    kernel = functools.partial(_gather_dot_kernel, tiles=tiles)
    return _call(kernel, out_type((T, K), out_dtype, dy, rows, pos),
                 (pl.cdiv(T, tiles.block_rows),), interpret, tiles, "combine_gather_dot",
                 dy, rows, pos, _nv(num_valid, M))


def _drop_arg(kernel, index: int, *refs):
    """Call ``kernel`` with None in place of the optional ref at ``index``."""
    return kernel(*refs[:index], None, *refs[index:])


def permute(x, sort_order, num_valid=None, *, top_k: int, interpret: bool = False):
    """Triton ``reference.permute``: rows [M, D] in x's dtype."""
    check("permute", top_k, x)
    return gather_rows(x, sort_order, None, num_valid, top_k=top_k, out_dtype=x.dtype,
                       interpret=interpret)


def combine(rows, sort_order, weights, num_valid=None, *, interpret: bool = False):
    """Triton ``reference.combine``: y [T, D] float32."""
    check("combine", weights.shape[1], rows, weights)
    pos = inverse_order(sort_order, interpret=interpret).reshape(weights.shape)
    return gather_sum(rows, pos, weights, num_valid, out_dtype=jnp.float32,
                      interpret=interpret)


def permute_bwd(drows, sort_order, num_valid, *, top_k: int, x_dtype, interpret: bool = False):
    """dx [T, D] = sum over the token's valid rows of drows (the transpose of permute)."""
    check("permute", top_k, drows)
    T = sort_order.shape[0] // top_k
    pos = inverse_order(sort_order, interpret=interpret).reshape(T, top_k)
    return gather_sum(drows, pos, None, num_valid, out_dtype=x_dtype, interpret=interpret)


def combine_bwd(dy, rows, sort_order, weights, num_valid, *, interpret: bool = False):
    """(drows [M, D], dweights [T, K]) of combine, in rows' and weights' dtypes."""
    T, K = weights.shape
    check("combine", K, rows, dy, weights)
    pos = inverse_order(sort_order, interpret=interpret).reshape(T, K)
    drows = gather_rows(dy, sort_order, weights.reshape(-1), num_valid, top_k=K,
                        out_dtype=rows.dtype, interpret=interpret)
    dweights = gather_dot(dy, rows, pos, num_valid, out_dtype=weights.dtype,
                          interpret=interpret)
    return drows, dweights
