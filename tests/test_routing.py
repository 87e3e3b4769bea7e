"""Router options, losses and bad input: each test fails if its option is miswired."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_reference as ref
from aristax import MoE, MoEConfig, RouterConfig, route
from aristax.moe import moe, router_logits
from aristax.routing import (
    expert_counts,
    load_balancing_loss,
    router_z_loss,
    sequence_balance_loss,
    update_balance_bias,
)
from test_moe import apply, check_against_reference, make, param_dict


def _logits(T, E, seed=0, scale=2.0):
    return jax.random.normal(jax.random.key(seed), (T, E)) * scale


def test_balance_bias_changes_selection_not_weights():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=8, router="sigmoid",
                    normalize_weights=False, bias_update_rate=0.1)
    logits = _logits(32, 8)
    bias = jnp.zeros(8).at[5].set(10.0)  # expert 5 wins every selection
    plain = route(logits, cfg.router_config)
    biased = route(logits, cfg.router_config, bias=bias)
    assert bool(jnp.all(jnp.any(biased.expert_ids == 5, axis=1)))
    assert not bool(jnp.all(jnp.any(plain.expert_ids == 5, axis=1)))
    # Weights are the unbiased sigmoid scores of the selected experts.
    scores = jax.nn.sigmoid(logits)
    expected = jnp.take_along_axis(scores, biased.expert_ids, axis=1)
    np.testing.assert_allclose(np.asarray(biased.weights), np.asarray(expected), rtol=1e-6)
    # And the whole layer follows the reference that applies the bias to selection only.
    module = make(cfg)
    module.router.balance_bias_e[...] = bias
    x = jax.random.normal(jax.random.key(1), (12, 8))
    check_against_reference(cfg, x, module, bias=np.asarray(bias))


def test_balance_bias_update_sign_rule_and_not_a_param():
    cfg = MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, bias_update_rate=0.5)
    module = MoE(cfg, rngs=nnx.Rngs(0))
    module.update_balance_bias(jnp.array([10, 2, 2, 2]))
    np.testing.assert_allclose(np.asarray(module.router.balance_bias_e[...]),
                               [-0.5, 0.5, 0.5, 0.5])
    np.testing.assert_allclose(
        np.asarray(update_balance_bias(jnp.zeros(3), jnp.array([1, 1, 4]), 0.1)),
        [0.1, 0.1, -0.1], rtol=1e-6)
    params = nnx.state(module, nnx.Param)
    assert all("balance_bias" not in "/".join(map(str, path))
               for path, _ in nnx.to_flat_state(params))
    with pytest.raises(ValueError, match="bias_update_rate"):
        MoE(cfg.replace(bias_update_rate=0.0), rngs=nnx.Rngs(0)).update_balance_bias(
            jnp.ones(4))


@pytest.mark.parametrize("num_groups,topk_groups,top_k", [(4, 2, 3), (8, 3, 2), (2, 1, 2)])
def test_group_limited_selection_stays_in_top_groups(num_groups, topk_groups, top_k):
    E = 16
    cfg = MoEConfig(num_experts=E, top_k=top_k, d_model=4, d_ff=4, router="sigmoid",
                    num_groups=num_groups, topk_groups=topk_groups)
    logits = _logits(64, E, seed=3)
    routing = route(logits, cfg.router_config)
    scores = np.asarray(jax.nn.sigmoid(logits), np.float64)
    outside = 0
    for t in range(64):
        allowed = set(ref.allowed_experts(scores[t], num_groups, topk_groups))
        chosen = set(np.asarray(routing.expert_ids[t]).tolist())
        assert chosen <= allowed
        outside += sorted(range(E), key=lambda e: -scores[t, e])[0] not in allowed
    # Some token's globally best expert lies outside its top groups, so the limit bites.
    assert num_groups == 2 or outside > 0


def test_routed_scaling_factor_scales_weights_only():
    base = MoEConfig(num_experts=8, top_k=2, d_model=4, d_ff=4, router="sigmoid",
                     normalize_weights=True)
    logits = _logits(16, 8)
    r1 = route(logits, base.router_config)
    r2 = route(logits, base.replace(routed_scaling_factor=2.5).router_config)
    np.testing.assert_array_equal(np.asarray(r1.expert_ids), np.asarray(r2.expert_ids))
    np.testing.assert_allclose(np.asarray(r2.weights), 2.5 * np.asarray(r1.weights), rtol=1e-6)
    np.testing.assert_allclose(np.asarray(r1.weights.sum(-1)), 1.0, rtol=1e-6)


def test_topk_softmax_differs_from_softmax_topk():
    logits = _logits(16, 8)
    a = route(logits, MoEConfig(8, 2, 4, 4, router="topk_softmax").router_config)
    b = route(logits, MoEConfig(8, 2, 4, 4, router="softmax_topk").router_config)
    np.testing.assert_array_equal(np.asarray(a.expert_ids), np.asarray(b.expert_ids))
    np.testing.assert_allclose(np.asarray(a.weights.sum(-1)), 1.0, rtol=1e-6)
    assert float(jnp.max(b.weights.sum(-1))) < 0.999  # unnormalised softmax mass


def test_expert_choice_gives_every_expert_its_capacity():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=4, d_ff=4, router="expert_choice")
    routing = route(_logits(10, 4), cfg.router_config)
    per_expert = np.asarray(routing.mask.sum(0))
    np.testing.assert_array_equal(per_expert, [5, 5, 5, 5])  # ceil(10 * 2 / 4)
    assert int(routing.mask.sum(1).max()) > 2 or int(routing.mask.sum(1).min()) < 2


def test_expert_choice_counts_the_tokens_no_expert_chose():
    """Expert choice, K=1, E=4, T=16 (C = 4 per expert) with one NaN token: the tokens
    outside every expert's top-C by probability (NumPy) get y = 0 and are counted in
    aux["unchosen_tokens"]; the NaN token is counted as non-finite, not as unchosen.
    Token choice chooses every finite token."""
    T, E, C = 16, 4, 4
    cfg = MoEConfig(num_experts=E, top_k=1, d_model=8, d_ff=8, router="expert_choice")
    module = make(cfg, seed=3)
    x = jax.random.normal(jax.random.key(4), (T, 8)).at[5, 0].set(jnp.nan)
    y, aux = apply(module, x)
    logits = np.asarray(x, np.float64) @ np.asarray(module.router.weight_de[...], np.float64)
    good = np.isfinite(logits).all(axis=1)
    p = np.exp(logits - logits.max(axis=1, keepdims=True))
    p = np.where(good[:, None], p / p.sum(axis=1, keepdims=True), -1.0)
    chosen = np.zeros(T, bool)
    for e in range(E):
        chosen[np.argsort(-p[:, e], kind="stable")[:C]] = True
    unchosen = good & ~chosen
    assert unchosen.sum() > 0  # the case exercises it
    assert int(aux["unchosen_tokens"]) == unchosen.sum()
    assert int(aux["nonfinite_tokens"]) == 1
    np.testing.assert_array_equal(np.asarray(y)[unchosen], 0.0)
    assert (np.abs(np.asarray(y)[chosen & good]).sum(axis=1) > 0).all()
    _, aux_tc = apply(make(cfg.replace(router="softmax_topk"), seed=3), x)
    assert int(aux_tc["unchosen_tokens"]) == 0


def test_router_jitter_only_in_training_and_bounded():
    eps = 0.2
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, router_jitter=eps)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(2), (16, 8))
    w = module.router.weight_de[...]
    _, aux_a = module(x)
    _, aux_b = module(x)
    clean = x @ w
    assert not np.allclose(np.asarray(aux_a["router_logits"]), np.asarray(aux_b["router_logits"]))
    bound = eps * (jnp.abs(x) @ jnp.abs(w)) + 1e-5
    assert bool(jnp.all(jnp.abs(aux_a["router_logits"] - clean) <= bound))
    module.eval()
    y_eval, aux_eval = module(x)
    np.testing.assert_allclose(np.asarray(aux_eval["router_logits"]), np.asarray(clean),
                               rtol=1e-5, atol=1e-5)
    check_against_reference(cfg, x, module)


@pytest.mark.parametrize("masked", [False, True])
def test_load_balancing_loss_and_gradient_equal_hugging_face(masked):
    """The loss and its gradient w.r.t. the logits against torch autograd through HF's
    ``load_balancing_loss_func``; ``masked``: row_weights as HF's attention_mask."""
    torch = pytest.importorskip("torch")
    hf = pytest.importorskip("transformers.models.mixtral.modeling_mixtral")
    T, E, K = 40, 8, 2
    logits = _logits(T, E, seed=4)
    mask = (np.arange(T) % 5 != 0).astype(np.float32) if masked else None
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=4, d_ff=4, normalize_weights=True)

    def ours(lg):
        return load_balancing_loss(route(lg, cfg.router_config),
                                   None if mask is None else jnp.asarray(mask))

    loss, grad = jax.value_and_grad(ours)(logits)
    lg_t = torch.tensor(np.asarray(logits), requires_grad=True)
    theirs = hf.load_balancing_loss_func(
        (lg_t,), E, K, attention_mask=None if mask is None else torch.tensor(mask))
    theirs.backward()
    np.testing.assert_allclose(float(loss), float(theirs.detach()), rtol=1e-5)
    np.testing.assert_allclose(np.asarray(grad), lg_t.grad.numpy(), rtol=1e-4, atol=1e-7)


def test_z_loss_gradient_equals_torch():
    """ST-MoE eq. 5 differentiated by torch autograd, with and without a token mask."""
    torch = pytest.importorskip("torch")
    logits = _logits(24, 6, seed=7)
    mask = np.arange(24) % 4 != 1
    for m in (None, mask):
        grad = jax.grad(router_z_loss)(logits, None if m is None else jnp.asarray(m))
        lg_t = torch.tensor(np.asarray(logits), requires_grad=True)
        z = torch.logsumexp(lg_t, dim=-1) ** 2
        (z.mean() if m is None else z[torch.tensor(m)].mean()).backward()
        np.testing.assert_allclose(np.asarray(grad), lg_t.grad.numpy(), rtol=1e-5, atol=1e-7)


def test_z_loss_and_sequence_loss_against_numpy():
    T, E, K, S = 24, 6, 2, 8
    logits = _logits(T, E, seed=5)
    lg = np.asarray(logits, np.float64)
    lse = np.log(np.exp(lg).sum(-1))
    np.testing.assert_allclose(float(router_z_loss(logits)), np.mean(lse ** 2), rtol=1e-5)
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=4, d_ff=4, router="sigmoid")
    routing = route(logits, cfg.router_config)
    s = 1 / (1 + np.exp(-lg))
    s = s / s.sum(-1, keepdims=True)
    ids = np.asarray(routing.expert_ids)
    total = 0.0
    for b in range(T // S):
        rows = slice(b * S, (b + 1) * S)
        counts = np.bincount(ids[rows].ravel(), minlength=E)
        total += np.sum(E / (K * S) * counts * s[rows].mean(0))
    np.testing.assert_allclose(float(sequence_balance_loss(routing, S)), total / (T // S),
                               rtol=1e-5)


def test_aux_loss_is_weighted_sum_and_differentiable():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, lb_loss_coef=0.3,
                    z_loss_coef=0.01, seq_aux_loss_coef=0.2)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(6), (2, 6, 8))
    _, aux = apply(module, x)
    expected = 0.3 * aux["lb_loss"] + 0.01 * aux["z_loss"] + 0.2 * aux["seq_aux_loss"]
    np.testing.assert_allclose(float(aux["loss"]), float(expected), rtol=1e-6)

    def loss(m):
        return m(x)[1]["loss"]

    grads = nnx.jit(nnx.grad(loss))(module)
    assert float(jnp.abs(grads.router.weight_de[...]).max()) > 0


def test_nonfinite_logits_are_reported_and_isolated():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, normalize_weights=True)
    module = make(cfg)
    x = jax.random.normal(jax.random.key(7), (9, 8)).at[4, 0].set(jnp.nan)
    y, aux = apply(module, x)
    assert int(aux["nonfinite_tokens"]) == 1
    assert bool(jnp.all(y[4] == 0))
    good = np.r_[0:4, 5:9]
    p = param_dict(module)
    xg = x[good]
    y_ref = ref.forward(xg, p, cfg, ref.plan(xg, p["router_de"], cfg))
    np.testing.assert_allclose(np.asarray(y)[good], np.asarray(y_ref), atol=2e-5)
    with pytest.raises(FloatingPointError, match="non-finite"):
        make(cfg.replace(debug_checks=True))(x)
    with pytest.raises(jax.errors.JaxRuntimeError, match="non-finite"):  # as documented
        jax.block_until_ready(apply(make(cfg.replace(debug_checks=True)), x))


@pytest.mark.parametrize("implementation,shared", [(None, 0), ("triton", 0), (None, 1)])
def test_nonfinite_tokens_leave_the_gradients_alone(implementation, shared):
    """A NaN or inf token changes no parameter gradient: the gradients of a batch with
    two bad tokens equal those of the batch without them, through the outputs, the
    z-loss and the load-balancing loss (whose means over T scale by (T_good/T)^2).
    "triton" is the fused route kernel (interpreted on the CPU) with its custom_vjp.
    With a shared expert too (its dense MLP saw the bad rows and gave NaN)."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, normalize_weights=True,
                    implementation=implementation, num_shared_experts=shared)
    params = make(cfg).params()
    T, bad = 9, [4, 6]
    good = np.setdiff1d(np.arange(T), bad)
    x = jax.random.normal(jax.random.key(8), (T, 8))
    x_bad = x.at[4, 0].set(jnp.inf).at[6, 2].set(jnp.nan)
    ct = jax.random.normal(jax.random.key(9), (T, 8))

    def loss(p, x, ct, lb_scale):
        y, aux = moe(x, p, cfg)
        return jnp.sum(y * ct) + aux["z_loss"] + lb_scale * aux["lb_loss"]

    y_bad = jax.jit(lambda p, x: moe(x, p, cfg)[0])(params, x_bad)
    assert bool(jnp.all(y_bad[np.array(bad)] == 0))
    grad = jax.jit(jax.grad(loss))
    grads = grad(params, x_bad, ct, 1.0)
    expected = grad(params, x[good], ct[good], (len(good) / T) ** 2)
    names = ("router_de", "gate_edf", "up_edf", "down_efd")
    names += ("shared_gate_df", "shared_up_df", "shared_down_fd") if shared else ()
    for name in names:
        np.testing.assert_allclose(getattr(grads, name), getattr(expected, name),
                                   rtol=1e-5, atol=1e-6, err_msg=name)


@pytest.mark.parametrize("implementation", [None, "triton"])
@pytest.mark.parametrize("normalize", [True, False])
def test_sigmoid_router_with_underflowing_scores_stays_finite(implementation, normalize):
    """float32 sigmoid(l) is 0 below l ~ -104 (-87 where denormals flush): a token whose
    selected scores all underflow gets zero weights, where 0/0 gave NaN in y, in the
    balancing loss and in every gradient. Token 3's logits are all about -240."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, router="sigmoid",
                    normalize_weights=normalize, implementation=implementation)
    params = make(cfg).params()
    router = -0.5 + 0.2 * jax.random.normal(jax.random.key(2), params.router_de.shape)
    params = params.replace(router_de=router)
    x = jax.random.normal(jax.random.key(3), (6, 8)).at[3].set(60.0)
    assert float(router_logits(x, params.router_de)[3].max()) < -110

    def loss(p, x):
        y, aux = moe(x, p, cfg)
        return jnp.sum(y) + aux["loss"], (y, aux)

    grads, (y, aux) = jax.grad(loss, has_aux=True)(params, x)
    assert all(bool(jnp.all(jnp.isfinite(g))) for g in jax.tree.leaves(grads))
    assert bool(jnp.all(y[3] == 0)) and np.isfinite(float(aux["lb_loss"]))
    good = np.r_[0:3, 4:6]
    np.testing.assert_allclose(y[good], moe(x[good], params, cfg)[0], rtol=1e-5, atol=1e-6)


@pytest.mark.parametrize("field,kwargs", [
    ("top_k", dict(top_k=5)),
    ("top_k", dict(top_k=0)),
    ("num_groups", dict(num_groups=3)),
    ("topk_groups", dict(num_groups=2, topk_groups=3)),
    ("top_k", dict(num_groups=4, topk_groups=1, top_k=2)),
    ("router", dict(router="softmax")),
    ("activation", dict(activation="tanh")),
    ("group_score", dict(group_score="sum")),
    ("weight_norm_p", dict(weight_norm_p=0)),
    ("weight_norm_eps", dict(weight_norm_eps=-1e-6)),
    ("weight_side", dict(weight_side="both")),
    ("loss_convention", dict(loss_convention="switch")),
    ("swiglu_limit", dict(swiglu_limit=float("inf"))),
    # GPT-OSS's clamp and slope with an activation that ignores them (a user trial)
    ("swiglu_limit", dict(activation="swiglu", swiglu_limit=3.0)),
    ("swiglu_alpha", dict(activation="gelu", swiglu_alpha=1.0)),
    ("shared_expert_gate", dict(shared_expert_gate=True)),
    ("router_bias", dict(router_bias="yes")),
    ("capacity_factor", dict(capacity_factor=0.0)),
    ("capacity_factor", dict(capacity_factor=-1.0)),
    ("drop_policy", dict(drop_policy="random")),
    ("dtype", dict(dtype="float17")),
    ("seq_aux_loss_coef", dict(router="expert_choice", seq_aux_loss_coef=0.1)),
    ("drop_policy", dict(router="expert_choice", drop_policy="probability")),
    ("drop_policy", dict(drop_policy="probability")),  # dropless: it would do nothing
    ("shared_d_ff", dict(shared_d_ff=4)),  # no shared experts to size
    # settings the router would ignore
    ("normalize_weights", dict(router="expert_choice", normalize_weights=True)),
    ("weight_norm_p", dict(weight_norm_p=2.0)),  # normalize_weights is False
    ("weight_norm_eps", dict(weight_norm_eps=1e-6)),
    ("weight_norm_p", dict(router="topk_softmax", normalize_weights=True, weight_norm_p=3.0)),
    ("group_score", dict(group_score="max")),  # num_groups=1: no groups to score
    ("normalize_weights", dict(normalize_weights="false")),  # a truthy string
    ("debug_checks", dict(debug_checks="no")),
    ("capacity_factor", dict(capacity_factor=True)),
    ("param_dtype", dict(param_dtype="int8")),  # parameters must be floating
    ("param_dtype", dict(param_dtype="float64")),  # without 64-bit mode JAX makes float32
    ("num_chunks", dict(num_chunks=0)),
    ("top_k", dict(top_k=True)),
    ("routed_scaling_factor", dict(routed_scaling_factor=-1.0)),
    ("routed_scaling_factor", dict(routed_scaling_factor=float("nan"))),
    ("capacity_factor", dict(capacity_factor=float("inf"))),
    ("exchange", dict(exchange="bogus")),
    ("implementation", dict(implementation="tritn")),
    ("implementation", dict(implementation=["triton", "nope"])),
    ("implementation", dict(implementation=[])),
])
def test_bad_config_names_the_field(field, kwargs):
    base = dict(num_experts=4, top_k=2, d_model=8, d_ff=8)
    with pytest.raises(ValueError, match=rf"MoEConfig\.{field}="):
        MoEConfig(**{**base, **kwargs})


def test_routing_settings_are_accepted_where_they_act():
    base = dict(num_experts=4, top_k=2, d_model=8, d_ff=8)
    MoEConfig(**base, normalize_weights=True, weight_norm_p=2.0, weight_norm_eps=1e-6)
    MoEConfig(**base, router="sigmoid", normalize_weights=True, weight_norm_eps=1e-20)
    MoEConfig(**base, router="topk_softmax", normalize_weights=True)  # the identity
    MoEConfig(**base, num_groups=2, group_score="max")


def test_route_names_a_config_of_the_wrong_type():
    """A user trial: route(logits, MoEConfig) routed token choice silently and failed
    for expert choice with an AttributeError; a list bias failed with another. A
    MoEConfig is refused naming router_config; a list bias is taken as an array."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8)
    logits = jax.random.normal(jax.random.key(0), (6, 4))
    with pytest.raises(TypeError, match="cfg must be a RouterConfig, got MoEConfig; .*"
                                        "router_config"):
        route(logits, cfg)
    bias = [0.0, 0.0, 0.0, 5.0]
    got = route(logits, cfg.router_config, bias=bias)
    want = route(logits, cfg.router_config, bias=jnp.asarray(bias))
    np.testing.assert_array_equal(np.asarray(got.expert_ids), np.asarray(want.expert_ids))
    assert np.all(np.any(np.asarray(got.expert_ids) == 3, axis=1))  # the bias picks 3


@pytest.mark.parametrize("field,kwargs", [
    ("router", dict(router="foo")),
    ("top_k", dict(top_k=5)),
    ("top_k", dict(top_k=0)),
    ("num_groups", dict(num_groups=3)),
    ("routed_scaling_factor", dict(routed_scaling_factor=0.0)),
    ("expert_capacity_factor", dict(expert_capacity_factor=-2.0)),
    ("normalize_weights", dict(normalize_weights="yes")),
])
def test_bad_router_config_names_the_field(field, kwargs):
    with pytest.raises(ValueError, match=rf"RouterConfig\.{field}="):
        RouterConfig(**{**dict(num_experts=4, top_k=2), **kwargs})


def test_configs_take_numpy_scalars_as_python_numbers():
    """np.int64 counts (from a NumPy sweep, say) were refused as "not a positive integer";
    now they equal (and hash as) the Python numbers."""
    plain = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8, lb_loss_coef=0.5,
                      normalize_weights=True)
    from_numpy = MoEConfig(num_experts=np.int64(4), top_k=np.int32(2), d_model=8, d_ff=8,
                           lb_loss_coef=np.float32(0.5), normalize_weights=np.bool_(True))
    assert from_numpy == plain and hash(from_numpy) == hash(plain)
    assert type(from_numpy.num_experts) is int and type(from_numpy.normalize_weights) is bool
    assert RouterConfig(num_experts=np.int64(4), top_k=np.int64(1)).num_experts == 4


def test_route_rejects_logits_of_another_expert_count():
    with pytest.raises(ValueError, match=r"logits.*num_experts=4"):
        route(jnp.zeros((3, 6)), RouterConfig(num_experts=4, top_k=2))


def test_wrong_input_width_is_rejected_before_jit():
    module = MoE(MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=8), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="d_model=8"):
        module(jnp.ones((3, 7)))


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_load_balancing_loss_over_nonfinite_logit_rows(router):
    """route + load_balancing_loss on logits with an inf row and a NaN row: the value is
    Switch eq. 4 over the good tokens with T counting all tokens (f_e = good
    assignments to e / T, P_e = sum of good probs / T), and jax.grad w.r.t. the logits
    is finite, zero on the bad rows."""
    T, E, K = 10, 4, 2
    logits = _logits(T, E, seed=11).at[3, 1].set(jnp.inf).at[7, 2].set(jnp.nan)
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=4, d_ff=4, router=router)

    def loss(lg):
        return load_balancing_loss(route(lg, cfg.router_config))

    value, grad = jax.value_and_grad(loss)(logits)
    good = np.setdiff1d(np.arange(T), [3, 7])
    lg = np.asarray(logits, np.float64)[good]
    if router == "sigmoid":
        p = 1 / (1 + np.exp(-lg))
        p = p / p.sum(-1, keepdims=True)  # normalised scores
    else:
        p = np.exp(lg - lg.max(-1, keepdims=True))
        p = p / p.sum(-1, keepdims=True)
    counts = np.bincount(np.argsort(-p, axis=1)[:, :K].ravel(), minlength=E)
    expected = E * np.sum(counts / T * p.sum(0) / T)
    np.testing.assert_allclose(float(value), expected, rtol=1e-5)
    grad = np.asarray(grad)
    assert np.isfinite(grad).all()
    assert (grad[[3, 7]] == 0).all() and np.abs(grad[good]).max() > 0


@pytest.mark.parametrize("segments", [1, 3])
def test_expert_counts_equal_numpy(segments):
    """Masked assignments per expert (and per consecutive segment of tokens) against a
    NumPy count, with slots masked out and an expert nobody picks."""
    rng = np.random.default_rng(segments)
    T, K, E = 12, 3, 7
    ids = rng.integers(0, E - 1, (T, K))  # expert E-1 is never picked
    mask = rng.random((T, K)) < 0.7
    want = np.zeros((segments, E), np.int64)
    for t in range(T):
        for k in range(K):
            if mask[t, k]:
                want[t // (T // segments), ids[t, k]] += 1
    seg = jnp.arange(T, dtype=jnp.int32) // (T // segments)
    got = expert_counts(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), E, seg, segments)
    assert got.dtype == jnp.int32
    np.testing.assert_array_equal(np.asarray(got).reshape(segments, E), want)
    total = expert_counts(jnp.asarray(ids, jnp.int32), jnp.asarray(mask), E)
    np.testing.assert_array_equal(np.asarray(total), want.sum(axis=0))
