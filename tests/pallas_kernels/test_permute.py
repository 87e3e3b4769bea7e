"""pallas_kernels.permute / combine: every backend against the reference (outputs and
jax.vjp gradients), the reference against NumPy loops, adjoint identities and
aristax.dispatch's dropless path, front-door errors, and CUDA lowering on this CPU.

Sort orders and num_valid are traced arguments, so all cases of one shape share one
compiled (interpreted) program per backend.
"""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from cuda_export import MOSAIC_INTERPRET, TRITON_CUDA, export_for_cuda
from aristax import dispatch as dispatch_lib
from aristax import routing as routing_lib
from aristax.config import RouterConfig
from aristax.pallas_kernels import mosaic_gpu_common as mgpu
from aristax.pallas_kernels import combine, permute
from aristax.pallas_kernels import route as route_op
from aristax.pallas_kernels.permute import api, mosaic_gpu, reference

BACKENDS = sorted(api.BACKENDS)
# (T, D, K, E, dtype): T*K and D are not multiples of the tiles (16/32 rows, 16..128 D);
# "bf16_d128" is also a shape Mosaic GPU serves (D a multiple of 128 for its combine).
SHAPES = {"f32": (11, 20, 3, 8, jnp.float32), "bf16": (9, 40, 2, 4, jnp.bfloat16),
          "bf16_d128": (9, 128, 2, 4, jnp.bfloat16)}
TOL = {jnp.float32: dict(rtol=1e-5, atol=1e-5), jnp.bfloat16: dict(rtol=2e-2, atol=2e-2)}


_UNROUTED = 10_000  # key of unrouted slots (sorts after every expert, as key E does)


def expert_order(keys: np.ndarray) -> tuple[np.ndarray, int]:
    """(sort_order, num_valid) of per-slot keys [T, K]: stable sort, routed count."""
    order = np.argsort(keys.reshape(-1), kind="stable").astype(np.int32)
    return order, int(np.sum(keys != _UNROUTED))


def _orders(T, K, E, seed=0) -> dict[str, tuple[np.ndarray, int]]:
    """Named sort orders: random top-k, experts 0..K-1 only (the rest empty), two
    unrouted tokens (num_valid < T*K), nothing routed, one expert per slot (K=1-like)."""
    rng = np.random.default_rng(seed)
    topk = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    few = np.tile(np.arange(K), (T, 1))
    unrouted = topk.copy()
    unrouted[[1, T - 2]] = _UNROUTED
    cases = {"random": topk, "empty_experts": few, "unrouted_tokens": unrouted,
             "nothing_routed": np.full((T, K), _UNROUTED)}
    return {name: expert_order(keys) for name, keys in cases.items()}


def _data(T, D, K, dtype, seed=1):
    """x [T, D], rows [M, D], weights [T, K], cotangents for rows and y (NumPy draws)."""
    rng = np.random.default_rng(seed)
    M = T * K
    x, rows, ct_rows = (jnp.asarray(rng.standard_normal(s, np.float32), dtype)
                        for s in ((T, D), (M, D), (M, D)))
    weights = jnp.asarray(rng.uniform(0.1, 1.0, (T, K)).astype(np.float32), dtype)
    dy = jnp.asarray(rng.standard_normal((T, D), np.float32))
    return x, rows, weights, ct_rows, dy


@functools.cache
def _run(backend: str | None, top_k: int):
    """jit: permute and combine through the API (implementation=None: the plain reference with
    autodiff), with their vjps: (perm, dx, y, drows, dweights)."""

    def run(x, order, nv, rows, weights, ct_rows, dy):
        if backend is None:
            p_fn = lambda x: reference.permute(x, order, nv, top_k=top_k)  # noqa: E731
            c_fn = lambda r, w: reference.combine(r, order, w, nv)  # noqa: E731
        else:
            kw = dict(num_valid=nv, interpret=None)  # CPU: interpreted; GPU: compiled
            p_fn = lambda x: permute(x, order, top_k=top_k, implementation=backend,  # noqa: E731
                                     **kw)
            c_fn = lambda r, w: combine(r, order, w, implementation=backend, **kw)  # noqa: E731
        perm, p_vjp = jax.vjp(p_fn, x)
        y, c_vjp = jax.vjp(c_fn, rows, weights)
        return (perm, *p_vjp(ct_rows), y, *c_vjp(dy))

    return jax.jit(run)


def _close(a, b, dtype, msg=""):
    np.testing.assert_allclose(np.asarray(a, np.float32), np.asarray(b, np.float32),
                               err_msg=msg, **TOL[dtype])


@pytest.mark.parametrize("backend", BACKENDS)
@pytest.mark.parametrize("shape", sorted(SHAPES))
def test_matches_reference_and_gradients(backend, shape):
    T, D, K, E, dtype = SHAPES[shape]
    if backend == "mosaic_gpu" and D % mgpu.WARPGROUP_ROW:
        pytest.skip(f"Mosaic GPU combine needs D % {mgpu.WARPGROUP_ROW} == 0 (tested below)")
    x, rows, weights, ct_rows, dy = _data(T, D, K, dtype)
    orders = _orders(T, K, E)
    if backend == "mosaic_gpu":
        # interpreted, ~10 s an order: "unrouted_tokens" is "random" with two tokens
        # unrouted, and "empty_experts" keeps every row valid
        del orders["random"]
    for name, (order, nv) in orders.items():
        args = (x, jnp.asarray(order), jnp.int32(nv), rows, weights, ct_rows, dy)
        got, want = _run(backend, K)(*args), _run(None, K)(*args)
        if backend == "mosaic_gpu":
            assert not mgpu.races_found(), name
        labels = ("rows", "dx", "y", "drows", "dweights")
        for label, a, b in zip(labels, got, want):
            assert a.dtype == b.dtype, (name, label, a.dtype, b.dtype)
            _close(a, b, dtype, f"{name}: {label}")


def test_mosaic_gpu_kernels_have_no_races():
    """Each Mosaic GPU kernel alone (interpreted on the CPU): the race detector keeps only the
    last kernel's state, so the check after the jitted vjps above sees one of five."""
    T, D, K, E, dtype = SHAPES["bf16_d128"]
    x, rows, weights, ct_rows, dy = _data(T, D, K, dtype)
    order, nv = _orders(T, K, E)["unrouted_tokens"]
    order, nv = jnp.asarray(order), jnp.int32(nv)
    run = dict(interpret=MOSAIC_INTERPRET)
    kernels = {
        "permute": lambda: mosaic_gpu.permute(x, order, nv, top_k=K, **run),
        "permute_bwd": lambda: mosaic_gpu.permute_bwd(ct_rows, order, nv, top_k=K,
                                                      x_dtype=dtype, **run),
        "combine": lambda: mosaic_gpu.combine(rows, order, weights, nv, **run),
        "combine_bwd drows": lambda: mosaic_gpu._gather(
            dy, order, weights, nv, top_k=K, out_dtype=dtype, **run,
            tiles=mosaic_gpu.GatherTiles.for_shape(D, mgpu.WARPGROUP_ROW)),
        "combine_bwd dweights": lambda: mosaic_gpu.combine_bwd(dy, rows, order, weights, nv,
                                                               **run),
    }
    for name, kernel in kernels.items():
        jax.block_until_ready(kernel())
        assert not mgpu.races_found(), name


def numpy_permute_combine(x, order, nv, rows, weights):
    """Brute force loops: rows[p] = x[order[p] // K] (p < nv); y[t] = sum_k w rows[pos]."""
    T, K = weights.shape
    perm = np.zeros((T * K, x.shape[1]), np.float64)
    y = np.zeros((T, rows.shape[1]), np.float64)
    for p, slot in enumerate(order):
        if p < nv:
            perm[p] = x[slot // K]
            y[slot // K] += weights[slot // K, slot % K] * rows[p]
    return perm, y


def test_reference_matches_numpy_and_is_its_own_adjoint():
    T, D, K, E, dtype = SHAPES["f32"]
    x, rows, weights, ct_rows, dy = _data(T, D, K, dtype, seed=5)
    for name, (order, nv) in _orders(T, K, E, seed=2).items():
        perm, dx, y, drows, dweights = _run(None, K)(
            x, jnp.asarray(order), jnp.int32(nv), rows, weights, ct_rows, dy)
        want_perm, want_y = numpy_permute_combine(*map(np.asarray, (x, order, nv, rows,
                                                                     weights)))
        np.testing.assert_array_equal(perm, want_perm, err_msg=name)
        np.testing.assert_allclose(y, want_y, rtol=1e-5, atol=1e-6, err_msg=name)
        # Linear maps: <P x, c> = <x, P^T c>; <C(r, w), dy> = <r, dC/dr> = <w, dC/dw>.
        np.testing.assert_allclose(np.vdot(perm, ct_rows), np.vdot(x, dx), rtol=1e-4)
        np.testing.assert_allclose(np.vdot(y, dy), np.vdot(rows, drows), rtol=1e-4, atol=1e-5)
        np.testing.assert_allclose(np.vdot(y, dy), np.vdot(weights, dweights), rtol=1e-4,
                                   atol=1e-5)


@pytest.mark.parametrize("backend", BACKENDS)
def test_replaces_the_dropless_path_of_aristax_moe(backend):
    """route -> permute -> combine equals aristax.routing -> dropless_dispatch ->
    dispatch.permute -> dispatch.combine, with a NaN token routed nowhere."""
    T, D, K, E, dtype = 11, 128, 3, 8, jnp.float32  # D: a shape every backend serves
    x, rows, _, ct_rows, dy = _data(T, D, K, dtype, seed=9)
    w_router = jnp.asarray(np.random.default_rng(3).standard_normal((D, E), np.float32))
    x = x.at[4].set(jnp.nan)
    cfg = RouterConfig(num_experts=E, top_k=K, normalize_weights=True)

    @jax.jit
    def aristax_path(x, rows):
        routing = routing_lib.route(jnp.dot(x, w_router, precision="highest"), cfg)
        dispatch = dispatch_lib.dropless_dispatch(routing)
        return (dispatch_lib.permute(x, dispatch),
                dispatch_lib.combine(rows, dispatch, routing.weights))

    out = jax.jit(lambda x: route_op(x, w_router, top_k=K, normalize=True))(x)
    nv = jnp.sum(out.counts)
    perm, _, y, _, _ = _run(backend, K)(x, out.sort_order, nv, rows, out.weights, ct_rows, dy)
    want_perm, want_y = aristax_path(x, rows)
    assert int(nv) == K * (T - 1)
    np.testing.assert_array_equal(perm, want_perm)
    np.testing.assert_allclose(y, want_y, rtol=1e-6, atol=1e-6)


@pytest.mark.parametrize(
    "op, kwargs, match",
    [
        ("permute", dict(implementation="nope"), "implementation"),
        ("combine", dict(implementation=["reference", "nope"]), "implementation"),
        ("permute", dict(x=jnp.zeros((4,))), r"x must be \[T, D\]"),
        ("permute", dict(sort_order=jnp.arange(7)), r"sort_order .* shape \[T\*K\] = \[8\]"),
        ("permute", dict(sort_order=jnp.zeros(8)), r"sort_order must be an integer array"),
        ("permute", dict(num_valid=jnp.zeros(3, jnp.int32)), "num_valid must be an integer scalar"),
        ("combine", dict(rows=jnp.zeros((9, 3))), r"rows must be \[T\*K, D\] = \[8, D\]"),
        ("combine", dict(weights=jnp.zeros(8)), r"weights must be \[T, K\]"),
        ("combine", dict(sort_order=jnp.arange(4)), r"sort_order .* shape \[T\*K\] = \[8\]"),
    ],
)
def test_front_door_errors(op, kwargs, match):
    args = dict(x=jnp.zeros((4, 3)), rows=jnp.zeros((8, 3)), weights=jnp.zeros((4, 2)),
                sort_order=jnp.arange(8))
    args.update(kwargs)
    with pytest.raises(ValueError, match=match):
        if op == "permute":
            permute(args["x"], args["sort_order"], top_k=2,
                    **{k: v for k, v in kwargs.items() if k in ("implementation", "num_valid")})
        else:
            combine(args["rows"], args["sort_order"], args["weights"],
                    **{k: v for k, v in kwargs.items() if k == "implementation"})


@pytest.mark.parametrize(
    "T, D, K, dtype",
    [(11, 20, 3, jnp.float32), (64, 256, 8, jnp.bfloat16), (1, 7, 1, jnp.float16),
     (300, 1000, 2, jnp.float32)],
)
def test_triton_lowers_for_cuda(T, D, K, dtype):
    """Forward and backward of both ops lower to Triton custom calls (no GPU needed)."""
    kw = dict(implementation="triton", interpret=False)

    def loss(x, rows, weights, order, nv):
        perm = permute(x, order, top_k=K, num_valid=nv, **kw)
        y = combine(rows * perm, order, weights, num_valid=nv, **kw)
        return jnp.sum(y)

    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 2)))
    M = T * K
    exported = export_for_cuda(
        grad, jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((M, D), dtype),
        jax.ShapeDtypeStruct((T, K), dtype), jax.ShapeDtypeStruct((M,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32), disabled_checks=TRITON_CUDA)
    text = exported.mlir_module()
    for kernel in ("permute_gather", "combine_gather_sum", "combine_gather_dot",
                   "inverse_order"):
        assert kernel in text, kernel


@pytest.mark.parametrize(
    "T, D, K, dtype",
    [(9, 128, 2, jnp.float32), (64, 256, 8, jnp.bfloat16), (1, 384, 1, jnp.float16),
     (300, 1024, 2, jnp.bfloat16)],
)
def test_mosaic_gpu_lowers_for_cuda(T, D, K, dtype):
    """permute, combine and their backwards lower to five Mosaic GPU kernels (permute,
    combine, dx, drows, dweights), no other backend, no GPU needed."""
    def loss(x, rows, weights, order, nv):
        kw = dict(num_valid=nv, implementation="mosaic_gpu", interpret=False)
        perm = permute(x, order, top_k=K, **kw)
        return jnp.sum(combine(rows * perm, order, weights, **kw) ** 2)

    M = T * K
    exported = jax.export.export(jax.jit(jax.grad(loss, argnums=(0, 1, 2))),
                                 platforms=["cuda"])(
        jax.ShapeDtypeStruct((T, D), dtype), jax.ShapeDtypeStruct((M, D), dtype),
        jax.ShapeDtypeStruct((T, K), dtype), jax.ShapeDtypeStruct((M,), jnp.int32),
        jax.ShapeDtypeStruct((), jnp.int32))
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == 5


def test_mosaic_gpu_refuses_what_it_cannot_serve():
    x, order = jnp.zeros((4, 20), jnp.bfloat16), jnp.arange(8)
    with pytest.raises(NotImplementedError, match="D=20 must be a multiple of 64"):
        permute(x, order, top_k=2, implementation="mosaic_gpu", interpret=True)
    rows = permute(x, order, top_k=2, implementation=["mosaic_gpu", "reference"],
                   interpret=True)  # falls back
    assert rows.shape == (8, 20)
    rows = jnp.ones((8, 64), jnp.float32)  # permute serves D=64, combine does not
    with pytest.raises(NotImplementedError, match="combine: D=64 must be a multiple of 128"):
        combine(rows, order, jnp.ones((4, 2)), implementation="mosaic_gpu", interpret=True)
    y = combine(rows, order, jnp.ones((4, 2)), implementation=["mosaic_gpu", "reference"],
                interpret=True)
    np.testing.assert_array_equal(np.asarray(y), 2.0)


def test_mosaic_gpu_permute_lowers_at_d64():
    """permute and its backward serve D % 64 == 0 (combine needs 128)."""
    def loss(x, order):
        rows = permute(x, order, top_k=2, implementation="mosaic_gpu", interpret=False)
        return jnp.sum(rows.astype(jnp.float32) ** 2)

    exported = jax.export.export(jax.jit(jax.grad(loss)), platforms=["cuda"])(
        jax.ShapeDtypeStruct((9, 64), jnp.float32), jax.ShapeDtypeStruct((18,), jnp.int32))
    assert exported.mlir_module().count("custom_call @mosaic_gpu") == 2
