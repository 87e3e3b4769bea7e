"""The Mosaic GPU grouped GEMMs: CPU interpret mode (race detection on) against the
references, the schedules, the refusals, and CUDA lowering with ``jax.export``.

Interpret mode simulates GMEM/SMEM, TMA, barriers and wgmma on the CPU, and is slow:
shapes stay at M <= 200, K, N <= 192, tiles of 64.
"""

from __future__ import annotations

import dataclasses
import re
import zlib

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from cuda_export import MOSAIC_INTERPRET
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg

TILES = mg.MosaicTiles(
    block_m=64, block_n=64, block_k=64, max_concurrent_steps=2,
    tgmm_block_m=64, tgmm_block_k=64, tgmm_block_n=64, tgmm_max_concurrent_steps=2,
)
TOL = {jnp.float32: 1e-4, jnp.bfloat16: 2e-2, jnp.float16: 2e-3}


@pytest.fixture(autouse=True)
def _fresh_interpreter():
    """A kernel that raised leaves the interpreter's global state set: clear it."""
    yield
    mgpu.reset_interpret_state()


def _inputs(seed, m, k, n, g, dtype, rhs_rows=None):
    """Fresh normal lhs[m,k] and rhs[g,k,n] (or, with rhs_rows, dout[rhs_rows,n])."""
    k1, k2 = jax.random.split(jax.random.key(seed))
    lhs = jax.random.normal(k1, (m, k), jnp.float32).astype(dtype)
    shape = (g, k, n) if rhs_rows is None else (rhs_rows, n)
    return lhs, jax.random.normal(k2, shape, jnp.float32).astype(dtype)


def _tgmm_numpy(lhs, dout, sizes):
    """out[g] = lhs[rows of g]^T @ dout[rows of g], a float64 loop over groups."""
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    out = np.zeros((len(sizes), lhs.shape[1], dout.shape[1]))
    start = 0
    for g, size in enumerate(sizes):
        out[g] = lhs[start:start + size].T @ dout[start:start + size]
        start += size
    return out


def _assert_close(actual, expected, dtype):
    tol = TOL[dtype]
    scale = max(1.0, float(np.abs(np.asarray(expected, np.float64)).max()))
    np.testing.assert_allclose(
        np.asarray(actual, np.float64), np.asarray(expected, np.float64),
        rtol=tol, atol=tol * scale,
    )


# name: (M, sizes). M = 200 is not a multiple of the 64-row tile. Cases sharing
# (M, G, dtypes) share one compiled interpreter program, so G is 4 throughout.
GMM_CASES = {
    "all_zero_sizes": (200, [0, 0, 0, 0]),
    "one_group_holds_all": (200, [0, 200, 0, 0]),
    "size1_tile_plus1_tail": (200, [1, 65, 0, 70]),  # sum 136 < M: rows 136.. are 0
    "straddling_groups": (200, [63, 2, 64, 71]),
    "m_below_tile": (8, [3, 0, 5, 0]),
}


@pytest.mark.parametrize(
    "case,in_dtype,out_dtype",
    [
        ("all_zero_sizes", jnp.bfloat16, jnp.float32),
        ("one_group_holds_all", jnp.bfloat16, jnp.float32),
        ("size1_tile_plus1_tail", jnp.bfloat16, jnp.float32),
        ("straddling_groups", jnp.bfloat16, jnp.float32),
        ("size1_tile_plus1_tail", jnp.bfloat16, jnp.bfloat16),
        ("straddling_groups", jnp.float16, jnp.float32),
        ("m_below_tile", jnp.bfloat16, jnp.float32),
    ],
)
def test_gmm_interpret_matches_ragged_dot(case, in_dtype, out_dtype):
    """N = 128 with 64-wide tiles: two column tiles per row tile."""
    m, sizes = GMM_CASES[case]
    g, k, n = len(sizes), 64, 128
    lhs, rhs = _inputs(zlib.crc32(case.encode()), m, k, n, g, in_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    out = mg.gmm(lhs, rhs, gs, out_dtype=out_dtype, tiles=TILES, interpret=MOSAIC_INTERPRET)
    out = np.asarray(jax.block_until_ready(out).astype(jnp.float32))
    assert not mgpu.races_found()
    ref = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    assert out.shape == (m, n)
    _assert_close(out, ref.astype(out_dtype).astype(jnp.float32), out_dtype)
    assert not np.any(out[sum(sizes):]), "rows past sum(group_sizes) must be 0"


@pytest.mark.parametrize(
    "sizes,in_dtype,out_dtype",
    [
        ([1, 65, 0, 70], jnp.bfloat16, jnp.float32),  # empty group; rows 136.. ignored
        ([63, 2, 0, 135], jnp.bfloat16, jnp.float32),
        ([0, 0, 0, 0], jnp.bfloat16, jnp.bfloat16),
    ],
)
def test_tgmm_interpret_matches_numpy_loop(sizes, in_dtype, out_dtype):
    m, g, k, n = 200, len(sizes), 64, 128
    lhs, dout = _inputs(sum(sizes) + sizes[0], m, k, n, g, in_dtype, rhs_rows=m)
    gs = jnp.asarray(sizes, jnp.int32)
    out = mg.tgmm(lhs, dout, gs, out_dtype=out_dtype, tiles=TILES, interpret=MOSAIC_INTERPRET)
    out = np.asarray(jax.block_until_ready(out).astype(jnp.float32))
    assert not mgpu.races_found()
    assert out.shape == (g, k, n)
    ref = jnp.asarray(_tgmm_numpy(lhs, dout, sizes), jnp.float32)
    _assert_close(out, np.asarray(ref.astype(out_dtype).astype(jnp.float32)), out_dtype)
    for gi, size in enumerate(sizes):
        if size == 0:
            assert not np.any(out[gi]), "empty groups must give 0"


@pytest.mark.parametrize("band", [1, 2])
def test_kernels_in_bands_match_references(band):
    """N = 192 in 64-wide tiles: three column tiles, in bands of 1 (column-major,
    snaking) and 2 (a full band then a narrower one, the second with rows backwards);
    the order must not change a single output."""
    tiles = dataclasses.replace(TILES, band_n=band, tgmm_band_n=band)
    m, k, n, sizes = 200, 64, 192, [63, 2, 0, 71]  # straddling groups; rows 136.. are 0
    lhs, rhs = _inputs(band, m, k, n, len(sizes), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    out = mg.gmm(lhs, rhs, gs, out_dtype=jnp.float32, tiles=tiles, interpret=MOSAIC_INTERPRET)
    ref = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    _assert_close(jax.block_until_ready(out), ref, jnp.bfloat16)
    assert not np.any(np.asarray(out)[sum(sizes):])
    dout = _inputs(band + 7, m, k, n, len(sizes), jnp.bfloat16, rhs_rows=m)[1]
    dw = mg.tgmm(lhs, dout, gs, out_dtype=jnp.float32, tiles=tiles, interpret=MOSAIC_INTERPRET)
    _assert_close(jax.block_until_ready(dw), _tgmm_numpy(lhs, dout, sizes), jnp.bfloat16)
    assert not mgpu.races_found()


@pytest.mark.parametrize("band,sizes", [(16, [63, 2, 0, 71]), (1, [0, 200, 0, 0]),
                                        (2, [1, 65, 0, 70])])
def test_gmm_t_reads_rhs_transposed(band, sizes):
    """gmm_t(lhs[M, N], rhs[G, K, N]) = lhs[m] @ rhs[g]^T, K = 192 (three column tiles
    of the output), in bands, against lax.ragged_dot of the transposed rhs."""
    tiles = dataclasses.replace(TILES, band_n=band)
    m, k, n = 200, 192, 128
    lhs = _inputs(band + 3, m, n, n, 1, jnp.bfloat16)[0]  # [M, N]
    rhs = _inputs(band + 4, m, k, n, len(sizes), jnp.bfloat16)[1]  # [G, K, N]
    gs = jnp.asarray(sizes, jnp.int32)
    out = mg.gmm_t(lhs, rhs, gs, out_dtype=jnp.float32, tiles=tiles,
                   interpret=MOSAIC_INTERPRET)
    ref = jax.lax.ragged_dot(lhs, jnp.swapaxes(rhs, 1, 2), gs,
                             preferred_element_type=jnp.float32)
    assert out.shape == (m, k)
    _assert_close(jax.block_until_ready(out), ref, jnp.bfloat16)
    assert not np.any(np.asarray(out)[sum(sizes):])
    assert not mgpu.races_found()


def _bands_brute(rows: int, cols: int, band: int) -> list[tuple[int, int]]:
    """The banded order by its definition: bands of ``band`` columns left to right,
    rows down (backwards in every other band), columns in order within a row."""
    order = []
    for i, c0 in enumerate(range(0, cols, band)):
        for r in range(rows) if i % 2 == 0 else reversed(range(rows)):
            order += [(r, c) for c in range(c0, min(c0 + band, cols))]
    return order


@pytest.mark.parametrize("rows,cols,band", [(5, 7, 2), (3, 6, 3), (4, 4, 16), (1, 5, 1),
                                            (6, 112, 16), (7, 3, 2), (2, 9, 4)])
def test_band_order(rows, cols, band):
    r, c = jax.vmap(lambda i: mgpu.band_order(i, rows, cols, band))(jnp.arange(rows * cols))
    assert list(zip(np.asarray(r).tolist(), np.asarray(c).tolist())) == \
        _bands_brute(rows, cols, band)


@pytest.mark.parametrize("n,sizes", [(256, [63, 2, 0, 71]), (128, [0, 200, 0, 0]),
                                     (256, [1, 65, 0, 70])])
def test_warp_specialized_gmm_and_gmm_t(n, sizes):
    """compute_wgs=2: a copy warpgroup and two compute warpgroups, each computing one
    64-column half of a 128-column output tile (N = 256: two such tiles per row tile),
    gmm and gmm_t against lax.ragged_dot; rows past the sum stay 0."""
    tiles = dataclasses.replace(TILES, compute_wgs=2, band_n=1)
    m, k = 200, 128
    lhs, rhs = _inputs(n + sizes[0], m, k, n, len(sizes), jnp.bfloat16)
    gs = jnp.asarray(sizes, jnp.int32)
    ref = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    for out in (mg.gmm(lhs, rhs, gs, out_dtype=jnp.float32, tiles=tiles,
                       interpret=MOSAIC_INTERPRET),
                mg.gmm_t(lhs, jnp.swapaxes(rhs, 1, 2), gs, out_dtype=jnp.float32,
                         tiles=tiles, interpret=MOSAIC_INTERPRET)):
        assert out.shape == (m, n)
        _assert_close(jax.block_until_ready(out), ref, jnp.bfloat16)
        assert not np.any(np.asarray(out)[sum(sizes):])
        assert not mgpu.races_found()


@pytest.mark.parametrize("wgs,n,sizes", [(2, 256, [63, 2, 0, 71]), (2, 128, [0, 200, 0, 0]),
                                         (2, 256, [1, 65, 0, 70]), (1, 256, [1, 65, 0, 70])])
def test_warp_specialized_tgmm(wgs, n, sizes):
    """tgmm_compute_wgs=2: a copy warpgroup and two compute warpgroups, each computing
    one 64-column half of a [64, 128] output tile (N = 256: two such tiles per K tile),
    against a float64 NumPy loop; empty groups give zeros. The rows past the sum hold
    NaN in both operands: each warpgroup's masks (of its own lhs copy and dout columns)
    keep them out, as one warpgroup's do."""
    tiles = dataclasses.replace(TILES, tgmm_compute_wgs=wgs, tgmm_band_n=1)
    m, k, total = 200, 128, sum(sizes)
    lhs, dout = _inputs(n + sizes[0], m, k, n, len(sizes), jnp.bfloat16, rhs_rows=m)
    lhs, dout = (a.at[total:].set(jnp.nan) for a in (lhs, dout))
    out = mg.tgmm(lhs, dout, jnp.asarray(sizes, jnp.int32), out_dtype=jnp.float32,
                  tiles=tiles, interpret=MOSAIC_INTERPRET)
    assert out.shape == (len(sizes), k, n)
    _assert_close(jax.block_until_ready(out), _tgmm_numpy(lhs, dout, sizes), jnp.bfloat16)
    assert not np.any(np.asarray(out)[np.asarray(sizes) == 0])
    assert not mgpu.races_found()


@pytest.mark.cpu_backend
def test_race_detector_is_live():
    """The no-race assertions above mean something: reading SMEM before the TMA
    barrier is waited for is reported."""

    def racy(x_gmem, o_gmem):
        def scope(smem, barrier):
            plgpu.copy_gmem_to_smem(x_gmem, smem, barrier)
            early = smem[...]  # the race: the copy may still be in flight
            plgpu.barrier_wait(barrier)
            smem[...] = early
            plgpu.commit_smem()
            plgpu.copy_smem_to_gmem(smem, o_gmem)
            plgpu.wait_smem_to_gmem(0)

        pl.run_scoped(scope, plgpu.SMEM((64, 64), jnp.float32),
                      plgpu.Barrier(num_arrivals=1))

    kernel = plgpu.kernel(racy, out_type=jax.ShapeDtypeStruct((64, 64), jnp.float32),
                          grid=(1,), grid_names=("sm",), interpret=mgpu.interpret_params())
    jax.block_until_ready(kernel(jnp.ones((64, 64), jnp.float32)))
    assert mgpu.races_found()


@pytest.mark.parametrize(
    "m,sizes,block_m",
    [(200, [1, 65, 0, 70], 64), (200, [0, 0, 0], 64), (200, [0, 200, 0], 64),
     (8, [3, 0, 5], 64), (256, [64, 64, 0, 128], 64), (296, [7, 0, 0, 130, 100], 128)],
)
def test_row_tile_schedule_covers_each_row_once(m, sizes, block_m):
    """Every row in [0, M) is owned by exactly one tile of its group (G = tail)."""
    sched = np.asarray(mg.row_tile_schedule(jnp.asarray(sizes, jnp.int32), m, block_m))
    assert sched.shape == (4, mg.num_row_tiles(m, len(sizes), block_m))
    owner = np.full(m, -1)
    for group, block, lo, hi in sched.T:
        rows = np.arange(block * block_m + lo, block * block_m + hi)
        assert np.all(owner[rows] == -1), "a row is stored twice"
        owner[rows] = group
    expected = np.repeat(np.arange(len(sizes) + 1), sizes + [m - sum(sizes)])
    np.testing.assert_array_equal(owner, expected)


def test_group_row_blocks():
    info = np.asarray(mg.group_row_blocks(jnp.asarray([1, 65, 0, 70], jnp.int32), 200, 64))
    np.testing.assert_array_equal(info, [[0, 1, 66, 66], [1, 66, 66, 136],
                                         [0, 0, 1, 1], [1, 2, 0, 2]])


def _sds(shape, dtype):
    return jax.ShapeDtypeStruct(shape, dtype)


@pytest.mark.parametrize(
    "args,reason",
    [
        ((_sds((64, 64), jnp.float32), _sds((2, 64, 64), jnp.float32)), "TF32"),
        ((_sds((64, 64), jnp.bfloat16), _sds((2, 64, 64), jnp.float16)), "both"),
        ((_sds((64, 96), jnp.bfloat16), _sds((2, 96, 64), jnp.bfloat16)), "multiples of 64"),
        ((_sds((64, 64), jnp.bfloat16), _sds((2, 64, 100), jnp.bfloat16)), "multiples of 64"),
        ((_sds((300, 64), jnp.bfloat16), _sds((2, 64, 64), jnp.bfloat16)), "multiple of 8"),
    ],
)
def test_check_refuses_with_reason(args, reason):
    lhs, rhs = args
    with pytest.raises(NotImplementedError, match=reason):
        mg.check(lhs, rhs, _sds((2,), jnp.int32), jnp.float32, interpret=True)


def test_check_refuses_integer_out_dtype_and_accepts_supported():
    lhs, rhs = _sds((64, 64), jnp.bfloat16), _sds((2, 64, 64), jnp.bfloat16)
    gs = _sds((2,), jnp.int32)
    with pytest.raises(NotImplementedError, match="out_dtype"):
        mg.check(lhs, rhs, gs, jnp.int32, interpret=True)
    for out_dtype in (None, jnp.float32, jnp.bfloat16, jnp.float16):
        mg.check(lhs, rhs, gs, out_dtype, interpret=True)
    mg.check_tgmm(lhs, _sds((64, 128), jnp.bfloat16), gs, jnp.float32, interpret=True)


def test_tiles_are_fitted_to_the_shape():
    """Whatever ``check`` accepts is served: blocks that do not divide K or N drop
    to 64, pipelines too deep for SMEM get shallower; impossible tiles are errors."""
    bf16, f32 = jnp.bfloat16, jnp.float32
    t = mg.MosaicTiles(block_n=128, block_k=128, max_concurrent_steps=3,
                       tgmm_block_k=128, tgmm_block_n=128)
    fitted = t.fit(192, 320, bf16, f32)
    assert (fitted.block_k, fitted.block_n) == (64, 64)
    assert (fitted.tgmm_block_k, fitted.tgmm_block_n) == (64, 64)
    assert t.fit(256, 512, bf16, f32) == t
    big = mg.MosaicTiles(block_m=128, block_n=256, block_k=128, max_concurrent_steps=4)
    assert big.smem_bytes(2, 4, tgmm=False) > mgpu.SMEM_BYTES
    shallower = big.fit(512, 512, bf16, f32)
    assert shallower.max_concurrent_steps == 2
    assert shallower.smem_bytes(2, 4, tgmm=False) <= mgpu.SMEM_BYTES
    with pytest.raises(ValueError, match="SMEM"):
        mg.MosaicTiles(block_m=256, block_n=256, max_concurrent_steps=1).fit(
            512, 512, bf16, f32)
    # warp-specialized: output tiles of 2 x block_n, or one warpgroup where N is not
    # a multiple; its operand buffers (48 KiB a step at [128, 64] x [64, 256]) sit
    # beside two [128, 64] store buffers (64 KiB in float32), so 3 steps fit
    ws = mg.MosaicTiles(block_n=128, max_concurrent_steps=4, compute_wgs=2)
    assert ws.fit(512, 384, bf16, f32).compute_wgs == 1
    assert ws.fit(512, 512, bf16, f32).max_concurrent_steps == 3
    assert ws.fit(512, 512, bf16, bf16).max_concurrent_steps == 4
    assert ws.smem_bytes(2, 4, tgmm=False) == 4 * 48 * 1024 + 64 * 1024 + 1024
    # tgmm warp-specialized: two copies of the [64, 128] lhs tile and a [64, 256] dout
    # tile (64 KiB a step) beside two [128, 64] store buffers (64 KiB in float32, 32 in
    # bf16): 2 steps fit in 227 KiB for a float32 output, 3 for bf16
    ws_t = mg.MosaicTiles(tgmm_compute_wgs=2)
    assert ws_t.smem_bytes(2, 4, tgmm=True) == 3 * 64 * 1024 + 64 * 1024 + 1024
    assert ws_t.fit(512, 384, bf16, f32).tgmm_compute_wgs == 1
    assert ws_t.fit(512, 512, bf16, f32).tgmm_max_concurrent_steps == 2
    assert ws_t.fit(512, 512, bf16, bf16).tgmm_max_concurrent_steps == 3
    with pytest.raises(TypeError, match="MosaicTiles"):
        mg.gmm(jnp.zeros((64, 64), bf16), jnp.zeros((2, 64, 64), bf16),
               jnp.asarray([32, 32], jnp.int32), out_dtype=f32, tiles={"block_m": 64},
               interpret=True)


def test_tiles_validation_and_heuristic():
    with pytest.raises(ValueError, match="multiple of 64"):
        mg.MosaicTiles(block_m=96)
    with pytest.raises(ValueError, match="positive"):
        mg.MosaicTiles(max_concurrent_steps=0)
    bf16, f32 = jnp.bfloat16, jnp.float32
    for m, k, n, g in [(4096, 1024, 512, 8), (256, 64, 192, 16), (8, 128, 64, 1)]:
        t = mg.MosaicTiles.for_shape(m, k, n, g)
        assert t.fit(k, n, bf16, bf16) == t  # already divides and fits
        # a float32 output beside the warp-specialized pipeline may take it shallower
        f32_out = t.fit(k, n, bf16, f32)
        assert dataclasses.replace(
            f32_out, max_concurrent_steps=t.max_concurrent_steps,
            tgmm_max_concurrent_steps=t.tgmm_max_concurrent_steps) == t
        for tgmm in (False, True):
            assert f32_out.smem_bytes(2, 4, tgmm=tgmm) <= mgpu.SMEM_BYTES
        # warp-specialized where two compute warpgroups' 128-column tiles divide N
        assert t.compute_wgs == t.tgmm_compute_wgs == (2 if n % 256 == 0 else 1)
        dlhs = t.fit(n, k, bf16, bf16)  # the backward's dlhs = gmm(dout, rhs^T)
        assert dlhs.block_k == t.block_k and dlhs.block_m == t.block_m
        assert 1 <= t.max_concurrent_steps <= max(1, k // t.block_k)
    with pytest.raises(ValueError, match="compute_wgs must be 1 or 2"):
        mg.MosaicTiles(compute_wgs=3)
    with pytest.raises(ValueError, match="tgmm_compute_wgs must be 1 or 2"):
        mg.MosaicTiles(tgmm_compute_wgs=4)
    assert mg.MosaicTiles.for_shape(4096, 512, 512, 64).block_m == 64  # small groups
    # Mixtral's up projection: 4 steps of [128, 64] x [64, 256] (48 KiB each) and two
    # [128, 64] float32 store buffers exceed 227 KiB, 3 steps do not
    mixtral = mg.MosaicTiles.for_shape(8192, 4096, 14336, 8)
    assert (mixtral.compute_wgs, mixtral.max_concurrent_steps) == (2, 4)
    assert mixtral.fit(4096, 14336, bf16, f32).max_concurrent_steps == 3
    assert mixtral.fit(4096, 14336, bf16, bf16).max_concurrent_steps == 4
    assert mg.MosaicTiles.for_shape(4096, 512, 512, 4).block_m == 128


# (M, K, N, G, input dtype, output dtype); default tiles unless noted.
LOWERING_CASES = [
    (296, 256, 384, 4, jnp.bfloat16, jnp.float32),
    (2048, 512, 256, 4, jnp.bfloat16, jnp.float32),  # the largest default tiles
    (1024, 512, 256, 8, jnp.bfloat16, jnp.bfloat16),
    (8, 64, 64, 2, jnp.float16, jnp.float32),
    (1000, 128, 192, 5, jnp.float16, jnp.float16),
]


def _custom_calls(exported) -> set[str]:
    return set(re.findall(r"custom_call @(\w+)", exported.mlir_module()))


@pytest.mark.parametrize("op", ["gmm", "tgmm"])
@pytest.mark.parametrize("m,k,n,g,in_dtype,out_dtype", LOWERING_CASES)
def test_lowers_for_cuda(op, m, k, n, g, in_dtype, out_dtype):
    """interpret=False lowers the real kernel (Mosaic GPU MLIR) on this CPU host."""
    if op == "gmm":
        f = lambda a, b, s: mg.gmm(a, b, s, out_dtype=out_dtype)  # noqa: E731
        second = _sds((g, k, n), in_dtype)
        expected = (m, n)
    else:
        f = lambda a, b, s: mg.tgmm(a, b, s, out_dtype=out_dtype)  # noqa: E731
        second = _sds((m, n), in_dtype)
        expected = (g, k, n)
    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        _sds((m, k), in_dtype), second, _sds((g,), jnp.int32))
    assert any("mosaic_gpu" in c for c in _custom_calls(exported))
    assert exported.out_avals[0].shape == expected
    assert exported.out_avals[0].dtype == jnp.dtype(out_dtype)


@pytest.mark.parametrize("tiles,n", [
    (mg.MosaicTiles(max_concurrent_steps=1, tgmm_max_concurrent_steps=1), 128),
    (mg.MosaicTiles(band_n=2, tgmm_band_n=2, block_n=64, tgmm_block_n=64), 192),
    (mg.MosaicTiles(compute_wgs=2, band_n=2, tgmm_compute_wgs=2, tgmm_band_n=2), 768)])
def test_lowers_with_single_stage_pipeline_or_bands(tiles, n):
    """gmm, tgmm and gmm_t with max_concurrent_steps=1 (no delayed release, each wgmma
    waited for), with three column tiles in bands of 2 (a full band and a narrower
    one), and warp-specialized (three 256-column tiles in bands of 2)."""
    args = (_sds((256, 128), jnp.bfloat16), _sds((3, 128, n), jnp.bfloat16),
            _sds((3,), jnp.int32))
    f = lambda a, b, s: mg.gmm(a, b, s, out_dtype=jnp.float32, tiles=tiles)  # noqa: E731
    assert _custom_calls(jax.export.export(jax.jit(f), platforms=["cuda"])(*args))
    t = lambda a, b, s: mg.tgmm(a, b, s, out_dtype=jnp.float32, tiles=tiles)  # noqa: E731
    dout = _sds((256, n), jnp.bfloat16)
    assert _custom_calls(jax.export.export(jax.jit(t), platforms=["cuda"])(args[0], dout,
                                                                            args[2]))
    # gmm_t: dout [256, n] @ rhs[g]^T, rhs [3, 128, n] read transposed
    ft = lambda a, b, s: mg.gmm_t(a, b, s, out_dtype=jnp.float32, tiles=tiles)  # noqa: E731
    assert _custom_calls(jax.export.export(jax.jit(ft), platforms=["cuda"])(dout, args[1],
                                                                             args[2]))


@pytest.mark.gpu
@pytest.mark.parametrize("in_dtype", [jnp.bfloat16, jnp.float16])
def test_compiled_on_hopper(in_dtype):
    """On an H100/H200: the compiled kernels (gmm, tgmm, gmm_t; row-major, in bands
    of 2 of the 3 column tiles, and warp-specialized) against the references."""
    if not str(getattr(jax.devices()[0], "compute_capability", "")).startswith("9."):
        pytest.skip("needs a Hopper GPU")
    m, k, n, sizes = 1024, 256, 384, [0, 1, 65, 300, 0, 400]  # sum 766 < M
    lhs, rhs = _inputs(7, m, k, n, len(sizes), in_dtype)
    gs = jnp.asarray(sizes, jnp.int32)
    dout = jax.random.normal(jax.random.key(8), (m, n), jnp.float32).astype(in_dtype)
    ref = jax.lax.ragged_dot(lhs, rhs, gs, preferred_element_type=jnp.float32)
    ref_t = jax.lax.ragged_dot(dout, jnp.swapaxes(rhs, 1, 2), gs,
                               preferred_element_type=jnp.float32)
    banded = dataclasses.replace(mg.MosaicTiles.for_shape(m, k, n, len(sizes)), band_n=2,
                                 tgmm_band_n=2)
    ws = mg.MosaicTiles(block_n=64, compute_wgs=2, band_n=2, tgmm_block_n=64,
                        tgmm_compute_wgs=2, tgmm_band_n=2)  # 3 tiles of 128 columns
    for tiles in (None, banded, ws):
        out = mg.gmm(lhs, rhs, gs, out_dtype=jnp.float32, tiles=tiles)
        _assert_close(out, ref, jnp.float32)
        assert not np.any(np.asarray(out)[sum(sizes):])
        _assert_close(mg.tgmm(lhs, dout, gs, out_dtype=jnp.float32, tiles=tiles),
                      _tgmm_numpy(lhs, dout, sizes), jnp.float32)
        _assert_close(mg.gmm_t(dout, rhs, gs, out_dtype=jnp.float32, tiles=tiles), ref_t,
                      jnp.float32)


def test_imports_and_lowers_without_the_private_interpreter():
    """On a JAX whose Mosaic GPU interpreter is not at JAX 0.10's private path (a GPU
    image may ship another JAX), the package still imports and the compiled kernel
    still lowers; only interpret mode refuses, naming the reason (a fresh process with
    that module hidden)."""
    import subprocess
    import sys

    script = """
import sys
sys.modules["jax._src.pallas.mosaic_gpu.interpret.gpu_callbacks"] = None
import jax, jax.numpy as jnp
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg
S = jax.ShapeDtypeStruct
args = (S((64, 128), jnp.bfloat16), S((2, 128, 128), jnp.bfloat16), S((2,), jnp.int32))
text = jax.export.export(jax.jit(mg.gmm), platforms=["cuda"])(*args).mlir_module()
assert "custom_call @mosaic_gpu" in text
try:
    mgpu.interpret_params()
except NotImplementedError as err:
    assert "interpret mode needs" in str(err), err
else:
    raise AssertionError("interpret_params did not refuse")
assert not mgpu.races_found()
print("ok")
"""
    done = subprocess.run([sys.executable, "-c", script], capture_output=True, text=True,
                          timeout=300)
    assert done.returncode == 0 and done.stdout.strip() == "ok", done.stderr[-2000:]
