"""pallas_kernels.route: every backend against the reference, the reference against
aristax.routing + aristax.dispatch and a NumPy brute force, gradients, front-door
errors, and CUDA lowering of the Triton and Mosaic GPU kernels on this (CPU) machine.

Each compiled function is cached per (backend, static config) and shapes are shared
between cases, so the interpreted Triton kernels compile a handful of times only.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import TRITON_CUDA, export_for_cuda
from aristax import dispatch as dispatch_lib
from aristax import routing as routing_lib
from aristax.config import RouterConfig
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels import route
from aristax.pallas_kernels.route import api, reference

BACKENDS = sorted(api.BACKENDS)
# (T, D, E, K, score, normalize): T odd and not a multiple of any tile; K = E; K = 1.
CASES = {
    "softmax_norm": (37, 24, 8, 2, "softmax", True),
    "sigmoid_k_eq_e": (13, 16, 4, 4, "sigmoid", False),
    "sigmoid_norm_k1": (21, 40, 6, 1, "sigmoid", True),
}
# Mosaic GPU serves bf16/f16 with D % 64 == 0 and T % 8 == 0: T = 2 tiles + 8 rows,
# K = E, K = 1 with E = 130 (padded to 192 columns).
MOSAIC_CASES = {
    "softmax_norm": (136, 128, 8, 2, "softmax", True),
    "sigmoid_k_eq_e": (24, 64, 4, 4, "sigmoid", False),
    "sigmoid_norm_k1": (72, 192, 130, 1, "sigmoid", True),
}
HARD_CASE = {"mosaic_gpu": (40, 64, 8, 2, "softmax", True)}  # else CASES["softmax_norm"]


def cases_for(backend: str) -> dict:
    return MOSAIC_CASES if backend == "mosaic_gpu" else CASES


def dtype_for(backend: str):
    return jnp.bfloat16 if backend == "mosaic_gpu" else jnp.float32


BACKEND_CASES = [(b, n) for b in BACKENDS for n in sorted(cases_for(b))]


def _inputs(T, D, E, seed=0, dtype=jnp.float32):
    """x [T, D], w_router [D, E] (logits of order 3) in ``dtype``, bias float32[E]:
    NumPy draws, no compile."""
    rng = np.random.default_rng(seed)
    x = rng.standard_normal((T, D), np.float32)
    w = rng.standard_normal((D, E), np.float32) * np.float32(3 / np.sqrt(D))
    bias = rng.standard_normal(E, np.float32) * np.float32(0.05)
    return jnp.asarray(x, dtype), jnp.asarray(w, dtype), jnp.asarray(bias)


def _make_run(route_fn):
    """jit: (x, w, bias, dlogits, dweights) -> (RouteOutput, dx, dw, dbias)."""

    def run(x, w, bias, dlogits, dweights):
        def f(x, w, bias):
            out = route_fn(x, w, bias)
            return (out.logits, out.weights), out

        _, vjp, out = jax.vjp(f, x, w, bias, has_aux=True)
        return (out, *vjp((dlogits, dweights)))

    return jax.jit(run)


@functools.cache
def _run(backend: str, top_k: int, score: str, normalize: bool):
    """The API with one backend (its custom_vjp); interpret=None: interpreted on CPU,
    compiled where a GPU is the default backend."""
    return _make_run(lambda x, w, bias: route(
        x, w, top_k=top_k, score=score, bias=bias, normalize=normalize,
        implementation=backend, interpret=None))


@functools.cache
def _oracle(top_k: int, score: str, normalize: bool):
    """``reference.route`` with plain autodiff (no custom_vjp): the gradient oracle."""
    return _make_run(lambda x, w, bias: reference.route(
        x, w, bias, top_k=top_k, score=score, normalize=normalize))


def _cotangents(T, E, K, seed=7):
    rng = np.random.default_rng(seed)
    return (jnp.asarray(rng.standard_normal((T, E), np.float32)),
            jnp.asarray(rng.standard_normal((T, K), np.float32)))


def _assert_same_routing(out, ref, *, rtol=1e-5, atol=1e-6):
    """Integer outputs exactly, float outputs to f32 tolerance."""
    for name in ("expert_ids", "counts", "sort_order"):
        np.testing.assert_array_equal(getattr(out, name), getattr(ref, name), err_msg=name)
    for name in ("logits", "weights"):
        np.testing.assert_allclose(getattr(out, name), getattr(ref, name), rtol=rtol,
                                   atol=atol, err_msg=name)


def numpy_route(x, w, bias, top_k, score, normalize):
    """Brute force in float64 NumPy: (ids, weights, counts, sort_order)."""
    with np.errstate(invalid="ignore"):
        logits = np.asarray(x, np.float64) @ np.asarray(w, np.float64)
    T, E = logits.shape
    finite = np.isfinite(logits).all(axis=1)
    safe = np.where(finite[:, None], logits, 0.0)
    if score == "softmax":
        s = np.exp(safe - safe.max(axis=1, keepdims=True))
        s /= s.sum(axis=1, keepdims=True)
    else:
        s = 1.0 / (1.0 + np.exp(-safe))
    select = s + (0.0 if bias is None else np.asarray(bias, np.float64))
    # descending, lowest index first among ties; NaN ranks first, as in jax.lax.top_k
    ids = np.stack([np.lexsort((-np.where(np.isnan(row), 0.0, row), ~np.isnan(row)))[:top_k]
                    for row in select])
    weights = np.take_along_axis(s, ids, axis=1)
    if normalize:
        weights /= weights.sum(axis=1, keepdims=True)
    weights[~finite] = 0.0
    key = np.where(finite[:, None], ids, E).reshape(-1)
    order = np.argsort(key, kind="stable")
    counts = np.bincount(key, minlength=E + 1)[:E]
    return ids, weights, counts, order


def _check_case(backend, case, x, w, bias, grads=True):
    """The backend through the API against the autodiff oracle, outputs and vjps."""
    T, D, E, K, score, normalize = case
    dl, dwt = _cotangents(T, E, K)
    out, dx, dw, dbias = _run(backend, K, score, normalize)(x, w, bias, dl, dwt)
    ref, dx_ref, dw_ref, dbias_ref = _oracle(K, score, normalize)(x, w, bias, dl, dwt)
    if backend == "mosaic_gpu":
        assert not mgpu.races_found()
    _assert_same_routing(out, ref)
    np.testing.assert_array_equal(dbias, 0.0)  # the bias only selects
    np.testing.assert_array_equal(dbias_ref, 0.0)
    if grads:  # float32 sums in another order, then rounded to x's dtype
        tol = 1e-4 if x.dtype == jnp.float32 else 1e-2
        for got, want in ((dx, dx_ref), (dw, dw_ref)):
            assert got.dtype == want.dtype == x.dtype
            np.testing.assert_allclose(np.asarray(got, np.float32),
                                       np.asarray(want, np.float32), rtol=tol, atol=tol / 10)
    return out


@pytest.mark.parametrize("backend, name", BACKEND_CASES)
def test_matches_reference_and_gradients(backend, name):
    case = cases_for(backend)[name]
    T, D, E = case[:3]
    x, w, bias = _inputs(T, D, E, seed=len(name), dtype=dtype_for(backend))
    _check_case(backend, case, x, w, bias)


# The Mosaic GPU interpreter reads rows past T as NaN (hardware reads zeros) and its
# wgmma multiplies them in NumPy; the kernel masks those rows.
@pytest.mark.filterwarnings("ignore:invalid value encountered in matmul:RuntimeWarning")
@pytest.mark.parametrize("backend", BACKENDS)
def test_hard_cases(backend):
    """Ties, one expert for everyone, empty experts, a NaN token (8 experts, top-2;
    the shapes of ``HARD_CASE`` or of case "softmax_norm").

    Integer inputs: every logit is exact (in bfloat16 too), so equal columns give
    exact ties."""
    case = HARD_CASE.get(backend, CASES["softmax_norm"])
    T, D, E, K = case[:4]
    dtype = dtype_for(backend)
    rng = np.random.default_rng(0)
    x = rng.integers(-2, 3, (T, D)).astype(np.float32)
    w = rng.integers(-1, 2, (D, E)).astype(np.float32)
    w[:, 3] = w[:, 5] = w[:, 6] = w[:, 1]
    x_bad = x.copy()
    x_bad[4, 3], x_bad[T - 1, 0] = np.nan, np.inf
    zero_bias = np.zeros(E, np.float32)
    two_experts = np.full(E, -100.0, np.float32)
    two_experts[[2, 5]] = 0.0
    nan_bias = zero_bias.copy()
    nan_bias[6] = np.nan  # ranks above every score (lax.top_k): expert 6, then the best
    variants = {
        "ties": (x, w, zero_bias),
        "all_equal": (x, np.zeros_like(w), zero_bias),  # every expert ties: ids 0..K-1
        "two_experts_only": (x, w, two_experts),  # six empty experts
        "nan_token": (x_bad, w, zero_bias),  # routed nowhere, sorted last
        "nan_bias": (x, w, nan_bias),
    }
    for label, (xv, wv, bv) in variants.items():
        out = _check_case(backend, case, jnp.asarray(xv, dtype), jnp.asarray(wv, dtype),
                          jnp.asarray(bv), grads=label != "nan_token")
        ids, weights, counts, order = numpy_route(xv, wv, bv, K, "softmax", True)
        np.testing.assert_array_equal(out.expert_ids, ids, err_msg=label)
        np.testing.assert_array_equal(out.counts, counts, err_msg=label)
        np.testing.assert_array_equal(out.sort_order, order, err_msg=label)
        np.testing.assert_allclose(out.weights, weights, rtol=1e-5, atol=1e-6, err_msg=label)
        np.testing.assert_array_equal(out.expert_ids, _lax_top_k(out.logits, bv, K),
                                      err_msg=label)
        if label == "all_equal":
            np.testing.assert_array_equal(out.expert_ids, np.tile([0, 1], (T, 1)))
        if label == "two_experts_only":
            np.testing.assert_array_equal(out.counts, [0, 0, T, 0, 0, T, 0, 0])
        if label == "nan_bias":
            np.testing.assert_array_equal(out.expert_ids[:, 0], 6)
            assert (out.expert_ids[:, 1] < E).all()
        if label == "nan_token":
            assert out.counts.sum() == K * (T - 2)
            np.testing.assert_array_equal(out.sort_order[-2 * K:] // K, [4] * K + [T - 1] * K)


@functools.partial(jax.jit, static_argnums=2)
def _lax_top_k(logits, bias, top_k):
    """jax.lax.top_k of softmax(logits) + bias (non-finite rows as zeros): the tie rule."""
    safe = jnp.where(jnp.all(jnp.isfinite(logits), axis=1, keepdims=True), logits, 0.0)
    return jax.lax.top_k(jax.nn.softmax(safe, axis=-1) + bias, top_k)[1]


@pytest.mark.parametrize("name", sorted(CASES))
def test_reference_equals_aristax_routing_and_dropless_dispatch(name):
    T, D, E, K, score, normalize = CASES[name]
    x, w, bias = _inputs(T, D, E, seed=3)
    x = x.at[2].set(jnp.nan)  # a token routed nowhere, as aristax.routing does
    cfg = RouterConfig(num_experts=E, top_k=K, normalize_weights=normalize,
                       router="softmax_topk" if score == "softmax" else "sigmoid")

    @jax.jit
    def both(x, w, bias):
        out = reference.route(x, w, bias, top_k=K, score=score, normalize=normalize)
        logits = jnp.dot(x, w, precision=jax.lax.Precision.HIGHEST)
        routing = routing_lib.route(logits, cfg, bias=bias)
        return out, routing, dispatch_lib.dropless_dispatch(routing)

    out, routing, dispatch = both(x, w, bias)
    np.testing.assert_array_equal(out.expert_ids, routing.expert_ids)
    np.testing.assert_array_equal(out.weights, routing.weights)
    np.testing.assert_array_equal(out.logits, routing.logits)
    np.testing.assert_array_equal(out.counts, dispatch.group_sizes)
    np.testing.assert_array_equal(out.sort_order, dispatch.sort_order)
    inverse = np.argsort(np.asarray(out.sort_order)).reshape(T, K)
    np.testing.assert_array_equal(inverse, dispatch.row_of)
    ids, weights, counts, order = numpy_route(x, w, bias, K, score, normalize)
    np.testing.assert_array_equal(out.expert_ids, ids)
    np.testing.assert_allclose(out.weights, weights, rtol=1e-5, atol=1e-7)
    np.testing.assert_array_equal(out.counts, counts)
    np.testing.assert_array_equal(out.sort_order, order)


def test_reference_gradient_matches_finite_differences():
    """Directional derivative of sum(c1 * logits) + sum(c2 * weights) (central, f32)."""
    T, D, E, K, score, normalize = CASES["softmax_norm"]
    x, w, bias = _inputs(T, D, E, seed=11)
    c1, c2 = _cotangents(T, E, K, seed=3)

    def loss(x, w):
        out = reference.route(x, w, bias, top_k=K, score=score, normalize=normalize)
        return jnp.sum(c1 * out.logits) + jnp.sum(c2 * out.weights)

    vx, vw = _inputs(T, D, E, seed=12)[:2]
    h = 1e-3

    @jax.jit
    def check(x, w, vx, vw):
        gx, gw = jax.grad(loss, argnums=(0, 1))(x, w)
        numeric = (loss(x + h * vx, w + h * vw) - loss(x - h * vx, w - h * vw)) / (2 * h)
        return numeric, jnp.sum(gx * vx) + jnp.sum(gw * vw)

    numeric, analytic = check(x, w, vx, vw)
    np.testing.assert_allclose(numeric, analytic, rtol=2e-3)


@pytest.mark.parametrize("backend", BACKENDS)
def test_bias_changes_selection_not_weights(backend):
    T, D, E, K, score, normalize = cases_for(backend)["sigmoid_k_eq_e"]
    x, w, _ = _inputs(T, D, E, dtype=dtype_for(backend))
    bias = jnp.asarray(np.array([0.0, 0.0, 0.0, 10.0], np.float32))
    out = _run(backend, K, score, normalize)(x, w, bias, *_cotangents(T, E, K))[0]
    np.testing.assert_array_equal(out.expert_ids[:, 0], 3)
    scores = 1 / (1 + np.exp(-np.asarray(out.logits, np.float64)))
    np.testing.assert_allclose(out.weights, np.take_along_axis(scores, out.expert_ids, 1),
                               rtol=1e-6)


@pytest.mark.parametrize(
    "kwargs, match",
    [
        (dict(implementation="cuda_magic"), "implementation"),
        (dict(implementation=[]), "implementation"),
        (dict(w_router=jnp.zeros((5, 4))), r"w_router must be \[D, E\] = \[8, E\]"),
        (dict(x=jnp.zeros((3, 8, 1))), r"x must be \[T, D\]"),
        (dict(bias=jnp.zeros((5,))), r"bias must be \[E\] = \[4\]"),
        (dict(top_k=5), r"top_k must be an int in \[1, E=4\]"),
        (dict(score="relu"), "score must be one of"),
        (dict(normalize="no"), "normalize must be True or False; got 'no'"),  # renormalised
    ],
)
def test_front_door_errors(kwargs, match):
    args = dict(x=jnp.zeros((3, 8)), w_router=jnp.zeros((8, 4)), top_k=2)
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        route(args.pop("x"), args.pop("w_router"), **args)


def test_triton_declines_float64_and_the_list_falls_back():
    with jax.enable_x64(True):
        x, w = jnp.ones((4, 8), jnp.float64), jnp.ones((8, 4), jnp.float64)
        with pytest.raises(NotImplementedError, match="triton: x dtype float64"):
            route(x, w, top_k=1, implementation="triton")
        out = jax.eval_shape(lambda x, w: route(
            x, w, top_k=1, implementation=["triton", "reference"]), x, w)
        assert out.logits.dtype == jnp.float64


@pytest.mark.parametrize(
    "T, D, E, K, score, dtype",
    [(100, 48, 8, 2, "softmax", jnp.float32), (64, 96, 64, 6, "sigmoid", jnp.bfloat16),
     (1, 16, 3, 3, "softmax", jnp.float16), (33, 200, 256, 8, "sigmoid", jnp.float32)],
)
def test_triton_lowers_for_cuda(T, D, E, K, score, dtype):
    def f(x, w, bias):
        out = route(x, w, top_k=K, score=score, bias=bias, normalize=True,
                    implementation="triton", interpret=False)
        return out, jax.grad(lambda x: jnp.sum(route(
            x, w, top_k=K, score=score, implementation="triton", interpret=False).weights))(x)

    exported = export_for_cuda(
        jax.jit(f), jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((D, E), dtype),
        jax.ShapeDtypeStruct((E,), jnp.float32), disabled_checks=TRITON_CUDA)
    text = exported.mlir_module()
    assert text.count("custom_call @__gpu$xla.gpu.triton") >= 2  # both router kernels
    assert "route_topk" in text and "route_order" in text


@pytest.mark.parametrize(
    "T, D, E, K, score, dtype",
    [(136, 128, 8, 2, "softmax", jnp.bfloat16), (8, 64, 6, 6, "sigmoid", jnp.float16),
     (1024, 256, 256, 8, "sigmoid", jnp.bfloat16), (64, 64, 130, 1, "softmax", jnp.bfloat16)],
)
def test_mosaic_gpu_lowers_for_cuda(T, D, E, K, score, dtype):
    """Layout inference, the wgmma shapes and SMEM budget are checked only when the
    kernel is compiled: E up to 256 (the widest wgmma), K = E, T = one row block."""
    def f(x, w, bias):
        out = route(x, w, top_k=K, score=score, bias=bias, normalize=True,
                    implementation="mosaic_gpu", interpret=False)
        return out, jax.grad(lambda x: jnp.sum(route(
            x, w, top_k=K, score=score, implementation="mosaic_gpu",
            interpret=False).weights))(x)

    exported = jax.export.export(jax.jit(f), platforms=["cuda"])(
        jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((D, E), dtype),
        jax.ShapeDtypeStruct((E,), jnp.float32))
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == 2  # forward twice


@pytest.mark.parametrize(
    "shape_x, shape_w, dtype, match",
    [((64, 64), (64, 8), jnp.float32, "bfloat16 or both float16"),
     ((64, 48), (48, 8), jnp.bfloat16, "D=48 must be a multiple of 64"),
     ((36, 64), (64, 8), jnp.bfloat16, "T=36 must be a multiple of 8"),
     ((64, 64), (64, 257), jnp.bfloat16, "E=257 > 256")],
)
def test_mosaic_gpu_declines_and_the_list_falls_back(shape_x, shape_w, dtype, match):
    x, w = jnp.ones(shape_x, dtype), jnp.ones(shape_w, dtype)
    with pytest.raises(NotImplementedError, match=match):
        route(x, w, top_k=1, implementation="mosaic_gpu", interpret=True)
    out = jax.eval_shape(lambda x, w: route(
        x, w, top_k=1, implementation=["mosaic_gpu", "reference"], interpret=True), x, w)
    assert out.logits.shape == (shape_x[0], shape_w[1])
