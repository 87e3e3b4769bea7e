"""A float32 Mixtral computes its matrix products in full float32, as Hugging Face does.

JAX's default precision lets an NVIDIA GPU run float32 products in TF32 (10 mantissa
bits), which PyTorch does not by default; the parity tolerance (1e-4 / 1e-5) would not
hold there. The CPU ignores the precision, so these tests read it where XLA gets it:
the precision of every dot in the program lowered for CUDA.
"""

from __future__ import annotations

import collections
import json
import re

import jax
import jax.numpy as jnp
import pytest
from cuda_export import export_for_cuda
from flax import nnx

from aristax.models import Mixtral, MixtralConfig

TINY = dict(vocab_size=64, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, num_key_value_heads=2, num_local_experts=4)
DOT = re.compile(r"(stablehlo\.dot_general|chlo\.ragged_dot)")
PRECISION = re.compile(r"precision(?:_config)? = \[\"?(\w+)\"?, \"?(\w+)\"?\]")


def dot_precisions(fn, *args) -> collections.Counter:
    """{(op, precision of each operand): count} over the dots of ``jit(fn)(*args)``
    exported for CUDA (precision None: the dot has none, JAX's DEFAULT)."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    text = export_for_cuda(jax.jit(fn), *avals).mlir_module()
    found = collections.Counter()
    for line in text.splitlines():
        op = DOT.search(line)
        if op and line.lstrip().startswith("%"):
            precision = PRECISION.search(line)
            found[op.group(1), precision and precision.groups()] += 1
    return found


def model_and_state(**config):
    model = Mixtral(MixtralConfig(**TINY, **config), rngs=nnx.Rngs(0))
    model.eval()
    return nnx.split(model)


def forward_and_grad(graphdef):
    """logits of the cache-free forward, the decode forward (decode weights), and the
    gradient of the loss: every kind of product the model has."""
    def fn(state, ids):
        model = nnx.merge(graphdef, state)
        decode = model(ids, decode_weights=model.decode_weights()).logits

        def loss(state):
            out = nnx.merge(graphdef, state)(ids)
            return jnp.sum(out.logits ** 2) + out.aux_loss

        return decode, jax.grad(loss)(state)

    return fn


@pytest.mark.parametrize("outer", ["default", "tensorfloat32"])
def test_float32_products_are_full_float32_whatever_jax_default(outer):
    graphdef, state = model_and_state()
    ids = jnp.zeros((2, 5), jnp.int32)
    with jax.default_matmul_precision(outer):
        found = dot_precisions(forward_and_grad(graphdef), state, ids)
    ops = {op for op, _ in found}
    assert ops == {"stablehlo.dot_general", "chlo.ragged_dot"}, found
    assert {precision for _, precision in found} == {("HIGHEST", "HIGHEST")}, found


@pytest.mark.parametrize("config", [dict(matmul_precision=None), dict(dtype="bfloat16")])
def test_none_or_bfloat16_keeps_jax_setting(config):
    graphdef, state = model_and_state(**config)
    ids = jnp.zeros((2, 5), jnp.int32)
    with jax.default_matmul_precision("high"):
        found = dot_precisions(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    assert found and {precision for _, precision in found} == {("HIGH", "HIGH")}, found


def test_chosen_precision_is_used():
    graphdef, state = model_and_state(matmul_precision="tensorfloat32")
    ids = jnp.zeros((2, 5), jnp.int32)
    found = dot_precisions(lambda s, i: nnx.merge(graphdef, s)(i).logits, state, ids)
    assert found and {precision for _, precision in found} == {("HIGH", "HIGH")}, found


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
