"""Pallas Triton backend of the grouped GEMM (any GPU that Triton supports).

Letters: M rows, K contraction, N output columns, G groups; group g owns the rows
[offsets[g], offsets[g + 1]) with offsets = [0, cumsum(group_sizes)] clipped to M.

gmm (out[m] = lhs[m] @ rhs[g(m)]): a grid over (schedule steps, N tiles). The schedule
(``gmm_schedule``, computed in jnp from ``group_sizes`` inside the trace) lists, group
by group, the row tiles of ``block_m`` rows that cover each group; a tile straddling a
group boundary appears once per group, and each visit loads and stores only its
group's rows (masked loads and stores). Steps after the group tiles zero the tiles
past sum(group_sizes); the remaining steps store nothing. The schedule has the static
length cdiv(M, block_m) + G, an upper bound on the number of tiles any group sizes
need (consecutive groups share at most one tile).

tgmm (out[g] = lhs[rows of g]^T @ dout[rows of g]): a grid over (G, K tiles, N tiles);
each program walks its group's rows in ``block_m`` chunks (a loop with a traced trip
count) and accumulates [block_k, block_n] in float32.

Both accumulate in float32 and cast to ``out_dtype`` at the store. float32 inputs are
multiplied at the precision ``jax.default_matmul_precision`` sets, as XLA's dots and
so the reference backend are: IEEE float32 at "highest" or "float32", TF32 at JAX's
default. Every value in the kernels is a power-of-2 tile of at
least 16 on each side (Triton's ``tl.dot`` needs both); M, K, N need not be multiples
of the tiles: tails are masked.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax import lax
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aristax.pallas_kernels.tiling import is_pow2, out_type
from aristax.pallas_kernels.triton_common import (
    DTYPES, GROUP, MIN_TILE, ROW_HI, ROW_LO, TILE, ZERO_FROM, KernelTiles, gmm_schedule,
    group_offsets, load, mask2d, steps_if, tail_mask,
)



@dataclasses.dataclass(frozen=True)
class TritonTiles:
    """Tile sizes of the Triton grouped GEMM, for the forward gmm and for tgmm.

    ``gmm`` serves the forward and the backward's dlhs = gmm(dout, rhs^T); ``tgmm``
    serves drhs. Block sizes are powers of 2, at least 16. ``for_shape`` is an untuned
    starting point, not the result of a sweep.

    Attributes:
      block_m, block_n, block_k: gmm tiles over rows, output columns, contraction.
      num_warps, num_stages: gmm Triton launch parameters.
      tgmm_block_m: rows reduced per tgmm loop step; tgmm_block_k, tgmm_block_n: the
        tgmm output tile [tgmm_block_k, tgmm_block_n] of out[g].
      tgmm_num_warps, tgmm_num_stages: tgmm Triton launch parameters.
    """

    block_m: int = 64
    block_n: int = 64
    block_k: int = 32
    num_warps: int = 4
    num_stages: int = 3
    tgmm_block_m: int = 32
    tgmm_block_k: int = 64
    tgmm_block_n: int = 64
    tgmm_num_warps: int = 4
    tgmm_num_stages: int = 3

    def __post_init__(self):
        for field in dataclasses.fields(self):
            value, kind = getattr(self, field.name), field.name.removeprefix("tgmm_")
            if kind.startswith("block_") and not (is_pow2(value) and value >= MIN_TILE):
                raise ValueError(f"TritonTiles.{field.name}={value!r} must be a power of 2 "
                                 f">= {MIN_TILE}")
            if kind == "num_warps" and not is_pow2(value):
                raise ValueError(f"TritonTiles.{field.name}={value!r} must be a power of 2")
            if kind == "num_stages" and not (isinstance(value, int) and value >= 1):
                raise ValueError(f"TritonTiles.{field.name}={value!r} must be an int >= 1")

    @classmethod
    def for_shape(cls, m: int, k: int, n: int, dtype) -> TritonTiles:
        """Heuristic tiles for lhs[M, K] @ rhs[G, K, N] in ``dtype``: 128-wide output
        tiles and 64-deep contraction for 16-bit inputs (half for float32, whose tiles
        take twice the shared memory), never wider than the next power of 2 of the
        dimension (tiny problems do no dead work)."""
        wide = jnp.dtype(dtype).itemsize <= 2

        def fit(dim: int, cap: int) -> int:
            return max(MIN_TILE, min(cap, pl.next_power_of_2(max(dim, 1))))

        block_m = fit(m, 64)
        block_n, block_k = fit(n, 128 if wide else 64), fit(k, 64 if wide else 32)
        tgmm_k, tgmm_n = fit(k, 128 if wide else 64), fit(n, 128 if wide else 64)
        return cls(
            block_m=block_m, block_n=block_n, block_k=block_k,
            num_warps=8 if block_m * block_n >= 64 * 128 else 4,
            num_stages=3 if wide else 2,
            tgmm_block_m=fit(m, 64 if wide else 32), tgmm_block_k=tgmm_k, tgmm_block_n=tgmm_n,
            tgmm_num_warps=8 if tgmm_k * tgmm_n >= 128 * 128 else 4,
            tgmm_num_stages=3 if wide else 2,
        )

    @property
    def gmm(self) -> KernelTiles:
        return KernelTiles(self.block_m, self.block_n, self.block_k, self.num_warps,
                           self.num_stages)

    @property
    def tgmm(self) -> KernelTiles:
        return KernelTiles(self.tgmm_block_m, self.tgmm_block_n, self.tgmm_block_k,
                           self.tgmm_num_warps, self.tgmm_num_stages)


def check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype, *,
          interpret: bool = False) -> None:
    """Raise NotImplementedError with the reason when this backend cannot serve.

    Serves lhs[M, K] and rhs[G, K, N] (or dout[M, N] for tgmm) of one dtype among
    bfloat16, float16, float32, with M, K, N, G >= 1 and a floating ``out_dtype``;
    the same limits hold for the backward. ``interpret`` does not matter here.
    """
    del interpret
    if lhs.dtype != rhs.dtype:
        raise NotImplementedError(f"triton: lhs {lhs.dtype} and rhs {rhs.dtype} differ")
    if lhs.dtype not in DTYPES:
        raise NotImplementedError(f"triton: dtype {lhs.dtype} not in {[str(d) for d in DTYPES]}")
    if jnp.dtype(out_dtype) not in DTYPES:
        raise NotImplementedError(f"triton: out_dtype {jnp.dtype(out_dtype)} unsupported")
    if 0 in lhs.shape or 0 in rhs.shape or group_sizes.shape[0] == 0:
        raise NotImplementedError(f"triton: empty operand lhs{list(lhs.shape)}, "
                                  f"rhs{list(rhs.shape)}, G={group_sizes.shape[0]}")


def _resolve_tiles(tiles, m: int, k: int, n: int, dtype) -> TritonTiles:
    """The caller's TritonTiles, or the heuristic's when None."""
    if tiles is None:
        return TritonTiles.for_shape(m, k, n, dtype)
    if not isinstance(tiles, TritonTiles):
        raise TypeError(f"triton: tiles must be TritonTiles or None; got {type(tiles).__name__}")
    return tiles


def _gmm_kernel(sched_ref, lhs_ref, rhs_ref, out_ref, *, tiles: KernelTiles, dims,
                rhs_transposed: bool):
    """One (step, N tile) program: out[tile rows in group, n tile] = lhs @ rhs[group].

    sched_ref: int32[5, T]. lhs_ref: [M, K]. rhs_ref: [G, K, N], or [G, N, K] with
    ``rhs_transposed`` (its [bn, bk] blocks enter the dot transposed). out_ref: [M, N].
    """
    m, k, n = dims
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    step, n_tile = pl.program_id(0), pl.program_id(1)
    group = sched_ref[GROUP, step]
    row_lo, row_hi = sched_ref[ROW_LO, step], sched_ref[ROW_HI, step]
    row0, col0 = sched_ref[TILE, step] * bm, n_tile * bn
    rows = row0 + jnp.arange(bm, dtype=jnp.int32)
    in_group = (rows >= row_lo) & (rows < row_hi)
    col_ok = tail_mask(col0, bn, n)

    def body(step, acc):
        k0 = step * bk
        k_ok = tail_mask(k0, bk, k)
        a = load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                  mask2d(in_group, k_ok))
        if rhs_transposed:
            b = load(rhs_ref.at[group, pl.ds(col0, bn), pl.ds(k0, bk)],
                     mask2d(col_ok, k_ok))
        else:
            b = load(rhs_ref.at[group, pl.ds(k0, bk), pl.ds(col0, bn)],
                     mask2d(k_ok, col_ok))
        return acc + plgpu.dot(a, b, trans_b=rhs_transposed)

    acc = lax.fori_loop(0, steps_if(row_hi > row_lo, pl.cdiv(k, bk)), body,
                        jnp.zeros((bm, bn), jnp.float32))
    # Rows outside the group hold 0 * rhs, which is NaN where rhs is inf: select 0.
    acc = jnp.where(in_group[:, None], acc, 0.0)
    row_ok = (in_group | (rows >= sched_ref[ZERO_FROM, step])) & (rows < m)
    plgpu.store(out_ref.at[pl.ds(row0, bm), pl.ds(col0, bn)], acc.astype(out_ref.dtype),
                mask=mask2d(row_ok, col_ok))


def gmm(lhs, rhs, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Grouped GEMM: out[m] = lhs[m] @ rhs[g(m)]; rows past sum(group_sizes) are zero.

    Args:
      lhs: [M, K]. rhs: [G, K, N], same dtype (bf16, f16 or f32).
      group_sizes: int32[G], rows of each group, consecutive from row 0.
      out_dtype: result dtype (accumulation is float32).
      tiles: TritonTiles (its gmm fields) or None for ``TritonTiles.for_shape``.
      interpret: run the kernel in Pallas interpret mode (CPU).
    Returns:
      [M, N] in ``out_dtype``.
    """
    return _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, rhs_transposed=False)


def gmm_t(lhs, rhs, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """out[m] = lhs[m] @ rhs[g(m)]^T for lhs [M, N] and rhs [G, K, N] -> [M, K]: the
    backward's dlhs, reading rhs's blocks transposed instead of a transposed copy of
    rhs. Args as ``gmm`` (its gmm tiles)."""
    return _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, rhs_transposed=True)


def _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, *, rhs_transposed: bool):
    g, k, n = rhs.shape
    b = jax.ShapeDtypeStruct((g, n, k) if rhs_transposed else (g, k, n), rhs.dtype)
    check(lhs, b, group_sizes, out_dtype)
    (m, k), (_, _, n) = lhs.shape, b.shape
    kt = _resolve_tiles(tiles, m, k, n, lhs.dtype).gmm
    schedule = gmm_schedule(group_sizes, m, kt.block_m)
    return pl.pallas_call(
        functools.partial(_gmm_kernel, tiles=kt, dims=(m, k, n),
                          rhs_transposed=rhs_transposed),
        out_shape=out_type((m, n), out_dtype, lhs, rhs, group_sizes),
        grid=(schedule.shape[1], pl.cdiv(n, kt.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=kt.num_warps,
                                             num_stages=kt.num_stages),
        interpret=interpret,
        name="ragged_dot_gmm",
    )(schedule, lhs, rhs)


def _tgmm_kernel(offsets_ref, lhs_ref, dout_ref, out_ref, *, tiles: KernelTiles, dims):
    """One (group, K tile, N tile) program: out[g, k tile, n tile] = sum over the
    group's rows of lhs[row, k tile]^T dout[row, n tile].

    offsets_ref: int32[G + 1]. lhs_ref: [M, K]. dout_ref: [M, N]. out_ref: [G, K, N].
    """
    _, k, n = dims
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    group, k0, n0 = pl.program_id(0), pl.program_id(1) * bk, pl.program_id(2) * bn
    row_lo, row_hi = offsets_ref[group], offsets_ref[group + 1]
    k_ok, n_ok = tail_mask(k0, bk, k), tail_mask(n0, bn, n)

    def body(step, acc):
        row0 = row_lo + step * bm
        row_ok = row0 + jnp.arange(bm, dtype=jnp.int32) < row_hi
        a = load(lhs_ref.at[pl.ds(row0, bm), pl.ds(k0, bk)],
                  mask2d(row_ok, k_ok))
        b = load(dout_ref.at[pl.ds(row0, bm), pl.ds(n0, bn)],
                  mask2d(row_ok, n_ok))
        return acc + plgpu.dot(a, b, trans_a=True)

    steps = (row_hi - row_lo + bm - 1) // bm  # int32 also under jax_enable_x64
    acc = lax.fori_loop(0, steps, body, jnp.zeros((bk, bn), jnp.float32))
    plgpu.store(out_ref.at[group, pl.ds(k0, bk), pl.ds(n0, bn)], acc.astype(out_ref.dtype),
                mask=mask2d(k_ok, n_ok))


def tgmm(lhs, dout, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Transposed grouped GEMM: out[g] = lhs[rows of g]^T @ dout[rows of g].

    Args:
      lhs: [M, K]. dout: [M, N], same dtype (bf16, f16 or f32).
      group_sizes: int32[G]; rows past the sum are ignored, empty groups give zeros.
      out_dtype: result dtype (accumulation is float32).
      tiles: TritonTiles (its tgmm fields) or None for ``TritonTiles.for_shape``.
      interpret: run the kernel in Pallas interpret mode (CPU).
    Returns:
      [G, K, N] in ``out_dtype``.
    """
    check(lhs, dout, group_sizes, out_dtype)
    (m, k), n, g = lhs.shape, dout.shape[1], group_sizes.shape[0]
    kt = _resolve_tiles(tiles, m, k, n, lhs.dtype).tgmm
    return pl.pallas_call(
        functools.partial(_tgmm_kernel, tiles=kt, dims=(m, k, n)),
        out_shape=out_type((g, k, n), out_dtype, lhs, dout, group_sizes),
        grid=(g, pl.cdiv(k, kt.block_k), pl.cdiv(n, kt.block_n)),
        compiler_params=plgpu.CompilerParams(num_warps=kt.num_warps,
                                             num_stages=kt.num_stages),
        interpret=interpret,
        name="ragged_dot_tgmm",
    )(group_offsets(group_sizes, m), lhs, dout)
