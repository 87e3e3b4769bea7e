"""The decoders' sharding metadata (``aristax.sharding.DecoderAxes``): every parameter
of a Mixtral or Qwen3-MoE model, attention, embeddings, norms, dense MLPs and MoE
blocks alike, names the axis of each of its dimensions' roles, so the Flax recipe
(``nnx.get_named_sharding``, then ``jax.device_put``) places the whole model; a
model placed over an FSDP x tensor mesh, or by logical rules with expert
parallelism, computes the loss and gradients of the same model on one device."""

from __future__ import annotations

import jax
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from aristax.models import (LOGICAL_DECODER_AXES, DecoderAxes, Mixtral, MixtralConfig,
                            Qwen3Moe, Qwen3MoeConfig)
from aristax.sharding import MoEAxes

# Qwen3-MoE with every kind of weight (q/k norms, projection biases, a dense layer),
# each role's dimension of its own size: vocab 40, D 24, H*Dh 32, G*Dh 16, Dh 8,
# dense F 56, expert F 20, E 6
QWEN = Qwen3MoeConfig(vocab_size=40, hidden_size=24, num_attention_heads=4, head_dim=8,
                      num_key_value_heads=2, intermediate_size=56, moe_intermediate_size=20,
                      num_experts=6, num_experts_per_tok=2, num_hidden_layers=2,
                      mlp_only_layers=(1,), attention_bias=True)
ROLE_OF_SIZE = {40: "vocab", 24: "embed", 32: "heads", 16: "kv_heads", 56: "mlp", 20: "mlp",
                6: "expert", 8: None}
NAMED = DecoderAxes(vocab="V", embed="D", heads="N", kv_heads="M", mlp="F", expert="X")

MIXTRAL = MixtralConfig(vocab_size=64, hidden_size=32, intermediate_size=48,
                        num_hidden_layers=2, num_attention_heads=4, num_key_value_heads=2,
                        num_local_experts=4, num_experts_per_tok=2)
TOKENS = jax.random.randint(jax.random.key(3), (8, 12), 0, MIXTRAL.vocab_size)


def param_specs(model) -> dict:
    """Path -> (the parameter's shape, its sharding names as a tuple) of every nnx.Param."""
    state = nnx.state(model, nnx.Param)
    specs = nnx.get_partition_spec(state)
    return {path: (tuple(v.shape), tuple(spec.get_value())) for (path, v), (_, spec) in zip(
        nnx.to_flat_state(state), nnx.to_flat_state(specs), strict=True)}


def test_every_parameter_names_the_axis_of_each_dimension():
    """Judged by dimension size alone: a dimension of the vocab's size is split over
    NAMED.vocab, of D over NAMED.embed, and so on; the router's E is never split."""
    specs = param_specs(Qwen3Moe(QWEN, rngs=nnx.Rngs(0), axes=NAMED))
    assert any("q_norm" in map(str, path) for path in specs)  # every kind is there
    assert any("q_bias_n" in map(str, path) for path in specs)
    assert any("mlp" in map(str, path) for path in specs)
    for path, (shape, spec) in specs.items():
        assert len(spec) == len(shape), (path, shape, spec)
        for size, name in zip(shape, spec, strict=True):
            router_e = "router" in map(str, path) and size == QWEN.num_experts
            role = None if router_e else ROLE_OF_SIZE[size]
            assert name == (None if role is None else getattr(NAMED, role)), (path, shape, spec)


def test_the_default_replicates_all_but_the_experts():
    for path, (shape, spec) in param_specs(Mixtral(MIXTRAL, rngs=nnx.Rngs(0))).items():
        expert = path[-1] in ("gate_edf", "up_edf", "down_efd")
        assert spec == (("expert",) if expert else ()) + (None,) * (len(shape) - expert), path


def test_axes_that_meet_in_one_weight_are_refused():
    with pytest.raises(ValueError, match=r"weight q_dn \('embed', 'heads'\)"):
        DecoderAxes(embed="model", heads="model")
    with pytest.raises(ValueError, match="weight gate_edf"):
        DecoderAxes(expert="model", mlp=("data", "model"))
    with pytest.raises(TypeError, match="DecoderAxes"):
        Mixtral(MIXTRAL, rngs=nnx.Rngs(0), axes=MoEAxes())
    # roles that never meet in a weight may share an axis (Megatron's tensor axis)
    DecoderAxes(vocab="t", heads="t", kv_heads="t", mlp="t", embed="f")


def loss_fn(model, tokens):
    logits = model(tokens).logits
    return optax.softmax_cross_entropy_with_integer_labels(logits[:, :-1],
                                                           tokens[:, 1:]).mean()


@jax.jit
def loss_and_grads(graphdef, params, rest, tokens):
    return jax.value_and_grad(lambda p: loss_fn(nnx.merge(graphdef, p, rest), tokens))(params)


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


FSDP_TP = DecoderAxes(vocab="tensor", embed="fsdp", heads="tensor", kv_heads="tensor",
                      mlp="tensor", expert=None, batch="fsdp")
# logical rules: experts over "expert" (expert parallel), D over "fsdp", the rest over
# "tensor"
RULES = (("vocab", "tensor"), ("embed", "fsdp"), ("heads", "tensor"), ("kv_heads", "tensor"),
         ("mlp", "tensor"), ("expert", "expert"), ("batch", "fsdp"))


@pytest.mark.parametrize("case", ["fsdp_tensor", "logical_rules_expert_parallel"])
def test_a_placed_model_computes_the_one_device_loss_and_gradients(case):
    if case == "fsdp_tensor":
        mesh = jax.make_mesh((4, 2), ("fsdp", "tensor"), axis_types=(AxisType.Auto,) * 2)
        axes, rules = FSDP_TP, ()
    else:
        mesh = jax.make_mesh((2, 2, 2), ("expert", "fsdp", "tensor"),
                             axis_types=(AxisType.Auto,) * 3)
        axes, rules = LOGICAL_DECODER_AXES, RULES
    with nnx.logical_axis_rules(rules):
        model = Mixtral(MIXTRAL, rngs=nnx.Rngs(0), axes=axes,
                        mesh=mesh if case != "fsdp_tensor" else None)
        graphdef, params, rest = nnx.split(model, nnx.Param, ...)
        one = Mixtral(MIXTRAL, rngs=nnx.Rngs(0))  # the same weights, nothing split
        want_loss, want_grads = loss_and_grads(*nnx.split(one, nnx.Param, ...), TOKENS)

        placed = jax.device_put(params, nnx.get_named_sharding(params, mesh))
        attn = placed["layers"][0]["attn"]
        assert attn["q_dn"].get_value().sharding.spec == P("fsdp", "tensor")
        assert attn["k_dm"].get_value().sharding.spec == P("fsdp", "tensor")
        assert placed["embed_vd"].get_value().sharding.spec == P("tensor", "fsdp")
        assert placed["norm"]["weight_d"].get_value().sharding.spec == P("fsdp")
        experts = placed["layers"][1]["moe"]["experts"]
        assert experts["down_efd"].get_value().sharding.spec == (
            P(None, "tensor", "fsdp") if case == "fsdp_tensor" else P("expert", "tensor", "fsdp"))
        tokens = jax.device_put(TOKENS, NamedSharding(mesh, P("fsdp")))
        loss, grads = loss_and_grads(graphdef, placed, rest, tokens)
        hlo = loss_and_grads.lower(graphdef, placed, rest, tokens).as_text()
    # with the expert axis on the mesh, the MoE blocks exchange tokens (expert parallel)
    assert ("all_to_all" in hlo) == (case != "fsdp_tensor")

    assert relative_error(loss, want_loss) < 1e-5
    flat_want = dict(nnx.to_flat_state(want_grads))
    for path, g in nnx.to_flat_state(grads):
        assert relative_error(g.get_value(), flat_want[path].get_value()) < 1e-4, path


def test_from_pretrained_takes_the_axes(small_pair):
    loaded = Mixtral.from_pretrained(small_pair.path, axes=FSDP_TP)
    built = Mixtral(small_pair.ours.config, rngs=nnx.Rngs(0), axes=FSDP_TP)
    assert param_specs(loaded) == param_specs(built)
    values = lambda m: jax.tree.leaves(nnx.state(m, nnx.Param))  # noqa: E731
    for got, want in zip(values(loaded), values(small_pair.ours), strict=True):
        np.testing.assert_array_equal(got, want)
