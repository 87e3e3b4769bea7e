"""One registry shape and one backend protocol for every kernel op (``frontdoor``)."""

from __future__ import annotations

import types

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels.moe_mlp import api as moe_mlp_api
from aristax.pallas_kernels.permute import api as permute_api
from aristax.pallas_kernels.permute import reference as permute_ref
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.route import api as route_api

# Each op's api module and the functions its backend modules provide besides ``check``.
OPS = {
    "ragged_dot": (ragged_dot_api, ("gmm", "tgmm")),
    "route": (route_api, ("route",)),
    "permute": (permute_api, ("permute", "permute_bwd", "combine", "combine_bwd")),
    "moe_mlp": (moe_mlp_api, ("moe_mlp",)),
}


@pytest.mark.parametrize("op", sorted(OPS))
def test_every_op_has_one_registry_shape(op):
    api, functions = OPS[op]
    assert isinstance(api.BACKENDS, dict) and "reference" in api.BACKENDS
    for name, module in api.BACKENDS.items():
        assert isinstance(module, types.ModuleType), (op, name)
        assert module.__name__.endswith(f"{op}.{name}"), (op, name, module.__name__)
        for fn in ("check", *functions):
            assert callable(getattr(module, fn, None)), (op, name, fn)
    for platform, names in api.DEFAULT_ORDER.items():
        assert set(names) <= set(api.BACKENDS), (op, platform, names)
        assert names[-1] == "reference", (op, platform, names)


def _backend(reason=None):
    def check(*args, interpret):
        if reason:
            raise NotImplementedError(reason)
    return types.SimpleNamespace(check=check)


def test_choose_takes_the_first_that_serves_and_reports_every_reason():
    backends = {"a": _backend("no a"), "b": _backend(), "c": _backend("no c")}
    assert frontdoor.choose("op", backends, ["a", "b", "c"], 1, interpret=False) == "b"
    with pytest.raises(NotImplementedError, match="op: no backend.*a: no a; c: no c"):
        frontdoor.choose("op", backends, ["a", "c"], 1, interpret=False)


def test_mosaic_interpret_mode_without_an_interpreter_falls_back(monkeypatch):
    """A JAX without Mosaic GPU's interpreter: ``check`` refuses interpret mode, so the
    layer's lenient list falls back to the reference instead of raising at the call."""
    monkeypatch.setattr(mgpu, "_gpu_callbacks", None)
    rng = np.random.default_rng(0)
    T, K, D = 8, 2, 128
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.bfloat16)
    order = jnp.asarray(rng.permutation(T * K), jnp.int32)
    with pytest.raises(NotImplementedError, match="interpret mode needs"):
        permute_api.permute(x, order, top_k=K, implementation="mosaic_gpu", interpret=True)
    rows = permute_api.permute(x, order, top_k=K, implementation=["mosaic_gpu", "reference"],
                               interpret=True)
    np.testing.assert_array_equal(rows, permute_ref.permute(x, order, top_k=K))


def test_backward_runs_on_the_reference_where_the_backend_refuses_the_cotangent(
        monkeypatch):
    """combine's forward served by a backend whose ``check`` refuses float32 [., D]
    operands: its backward (dy is float32) must run on the reference, not raise."""
    def check(op, top_k, *arrays, interpret):
        if any(a.dtype != jnp.bfloat16 for a in arrays[:2]):  # rows, and dy backward
            raise NotImplementedError("bf16 only")

    fake = types.SimpleNamespace(check=check, combine=permute_ref.combine, combine_bwd=None)
    monkeypatch.setitem(permute_api.BACKENDS, "fake", fake)
    rng = np.random.default_rng(1)
    T, K, D = 6, 2, 16
    rows = jnp.asarray(rng.standard_normal((T * K, D)), jnp.bfloat16)
    weights = jnp.asarray(rng.random((T, K)), jnp.bfloat16)
    order = jnp.asarray(rng.permutation(T * K), jnp.int32)

    def loss(impl):
        return lambda r, w: jnp.sum(permute_api.combine(r, order, w, implementation=impl) ** 2)

    got = jax.grad(loss("fake"), argnums=(0, 1))(rows, weights)
    want = jax.grad(loss("reference"), argnums=(0, 1))(rows, weights)
    for g, w in zip(got, want):
        np.testing.assert_array_equal(np.asarray(g, np.float32), np.asarray(w, np.float32))


def test_on_a_gpu_xla_serves_what_the_gpu_kernels_refuse(monkeypatch, kernel_calls):
    """The GPU order has "xla" before the reference (3-4x faster than
    jax.lax.ragged_dot forward+backward on an H200): int32 operands, which Mosaic GPU
    and Triton refuse, and a fused MLP with expert biases, which they do not compute."""
    monkeypatch.setattr(jax, "default_backend", lambda: "gpu")
    rng = np.random.default_rng(0)
    sizes = np.array([3, 0, 6], np.int32)
    lhs, rhs = rng.integers(-4, 5, (10, 5), np.int32), rng.integers(-4, 5, (3, 5, 4), np.int32)
    out = ragged_dot_api.ragged_dot(jnp.asarray(lhs), jnp.asarray(rhs), jnp.asarray(sizes))
    groups = np.repeat(np.arange(3), sizes)
    want = np.zeros((10, 4), np.int32)
    want[:9] = np.einsum("mk,mkn->mn", lhs[:9], rhs[groups])
    np.testing.assert_array_equal(out, want)
    assert kernel_calls["xla"] == ["ragged_dot"] and not kernel_calls["reference"]

    T, K, E, D, F = 6, 2, 3, 8, 4
    x = jnp.asarray(rng.standard_normal((T, D)), jnp.float32)
    sort_order = jnp.asarray(rng.permutation(T * K), jnp.int32)
    weights = jnp.asarray(rng.random((T, K)), jnp.float32)
    counts = jnp.asarray([5, 0, 7], jnp.int32)
    up, down = (jnp.asarray(rng.standard_normal(s), jnp.float32) for s in ((E, D, F), (E, F, D)))
    bias = jnp.asarray(rng.standard_normal((E, F)), jnp.float32)
    args = (x, sort_order, weights, counts, None, up, down)
    y = moe_mlp_api.moe_mlp(*args, activation="gelu", up_bias_ef=bias)
    y_ref = moe_mlp_api.moe_mlp(*args, activation="gelu", up_bias_ef=bias,
                                implementation="reference")
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-5)
    assert "moe_mlp" in kernel_calls["xla"]
