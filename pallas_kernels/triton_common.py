"""Building blocks shared by the Pallas Triton kernels of every op: the supported
dtypes, one kernel's launch tiles (``KernelTiles``), the grouped-GEMM tile schedule
(``group_offsets``, ``gmm_schedule``) and masked loads (``mask2d``, ``load``,
``tail_mask``, ``steps_if``). Imports only JAX.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16), jnp.dtype(jnp.float32))
MIN_TILE = 16  # Triton's tl.dot needs every dot dimension >= 16.


@dataclasses.dataclass(frozen=True)
class KernelTiles:
    """One kernel's tiles: block_m rows, block_n output columns, block_k contraction,
    and Triton's num_warps / num_stages (software-pipelining depth)."""

    block_m: int
    block_n: int
    block_k: int
    num_warps: int
    num_stages: int


def group_offsets(group_sizes: jax.Array, m: int) -> jax.Array:
    """int32[G + 1]: [0, cumsum(max(group_sizes, 0))] clipped to M (so the kernels
    never address rows past M, whatever the sizes)."""
    ends = jnp.minimum(jnp.cumsum(jnp.maximum(group_sizes.astype(jnp.int32), 0),
                                  dtype=jnp.int32), m)
    return jnp.concatenate([jnp.zeros((1,), jnp.int32), ends])


# Rows of the gmm schedule.
GROUP, TILE, ROW_LO, ROW_HI, ZERO_FROM = range(5)


def gmm_schedule(group_sizes: jax.Array, m: int, block_m: int) -> jax.Array:
    """The gmm tile schedule: int32[5, cdiv(M, block_m) + G].

    Column t is one grid step: (group, row tile, row_lo, row_hi, zero_from). The step
    multiplies rows [row_lo, row_hi) of tile ``tile`` by rhs[group] and stores them,
    and stores zeros to that tile's rows >= zero_from. Steps, in order: every
    nonempty group's covering tiles; then the tiles wholly past sum(group_sizes)
    (row_lo = row_hi = 0, zero_from = sum); then idle steps (zero_from = M).
    """
    num_groups = group_sizes.shape[0]
    num_tiles = pl.cdiv(m, block_m)
    offsets = group_offsets(group_sizes, m)
    starts, ends, total = offsets[:-1], offsets[1:], offsets[-1]
    first = starts // block_m
    count = jnp.where(ends > starts, (ends - 1) // block_m - first + 1, 0)
    cum = jnp.cumsum(count, dtype=jnp.int32)
    step = jnp.arange(num_tiles + num_groups, dtype=jnp.int32)
    group = jnp.minimum(jnp.searchsorted(cum, step, side="right").astype(jnp.int32),
                        num_groups - 1)
    is_group_tile = step < cum[-1]
    zero_tile = (total + block_m - 1) // block_m + (step - cum[-1])
    is_zero_tile = ~is_group_tile & (zero_tile < num_tiles)
    tile = jnp.where(is_group_tile, first[group] + step - (cum[group] - count[group]),
                     jnp.where(is_zero_tile, zero_tile, 0))
    row_lo = jnp.where(is_group_tile, starts[group], 0)
    row_hi = jnp.where(is_group_tile, ends[group], 0)
    zero_from = jnp.where(is_group_tile | is_zero_tile, total, m)
    return jnp.stack([group, tile, row_lo, row_hi, zero_from]).astype(jnp.int32)


def mask2d(row_mask, col_mask):
    """[R, C] mask from optional [R] and [C] masks (None = all True; None if both)."""
    if row_mask is None and col_mask is None:
        return None
    if col_mask is None:
        return row_mask[:, None]
    if row_mask is None:
        return col_mask[None, :]
    return row_mask[:, None] & col_mask[None, :]


def load(ref, mask):
    """Masked load (zeros where ``mask`` is False); a plain load when mask is None."""
    return plgpu.load(ref) if mask is None else plgpu.load(ref, mask=mask, other=0)


def steps_if(live, steps: int):
    """int32 ``steps`` where the scalar ``live`` holds, else 0: a loop bound.
    (Not ``jnp.where(live, steps, 0)``: Pallas Triton gives a Python scalar in a
    scalar select the predicate's type, i1, and the GPU's compiler then rejects the
    loop: "'scf.for' op failed to verify that all of {lowerBound, upperBound, step}
    have same type".)"""
    return live.astype(jnp.int32) * steps


def tail_mask(start, size: int, bound: int):
    """[size] mask start + i < bound, or None when ``bound`` is a multiple of size
    (start is then a multiple of size and no tile overruns)."""
    return None if bound % size == 0 else start + jnp.arange(size, dtype=jnp.int32) < bound
