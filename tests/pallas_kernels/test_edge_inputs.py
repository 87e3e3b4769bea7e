"""Kernel inputs at the edges, on every op: JAX's 64-bit mode with float32 operands,
a -inf router bias, and empty operands (the Pallas backends decline them, so a list
ending in "reference" falls back). Triton runs interpreted; Mosaic GPU is lowered."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import TRITON_CUDA, export_for_cuda
from aristax.pallas_kernels import combine, moe_mlp, permute, ragged_dot, route

MOSAIC_CUDA = TRITON_CUDA + [jax.export.DisabledSafetyCheck.custom_call("mosaic_gpu_v2")]


def _ops(implementation, dtype=jnp.float32):
    """{name: (fn, args)}: each op's forward and gradient on small odd shapes."""
    rng = np.random.default_rng(0)
    T, D, E, K, F = 6, 16, 4, 2, 16

    def arr(*shape, scale=1.0):
        return jnp.asarray(rng.standard_normal(shape) * scale, dtype)

    x, w = arr(T, D), arr(D, E)
    r = route(x, w, top_k=K)
    gs = jnp.asarray([5, 0, 3], jnp.int32)
    lhs, rhs = arr(9, D), arr(3, D, F)
    gate, up, down = arr(E, D, F, scale=0.2), arr(E, D, F, scale=0.2), arr(E, F, D, scale=0.2)
    impl = dict(implementation=implementation)

    def mlp(x, weights):
        return moe_mlp(x, r.sort_order, weights, r.counts, gate, up, down,
                       activation="swiglu", **impl)

    return {
        "ragged_dot": (lambda a, b: ragged_dot(a, b, gs, **impl), (lhs, rhs)),
        "route": (lambda x: route(x, w, top_k=K, **impl).weights, (x,)),
        "permute": (lambda x: permute(x, r.sort_order, top_k=K, **impl), (x,)),
        "combine": (lambda rows, wt: combine(rows, r.sort_order, wt, **impl),
                    (arr(T * K, D), r.weights)),
        "moe_mlp": (mlp, (x, r.weights)),
    }


def _value_and_grads(fn, args):
    out = fn(*args)
    grads = jax.grad(lambda *a: jnp.sum(fn(*a) ** 2), argnums=tuple(range(len(args))))(*args)
    return out, grads


@pytest.mark.parametrize("op", ["ragged_dot", "route", "permute", "combine", "moe_mlp"])
def test_triton_runs_float32_under_x64_like_without(op):
    """Python ints in the kernels became int64 under jax_enable_x64 and crashed
    (lax.div of int32 by int64, an int64 store into an int32 ref), with an error the
    front door does not fall back on."""
    fn, args = _ops("triton")[op]
    expected = _value_and_grads(fn, args)
    with jax.enable_x64(True):
        got = _value_and_grads(*_ops("triton")[op])
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-6, atol=1e-6),
                 got, expected)


def test_mosaic_gpu_lowers_under_x64():
    """emit_pipeline's min(Python int, traced steps) met an int32 step count."""
    S = jax.ShapeDtypeStruct
    bf16 = jnp.bfloat16

    def grouped(a, b, g):
        y, vjp = jax.vjp(lambda a, b: ragged_dot(a, b, g, preferred_element_type=jnp.float32,
                                                 implementation="mosaic_gpu", interpret=False),
                         a, b)
        return y, vjp(y)

    with jax.enable_x64(True):
        text = export_for_cuda(jax.jit(grouped), S((136, 64), bf16), S((5, 64, 128), bf16),
                               S((5,), jnp.int32), disabled_checks=MOSAIC_CUDA).mlir_module()
    assert "mosaic_gpu" in text


@pytest.mark.parametrize("backend", ["reference", "triton"])
def test_minus_inf_bias_still_picks_distinct_experts(backend):
    """Experts 1 and 2 barred by a -inf bias, top_k = 3: the third pick is one of them
    (the lowest index, as lax.top_k), not expert 0 again (Triton picked it twice and
    left sort_order rows unwritten)."""
    rng = np.random.default_rng(1)
    x = jnp.asarray(rng.standard_normal((5, 8)), jnp.float32)
    w = jnp.asarray(rng.standard_normal((8, 4)), jnp.float32)
    bias = jnp.asarray([0.0, -jnp.inf, -jnp.inf, 0.0], jnp.float32)
    out = route(x, w, top_k=3, bias=bias, implementation=backend)
    ids = np.asarray(out.expert_ids)
    assert all(sorted(row) == [0, 1, 3] for row in ids), ids
    np.testing.assert_array_equal(out.counts, [5, 5, 0, 5])
    np.testing.assert_array_equal(np.sort(out.sort_order), np.arange(15))


@pytest.mark.parametrize("op", ["route", "permute", "combine"])
def test_empty_operands_fall_back_to_the_reference(op):
    """T = 0 tokens: Triton declines (it failed with a slice error, so the list never
    reached "reference"), and the reference answers with the right empty shapes."""
    T, D, K = 0, 8, 2
    x, order = jnp.zeros((T, D)), jnp.zeros((T * K,), jnp.int32)
    call = {"route": lambda i: route(x, jnp.ones((D, 4)), top_k=K, implementation=i).weights,
            "permute": lambda i: permute(x, order, top_k=K, implementation=i),
            "combine": lambda i: combine(jnp.zeros((T * K, D)), order, jnp.zeros((T, K)),
                                         implementation=i)}[op]
    with pytest.raises(NotImplementedError, match="empty"):
        call("triton")
    expected_shape = {"route": (0, K), "permute": (0, D), "combine": (0, D)}[op]
    assert call(["triton", "reference"]).shape == expected_shape
    assert call("reference").shape == expected_shape


def test_mosaic_moe_mlp_declines_zero_tokens():
    """Its check took T * K = 0 as a multiple of 8, then failed on log2(0)."""
    E, D, F = 4, 128, 64
    z = jnp.zeros

    def call(implementation):
        return moe_mlp(z((0, D), jnp.bfloat16), z((0,), jnp.int32), z((0, 2), jnp.bfloat16),
                       z((E,), jnp.int32), z((E, D, F), jnp.bfloat16),
                       z((E, D, F), jnp.bfloat16), z((E, F, D), jnp.bfloat16),
                       activation="swiglu", implementation=implementation)

    with pytest.raises(NotImplementedError, match="empty operand"):
        call("mosaic_gpu")
    assert call(["mosaic_gpu", "reference"]).shape == (0, D)


def test_counts_are_integers_not_bools():
    """NumPy integers serve as top_k (they were refused); True and a float num_valid
    (silently truncated) are refused."""
    x, w = jnp.ones((3, 4)), jnp.ones((4, 4))
    order = jnp.arange(6, dtype=jnp.int32)
    assert route(x, w, top_k=np.int64(2)).expert_ids.shape == (3, 2)
    assert permute(x, order, top_k=np.int32(2)).shape == (6, 4)
    with pytest.raises(ValueError, match="route: top_k must be an int"):
        route(x, w, top_k=True)
    with pytest.raises(ValueError, match="permute: top_k must be a positive int"):
        permute(x, order, top_k=True)
    with pytest.raises(ValueError, match="combine: num_valid must be an integer scalar"):
        combine(jnp.ones((6, 4)), order, jnp.ones((3, 2)), num_valid=3.7)
