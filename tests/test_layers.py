"""Module plumbing: the Linen bridge, sharding metadata, training with optax."""

from __future__ import annotations

import flax.linen as linen
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import moe_reference as ref
from aristax import MoE, MoEConfig, moe_linen, routing
from aristax.sharding import param_partition_specs

CFG = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, normalize_weights=True,
                num_shared_experts=1)


class TinyLinenModel(linen.Module):
    """Dense -> aristax MoE (through the bridge) -> Dense."""

    @linen.compact
    def __call__(self, x):
        h = linen.Dense(CFG.d_model, name="inp")(x)
        y, aux = moe_linen(CFG, name="moe")(h)
        return linen.Dense(3, name="out")(h + y), aux["loss"]


def test_linen_bridge_under_jit_and_grad():
    model = TinyLinenModel()
    x = jax.random.normal(jax.random.key(0), (2, 5, 4))
    variables = model.init(jax.random.key(1), x)
    out, aux_loss = jax.jit(model.apply)(variables, x)
    assert out.shape == (2, 5, 3) and aux_loss.shape == ()

    # The bridged layer computes the same function as the per-token reference.
    params = variables["params"]
    moe_p = params["moe"]

    def leaf(*path):
        node = moe_p
        for key in path:
            node = node[key]
        return getattr(node, "value", node)

    p = {"router_de": leaf("router", "weight_de"), "gate_edf": leaf("experts", "gate_edf"),
         "up_edf": leaf("experts", "up_edf"), "down_efd": leaf("experts", "down_efd"),
         "shared_gate_df": leaf("shared_experts", "gate_df"),
         "shared_up_df": leaf("shared_experts", "up_df"),
         "shared_down_fd": leaf("shared_experts", "down_fd")}
    h = linen.Dense(CFG.d_model).apply({"params": params["inp"]}, x).reshape(-1, CFG.d_model)
    y_ref = ref.forward(h, p, CFG, ref.plan(h, p["router_de"], CFG))
    expected = linen.Dense(3).apply({"params": params["out"]}, h + y_ref.astype(np.float32))
    np.testing.assert_allclose(np.asarray(out).reshape(-1, 3), np.asarray(expected),
                               atol=1e-4, rtol=1e-4)

    def loss(params):
        out, aux = model.apply({**variables, "params": params}, x)
        return jnp.mean(out ** 2) + aux

    grads = jax.jit(jax.grad(loss))(variables["params"])
    for name in ("up_edf", "down_efd", "gate_edf"):
        g = grads["moe"]["experts"][name]
        assert float(jnp.abs(getattr(g, "value", g)).max()) > 0, name


def test_sharding_metadata_on_expert_axis():
    specs = param_partition_specs(MoE(CFG, rngs=nnx.Rngs(0)))
    assert specs["experts"]["up_edf"] == P("expert", None, None)
    assert specs["experts"]["gate_edf"] == P("expert", None, None)
    assert specs["experts"]["down_efd"] == P("expert", None, None)
    assert specs["router"]["weight_de"] == P(None, None)
    assert specs["shared_experts"]["up_df"] == P(None, None)


def test_training_with_optax_lowers_the_loss():
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, bias_update_rate=1e-3)
    model = MoE(cfg, rngs=nnx.Rngs(0))
    optimizer = nnx.Optimizer(model, optax.adam(1e-2), wrt=nnx.Param)
    x = jax.random.normal(jax.random.key(0), (64, 8))
    target = jnp.tanh(x[:, ::-1])

    @nnx.jit
    def step(model, optimizer):
        def loss_fn(model):
            y, aux = model(x)
            return jnp.mean((y - target) ** 2) + aux["loss"], aux

        (loss, aux), grads = nnx.value_and_grad(loss_fn, has_aux=True)(model)
        optimizer.update(model, grads)
        model.update_balance_bias(aux["expert_load"])
        return loss

    with jax.numpy_dtype_promotion("standard"):  # optax's Adam mixes int and float
        losses = [float(step(model, optimizer)) for _ in range(30)]
    assert losses[-1] < 0.5 * losses[0]
    assert float(jnp.abs(model.router.balance_bias_e[...]).max()) > 0


def test_num_chunks_in_the_module_equals_unchunked_with_drops():
    base = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, capacity_factor=0.75)
    x = jax.random.normal(jax.random.key(3), (2, 7, 8))
    call = nnx.jit(lambda module, x: module(x))
    y1, aux1 = call(MoE(base, rngs=nnx.Rngs(0)), x)
    y3, aux3 = call(MoE(base.replace(num_chunks=3), rngs=nnx.Rngs(0)), x)
    assert int(aux1["num_dropped"]) > 0
    assert int(aux3["num_dropped"]) == int(aux1["num_dropped"])
    np.testing.assert_allclose(np.asarray(y3), np.asarray(y1), atol=1e-6)


# (implementation, dtype, d_model, the kernels that must run). Mosaic GPU's fused
# moe_mlp needs D % 128 == 0; at D = 192 the layer runs its permute and grouped GEMMs
# (its combine needs D % 128 too: the reference combines). The fused Mosaic layer is
# only traced (which kernels it calls): its numbers are the fused op's, which
# tests/pallas_kernels/test_moe_mlp.py checks on every hard routing, and an
# interpreted layer costs ~30 s.
# Every layer routes with the fused route kernel (Mosaic GPU's needs bfloat16 router
# weights: the layers on it keep their parameters in bfloat16).
KERNEL_LAYERS = [("triton", "float32", 64, {"moe_mlp", "route"}),
                 ("mosaic_gpu", "bfloat16", 192, {"permute", "ragged_dot", "route"})]
TRACED_KERNEL_LAYERS = [("mosaic_gpu", "bfloat16", 128, {"moe_mlp", "permute",
                                                         "ragged_dot", "route"})]


def _layer_loss(x):
    def loss(module):
        y, aux = module(x)
        return jnp.sum(y.astype(jnp.float32) ** 2) + aux["loss"], (y, aux)
    return loss


def _layer_config(implementation, dtype, d_model):
    return MoEConfig(num_experts=4, top_k=2, d_model=d_model, d_ff=64,
                     normalize_weights=True, num_shared_experts=1, dtype=dtype,
                     param_dtype=dtype, implementation=implementation)


def _assert_ran(kernel_calls, implementation, kernels):
    ran = set(kernel_calls[implementation])
    assert kernels <= ran and ("moe_mlp" in ran) == ("moe_mlp" in kernels), dict(kernel_calls)


def _layer_results(implementation, dtype, x):
    """(y, aux loss, parameter gradient leaves) of the layer on ``implementation``."""
    module = MoE(_layer_config(implementation, dtype, x.shape[-1]), rngs=nnx.Rngs(0))
    (_, (y, aux)), grads = nnx.jit(nnx.value_and_grad(_layer_loss(x), has_aux=True))(module)
    return y, aux["loss"], jax.tree.leaves(nnx.to_pure_dict(grads))


def _assert_same_layer(kernel, reference, dtype):
    (y_k, l_k, g_k), (y_r, l_r, g_r) = kernel, reference
    tol = dict(rtol=2e-2, atol=2e-2) if dtype == "bfloat16" else dict(rtol=1e-4, atol=1e-5)
    np.testing.assert_allclose(np.asarray(y_k, np.float32), np.asarray(y_r, np.float32), **tol)
    np.testing.assert_allclose(float(l_k), float(l_r), rtol=1e-5)
    for a, b in zip(g_k, g_r):
        scale = float(np.max(np.abs(np.asarray(b, np.float32)))) or 1.0
        np.testing.assert_allclose(np.asarray(a, np.float32) / scale,
                                   np.asarray(b, np.float32) / scale, **tol)


@pytest.mark.parametrize("implementation,dtype,d_model,kernels", KERNEL_LAYERS)
def test_moe_module_runs_on_each_kernel_implementation(implementation, dtype, d_model,
                                                     kernels, kernel_calls):
    """The NNX layer with ``MoEConfig(implementation=...)`` (Pallas kernels, interpret mode
    on CPU) gives the reference layer's output, aux loss and parameter gradients, and
    runs the kernels it should (the fused ``moe_mlp`` where it serves)."""
    x = jax.random.normal(jax.random.key(3), (2, 8, d_model), dtype)
    _assert_same_layer(_layer_results(implementation, dtype, x),
                       _layer_results("reference", dtype, x), dtype)
    _assert_ran(kernel_calls, implementation, kernels)


@pytest.mark.parametrize("implementation,dtype,d_model,kernels", TRACED_KERNEL_LAYERS)
def test_moe_module_traces_onto_the_fused_kernel(implementation, dtype, d_model, kernels,
                                                 kernel_calls):
    """The layer's value and gradients, traced (not run), call the kernels they should:
    the fused moe_mlp forward, its backward's permute and grouped GEMMs."""
    x = jax.random.normal(jax.random.key(3), (2, 8, d_model), dtype)
    module = MoE(_layer_config(implementation, dtype, d_model), rngs=nnx.Rngs(0))
    (_, (y, _)), _ = nnx.eval_shape(nnx.value_and_grad(_layer_loss(x), has_aux=True), module)
    assert y.shape == x.shape
    _assert_ran(kernel_calls, implementation, kernels)


def test_layer_falls_back_to_the_reference_where_a_named_backend_refuses(kernel_calls):
    """Mosaic GPU's grouped GEMM refuses float32, as does its route kernel: the layer
    runs those ops on the reference (the rule its permute and combine follow) and
    equals the reference layer, value and gradients. The list form of the name too."""
    x = jax.random.normal(jax.random.key(4), (2, 8, 64))
    _assert_same_layer(_layer_results(["mosaic_gpu"], "float32", x),
                       _layer_results("reference", "float32", x), "float32")
    assert "ragged_dot" not in kernel_calls["mosaic_gpu"], dict(kernel_calls)


@pytest.mark.parametrize("build,message", [
    (lambda: MoE(dict(num_experts=4, top_k=2, d_model=8, d_ff=16), rngs=nnx.Rngs(0)),
     "config must be an aristax.MoEConfig, got dict"),
    (lambda: MoE(CFG, rngs=0), r"rngs must be a flax.nnx.Rngs, got int; e.g. rngs=nnx.Rngs\(0\)"),
    (lambda: MoE(CFG.replace(router_jitter=0.1), rngs=nnx.Rngs(0))(jnp.ones((2, 8)), rngs=3),
     "rngs= of the call must be an nnx.Rngs, an nnx.RngStream or one PRNG key"),
])
def test_wrong_argument_types_name_the_argument(build, message):
    with pytest.raises(TypeError, match=message):
        build()


def test_seq_len_for_flattened_tokens_in_the_nnx_and_linen_layers():
    """The sequence-wise balance loss of [B*S, D] tokens given seq_len=S equals that of
    [B, S, D] (without it, x [T, D] is one sequence; a user trial found no way to say
    S for flattened tokens: a different loss, silently)."""
    from aristax import moe

    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, seq_aux_loss_coef=1.0)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (3, 5, 8))
    flat = x.reshape(15, 8)
    want = moe(flat, layer.params(), cfg, seq_len=5)[1]["seq_aux_loss"]
    one_sequence = moe(flat, layer.params(), cfg)[1]["seq_aux_loss"]
    assert abs(float(want) - float(one_sequence)) > 1e-4  # the split matters here
    for got in (layer(x)[1], layer(flat, seq_len=5)[1]):
        np.testing.assert_allclose(got["seq_aux_loss"], want, rtol=1e-6)
    np.testing.assert_allclose(layer(flat)[1]["seq_aux_loss"], one_sequence, rtol=1e-6)
    with pytest.raises(ValueError, match="seq_len=4 must be a positive divisor"):
        layer(flat, seq_len=4)
    bridged = moe_linen(cfg)
    variables = bridged.init(jax.random.key(0), x)
    np.testing.assert_allclose(bridged.apply(variables, flat, seq_len=5)[1]["seq_aux_loss"],
                               bridged.apply(variables, x)[1]["seq_aux_loss"], rtol=1e-6)


class ScannedLinenStack(linen.Module):
    """Two bridged MoE layers under nn.scan, their collections stacked on axis 0."""

    cfg: MoEConfig

    @linen.compact
    def __call__(self, x):
        def body(layer, h, _):
            y, aux = layer(h)
            return h + y, aux["expert_load"]

        stack = linen.scan(body, variable_axes={"params": 0, "BalanceBias": 0,
                                                "ExpertLayout": 0},
                           split_rngs={"params": True}, length=2,
                           metadata_params={linen.PARTITION_NAME: "layers"})
        return stack(moe_linen(self.cfg, name="moe"), x, None)


def test_linen_selection_bias_is_applied_refused_when_missing_and_updated_per_layer():
    """A user trial: apply({"params": ...}) silently routed with a zero selection bias
    (the bridge builds the layer afresh and "BalanceBias" was not given). Now that
    raises; the bias given is the one routed with, against NumPy's top-1 of logits +
    bias; and routing.update_balance_bias updates a scanned stack's [L, E] bias layer
    by layer (each against its own mean load)."""
    cfg = MoEConfig(num_experts=4, top_k=1, d_model=8, d_ff=8, bias_update_rate=0.5)
    x = jax.random.normal(jax.random.key(3), (12, 8))
    layer = moe_linen(cfg, name="moe")
    variables = layer.init(jax.random.key(4), x)
    with pytest.raises(ValueError, match="no 'BalanceBias' collection.*model.apply"):
        layer.apply({"params": variables["params"]}, x)
    bias = np.array([0.0, 0.0, 0.0, 5.0], np.float32)
    given = {**variables, "BalanceBias": {"router": {"balance_bias_e": jnp.asarray(bias)}}}
    _, aux = layer.apply(given, x)
    router = np.asarray(linen.unbox(variables["params"])["router"]["weight_de"])
    picks = np.argmax(np.asarray(x) @ router + bias, axis=-1)
    np.testing.assert_array_equal(aux["expert_load"], np.bincount(picks, minlength=4))

    stack = ScannedLinenStack(cfg)
    stacked = stack.init(jax.random.key(5), x)
    assert stacked["BalanceBias"]["moe"]["router"]["balance_bias_e"].shape == (2, 4)
    _, loads = stack.apply(stacked, x)  # [L, E]
    new = jax.tree.map(lambda b: routing.update_balance_bias(b, loads, 0.5),
                       stacked["BalanceBias"])["moe"]["router"]["balance_bias_e"]
    load = np.asarray(loads, np.float32)
    want = 0.5 * np.sign(load.mean(axis=1, keepdims=True) - load)
    np.testing.assert_array_equal(np.asarray(new), want)
    # rows of other totals: each against its own mean (one mean over both gave +1s)
    two = routing.update_balance_bias(jnp.zeros((2, 4)), jnp.array([[8, 0, 0, 0],
                                                                    [1, 1, 1, 1]]), 1.0)
    np.testing.assert_array_equal(two, [[-1, 1, 1, 1], [0, 0, 0, 0]])
