"""Plain-XLA backend of the grouped GEMM: a loop over row tiles, each one dense product
with its group's weights. No Pallas: compiled (never interpreted) on every platform.

Letters: M rows, K contraction, N output columns, G groups; group g owns rows
[start_g, end_g) with end = cumsum(group_sizes) clipped to M. Tiles: ``XlaTiles``
(b = ``block_m`` rows per full tile, a = ``align`` rows per remainder tile).

The work is the routed rows (``jax.lax.ragged_dot`` on XLA:CPU masks lhs into
[G, M, K]: G times the work and the memory). Tiles are visited by ``lax.fori_loop``s
whose trip counts are traced, so empty groups cost nothing. Two loop forms:

* aligned, when every group (and M) is a whole multiple of a (``aristax.dispatch.
  align_groups`` lays the MoE layer's rows out so): each group's first
  floor(size / b) * b rows in full b-row tiles, the rest in a-row tiles; every tile
  lies inside its group, so a step writes (gmm) or accumulates (tgmm) its whole
  product, with no mask, no read-modify-write of the output and no padded copy;
* masked, for any other input: each group cut into cdiv(size, b) tiles from its own
  start; a gmm step writes back only its group's rows of the tile (the rest keep what
  they hold), a tgmm step masks them to 0; lhs is padded by b rows so no tile runs
  past M.

``lax.cond`` picks the form from the group sizes at run time, so every input gets
exact results; products under ``SMALL_PRODUCT`` multiply-adds compile only the masked
form. gmm: out[m] = lhs[m] @ rhs[g(m)], rows past sum(group_sizes) are 0. tgmm:
out[g] = lhs[rows of g]^T @ dout[rows of g]. Products accumulate in float32 (float64
for float64 inputs, the output dtype for integers) at ``jax.default_matmul_precision``.

On the 2-core Xeon VM of this project (experiments/benchmarks/ragged_dot_cpu.py,
float32, results/ragged_dot_cpu.json) aligned (512, 64) tiles ran at 0.6-1.2x the rate
of one dense product of the routed rows forward and 0.67-1.1x forward + backward,
masked tiles at 0.3-0.9x, lax.ragged_dot at 0.01-0.17x.
"""

from __future__ import annotations

import dataclasses
from typing import NamedTuple

import jax
import jax.numpy as jnp
from jax import lax
from jax.sharding import PartitionSpec as P

from aristax.pallas_kernels.tiling import is_pow2, on_auto_axes, row_spec, varying_like


# The largest align ``XlaTiles.for_shape`` picks; it grows with the row count.
MAX_ALIGN = 64


@dataclasses.dataclass(frozen=True)
class XlaTiles:
    """Rows per tile of the plain-XLA grouped GEMM (forward, dlhs and drhs alike).

    Attributes:
      block_m: rows of a full tile (a power of two >= 8): larger tiles run nearer the
        dense rate on a CPU.
      align: rows of a remainder tile (a power of two, at most ``block_m``): where every
        group is a whole number of them (``dispatch.align_groups`` lays the MoE layer's
        rows out so), each group runs as full tiles then remainder tiles, unmasked, and
        wastes no row; else every group runs as ``block_m`` tiles, its last one masked.
    ``for_shape`` picks both from the mean group size.
    """

    block_m: int = 256
    align: int = 32

    def __post_init__(self):
        for name in ("block_m", "align"):
            value = getattr(self, name)
            if not (is_pow2(value) and value >= 8):
                raise ValueError(f"XlaTiles.{name}={value!r} must be a power of 2 >= 8")
        if self.align > self.block_m:
            raise ValueError(f"XlaTiles.align={self.align} must be at most block_m="
                             f"{self.block_m}")

    @classmethod
    def for_shape(cls, m: int, num_groups: int) -> XlaTiles:
        """block_m: the mean group size as a power of two in [64, 512]; align: block_m
        / 8 in [32, 64]. (512, 64) ran fastest or level at every shape of
        experiments/benchmarks/ragged_dot_cpu.py (mean groups of 512 to 1024 rows)."""
        mean = max(1, m // max(1, num_groups))
        block = int(min(512, max(64, 1 << (mean.bit_length() - 1))))
        return cls(block_m=block, align=min(block, max(32, min(MAX_ALIGN, block // 8))))


def resolve_tiles(tiles, m: int, num_groups: int) -> XlaTiles:
    """The caller's XlaTiles, or ``XlaTiles.for_shape``'s when None."""
    if tiles is None:
        return XlaTiles.for_shape(m, num_groups)
    if not isinstance(tiles, XlaTiles):
        raise TypeError(f"xla: tiles must be XlaTiles or None; got {type(tiles).__name__}")
    return tiles


def check(lhs: jax.Array, rhs: jax.Array, group_sizes: jax.Array, out_dtype, *,
          interpret: bool = False) -> None:
    """NotImplementedError unless lhs and rhs (or dout for tgmm) share one dtype; any
    dtype ``jnp.dot`` takes, and empty operands, are served, forward and backward."""
    del group_sizes, out_dtype, interpret
    if lhs.dtype != rhs.dtype:
        raise NotImplementedError(f"xla: lhs {lhs.dtype} and rhs {rhs.dtype} differ")


def _accumulation(dtype, out_dtype) -> jnp.dtype:
    """The products' dtype: float32 for floating inputs (float64 where the inputs or
    the output are float64), else ``out_dtype``."""
    if jnp.issubdtype(dtype, jnp.floating):
        wide = jnp.dtype(jnp.float64) in (jnp.dtype(dtype), jnp.dtype(out_dtype))
        return jnp.dtype(jnp.float64 if wide else jnp.float32)
    return jnp.dtype(out_dtype)


def _cdiv(a: int, b: int) -> int:
    return -(-a // b)


def group_bounds(group_sizes: jax.Array, m: int) -> tuple[jax.Array, jax.Array]:
    """starts, ends int32[G] of each group's rows, clipped to M."""
    ends = jnp.minimum(jnp.cumsum(group_sizes, dtype=jnp.int32), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends[:-1]]), ends


class Tiles(NamedTuple):
    """A schedule: tile t < count covers rows [lo[t], lo[t] + rows[t]) of group
    group[t] (rows[t] <= the tile size); entries past count are unused."""

    group: jax.Array
    lo: jax.Array
    rows: jax.Array
    count: jax.Array


def tile_schedule(starts: jax.Array, lengths: jax.Array, size: int, entries: int) -> Tiles:
    """Tiles of ``size`` rows cut from the start of each group's span [starts[g],
    starts[g] + lengths[g]), group by group; ``entries`` bounds their number."""
    tiles = (lengths + size - 1) // size
    last = jnp.cumsum(tiles, dtype=jnp.int32)
    t = jnp.arange(entries, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(last, t, side="right"),
                        lengths.shape[0] - 1).astype(jnp.int32)
    lo = starts[group] + (t - (last[group] - tiles[group])) * size
    return Tiles(group, lo, jnp.clip(starts[group] + lengths[group] - lo, 0, size), last[-1])


def aligned_schedules(group_sizes: jax.Array, m: int, tiles: XlaTiles) -> list:
    """[(full tiles, block_m), (remainder tiles, align)] of groups that are whole
    multiples of ``align``: each group's first floor(size / block_m) * block_m rows in
    full tiles, the rest in remainder tiles."""
    b, a = tiles.block_m, tiles.align
    starts, ends = group_bounds(group_sizes, m)
    full = (ends - starts) // b * b
    spare = min(m // a, group_sizes.shape[0] * (b // a - 1))
    rest = [(tile_schedule(starts + full, ends - starts - full, a, max(1, spare)), a)]
    return rest if b > m else [(tile_schedule(starts, full, b, m // b), b)] + rest


def masked_schedule(group_sizes: jax.Array, m: int, b: int) -> Tiles:
    """Tiles of b rows from each group's start, the last of each group partial: at
    most cdiv(M, b) + G of them."""
    starts, ends = group_bounds(group_sizes, m)
    return tile_schedule(starts, ends - starts, b, _cdiv(m, b) + group_sizes.shape[0])


def _aligned(group_sizes: jax.Array, m: int, align: int) -> jax.Array:
    """Whether every group (clipped to M) is a whole multiple of ``align``."""
    starts, ends = group_bounds(group_sizes, m)
    return jnp.all((ends - starts) % align == 0)


# Below this many multiply-adds (M * K * N) only the masked loop is compiled: its one
# loop compiles in a third of the time of the run-time choice among three, and at
# this size their speeds do not matter (a layer test compiles dozens of them).
SMALL_PRODUCT = 1 << 22


def _by_form(aligned, masked, group_sizes, shape: tuple[int, int, int], align: int,
             *operands):
    """``aligned(*operands)`` where every group is a whole multiple of ``align`` (a
    run-time choice), else ``masked(*operands)``; only ``masked`` is compiled where M
    is no multiple of ``align`` or the product (M, K, N) is small."""
    m, k, n = shape
    if m % align or m * k * n < SMALL_PRODUCT:
        return masked(*operands)
    return lax.cond(_aligned(group_sizes, m, align), aligned, masked, *operands)


def _zeros_like_operands(*operands):
    """jnp.zeros that varies over the manual mesh axes the operands vary over (a loop
    carry inside ``shard_map`` must type like the values the loop writes into it)."""
    return lambda shape, dtype: varying_like(jnp.zeros(shape, dtype), *operands)


def gmm(lhs, rhs, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Grouped GEMM: out[m] = lhs[m] @ rhs[g(m)]; rows past sum(group_sizes) are zero.

    Args:
      lhs: [M, K]. rhs: [G, K, N]. group_sizes: int[G], rows of each group,
        consecutive from row 0.
      out_dtype: result dtype. tiles: XlaTiles or None (``XlaTiles.for_shape``).
      interpret: ignored (plain XLA).
    Returns:
      [M, N] in ``out_dtype``. Inputs typed on a mesh with Explicit axes run with
      those axes Auto (slices and loops have no Explicit sharding rule); the result
      keeps lhs's row sharding.
    """
    del interpret
    tiles = resolve_tiles(tiles, lhs.shape[0], rhs.shape[0])
    return on_auto_axes(lambda *a: _gmm(*a, tiles, jnp.dtype(out_dtype)), lhs, rhs,
                        group_sizes, out_sharding=lambda: row_spec(lhs))


def _gmm(lhs, rhs, group_sizes, tiles: XlaTiles, out_dtype) -> jax.Array:
    (m, k), (g, _, n) = lhs.shape, rhs.shape
    if 0 in (m, k, n, g):
        return jnp.zeros((m, n), out_dtype)
    acc = _accumulation(lhs.dtype, out_dtype)
    zeros = _zeros_like_operands(lhs, rhs, group_sizes)

    def run(out, lhs, sched: Tiles, size: int, masked: bool):
        """out with each scheduled tile's product written to its rows (masked: only
        the rows that belong to its group; the others keep what they hold)."""
        row = jnp.arange(size, dtype=jnp.int32)[:, None]

        def step(t, out):
            w = lax.dynamic_index_in_dim(rhs, sched.group[t], keepdims=False)
            res = jnp.dot(lax.dynamic_slice_in_dim(lhs, sched.lo[t], size), w,
                          preferred_element_type=acc).astype(out_dtype)
            if masked:
                held = lax.dynamic_slice_in_dim(out, sched.lo[t], size)
                res = jnp.where(row < sched.rows[t], res, held)
            return lax.dynamic_update_slice_in_dim(out, res, sched.lo[t], 0)
        return lax.fori_loop(0, sched.count, step, out)

    def aligned(lhs, group_sizes):
        out = zeros((m, n), out_dtype)
        for sched, size in aligned_schedules(group_sizes, m, tiles):
            out = run(out, lhs, sched, size, masked=False)
        return out

    def masked(lhs, group_sizes):
        b = tiles.block_m
        lhs = jnp.pad(lhs, ((0, b), (0, 0)))  # a tile may run past M
        sched = masked_schedule(group_sizes, m, b)
        return run(zeros((m + b, n), out_dtype), lhs, sched, b, masked=True)[:m]

    return _by_form(aligned, masked, group_sizes, (m, k, n), tiles.align, lhs, group_sizes)


def tgmm(lhs, dout, group_sizes, *, out_dtype, tiles=None, interpret=False) -> jax.Array:
    """Transposed grouped GEMM: out[g] = lhs[rows of g]^T @ dout[rows of g].

    Args:
      lhs: [M, K]. dout: [M, N]. group_sizes: int[G] (rows past the sum are ignored;
        empty groups give zeros).
      out_dtype: result dtype. tiles: XlaTiles or None. interpret: ignored.
    Returns:
      [G, K, N] in ``out_dtype`` (replicated where inputs are typed on an Explicit mesh).
    """
    del interpret
    tiles = resolve_tiles(tiles, lhs.shape[0], group_sizes.shape[0])
    return on_auto_axes(lambda *a: _tgmm(*a, tiles, jnp.dtype(out_dtype)), lhs, dout,
                        group_sizes, out_sharding=lambda: P())


def _tgmm(lhs, dout, group_sizes, tiles: XlaTiles, out_dtype) -> jax.Array:
    (m, k), n, g = lhs.shape, dout.shape[1], group_sizes.shape[0]
    if 0 in (m, k, n, g):
        return jnp.zeros((g, k, n), out_dtype)
    acc = _accumulation(lhs.dtype, out_dtype)
    zeros = _zeros_like_operands(lhs, dout, group_sizes)

    def run(out, lhs, dout, sched: Tiles, size: int, masked: bool):
        """out[g] += lhs_tile^T @ dout_tile over the scheduled tiles (masked: the
        tile's rows past its group's end count as 0)."""
        row = jnp.arange(size, dtype=jnp.int32)[:, None]

        def step(t, out):
            a = lax.dynamic_slice_in_dim(lhs, sched.lo[t], size)
            if masked:
                a = jnp.where(row < sched.rows[t], a, jnp.zeros((), a.dtype))
            part = lax.dot_general(a, lax.dynamic_slice_in_dim(dout, sched.lo[t], size),
                                   (((0,), (0,)), ((), ())), preferred_element_type=acc)
            held = lax.dynamic_index_in_dim(out, sched.group[t], keepdims=False)
            return lax.dynamic_update_index_in_dim(out, held + part, sched.group[t], 0)
        return lax.fori_loop(0, sched.count, step, out)

    def aligned(lhs, dout, group_sizes):
        out = zeros((g, k, n), acc)
        for sched, size in aligned_schedules(group_sizes, m, tiles):
            out = run(out, lhs, dout, sched, size, masked=False)
        return out

    def masked(lhs, dout, group_sizes):
        b = tiles.block_m
        lhs, dout = (jnp.pad(x, ((0, b), (0, 0))) for x in (lhs, dout))
        return run(zeros((g, k, n), acc), lhs, dout, masked_schedule(group_sizes, m, b), b,
                   masked=True)

    out = _by_form(aligned, masked, group_sizes, (m, k, n), tiles.align, lhs, dout,
                   group_sizes)
    return out.astype(out_dtype)
