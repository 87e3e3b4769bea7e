"""The plain-XLA fused expert MLP ("xla", the MoE layer's CPU default) beyond the
tests every moe_mlp backend runs (test_moe_mlp.py): its tile schedule against brute
force, forward and gradients against a NumPy loop over the routed rows on the hard
routings and in float64, jax.vmap, and the layer's default choosing it (and falling
back where it does not compute an option)."""

from __future__ import annotations

import importlib
import math

import chex
import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aristax import MoEConfig, MoEParams, moe
from aristax.pallas_kernels.moe_mlp import moe_mlp, xla
from aristax.pallas_kernels.ragged_dot.xla import XlaTiles
from test_moe_mlp import UNROUTED, counting, layout

param_shapes = importlib.import_module("aristax.moe").param_shapes  # aristax.moe: the function


@pytest.mark.parametrize("tiles", [XlaTiles(32, 8), XlaTiles(64, 8), XlaTiles(16, 16)])
@pytest.mark.parametrize("seed", range(4))
def test_schedule_covers_every_padded_row_once(tiles, seed):
    """The groups with rows are visited once each, in order, then no other; every row
    of each group (padded to a multiple of align) is covered by exactly one of its
    tiles, of the run's size and inside the group, with at most one tile of each
    remainder size; the padded layout fits P rows and the real rows map back to their
    own."""
    rng = np.random.default_rng(seed)
    E = int(rng.integers(1, 9))
    sizes = rng.integers(0, 80, E) * (rng.random(E) < 0.8)  # some empty groups
    m = int(sizes.sum() + rng.integers(-20, 20))  # sums below M, and past it (clipped)
    m = max(m, 1)
    sched = xla.schedules(jnp.asarray(sizes, jnp.int32), m, tiles)
    clipped = np.diff(np.minimum(np.concatenate([[0], np.cumsum(sizes)]), m))
    padded = -(-clipped // tiles.align) * tiles.align
    pstart = np.cumsum(padded) - padded
    assert padded.sum() <= xla.padded_rows(m, E, tiles)
    count = int(sched.count)
    np.testing.assert_array_equal(np.asarray(sched.order)[:count], np.flatnonzero(padded))
    owner = np.full(int(padded.sum()), -1)
    for g in range(E):
        runs = xla.group_tiles(sched, g, tiles)
        assert [size for size, _, _ in runs] == [tiles.block_m >> i for i in range(len(runs))]
        assert runs[-1][0] == tiles.align
        for i, (size, first, n) in enumerate(runs):
            assert i == 0 or int(n) in (0, 1)
            for t in range(int(n)):
                lo = int(first) + t * size
                assert pstart[g] <= lo and lo + size <= pstart[g] + padded[g], (g, lo, size)
                assert (owner[lo:lo + size] == -1).all()
                owner[lo:lo + size] = g
    assert (owner == np.repeat(np.arange(E), padded)).all()
    shift, end = np.asarray(sched.shift), np.asarray(sched.end)
    np.testing.assert_array_equal(end, pstart + clipped)
    np.testing.assert_array_equal(pstart - shift, np.cumsum(clipped) - clipped)


def routings(T: int, E: int, K: int, rng) -> dict[str, tuple]:
    """Named routings (sort_order, group_sizes, num_valid)."""
    topk = np.stack([rng.permutation(E)[:K] for _ in range(T)])
    cases = {"random": layout(topk, E)}
    order, sizes, nv = layout(topk, E)
    cases["num_valid_below_sum"] = (order, sizes, int(nv) - 7)
    skew = np.stack([np.r_[0, 1 + rng.permutation(E - 1)[:K - 1]] for _ in range(T)])
    cases["one_expert_in_every_token"] = layout(skew, E)
    if K < E:
        cases["empty_experts"] = layout(np.tile(np.arange(K), (T, 1)), E)
        one = np.full((T, K), UNROUTED)
        one[:, 0] = E - 1
        cases["one_expert_takes_all"] = layout(one, E)
    cases["nothing_routed"] = layout(np.full((T, K), UNROUTED), E)
    return cases


def numpy_swiglu(x, order, weights, sizes, nv, gate, up, down, dy):
    """y and the gradients of <y, dy> by a loop over the routed rows (float64)."""
    x, weights, gate, up, down, dy = (np.asarray(a, np.float64)
                                      for a in (x, weights, gate, up, down, dy))
    T, K = weights.shape
    nv = int(sizes.sum()) if nv is None else nv
    expert = np.repeat(np.arange(len(sizes)), sizes)
    y, dx, dw = np.zeros_like(x), np.zeros_like(x), np.zeros_like(weights)
    dgate, dup, ddown = np.zeros_like(gate), np.zeros_like(up), np.zeros_like(down)
    for m in range(nv):
        s, e = int(order[m]), expert[m]
        t, w = s // K, weights.flat[s]
        a = x[t]
        g, u = a @ gate[e], a @ up[e]
        sig = 1 / (1 + np.exp(-g))
        h = g * sig * u
        o = h @ down[e]
        y[t] += w * o
        dw.flat[s] = o @ dy[t]
        do = w * dy[t]
        ddown[e] += np.outer(h, do)
        dh = down[e] @ do
        du, dg = dh * g * sig, dh * u * sig * (1 + g * (1 - sig))
        dx[t] += gate[e] @ dg + up[e] @ du
        dgate[e] += np.outer(a, dg)
        dup[e] += np.outer(a, du)
    return y, (dx, dw, dgate, dup, ddown)


def value_and_grads(x, order, weights, sizes, nv, gate, up, down, dy, tiles):
    def op(x, weights, gate, up, down):
        return moe_mlp(x, order, weights, sizes, gate, up, down, activation="swiglu",
                       num_valid=nv, implementation="xla", tiles=tiles)
    y, pullback = jax.vjp(op, x, weights, gate, up, down)
    return y, pullback(dy)


@pytest.mark.parametrize("joined", [True, False], ids=["joined-wgrad", "split-wgrad"])
@pytest.mark.parametrize("tiles", [None, XlaTiles(32, 8)], ids=["default", "tiles32-16-8"])
@pytest.mark.parametrize("shape", [(53, 24, 40, 6, 2), (29, 16, 24, 4, 4), (31, 40, 16, 5, 3)],
                         ids=["odd", "K=E", "F<D"])
def test_equals_numpy_on_hard_routings(shape, tiles, joined, monkeypatch):
    """Both forms of the backward's gate/up products (joined [2F]-wide ones per tile up
    to ``JOINED_WGRAD_MAX_F``, two F-wide ones above), and both forms of down's
    weight gradient (the row weights on dy's rows, or on h's where F < D)."""
    monkeypatch.setattr(xla, "JOINED_WGRAD_MAX_F", 1 << 20 if joined else 0)
    jax.clear_caches()  # traces of the other form
    T, D, F, E, K = shape
    rng = np.random.default_rng(T)
    x = rng.standard_normal((T, D)).astype(np.float32)
    weights = rng.uniform(0.1, 1.0, (T, K)).astype(np.float32)
    gate, up = (rng.standard_normal((E, D, F)).astype(np.float32) * 0.3 for _ in range(2))
    down = rng.standard_normal((E, F, D)).astype(np.float32) * 0.3
    dy = rng.standard_normal((T, D)).astype(np.float32)
    fn = jax.jit(value_and_grads, static_argnums=9)
    for case, (order, sizes, nv) in routings(T, E, K, rng).items():
        got = fn(x, order, weights, sizes, nv, gate, up, down, dy, tiles)
        want = numpy_swiglu(x, order, weights, sizes, nv, gate, up, down, dy)
        for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            scale = max(1.0, float(np.abs(b).max(initial=0.0)))
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=f"{case}: leaf {i}")


def test_float64_values_and_gradients():
    T, D, F, E, K = 21, 8, 12, 3, 2
    rng = np.random.default_rng(7)
    with jax.enable_x64(True):
        x = rng.standard_normal((T, D))
        weights = rng.uniform(0.1, 1.0, (T, K))
        gate, up, down = (rng.standard_normal(s) for s in ((E, D, F), (E, D, F), (E, F, D)))
        dy = rng.standard_normal((T, D))
        order, sizes, _ = routings(T, E, K, rng)["random"]
        got = value_and_grads(*(jnp.asarray(a) for a in (x, order, weights, sizes)), None,
                              *(jnp.asarray(a) for a in (gate, up, down, dy)), None)
        assert all(leaf.dtype == jnp.float64 for leaf in jax.tree.leaves(got))
        want = numpy_swiglu(x, order, weights, sizes, None, gate, up, down, dy)
        for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-10, atol=1e-10)


@pytest.mark.parametrize("options", [
    dict(activation="swiglu"),
    dict(activation="clamped_swiglu", swiglu_limit=0.8, weight_side="input",
         gate_bias_ef=0.3, up_bias_ef=-0.2, down_bias_ed=0.1)], ids=["plain", "extras"])
def test_vmap_of_value_and_grad_equals_each_problem(options):
    """Per-problem routings under jax.vmap (batched trip counts) give each problem's
    own result, with and without the options beyond the plain MLP."""
    T, D, F, E, K, B = 17, 8, 12, 4, 2, 3
    rng = np.random.default_rng(3)
    x = jnp.asarray(rng.standard_normal((B, T, D)), jnp.float32)
    weights = jnp.asarray(rng.uniform(0.1, 1, (B, T, K)), jnp.float32)
    gate, up = (jnp.asarray(rng.standard_normal((E, D, F)) * 0.3, jnp.float32) for _ in "gu")
    down = jnp.asarray(rng.standard_normal((E, F, D)) * 0.3, jnp.float32)
    lay = [layout(np.stack([rng.permutation(E)[:K] for _ in range(T)]), E)[:2]
           for _ in range(B)]
    order, sizes = (jnp.asarray(np.stack(a)) for a in zip(*lay))
    options = {k: jnp.asarray(rng.standard_normal((E, D if k == "down_bias_ed" else F)) * v,
                              jnp.float32) if k.endswith(("_ef", "_ed")) else v
               for k, v in options.items()}

    def loss(x, weights, gate, up, down, order, sizes):
        y = moe_mlp(x, order, weights, sizes, gate, up, down, implementation="xla", **options)
        return jnp.sum(y * y)
    fn = jax.value_and_grad(loss, argnums=(0, 1, 2, 3, 4))
    batched = jax.jit(jax.vmap(fn, in_axes=(0, 0, None, None, None, 0, 0)))(
        x, weights, gate, up, down, order, sizes)
    for b in range(B):
        one = jax.jit(fn)(x[b], weights[b], gate, up, down, order[b], sizes[b])
        value, (dx, dw, *_) = one
        chex.assert_trees_all_close((batched[0][b], batched[1][0][b], batched[1][1][b]),
                                    (value, dx, dw), rtol=1e-5, atol=1e-5)


@pytest.mark.skipif(jax.default_backend() != "cpu", reason="the CPU's layer default")
@pytest.mark.parametrize("options, fused", [
    (dict(), True),
    (dict(activation="geglu", num_shared_experts=1), True),
    (dict(activation="relu", weight_side="input"), True),        # Switch / Llama 4
    (dict(activation="clamped_swiglu", expert_bias=True, swiglu_limit=0.6,
          swiglu_alpha=1.3), True),                               # GPT-OSS (clamps bite)
    (dict(activation="gelu", expert_bias=True, weight_side="input", num_shared_experts=1),
     True),
    # a kernel named that lacks an option is passed over: for the next, or unfused
    (dict(expert_bias=True, implementation=("triton", "xla")), True),
    (dict(activation="relu", implementation=("triton", "reference")), False),
    (dict(capacity_factor=0.75), False),          # not dropless
])
def test_layer_default_runs_the_fused_loop_where_it_serves(options, fused, monkeypatch):
    """aristax.moe with implementation=None (or the names given) on the CPU runs the
    "xla" fused loop, or the unfused path where it does not serve, and equals
    implementation="reference": output, aux and gradients of x and every parameter."""
    options = dict(options)
    implementation = options.pop("implementation", None)
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=16, d_ff=24, **options)
    rng = np.random.default_rng(11)
    params = MoEParams(**{name: None if shape is None else jnp.asarray(
        rng.standard_normal(shape) * 0.3, jnp.float32)
        for name, shape in param_shapes(cfg).items()})
    x = jnp.asarray(rng.standard_normal((23, 16)), jnp.float32)
    calls = counting("xla", monkeypatch)

    def value_and_grads(implementation):
        config = cfg.replace(implementation=implementation)

        def loss(x, params):
            y, aux = moe(x, params, config)
            return jnp.sum(jnp.square(y)) + aux["loss"], (y, aux)
        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)

    got = value_and_grads(implementation)
    assert calls == ([1] if fused else [])
    want = value_and_grads("reference")
    for leaf, ref in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        scale = max(1.0, float(jnp.max(jnp.abs(ref))))
        chex.assert_trees_all_close(leaf, ref, atol=1e-5 * scale, rtol=1e-5)


def test_numpy_operands_run_eagerly():
    """NumPy weights (as a user's loaded checkpoint, or moe() with np.asarray params)
    reach the loop as NumPy arrays: indexed by a traced expert they must not be
    converted (this raised TracerArrayConversionError)."""
    T, D, F, E, K = 9, 8, 12, 3, 2
    rng = np.random.default_rng(5)
    x, weights = rng.standard_normal((T, D)), rng.uniform(0.1, 1, (T, K))
    gate, up, down = (rng.standard_normal(s) for s in ((E, D, F), (E, D, F), (E, F, D)))
    x, weights, gate, up, down = (a.astype(np.float32) for a in (x, weights, gate, up, down))
    order, sizes, _ = routings(T, E, K, rng)["random"]
    y = moe_mlp(x, order, weights, sizes, gate, up, down, activation="swiglu",
                implementation="xla")
    want, _ = numpy_swiglu(x, order, weights, sizes, None, gate, up, down, np.zeros_like(x))
    np.testing.assert_allclose(np.asarray(y), want, rtol=1e-5, atol=1e-5)


def numpy_mlp(x, order, weights, sizes, nv, gate, up, down, biases, activation, input_weights,
              limit=7.0, alpha=1.702):
    """y of the general expert MLP by a loop over the routed rows (float64, NumPy):
    the activations written out from their papers' formulas, biases per expert, the
    weight on the input row or on the output."""
    erf = np.vectorize(math.erf)  # the exact GELU's
    x, weights = np.asarray(x, np.float64), np.asarray(weights, np.float64)
    T, K = weights.shape
    gb, ub, db = (None if b is None else np.asarray(b, np.float64) for b in biases)
    expert = np.repeat(np.arange(len(sizes)), sizes)
    y = np.zeros_like(x)
    for m in range(int(nv)):
        s, e = int(order[m]), expert[m]
        t, w = s // K, weights.flat[s]
        a = w * x[t] if input_weights else x[t]
        u = a @ np.asarray(up[e], np.float64) + (0 if ub is None else ub[e])
        g = None if gate is None else a @ np.asarray(gate[e], np.float64) + (
            0 if gb is None else gb[e])
        sig = lambda v: 1 / (1 + np.exp(-v))  # noqa: E731
        gelu = lambda v: 0.5 * v * (1 + erf(v / np.sqrt(2)))  # noqa: E731
        h = {"swiglu": lambda: g * sig(g) * u, "geglu": lambda: gelu(g) * u,
             "gelu": lambda: gelu(u), "relu": lambda: np.maximum(u, 0),
             "clamped_swiglu": lambda: (np.clip(u, -limit, limit) + 1)
             * np.minimum(g, limit) * sig(alpha * np.minimum(g, limit))}[activation]()
        o = h @ np.asarray(down[e], np.float64) + (0 if db is None else db[e])
        y[t] += o if input_weights else w * o
    return y


EXTRA_CASES = [  # (activation, expert biases, weight side)
    ("clamped_swiglu", True, "output"),  # GPT-OSS
    ("relu", False, "input"),
    ("swiglu", True, "input"),
    ("gelu", True, "output"),
    ("geglu", False, "input"),           # Llama 4 uses swiglu; every activation runs
]


def extra_operands(shape, activation, biased, seed, dtype=jnp.float32):
    T, D, F, E, K = shape
    rng = np.random.default_rng(seed)
    normal = lambda *s: jnp.asarray(rng.standard_normal(s) * 0.5, dtype)  # noqa: E731
    gated = activation not in ("gelu", "relu")
    ops = dict(x=normal(T, D) * 2, weights=jnp.asarray(rng.uniform(0.1, 1, (T, K)), dtype),
               gate=normal(E, D, F) if gated else None, up=normal(E, D, F), down=normal(E, F, D),
               biases=(normal(E, F) if biased and gated else None,
                       normal(E, F) if biased else None, normal(E, D) if biased else None))
    return ops, jnp.asarray(rng.standard_normal((T, D)), dtype), rng


def extras_vjp(implementation, activation, side, limit):
    def f(x, weights, gate, up, down, biases, order, sizes, nv, dy):
        def op(x, weights, gate, up, down, biases):
            return moe_mlp(x, order, weights, sizes, gate, up, down, activation=activation,
                           num_valid=nv, gate_bias_ef=biases[0], up_bias_ef=biases[1],
                           down_bias_ed=biases[2], weight_side=side, swiglu_limit=limit,
                           swiglu_alpha=1.3, implementation=implementation,
                           tiles=XlaTiles(16, 8) if implementation == "xla" else None)
        y, pullback = jax.vjp(op, x, weights, gate, up, down, biases)
        return y, pullback(dy)
    return jax.jit(f)


@pytest.mark.parametrize("activation, biased, side", EXTRA_CASES)
def test_extras_equal_numpy_and_the_reference_gradients(activation, biased, side):
    """The options the GPU kernels do not compute (ReLU, GPT-OSS's clamped SwiGLU,
    expert biases, input-side weights) on the fused loop: y equals a NumPy loop over
    the routed rows, and y with the gradients of x, weights, every weight and bias
    equal autodiff of the unfused reference composition, on every hard routing."""
    # output-side weights scale h's rows in down's weight gradient where F < D
    T, D, F, E, K = shape = (37, 12, 20, 5, 2) if side == "input" else (37, 20, 12, 5, 2)
    ops, dy, rng = extra_operands(shape, activation, biased, seed=len(activation))
    limit = 0.8  # small: the clamps bite on these values
    got_fn, want_fn = (extras_vjp(n, activation, side, limit) for n in ("xla", "reference"))
    for case, (order, sizes, nv) in routings(T, E, K, rng).items():
        args = (*ops.values(), order, sizes, nv, dy)
        got, want = got_fn(*args), want_fn(*args)
        y_np = numpy_mlp(ops["x"], order, ops["weights"], sizes, nv, ops["gate"], ops["up"],
                         ops["down"], ops["biases"], activation, side == "input", limit, 1.3)
        np.testing.assert_allclose(np.asarray(got[0]), y_np, rtol=1e-4, atol=1e-4,
                                   err_msg=case)
        gated = ops["gate"] is not None  # y, 4 or 5 weights' and 0, 2 or 3 biases' grads
        assert len(jax.tree.leaves(got)) == len(jax.tree.leaves(want)) == (
            5 + gated + biased * (2 + gated))
        for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
            scale = max(1.0, float(np.abs(b).max(initial=0.0)))
            np.testing.assert_allclose(np.asarray(a), b, rtol=1e-4, atol=1e-5 * scale,
                                       err_msg=f"{case}: leaf {i}")


def test_extras_gradients_equal_central_differences_in_float64():
    """In float64, the fused loop's gradient with every option on (clamped SwiGLU,
    biases, input-side weights) along a random direction equals central differences
    of its own forward: a check independent of any autodiff."""
    T, D, F, E, K = shape = (19, 6, 8, 3, 2)
    with jax.enable_x64(True):
        ops, dy, rng = extra_operands(shape, "clamped_swiglu", True, seed=3, dtype=jnp.float64)
        order, sizes, nv = routings(T, E, K, rng)["random"]
        fn = extras_vjp("xla", "clamped_swiglu", "input", 0.8)
        y, grads = fn(*ops.values(), order, sizes, nv, dy)
        primals = tuple(ops.values())
        direction = jax.tree.map(lambda a: jnp.asarray(rng.standard_normal(a.shape)), primals)
        eps = 1e-6
        moved = [fn(*jax.tree.map(lambda a, d: a + sign * eps * d, primals, direction),
                    order, sizes, nv, dy)[0] for sign in (1, -1)]
        numeric = jnp.sum(dy * (moved[0] - moved[1])) / (2 * eps)
        analytic = sum(jnp.sum(g * d) for g, d in zip(jax.tree.leaves(grads),
                                                        jax.tree.leaves(direction)))
        np.testing.assert_allclose(analytic, numeric, rtol=1e-6)


def test_extras_bfloat16_follow_the_reference():
    """bf16 tokens and parameters with biases and input-side weights: the loop rounds
    where the unfused composition does (rows, h and the biases' sums)."""
    T, D, F, E, K = shape = (29, 16, 24, 4, 2)
    ops, dy, rng = extra_operands(shape, "swiglu", True, seed=9, dtype=jnp.bfloat16)
    order, sizes, nv = routings(T, E, K, rng)["random"]
    args = (*ops.values(), order, sizes, nv, dy.astype(jnp.float32))
    got = extras_vjp("xla", "swiglu", "input", 7.0)(*args)
    want = extras_vjp("reference", "swiglu", "input", 7.0)(*args)
    for i, (a, b) in enumerate(zip(jax.tree.leaves(got), jax.tree.leaves(want))):
        assert a.dtype == b.dtype, i
        a, b = np.asarray(a, np.float32), np.asarray(b, np.float32)
        scale = max(1.0, float(np.abs(b).max()))
        np.testing.assert_allclose(a, b, rtol=2e-2, atol=2e-2 * scale, err_msg=f"leaf {i}")
