"""pallas_kernels.moe_mlp: every kernel backend against the reference (outputs and
jax.vjp gradients for x, weights and the three expert weights), the hard routings,
front-door errors, CUDA lowering on this CPU machine, and ``aristax.moe`` with
``MoEConfig(implementation=<kernel>)`` against ``implementation="reference"``.

Tests are parametrized over ``KERNELS`` (the registered backends but "reference"),
so a backend registered later runs them too, or over ``PALLAS`` (those but the
plain-XLA "xla") where they lower Pallas kernels for CUDA; on CPU the Pallas kernels
run in interpret mode. "xla"'s own tests are in test_moe_mlp_xla.py. Routings, weights and num_valid are traced data: all routing cases
of one (backend, shape, dtype, activation) share one compiled program.
"""

from __future__ import annotations

import functools
import types

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import MOSAIC_INTERPRET, TRITON_CUDA, export_for_cuda
from aristax import MoEConfig, MoEParams, moe
from aristax.pallas_kernels import frontdoor, moe_mlp
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.moe_mlp import (
    GateUpTiles, MoeMlpTiles, MosaicMoeMlpTiles, api, fused_backend, mosaic_gpu, reference,
)
from aristax.pallas_kernels.permute import reference as permute_reference
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as mg
from aristax.pallas_kernels.ragged_dot import reference as ragged_dot_reference
from aristax.pallas_kernels.ragged_dot.triton import KernelTiles, TritonTiles
from aristax.pallas_kernels.ragged_dot.xla import XlaTiles

KERNELS = [name for name in api.BACKENDS if name != "reference"]
PALLAS = [name for name in KERNELS if name not in frontdoor.PLAIN_XLA]
# (T, D, F, E, K): T odd, T*K, D and F not multiples of the 16-row / 16..32 tiles.
SHAPE = (19, 24, 40, 5, 2)
SHAPE_K_EQ_E = (7, 24, 40, 3, 3)  # K = E
# Mosaic GPU needs T*K % 8, F % 64 and D % 128 == 0 and 16-bit operands; its row
# tiles (64) still straddle experts and T*K is not a multiple of them.
MOSAIC_SHAPE = (20, 128, 64, 5, 2)
MOSAIC_SHAPE_K_EQ_E = (8, 128, 64, 3, 3)
TILES = {"triton": MoeMlpTiles(
    gate_up=KernelTiles(16, 32, 16, 4, 2), down=KernelTiles(16, 16, 16, 4, 2),
    backward=TritonTiles(block_m=16, block_n=32, block_k=16, tgmm_block_m=16,
                         tgmm_block_k=32, tgmm_block_n=16)),
    # 128 gathered rows per tile (more than T*K), a one-step down pipeline
    # and down block_n = 64 asked for (the epilogue needs 128: it must be raised)
    "mosaic_gpu": MosaicMoeMlpTiles(
        gate_up=GateUpTiles(block_m=128),
        down=mg.MosaicTiles(block_m=64, block_n=64, max_concurrent_steps=1)),
    # tiles of 32, 16 and 8 rows: groups of SHAPE_XLA need all three loops
    "xla": XlaTiles(block_m=32, align=8)}
SHAPE_XLA = (67, 24, 40, 5, 2)
# Per backend: every activation, both operand widths where served (bf16 operands
# accumulate in float32), K = E; the routing cases each combination runs (None: all
# of ``routings``). An interpreted Mosaic GPU forward+backward takes ~12 s, so its
# hard routings are spread over the combinations: each still runs once per backend.
COMBOS = {
    "triton": [("swiglu", jnp.bfloat16, SHAPE, None), ("gelu", jnp.float32, SHAPE, None),
               ("geglu", jnp.bfloat16, SHAPE_K_EQ_E, None)],
    "mosaic_gpu": [("swiglu", jnp.bfloat16, MOSAIC_SHAPE,
                    ("random", "empty_experts", "one_expert", "num_valid_below_sum")),
                   ("gelu", jnp.float16, MOSAIC_SHAPE, ("random", "unrouted_tokens")),
                   ("geglu", jnp.bfloat16, MOSAIC_SHAPE_K_EQ_E,
                    ("random", "nothing_routed"))],
    "xla": [("swiglu", jnp.float32, SHAPE_XLA, None), ("gelu", jnp.bfloat16, SHAPE, None),
            ("geglu", jnp.float32, SHAPE_K_EQ_E, None)],
}
# (shape, x dtype) each backend serves, for the tests that need one call
SERVED = {"triton": (SHAPE, jnp.float32), "mosaic_gpu": (MOSAIC_SHAPE, jnp.bfloat16),
          "xla": (SHAPE, jnp.float32)}
UNROUTED = 10_000  # key of an unrouted slot: sorts after every expert


def test_mosaic_gpu_gate_up_alone_matches_and_has_no_races():
    """The Mosaic GPU gate/up kernel by itself, so that the race detector (which keeps
    only the last kernel's state) sees it: h equals the activation of the reference
    grouped GEMMs of the gathered rows; rows past num_valid (below the routed sum
    here) are 0. D = 192: three 64-wide K steps, so a buffer slot is refilled; F =
    64 with block_n = 128 asked for: the tiles must fit F (64-wide column tiles)."""
    shape = (8, 192, 64, 3, 2)
    T, D, F, E, K = shape
    x, _, gate, up, _, _ = operands(shape, jnp.bfloat16, 7)
    gate, up = gate.astype(jnp.bfloat16), up.astype(jnp.bfloat16)
    order, sizes, nv = routings(T, E, K)["num_valid_below_sum"]
    h = mosaic_gpu.gate_up(x, order, nv, sizes, gate, up, activation="swiglu", top_k=K,
                           tiles=GateUpTiles(block_n=128), interpret=MOSAIC_INTERPRET)
    assert not mgpu.races_found()
    rows = permute_reference.permute(x, order, nv, top_k=K)
    pre = [ragged_dot_reference.ragged_dot(rows, w, sizes,
                                            preferred_element_type=jnp.float32)
           for w in (gate, up)]
    want = reference.hidden(*pre, "swiglu").astype(jnp.bfloat16)
    assert_close(h, want, jnp.bfloat16, "gate_up")
    np.testing.assert_array_equal(np.asarray(h, np.float32)[int(nv):], 0.0)


def test_mosaic_gpu_down_combine_alone_matches_numpy():
    """The Mosaic GPU down+combine kernel by itself (race detector on): y[t] = sum of
    w * (h[m] @ down[e]) over token t's rows m below num_valid (below the routed sum
    here, so some routed rows add nothing, though they hold NaN), with a NumPy loop
    as the oracle; and under jax.vmap, one problem per batch element."""
    T, D, F, E, K = MOSAIC_SHAPE
    rng = np.random.default_rng(8)
    order, sizes, nv = routings(T, E, K)["num_valid_below_sum"]
    h32 = rng.standard_normal((T * K, F)).astype(np.float32)
    h32[nv:] = np.nan
    h = jnp.asarray(h32, jnp.bfloat16)
    down = jnp.asarray(rng.standard_normal((E, F, D)) * 0.3, jnp.bfloat16)
    w = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    y = mosaic_gpu.down_combine(h, down, order, jnp.asarray(w), nv, sizes,
                                interpret=MOSAIC_INTERPRET)
    assert not mgpu.races_found()
    h32, down32 = np.asarray(h, np.float32), np.asarray(down, np.float32)
    expert = np.repeat(np.arange(E), sizes)
    want = np.zeros((T, D), np.float32)
    for m in range(nv):
        s = order[m]
        want[s // K] += w.flat[s] * (h32[m] @ down32[expert[m]])
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-4)
    batched = jax.vmap(functools.partial(mosaic_gpu.down_combine, interpret=MOSAIC_INTERPRET),
                       in_axes=(0, None, None, None, None, None))(
        jnp.stack([h, 2 * h]), down, order, jnp.asarray(w), nv, sizes)
    # x2 is exact in floating point: the batch's second problem gives exactly 2 y
    np.testing.assert_array_equal(np.asarray(batched), np.stack([y, 2 * y]))
    assert not mgpu.races_found()


def layout(keys: np.ndarray, num_experts: int, num_valid: int | None = None):
    """(sort_order int32[T*K], group_sizes int32[E], num_valid) of expert keys [T, K]:
    the stable sort of the slots by expert, unrouted slots (UNROUTED) last."""
    flat = keys.reshape(-1)
    order = np.argsort(flat, kind="stable").astype(np.int32)
    sizes = np.bincount(flat[flat != UNROUTED], minlength=num_experts).astype(np.int32)
    return order, sizes, np.int32(sizes.sum() if num_valid is None else num_valid)


def routings(T: int, E: int, K: int, seed: int = 0) -> dict[str, tuple]:
    """Named hard routings of T tokens, top-K of E (distinct experts per token)."""
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    cases = {"random": layout(topk, E)}
    if K < E:
        cases["empty_experts"] = layout(np.tile(np.arange(K), (T, 1)), E)
        one = np.full((T, K), UNROUTED)
        one[:, 0] = E - 2  # every token on one expert; num_valid = T < T*K
        cases["one_expert"] = layout(one, E)
    unrouted = topk.copy()
    unrouted[[1, T - 2]] = UNROUTED
    cases["unrouted_tokens"] = layout(unrouted, E)
    order, sizes, nv = layout(topk, E)
    cases["num_valid_below_sum"] = (order, sizes, np.int32(nv - 5))
    cases["nothing_routed"] = layout(np.full((T, K), UNROUTED), E)
    return cases


def operands(shape, dtype, seed: int):
    """x [T, D] in dtype; weights [T, K], gate/up [E, D, F], down [E, F, D] float32
    parameters; dy [T, D] float32 (NumPy draws: no compile per shape)."""
    T, D, F, E, K = shape
    rng = np.random.default_rng(seed)

    def normal(*s, scale=1.0):
        return jnp.asarray((rng.standard_normal(s) * scale).astype(np.float32))
    x = normal(T, D).astype(dtype)
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32))
    return (x, weights, normal(E, D, F, scale=0.3), normal(E, D, F, scale=0.3),
            normal(E, F, D, scale=0.3), normal(T, D))


@functools.cache
def vjp_fn(name: str, activation: str):
    """jit((x, weights, gate, up, down, order, sizes, nv, dy) -> (y, grads)) through
    the front door with backend ``name``; grads for x, weights, gate, up, down."""
    def f(x, weights, gate, up, down, order, sizes, nv, dy):
        def op(x, weights, gate, up, down):
            return moe_mlp(x, order, weights, sizes, gate, up, down, activation=activation,
                           num_valid=nv, implementation=name, tiles=TILES.get(name))
        gate = None if activation == "gelu" else gate
        y, pullback = jax.vjp(op, x, weights, gate, up, down)
        return y, pullback(dy)
    return jax.jit(f)


def assert_close(got, want, dtype, case: str):
    """Leaf by leaf (NumPy: no compiles), atol relative to the leaf's scale; 16-bit
    operands round at 2^-8 (bf16) or 2^-11 (f16) and the kernel backward rounds at
    other points than autodiff of the reference."""
    tol = 2e-2 if jnp.dtype(dtype).itemsize == 2 else 1e-5
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert a.dtype == b.dtype, (case, i, a.dtype, b.dtype)
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(1.0, float(np.abs(b).max(initial=0.0)))
        np.testing.assert_allclose(a, b, atol=tol * scale, rtol=tol, err_msg=f"{case}: {i}")


def check_against_reference(name, shape, activation, dtype, seed, cases=None):
    T, D, F, E, K = shape
    x, weights, gate, up, down, dy = operands(shape, dtype, seed)
    every = routings(T, E, K, seed)
    for case in every if cases is None else cases:
        order, sizes, nv = every[case]
        xs = x
        if case == "unrouted_tokens":  # tokens routed nowhere may hold NaN (router)
            xs = np.array(x, np.float32)
            xs[[1, T - 2]] = np.nan
            xs = jnp.asarray(xs, dtype)
        args = (xs, weights, gate, up, down, order, sizes, nv, dy)
        got = vjp_fn(name, activation)(*args)
        want = vjp_fn("reference", activation)(*args)
        assert got[0].shape == (T, D) and got[0].dtype == jnp.float32, case
        assert_close(got, want, dtype, case)
        y, (dx, dweights, *_) = got
        if case == "nothing_routed":
            for leaf in jax.tree.leaves(got):
                np.testing.assert_array_equal(np.asarray(leaf, np.float32), 0.0, case)
        if case == "unrouted_tokens":  # tokens 1 and T-2 take no part, NaN or not
            for leaf in (y, dx, dweights):
                np.testing.assert_array_equal(np.asarray(leaf, np.float32)[[1, T - 2]], 0.0)


@pytest.mark.parametrize(
    "name, activation, dtype, shape, cases",
    [(n, *combo) for n in KERNELS for combo in COMBOS[n]],
    ids=[f"{n}-{a}-{jnp.dtype(d)}-K{s[4]}-E{s[3]}" for n in KERNELS
         for a, d, s, _ in COMBOS[n]])
def test_matches_reference_and_gradients(name, activation, dtype, shape, cases):
    check_against_reference(name, shape, activation, dtype, seed=1, cases=cases)


@pytest.mark.parametrize("dtype", [jnp.float32, jnp.float64])
@pytest.mark.parametrize("activation", reference.ACTIVATIONS + reference.OTHER_ACTIVATIONS)
def test_hidden_vjp_equals_autodiff_of_hidden(activation, dtype):
    """``reference.hidden_vjp`` (SwiGLU's written out) gives ``hidden`` and jax.vjp of
    it, on fresh values from -60 to 60 (sigmoid saturated both ways) and around 0; in
    float64 its vjp also matches central differences of ``hidden``."""
    with jax.enable_x64(dtype == jnp.float64):
        _check_hidden_vjp(activation, dtype)


def _check_hidden_vjp(activation, dtype):
    rng = np.random.default_rng(5)
    pre = tuple(jnp.asarray(np.concatenate([rng.standard_normal(64) * 3,
                                            rng.uniform(-60, 60, 64)]), dtype)
                for _ in range(2 if activation in reference.GATED + ("clamped_swiglu",) else 1))
    dh = jnp.asarray(rng.standard_normal(128), dtype)
    full = pre if len(pre) == 2 else (None,) + pre
    h, vjp = reference.hidden_vjp(pre, activation)
    want_h, want_vjp = jax.vjp(lambda *p: reference.hidden(
        *(p if len(p) == 2 else (None,) + p), activation), *pre)
    tol = dict(rtol=1e-6, atol=1e-6) if dtype == jnp.float32 else dict(rtol=1e-13, atol=1e-13)
    np.testing.assert_allclose(h, reference.hidden(*full, activation), **tol)
    np.testing.assert_allclose(h, want_h, **tol)
    for got, want in zip(vjp(dh), want_vjp(dh), strict=True):
        np.testing.assert_allclose(got, want, **tol)
    if dtype == jnp.float64:  # and, independently of autodiff, central differences
        v = tuple(jnp.asarray(rng.standard_normal(128), dtype) for _ in pre)
        eps = 1e-6
        moved = [reference.hidden_of(tuple(p + sign * eps * d for p, d in zip(pre, v)),
                                     activation) for sign in (1, -1)]
        directional = jnp.sum(dh * (moved[0] - moved[1])) / (2 * eps)
        np.testing.assert_allclose(sum(jnp.sum(g * d) for g, d in zip(vjp(dh), v)),
                                   directional, rtol=1e-6)


def test_every_backend_runs_every_routing():
    """The spread of COMBOS' routing cases leaves none out for any backend."""
    T, _, _, E, K = SHAPE  # K < E: every routing case exists
    for name in KERNELS:
        ran = set()
        for _, _, (t, _, _, e, k), cases in COMBOS[name]:
            ran |= set(routings(t, e, k) if cases is None else cases)
        assert ran == set(routings(T, E, K)), name


def counting(name: str, monkeypatch) -> list:
    """BACKENDS[name] replaced by a copy whose forward entry point (``forward`` where it
    has a backward of its own, else ``moe_mlp``) appends to the list returned."""
    calls, real = [], api.BACKENDS[name]
    entry = "forward" if hasattr(real, "backward") else "moe_mlp"
    fake = types.SimpleNamespace(**{k: getattr(real, k) for k in dir(real)
                                    if not k.startswith("__")})
    setattr(fake, entry, lambda *a, **k: calls.append(1) or getattr(real, entry)(*a, **k))
    monkeypatch.setitem(api.BACKENDS, name, fake)
    return calls


@pytest.mark.parametrize("name", PALLAS)
def test_backend_choice_and_fallback(name, monkeypatch):
    shape, dtype = SERVED[name]
    T, D, F, E, K = shape
    x, weights, gate, up, down, _ = operands(shape, dtype, 3)
    order, sizes, _ = routings(T, E, K)["random"]

    def call(impl, x=x, weights=weights):
        return jax.eval_shape(lambda: moe_mlp(x, order, weights, sizes, gate, up, down,
                                              activation="swiglu", implementation=impl))
    wide = jnp.ones((T, 65), jnp.float32)  # K > MAX_TOP_K: the kernels refuse
    wide_order = np.arange(T * 65, dtype=np.int32)
    with pytest.raises(NotImplementedError, match=f"{name}: .*top_k=65"):
        jax.eval_shape(lambda: moe_mlp(x, wide_order, wide, sizes, gate, up, down,
                                       activation="swiglu", implementation=name))
    assert jax.eval_shape(lambda: moe_mlp(x, wide_order, wide, sizes, gate, up, down,
                                          activation="swiglu",
                                          implementation=[name, "reference"])).shape == (T, D)
    calls = counting(name, monkeypatch)
    assert call(name).dtype == jnp.float32 and calls == [1]
    call(None)  # the platform default: "xla" on the CPU, Triton first on a GPU
    default_first = api.DEFAULT_ORDER.get(jax.default_backend(), ("reference",))[0]
    assert calls == [1] * (1 + (default_first == name))
    assert fused_backend(None, x, weights, up) == api.LAYER_DEFAULT.get(jax.default_backend())
    assert fused_backend("reference", x, weights, up) is None
    assert fused_backend(["reference", name], x, weights, up) is None
    assert fused_backend([name, "reference"], x, weights, up) == name
    assert fused_backend([name], x, wide, up) is None
    with pytest.raises(ValueError, match="implementation"):
        fused_backend([name, "nope"], x, weights, up)


@pytest.mark.parametrize(
    "change, match",
    [
        (dict(implementation="nope"), "implementation"),
        (dict(activation="tanh"), "activation must be one of"),
        (dict(weight_side="both"), "weight_side must be 'output' or 'input'"),
        (dict(up_bias_ef=jnp.zeros((3, 3))), r"up_bias_ef must be None or \[3, 5\]"),
        (dict(down_bias_ed=jnp.zeros((3, 5))), r"down_bias_ed must be None or \[3, 3\]"),
        (dict(activation="relu", gate_edf=None, gate_bias_ef=jnp.zeros((3, 5))),
         "gate_bias_ef must be None for 'relu'"),
        (dict(x=jnp.zeros((4,))), r"x must be a floating \[T, D\]"),
        (dict(x=jnp.zeros((4, 3), jnp.int32)), r"x must be a floating \[T, D\]"),
        (dict(weights=jnp.zeros((5, 2))), r"weights must be .*\[T, K\] = \[4, K\]"),
        (dict(sort_order=jnp.arange(7)), r"sort_order must be .*\[T\*K\] = \[8\]"),
        (dict(sort_order=jnp.zeros(8)), "sort_order must be an integer array"),
        (dict(group_sizes=jnp.zeros((2, 3), jnp.int32)), r"group_sizes must be .*\[E\]"),
        (dict(up_edf=jnp.zeros((2, 3, 5))), r"up_edf must be \[E, D, F\] = \[3, 3, F\]"),
        (dict(down_efd=jnp.zeros((3, 3, 5))), r"down_efd must be \[E, F, D\] = \[3, 5, 3\]"),
        (dict(gate_edf=None), r"gate_edf must be \[E, D, F\] = \[3, 3, 5\] for 'swiglu'"),
        (dict(activation="gelu"), "gate_edf must be None for 'gelu'"),
        (dict(num_valid=jnp.zeros(3, jnp.int32)), "num_valid must be an integer scalar"),
        # a user trial: both ran, 3.9 as 3 and the negative size as garbage
        (dict(num_valid=3.9), r"num_valid must be an integer scalar \(or None\); got float"),
        (dict(group_sizes=np.array([-2, 6, 4])), r"group_sizes=\[-2, 6, 4\] must be in \[0, "),
    ],
)
def test_front_door_errors(change, match):
    args = dict(x=jnp.zeros((4, 3)), sort_order=jnp.arange(8), weights=jnp.zeros((4, 2)),
                group_sizes=jnp.zeros(3, jnp.int32), gate_edf=jnp.zeros((3, 3, 5)),
                up_edf=jnp.zeros((3, 3, 5)), down_efd=jnp.zeros((3, 5, 3)),
                activation="swiglu")
    args.update(change)
    with pytest.raises(ValueError, match=match):
        moe_mlp(**args)


def test_tiles_validate_and_fit_shapes():
    with pytest.raises(ValueError, match="MoeMlpTiles.gate_up: .*block_m"):
        MoeMlpTiles(gate_up=KernelTiles(24, 64, 32, 4, 2))
    with pytest.raises(ValueError, match="MoeMlpTiles.backward"):
        MoeMlpTiles(backward=KernelTiles(16, 16, 16, 4, 2))
    tiles = MoeMlpTiles.for_shape(8 * 4096, 4096, 14336, jnp.bfloat16)
    assert tiles.gate_up.block_n == 64 and tiles.down.block_n == 128
    assert MoeMlpTiles.for_shape(40, 24, 40, jnp.float32, gated=False).gate_up.block_n == 64
    with pytest.raises(ValueError, match="GateUpTiles.block_m must be a positive multiple"):
        GateUpTiles(block_m=96)
    with pytest.raises(ValueError, match="GateUpTiles.block_k must be 64"):
        GateUpTiles(block_k=128)
    with pytest.raises(ValueError, match="MosaicMoeMlpTiles.down must be MosaicTiles"):
        MosaicMoeMlpTiles(down=GateUpTiles())
    with pytest.raises(ValueError, match="down.compute_wgs must be 1"):
        MosaicMoeMlpTiles(down=mg.MosaicTiles(compute_wgs=2))
    assert MosaicMoeMlpTiles(backward=mg.MosaicTiles(compute_wgs=2)).backward.compute_wgs == 2
    # ragged_dot's heuristic is warp-specialized where 256 divides N; the down kernel
    # takes it on one warpgroup: 4 steps of [128, 64] x [64, 128] bf16 (32 KiB each)
    # beside its [128, 128] float32 tile (64 KiB) fit in 227 KiB
    assert mg.MosaicTiles.for_shape(8192, 14336, 4096, 8).compute_wgs == 2
    down = mosaic_gpu.down_tiles(None, 8192, 14336, 4096, 8, jnp.bfloat16)
    assert (down.compute_wgs, down.block_n, down.max_concurrent_steps) == (1, 128, 4)
    assert GateUpTiles.for_shape(192).block_n == 64
    assert GateUpTiles(block_n=128).fit(192).block_n == 64
    assert GateUpTiles(block_n=128).fit(256).block_n == 128
    with pytest.raises(TypeError, match="MosaicMoeMlpTiles or None"):
        mosaic_gpu.backward_tiles(GateUpTiles())


EXPORT_CASES = {  # name -> [(dtype, activation, (T, D, F, E, K), use TILES?)]
    "triton": [(jnp.float32, "swiglu", (19, 24, 40, 5, 2), True),
               (jnp.float16, "gelu", (33, 200, 48, 4, 1), False),
               (jnp.bfloat16, "geglu", (256, 256, 512, 8, 8), False)],
    "mosaic_gpu": [(jnp.bfloat16, "swiglu", (36, 128, 192, 5, 2), True),
                   (jnp.float16, "gelu", (64, 256, 64, 8, 1), False),
                   (jnp.bfloat16, "geglu", (256, 256, 512, 8, 8), False)],
}
GPU_CALLS = {"triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "@mosaic_gpu"}
# Forward and backward kernels the lowered modules must contain: Triton names them;
# Mosaic GPU calls are counted: the forward's gate_up and down_combine; the
# gradient's module holds those 2 and the backward's 2 permutes (x, dy), up (and
# gate) gmms recomputing h, the down^T and drows gmms, the ddown and dup (and dgate)
# tgmms and the dx permute backward.
EXPORT_KERNELS = {
    "triton": (("moe_mlp_gate_up", "moe_mlp_down_combine"),
               ("ragged_dot_gmm", "ragged_dot_tgmm", "permute_gather", "inverse_order",
                "combine_gather_sum")),
}


@pytest.mark.parametrize(
    "name, case", [(n, c) for n in PALLAS for c in EXPORT_CASES[n]],
    ids=[f"{n}-{jnp.dtype(c[0])}-{c[1]}-{'x'.join(map(str, c[2]))}"
         for n in PALLAS for c in EXPORT_CASES[n]])
def test_exported_cuda_lowering(name, case):
    """The real kernels lower for CUDA: the fused forward, and the backward's grouped
    GEMMs and permute/combine kernels, all of this backend (no fallback)."""
    dtype, activation, (T, D, F, E, K), tiled = case
    tiles = TILES.get(name) if tiled else None

    def loss(x, weights, gate, up, down, order, sizes, nv):
        y = moe_mlp(x, order, weights, sizes, None if activation == "gelu" else gate, up,
                    down, activation=activation, num_valid=nv, implementation=name,
                    interpret=False, tiles=tiles)
        return jnp.sum(y * y), y

    S = jax.ShapeDtypeStruct
    avals = (S((T, D), dtype), S((T, K), jnp.float32), S((E, D, F), dtype),
             S((E, D, F), dtype), S((E, F, D), dtype), S((T * K,), jnp.int32),
             S((E,), jnp.int32), S((), jnp.int32))
    forward = jax.jit(lambda *a: loss(*a)[1])
    backward = jax.jit(jax.grad(lambda *a: loss(*a)[0], argnums=(0, 1, 2, 3, 4)))
    texts = [export_for_cuda(fn, *avals, disabled_checks=TRITON_CUDA).mlir_module()
             for fn in (forward, backward)]
    other = [GPU_CALLS[n] for n in GPU_CALLS if n != name]
    assert not any(call in text for call in other for text in texts)
    if name in EXPORT_KERNELS:
        for text, kernels in zip(texts, EXPORT_KERNELS[name]):
            for kernel in kernels:
                assert kernel in text, kernel
    else:
        gated = activation != "gelu"
        assert texts[0].count(f"custom_call {GPU_CALLS[name]}") == 2
        assert texts[1].count(f"custom_call {GPU_CALLS[name]}") == 2 + 8 + 2 * gated


def test_mosaic_down_combine_budgets_its_tile_beside_the_pipeline():
    """down_combine holds its float32 [block_m, block_n] tile in SMEM around the GEMM's
    operand pipeline, so its tiles are fitted to the sum: with block_n=256 and 4 steps
    the two need 320 KiB, over an H100's 227 KiB (this raised ValueError at lowering,
    which no backend list falls back from); the pipeline gets shallower and lowers."""
    T, K, F, D, E = 512, 2, 512, 512, 8
    wide = mg.MosaicTiles(block_m=128, block_n=256, block_k=64, max_concurrent_steps=4)
    fitted = mg.resolve_tiles(wide, T * K, F, D, E, jnp.bfloat16, jnp.float32,
                               out_tile_with_pipeline=True)
    assert fitted.block_n == 256 and fitted.max_concurrent_steps == 2
    assert fitted.smem_bytes(2, 4, tgmm=False, out_tile_with_pipeline=True) <= mgpu.SMEM_BYTES
    S = jax.ShapeDtypeStruct
    avals = (S((T * K, F), jnp.bfloat16), S((E, F, D), jnp.bfloat16), S((T * K,), jnp.int32),
             S((T, K), jnp.float32), S((), jnp.int32), S((E,), jnp.int32))
    fn = jax.jit(lambda *a: mosaic_gpu.down_combine(*a, tiles=wide, interpret=False))
    assert GPU_CALLS["mosaic_gpu"] in export_for_cuda(fn, *avals).mlir_module()


@pytest.mark.parametrize("name", PALLAS)
def test_vmap_of_value_and_grad_lowers_for_cuda(name):
    """jax.vmap over a batch of problems (per-element routing and weights) runs the
    same kernels, forward and backward: every kernel batches."""
    (T, D, F, E, K), _ = SERVED[name]
    dtype, B, S = jnp.bfloat16, 3, jax.ShapeDtypeStruct  # bf16: every backend serves it

    def loss(x, weights, gate, up, down, order, sizes):
        y = moe_mlp(x, order, weights, sizes, gate, up, down, activation="swiglu",
                    implementation=name, interpret=False)
        return jnp.sum(y * y)

    fn = jax.jit(jax.vmap(jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))))
    avals = (S((B, T, D), dtype), S((B, T, K), jnp.float32), S((B, E, D, F), dtype),
             S((B, E, D, F), dtype), S((B, E, F, D), dtype), S((B, T * K), jnp.int32),
             S((B, E), jnp.int32))
    text = export_for_cuda(fn, *avals, disabled_checks=TRITON_CUDA).mlir_module()
    assert GPU_CALLS[name] in text


LAYER_CASES = {  # name -> MoEConfig overrides (num_experts=4, d_model=24, d_ff=40)
    "dropless_top2_swiglu_shared": dict(top_k=2, num_shared_experts=1,
                                        normalize_weights=True),
    "capacity_top1_gelu": dict(top_k=1, activation="gelu", capacity_factor=0.75),
}


def layer_params(cfg: MoEConfig, seed: int) -> MoEParams:
    """Random MoEParams for ``cfg`` (router scaled so the routing is decisive)."""
    rng = np.random.default_rng(seed)
    E, D, F, Fs = cfg.num_experts, cfg.d_model, cfg.d_ff, cfg.shared_width
    gated = cfg.activation != "gelu"

    def normal(*s, scale=0.3):
        return jnp.asarray((rng.standard_normal(s) * scale).astype(np.float32))
    return MoEParams(
        router_de=normal(D, E, scale=1.0), up_edf=normal(E, D, F), down_efd=normal(E, F, D),
        gate_edf=normal(E, D, F) if gated else None,
        shared_up_df=normal(D, Fs) if Fs else None,
        shared_down_fd=normal(Fs, D) if Fs else None,
        shared_gate_df=normal(D, Fs) if Fs and gated else None)


# Mosaic GPU's layer is in tests/test_layers.py: run unfused (D = 192), traced fused.
@pytest.mark.parametrize("case", sorted(LAYER_CASES))
@pytest.mark.parametrize("name", [n for n in KERNELS if n != "mosaic_gpu"])
def test_moe_layer_matches_reference_backend(name, case, monkeypatch):
    """aristax.moe with MoEConfig(implementation=name) equals implementation=
    "reference": output, aux and gradients (x and every parameter). The dropless
    cases run the fused op, the capacity case the grouped GEMM."""
    cfg = MoEConfig(num_experts=4, d_model=24, d_ff=40, **LAYER_CASES[case])
    params = layer_params(cfg, seed=4)
    x = jnp.asarray(np.random.default_rng(5).standard_normal((19, 24)).astype(np.float32))
    calls = counting(name, monkeypatch)

    @functools.partial(jax.jit, static_argnums=2)
    def value_and_grads(x, params, implementation):
        config = cfg.replace(implementation=implementation)

        def loss(x, params):
            y, aux = moe(x, params, config)
            return jnp.sum(jnp.square(y)) + aux["loss"], (y, aux)
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)

    got, want = (value_and_grads(x, params, impl) for impl in (name, "reference"))
    assert len(calls) == (0 if cfg.capacity_factor else 1)
    for leaf, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = max(1.0, float(jnp.max(jnp.abs(ref.astype(jnp.float32)))))
        chex.assert_trees_all_close(leaf, ref, atol=1e-4 * scale, rtol=1e-4)


@pytest.mark.parametrize("op", ["moe_mlp", "ragged_dot"])
@pytest.mark.parametrize("setting, expected", [("tensorfloat32", ("HIGH", "HIGH")),
                                               ("highest", ("HIGHEST", "HIGHEST"))])
def test_triton_float32_products_follow_jax_matmul_precision(op, setting, expected):
    """The Triton GEMM kernels multiply float32 at the precision that
    ``jax.default_matmul_precision`` sets, as XLA's dots, and so the reference backend,
    do (TF32 at JAX's default on a GPU, IEEE at "highest"): the backends agree under
    any setting. The backward kernels run at the setting of the forward call, also
    when only that call is under it (as in ``Mixtral``) and the gradient is taken
    outside."""
    from cuda_export import dot_precisions

    from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api

    T, D, F, E, K = 8, 16, 32, 4, 2
    rng = np.random.default_rng(0)
    x = jnp.asarray(rng.standard_normal((T, D), np.float32))
    gate, up = (jnp.asarray(rng.standard_normal((E, D, F), np.float32)) for _ in range(2))
    down = jnp.asarray(rng.standard_normal((E, F, D), np.float32))
    sizes = jnp.asarray([5, 0, 3, 8], jnp.int32)
    order = jnp.asarray(rng.permutation(T * K), jnp.int32)
    weights = jnp.full((T, K), 0.5, jnp.float32)

    def loss(x, gate, up, down):
        with jax.default_matmul_precision(setting):
            if op == "moe_mlp":
                y = moe_mlp(x, order, weights, sizes, gate, up, down, activation="swiglu",
                            implementation="triton", interpret=True)
            else:
                y = ragged_dot_api.ragged_dot(jnp.concatenate([x, x]), up, sizes,
                                              implementation="triton", interpret=True)
        return jnp.sum(y * y)

    with jax.default_matmul_precision("bfloat16"):  # DEFAULT, unlike either setting
        found = dot_precisions(jax.grad(loss, argnums=(0, 1, 2, 3)), x, gate, up, down)
    in_kernels = {p.precision for p in found if p.in_kernel}
    assert in_kernels == {expected}, found
