"""The routing and expert options of Hugging Face's MoE blocks (issue 33) on the NNX
module, under a plan layout, and the Megatron loss convention, against NumPy.

(Every option through every path against the per-token reference: test_every_path.)
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_reference as ref
from aristax import MoE, MoEConfig, moe
from aristax.parallel import expert_parallel_moe, layout_experts

D, F, E, T = 8, 12, 8, 32
ALL_OPTIONS = dict(router="sigmoid", top_k=2, num_experts=E, d_model=D, d_ff=F,
                   router_bias=True, expert_bias=True, selection_bias=True,
                   activation="clamped_swiglu", swiglu_limit=0.7, num_shared_experts=1,
                   shared_expert_gate=True, normalize_weights=True, weight_norm_p=3.0)


def randomized(layer: MoE, seed: int) -> MoE:
    """The layer with every parameter (biases included) and the selection bias random."""
    rng = np.random.default_rng(seed)
    for _, var in nnx.iter_graph(layer):
        if isinstance(var, nnx.Variable) and not isinstance(
                var, nnx.RngState) and jnp.issubdtype(var[...].dtype, jnp.floating):
            var.set_value(jnp.asarray(rng.standard_normal(var[...].shape) * 0.5,
                                      var[...].dtype))
    return layer


def as_dict(params) -> dict:
    return {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}


def test_module_holds_every_option_and_equals_the_reference():
    cfg = MoEConfig(**ALL_OPTIONS)
    layer = randomized(MoE(cfg, rngs=nnx.Rngs(0)), 1)
    p = layer.params()
    assert p.router_bias_e.shape == (E,) and p.shared_expert_gate_d.shape == (D,)
    assert p.gate_bias_ef.shape == p.up_bias_ef.shape == (E, F)
    assert p.down_bias_ed.shape == (E, D)
    x = jax.random.normal(jax.random.key(2), (2, T // 2, D))
    y, aux = layer(x)
    bias = np.asarray(layer.router.balance_bias_e[...])
    flat = np.asarray(x).reshape(-1, D)
    pl = ref.plan(flat, p.router_de, cfg, bias=bias, router_bias=p.router_bias_e)
    y_ref = ref.forward(flat, as_dict(p), cfg, pl)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), y_ref, atol=2e-5, rtol=2e-4)
    np.testing.assert_array_equal(np.asarray(aux["expert_load"]), pl["load"])
    # the selection bias changed the choice (else this test would not cover it)
    plain = ref.plan(flat, p.router_de, cfg, router_bias=p.router_bias_e)
    assert plain["ids"] != pl["ids"]


def test_fixed_selection_bias_selects_without_weighting_and_is_not_updated():
    cfg = MoEConfig(num_experts=E, top_k=2, d_model=D, d_ff=F, router="sigmoid",
                    selection_bias=True)
    layer = randomized(MoE(cfg, rngs=nnx.Rngs(0)), 3)
    layer.router.balance_bias_e[...] = jnp.zeros(E).at[5].set(100.0)  # expert 5 always
    x = jax.random.normal(jax.random.key(4), (T, D))
    y, aux = layer(x)
    assert int(aux["expert_load"][5]) == T
    p = layer.params()
    bias = np.asarray(layer.router.balance_bias_e[...])
    y_ref = ref.forward(x, as_dict(p), cfg, ref.plan(x, p.router_de, cfg, bias=bias))
    np.testing.assert_allclose(np.asarray(y), y_ref, atol=2e-5, rtol=2e-4)
    with pytest.raises(ValueError, match="bias_update_rate > 0"):
        layer.update_balance_bias(aux["expert_load"])
    assert "balance_bias_e" not in str(nnx.state(layer, nnx.Param))  # not trained


def test_expert_biases_follow_the_experts_in_a_plan_layout():
    """layout_experts moves the bias rows with their experts: the expert-parallel layer
    on a permuted, replicated layout equals the single-device layer, with gradients."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=D, d_ff=F, expert_bias=True,
                    activation="relu", router_bias=True)
    params = randomized(MoE(cfg, rngs=nnx.Rngs(0)), 5).params()
    perm = (3, 0, 2, 1, 1, 0, 3, 2)  # 8 slots on 4 devices: every expert twice
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    x = jax.random.normal(jax.random.key(6), (16, D))

    def loss(fn, p):
        y, _ = fn(x, p)
        return jnp.sum(y * jnp.cos(y)), y

    want, gwant = jax.value_and_grad(lambda p: loss(lambda x, p: moe(x, p, cfg), p),
                                     has_aux=True)(params)
    physical = layout_experts(params, perm)
    got, gphys = jax.jit(jax.value_and_grad(lambda p: loss(
        lambda x, p: expert_parallel_moe(x, p, cfg, mesh, expert_perm=perm,
                                         exchange="padded"), p), has_aux=True))(physical)
    np.testing.assert_allclose(np.asarray(got[1]), np.asarray(want[1]), atol=2e-5, rtol=2e-4)
    # every slot of a logical expert gets that expert's gradient (tie_replicas), biases
    # included, so the replicas train as one
    for name in ("up_bias_ef", "down_bias_ed", "up_edf"):
        slots = np.asarray(getattr(gphys, name))
        for slot, e in enumerate(perm):
            np.testing.assert_allclose(slots[slot], np.asarray(getattr(gwant, name))[e],
                                       atol=2e-5, rtol=2e-4, err_msg=f"{name} slot {slot}")
    np.testing.assert_allclose(np.asarray(gphys.router_bias_e),
                               np.asarray(gwant.router_bias_e), atol=2e-5, rtol=2e-4)


def _np_softmax(z):
    e = np.exp(z - z.max(-1, keepdims=True))
    return e / e.sum(-1, keepdims=True)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_megatron_loss_convention(router):
    """Megatron-Core: lb = E / (K T^2) sum_e (sum_t P[t, e]) count_e with the counts of a
    plain top-k of the unbiased, ungrouped scores (switch_load_balancing_loss_func);
    the sequence-wise loss (DeepSeek-V3 eq. 17-20) with the same counts. aristax's
    convention counts the slots routed after the selection bias and group limits, and
    its lb is K times Megatron's."""
    K, S = 2, 8
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F, router=router,
                    num_groups=4, topk_groups=1, selection_bias=True, lb_loss_coef=0.3,
                    seq_aux_loss_coef=0.2, loss_convention="megatron")
    layer = randomized(MoE(cfg, rngs=nnx.Rngs(0)), 7)
    layer.router.balance_bias_e[...] = jnp.asarray(np.linspace(-0.5, 0.5, E), jnp.float32)
    x = jax.random.normal(jax.random.key(8), (T // S, S, D))
    _, aux = layer(x)
    logits = np.asarray(x, np.float64).reshape(-1, D) @ np.asarray(layer.params().router_de,
                                                                   np.float64)
    scores = 1 / (1 + np.exp(-logits)) if router == "sigmoid" else _np_softmax(logits)
    P = scores / scores.sum(-1, keepdims=True)
    plain = np.argsort(-logits, axis=1)[:, :K]
    counts = np.bincount(plain.reshape(-1), minlength=E)
    lb = E / (K * T * T) * np.sum(P.sum(0) * counts)
    seq = np.mean([np.sum(E / (K * S) * np.bincount(plain[s:s + S].reshape(-1), minlength=E)
                          * P[s:s + S].mean(0)) for s in range(0, T, S)])
    np.testing.assert_allclose(float(aux["lb_loss"]), lb, rtol=1e-5)
    np.testing.assert_allclose(float(aux["seq_aux_loss"]), seq, rtol=1e-5)
    np.testing.assert_allclose(float(aux["loss"]), 0.3 * lb + 0.2 * seq, rtol=1e-5)
    # the layer routed with the bias and groups, so its own counts differ
    assert not np.array_equal(np.asarray(aux["expert_load"]), counts)
    # aristax's convention on the same layer: K times lb, counting the routed slots
    ours = dataclasses.replace(cfg, loss_convention="aristax")
    _, aux2 = moe(jnp.asarray(x).reshape(-1, D), layer.params(), ours,
                  bias=layer.router.balance_bias_e[...], seq_len=S)
    load = np.asarray(aux2["expert_load"])
    np.testing.assert_allclose(float(aux2["lb_loss"]), E / (T * T) * np.sum(P.sum(0) * load),
                               rtol=1e-5)
