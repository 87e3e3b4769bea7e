"""Pallas Triton router: two kernels and a few ``jnp`` lines between them.

Letters: T tokens, D model dim, E experts, K = top_k, BT/BD the tile sizes, NB = the
number of token blocks, Ep = E padded to a power of two (>= 16), Kp = K padded.

Kernel 1 (``_router_kernel``, one program per BT tokens):
  logits = x @ w_router over BD-wide chunks of D (f32 accumulation, IEEE f32),
  scores (softmax or sigmoid), top-k by K rounds of "take the max, lowest index on
  ties, then mask it" (the tie rule of ``jax.lax.top_k``), weights, and for the
  expert order the block-local part: hist[b, e] = routed tokens of block b on
  expert e, rank[t, k] = earlier tokens of the same block on expert ids[t, k]
  (an exclusive cumsum of the token x expert one-hot over the block).
``jnp`` between the kernels (the cross-block prefix, which needs every block's
histogram, so it cannot run inside one launch; O(NB * E) work):
  counts = sum_b hist, base[b, e] = start of expert e + rows of e in blocks < b, and
  the rows of non-finite tokens, which follow all routed rows in assignment order.
Kernel 2 (``_order_kernel``, one program per BT tokens):
  pos[t, k] = base[b, ids[t, k]] + rank[t, k], and the scatter
  sort_order[pos[t, k]] = t*K + k (each row is written exactly once).
"""

from __future__ import annotations

import dataclasses
import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import triton as plgpu

from aristax.pallas_kernels.route.reference import (
    RouteOutput, block_bases, nonfinite_rows, normalize_rows,
)
from aristax.pallas_kernels.tiling import MAX_TOP_K, next_pow2, out_type

MAX_EXPERTS = 1024  # Ep x BT tiles beyond this spill registers; fall back instead.


@dataclasses.dataclass(frozen=True)
class RouteTiles:
    """Tile sizes of both router kernels (powers of two; BT, BD >= 16 for tl.dot)."""

    block_t: int = 32
    block_d: int = 64
    num_warps: int = 4
    num_stages: int = 2

    @classmethod
    def for_shape(cls, num_tokens: int, d_model: int, num_experts: int) -> "RouteTiles":
        """Heuristic: keep the [BT, Ep] score tile near 4K elements per program."""
        ep = padded_experts(num_experts)
        block_t = max(16, min(64, 4096 // ep, next_pow2(num_tokens)))
        block_d = max(16, min(64, next_pow2(d_model)))
        return cls(block_t=block_t, block_d=block_d, num_warps=4 if block_t * ep <= 4096 else 8)

    def params(self) -> plgpu.CompilerParams:
        return plgpu.CompilerParams(num_warps=self.num_warps, num_stages=self.num_stages)


def padded_experts(num_experts: int) -> int:
    """Ep: the expert axis of the tiles, a power of two >= 16."""
    return max(16, next_pow2(num_experts))


def _dot_operands(xb: jax.Array, wb: jax.Array) -> tuple[jax.Array, jax.Array]:
    """Both bf16/f16 when both are (exact products, f32 sums), else both f32."""
    if xb.dtype == wb.dtype and xb.dtype in (jnp.bfloat16, jnp.float16):
        return xb, wb
    return xb.astype(jnp.float32), wb.astype(jnp.float32)


def _logits_tile(x_ref, w_ref, rows, cols, tiles: RouteTiles) -> jax.Array:
    """f32[BT, Ep] = x[rows] @ w[:, cols], zero outside [T, E] (masked loads)."""
    T, D = x_ref.shape
    E = w_ref.shape[1]
    rmask, cmask = rows < T, cols < E
    safe_rows = jnp.minimum(rows, T - 1)
    safe_cols = jnp.minimum(cols, E - 1)

    def body(i, acc):
        d = i * tiles.block_d + jnp.arange(tiles.block_d, dtype=jnp.int32)
        dmask = d < D
        safe_d = jnp.minimum(d, D - 1)
        xb = plgpu.load(x_ref.at[safe_rows[:, None], safe_d[None, :]],
                        mask=rmask[:, None] & dmask[None, :], other=0)
        wb = plgpu.load(w_ref.at[safe_d[:, None], safe_cols[None, :]],
                        mask=dmask[:, None] & cmask[None, :], other=0)
        a, b = _dot_operands(xb, wb)
        return acc + plgpu.dot(a, b, precision=jax.lax.Precision.HIGHEST)

    acc = jnp.zeros((tiles.block_t, cols.shape[0]), jnp.float32)
    return jax.lax.fori_loop(0, pl.cdiv(D, tiles.block_d), body, acc)


def _scores_tile(safe: jax.Array, cmask: jax.Array, score: str) -> jax.Array:
    """[BT, Ep] softmax over the real experts (0 on padding) or sigmoid."""
    if score == "sigmoid":
        return 1.0 / (1.0 + jnp.exp(-safe))
    masked = jnp.where(cmask[None, :], safe, -jnp.inf)
    unnorm = jnp.exp(masked - jnp.max(masked, axis=1, keepdims=True))
    return unnorm / jnp.sum(unnorm, axis=1, keepdims=True)


def _top_k_tile(select: jax.Array, cols: jax.Array, top_k: int) -> list[jax.Array]:
    """K arrays int32[BT]: the k-th best column, lowest index among equal values.

    Round k takes the row max over the columns not taken yet and the smallest such
    column holding it (so K distinct experts, also among -inf scores, e.g. a -inf
    bias; ties resolve as in ``jax.lax.top_k``). As there, NaN (a NaN bias) ranks
    above every number, so a pick is always a real column.
    """
    picks = []
    ep = cols.shape[0]
    nan = select != select
    taken = jnp.zeros(select.shape, jnp.bool_)
    for _ in range(top_k):
        best = jnp.max(jnp.where(taken | nan, -jnp.inf, select), axis=1, keepdims=True)
        idx = jnp.min(jnp.where(~taken & (select == best), cols[None, :], ep), axis=1)
        idx_nan = jnp.min(jnp.where(~taken & nan, cols[None, :], ep), axis=1)
        idx = jnp.where(idx_nan < ep, idx_nan, idx)
        picks.append(idx)
        taken = taken | (cols[None, :] == idx[:, None])
    return picks


def _choice_tiles(picks, scores, cols, kcols, normalize: bool):
    """ids int32[BT, Kp], weights f32[BT, Kp] (eq. of ``reference.gate_weights``) and
    the token x expert one-hot int32[BT, Ep] of the K picks."""
    shape = (scores.shape[0], kcols.shape[0])
    ids, wts = jnp.zeros(shape, jnp.int32), jnp.zeros(shape, jnp.float32)
    onehot = jnp.zeros(scores.shape, jnp.int32)
    for k, idx in enumerate(picks):
        hit = cols[None, :] == idx[:, None]
        in_k = kcols[None, :] == k
        ids = jnp.where(in_k, idx[:, None], ids)
        wts = jnp.where(in_k, jnp.sum(jnp.where(hit, scores, 0.0), axis=1)[:, None], wts)
        onehot = onehot + jnp.where(hit, 1, 0)
    if normalize:  # an underflowed row gets 0, not NaN
        wts = normalize_rows(wts)
    return ids, wts, onehot


def _block_ranks(onehot, picks, cols, kcols) -> jax.Array:
    """int32[BT, Kp]: rank[t, k] = earlier tokens of the block routed to ids[t, k].

    The K experts of one token are distinct, so this is the exclusive cumsum of the
    one-hot over the block's tokens, read at each pick; with the block offsets it
    gives the stable sort position (assignment order within an expert).
    """
    before = jnp.cumsum(onehot, axis=0) - onehot
    rank = jnp.zeros((onehot.shape[0], kcols.shape[0]), jnp.int32)
    for k, idx in enumerate(picks):
        r = jnp.sum(jnp.where(cols[None, :] == idx[:, None], before, 0), axis=1,
                    dtype=jnp.int32)  # int32 also under jax_enable_x64
        rank = jnp.where(kcols[None, :] == k, r[:, None], rank)
    return rank


def _router_kernel(x_ref, w_ref, b_ref, logits_ref, ids_ref, wts_ref, rank_ref, hist_ref,
                   *, top_k: int, score: str, normalize: bool, tiles: RouteTiles):
    """Kernel 1: logits, top-k ids/weights, block histogram and block-local ranks.

    Loads clamp their indices and mask; stores keep out-of-range indices unclamped and
    masked, so the interpreter drops them instead of writing a clamped duplicate.
    """
    T, E = logits_ref.shape
    b = pl.program_id(0)
    rows = b * tiles.block_t + jnp.arange(tiles.block_t, dtype=jnp.int32)
    cols = jnp.arange(hist_ref.shape[1], dtype=jnp.int32)
    kcols = jnp.arange(next_pow2(top_k), dtype=jnp.int32)
    rmask, cmask = rows < T, cols < E

    logits = _logits_tile(x_ref, w_ref, rows, cols, tiles)
    plgpu.store(logits_ref.at[rows[:, None], cols[None, :]], logits,
                mask=rmask[:, None] & cmask[None, :])
    bad = cmask[None, :] & ~(jnp.abs(logits) < jnp.inf)  # NaN or +-inf
    finite = jnp.sum(jnp.where(bad, 1, 0), axis=1) == 0
    scores = _scores_tile(jnp.where(finite[:, None], logits, 0.0), cmask, score)
    bias = plgpu.load(b_ref.at[jnp.minimum(cols, E - 1)], mask=cmask, other=0.0)
    picks = _top_k_tile(jnp.where(cmask[None, :], scores + bias[None, :], -jnp.inf), cols,
                        top_k)
    ids, wts, onehot = _choice_tiles(picks, scores, cols, kcols, normalize)
    wts = jnp.where(finite[:, None], wts, 0.0)
    onehot = jnp.where((finite & rmask)[:, None], onehot, 0)  # unrouted tokens: no rows
    rank = _block_ranks(onehot, picks, cols, kcols)

    kidx, kmask = (rows[:, None], kcols[None, :]), rmask[:, None] & (kcols < top_k)[None, :]
    plgpu.store(ids_ref.at[kidx], ids, mask=kmask)
    plgpu.store(wts_ref.at[kidx], wts, mask=kmask)
    plgpu.store(rank_ref.at[kidx], rank, mask=kmask)
    plgpu.store(hist_ref.at[b, cols], jnp.sum(onehot, axis=0, dtype=jnp.int32))


def _order_kernel(ids_ref, rank_ref, base_ref, nf_ref, order_ref, *, tiles: RouteTiles):
    """Kernel 2: sort_order[pos] = assignment with pos = base[b, ids] + rank (or nf_ref + k)."""
    T, K = ids_ref.shape
    b = pl.program_id(0)
    rows = b * tiles.block_t + jnp.arange(tiles.block_t, dtype=jnp.int32)
    cols = jnp.arange(base_ref.shape[1], dtype=jnp.int32)
    rmask = rows < T
    safe_rows = jnp.minimum(rows, T - 1)
    base = plgpu.load(base_ref.at[b, cols])
    nf_start = plgpu.load(nf_ref.at[safe_rows], mask=rmask, other=-1)
    for k in range(K):
        kk = jnp.full_like(rows, k)
        idx = plgpu.load(ids_ref.at[safe_rows, kk], mask=rmask, other=0)
        rank = plgpu.load(rank_ref.at[safe_rows, kk], mask=rmask, other=0)
        pos = jnp.sum(jnp.where(cols[None, :] == idx[:, None], base[None, :], 0), axis=1,
                      dtype=jnp.int32) + rank
        pos = jnp.where(nf_start >= 0, nf_start + k, pos)
        plgpu.store(order_ref.at[jnp.where(rmask, pos, T * K)], rows * K + k, mask=rmask)


def check(x: jax.Array, w_router: jax.Array, top_k: int, *, interpret: bool = False) -> None:
    """NotImplementedError with the reason when this backend cannot serve."""
    del interpret  # interpreted on CPU, compiled on any GPU Triton supports
    for name, arr in (("x", x), ("w_router", w_router)):
        if arr.dtype not in (jnp.float32, jnp.bfloat16, jnp.float16):
            raise NotImplementedError(f"{name} dtype {arr.dtype} (Triton router: f32/bf16/f16)")
        if 0 in arr.shape:
            raise NotImplementedError(f"{name} is empty (shape {arr.shape})")
    if padded_experts(w_router.shape[1]) > MAX_EXPERTS:
        raise NotImplementedError(f"E={w_router.shape[1]} > {MAX_EXPERTS} experts")
    if top_k > MAX_TOP_K:
        raise NotImplementedError(f"top_k={top_k} > {MAX_TOP_K}")


def _router_call(x, w_router, bias, *, top_k, score, normalize, interpret, tiles):
    """Kernel 1 over NB blocks: (logits, ids, weights, rank, hist[NB, Ep])."""
    (T, _), E = x.shape, w_router.shape[1]
    nb = pl.cdiv(T, tiles.block_t)
    i32, f32 = jnp.int32, jnp.float32
    operands = (x, w_router, bias)
    per_choice = [out_type((T, top_k), dt, *operands) for dt in (i32, f32, i32)]
    return pl.pallas_call(
        functools.partial(_router_kernel, top_k=top_k, score=score, normalize=normalize,
                          tiles=tiles),
        out_shape=(out_type((T, E), f32, *operands), *per_choice,
                   out_type((nb, padded_experts(E)), i32, *operands)),
        grid=(nb,), compiler_params=tiles.params(), interpret=interpret, name="route_topk",
    )(x, w_router, bias)


def _order_call(ids, rank, base, nf_rows, *, interpret, tiles):
    """Kernel 2 over NB blocks: sort_order int32[T*K]."""
    T, K = ids.shape
    return pl.pallas_call(
        functools.partial(_order_kernel, tiles=tiles),
        out_shape=out_type((T * K,), jnp.int32, ids, rank, base, nf_rows),
        grid=(pl.cdiv(T, tiles.block_t),), compiler_params=tiles.params(),
        interpret=interpret, name="route_order",
    )(ids, rank, base, nf_rows)


def route(
    x: jax.Array,
    w_router: jax.Array,
    bias: jax.Array | None,
    *,
    top_k: int,
    score: str,
    normalize: bool,
    interpret: bool = False,
    tiles: RouteTiles | None = None,
) -> RouteOutput:
    """Triton router with the reference's contract (``reference.route``).

    Args:
      x: [T, D] f32/bf16/f16. w_router: [D, E]. bias: float[E] or None.
      top_k: K. score: "softmax" | "sigmoid". normalize: renormalise the weights.
      interpret: run the kernels in the Pallas interpreter (CPU).
      tiles: ``RouteTiles``; None = ``RouteTiles.for_shape``.
    Returns:
      ``RouteOutput`` (logits/weights in float32).
    """
    check(x, w_router, top_k)
    (T, D), E = x.shape, w_router.shape[1]
    tiles = tiles or RouteTiles.for_shape(T, D, E)
    bias = jnp.zeros((E,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    logits, ids, weights, rank, hist = _router_call(
        x, w_router, bias, top_k=top_k, score=score, normalize=normalize,
        interpret=interpret, tiles=tiles)
    counts, base = block_bases(hist, E)
    nf_rows = nonfinite_rows(logits, jnp.sum(counts, dtype=jnp.int32), top_k)
    sort_order = _order_call(ids, rank, base, nf_rows, interpret=interpret, tiles=tiles)
    return RouteOutput(logits, ids, weights, counts, sort_order)
