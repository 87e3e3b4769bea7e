"""Every MoE block of the installed transformers against aristax (issue 33).

For each block of ``hf_blocks.BLOCKS`` (tiny random configs built here, float32):
``aristax.models.hf_moe.from_hf`` gives a config and params whose ``aristax.moe``
equals the block's output within 1e-5 relative, and its router logits where the block
exposes them; gradients with respect to the input and to every weight equal torch
autograd's (the weights' through ``to_hf``, which is a pure relayout); ``to_hf`` gives
the block's state dict back exactly; ``MoE.from_hf`` computes the block too.
The blocks aristax does not compute are refused with the reason (``LEFT_OUT``).
"""

from __future__ import annotations

import inspect
import warnings

import jax
import jax.numpy as jnp
import numpy as np
import pytest

torch = pytest.importorskip("torch")
pytest.importorskip("transformers")

from flax import nnx  # noqa: E402

from aristax import MoE, moe  # noqa: E402
from aristax.layers import FROM_HF_MODULE_OPTIONS  # noqa: E402
from aristax.models import hf_moe  # noqa: E402
from tests.conformance.hf_blocks import BLOCKS  # noqa: E402

# Blocks aristax refuses, with what it would need (the NotImplementedError names it).
LEFT_OUT = {
    "axk1": "RMSNorm after the experts", "axk2": "group mask by 0 instead of -inf",
    "hy_v4": "SwiGLU clamped before the SiLU", "glm5_next_text": "clamped before the SiLU",
    "nemotron_h": "squared-ReLU", "nemotron_h_latent": "squared-ReLU",
    "deepseek_v4": "sqrt(softplus)", "phimoe": "sparsemixer", "jetmoe": "output bias",
    "minimax_m3_vl_text": "clamped GLU on the shared", "cohere2_moe": "average",
    "cohere2_moe_sigmoid": "average", "longcat_flash": "identity",
    "gemma4_text": "router RMSNorm", "kolibri1": "on the logits", "laguna": "softcap",
    "step3p7": "clamp after the SiLU", "openai_privacy_filter": "scaled by K",
    "inkling_text": "weighted by the router", "inkling2_text": "softcapped",
    "muse_spark_text": "projections and norms",
}
CONVERTED = [name for name in BLOCKS if name not in LEFT_OUT]
B, S = 2, 5


# Entries that wrap their MoE block with the decoder's shared MLP (Granite's lives in
# the decoder layer): the conversion takes the block itself.
WRAPPED = ("granitemoeshared", "granitemoehybrid", "granitemoe_swa")


def moe_block(name: str, seed: int):
    """The MoE block of entry ``name``."""
    block = BLOCKS[name].build(seed)
    return block.block_sparse_moe if name in WRAPPED else block


def block_run(name, block, x):
    """(y [B, S, D], router logits or None) as the block's decoder layer calls it."""
    if name in WRAPPED:
        out = block(x)
        return (out[0] if isinstance(out, tuple) else out), None
    return BLOCKS[name].run(block, x)


def converted(block):
    with warnings.catch_warnings():
        warnings.simplefilter("ignore", UserWarning)  # Switch's capacity note
        return hf_moe.from_hf(block), hf_moe.selection_bias(block)


def rel_err(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.abs(got - want).max() / max(np.abs(want).max(), 1e-30))


@pytest.mark.parametrize("name", CONVERTED)
def test_block_equals_aristax_outputs_logits_gradients_and_round_trip(name):
    block = moe_block(name, 1).float()
    (config, params), bias = converted(block)
    D = config.d_model
    g = torch.Generator().manual_seed(2)
    x = torch.randn(B, S, D, generator=g, requires_grad=True)
    ct = torch.randn(B, S, D, generator=g)
    capacity = getattr(getattr(block, "router", None), "expert_capacity", None)
    if name.startswith("switch") and capacity < S:  # drops per sequence: aristax's
        config = config.replace(capacity_factor=capacity * config.num_experts / S)
    y, logits = block_run(name, block, x)
    (y * ct).sum().backward()

    def ours(x, params):
        if config.capacity_factor is None:
            y, aux = moe(x.reshape(-1, D), params, config, bias=bias)
            return y.reshape(x.shape), aux["router_logits"]
        # a sequence at a time: the block's capacity is per sequence
        outs = [moe(x[b], params, config, bias=bias) for b in range(B)]
        return (jnp.stack([o[0] for o in outs]),
                jnp.concatenate([o[1]["router_logits"] for o in outs]))

    @jax.jit
    def value_and_grads(x, params, ct):
        (_, (y, lg)), grads = jax.value_and_grad(
            lambda x, p: (jnp.sum(ours(x, p)[0] * ct), ours(x, p)), argnums=(0, 1),
            has_aux=True)(x, params)
        return y, lg, grads

    yj, lj, (dx, dparams) = value_and_grads(jnp.asarray(x.detach().numpy()), params,
                                            jnp.asarray(ct.numpy()))
    assert rel_err(yj, y.detach().numpy()) < 1e-5
    if logits is not None:
        np.testing.assert_allclose(np.asarray(lj), logits.detach().reshape(-1, lj.shape[-1])
                                   .numpy()[:, :config.num_experts], atol=1e-5, rtol=1e-5)
    assert rel_err(dx, x.grad.numpy()) < 1e-4
    grads_hf = hf_moe.to_hf(config, dparams, like=block)
    for key, param in block.named_parameters():
        if key in grads_hf and param.grad is not None:
            assert rel_err(grads_hf[key], param.grad.numpy()) < 1e-4, key
    # round trip: the state dict back from aristax's params, into a block of other values
    other = moe_block(name, 3).float()
    state = hf_moe.to_hf(config, params, like=other,
                         selection_bias=bias)
    assert set(state) == set(block.state_dict())
    other.load_state_dict(state)
    for key, value in block.state_dict().items():
        assert torch.equal(other.state_dict()[key], value), key


@pytest.mark.parametrize("name", ["mixtral", "deepseek_v3", "gpt_oss", "llama4_text",
                                  "qwen2_moe"])
def test_nnx_module_from_hf(name):
    block = moe_block(name, 4).float()
    layer = MoE.from_hf(block, rngs=nnx.Rngs(0))
    x = torch.randn(B, S, layer.config.d_model, generator=torch.Generator().manual_seed(5))
    with torch.no_grad():
        want, _ = block_run(name, block, x)
    got, _ = layer(jnp.asarray(x.numpy()))
    assert rel_err(got, want.numpy()) < 1e-5


def test_nnx_module_from_hf_takes_how_it_runs_and_trains():
    """``MoE.from_hf`` had no way to set the options a block does not decide (the
    bias update rate of DeepSeek-V3's selection bias, the implementation, chunks,
    aux-loss coefficients): they are keywords now, and the layer still computes the
    block; what the block decides (top_k) is refused, naming the fields that may be
    set."""
    block = moe_block("deepseek_v3", 4).float()
    options = dict(implementation="xla", num_chunks=2, bias_update_rate=1e-3,
                   z_loss_coef=0.01, lb_loss_coef=0.0)
    layer = MoE.from_hf(block, rngs=nnx.Rngs(0), **options)
    for field, value in options.items():
        assert getattr(layer.config, field) == value, field
    x = torch.randn(B, S, layer.config.d_model, generator=torch.Generator().manual_seed(6))
    with torch.no_grad():
        want, _ = block_run("deepseek_v3", block, x)
    got, aux = layer(jnp.asarray(x.numpy()))
    assert rel_err(got, want.numpy()) < 1e-5
    bias = np.asarray(layer.router.balance_bias_e[...])
    layer.update_balance_bias(aux["expert_load"])  # moves by the rate given
    step = np.abs(np.asarray(layer.router.balance_bias_e[...]) - bias)
    assert np.count_nonzero(step) > 0
    np.testing.assert_allclose(step[step > 0], 1e-3, atol=1e-7)
    with pytest.raises(TypeError, match=r"got top_k: what the .* computes.*bias_update_rate"):
        MoE.from_hf(block, rngs=nnx.Rngs(0), top_k=1)
    # a misspelt option or the config itself: named as unknown by from_hf, not by the
    # constructor it would otherwise reach
    assert set(FROM_HF_MODULE_OPTIONS) == set(
        inspect.signature(MoE.__init__).parameters) - {"self", "config", "rngs"}
    for wrong in ({"implementaton": "xla"}, {"config": layer.config}):
        with pytest.raises(TypeError, match=rf"from_hf got {next(iter(wrong))}: unknown; "
                                            r"it takes .*mesh, plan.*implementation"):
            MoE.from_hf(block, rngs=nnx.Rngs(0), **wrong)


@pytest.mark.parametrize("name", sorted(LEFT_OUT))
def test_left_out_blocks_are_refused_naming_the_feature(name):
    with pytest.raises(NotImplementedError, match=LEFT_OUT[name].replace("(", r"\(")
                       .replace(")", r"\)")):
        hf_moe.from_hf(moe_block(name, 0))


def test_every_block_is_converted_or_left_out_with_a_reason():
    assert set(LEFT_OUT) <= set(BLOCKS)
    assert len(CONVERTED) >= 40  # the list and the blocks sharing their code
    for name in ("mixtral", "qwen2_moe", "qwen3_moe", "qwen3_next", "deepseek_v2_greedy",
                 "deepseek_v2_group_limited", "deepseek_v3", "glm4_moe", "olmoe", "gpt_oss",
                 "llama4_text", "ernie4_5_moe", "lfm2_moe", "dbrx", "switch_transformers",
                 "granitemoe"):
        assert name in CONVERTED, name


def test_to_hf_refuses_a_config_of_another_block():
    block = moe_block("mixtral", 0)
    config, params = hf_moe.from_hf(block)
    with pytest.raises(ValueError, match="MoEConfig.router="):
        hf_moe.to_hf(config.replace(router="sigmoid"), params, like=block)


def _filled(block, seed: int):
    g = torch.Generator().manual_seed(seed)
    with torch.no_grad():
        for w in block.parameters():
            w.copy_(torch.randn(w.shape, generator=g) * 0.3)
    return block.eval()


def test_every_renormalisation_flag_is_followed_both_ways():
    """Each converted block's router flag ``norm_topk_prob`` (read at forward time) set
    the other way from BLOCKS' config: from_hf follows it (a user trial found LaraMini's
    ``False`` converted as renormalised: 46% off, silently)."""
    flipped = []
    for name in CONVERTED:
        block = moe_block(name, 6).float()
        flags = [m for m in block.modules() if isinstance(getattr(m, "norm_topk_prob", None),
                                                          bool)]
        if not flags or name.startswith("switch"):
            continue
        for m in flags:
            m.norm_topk_prob = not m.norm_topk_prob
        (config, params), bias = converted(block)
        x = torch.randn(B * S, config.d_model, generator=torch.Generator().manual_seed(7))
        with torch.no_grad():
            want = block_run(name, block, x.reshape(B, S, -1))[0].reshape(B * S, -1)
        got = moe(jnp.asarray(x.numpy()), params, config, bias=bias)[0]
        assert rel_err(got, want.numpy()) < 1e-5, (name, flags[0].norm_topk_prob)
        flipped.append(name)
    assert {"lara_mini", "qwen3_moe", "deepseek_v3"} <= set(flipped), flipped


@pytest.mark.parametrize("name,field", [("mixtral", "jitter_noise"),
                                        ("dbrx", "moe_jitter_eps")])
def test_training_jitter_is_named_in_a_warning(name, field):
    """Each block kind's training-only noise warns that it is not carried (DBRX's
    ``moe_jitter_eps`` converted silently before)."""
    block = moe_block(name, 1)
    modules = [m for m in block.modules() if hasattr(m, field)]
    assert modules, field
    for m in modules:
        setattr(m, field, 0.1)
    with pytest.warns(UserWarning, match=r"training jitter \(0.1\)"):
        hf_moe.from_hf(block)


def test_lfm2_epsilon_in_the_weights_sum():
    """LFM2 divides by sum + 1e-6: with small sigmoid scores that is 5% of the weights
    (found by an independent audit: aristax divided by the sum alone)."""
    from transformers import Lfm2MoeConfig
    from transformers.models.lfm2_moe.modeling_lfm2_moe import Lfm2MoeSparseMoeBlock

    cfg = Lfm2MoeConfig(hidden_size=8, num_experts=4, num_experts_per_tok=2,
                        moe_intermediate_size=8, norm_topk_prob=True, use_expert_bias=False)
    cfg._experts_implementation = "eager"
    block = _filled(Lfm2MoeSparseMoeBlock(cfg), 0)
    with torch.no_grad():
        block.gate.weight.copy_(-1.0 - 0.1 * torch.arange(4.0)[:, None].expand(4, 8))
    x = torch.full((1, 1, 8), 1.4)
    config, params = hf_moe.from_hf(block)
    assert config.weight_norm_eps == 1e-6
    with torch.no_grad():
        want = block(x).reshape(-1, 8).numpy()
    assert rel_err(moe(jnp.asarray(x.numpy()).reshape(-1, 8), params, config)[0], want) < 1e-5


def test_ernie_norm_min_that_clamps_is_refused():
    from transformers import Ernie4_5_MoeConfig
    from transformers.models.ernie4_5_moe.modeling_ernie4_5_moe import (
        Ernie4_5_MoeSparseMoeBlock)

    cfg = Ernie4_5_MoeConfig(hidden_size=8, moe_num_experts=8, moe_k=2, moe_intermediate_size=8,
                             moe_num_shared_experts=0, moe_norm_min=0.9)
    with pytest.raises(NotImplementedError, match="moe_norm_min=0.9"):
        hf_moe.from_hf(_filled(Ernie4_5_MoeSparseMoeBlock(cfg), 0))


def test_settings_without_an_aristax_equivalent_are_refused_naming_the_block():
    from transformers import Qwen2MoeConfig
    from transformers.models.qwen2_moe.modeling_qwen2_moe import Qwen2MoeSparseMoeBlock

    cfg = Qwen2MoeConfig(hidden_size=8, moe_intermediate_size=8, num_experts=4,
                         num_experts_per_tok=2, shared_expert_intermediate_size=0)
    with pytest.raises(NotImplementedError, match="Qwen2MoeSparseMoeBlock.*shared_d_ff"):
        hf_moe.from_hf(_filled(Qwen2MoeSparseMoeBlock(cfg), 0))


def test_to_hf_refuses_routing_shapes_and_biases_the_block_does_not_have():
    """Found by an independent audit: to_hf compared only the fields the target block
    sets, so a grouped config went into an ungrouped block silently."""
    grouped, plain = moe_block("deepseek_v3", 0), moe_block("mixtral", 0)
    config, params = hf_moe.from_hf(grouped)
    ungrouped = moe_block("deepseek_v3", 1)
    ungrouped.gate.num_group = ungrouped.gate.topk_group = 1  # what n_group=1 builds
    with pytest.raises(ValueError, match="num_groups=4"):
        hf_moe.to_hf(config, params, like=ungrouped)
    mconfig, mparams = hf_moe.from_hf(plain)
    with pytest.raises(ValueError, match="routed_scaling_factor"):
        hf_moe.to_hf(mconfig.replace(routed_scaling_factor=2.5), mparams, like=plain)
    with pytest.raises(ValueError, match="params.up_edf has shape"):
        hf_moe.to_hf(mconfig, mparams.replace(up_edf=mparams.up_edf[:, :, :4]), like=plain)
    with pytest.raises(ValueError, match="no selection bias"):
        hf_moe.to_hf(mconfig, mparams, like=plain, selection_bias=np.zeros(8))


def test_float64_blocks_convert_exactly():
    block = moe_block("mixtral", 6).double()
    with jax.enable_x64(True):
        config, params = hf_moe.from_hf(block)
        assert params.up_edf.dtype == jnp.float64
        state = hf_moe.to_hf(config, params, like=block)
        for key, value in block.state_dict().items():
            assert torch.equal(state[key], value), key
