"""aristax.MoE against the per-token reference in tests/moe_reference.py."""

from __future__ import annotations

import dataclasses
import functools
import itertools

import chex
import hypothesis
import hypothesis.strategies as st
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_reference as ref
from aristax import MoE, MoEConfig, MoEParams, moe
from aristax import dispatch as dispatch_lib
from aristax.routing import Routing

ROUTER_CASES = {
    "mixtral": dict(router="softmax_topk", normalize_weights=True),
    "switch_top1": dict(router="softmax_topk", top_k=1),
    "topk_softmax": dict(router="topk_softmax", top_k=3),
    "sigmoid_groups": dict(router="sigmoid", normalize_weights=True, num_groups=4,
                           topk_groups=2, routed_scaling_factor=2.5),
    "expert_choice": dict(router="expert_choice", top_k=2),
    "expert_choice_cf": dict(router="expert_choice", top_k=1, capacity_factor=1.5),
}
ACTIVATIONS = ("swiglu", "geglu", "gelu")


def make(cfg: MoEConfig, seed: int = 0):
    module = MoE(cfg, rngs=nnx.Rngs(seed))
    # Larger router weights than the init so routing is decisive and varied.
    module.router.weight_de[...] = jax.random.normal(
        jax.random.key(seed + 100), module.router.weight_de.shape) * 0.5
    return module


def param_dict(module: MoE) -> dict:
    p = module.params()
    return {f.name: getattr(p, f.name) for f in dataclasses.fields(p)}


@nnx.jit
def apply(module, x):
    return module(x)


def check_against_reference(cfg, x, module=None, bias=None, atol=2e-5, rtol=2e-5):
    module = module or make(cfg)
    y, aux = apply(module, x)
    p = param_dict(module)
    pl = ref.plan(x, p["router_de"], cfg, bias=bias)
    y_ref = ref.forward(x, p, cfg, pl)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=atol, rtol=rtol)
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), pl["load"])
    assert int(aux["num_dropped"]) == pl["dropped"]
    expected_fraction = pl["dropped"] / max(pl["routed"], 1)
    np.testing.assert_allclose(float(aux["dropped_fraction"]), expected_fraction, rtol=1e-6)
    return y, aux, pl


@pytest.mark.parametrize("case", sorted(ROUTER_CASES))
@pytest.mark.parametrize("activation", ACTIVATIONS)
def test_forward_matches_per_token_loop(case, activation):
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=24, activation=activation)
    cfg = cfg.replace(**ROUTER_CASES[case])
    x = jax.random.normal(jax.random.key(1), (13, 16))
    check_against_reference(cfg, x)


@pytest.mark.parametrize("policy", ["position", "probability"])
@pytest.mark.parametrize("factor", [0.5, 1.0, 1.25])
def test_capacity_drops_counted_exactly(policy, factor):
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, normalize_weights=True,
                    capacity_factor=factor, drop_policy=policy)
    x = jax.random.normal(jax.random.key(2), (21, 8))
    _, aux, pl = check_against_reference(cfg, x)
    if factor < 1:
        assert pl["dropped"] > 0  # the case really exercises drops


def test_vmap_over_tokens_says_how_to_batch_instead():
    """jax.lax.ragged_dot (the reference backend) cannot be vmapped with shared weights
    (jax 0.10 and 0.11); the error says what to do, and the layer on the flattened batch
    is what vmap would be."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, implementation="reference")
    params = make(cfg).params()
    x = jax.random.normal(jax.random.key(0), (3, 5, 8))
    with pytest.raises(NotImplementedError, match=r"vmap.*all tokens at once.*lax\.map"):
        jax.vmap(lambda xb: moe(xb, params, cfg)[0])(x)
    looped = jax.lax.map(lambda xb: moe(xb, params, cfg)[0], x)
    flat = moe(x.reshape(15, 8), params, cfg)[0].reshape(3, 5, 8)
    np.testing.assert_allclose(looped, flat, rtol=1e-6, atol=1e-6)


def test_vmap_over_tokens_runs_on_the_xla_grouped_gemm():
    """The CPU default grouped GEMM (a loop of dense products) batches under jax.vmap
    with shared weights: values and weight gradients equal a jax.lax.map loop."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, implementation="xla")
    params = make(cfg).params()
    x = jax.random.normal(jax.random.key(3), (3, 5, 8))

    def loss(params, batched):
        ys = batched(lambda xb: moe(xb, params, cfg)[0], x)
        return jnp.sum(jnp.sin(ys)), ys

    vmapped = jax.grad(loss, has_aux=True)(params, lambda f, x: jax.vmap(f)(x))
    looped = jax.grad(loss, has_aux=True)(params, jax.lax.map)
    jax.tree.map(lambda a, b: np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6),
                 vmapped, looped)


def test_capacity_is_the_exact_ceiling_of_the_decimal_factor():
    """C = ceil(tenths/10 * T * K / E) in integers; the float product (1.1 * 100 / 2 =
    55.00000000000001) gave one slot too many in 1,677 of 387,072 cases."""
    for tenths in (3, 7, 10, 11, 12, 13, 25):
        for T, K, E in itertools.product(range(1, 121), (1, 2, 3), (2, 3, 4, 6, 8)):
            cfg = MoEConfig(num_experts=E, top_k=min(K, E), d_model=4, d_ff=4,
                            capacity_factor=tenths / 10)
            expected = max(1, -(-tenths * T * min(K, E) // (10 * E)))
            assert cfg.capacity(T) == expected, (tenths, T, K, E)


def test_probability_policy_serves_every_top1_choice_before_any_top2():
    """V-MoE batch prioritized routing: tokens ordered by their highest weight, then the
    K rounds as "position". Token 1's second choice (0.45) outweighs token 0's first
    choice of expert 1 (0.40) but must not take its place (capacity 1)."""
    ids = jnp.asarray([[1, 0], [0, 1]], jnp.int32)
    weights = jnp.asarray([[0.40, 0.35], [0.55, 0.45]], jnp.float32)
    routing = Routing(expert_ids=ids, weights=weights, mask=jnp.ones((2, 2), bool),
                      probs=jnp.full((2, 2), 0.5), logits=jnp.zeros((2, 2)))
    d = dispatch_lib.capacity_dispatch(routing, 1, "probability")
    np.testing.assert_array_equal(d.kept, [[True, False], [True, False]])
    assert int(d.num_dropped) == 2
    # token order by top weight: token 1 (0.55) before token 0 (0.40) in each round
    d = dispatch_lib.capacity_dispatch(
        routing.replace(expert_ids=jnp.asarray([[0, 1], [0, 1]])), 1, "probability")
    np.testing.assert_array_equal(d.kept, [[False, False], [True, True]])


@pytest.mark.parametrize("n,num_keys", [(0, 5), (1, 1), (7, 1), (37, 3), (2048, 9),
                                         (32768, 65), (6, 2 ** 30)])
def test_stable_order_equals_numpy_stable_argsort(n, num_keys):
    """dispatch.stable_order (one packed int32 sort; argsort where key * n + position
    would overflow int32, the last case) against NumPy's stable argsort on fresh keys:
    random, all equal, all the largest key, and per row of a batch under jit and vmap."""
    rng = np.random.default_rng(n + num_keys)
    cases = [rng.integers(0, num_keys, n), np.zeros(n, np.int64), np.full(n, num_keys - 1)]
    for keys in cases:
        got = dispatch_lib.stable_order(jnp.asarray(keys, jnp.int32), num_keys)
        assert got.dtype == jnp.int32
        np.testing.assert_array_equal(got, np.argsort(keys, kind="stable"))
    batch = rng.integers(0, num_keys, (3, n))
    want = np.argsort(batch, axis=-1, kind="stable")
    jitted = jax.jit(lambda k: dispatch_lib.stable_order(k, num_keys))
    np.testing.assert_array_equal(jitted(jnp.asarray(batch, jnp.int32)), want)
    np.testing.assert_array_equal(jax.vmap(jitted)(jnp.asarray(batch, jnp.int32)), want)


def _steer(x, router_de, expert, strength):
    """Feature 0 of x set to 5 and router row 0 pushing ``expert`` by ``strength``."""
    x = x.at[:, 0].set(5.0)
    return x, router_de.at[0, expert].set(strength)


@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_expert_with_no_tokens(capacity_factor):
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, capacity_factor=capacity_factor)
    module = make(cfg)
    x, w = _steer(jax.random.normal(jax.random.key(3), (9, 8)),
                  module.router.weight_de[...], expert=2, strength=-8.0)
    module.router.weight_de[...] = w
    _, aux, _ = check_against_reference(cfg, x, module)
    assert int(aux["expert_load"][2]) == 0


@pytest.mark.parametrize("top_k", [1, 2])
@pytest.mark.parametrize("capacity_factor", [None, 1.0])
def test_every_token_on_one_expert(top_k, capacity_factor):
    cfg = MoEConfig(num_experts=4, top_k=top_k, d_model=8, d_ff=8,
                    capacity_factor=capacity_factor)
    module = make(cfg)
    x, w = _steer(jax.random.normal(jax.random.key(4), (11, 8)),
                  module.router.weight_de[...], expert=1, strength=6.0)
    module.router.weight_de[...] = w
    _, aux, pl = check_against_reference(cfg, x, module)
    assert int(aux["expert_load"][1]) == 11
    if capacity_factor is not None:
        assert pl["dropped"] > 0


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_k_equals_e(router):
    cfg = MoEConfig(num_experts=4, top_k=4, d_model=8, d_ff=8, router=router,
                    normalize_weights=True)
    x = jax.random.normal(jax.random.key(5), (7, 8))
    _, aux, _ = check_against_reference(cfg, x)
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), [7, 7, 7, 7])


def test_leading_shape_and_shared_experts():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, num_shared_experts=2,
                    shared_d_ff=4)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(6), (2, 3, 5, 8))
    y, aux = apply(module, x)
    assert y.shape == x.shape and aux["router_logits"].shape == (2, 3, 5, 4)
    assert module.shared_experts.up_df.shape == (8, 8)
    flat = x.reshape(-1, 8)
    p = param_dict(module)
    y_ref = ref.forward(flat, p, cfg, ref.plan(flat, p["router_de"], cfg))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 8), np.asarray(y_ref), atol=2e-5)


def test_bfloat16_inputs_accumulate_in_float32():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=64, d_ff=128, normalize_weights=True)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(7), (16, 64))
    y16, _ = apply(module, x.astype(jnp.bfloat16))
    assert y16.dtype == jnp.bfloat16
    p = param_dict(module)
    xb = x.astype(jnp.bfloat16).astype(jnp.float32)
    p16 = {k: None if v is None else v.astype(jnp.bfloat16).astype(jnp.float32)
           for k, v in p.items()}
    p16["router_de"] = p["router_de"]
    y_ref = ref.forward(xb, p16, cfg, ref.plan(xb, p["router_de"], cfg))
    err = np.abs(np.asarray(y16, np.float32) - np.asarray(y_ref))
    scale = np.abs(np.asarray(y_ref)).max()
    # bf16 output rounding is 2^-8 relative; float32 accumulation keeps the error there.
    assert err.max() <= 2 ** -7 * scale, (err.max(), scale)


GRADIENT_CASES = {
    **{name: (dict(case), ACTIVATIONS[i % 3]) for i, (name, case) in enumerate(
        sorted(ROUTER_CASES.items()))},
    "capacity_position": (dict(capacity_factor=0.75, normalize_weights=True), "geglu"),
    "capacity_probability": (dict(capacity_factor=0.75, drop_policy="probability"), "gelu"),
}


@pytest.mark.parametrize("case", sorted(GRADIENT_CASES))
def test_gradients_match_per_token_loop(case):
    overrides, activation = GRADIENT_CASES[case]
    cfg = MoEConfig(**{**dict(num_experts=8, top_k=2, d_model=6, d_ff=8, activation=activation,
                              num_shared_experts=1), **overrides})
    module = make(cfg)
    with jax.enable_x64(True):
        p = {k: None if v is None else jnp.asarray(v, jnp.float64)
             for k, v in param_dict(module).items()}
        x = jax.random.normal(jax.random.key(8), (8, 6), jnp.float64)
        ct = jax.random.normal(jax.random.key(9), (8, 6), jnp.float64)
        pl = ref.plan(x, p["router_de"], cfg)
        if case.startswith("capacity"):
            assert pl["dropped"] > 0

        def ours(x, p):
            return jnp.sum(moe(x, MoEParams(**p), cfg)[0] * ct)

        def theirs(x, p):
            return jnp.sum(ref.forward(x, p, cfg, pl, xnp=jnp) * ct)

        g = jax.jit(jax.grad(ours, argnums=(0, 1)))(x, p)
        g_ref = jax.jit(jax.grad(theirs, argnums=(0, 1)))(x, p)
    chex.assert_trees_all_close(g, g_ref, atol=1e-10, rtol=1e-8)  # all float64
    assert np.abs(np.asarray(g[1]["router_de"])).max() > 0  # router gets a gradient


@hypothesis.settings(max_examples=8, deadline=None)
@hypothesis.given(
    T=st.integers(1, 17), E=st.integers(1, 9), k_frac=st.floats(0, 1), D=st.integers(1, 9),
    F=st.integers(1, 9), cap=st.sampled_from([None, 0.5, 1.0, 2.0]), seed=st.integers(0, 99),
    router=st.sampled_from(["softmax_topk", "topk_softmax", "sigmoid", "expert_choice"]),
)
def test_hypothesis_sizes(T, E, k_frac, D, F, cap, seed, router):
    K = 1 + int(k_frac * (E - 1))
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, capacity_factor=cap,
                    normalize_weights=router != "expert_choice", router=router)
    x = jax.random.normal(jax.random.key(seed), (T, D))
    check_against_reference(cfg, x, make(cfg, seed))


# label: (changes to moe's arguments, the error's words); x is [6, 8], params fit cfg
BAD_INPUTS = {
    "x too narrow": (lambda a: dict(x=a["x"][:, :7]), r"x has shape \(6, 7\).*d_model=8"),
    "x not flat": (lambda a: dict(x=a["x"].reshape(2, 3, 8)), r"x has shape \(2, 3, 8\)"),
    "no tokens": (lambda a: dict(x=a["x"][:0]), r"no tokens \(T=0\)"),
    "integer x": (lambda a: dict(x=a["x"].astype(jnp.int32)), "x has dtype int32"),
    "more experts": (lambda a: dict(config=a["config"].replace(num_experts=8)),
                     r"params\.router_de has shape \(8, 4\).*needs \(8, 8\)"),
    "wider experts": (lambda a: dict(config=a["config"].replace(d_ff=16)),
                      r"params\.up_edf has shape \(4, 8, 8\).*needs \(4, 8, 16\)"),
    "gate for gelu": (lambda a: dict(config=a["config"].replace(activation="gelu")),
                      r"params\.gate_edf has shape \(4, 8, 8\).*needs None"),
    "no shared experts": (lambda a: dict(config=a["config"].replace(num_shared_experts=1)),
                          r"params\.shared_up_df has shape None.*needs \(8, 8\)"),
    "bias": (lambda a: dict(bias=jnp.zeros(3)), r"bias has shape \(3,\)"),
    # complex weights lost their imaginary part, integer ones were taken, silently
    "complex weights": (lambda a: dict(params=a["params"].replace(
        down_efd=a["params"].down_efd.astype(jnp.complex64) + 5j)),
        r"params\.down_efd has dtype complex64.*astype\(jnp\.float32\)"),
    "integer weights": (lambda a: dict(params=a["params"].replace(
        router_de=a["params"].router_de.astype(jnp.int32))), r"params\.router_de has dtype int32"),
    "seq_len": (lambda a: dict(seq_len=4), "seq_len=4 must be a positive divisor of the T=6"),
    "seq_len zero": (lambda a: dict(seq_len=0), "seq_len=0 must be a positive divisor"),
}


@pytest.mark.parametrize("layer", ["moe", "chunked_moe", "jit"])
@pytest.mark.parametrize("label", sorted(BAD_INPUTS))
def test_bad_inputs_name_the_argument(layer, label):
    """``moe`` (also chunked, and under ``jax.jit``: the check runs while tracing)
    rejects inputs that do not fit the config with a ValueError that names them."""
    from aristax.parallel.overlap import chunked_moe

    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8)
    args = dict(x=jnp.ones((6, 8)), params=make(cfg).params(), config=cfg)
    change, words = BAD_INPUTS[label]
    args |= change(args)
    forward = {"moe": moe, "chunked_moe": functools.partial(chunked_moe, num_chunks=2),
               "jit": jax.jit(moe, static_argnames=("config", "seq_len"))}[layer]
    with pytest.raises(ValueError, match=words):
        forward(**args)


def test_arguments_of_the_wrong_type_say_what_they_must_be():
    """Swapped arguments, a dict of weights or a list of tokens raise a TypeError that
    names the argument (they were AttributeErrors from deep inside)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8)
    layer = make(cfg)
    x, params = jnp.ones((6, 8)), layer.params()
    with pytest.raises(TypeError, match="config must be a MoEConfig, got MoEParams"):
        moe(x, cfg, params)
    with pytest.raises(TypeError, match="params must be MoEParams.*got dict"):
        moe(x, dataclasses.asdict(params), cfg)
    with pytest.raises(TypeError, match=r"x must be an array, got list; pass jnp.asarray"):
        layer([[0.0] * 8])
    with pytest.raises(TypeError, match=r"seq_len=3.0 must be a Python or NumPy integer"):
        moe(x, params, cfg, seq_len=3.0)


def test_traced_config_and_symbolic_tokens_say_the_fix():
    """A user trial: ``jax.jit(moe)(x, params, config)`` said "config must be a
    MoEConfig, got DynamicJaxprTracer" though one was passed, and ``jax.export`` with a
    symbolic token count failed inside the sort with JAX's InconclusiveDimensionOperation.
    Both now say what to do."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8)
    x, params = jnp.ones((6, 8)), make(cfg).params()
    with pytest.raises(TypeError, match="config is a traced value.*static_argnames='config'"):
        jax.jit(moe)(x, params, cfg)
    assert jax.jit(moe, static_argnames="config")(x, params, cfg)[0].shape == (6, 8)
    T, = jax.export.symbolic_shape("T")
    with pytest.raises(ValueError, match="x has symbolic shape.*one program per token count"):
        jax.export.export(jax.jit(lambda x, p: moe(x, p, cfg)[0]))(
            jax.ShapeDtypeStruct((T, 8), jnp.float32), params)


@pytest.mark.parametrize("overrides", [dict(implementation="reference"),
                                       dict(capacity_factor=0.75), dict()])
def test_second_derivative_equals_loop_or_names_the_fix(overrides):
    """grad of grad (w.r.t. x, of a loss of the input gradient) equals the per-token
    loop's, float64, where the path's backward is differentiable ("reference"; the
    capacity path's small grouped GEMMs, whose loops have static trip counts); on the
    CPU default (the fused "xla" loop, trip counts traced) it raises a
    NotImplementedError naming implementation='reference' (a user trial: JAX's
    "Reverse-mode differentiation does not work for lax.while_loop" before)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=6, d_ff=8, **overrides)
    module = make(cfg)
    with jax.enable_x64(True):
        p = {k: None if v is None else jnp.asarray(v, jnp.float64)
             for k, v in param_dict(module).items()}
        x = jax.random.normal(jax.random.key(3), (10, 6), jnp.float64)
        pl = ref.plan(x, p["router_de"], cfg)

        def grad_of_grad(forward):
            def input_grad_norm(x):
                return jnp.sum(jax.grad(lambda x: jnp.sum(forward(x) ** 2))(x) ** 2)
            return jax.grad(input_grad_norm)(x)

        want = grad_of_grad(lambda x: ref.forward(x, p, cfg, pl, xnp=jnp))
        if not overrides:
            with pytest.raises(NotImplementedError,
                               match="moe_mlp: backend 'xla'.*implementation='reference'"):
                grad_of_grad(lambda x: moe(x, MoEParams(**p), cfg)[0])
            return
        got = grad_of_grad(lambda x: moe(x, MoEParams(**p), cfg)[0])
    assert np.abs(np.asarray(want)).max() > 0
    np.testing.assert_allclose(got, want, rtol=1e-8, atol=1e-10)


def test_seq_len_may_be_a_numpy_integer():
    """A user trial: seq_len=np.int64(3) of T=6 was refused as "must be a positive
    divisor of the T=6 tokens"; it now gives what seq_len=3 gives (per-sequence
    balance loss: not what one sequence of 6 gives)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, seq_aux_loss_coef=0.1)
    x = jax.random.normal(jax.random.key(5), (6, 8))
    params = make(cfg).params()
    want = moe(x, params, cfg, seq_len=3)[1]["seq_aux_loss"]
    got = moe(x, params, cfg, seq_len=np.int64(3))[1]["seq_aux_loss"]
    assert float(got) == float(want) != float(moe(x, params, cfg)[1]["seq_aux_loss"])


@pytest.mark.parametrize("implementation, names", [
    ("mosaic_gpu", ["mosaic_gpu", "reference"]),
    (["triton", "mosaic_gpu"], ["triton", "mosaic_gpu", "reference"]),
    (["reference", "triton"], ["reference", "triton"]),  # the user's order is kept
    ("not_a_permute_backend", ["reference"]),
])
def test_kernel_names_keep_order_and_end_in_reference(implementation, names):
    from aristax.pallas_kernels.frontdoor import with_reference
    from aristax.pallas_kernels.permute import api as permute_api

    assert with_reference(implementation, permute_api.BACKENDS) == names


@pytest.mark.parametrize("case", ["mixtral", "switch_top1", "topk_softmax", "sigmoid"])
def test_fused_routing_equals_router_and_dropless_dispatch(case):
    """``moe.fused_routing`` (the Triton route kernel, interpreted on CPU) gives the
    plain path's Routing and Dispatch: a NaN token, a selection bias, a scaling factor."""
    from aristax import routing as routing_lib
    from aristax.moe import fused_routing, router_logits

    kw = dict(ROUTER_CASES.get(case, {}))
    if case == "sigmoid":
        kw = dict(router="sigmoid", normalize_weights=True, routed_scaling_factor=2.5)
    cfg = MoEConfig(num_experts=6, top_k=kw.pop("top_k", 2), d_model=16, d_ff=8,
                    implementation="triton", **kw)
    T, E = 21, cfg.num_experts
    x = jax.random.normal(jax.random.key(0), (T, cfg.d_model)).at[5, 3].set(jnp.nan)
    w = jax.random.normal(jax.random.key(1), (cfg.d_model, E))
    bias = jax.random.normal(jax.random.key(2), (E,)) * 0.1

    @jax.jit
    def both(x, w, bias):
        plain = routing_lib.route(router_logits(x, w), cfg.router_config, bias=bias)
        return fused_routing(x, w, cfg, bias), (plain, dispatch_lib.dropless_dispatch(plain))

    (routing, dispatch), (routing_ref, dispatch_ref) = both(x, w, bias)
    assert int(dispatch.num_routed) == cfg.top_k * (T - 1)  # the NaN token goes nowhere
    for got, want in ((routing, routing_ref), (dispatch, dispatch_ref)):
        for name, a in vars(got).items():
            b = getattr(want, name)
            if jnp.issubdtype(a.dtype, jnp.floating):
                np.testing.assert_allclose(a, b, rtol=1e-5, atol=1e-6, err_msg=name)
            else:
                np.testing.assert_array_equal(a, b, err_msg=name)


def _plain_route_and_combine(x, w):
    """router_logits, route, dropless dispatch, combine: the plain path's products
    besides the expert GEMMs."""
    from aristax import dispatch as dispatch_lib
    from aristax import routing as routing_lib
    from aristax.moe import router_logits

    cfg = MoEConfig(num_experts=w.shape[1], top_k=3, d_model=x.shape[1], d_ff=8)
    routing = routing_lib.route(router_logits(x, w), cfg.router_config)
    dispatch = dispatch_lib.dropless_dispatch(routing)
    return dispatch_lib.combine(dispatch_lib.permute(x, dispatch), dispatch, routing.weights)


def _fused_route_and_combine(x, w):
    """The route and combine ops (reference backends; Triton's route kernel uses
    HIGHEST in its kernel)."""
    from aristax.pallas_kernels.permute import api as permute_api
    from aristax.pallas_kernels.route import api as route_api

    out = route_api.route(x, w, top_k=3, normalize=True, implementation="reference")
    rows = permute_api.permute(x, out.sort_order, top_k=3, implementation="reference")
    return permute_api.combine(rows, out.sort_order, out.weights, implementation="reference")


@pytest.mark.parametrize("path", [_plain_route_and_combine, _fused_route_and_combine])
def test_routing_and_combine_are_full_precision_under_any_jax_setting(path):
    """Routing and the K-way weighted combine (small; not GEMMs) are float32 products
    at HIGHEST, forward and backward, whatever ``jax.default_matmul_precision`` says
    (on a GPU "tensorfloat32", or JAX's default, would round them to TF32), as the
    route and combine kernels compute them exactly. The plain combine is elementwise
    (no dot at all); its router's logits, dx and dw are the three products left."""
    from cuda_export import dot_precisions

    def grads(x, w):
        return jax.grad(lambda x, w: jnp.sum(jnp.sin(path(x, w))), (0, 1))(x, w)

    x, w = jnp.ones((7, 16)), jnp.ones((16, 5))
    with jax.default_matmul_precision("tensorfloat32"):
        found = dot_precisions(grads, x, w)
    assert sum(found.values()) >= 3, found  # logits, dx, dw (and the fused combine's)
    assert {p.precision for p in found} == {("HIGHEST", "HIGHEST")}, found


def test_fused_routing_leaves_what_the_kernel_does_not_do_to_the_plain_path():
    from aristax.moe import fused_routing

    x, w = jnp.ones((8, 16)), jnp.ones((16, 8))
    base = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=8, implementation="triton")
    for cfg in (base.replace(implementation=None), base.replace(implementation="reference"),
                base.replace(capacity_factor=1.0), base.replace(router="expert_choice"),
                base.replace(router="sigmoid", num_groups=4, topk_groups=2)):
        assert fused_routing(x, w, cfg, None) is None, cfg
    assert fused_routing(x, w, base, None) is not None


@pytest.mark.cpu_backend  # the 8 host devices as JAX's default
@pytest.mark.parametrize("capacity_factor", [None, 0.75])
def test_data_parallel_on_an_explicit_mesh_equals_one_device(capacity_factor):
    """Tokens sharded over a mesh with Explicit axes (``jax.make_mesh``'s default, under
    ``jax.set_mesh``): the single-device layer runs there (sort and gather have no
    sharding rule on Explicit axes) and gives the reference's outputs, drops and
    gradients; y keeps x's row sharding."""
    from jax.sharding import NamedSharding, PartitionSpec as P

    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16,
                    capacity_factor=capacity_factor)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(5), (40, 8))
    y_ref, aux_ref, pl = check_against_reference(cfg, x, module)
    if capacity_factor is not None:
        assert pl["dropped"] > 0

    def loss(x, params):
        y, aux = moe(x, params, cfg)
        return jnp.sum(jnp.sin(y)) + aux["loss"], aux

    grads_ref = jax.grad(loss, argnums=(0, 1), has_aux=True)(x, module.params())[0]
    mesh = jax.make_mesh((8,), ("data",), axis_types=(jax.sharding.AxisType.Explicit,))
    with jax.set_mesh(mesh):
        xs = jax.device_put(x, NamedSharding(mesh, P("data")))
        y, aux = jax.jit(lambda x, p: moe(x, p, cfg))(xs, module.params())
        grads = jax.jit(jax.grad(loss, argnums=(0, 1), has_aux=True))(xs, module.params())[0]
        eager = jax.grad(loss, argnums=(0, 1), has_aux=True)(xs, module.params())[0]
        # an optimizer-like step on the mesh takes them (eager gradients of the
        # one-device weights came back typed on the mesh's Auto twin, and this raised)
        stepped = jax.tree.map(lambda p, g: p - 0.5 * g, module.params(), eager[1])
    assert y.sharding.spec[0] == "data"
    chex.assert_trees_all_close(eager, grads_ref, rtol=1e-5, atol=1e-6)
    chex.assert_trees_all_close(
        stepped, jax.tree.map(lambda p, g: p - 0.5 * g, module.params(), grads_ref[1]),
        rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(y, y_ref, rtol=1e-5, atol=1e-6)
    assert int(aux["num_dropped"]) == pl["dropped"]
    np.testing.assert_array_equal(aux["expert_load"], pl["load"])
    chex.assert_trees_all_close(grads, grads_ref, rtol=1e-5, atol=1e-6)


def test_capacity_drops_skip_the_nan_token():
    """A NaN token is routed nowhere: its K slots are neither routed nor dropped, so
    num_dropped (and the dropped fraction) equal the reference's count over the finite
    tokens."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, normalize_weights=True,
                    capacity_factor=0.75)
    x = jax.random.normal(jax.random.key(3), (15, 8)).at[4, 2].set(jnp.nan)
    _, aux, pl = check_against_reference(cfg, x)
    assert pl["routed"] == cfg.top_k * 14 and pl["dropped"] > 0
    assert int(aux["num_dropped"]) == pl["dropped"]


def test_probability_policy_ranks_by_the_largest_weight_not_slot_0():
    """With a selection bias the sigmoid router's slot 0 is the best biased score, not
    the largest weight: batch prioritized routing must rank tokens by max(weights)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, router="sigmoid",
                    capacity_factor=0.5, drop_policy="probability", bias_update_rate=0.1)
    module = make(cfg, seed=4)
    bias = jnp.asarray([0.3, -0.2, 0.1, -0.3], jnp.float32)
    module.router.balance_bias_e[...] = bias
    x = jax.random.normal(jax.random.key(4), (21, 8))
    _, _, pl = check_against_reference(cfg, x, module=module, bias=bias)
    assert pl["dropped"] > 0
    # guard: slot 0 is not the largest weight for some tokens
    logits = np.asarray(x, np.float64) @ np.asarray(module.router.weight_de[...], np.float64)
    w = ref.weights_np(logits, pl["ids"], cfg)
    assert sum(row[0] < max(row) for row in w) > 0


def test_temporary_memory_grows_with_tokens_not_with_experts_times_tokens():
    """The layer's forward + backward at E = 64 compiles to temporaries of a few
    [T*K + E*align, D + F] float32 buffers plus the weight gradients' accumulators,
    whatever E (on the CPU the fused "xla" moe_mlp loop: y and dx [T, D], the saved
    pre-activations, two [T*K + E*(align-1), F]): lax.ragged_dot's lowering on XLA:CPU (the
    "reference") masks its rows into [E, T*K, D], 200 times that at this shape."""
    from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api

    def temp_bytes(T, E, implementation=None, D=256, F=128, K=8):
        cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F,
                        implementation=implementation)
        s = jax.ShapeDtypeStruct
        p = MoEParams(router_de=s((D, E), jnp.float32), gate_edf=s((E, D, F), jnp.float32),
                      up_edf=s((E, D, F), jnp.float32), down_efd=s((E, F, D), jnp.float32))

        def grads(p, x):
            return jax.grad(lambda p, x: jnp.sum(moe(x, p, cfg)[0]), argnums=(0, 1))(p, x)
        analysis = jax.jit(grads).lower(p, s((T, D), jnp.float32)).compile().memory_analysis()
        align = ragged_dot_api.row_alignment(T * K, E, jnp.float32, implementation)
        rows = T * K + E * align
        return analysis.temp_size_in_bytes, 8 * rows * (D + F) * 4 + 2 * 3 * E * D * F * 4

    used, bound = temp_bytes(1024, 64)
    assert used <= bound
    used_2t, bound_2t = temp_bytes(2048, 64)
    assert used_2t <= bound_2t and used_2t < 2.2 * used  # linear in T
    if jax.default_backend() == "cpu":
        assert temp_bytes(1024, 64, "reference")[0] > 10 * bound  # the old lowering
