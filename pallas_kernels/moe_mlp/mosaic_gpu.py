"""Pallas Mosaic GPU (Hopper) expert MLP in two kernels: the gate/up grouped GEMM with
the row gather in its prologue and the activation in its epilogue; the down grouped
GEMM with the routing-weight multiply and the combine in its epilogue.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
M = T*K rows in expert order, nv = the valid rows, BM/BN/BK tile sizes.

Kernel ``_gate_up_body`` walks ``ragged_dot.mosaic_gpu.row_tile_schedule`` (a row
tile that straddles two experts is visited once per expert and stores only that
expert's rows) over F tiles. Per BK-wide chunk of D it gathers the tile's BM rows
x[sort_order[m] // K] by one-row TMA copies into a staging tile (rows past nv copy
a zero row), copies the staging tile through registers into the wgmma operand tile
(per-row TMA straight into the operand tile does not pass layout inference), and
runs one wgmma per weight (gate, up) into float32 accumulators; the epilogue applies
the activation (``activation.activate``: exp and a Chebyshev erfc, no erf
lowering needed) and stores h [M, F] in x's dtype.
Kernel ``_down_scatter_body`` walks the same schedule over D tiles: the pipelined
K loop of ``ragged_dot.mosaic_gpu`` (``_gmm_tile``) gives the float32 tile
h[rows] @ down[e] in SMEM; the epilogue multiplies each row m by its routing weight
w.flat[s] (s = sort_order[m]; 0 for rows past nv) and stores it by a one-row TMA to
row s of a assignment-ordered [T*K, D] array; y sums each token's K assignments (in order, as
the reference combine). sort_order is a permutation, so every assignment is written
exactly once: no zero fill, no atomics, deterministic, and the kernel batches under
``jax.vmap`` like every ``plgpu.kernel``. (A scatter-add into y by float atomics
would save the [T*K, D] round trip, but Pallas' Mosaic GPU interpreter has no
atomics and a kernel that updates a zero-filled ref cannot be batched in JAX 0.10.)
The backward (``api._kernel_bwd``) runs on the Mosaic GPU ``ragged_dot`` and
``permute`` kernels.

The gate/up K loop is double-buffered (two buffers of staging and weight tiles, a
barrier pair per buffer): step kk+1's gathers and weight copies are in flight while
step kk waits for its own, copies and multiplies. The operand tile is single: each
step waits for the previous wgmma before overwriting it. Never run on a GPU: correct
in interpret mode (race detector on; it does not model the asynchrony of wgmma, so
the wgmma waits are right by construction) and lowers for CUDA.
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels.moe_mlp.activation import activate
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg
from aristax.pallas_kernels.tiling import MAX_TOP_K



@dataclasses.dataclass(frozen=True)
class GateUpTiles:
    """Tiles of the gate/up kernel: block_m gathered rows (one barrier arrival each),
    block_n hidden (F) columns, block_k of D per step. All multiples of 64 (one wgmma
    warpgroup's rows); block_k is 64 (one 128-byte row of 16-bit values, the widest
    TMA swizzle)."""

    block_m: int = 64
    block_n: int = 128
    block_k: int = 64

    def __post_init__(self):
        for f in dataclasses.fields(self):
            v = getattr(self, f.name)
            if not isinstance(v, int) or v < 1 or v % mgpu.ALIGN:
                raise ValueError(f"GateUpTiles.{f.name} must be a positive multiple of "
                                 f"{mgpu.ALIGN}; got {v!r}")
        if self.block_k != mgpu.ALIGN:
            raise ValueError(f"GateUpTiles.block_k must be {mgpu.ALIGN}; got {self.block_k}")

    @classmethod
    def for_shape(cls, d_ff: int) -> GateUpTiles:
        """Column tiles of 128 where 128 divides F, else 64. Untuned."""
        return cls(block_n=128 if d_ff % 128 == 0 else mgpu.ALIGN)

    def fit(self, d_ff: int) -> GateUpTiles:
        """These tiles with block_n dropped to 64 when it does not divide F (which
        ``check`` makes a multiple of 64)."""
        return self if d_ff % self.block_n == 0 else dataclasses.replace(
            self, block_n=mgpu.ALIGN)


@dataclasses.dataclass(frozen=True)
class MosaicMoeMlpTiles:
    """Tiles of the Mosaic GPU expert MLP; None picks that part's heuristic.

    Attributes:
      gate_up: kernel 1 (``GateUpTiles``).
      down: kernel 2, the down GEMM with the combine epilogue: the forward fields
        of ``ragged_dot.mosaic_gpu.MosaicTiles`` (block_n over D, block_k over F;
        a block_n that is not a multiple of 128 after fitting D becomes 128).
      backward: ``MosaicTiles`` of the backward's grouped GEMMs.
    """

    gate_up: GateUpTiles | None = None
    down: mg.MosaicTiles | None = None
    backward: mg.MosaicTiles | None = None

    def __post_init__(self):
        for name, kind in (("gate_up", GateUpTiles), ("down", mg.MosaicTiles),
                           ("backward", mg.MosaicTiles)):
            v = getattr(self, name)
            if v is not None and not isinstance(v, kind):
                raise ValueError(f"MosaicMoeMlpTiles.{name} must be {kind.__name__} or "
                                 f"None; got {type(v).__name__}")
        if self.down is not None and self.down.compute_wgs != 1:
            raise ValueError("MosaicMoeMlpTiles.down.compute_wgs must be 1: the down "
                             "kernel runs one warpgroup (warp specialization is "
                             "ragged_dot's gmm only, e.g. in MosaicMoeMlpTiles.backward)")


def check(x: jax.Array, weights: jax.Array, up_edf: jax.Array, *,
          interpret: bool = False) -> None:
    """NotImplementedError with the reason when this backend cannot serve.

    x bfloat16 or float16 (wgmma would run float32 as TF32); K <= ``MAX_TOP_K``;
    T*K a multiple of 8 and F of 64 (the Mosaic grouped GEMMs); D a multiple of
    128 (the down GEMM's epilogue scales 1-D tile rows, as Mosaic ``combine``);
    compiled only on Hopper or when cross-lowering.
    """
    (T, D), K, F = x.shape, weights.shape[1], up_edf.shape[2]
    mgpu.raise_if(
        "mosaic_gpu",
        None if min(T, D, F, up_edf.shape[0]) >= 1 else
        f"empty operand (T={T}, D={D}, F={F}, E={up_edf.shape[0]})",
        None if K <= MAX_TOP_K else f"top_k={K} > {MAX_TOP_K}",
        None if jnp.dtype(x.dtype) in mgpu.INPUT_DTYPES else
        f"x dtype {x.dtype} (bfloat16/float16: float32 would run as TF32 on wgmma)",
        None if (T * K) % mgpu.ROW_ALIGN == 0 else
        f"T*K={T * K} must be a multiple of {mgpu.ROW_ALIGN}",
        None if F % mgpu.ALIGN == 0 else f"F={F} must be a multiple of {mgpu.ALIGN}",
        None if D % mgpu.WARPGROUP_ROW == 0 else
        f"D={D} must be a multiple of {mgpu.WARPGROUP_ROW}",
        mgpu.platform_reason(interpret),
    )


def backward_tiles(tiles: MosaicMoeMlpTiles | None) -> mg.MosaicTiles | None:
    """The ragged_dot tiles of the backward GEMMs (None: ragged_dot's heuristic)."""
    return None if tiles is None else _resolve(tiles).backward


def _resolve(tiles) -> MosaicMoeMlpTiles:
    if tiles is None:
        return MosaicMoeMlpTiles()
    if not isinstance(tiles, MosaicMoeMlpTiles):
        raise TypeError(f"mosaic_gpu: tiles must be MosaicMoeMlpTiles or None; got "
                        f"{type(tiles).__name__}")
    return tiles


def _gate_up_body(sched_gmem, order_gmem, nv_gmem, x_gmem, zero_gmem, *refs,
                  top_k: int, activation: str, tiles: GateUpTiles):
    """h[m] = act(x[sort_order[m] // K] @ gate[e], ... @ up[e]) for the rows of each
    scheduled (expert, row tile), F tile; refs = ([gate,] up, h).

    The K loop is double-buffered: step kk issues step kk+1's row gathers and weight
    copies into buffer (kk+1) % 2, then waits for its own buffer and multiplies; a buffer
    is refilled only after the wgmma that read it has been waited for.
    """
    *mats, h_gmem = refs
    (m, f), (T, D) = h_gmem.shape, x_gmem.shape
    bm, bn, bk = tiles.block_m, tiles.block_n, tiles.block_k
    num_experts, nv, steps = mats[0].shape[0], nv_gmem[0], D // bk

    def scope(stage, a_smem, rows_barrier, w_barrier, *w_smem):
        @plgpu.nd_loop((sched_gmem.shape[1], f // bn), collective_axes="sm")
        def _(info):
            t, ni = info.index
            expert, block, lo, hi = (sched_gmem[i, t] for i in range(4))
            row0, col0 = block * bm, ni * bn

            def source_row(r):
                p = jnp.minimum(row0 + r, m - 1)
                return jnp.minimum(order_gmem[p] // top_k, T - 1), row0 + r < nv

            def start_loads(kk, buf):
                for mat, dst in zip(mats, w_smem):
                    plgpu.copy_gmem_to_smem(
                        mat.at[expert, pl.ds(kk * bk, bk), pl.ds(col0, bn)], dst.at[buf],
                        w_barrier.at[buf])
                mgpu.start_row_gathers(x_gmem, zero_gmem, stage.at[buf],
                                             rows_barrier.at[buf], source_row, kk * bk, bk)

            def accumulate(*accs):
                start_loads(0, 0)

                @pl.loop(0, steps)
                def _(kk):
                    buf = kk % 2
                    plgpu.wgmma_wait(0)  # step kk-1 no longer reads buffer 1 - buf

                    @pl.when(kk + 1 < steps)
                    def _():
                        start_loads(kk + 1, 1 - buf)

                    plgpu.barrier_wait(rows_barrier.at[buf])
                    plgpu.barrier_wait(w_barrier.at[buf])
                    a_smem[...] = stage[buf]
                    plgpu.commit_smem()
                    for acc, w in zip(accs, w_smem):
                        plgpu.wgmma(acc, a_smem, w.at[buf])

                plgpu.wgmma_wait(0)
                pre = [acc[...] for acc in accs]
                return activate(pre[0] if len(pre) == 2 else None, pre[-1], activation)

            @pl.when((hi > lo) & (expert < num_experts))
            def _():
                h = pl.run_scoped(accumulate,
                                  *[plgpu.ACC((bm, bn), jnp.float32) for _ in mats])
                mgpu.store_rows(h.astype(h_gmem.dtype), h_gmem, row0, lo, hi, col0,
                               min(bm, m))

            @pl.when((hi > lo) & (expert == num_experts))  # rows past the routed ones
            def _():
                mgpu.store_rows(jnp.zeros((bm, bn), h_gmem.dtype), h_gmem, row0, lo, hi,
                               col0, min(bm, m))

    dtype = x_gmem.dtype
    pl.run_scoped(scope, plgpu.SMEM((2, bm, bk), dtype), plgpu.SMEM((bm, bk), dtype),
                  plgpu.Barrier(num_arrivals=bm, num_barriers=2),
                  plgpu.Barrier(num_arrivals=len(mats), num_barriers=2),
                  *[plgpu.SMEM((2, bk, bn), dtype) for _ in mats])


def gate_up(x, sort_order, num_valid, group_sizes, gate_edf, up_edf, *, activation: str,
            top_k: int, tiles: GateUpTiles | None = None, interpret=False) -> jax.Array:
    """h [M, F] in x's dtype: the activation of the gathered rows' gate/up GEMMs
    (rows past num_valid give act(0) = 0)."""
    m, (d, f) = sort_order.shape[0], up_edf.shape[1:]
    tiles = (tiles or GateUpTiles.for_shape(f)).fit(f)
    mats = [w for w in (gate_edf, up_edf) if w is not None]
    body = functools.partial(_gate_up_body, top_k=top_k, activation=activation,
                             tiles=tiles)
    return mgpu.launch(body, jax.ShapeDtypeStruct((m, f), x.dtype), interpret)(
        mg.row_tile_schedule(group_sizes, m, tiles.block_m), sort_order,
        jnp.asarray(num_valid, jnp.int32).reshape(1), x, mgpu.zero_row(d, x.dtype),
        *mats)


def _down_scatter_body(sched_gmem, order_gmem, w_gmem, nv_gmem, h_gmem, down_gmem,
                       out_gmem, *, tiles: mg.MosaicTiles):
    """out[s] = w.flat[s] * (h[m] @ down[e]) with s = sort_order[m] for the rows m < nv
    of each scheduled (expert, row tile), D tile; 0 for the other rows' assignments. Every
    assignment is some row's (sort_order is a permutation), so out is written once."""
    d = out_gmem.shape[1]
    bm, bn = tiles.block_m, tiles.block_n
    num_experts, nv = down_gmem.shape[0], nv_gmem[0]

    @plgpu.nd_loop((sched_gmem.shape[1], d // bn), collective_axes="sm")
    def _(info):
        t, ni = info.index
        expert, block, lo, hi = (sched_gmem[i, t] for i in range(4))
        row0, cols = block * bm, pl.ds(ni * bn, bn)

        def scatter(tile):
            @pl.when(expert < num_experts)  # the pseudo-group's rows are all past nv
            def _():
                tile[...] = mgpu.gmm_tile(h_gmem, down_gmem.at[expert], block, ni, tiles)

            @pl.loop(lo, hi)
            def _(r):  # by branch: a non-finite h row past nv must not leak as NaN * 0
                keep = row0 + r < nv

                @pl.when(keep)
                def _():
                    tile[r] = tile[r] * w_gmem[order_gmem[row0 + r]]

                @pl.when(jnp.logical_not(keep))
                def _():
                    tile[r] = jnp.zeros((bn,), tile.dtype)

            plgpu.commit_smem()

            @pl.loop(lo, hi)
            def _(r):
                plgpu.copy_smem_to_gmem(tile.at[pl.ds(r, 1)],
                                        out_gmem.at[pl.ds(order_gmem[row0 + r], 1), cols])

            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

        @pl.when(hi > lo)
        def _():
            pl.run_scoped(scatter, plgpu.SMEM((bm, bn), jnp.float32))


def down_tiles(tiles: mg.MosaicTiles | None, m: int, f: int, d: int, num_experts: int,
               in_dtype) -> mg.MosaicTiles:
    """The down kernel's tiles for h [m, f] @ down [num_experts, f, d]: the caller's or
    ragged_dot's heuristic on one warpgroup (the scatter epilogue is not warp
    specialized), fitted with its float32 tile held in SMEM around the GEMM's
    pipeline, block_n at least 128 (the epilogue's 1-D rows)."""
    if tiles is None:
        tiles = dataclasses.replace(mg.MosaicTiles.for_shape(m, f, d, num_experts),
                                    compute_wgs=1)
    tiles = mg.resolve_tiles(tiles, m, f, d, num_experts, in_dtype, jnp.float32,
                             out_tile_with_pipeline=True)
    if tiles.block_n % mgpu.WARPGROUP_ROW:
        tiles = dataclasses.replace(tiles, block_n=mgpu.WARPGROUP_ROW)
    return tiles


def down_combine(h, down_efd, sort_order, weights, num_valid, group_sizes, *,
                 tiles: mg.MosaicTiles | None = None, interpret=False) -> jax.Array:
    """y [T, D] float32, y[t] = sum_k weights[t, k] * (h @ down[e])[row of assignment t*K+k]
    over the rows below num_valid: the down grouped GEMM whose epilogue multiplies
    each row by its routing weight and stores it to its assignment (out [T*K, D] in assignment
    order, each written once); y sums each token's K assignments in order.

    h: [M, F] in expert order (16-bit); down_efd: [E, F, D], h's dtype.
    """
    (m, f), (e, _, d), (T, K) = h.shape, down_efd.shape, weights.shape
    tiles = down_tiles(tiles, m, f, d, e, h.dtype)
    body = functools.partial(_down_scatter_body, tiles=tiles)
    by_assignment = mgpu.launch(body, jax.ShapeDtypeStruct((m, d), jnp.float32), interpret)(
        mg.row_tile_schedule(group_sizes, m, tiles.block_m), sort_order,
        weights.reshape(-1).astype(jnp.float32),
        jnp.asarray(num_valid, jnp.int32).reshape(1), h, down_efd)
    return jnp.sum(by_assignment.reshape(T, K, d), axis=1)


def moe_mlp(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf, down_efd, *,
            activation: str, tiles: MosaicMoeMlpTiles | None = None,
            interpret: bool = False) -> jax.Array:
    """The forward (``reference.moe_mlp``'s contract): y [T, D] float32.

    Args: as ``triton.moe_mlp``; tiles: ``MosaicMoeMlpTiles`` or None (heuristics).
    """
    check(x, weights, up_edf, interpret=interpret)
    tiles = _resolve(tiles)
    h = gate_up(x, sort_order, num_valid, group_sizes, gate_edf, up_edf,
                activation=activation, top_k=weights.shape[1], tiles=tiles.gate_up,
                interpret=interpret)
    return down_combine(h, down_efd, sort_order, weights, num_valid, group_sizes,
                        tiles=tiles.down, interpret=interpret)
