"""ragged_dot: every Pallas backend against the reference, written once per backend.

Each test is parametrized over ``KERNELS``, the registered backends other than
"reference", so a backend registered later runs the same tests. On a CPU machine the
kernels run in Pallas interpret mode (``interpret=None``); the export tests lower the
real GPU kernels for CUDA on the same machine, which catches tiling and layout errors
that interpret mode forgives. ``GEOMETRY`` gives each backend shapes it serves (odd M,
K, N, not multiples of the tiles, where it allows) and small tiles; the many
group-size cases are data, not shapes, so each jitted function compiles once and the
file runs in well under a minute on 2 CPU cores.
"""

from __future__ import annotations

import functools
import types
from typing import Any, NamedTuple

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax import export

from cuda_export import export_for_cuda
from aristax import MoEConfig, MoEParams, moe
from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.ragged_dot import api
from aristax.pallas_kernels.ragged_dot.triton import TritonTiles
from aristax.pallas_kernels.ragged_dot.xla import XlaTiles

KERNELS = [name for name in api.BACKENDS if name != "reference"]
PALLAS = [name for name in KERNELS if name not in frontdoor.PLAIN_XLA]
DTYPES = [jnp.float32, jnp.bfloat16]
GPU_CALLS = ("__gpu$xla.gpu.triton", "mosaic_gpu_v2")


class Geometry(NamedTuple):
    """Shapes (M, K, N, G) and tiles for one backend's tests; block_m sets the
    "tile + 1" group-size case."""

    shape: tuple[int, int, int, int]
    tiles: Any
    block_m: int


GEOMETRY = {
    "triton": Geometry((67, 37, 45, 5), TritonTiles(
        block_m=16, block_n=32, block_k=16, num_warps=4, num_stages=2,
        tgmm_block_m=16, tgmm_block_k=32, tgmm_block_n=16), 16),
    # TMA / wgmma want K, N multiples of 64 and M of 8; the backend picks its tiles.
    "mosaic_gpu": Geometry((136, 64, 64, 5), None, 64),
    # 16-row tiles: several per group, groups that end mid-tile and aligned groups
    "xla": Geometry((67, 37, 45, 5), XlaTiles(block_m=16, align=8), 16),
}


def geometry(name: str) -> Geometry:
    return GEOMETRY.get(name, Geometry((67, 37, 45, 5), None, 16))


def tolerance(dtype) -> dict:
    """Dtype-aware tolerances; bf16 covers the backward's bf16 rounding of dout."""
    return dict(atol=3e-2, rtol=2e-2) if dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-5)


def group_cases(m: int, g: int, block_m: int) -> dict[str, np.ndarray]:
    """The hard group sizes (int32[G], sum <= M) for M rows in G groups."""
    def fill(*sizes):
        out, left = [], m
        for size in sizes[:g]:
            out.append(min(size, left))
            left -= out[-1]
        return np.array(out + [0] * (g - len(out)), np.int32)

    cases = {
        "all_empty": fill(0),
        "one_group_all": fill(*[0] * (g // 2), m),
        "last_group_all": fill(*[0] * (g - 1), m),
        "ones": fill(*[1] * g),  # sum G < M: trailing rows are zero
        "tile_plus_one": fill(*[block_m + 1] * g),
        "tile_aligned": fill(block_m, block_m, 0, 2 * block_m, 3),
        "all_whole_tiles": fill(block_m, 0, 2 * block_m, block_m),  # every group aligned
        "sum_below_m": fill(m // 20, m // 3, 0, m // 7, m // 6),
    }
    rng = np.random.default_rng(m * g)
    for i in range(2):
        cuts = np.sort(rng.integers(0, m + 1, size=g))
        cases[f"random{i}"] = np.diff(np.concatenate([[0], cuts])).astype(np.int32)
    return cases


def operands(seed: int, dtype, shape):
    """Fresh normal lhs[M, K], rhs[G, K, N], dout[M, N] from ``seed`` (NumPy's
    generator: each new shape of ``jax.random`` costs seconds of compile on CPU)."""
    m, k, n, g = shape
    rng = np.random.default_rng(seed)
    return tuple(jnp.asarray(rng.standard_normal(s, np.float32).astype(dtype))
                 for s in ((m, k), (g, k, n), (m, n)))


def refusal(name: str, dtype, shape) -> str | None:
    """The backend's reason for refusing ``dtype`` at ``shape``, or None if it serves."""
    lhs, rhs, _ = jax.eval_shape(lambda: operands(0, dtype, shape))
    try:
        api.BACKENDS[name].check(lhs, rhs, jnp.zeros(shape[3], jnp.int32), jnp.float32,
                                 interpret=jax.default_backend() == "cpu")
    except NotImplementedError as err:
        return str(err)
    return None


def skip_unless_served(name: str, dtype, shape) -> None:
    """Skip a float32 case the backend refuses (e.g. a wgmma kernel), with its reason;
    bf16 at ``GEOMETRY``'s shape must be served."""
    reason = refusal(name, dtype, shape)
    if reason is not None and dtype != jnp.bfloat16:
        pytest.skip(f"{name} refuses {jnp.dtype(dtype)}: {reason}")


@functools.cache
def front_door(name: str, out_dtype=None):
    """jit(ragged_dot) through the front door with backend ``name``."""
    return jax.jit(lambda a, b, gs: api.ragged_dot(
        a, b, gs, preferred_element_type=out_dtype, implementation=name,
        tiles=geometry(name).tiles))


@functools.cache
def vjp_fn(name: str):
    """jit((lhs, rhs, sizes, dout) -> (out, dlhs, drhs)) with float32 accumulation."""
    def f(a, b, gs, dout):
        out, pullback = jax.vjp(lambda a, b: api.ragged_dot(
            a, b, gs, preferred_element_type=jnp.float32, implementation=name,
            tiles=geometry(name).tiles), a, b)
        return (out, *pullback(dout.astype(out.dtype)))
    return jax.jit(f)


def backend_op(name: str, op: str):
    """jit of backend ``name``'s ``op`` ("tgmm", "gmm_t") with GEOMETRY's tiles and a
    float32 output (interpreted on the CPU)."""
    return jax.jit(functools.partial(getattr(api.BACKENDS[name], op), out_dtype=jnp.float32,
                                     tiles=geometry(name).tiles,
                                     interpret=jax.default_backend() == "cpu"))


def numpy_gmm(lhs, rhs, sizes) -> np.ndarray:
    """out[m] = lhs[m] @ rhs[group of m] in float64 (zeros past the sum), as float32."""
    lhs, rhs = np.asarray(lhs, np.float64), np.asarray(rhs, np.float64)
    group = np.repeat(np.arange(len(sizes)), sizes)
    out = np.zeros((lhs.shape[0], rhs.shape[2]))
    out[:len(group)] = np.einsum("mk,mkn->mn", lhs[:len(group)], rhs[group])
    return out.astype(np.float32)


def numpy_tgmm(lhs, dout, sizes) -> np.ndarray:
    """out[g] = lhs[rows of g]^T @ dout[rows of g] in float64 by a loop, as float32."""
    lhs, dout = np.asarray(lhs, np.float64), np.asarray(dout, np.float64)
    ends = np.cumsum(sizes)
    out = np.zeros((len(sizes), lhs.shape[1], dout.shape[1]))
    for g, (lo, hi) in enumerate(zip(ends - sizes, ends)):
        out[g] = lhs[lo:hi].T @ dout[lo:hi]
    return out.astype(np.float32)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", KERNELS)
def test_gmm_matches_reference(name, dtype):
    geo = geometry(name)
    skip_unless_served(name, dtype, geo.shape)
    for seed, (case, sizes) in enumerate(group_cases(*geo.shape[::3], geo.block_m).items()):
        lhs, rhs, _ = operands(seed, dtype, geo.shape)
        out = front_door(name, jnp.float32)(lhs, rhs, sizes)
        expected = front_door("reference", jnp.float32)(lhs, rhs, sizes)
        assert out.dtype == jnp.float32, case
        chex.assert_trees_all_close(out, expected, **tolerance(dtype), custom_message=case)
        np.testing.assert_array_equal(np.asarray(out[int(sizes.sum()):]), 0.0, err_msg=case)


@pytest.mark.parametrize("name", KERNELS)
def test_output_dtype_defaults_to_input(name):
    geo = geometry(name)
    lhs, rhs, _ = operands(7, jnp.bfloat16, geo.shape)
    sizes = group_cases(*geo.shape[::3], geo.block_m)["sum_below_m"]
    out = front_door(name)(lhs, rhs, sizes)
    assert out.dtype == jnp.bfloat16
    chex.assert_trees_all_close(out.astype(jnp.float32), numpy_gmm(lhs, rhs, sizes),
                                **tolerance(jnp.bfloat16))


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", KERNELS)
def test_tgmm_matches_numpy_loop(name, dtype):
    geo = geometry(name)
    skip_unless_served(name, dtype, geo.shape)
    m, k, n, g = geo.shape
    tgmm = backend_op(name, "tgmm")
    for seed, (case, sizes) in enumerate(group_cases(m, g, geo.block_m).items()):
        lhs, _, dout = operands(seed + 50, dtype, geo.shape)
        out = tgmm(lhs, dout, sizes)
        assert out.shape == (g, k, n) and out.dtype == jnp.float32, case
        chex.assert_trees_all_close(out, numpy_tgmm(lhs, dout, sizes), **tolerance(dtype),
                                    custom_message=case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", [n for n in KERNELS if hasattr(api.BACKENDS[n], "gmm_t")])
def test_gmm_t_matches_numpy(name, dtype):
    """gmm_t(dout[M, N], rhs[G, K, N]) = dout[m] @ rhs[group of m]^T (the backward's
    dlhs, rhs read transposed in place) on every hard group layout."""
    geo = geometry(name)
    skip_unless_served(name, dtype, geo.shape)
    m, k, n, g = geo.shape
    gmm_t = backend_op(name, "gmm_t")
    for seed, (case, sizes) in enumerate(group_cases(m, g, geo.block_m).items()):
        _, rhs, dout = operands(seed + 90, dtype, geo.shape)
        out = gmm_t(dout, rhs, sizes)
        assert out.shape == (m, k) and out.dtype == jnp.float32, case
        chex.assert_trees_all_close(out, numpy_gmm(dout, np.swapaxes(rhs, 1, 2), sizes),
                                    **tolerance(dtype), custom_message=case)


@pytest.mark.parametrize("dtype", DTYPES)
@pytest.mark.parametrize("name", KERNELS)
def test_vjp_matches_reference_autodiff(name, dtype):
    geo = geometry(name)
    skip_unless_served(name, dtype, geo.shape)
    cases = list(group_cases(*geo.shape[::3], geo.block_m).items())
    for seed, (case, sizes) in enumerate(cases[3:]):
        lhs, rhs, dout = operands(seed + 200, dtype, geo.shape)
        got, expected = (vjp_fn(impl)(lhs, rhs, sizes, dout) for impl in (name, "reference"))
        assert [x.dtype for x in got] == [jnp.float32, dtype, dtype], case
        chex.assert_trees_all_close(got, expected, **tolerance(dtype), custom_message=case)


@pytest.mark.parametrize("name", KERNELS)
def test_group_sizes_get_no_gradient(name):
    geo = geometry(name)
    lhs, rhs, dout = operands(9, jnp.bfloat16, geo.shape)
    sizes = group_cases(*geo.shape[::3], geo.block_m)["tile_plus_one"]

    def cotangents(a, b, gs):
        _, pullback = jax.vjp(front_door(name, jnp.float32), a, b, gs)
        return pullback(dout.astype(jnp.float32))

    assert jax.eval_shape(cotangents, lhs, rhs, sizes)[2].dtype == jax.dtypes.float0


@pytest.mark.parametrize("name", KERNELS)
@hypothesis.settings(max_examples=15, deadline=None)
@hypothesis.given(fractions=st.lists(st.floats(0, 1), min_size=2, max_size=8),
                  seed=st.integers(0, 2**16))
def test_gmm_hypothesis_group_sizes(name, fractions, seed):
    """Any sizes with sum <= M (cut points drawn as fractions of M)."""
    geo = geometry(name)
    m, g = geo.shape[0], geo.shape[3]
    cuts = sorted(int(f * m) for f in (fractions * g)[:g])
    sizes = np.diff(np.array([0] + cuts)).astype(np.int32)
    lhs, rhs, _ = operands(seed, jnp.bfloat16, geo.shape)
    chex.assert_trees_all_close(front_door(name, jnp.float32)(lhs, rhs, sizes),
                                front_door("reference", jnp.float32)(lhs, rhs, sizes),
                                **tolerance(jnp.bfloat16))


def _refusing_backend(reason: str) -> types.SimpleNamespace:
    def check(*_, **__):
        raise NotImplementedError(reason)
    return types.SimpleNamespace(check=check)


def spy_on_gmm(monkeypatch, name: str) -> list:
    """Replace backend ``name`` by a copy whose gmm records (lhs shape, tiles) of each
    call in the returned list."""
    real, calls = api.BACKENDS[name], []

    def gmm(*args, **kwargs):
        calls.append((args[0].shape, kwargs.get("tiles")))
        return real.gmm(*args, **kwargs)
    monkeypatch.setitem(api.BACKENDS, name, types.SimpleNamespace(
        check=real.check, gmm=gmm, tgmm=real.tgmm))
    return calls


@pytest.mark.parametrize("name", KERNELS)
def test_unserving_backend_falls_through(name, monkeypatch):
    monkeypatch.setitem(api.BACKENDS, "refuses", _refusing_backend("never serves"))
    calls = spy_on_gmm(monkeypatch, name)
    geo = geometry(name)
    lhs, rhs, _ = operands(11, jnp.bfloat16, geo.shape)
    sizes = group_cases(*geo.shape[::3], geo.block_m)["sum_below_m"]

    def call(implementation, tiles=geo.tiles):
        return api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                              implementation=implementation, tiles=tiles)

    jax.eval_shape(lambda: call(["refuses", name]))  # traced, not run
    jax.eval_shape(lambda: call(["refuses", name], {name: geo.tiles, "refuses": "x"}))
    assert calls == [(lhs.shape, geo.tiles)] * 2
    chex.assert_trees_all_close(call(["refuses", "reference"]), numpy_gmm(lhs, rhs, sizes),
                                atol=1e-4, rtol=1e-5)
    with pytest.raises(NotImplementedError, match="never serves"):
        call(["refuses"])


@pytest.mark.parametrize("name", KERNELS)
def test_refused_dtype_falls_to_reference(name, monkeypatch):
    """Mixed input dtypes: the kernels refuse, the reference (next in line) serves."""
    calls = spy_on_gmm(monkeypatch, name)
    shape = geometry(name).shape
    lhs, rhs, _ = operands(12, jnp.float32, shape)
    sizes = np.ones(shape[3], np.int32)
    rhs = rhs.astype(jnp.float16)
    with pytest.raises(NotImplementedError, match=name):
        api.ragged_dot(lhs, rhs, sizes, preferred_element_type=jnp.float32,
                       implementation=name)
    out = jax.eval_shape(lambda: api.ragged_dot(lhs, rhs, sizes,
                                                preferred_element_type=jnp.float32,
                                                implementation=[name, "reference"]))
    assert out.shape == (shape[0], shape[2]) and not calls


@pytest.mark.parametrize("implementation", ["nope", [], ["reference", "nope"]])
def test_invalid_implementation_raises(implementation):
    lhs, rhs, _ = operands(13, jnp.float32, (8, 4, 4, 2))
    with pytest.raises(ValueError, match="implementation"):
        api.ragged_dot(lhs, rhs, np.zeros(2, np.int32), implementation=implementation)


@pytest.mark.parametrize("lhs_shape, rhs_shape, sizes, words", [
    ((13, 8), (2, 8), np.zeros(2, np.int32), r"rhs must be \[G, K, N\]"),
    ((13, 8, 1), (2, 8, 4), np.zeros(2, np.int32), r"lhs must be \[M, K\]"),
    ((13, 6), (2, 8, 4), np.zeros(2, np.int32), "disagree on K"),
    ((13, 8), (2, 8, 4), np.zeros(3, np.int32), r"group_sizes must be .* \[G\]=\(2,\)"),
    ((13, 8), (2, 8, 4), np.zeros(2, np.float32), "group_sizes must be an integer array"),
    # a user trial: all zeros came back, with no error
    ((13, 8), (2, 8, 4), np.array([-2, 5], np.int32),
     r"group_sizes=\[-2, 5\] must be in \[0, 2\*\*31 - 1\]"),
    # a user trial: int64 sizes beyond int32 wrapped to [2, 2] silently
    ((13, 8), (2, 8, 4), np.array([2**32 + 2, 2], np.int64), r"group_sizes=\[4294967298, 2\]"),
])
def test_bad_operands_name_the_argument(lhs_shape, rhs_shape, sizes, words):
    with pytest.raises(ValueError, match=words):
        api.ragged_dot(jnp.ones(lhs_shape), jnp.ones(rhs_shape), sizes)


def test_group_sizes_may_be_a_list():
    """A list is an array of sizes, as for jax.lax.ragged_dot's callers (it raised
    AttributeError: 'list' object has no attribute 'shape')."""
    lhs, rhs, _ = operands(13, jnp.float32, (8, 4, 4, 2))
    got = api.ragged_dot(lhs, rhs, [3, 4], implementation="xla")
    np.testing.assert_allclose(got, jax.lax.ragged_dot(lhs, rhs, jnp.array([3, 4])),
                               rtol=1e-5, atol=1e-5)


def test_a_backend_reason_names_the_backend_once():
    lhs, rhs, _ = operands(13, jnp.float32, (8, 4, 4, 2))
    with pytest.raises(NotImplementedError) as err:
        api.ragged_dot(lhs, rhs.astype(jnp.bfloat16), np.array([3, 4]),
                       preferred_element_type=jnp.float32, implementation="xla")
    assert "(xla: lhs float32 and rhs bfloat16 differ)" in str(err.value), err.value


def test_triton_tiles_validate_and_fit_shapes():
    with pytest.raises(ValueError, match="block_m"):
        TritonTiles(block_m=24)
    with pytest.raises(ValueError, match="tgmm_block_k"):
        TritonTiles(tgmm_block_k=8)
    tiles = TritonTiles.for_shape(5, 4096, 14336, jnp.bfloat16)
    assert (tiles.block_m, tiles.block_n, tiles.block_k) == (16, 128, 64)


EXPORT_CASES = {  # backend -> [(dtype, (M, K, N, G), use GEOMETRY's tiles?)]
    "triton": [
        (jnp.bfloat16, (70, 40, 48, 5), True),
        (jnp.bfloat16, (256, 128, 96, 8), False),
        (jnp.float32, (33, 17, 200, 3), False),
        (jnp.float32, (256, 128, 96, 8), True),
        (jnp.float16, (70, 40, 48, 5), False),
    ],
}
DEFAULT_EXPORT_CASES = [(jnp.bfloat16, (256, 128, 192, 8), False),
                        (jnp.float16, (512, 256, 128, 4), False)]


def _count_gpu_kernels(exported) -> int:
    text = exported.mlir_module()
    return sum(text.count(f'@"{call}"') + text.count(f"@{call}(") for call in GPU_CALLS)


@pytest.mark.parametrize("name, case", [(name, case) for name in PALLAS
                                        for case in EXPORT_CASES.get(name, DEFAULT_EXPORT_CASES)],
                         ids=lambda v: v if isinstance(v, str)
                         else f"{jnp.dtype(v[0])}-{'x'.join(map(str, v[1]))}-{v[2]}")
def test_exported_cuda_lowering(name, case):
    """The real kernels lower for CUDA: the forward and both backward GEMMs, with no
    transposed copy of rhs."""
    dtype, (m, k, n, g), tiled = case
    tiles = geometry(name).tiles if tiled else None

    def forward(a, b, gs):
        return api.ragged_dot(a, b, gs, preferred_element_type=jnp.float32,
                              implementation=name, interpret=False, tiles=tiles)

    def backward(a, b, gs):
        out, pullback = jax.vjp(lambda a, b: forward(a, b, gs), a, b)
        return pullback(out)

    avals = (jax.ShapeDtypeStruct((m, k), dtype), jax.ShapeDtypeStruct((g, k, n), dtype),
             jax.ShapeDtypeStruct((g,), jnp.int32))
    disabled = [export.DisabledSafetyCheck.custom_call(GPU_CALLS[0])]
    for fn, kernels in ((forward, 1), (backward, 3)):
        exported = export_for_cuda(jax.jit(fn), *avals, disabled_checks=disabled)
        assert _count_gpu_kernels(exported) >= kernels, fn.__name__
    # dlhs reads rhs transposed in place (gmm_t): no transposed copy of the weights
    assert "stablehlo.transpose" not in exported.mlir_module()


def _expert_weights(e: int, d: int, f: int, seed: int = 21) -> dict[str, jax.Array]:
    """Router [D, E] and SwiGLU expert weights gate, up [E, D, F], down [E, F, D]."""
    rng = np.random.default_rng(seed)
    shapes = dict(router_de=(d, e), gate_edf=(e, d, f), up_edf=(e, d, f), down_efd=(e, f, d))
    scale = dict(router_de=1.0, gate_edf=0.3, up_edf=0.3, down_efd=0.3)
    return {key: jnp.asarray(rng.standard_normal(s, np.float32) * scale[key])
            for key, s in shapes.items()}


@pytest.mark.parametrize("name", KERNELS)
def test_moe_layer_matches_reference_backend(name, monkeypatch):
    """aristax.moe with MoEConfig(implementation=name): the loss, the output and the
    gradients (tokens and every parameter) equal those with "reference". The layer
    uses a capacity (factor 1), whose experts always run ragged_dot; the
    dropless path may run the fused moe_mlp instead (tests/pallas_kernels/test_moe_mlp.py)."""
    m, d, f, _ = geometry(name).shape
    dtype = jnp.float32 if refusal(name, jnp.float32, (m, d, f, 4)) is None else jnp.bfloat16
    params = MoEParams(**_expert_weights(4, d, f))
    x = jnp.asarray(np.random.default_rng(22).standard_normal((m // 2, d), np.float32)
                    .astype(dtype))

    @functools.partial(jax.jit, static_argnums=2)
    def value_and_grads(x, params, implementation):
        cfg = MoEConfig(num_experts=4, top_k=2, d_model=d, d_ff=f, capacity_factor=1.0,
                        implementation=implementation)

        def loss(x, params):
            y, _ = moe(x, params, cfg)
            return jnp.sum(jnp.square(y.astype(jnp.float32))), y
        return jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)(x, params)

    calls = spy_on_gmm(monkeypatch, name)
    got, expected = (value_and_grads(x, params, impl) for impl in (name, "reference"))
    assert len(calls) >= 6  # gate, up, down forward; their dlhs in the backward
    for leaf, want in zip(jax.tree.leaves(got), jax.tree.leaves(expected)):
        # A whole layer in bf16 (grads through gate * up): atol relative to the leaf.
        scale = max(1.0, float(jnp.max(jnp.abs(want.astype(jnp.float32)))))
        tol = tolerance(dtype) if dtype == jnp.bfloat16 else dict(atol=1e-4, rtol=1e-4)
        chex.assert_trees_all_close(leaf, want, atol=tol["atol"] * scale, rtol=tol["rtol"])


@pytest.mark.cpu_backend
def test_reference_serves_inputs_typed_on_an_explicit_mesh():
    """jax 0.10's ragged_dot has no Explicit-sharding rule; the reference must still
    serve (forward and gradients) inside ``jax.set_mesh`` with row-sharded lhs."""
    from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

    mesh = jax.make_mesh((8,), ("data",), axis_types=(AxisType.Explicit,))
    rng = np.random.default_rng(7)
    lhs_np = rng.standard_normal((64, 16)).astype(np.float32)
    rhs_np = rng.standard_normal((4, 16, 8)).astype(np.float32)
    sizes_np = np.array([10, 30, 0, 20], np.int32)  # rows 60.. belong to no group
    out_np, dlhs_np, drhs_np = np.zeros((64, 8)), np.zeros((64, 16)), np.zeros((4, 16, 8))
    for g, (a, n) in enumerate(zip(np.cumsum(sizes_np) - sizes_np, sizes_np)):
        out_np[a:a + n] = lhs_np[a:a + n] @ rhs_np[g]
        dlhs_np[a:a + n] = 2 * out_np[a:a + n] @ rhs_np[g].T  # d sum(out**2)
        drhs_np[g] = lhs_np[a:a + n].T @ (2 * out_np[a:a + n])
    with jax.set_mesh(mesh):
        lhs = jax.device_put(lhs_np, NamedSharding(mesh, P("data", None)))
        rhs, sizes = jnp.asarray(rhs_np), jnp.asarray(sizes_np)

        def loss(lhs, rhs):
            return jnp.sum(api.ragged_dot(lhs, rhs, sizes, implementation="reference") ** 2)

        out = jax.jit(lambda a, b: api.ragged_dot(a, b, sizes))(lhs, rhs)
        dlhs, drhs = jax.jit(jax.grad(loss, argnums=(0, 1)))(lhs, rhs)
    for got, want in ((out, out_np), (dlhs, dlhs_np), (drhs, drhs_np)):
        np.testing.assert_allclose(np.asarray(got), want, rtol=1e-4, atol=1e-4)
