"""Pallas Mosaic GPU (Hopper) router: one kernel, then a scatter in ``jnp``.

Letters: T tokens, D model dim, E experts, K = top_k, BT = 64 tokens per tile (one
wgmma warpgroup), Ep = E padded to a multiple of 64 (>= 128), Kp = K padded to a
multiple of 8, NB = cdiv(T, BT) token blocks.

Kernel ``_topk_body`` (persistent: the SMs walk the NB token blocks):
  logits f32[BT, Ep] = x[rows] @ w_router (zero-padded to Ep columns) by the
  pipelined wgmma K loop of ``ragged_dot.mosaic_gpu`` (bf16/f16 operands, float32
  accumulation: the reference's exact products and float32 sums, in another order);
  then in registers, as the Triton router (``route.triton``): the finite-token test,
  scores (softmax over the real experts, or sigmoid), K rounds of top-k (row max,
  then the lowest column holding it: ``jax.lax.top_k``'s tie rule), the weights, and
  the token x expert one-hot of the picks. The block histogram is the one-hot's
  column sum. The block-local ranks (earlier tokens of the block on the same expert:
  an exclusive cumsum over tokens, which Mosaic GPU does not lower) come from one
  more wgmma, strictly-lower-triangular ones [BT, BT] @ one-hot [BT, Ep] in
  bfloat16, exact in its float32 accumulator (every entry is a count < BT).
``jnp`` after the kernel, O(T*K + NB*E): the counts and each (block, expert)'s first
row (``reference.block_bases``), the rows of non-finite tokens after all routed
rows (``reference.nonfinite_rows``), and one scatter
sort_order[base[b, ids[t, k]] + rank[t, k]] = t*K + k (a permutation). A scalar
scatter inside the kernel would serialise the T*K stores of a block.

Constraints (``NotImplementedError`` otherwise, so the front door falls back): x and
w_router both bfloat16 or both float16 (float32 would run as TF32 on wgmma and could
change the selection); D a multiple of 64; T a multiple of 8; E <= 256 (one wgmma
is at most 256 columns wide); K <= ``MAX_TOP_K``; compiled only on Hopper, or on the
CPU when cross-lowering with ``jax.export``. Interpret mode runs Pallas' Mosaic GPU
interpreter with its race detector (``mosaic_gpu_common.races_found``); the
interpreter has no register layouts, so the layout annotations apply only when
compiling. On an H200 (jax 0.11.2) it matched the reference at T 4096, D 4096, E 8
and took 0.065 ms, Triton's 0.056 (``gpu_check.py``); its register use at Ep = 256 is
unmeasured (one f32 [BT, Ep] tile is already 128 registers per thread: expect spills).
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg
from aristax.pallas_kernels.route.reference import RouteOutput, block_bases, nonfinite_rows
from aristax.pallas_kernels.tiling import MAX_TOP_K

BLOCK_T = 64  # tokens per tile: the rows of one wgmma warpgroup
MAX_EXPERTS = 256  # the widest wgmma


def padded_experts(num_experts: int) -> int:
    """Ep: E rounded up to a multiple of 64 (wgmma/TMA columns), at least 128."""
    return max(128, -(-num_experts // mgpu.ALIGN) * mgpu.ALIGN)


def padded_top_k(top_k: int) -> int:
    """Kp: K rounded up to a multiple of 8 (the narrowest wgmma-layout tile)."""
    return -(-top_k // 8) * 8


def check(x: jax.Array, w_router: jax.Array, top_k: int, *, interpret=False) -> None:
    """NotImplementedError with the reason when this backend cannot serve."""
    (T, D), E = x.shape, w_router.shape[1]
    mgpu.raise_if(
        "mosaic_gpu route",
        mgpu.dtype_reason(x.dtype, w_router.dtype, jnp.float32),
        None if D % mgpu.ALIGN == 0 else f"D={D} must be a multiple of {mgpu.ALIGN}",
        None if T % mgpu.ROW_ALIGN == 0 else f"T={T} must be a multiple of {mgpu.ROW_ALIGN}",
        None if E <= MAX_EXPERTS else f"E={E} > {MAX_EXPERTS} experts (one wgmma)",
        None if top_k <= MAX_TOP_K else f"top_k={top_k} > {MAX_TOP_K}",
        mgpu.platform_reason(interpret),
    )


def _gemm_tiles(d_model: int, ep: int, dtype) -> mg.MosaicTiles:
    """The logits GEMM: BT rows x all Ep columns, K steps of 64, up to 4 in flight
    (fewer where SMEM would overflow: ``MosaicTiles.fit``)."""
    tiles = mg.MosaicTiles(block_m=BLOCK_T, block_n=ep, block_k=mgpu.ALIGN,
                           max_concurrent_steps=max(1, min(4, d_model // mgpu.ALIGN)))
    return tiles.fit(d_model, ep, dtype, jnp.float32)


WGMMA = plgpu.Layout.WGMMA
COL = plgpu.Layout.WGMMA.reduce(0)  # one value per tile column: [Ep]


def _with_layout(x: jax.Array, layout, interpret: bool) -> jax.Array:
    """x annotated with its register layout for the compiler (the interpreter, which
    has no layouts, cannot lower the annotation)."""
    return x if interpret else plgpu.layout_cast(x, layout)


def _iota(shape, dim: int, interpret: bool) -> jax.Array:
    """int32 iota over ``dim`` in the wgmma register layout."""
    return _with_layout(jax.lax.broadcasted_iota(jnp.int32, shape, dim), WGMMA, interpret)


def _per_row(v: jax.Array, width: int) -> jax.Array:
    """[BT] -> [BT, width]: each row's value across the row."""
    return jax.lax.broadcast_in_dim(v, (v.shape[0], width), [0])


def _scores(logits: jax.Array, real: jax.Array, score: str) -> jax.Array:
    """[BT, Ep] softmax over the real experts (0 on padding) or sigmoid."""
    if score == "sigmoid":
        return 1.0 / (1.0 + jnp.exp(-logits))
    masked = jnp.where(real, logits, -jnp.inf)
    unnorm = jnp.exp(masked - _per_row(jnp.max(masked, axis=1), masked.shape[1]))
    return unnorm / _per_row(jnp.sum(unnorm, axis=1), masked.shape[1])


def _top_k(select: jax.Array, cols: jax.Array, top_k: int) -> list[jax.Array]:
    """K arrays int32[BT]: the k-th best column, lowest index among equal values.

    Round k takes the row max over the columns not taken yet and the smallest such
    column holding it (so K distinct experts, also among -inf scores, e.g. a -inf
    bias; ties resolve as in ``jax.lax.top_k``). As there, NaN (a NaN bias) ranks
    above every number, so a pick is always a real column.
    """
    picks, ep = [], select.shape[1]
    number, nan = select == select, select != select  # no bool negation in Mosaic GPU
    taken = jnp.zeros(select.shape, jnp.float32)
    for _ in range(top_k):
        free = taken == 0.0
        best = _per_row(jnp.max(jnp.where(free & number, select, -jnp.inf), axis=1), ep)
        idx = jnp.min(jnp.where(free & (select == best), cols, ep), axis=1)
        idx_nan = jnp.min(jnp.where(free & nan, cols, ep), axis=1)
        idx = jnp.where(idx_nan < ep, idx_nan, idx)
        picks.append(idx)
        taken = jnp.where(cols == _per_row(idx, ep), 1.0, taken)
    return picks


def _by_choice(values: list[jax.Array], kcols: jax.Array) -> jax.Array:
    """[BT, Kp] with column k = values[k] ([BT] each), 0 past K."""
    out = jnp.zeros(kcols.shape, values[0].dtype)
    for k, v in enumerate(values):
        out = jnp.where(kcols == k, _per_row(v, kcols.shape[1]), out)
    return out


def _ranks_before(onehot: jax.Array, interpret: bool) -> jax.Array:
    """f32[BT, Ep]: before[t, e] = sum_{t' < t} onehot[t', e], by one bf16 wgmma.

    onehot holds 0/1 and BT <= 256, so bfloat16 operands and the float32
    accumulator are exact.
    """
    bt, ep = onehot.shape
    lower = jnp.where(_iota((bt, bt), 1, interpret) < _iota((bt, bt), 0, interpret),
                      1.0, 0.0)

    def scope(tri_smem, onehot_smem, acc_ref):
        tri_smem[...] = lower.astype(jnp.bfloat16)
        onehot_smem[...] = onehot.astype(jnp.bfloat16)
        plgpu.commit_smem()
        plgpu.wgmma(acc_ref, tri_smem, onehot_smem)
        plgpu.wgmma_wait(0)
        return acc_ref[...]

    smem = (plgpu.SMEM((bt, bt), jnp.bfloat16), plgpu.SMEM((bt, ep), jnp.bfloat16))
    acc = plgpu.ACC((bt, ep), jnp.float32)
    if not interpret:
        return pl.run_scoped(scope, *smem, acc)
    # The interpreter allocates registers (ACC) and SMEM in separate scopes.
    return pl.run_scoped(lambda a, b: pl.run_scoped(lambda c: scope(a, b, c), acc), *smem)


def _topk_body(x_gmem, w_gmem, bias_gmem, logits_gmem, ids_gmem, wts_gmem, rank_gmem,
               hist_gmem, *, num_experts: int, top_k: int, score: str, normalize: bool,
               interpret: bool):
    """Per token block b: logits, ids and weights [BT, Kp], ranks [BT, Kp] and the
    histogram hist[b*Ep : (b+1)*Ep]."""
    (T, ep), kp = logits_gmem.shape, ids_gmem.shape[1]
    tiles = _gemm_tiles(x_gmem.shape[1], ep, x_gmem.dtype)
    max_rows = min(BLOCK_T, T)

    def scope(bias_smem, hist_smem, barrier):
        plgpu.copy_gmem_to_smem(bias_gmem, bias_smem, barrier)
        plgpu.barrier_wait(barrier)

        @plgpu.nd_loop((pl.cdiv(T, BLOCK_T),), collective_axes="sm")
        def _(info):
            b = info.index[0]
            row0 = b * BLOCK_T
            num_rows = jnp.minimum(T - row0, BLOCK_T)
            logits = mgpu.gmm_tile(x_gmem, w_gmem, b, 0, tiles)
            mgpu.store_rows(logits, logits_gmem, row0, 0, num_rows, 0, max_rows)

            cols = _iota(logits.shape, 1, interpret)
            kcols = _iota((BLOCK_T, kp), 1, interpret)
            real = cols < num_experts
            bad = real & ((logits != logits) | (jnp.abs(logits) == jnp.inf))  # NaN, inf
            num_bad = jnp.sum(jnp.where(bad, 1, 0), axis=1)
            finite = _per_row(num_bad, ep) == 0
            scores = _scores(jnp.where(finite, logits, 0.0), real, score)
            bias = jax.lax.broadcast_in_dim(
                _with_layout(bias_smem[...], COL, interpret), logits.shape, [1])
            picks = _top_k(jnp.where(real, scores + bias, -jnp.inf), cols, top_k)

            # The K experts of a token are distinct; unrouted tokens get no rows.
            routed = finite & (_iota(logits.shape, 0, interpret) < num_rows)
            picked, onehot = [], jnp.zeros(logits.shape, jnp.float32)
            for idx in picks:
                hit = cols == _per_row(idx, ep)
                picked.append(jnp.sum(jnp.where(hit, scores, 0.0), axis=1))
                onehot = jnp.where(hit & routed, 1.0, onehot)
            wts = _by_choice(picked, kcols)
            if normalize:  # as reference.normalize_rows: underflowed rows get 0
                total = _per_row(jnp.sum(wts, axis=1), kp)
                ok = total >= jnp.finfo(jnp.float32).tiny
                wts = jnp.where(ok, wts / jnp.where(ok, total, 1.0), 0.0)
            wts = jnp.where(_per_row(num_bad, kp) == 0, wts, 0.0)
            before = _ranks_before(onehot, interpret)
            rank = _by_choice([jnp.sum(jnp.where(cols == _per_row(idx, ep), before, 0.0),
                                     axis=1) for idx in picks], kcols)
            for tile, out in ((_by_choice(picks, kcols), ids_gmem), (wts, wts_gmem),
                              (rank.astype(jnp.int32), rank_gmem)):
                mgpu.store_rows(tile, out, row0, 0, num_rows, 0, max_rows)

            hist_smem[...] = jnp.sum(onehot, axis=0).astype(jnp.int32)
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(hist_smem, hist_gmem.at[pl.ds(b * ep, ep)])
            plgpu.wait_smem_to_gmem(0, wait_read_only=True)

    pl.run_scoped(scope, plgpu.SMEM((ep,), jnp.float32), plgpu.SMEM((ep,), jnp.int32),
                  plgpu.Barrier(num_arrivals=1))


def route(
    x: jax.Array,
    w_router: jax.Array,
    bias: jax.Array | None,
    *,
    top_k: int,
    score: str,
    normalize: bool,
    interpret=False,
) -> RouteOutput:
    """Mosaic GPU router with the reference's contract (``reference.route``).

    Args:
      x: [T, D] bf16/f16. w_router: [D, E], x's dtype. bias: float[E] or None.
      top_k: K. score: "softmax" | "sigmoid". normalize: renormalise the weights.
      interpret: False (compiled), True (interpreter with race detection), an
        ``InterpretGPUParams``, or None (interpret iff the default backend is CPU).
    Returns:
      ``RouteOutput`` (logits/weights in float32).
    Raises:
      NotImplementedError: when this backend cannot serve (see ``check``).
    """
    interpret = mgpu.resolve_interpret(interpret)
    check(x, w_router, top_k, interpret=interpret)
    T, E = x.shape[0], w_router.shape[1]
    ep, kp, nb = padded_experts(E), padded_top_k(top_k), pl.cdiv(T, BLOCK_T)
    w_padded = jnp.pad(w_router, ((0, 0), (0, ep - E)))
    bias_row = jnp.zeros((E,), jnp.float32) if bias is None else bias.astype(jnp.float32)
    bias_padded = jnp.pad(bias_row, (0, ep - E))
    f32, i32 = jnp.float32, jnp.int32
    out_type = (jax.ShapeDtypeStruct((T, ep), f32), jax.ShapeDtypeStruct((T, kp), i32),
                jax.ShapeDtypeStruct((T, kp), f32), jax.ShapeDtypeStruct((T, kp), i32),
                jax.ShapeDtypeStruct((nb * ep,), i32))
    body = functools.partial(_topk_body, num_experts=E, top_k=top_k, score=score,
                             normalize=normalize, interpret=bool(interpret))
    logits, ids, weights, rank, hist = mgpu.launch(body, out_type, interpret)(
        x, w_padded, bias_padded)
    logits, ids = logits[:, :E], ids[:, :top_k]
    counts, base = block_bases(hist.reshape(nb, ep), E)
    nf_rows = nonfinite_rows(logits, jnp.sum(counts, dtype=jnp.int32), top_k)[:, None]
    block = (jnp.arange(T, dtype=i32) // BLOCK_T)[:, None]
    pos = jnp.where(nf_rows >= 0, nf_rows + jnp.arange(top_k, dtype=i32),
                    base[block, ids] + rank[:, :top_k])
    sort_order = jnp.zeros((T * top_k,), i32).at[pos.reshape(-1)].set(
        jnp.arange(T * top_k, dtype=i32), unique_indices=True, mode="promise_in_bounds")
    return RouteOutput(logits, ids, weights[:, :top_k], counts, sort_order)
