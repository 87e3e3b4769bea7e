"""A float32 Mixtral computes its matrix products in full float32, as Hugging Face does.

JAX's default precision lets an NVIDIA GPU run float32 products in TF32 (10 mantissa
bits), which PyTorch does not by default; the parity tolerance (1e-4 / 1e-5) would not
hold there. The CPU ignores the precision, so these tests read it where XLA gets it:
the precision of every matrix product in the traced program.
"""

from __future__ import annotations

import dataclasses
import json

import jax
import jax.numpy as jnp
import pytest
from cuda_export import dot_precisions
from flax import nnx

from aristax.models import Mixtral, MixtralConfig

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)


# Routing and the K-way combine are HIGHEST under any setting (aristax.moe.router_logits,
# aristax.dispatch.combine); the other products follow the setting in force.
HIGHEST, HIGH = ("HIGHEST", "HIGHEST"), ("HIGH", "HIGH")


def model_and_state(implementation=None, **config):
    """A tiny Mixtral split; ``implementation`` for its MoE blocks (None: the
    platform's default: the reference on the CPU, the Triton kernels on a GPU)."""
    cfg = MixtralConfig(**TINY, **config)
    moe_config = dataclasses.replace(cfg.moe_config(), implementation=implementation)
    model = Mixtral(cfg, rngs=nnx.Rngs(0), moe_config=moe_config)
    model.eval()
    return nnx.split(model)


def forward_and_grad(graphdef):
    """logits of the cache-free forward, the decode forward (decode weights), and the
    gradient of the loss: every kind of product the model has."""
    def fn(state, ids):
        model = nnx.merge(graphdef, state)
        decode = model(ids, decode_weights=model.decode_weights()).logits

        params, rest = nnx.split_state(state, nnx.Param, ...)  # (the expert layouts
        # are int variables: differentiate the parameters, as nnx.grad does)

        def loss(params):
            out = nnx.merge(graphdef, params, rest)(ids)
            return jnp.sum(out.logits ** 2) + out.aux_loss

        return decode, jax.grad(loss)(params)

    return fn


@pytest.mark.parametrize("implementation", [None, "triton"])
@pytest.mark.parametrize("outer", ["default", "tensorfloat32"])
def test_float32_products_are_full_float32_whatever_jax_default(outer, implementation):
    """Also in the Triton kernels, whose backward is traced outside the model's call."""
    graphdef, state = model_and_state(implementation)
    ids = jnp.zeros((2, 5), jnp.int32)
    with jax.default_matmul_precision(outer):
        found = dot_precisions(forward_and_grad(graphdef), state, ids)
    kernels = {p.primitive for p in found if p.in_kernel}
    assert kernels == ({"dot_general"} if implementation else kernels), found
    assert sum(found.values()) > 20 and {p.precision for p in found} == {HIGHEST}, found


@pytest.mark.parametrize("config", [dict(matmul_precision=None), dict(dtype="bfloat16")])
def test_none_or_bfloat16_keeps_jax_setting(config):
    graphdef, state = model_and_state(**config)
    ids = jnp.zeros((2, 5), jnp.int32)
    with jax.default_matmul_precision("high"):
        found = dot_precisions(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    assert {p.precision for p in found} == {HIGH, HIGHEST}, found


def test_chosen_precision_is_used():
    graphdef, state = model_and_state(matmul_precision="tensorfloat32")
    ids = jnp.zeros((2, 5), jnp.int32)
    found = dot_precisions(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    assert {p.precision for p in found} == {HIGH, HIGHEST}, found


def test_bad_precision_is_named():
    with pytest.raises(ValueError, match="matmul_precision='fast'.*'highest'"):
        MixtralConfig(**TINY, matmul_precision="fast")


def test_precision_is_ours_not_config_json(tmp_path):
    """Like dtype, it is how this model computes: not written to config.json, and
    from_pretrained takes it as an argument."""
    model = Mixtral(MixtralConfig(**TINY), rngs=nnx.Rngs(0))
    model.save_pretrained(tmp_path)
    assert "matmul_precision" not in json.loads((tmp_path / "config.json").read_text())
    assert Mixtral.from_pretrained(tmp_path).config.matmul_precision == "highest"
    loaded = Mixtral.from_pretrained(tmp_path, matmul_precision=None)
    assert loaded.config.matmul_precision is None
    assert MixtralConfig.from_hf({**TINY, "matmul_precision": None}).matmul_precision == \
        "highest"
