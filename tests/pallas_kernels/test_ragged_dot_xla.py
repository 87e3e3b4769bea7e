"""The plain-XLA grouped GEMM ("xla", the CPU default) beyond the tests every backend
runs (test_ragged_dot.py): both of its loops, every dtype, the inputs where it must
differ from XLA:CPU's lax.ragged_dot, its memory, and the aligned layout the MoE layer
gives it (dispatch.align_groups)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_reference as ref
from aristax import MoEConfig, routing as routing_lib
from aristax import dispatch as dispatch_lib
from aristax.pallas_kernels.ragged_dot import api, xla


def value_and_grads(lhs, rhs, sizes, dout, tiles):
    out, vjp = jax.vjp(lambda a, b: api.ragged_dot(
        a, b, jnp.asarray(sizes), preferred_element_type=jnp.float32, implementation="xla",
        tiles=tiles), lhs, rhs)
    return (out, *vjp(dout))


def operands(seed, m, k, n, g, dtype=np.float32):
    rng = np.random.default_rng(seed)
    return (rng.standard_normal((m, k)).astype(dtype), rng.standard_normal((g, k, n)).astype(dtype),
            rng.standard_normal((m, n)).astype(np.float32))


# whole 8-row multiples: full 16-row tiles and 8-row remainders, empty groups, sums < M
ALIGNED_SIZES = [[24, 0, 32, 8], [0, 0, 64, 0], [8, 16, 0, 0], [0, 0, 0, 0], [40, 0, 0, 24]]
TILES = xla.XlaTiles(block_m=16, align=8)


@pytest.mark.parametrize("sizes", ALIGNED_SIZES)
@pytest.mark.parametrize("loop", ["aligned", "masked"])
def test_both_loops_equal_numpy_on_whole_tiles(sizes, loop, monkeypatch):
    """Groups in whole 8-row multiples and M = 64: the run-time choice takes the aligned
    loops (16-row tiles, then 8-row remainders); forcing either path gives the same,
    right, values and gradients (sums below M leave zero rows; empty groups get zero
    gradients)."""
    monkeypatch.setattr(xla, "SMALL_PRODUCT", 0)  # compile the run-time choice here too
    monkeypatch.setattr(xla, "_aligned", lambda *a: jnp.asarray(loop == "aligned"))
    lhs, rhs, dout = operands(sum(sizes), 64, 24, 40, 4)
    got = jax.jit(value_and_grads, static_argnums=4)(lhs, rhs, np.array(sizes, np.int32), dout,
                                                      TILES)
    for g, w in zip(got, ref.ragged_dot_with_grads(lhs, rhs, np.array(sizes), dout)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


def test_whole_multiples_pick_the_aligned_loops():
    assert bool(xla._aligned(jnp.array([24, 0, 32, 8]), 64, 8))
    assert not bool(xla._aligned(jnp.array([24, 0, 31, 8]), 64, 8))
    # clipped to M = 64, the third group keeps 32 rows: still whole multiples
    assert bool(xla._aligned(jnp.array([16, 16, 48, 0]), 64, 8))


@pytest.mark.parametrize("sizes", [[5, 0, 70, 9], [200, 0, 0, 0], [0, 3, 0, 1]])
def test_sizes_past_m_are_clipped_as_the_reference(sizes):
    """sum(group_sizes) > M: the last groups lose the rows past M, as lax.ragged_dot."""
    lhs, rhs, dout = operands(1, 67, 9, 11, 4)
    sizes = np.array(sizes, np.int32)
    got = value_and_grads(lhs, rhs, sizes, dout, TILES)
    want = ref.ragged_dot_with_grads(lhs, rhs, sizes, dout)
    for g, w in zip(got, want):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("dtype", [jnp.float16, jnp.bfloat16, jnp.int32, jnp.int8])
def test_every_dtype_of_the_reference(dtype):
    """Forward in float16, bfloat16 and integers (products accumulated in float32, or in
    the integer output type) equals lax.ragged_dot."""
    rng = np.random.default_rng(3)
    lhs = jnp.asarray(rng.integers(-4, 5, (37, 8)), dtype)
    rhs = jnp.asarray(rng.integers(-4, 5, (3, 8, 6)), dtype)
    sizes = jnp.array([10, 0, 20], jnp.int32)
    out_dtype = jnp.int32 if jnp.issubdtype(dtype, jnp.integer) else jnp.float32
    got = api.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_dtype,
                         implementation="xla", tiles=xla.XlaTiles(block_m=8, align=8))
    want = jax.lax.ragged_dot(lhs, rhs, sizes, preferred_element_type=out_dtype)
    assert got.dtype == want.dtype
    np.testing.assert_array_equal(got, want)


def test_float64_values_and_gradients():
    with jax.enable_x64(True):
        lhs, rhs, dout = operands(5, 50, 7, 9, 3, np.float64)
        sizes = np.array([20, 0, 25], np.int32)
        out, vjp = jax.vjp(lambda a, b: api.ragged_dot(a, b, jnp.asarray(sizes),
                                                       implementation="xla"), lhs, rhs)
        got = (out, *vjp(jnp.asarray(dout, jnp.float64)))
        assert all(g.dtype == jnp.float64 for g in got)
        for g, w in zip(got, ref.ragged_dot_with_grads(lhs, rhs, sizes, dout)):
            np.testing.assert_allclose(g, w, rtol=1e-12, atol=1e-12)


def test_an_inf_in_an_empty_groups_weights_reaches_no_row():
    """Each row reads its own group's weights only (lax.ragged_dot on XLA:CPU multiplies
    every row by every group's and masks, so 0 * inf makes every row NaN)."""
    lhs, rhs, dout = operands(2, 40, 6, 5, 3)
    rhs[1, 0, 0] = np.inf
    sizes = np.array([15, 0, 25], np.int32)
    got = value_and_grads(lhs, rhs, sizes, dout, xla.XlaTiles(block_m=8, align=8))
    for g, w in zip(got, ref.ragged_dot_with_grads(lhs, np.where(np.isinf(rhs), 0, rhs), sizes, dout)):
        np.testing.assert_allclose(g, w, rtol=1e-5, atol=1e-4)


@pytest.mark.parametrize("rows", [48, 4096])
def test_second_derivative_equals_lax_or_names_the_fix(rows):
    """grad of grad (w.r.t. lhs, of a loss of lhs's gradient) equals lax.ragged_dot's
    where the loops' trip counts are static (48 rows: the masked loop alone); at 4096
    rows x 32 x 32 (the aligned loops, counts traced) it raises a NotImplementedError
    naming implementation='reference', not JAX's while_loop error (a user trial)."""
    lhs, rhs, _ = operands(4, rows, 32, 32, 4, np.float64)
    sizes = jnp.asarray([rows // 4, 0, rows // 2, rows // 8], jnp.int32)

    def grad_of_grad(dot):
        def lhs_grad_norm(a):
            return jnp.sum(jax.grad(lambda a: jnp.sum(dot(a) ** 2))(a) ** 2)
        return jax.grad(lhs_grad_norm)(jnp.asarray(lhs))

    def ours(a):
        return api.ragged_dot(a, jnp.asarray(rhs), sizes, implementation="xla")

    with jax.enable_x64(True):
        if rows > 48:
            with pytest.raises(NotImplementedError,
                               match="ragged_dot: backend 'xla'.*implementation='reference'"):
                grad_of_grad(ours)
            return
        want = grad_of_grad(lambda a: jax.lax.ragged_dot(a, jnp.asarray(rhs), sizes))
        got = grad_of_grad(ours)
    np.testing.assert_allclose(got, want, rtol=1e-10, atol=1e-9)
    assert np.abs(np.asarray(want)).max() > 1


def test_empty_operands():
    for m, k, n, g in [(0, 4, 5, 3), (6, 0, 5, 3), (6, 4, 0, 3)]:
        lhs, rhs = jnp.ones((m, k)), jnp.ones((g, k, n))
        sizes = jnp.array([m, 0, 0], jnp.int32)
        out, vjp = jax.vjp(lambda a, b: api.ragged_dot(a, b, sizes, implementation="xla"),
                           lhs, rhs)
        dlhs, drhs = vjp(jnp.ones((m, n)))
        assert out.shape == (m, n) and not np.any(out)
        assert dlhs.shape == (m, k) and drhs.shape == (g, k, n) and not np.any(drhs)


def test_temporary_memory_does_not_grow_with_groups_times_rows():
    """At G = 64 the loop's temporaries are a few [M, N]-sized buffers; lax.ragged_dot's
    XLA:CPU lowering masks lhs into [G, M, K]."""
    m, k, n, g = 2048, 128, 128, 64

    def temp_bytes(implementation):
        def f(lhs, rhs, sizes, dout):
            out, vjp = jax.vjp(lambda a, b: api.ragged_dot(
                a, b, sizes, implementation=implementation), lhs, rhs)
            return out, vjp(dout)
        shapes = (jax.ShapeDtypeStruct((m, k), jnp.float32),
                  jax.ShapeDtypeStruct((g, k, n), jnp.float32),
                  jax.ShapeDtypeStruct((g,), jnp.int32), jax.ShapeDtypeStruct((m, n), jnp.float32))
        return jax.jit(f).lower(*shapes).compile().memory_analysis().temp_size_in_bytes

    bound = 8 * m * (k + n) * 4  # a few [M, K] and [M, N] float32 buffers, no G
    assert temp_bytes("xla") <= bound
    if jax.default_backend() == "cpu":
        assert temp_bytes("reference") > g * m * k * 4 / 2  # what the bound excludes


def test_tiles_validate_and_follow_the_mean_group():
    with pytest.raises(ValueError, match="block_m"):
        xla.XlaTiles(block_m=48)
    with pytest.raises(ValueError, match="align"):
        xla.XlaTiles(block_m=16, align=32)
    with pytest.raises(TypeError, match="XlaTiles"):
        api.ragged_dot(jnp.ones((8, 4)), jnp.ones((2, 4, 4)), jnp.array([4, 4]),
                       implementation="xla", tiles=object())
    assert xla.XlaTiles.for_shape(8192, 8) == xla.XlaTiles(block_m=512, align=64)
    assert xla.XlaTiles.for_shape(32768, 64) == xla.XlaTiles(block_m=512, align=64)
    assert xla.XlaTiles.for_shape(8192, 64) == xla.XlaTiles(block_m=128, align=32)
    assert xla.XlaTiles.for_shape(100, 64) == xla.XlaTiles(block_m=64, align=32)


def test_row_alignment_is_the_serving_backends_tile():
    if jax.default_backend() == "cpu":
        assert api.row_alignment(8192, 8, jnp.float32) == 64
    assert api.row_alignment(8192, 8, jnp.float32, "reference") == 1
    assert api.row_alignment(8192, 64, jnp.float32, "xla") == 32


def test_the_layers_padded_rows_keep_the_tiles_it_was_aligned_for():
    """Padding adds rows, and the backend picks its tiles from the padded count: the
    multiple ``row_alignment`` gives is one the backend's align divides, for any count
    the padding can reach (else every call would take the masked loop)."""
    for m in list(range(64, 9000, 37)) + [7680, 7936, 8192, 15872, 16384, 32768]:
        for g in (1, 4, 8, 31, 64, 128):
            multiple = api.row_alignment(m, g, jnp.float32, "xla")
            padded = -(-(m + g * (multiple - 1)) // multiple) * multiple
            for rows in (m, padded):
                assert multiple % xla.XlaTiles.for_shape(rows, g).align == 0, (m, g, rows)


@pytest.mark.parametrize("multiple", [1, 4, 16])
def test_aligned_dispatch_is_the_same_layer(multiple):
    """align_groups moves each expert's rows to a multiple of ``multiple`` and pads its
    group: permute -> per-expert map -> combine gives the same y and gradients, every
    group is whole multiples, and the padding rows are zero and never read."""
    T, K, E, D = 37, 3, 5, 6
    rng = np.random.default_rng(multiple)
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=4)
    logits = jnp.asarray(rng.standard_normal((T, E)), jnp.float32).at[4].set(jnp.nan)
    routing = routing_lib.route(logits, cfg.router_config)
    plain = dispatch_lib.dropless_dispatch(routing)
    aligned = dispatch_lib.align_groups(plain, multiple)
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    scale = jnp.asarray(rng.standard_normal((E, D)), jnp.float32)

    def layer(x, weights, dispatch):
        rows = dispatch_lib.permute(x, dispatch)
        expert = jnp.repeat(jnp.arange(E), dispatch.group_sizes,
                            total_repeat_length=rows.shape[0])
        return dispatch_lib.combine(jnp.tanh(rows * scale[expert]), dispatch, weights)

    def loss(x, weights, dispatch):
        return jnp.sum(layer(x, weights, dispatch) ** 2)

    want = jax.value_and_grad(loss, argnums=(0, 1))(x, routing.weights, plain)
    got = jax.value_and_grad(loss, argnums=(0, 1))(x, routing.weights, aligned)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6), got, want)
    sizes = np.asarray(aligned.group_sizes)
    assert np.all(sizes % multiple == 0)
    assert np.all(sizes - np.asarray(plain.group_sizes) < multiple)
    rows = np.asarray(dispatch_lib.permute(x, aligned))
    assert not np.any(rows[~np.asarray(aligned.row_valid)])
    assert aligned.sort_order.shape[0] % multiple == 0


@pytest.mark.cpu_backend  # elsewhere the default grouped GEMM is not "xla": no alignment
@pytest.mark.parametrize("load", ["uniform", "one_expert"])
def test_layer_on_aligned_tiles_equals_the_reference(load, monkeypatch):
    """The MoE layer on the CPU default (rows aligned to the backend's tiles, the
    unmasked loops; forced at this small size) equals it on lax.ragged_dot: output, aux
    loss and every gradient, with empty experts, and with one expert taking all. In
    float64, where the two differ only by rounding (float32 gradients of a few hundred
    differ by ~1e-3 from float64 on either path)."""
    from aristax import MoEParams, moe

    monkeypatch.setattr(xla, "SMALL_PRODUCT", 0)
    monkeypatch.setattr(xla.XlaTiles, "for_shape",
                        classmethod(lambda cls, m, g: cls(block_m=16, align=8)))
    T, D, F, E, K = 45, 12, 20, 6, 2
    rng = np.random.default_rng(11)
    arrays = [rng.standard_normal(s) * 0.5 for s in ((D, E), (E, D, F), (E, F, D), (E, D, F))]
    x = rng.standard_normal((T, D))
    if load == "one_expert":  # a huge router column: every token's first choice is 3
        arrays[0][:, 3], x = 50.0, np.abs(x)

    def value_and_grads(implementation):
        cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, normalize_weights=True,
                        implementation=implementation)

        def loss(p, x):
            y, aux = moe(x, p, cfg)
            return jnp.sum(y * jnp.cos(y)) + aux["loss"], y
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(params, x)

    assert api.row_alignment(T * K, E, jnp.float64) == 8
    with jax.enable_x64(True):
        params = MoEParams(*(jnp.asarray(a, jnp.float64) for a in arrays))
        x = jnp.asarray(x, jnp.float64)
        got, want = value_and_grads(None), value_and_grads("reference")
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-10, atol=1e-10),
                 got, want)
