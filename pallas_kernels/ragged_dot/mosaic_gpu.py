"""Grouped GEMM on Hopper: Pallas Mosaic GPU kernels (TMA loads, wgmma, K pipeline).

Two kernels share the interface of every ragged_dot backend (letters: M rows, K and
N feature dims, G groups; rows are grouped consecutively by ``group_sizes``):

- ``gmm(lhs[M,K], rhs[G,K,N], group_sizes[G]) -> out[M,N]``,
  ``out[m] = lhs[m] @ rhs[group of m]``; rows at or past ``sum(group_sizes)`` are 0.
- ``tgmm(lhs[M,K], dout[M,N], group_sizes[G]) -> out[G,K,N]``,
  ``out[g] = lhs[rows of g]^T @ dout[rows of g]``; empty groups give 0.
  (The backward: ``drhs = tgmm(lhs, dout)``, ``dlhs = gmm(dout, rhs^T)``.)
- ``gmm_t(lhs[M,N], rhs[G,K,N], group_sizes) -> out[M,K]``,
  ``out[m] = lhs[m] @ rhs[group of m]^T``: gmm reading rhs's tiles transposed in
  SMEM, so the backward's dlhs needs no transposed copy of rhs.

Algorithm (the one of JAX's ``ops/gpu/ragged_dot_mgpu.py`` and
``transposed_ragged_dot_mgpu.py``, written anew around our interface):

- gmm: row tiles of ``block_m`` are aligned to the row grid, not to groups, so a
  tile that straddles a group boundary is computed once per group it touches. A
  schedule computed before the kernel (``row_tile_schedule``) lists, per tile, its
  group, row block and the row range ``[lo, hi)`` it owns; the trailing rows past
  ``sum(group_sizes)`` form one more pseudo-group whose tiles store zeros without a
  matmul. Each tile runs a pipelined K loop (``plgpu.emit_pipeline``: TMA
  GMEM->SMEM copies ``max_concurrent_steps`` deep, one async wgmma per step, f32
  accumulator), then stores only rows ``[lo, hi)`` with a ladder of power-of-two
  TMA stores (TMA boxes have static shapes; a dynamic row count is a sum of
  powers of two), so tiles of neighbouring groups never write each other's rows.
- tgmm: one output tile ``[block_k, block_n]`` of one group per step of a
  persistent loop; a pipelined loop over the group's row blocks feeds
  ``wgmma(acc, lhs_tile^T, dout_tile)``. Row blocks on a group boundary are masked
  in SMEM (rows outside the group set to 0 in both operands, by select, so
  non-finite values of other groups never leak in) before the wgmma.

All are persistent: ``grid=(number of SMs,)`` and ``plgpu.nd_loop`` spreads the
tiles over the SMs, in bands of column tiles (``MosaicTiles.band_n``).

Constraints (``check``/``check_tgmm`` raise ``NotImplementedError`` with the reason,
so the front door falls back):
- lhs and rhs/dout both bfloat16 or both float16. float32 is refused: wgmma would
  run it as TF32, silently less precise than the float32 reference.
- ``out_dtype`` float32, bfloat16 or float16 (the accumulator is always float32).
- K and N multiples of 64 (TMA/wgmma tile alignment); M a multiple of 8 (Mosaic
  GPU's TMA into swizzled SMEM tiles needs GMEM dims that are multiples of the
  8-row tiling; lowering fails otherwise), else free: the last row tile may run
  past M (TMA fills those rows with zeros and they are never stored), M < block_m
  included.
- Compiled (``interpret=False``): the default backend is a GPU of compute capability
  9.x (Hopper), or the CPU, which is the cross-lowering path
  (``jax.export(..., platforms=["cuda"])``).
Tiles never refuse a call ``check`` accepted: ``MosaicTiles.fit`` drops a block
that does not divide K or N to 64 and shortens a pipeline too deep for SMEM.

Interpret mode (``interpret=True`` or an ``InterpretGPUParams``) runs the kernels
on CPU in Pallas' Mosaic GPU interpreter (simulated GMEM/SMEM, barriers, TMA and
wgmma), with its happens-before race detector on; ``races_found()`` reports it.
Out-of-bounds TMA reads are filled with NaN there (hardware fills zeros), which is
stricter: a NaN that reaches an output is a masking bug.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels.mosaic_gpu_common import (
    ALIGN, ROW_ALIGN, SMEM_BYTES, band_order, dtype_reason,
    gmm_tile, launch, mma, platform_reason, raise_if, release_delay, resolve_interpret,
    store_rows, store_smem_rows, transposed, with_transpose_scratch,
)


# ---------------------------------------------------------------------------
# Tile sizes
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class MosaicTiles:
    """Tile sizes of the Mosaic GPU grouped GEMMs, forward and backward.

    gmm (forward, and the backward's ``dlhs = gmm(dout, rhs^T)``) computes
    ``[block_m, block_n]`` output tiles, stepping K by ``block_k``. tgmm (the
    backward's ``drhs``) computes ``[tgmm_block_k, tgmm_block_n]`` tiles of one group,
    stepping over the group's rows ``tgmm_block_m`` at a time. ``*_concurrent_steps``
    is the TMA pipeline depth (SMEM buffers in flight); with 2 or more, each wgmma
    may stay in flight while the next step's copies land (``delay_release=1``).
    All block sizes are multiples of 64 (one wgmma warpgroup is 64 rows).
    ``band_n`` / ``tgmm_band_n``: the persistent loops visit output tiles in bands of
    this many column tiles (``mosaic_gpu_common.band_order``; at least the number of
    column tiles: row-major), so the tiles in flight share their operands in L2.
    ``compute_wgs``: 1, or 2 for gmm (and gmm_t) warp-specialized (``_gmm_ws_body``):
    output tiles of [block_m, 2 * block_n], a copy warpgroup and two compute
    warpgroups of [block_m, block_n] each. ``tgmm_compute_wgs``: the same for tgmm
    (``_tgmm_ws_body``): output tiles of [tgmm_block_k, 2 * tgmm_block_n].
    """

    block_m: int = 128
    block_n: int = 128
    block_k: int = 64
    max_concurrent_steps: int = 4
    tgmm_block_m: int = 64
    tgmm_block_k: int = 128
    tgmm_block_n: int = 128
    tgmm_max_concurrent_steps: int = 3
    band_n: int = 16
    tgmm_band_n: int = 16
    compute_wgs: int = 1
    tgmm_compute_wgs: int = 1

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1:
                raise ValueError(f"MosaicTiles.{f.name} must be a positive int; got {v!r}")
            if "block" in f.name and v % ALIGN:
                raise ValueError(f"MosaicTiles.{f.name}={v} is not a multiple of {ALIGN}")
        for name in ("compute_wgs", "tgmm_compute_wgs"):
            if getattr(self, name) not in (1, 2):
                raise ValueError(f"MosaicTiles.{name} must be 1 or 2 (warpgroups computing "
                                 f"one output tile); got {getattr(self, name)}")

    @classmethod
    def for_shape(cls, m: int, k: int, n: int, num_groups: int) -> MosaicTiles:
        """A heuristic for ``lhs[m,k] @ rhs[num_groups,k,n]`` and its backward.

        Row tiles of 64 when groups average under 128 rows (fewer wasted rows in
        tiles that straddle group boundaries), else 128; column tiles of 128 where
        128 divides N (64 otherwise); K steps of 64 (128-byte rows, the widest TMA
        swizzle for 16-bit types). The backward picks its tile of K x N the same way
        from K and N. Pipeline depth: 4 steps (4 x 32 KiB of operand buffers in
        Hopper's 227 KiB of SMEM; the output tile reuses them after the K loop), never
        more than the K steps. Bands of 16 column tiles (the class default of
        ``band_n``, ``tgmm_band_n``): the 132 SMs' tiles in flight then cover about 8
        row tiles of 16 columns, at the Mixtral shape about one expert's rows (1024
        rows per expert in tiles of 128), which read the expert's rhs band from HBM
        once rather than once per row tile. Warp-specialized (``compute_wgs=2``,
        output tiles of [block_m, 256]) where 256 divides N (its store buffers sit
        beside the operand buffers, so ``fit`` makes the pipeline 3 steps deep for a
        float32 output). Measured on an H200 at the Mixtral shape in bf16
        (results/gpu_check_h200_4.json, one run): bands of 16 against row-major 1.69
        against 2.02 ms forward, 5.32 against 6.11 ms forward + backward; warp
        specialized against one warpgroup 1.59 against 1.69 ms, 4.78 against 5.32 ms.
        tgmm warp-specialized the same way (``tgmm_compute_wgs=2``, tiles of
        [tgmm_block_k, 256]) where 256 divides N: forward + backward against one
        warpgroup, bf16, uniform / Zipf load, on H200s (results/gpu_check_h200_6.json,
        gpu_check_h200_7*.json): Mixtral 4.95 / 5.61 against 4.97 / 5.81 ms and
        4.99 / 5.80 against 5.21 / 5.86 ms; fine-grained (E 128) 0.59 / 0.77 against
        0.66 / 0.81 ms. gpu_check.py times the alternatives beside it
        (``TILE_VARIANTS``).
        """
        avg_rows = m / max(num_groups, 1)
        block_m = 64 if avg_rows < 128 else 128
        block_n = 128 if n % 128 == 0 else ALIGN
        block_k = ALIGN
        compute_wgs = 2 if n % (2 * block_n) == 0 else 1
        tgmm_block_n = 128 if n % 128 == 0 else ALIGN
        tgmm_compute_wgs = 2 if n % (2 * tgmm_block_n) == 0 else 1
        steps = max(1, min(4, k // block_k))
        return cls(
            block_m=block_m,
            block_n=block_n,
            block_k=block_k,
            max_concurrent_steps=steps,
            compute_wgs=compute_wgs,
            tgmm_block_m=64,
            tgmm_block_k=128 if k % 128 == 0 else ALIGN,
            tgmm_block_n=tgmm_block_n,
            tgmm_max_concurrent_steps=3,
            tgmm_compute_wgs=tgmm_compute_wgs,
        )

    def smem_bytes(self, in_itemsize: int, out_itemsize: int, *, tgmm: bool,
                   out_tile_with_pipeline: bool = False) -> int:
        """SMEM of one program: the pipeline's operand buffers and the output tile,
        plus 1 KiB for barriers. The tile comes after the pipeline (a later scope, so
        the larger of the two counts), or, with ``out_tile_with_pipeline`` (a kernel
        that holds its tile around the pipeline, e.g. moe_mlp's ``down_combine``) or
        ``compute_wgs`` > 1 (its store buffers, see ``_gmm_ws_body``), alongside it
        (the sum)."""
        if tgmm:  # warp-specialized: a copy of the lhs tile per compute warpgroup
            bm, bk, bn = self.tgmm_block_m, self.tgmm_block_k, self.tgmm_block_n
            wgs = self.tgmm_compute_wgs
            operands = self.tgmm_max_concurrent_steps * wgs * (bm * bk + bm * bn) * in_itemsize
            if wgs > 1:  # one [bk, 64] store buffer per compute warpgroup, kept
                out_tile_with_pipeline, out = True, wgs * bk * ALIGN * out_itemsize
            else:
                out = bk * bn * out_itemsize
        else:
            bm, bk, wgs = self.block_m, self.block_k, self.compute_wgs
            operands = self.max_concurrent_steps * (bm * bk + bk * wgs * self.block_n)
            operands *= in_itemsize
            if wgs > 1:  # one [bm, 64] store buffer per compute warpgroup, kept
                out_tile_with_pipeline, out = True, wgs * bm * ALIGN * out_itemsize
            else:
                out = bm * self.block_n * out_itemsize
        return (operands + out if out_tile_with_pipeline else max(operands, out)) + 1024

    def fit(self, k: int, n: int, in_dtype, out_dtype, *,
            out_tile_with_pipeline: bool = False) -> MosaicTiles:
        """These tiles adjusted to serve K=k and N=n (multiples of 64, as ``check``
        requires), so that a call ``check`` accepts is always served.

        A block_k/block_n (either pass) that does not divide its dimension drops to
        64; ``compute_wgs`` drops to 1 where 2 * block_n does not divide N (and
        ``tgmm_compute_wgs`` where 2 * tgmm_block_n does not); a pipeline
        deeper than Hopper's SMEM holds gets shallower (``out_tile_with_pipeline``:
        the forward's, see ``smem_bytes``).

        Raises:
          ValueError: the tiles overflow SMEM even with a one-step pipeline.
        """
        def divides(block: int, dim: int) -> int:
            return block if dim % block == 0 else ALIGN

        tiles = dataclasses.replace(
            self, block_k=divides(self.block_k, k), block_n=divides(self.block_n, n),
            tgmm_block_k=divides(self.tgmm_block_k, k),
            tgmm_block_n=divides(self.tgmm_block_n, n),
        )
        if n % (tiles.compute_wgs * tiles.block_n):
            tiles = dataclasses.replace(tiles, compute_wgs=1)
        if n % (tiles.tgmm_compute_wgs * tiles.tgmm_block_n):
            tiles = dataclasses.replace(tiles, tgmm_compute_wgs=1)
        sizes = jnp.dtype(in_dtype).itemsize, jnp.dtype(out_dtype).itemsize
        for tgmm, field in ((False, "max_concurrent_steps"),
                            (True, "tgmm_max_concurrent_steps")):
            kw = dict(tgmm=tgmm, out_tile_with_pipeline=out_tile_with_pipeline and not tgmm)
            while tiles.smem_bytes(*sizes, **kw) > SMEM_BYTES:
                if getattr(tiles, field) == 1:
                    raise ValueError(f"{tiles} need {tiles.smem_bytes(*sizes, **kw)} "
                                     f"bytes of SMEM > {SMEM_BYTES} at one pipeline step")
                tiles = dataclasses.replace(tiles, **{field: getattr(tiles, field) - 1})
        return tiles


def resolve_tiles(tiles, m: int, k: int, n: int, num_groups: int, in_dtype, out_dtype,
                   *, out_tile_with_pipeline: bool = False):
    """The caller's MosaicTiles (or the heuristic's when None), fitted to K and N."""
    if tiles is None:
        tiles = MosaicTiles.for_shape(m, k, n, num_groups)
    if not isinstance(tiles, MosaicTiles):
        raise TypeError(f"mosaic_gpu: tiles must be MosaicTiles or None; got "
                        f"{type(tiles).__name__}")
    return tiles.fit(k, n, in_dtype, out_dtype, out_tile_with_pipeline=out_tile_with_pipeline)


# ---------------------------------------------------------------------------
# Capability checks (the pieces are in ``mosaic_gpu_common``)
# ---------------------------------------------------------------------------


def _shape_reason(m: int, k: int, n: int, num_groups: int) -> str | None:
    if m < 1 or num_groups < 1:
        return f"needs M >= 1 and G >= 1; got M={m}, G={num_groups}"
    if k % ALIGN or n % ALIGN:
        return f"K={k} and N={n} must be multiples of {ALIGN} (TMA/wgmma tile alignment)"
    if m % ROW_ALIGN:
        return (f"M={m} must be a multiple of {ROW_ALIGN} (TMA into swizzled SMEM tiles "
                f"needs GMEM dims that are multiples of the {ROW_ALIGN}-row tiling)")
    return None


def check(lhs, rhs, group_sizes, out_dtype=None, *, interpret=False) -> None:
    """Raise NotImplementedError (with the reason) unless gmm and its backward serve.

    Args: lhs [M,K], rhs [G,K,N], group_sizes int[G]; out_dtype None = lhs.dtype.
    The backward (tgmm on [M,K]x[M,N], gmm on [M,N]x[G,N,K]) has the same limits.
    """
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    raise_if(
        "mosaic_gpu ragged_dot",
        dtype_reason(lhs.dtype, rhs.dtype, out_dtype),
        _shape_reason(m, k, n, g),
        None if group_sizes.shape == (g,) else f"group_sizes must be [{g}]",
        platform_reason(interpret),
    )


def check_tgmm(lhs, dout, group_sizes, out_dtype=None, *, interpret=False) -> None:
    """``check`` for ``tgmm(lhs[M,K], dout[M,N], group_sizes[G])``."""
    out_dtype = lhs.dtype if out_dtype is None else out_dtype
    (m, k), (_, n) = lhs.shape, dout.shape
    raise_if(
        "mosaic_gpu ragged_dot",
        dtype_reason(lhs.dtype, dout.dtype, out_dtype),
        _shape_reason(m, k, n, group_sizes.shape[0]),
        platform_reason(interpret),
    )


# ---------------------------------------------------------------------------
# Schedules (plain jnp, computed before the kernels)
# ---------------------------------------------------------------------------


def num_row_tiles(m: int, num_groups: int, block_m: int) -> int:
    """Upper bound on gmm tiles: each of the G+1 segments (groups + trailing rows)
    adds at most one tile (the one it shares with the previous segment)."""
    return pl.cdiv(m, block_m) + num_groups


def segment_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends int32[G+1] of the G groups and the trailing-rows segment.

    Cumulative ends are clipped to M (a sum past M is truncated); segment G is
    ``[sum, M)``.
    """
    ends = jnp.minimum(jnp.cumsum(group_sizes.astype(jnp.int32)), jnp.int32(m))
    ends = jnp.maximum(ends, 0)
    ends = jnp.concatenate([ends, jnp.full((1,), m, jnp.int32)])
    starts = jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]])
    return starts, ends


@functools.partial(jax.jit, static_argnums=(1, 2))
def row_tile_schedule(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """The gmm work list: int32[4, T] rows (group, row block, lo, hi) per tile.

    Tile t computes rows ``[block*block_m + lo, block*block_m + hi)`` of group
    ``group``; ``group == G`` marks trailing rows (stored as zeros) and ``lo == hi``
    an unused tile. T = ``num_row_tiles(m, G, block_m)``.
    """
    g = group_sizes.shape[0]
    starts, ends = segment_bounds(group_sizes, m)
    first = starts // block_m
    last = jnp.maximum(ends - 1, 0) // block_m
    counts = jnp.where(ends > starts, last - first + 1, 0)
    tile_end = jnp.cumsum(counts)
    tile_start = tile_end - counts
    t = jnp.arange(num_row_tiles(m, g, block_m), dtype=jnp.int32)
    seg = jnp.searchsorted(tile_end, t, side="right").astype(jnp.int32)
    used = seg <= g
    seg = jnp.minimum(seg, g)
    block = first[seg] + t - tile_start[seg]
    row0 = block * block_m
    lo = jnp.clip(starts[seg] - row0, 0, block_m)
    hi = jnp.clip(ends[seg] - row0, 0, block_m)
    zero = jnp.zeros_like(t)
    return jnp.stack([
        seg, jnp.where(used, block, zero), jnp.where(used, lo, zero),
        jnp.where(used, hi, zero),
    ]).astype(jnp.int32)


@functools.partial(jax.jit, static_argnums=(1, 2))
def group_row_blocks(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """The tgmm work list: int32[4, G] rows (start, end, first row block, blocks)."""
    starts, ends = segment_bounds(group_sizes, m)
    starts, ends = starts[:-1], ends[:-1]
    first = starts // block_m
    blocks = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    return jnp.stack([starts, ends, first, blocks]).astype(jnp.int32)


# ---------------------------------------------------------------------------
# Kernel pieces
# ---------------------------------------------------------------------------


def _gmm_body(sched_gmem, lhs_gmem, rhs_gmem, out_gmem, *, tiles: MosaicTiles,
              rhs_transposed: bool, interpret: bool):
    """Persistent loop over (row tile, column tile) in bands of ``tiles.band_n``
    column tiles (``band_order``); see ``row_tile_schedule``. rhs_gmem: [G, K, N], or
    [G, N, K] with ``rhs_transposed``."""
    m, n = out_gmem.shape
    g = rhs_gmem.shape[0]
    bm, bn = tiles.block_m, tiles.block_n
    num_tiles = sched_gmem.shape[1]

    @plgpu.nd_loop((num_tiles * (n // bn),), collective_axes="sm")
    def _(info):
        t, ni = band_order(info.index[0], num_tiles, n // bn, tiles.band_n)
        group, block = sched_gmem[0, t], sched_gmem[1, t]
        lo, hi = sched_gmem[2, t], sched_gmem[3, t]
        row0, col0 = block * bm, ni * bn

        @pl.when((hi > lo) & (group < g))
        def _():
            acc = gmm_tile(lhs_gmem, rhs_gmem.at[group], block, ni, tiles,
                           rhs_transposed=rhs_transposed, interpret=interpret)
            store_rows(acc.astype(out_gmem.dtype), out_gmem, row0, lo, hi, col0,
                        min(bm, m))

        @pl.when((hi > lo) & (group == g))
        def _():
            zeros = jnp.zeros((bm, bn), out_gmem.dtype)
            store_rows(zeros, out_gmem, row0, lo, hi, col0, min(bm, m))


WS_MEMORY_REGISTERS = 40  # registers per thread of the copy warpgroup (as JAX's Hopper matmul)


def _ws_pipeline(step, context, block=0, ni=0, *, k: int, tiles: MosaicTiles,
                 rhs_transposed: bool):
    """The warp-specialized K loop of the [block_m, compute_wgs * block_n] output tile
    (row block ``block``, column tile ``ni``): lhs [bm, bk] and rhs [bk, wgs * bn] (or
    its transpose) per step, ``step(idx, lhs_smem, rhs_smem, acc)`` on each compute
    warpgroup inside ``context``."""
    bm, bn, bk, wgs = tiles.block_m, tiles.block_n, tiles.block_k, tiles.compute_wgs
    if rhs_transposed:
        rhs_spec = plgpu.BlockSpec((wgs * bn, bk), lambda kk: (ni, kk))
    else:
        rhs_spec = plgpu.BlockSpec((bk, wgs * bn), lambda kk: (kk, ni))
    return plgpu.emit_pipeline_warp_specialized(
        step, grid=(k // bk,), memory_registers=WS_MEMORY_REGISTERS,
        in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (block, kk)), rhs_spec],
        wg_axis="wg", num_compute_wgs=wgs,
        max_concurrent_steps=tiles.max_concurrent_steps, compute_context=context)


def _gmm_ws_body(sched_gmem, lhs_gmem, rhs_gmem, out_gmem, *, tiles: MosaicTiles,
                 rhs_transposed: bool, interpret: bool):
    """``_gmm_body`` warp-specialized (``tiles.compute_wgs`` > 1): in each program one
    warpgroup issues the TMA copies and ``compute_wgs`` warpgroups each compute one
    [block_m, block_n] part of a [block_m, compute_wgs * block_n] output tile
    (``plgpu.emit_pipeline_warp_specialized``). So the copies of a tile's next K steps
    overlap one warpgroup's wgmma with the other's, and the next tile's copies overlap
    this tile's stores. Each warpgroup stores its part 64 columns at a time through one
    SMEM buffer (a float32 [128, 64] is 32 KiB, so the pipeline keeps 3 steps of 48
    KiB), each store left in flight until the buffer is needed again. Same schedule
    and band order as ``_gmm_body``, over the wider tiles. The warpgroups share only
    the pipeline's operand buffers, which they read: the interpreter's race detector
    does not see races between warpgroups (a write by one to a buffer the other's
    wgmma read went unreported) nor TMA stores still reading SMEM."""
    m, n = out_gmem.shape
    g, k = rhs_gmem.shape[0], lhs_gmem.shape[1]
    bm, bn, bk, wgs = tiles.block_m, tiles.block_n, tiles.block_k, tiles.compute_wgs
    num_tiles, cols = sched_gmem.shape[1], n // (wgs * bn)
    pipeline = functools.partial(_ws_pipeline, k=k, tiles=tiles,
                                 rhs_transposed=rhs_transposed)

    def scope(allocations, out_smem, scratch=None):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((num_tiles * cols,), collective_axes="sm")
        def _(info):
            t, ni = band_order(info.index[0], num_tiles, cols, tiles.band_n)
            group, block, lo, hi = (sched_gmem[i, t] for i in range(4))

            def store(tile):  # a compute warpgroup's [bm, bn] part, 64 columns at a time
                for c in range(0, bn, ALIGN):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem[wg] is free
                    out_smem[wg] = tile[:, c:c + ALIGN]
                    store_smem_rows(out_smem.at[wg], out_gmem, block * bm, lo, hi,
                                    (ni * wgs + wg) * bn + c, min(bm, m), wait=False)

            def context(run):
                def acc_scope(acc_ref):
                    run(acc_ref)
                    store(acc_ref[...].astype(out_gmem.dtype))

                pl.run_scoped(acc_scope, plgpu.ACC((bm, bn), jnp.float32))

            def step(_, a_smem, b_smem, acc_ref):
                if rhs_transposed:
                    b = transposed(b_smem.at[pl.ds(wg * bn, bn)],
                                   None if scratch is None else scratch.at[wg])
                else:
                    b = b_smem.at[:, pl.ds(wg * bn, bn)]
                plgpu.wgmma(acc_ref, a_smem, b)
                plgpu.wgmma_wait(0)  # the pipeline frees the step's buffers on return
                return acc_ref

            @pl.when((hi > lo) & (group < g))
            def _():
                pipeline(step, context, block, ni)(lhs_gmem, rhs_gmem.at[group],
                                                   allocations=allocations)

            @pl.when((hi > lo) & (group == g) & (wg < wgs))
            def _():
                store(jnp.zeros((bm, bn), out_gmem.dtype))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    _run_ws_scope(scope, pipeline, (lhs_gmem, rhs_gmem.at[0]), (wgs, bm, ALIGN), out_gmem.dtype,
                  ((wgs, bk, bn), rhs_gmem.dtype) if rhs_transposed and interpret else None)


def _run_ws_scope(scope, pipeline, operands, store_shape, store_dtype, scratch) -> None:
    """``scope(allocations=, out_smem=[, scratch=])`` on every warpgroup: the
    allocations of ``pipeline(step, context)`` for ``operands``, the compute
    warpgroups' store buffers ``out_smem`` [wgs, rows, 64] and, where ``scratch`` =
    (shape, dtype), ``transposed``'s scratch, one per compute warpgroup (interpret
    mode)."""
    def ignore(*_, **__):
        return None

    scoped = dict(allocations=pipeline(ignore, ignore).get_allocations(*operands),
                  out_smem=plgpu.SMEM(store_shape, store_dtype))
    if scratch is not None:
        scoped["scratch"] = plgpu.SMEM(*scratch)
    pl.run_scoped(lambda **refs: scope(**refs), collective_axes="wg", **scoped)


def _mask_rows(ref, row0, start, end) -> None:
    """Zero the rows of ``ref[rows, cols]`` (global rows row0 + i) outside [start, end)."""
    x = ref[...]
    rows = jax.lax.broadcasted_iota(jnp.int32, x.shape, 0) + row0
    keep = (rows >= start) & (rows < end)
    ref[...] = jnp.where(keep, x, jnp.zeros_like(x))


def _tgmm_tile(lhs_gmem, dout_gmem, ki, ni, group_info, tiles, interpret):
    """f32[bk,bn] = sum over the group's row blocks of lhs_blk[:, ki]^T @ dout_blk[:, ni].

    ``group_info`` = (start, end, first row block, number of row blocks) of the group.
    """
    start, end, first, blocks = group_info
    bm, bk, bn = tiles.tgmm_block_m, tiles.tgmm_block_k, tiles.tgmm_block_n
    steps = tiles.tgmm_max_concurrent_steps
    delay = release_delay(steps)

    def step(idx, lhs_smem, dout_smem, acc_ref, scratch):
        row0 = (first + idx[0]) * bm

        @pl.when((row0 < start) | (row0 + bm > end))
        def _():
            _mask_rows(lhs_smem, row0, start, end)
            _mask_rows(dout_smem, row0, start, end)
            plgpu.commit_smem()

        mma(acc_ref, transposed(lhs_smem, scratch), dout_smem, steps)

    def scope(acc_ref, scratch=None):
        @pl.when(blocks > 0)
        def _():
            plgpu.emit_pipeline(
                lambda idx, a, b: step(idx, a, b, acc_ref, scratch),
                # emit_pipeline takes min(Python int, steps): the default int dtype
                grid=(blocks.astype(jax.dtypes.canonicalize_dtype(jnp.int64)),),
                in_specs=[  # int32 block indices, also under jax_enable_x64
                    plgpu.BlockSpec((bm, bk), lambda r: (first + r.astype(jnp.int32), ki),
                                    delay_release=delay),
                    plgpu.BlockSpec((bm, bn), lambda r: (first + r.astype(jnp.int32), ni),
                                    delay_release=delay),
                ],
                max_concurrent_steps=steps,
            )(lhs_gmem, dout_gmem)

        return acc_ref[...]

    return with_transpose_scratch(scope, plgpu.ACC((bk, bn), jnp.float32), (bk, bm),
                                  lhs_gmem.dtype, interpret)


def _tgmm_body(info_gmem, lhs_gmem, dout_gmem, out_gmem, *, tiles: MosaicTiles,
               interpret):
    """Persistent loop over (group, K tile, N tile), each group's tiles in bands of
    ``tiles.tgmm_band_n`` N tiles (``band_order``); see ``group_row_blocks``."""
    g, k, n = out_gmem.shape
    bk, bn = tiles.tgmm_block_k, tiles.tgmm_block_n

    @plgpu.nd_loop((g, (k // bk) * (n // bn)), collective_axes="sm")
    def _(info):
        gi, lin = info.index
        ki, ni = band_order(lin, k // bk, n // bn, tiles.tgmm_band_n)
        group_info = tuple(info_gmem[i, gi] for i in range(4))
        acc = _tgmm_tile(lhs_gmem, dout_gmem, ki, ni, group_info, tiles, interpret)

        def store(o_smem):
            o_smem[...] = acc.astype(o_smem.dtype)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(
                o_smem, out_gmem.at[gi, pl.ds(ki * bk, bk), pl.ds(ni * bn, bn)]
            )
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        pl.run_scoped(store, plgpu.SMEM((bk, bn), out_gmem.dtype))


def _tgmm_ws_step(idx, *refs, rows, wg, scratch, tiles: MosaicTiles):
    """One row block of ``_tgmm_ws_body``'s pipeline on compute warpgroup ``wg``: refs
    are the lhs copies (one per warpgroup), the dout tile [bm, wgs * bn] and the
    accumulator; ``rows`` = (the group's first row block, start, end)."""
    *lhs_copies, dout_smem, acc_ref = refs
    first, start, end = rows
    bm, bn = tiles.tgmm_block_m, tiles.tgmm_block_n
    row0 = (first + idx[0]) * bm
    for w, lhs in enumerate(lhs_copies):  # static refs per warpgroup
        dout = dout_smem.at[:, pl.ds(w * bn, bn)]

        @pl.when((wg == w) & ((row0 < start) | (row0 + bm > end)))
        def _():
            _mask_rows(lhs, row0, start, end)
            _mask_rows(dout, row0, start, end)
            plgpu.commit_smem()

        @pl.when(wg == w)
        def _():
            plgpu.wgmma(acc_ref, transposed(lhs, None if scratch is None else scratch.at[w]),
                        dout)
    plgpu.wgmma_wait(0)  # the pipeline frees the step's buffers on return
    return acc_ref


def _tgmm_ws_body(info_gmem, lhs_gmem, dout_gmem, out_gmem, *, tiles: MosaicTiles,
                  interpret):
    """``_tgmm_body`` warp-specialized (``tiles.tgmm_compute_wgs`` > 1): per program one
    warpgroup issues the TMA copies and compute warpgroup w computes the [bk, bn] part
    w of a [bk, wgs * bn] output tile: lhs_blk[:, ki]^T @ dout_blk[:, its bn columns],
    over the group's row blocks (``plgpu.emit_pipeline_warp_specialized``, grid: the
    group's row blocks, traced). Every warpgroup writes only buffers it owns: the
    pipeline brings one copy of the lhs tile per compute warpgroup (each masks its own
    copy's rows outside the group, and its own columns of dout; the interpreter's race
    detector does not see races between warpgroups, see ``_gmm_ws_body``), and each
    stores its part 64 columns at a time through its own SMEM buffer."""
    g, k, n = out_gmem.shape
    bm, bk, bn = tiles.tgmm_block_m, tiles.tgmm_block_k, tiles.tgmm_block_n
    wgs, cols = tiles.tgmm_compute_wgs, n // (tiles.tgmm_compute_wgs * tiles.tgmm_block_n)

    def pipeline(step, context, first=0, ki=0, ni=0, blocks=tiles.tgmm_max_concurrent_steps):
        lhs_spec = plgpu.BlockSpec((bm, bk), lambda r: (first + r.astype(jnp.int32), ki))
        dout_spec = plgpu.BlockSpec((bm, wgs * bn), lambda r: (first + r.astype(jnp.int32), ni))
        return plgpu.emit_pipeline_warp_specialized(
            step, grid=(blocks,), memory_registers=WS_MEMORY_REGISTERS,
            in_specs=[lhs_spec] * wgs + [dout_spec], wg_axis="wg", num_compute_wgs=wgs,
            max_concurrent_steps=tiles.tgmm_max_concurrent_steps, compute_context=context)

    def scope(allocations, out_smem, scratch=None):
        wg = jax.lax.axis_index("wg")

        @plgpu.nd_loop((g, (k // bk) * cols), collective_axes="sm")
        def _(info):
            gi, lin = info.index
            ki, ni = band_order(lin, k // bk, cols, tiles.tgmm_band_n)
            start, end, first, blocks = (info_gmem[i, gi] for i in range(4))

            def store(tile):  # a compute warpgroup's [bk, bn] part, 64 columns at a time
                for c in range(0, bn, ALIGN):
                    plgpu.wait_smem_to_gmem(0, wait_read_only=True)  # out_smem[wg] is free
                    out_smem[wg] = tile[:, c:c + ALIGN].astype(out_gmem.dtype)
                    plgpu.commit_smem()
                    plgpu.copy_smem_to_gmem(out_smem.at[wg], out_gmem.at[
                        gi, pl.ds(ki * bk, bk), pl.ds((ni * wgs + wg) * bn + c, ALIGN)])

            def context(run):
                def acc_scope(acc_ref):
                    run(acc_ref)
                    store(acc_ref[...])

                pl.run_scoped(acc_scope, plgpu.ACC((bk, bn), jnp.float32))

            @pl.when(blocks > 0)
            def _():
                step = functools.partial(_tgmm_ws_step, rows=(first, start, end), wg=wg,
                                         scratch=scratch, tiles=tiles)
                # emit_pipeline takes min(Python int, steps): the default int dtype
                grid = blocks.astype(jax.dtypes.canonicalize_dtype(jnp.int64))
                pipeline(step, context, first, ki, ni, grid)(
                    *[lhs_gmem] * wgs, dout_gmem, allocations=allocations)

            @pl.when((blocks == 0) & (wg < wgs))
            def _():
                store(jnp.zeros((bk, bn), jnp.float32))

        plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    _run_ws_scope(scope, pipeline, (*[lhs_gmem] * wgs, dout_gmem), (wgs, bk, ALIGN),
                  out_gmem.dtype, ((wgs, bk, bm), lhs_gmem.dtype) if interpret else None)


# ---------------------------------------------------------------------------
# Entry points
# ---------------------------------------------------------------------------


def gmm(lhs, rhs, group_sizes, *, out_dtype=None, tiles: MosaicTiles | None = None,
        interpret=False) -> jax.Array:
    """out[M,N] with out[m] = lhs[m] @ rhs[group of m] (f32 accumulation).

    Args:
      lhs: [M,K] bf16/f16, rows grouped consecutively. rhs: [G,K,N], lhs's dtype.
      group_sizes: int[G]; rows at or past their sum give zeros.
      out_dtype: f32, bf16 or f16 (None: lhs.dtype).
      tiles: MosaicTiles (None: ``MosaicTiles.for_shape``), fitted to K and N by
        ``MosaicTiles.fit``.
      interpret: False (compiled), True (interpreter with race detection), an
        ``InterpretGPUParams``, or None (interpret iff the default backend is CPU).
    Raises:
      NotImplementedError: when this backend cannot serve (see ``check``).
    """
    return _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, rhs_transposed=False)


def gmm_t(lhs, rhs, group_sizes, *, out_dtype=None, tiles: MosaicTiles | None = None,
          interpret=False) -> jax.Array:
    """out[M,K] with out[m] = lhs[m] @ rhs[group of m]^T, for lhs [M,N] and rhs
    [G,K,N]: the backward's dlhs = gmm(dout, rhs^T) reading rhs where it lies, its
    [block_n, block_k] tiles entering the wgmma transposed, instead of transposing rhs
    in GMEM first (a pass over every expert's weights: at the Mixtral shape 0.94 GB
    read and written per weight, ~0.45 ms at the H200's 4.1 TB/s). Args and raises as
    ``gmm`` (``check`` on the shapes of rhs^T)."""
    return _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, rhs_transposed=True)


def _gmm(lhs, rhs, group_sizes, out_dtype, tiles, interpret, *, rhs_transposed: bool):
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    interpret = resolve_interpret(interpret)
    g, k, n = rhs.shape
    b = jax.ShapeDtypeStruct((g, n, k) if rhs_transposed else (g, k, n), rhs.dtype)
    check(lhs, b, group_sizes, out_dtype, interpret=interpret)
    (m, k), (_, _, n) = lhs.shape, b.shape
    tiles = resolve_tiles(tiles, m, k, n, g, lhs.dtype, out_dtype)
    sched = row_tile_schedule(group_sizes, m, tiles.block_m)
    wgs = tiles.compute_wgs
    body = functools.partial(_gmm_body if wgs == 1 else _gmm_ws_body, tiles=tiles,
                             rhs_transposed=rhs_transposed, interpret=bool(interpret))
    out_type = jax.ShapeDtypeStruct((m, n), out_dtype)
    warpgroups = 1 if wgs == 1 else wgs + 1  # + the copy warpgroup
    return launch(body, out_type, interpret, warpgroups=warpgroups)(sched, lhs, rhs)


def tgmm(lhs, dout, group_sizes, *, out_dtype=None, tiles: MosaicTiles | None = None,
         interpret=False) -> jax.Array:
    """out[G,K,N] with out[g] = lhs[rows of g]^T @ dout[rows of g] (f32 accumulation).

    Args:
      lhs: [M,K] bf16/f16. dout: [M,N], lhs's dtype. group_sizes: int[G]; empty
        groups give zeros, rows past the sum are ignored.
      out_dtype, tiles, interpret: as for ``gmm`` (tiles' ``tgmm_*`` fields apply).
    Raises:
      NotImplementedError: when this backend cannot serve (see ``check_tgmm``).
    """
    out_dtype = jnp.dtype(lhs.dtype if out_dtype is None else out_dtype)
    interpret = resolve_interpret(interpret)
    check_tgmm(lhs, dout, group_sizes, out_dtype, interpret=interpret)
    (m, k), (_, n), g = lhs.shape, dout.shape, group_sizes.shape[0]
    tiles = resolve_tiles(tiles, m, k, n, g, lhs.dtype, out_dtype)
    info = group_row_blocks(group_sizes, m, tiles.tgmm_block_m)
    wgs = tiles.tgmm_compute_wgs
    body = functools.partial(_tgmm_body if wgs == 1 else _tgmm_ws_body, tiles=tiles,
                             interpret=bool(interpret))
    out_type = jax.ShapeDtypeStruct((g, k, n), out_dtype)
    warpgroups = 1 if wgs == 1 else wgs + 1  # + the copy warpgroup
    return launch(body, out_type, interpret, warpgroups=warpgroups)(info, lhs, dout)
