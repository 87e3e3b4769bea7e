"""Eager calls of the single-device layer (a notebook) compile once per input shape
(issue 31 G), and give what the same call under ``jax.jit`` gives."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from aristax import MoE, MoEConfig
from compiles import count_compiles


@pytest.mark.parametrize("num_chunks", [None, 3])
def test_eager_calls_compile_once_per_shape(num_chunks):
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, num_chunks=num_chunks,
                    z_loss_coef=1e-3)
    layer = MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (2, 6, 8))
    with count_compiles() as first:
        y, aux = layer(x)
    with count_compiles() as again:
        layer(x)
    with count_compiles() as other:
        layer(x[:, :5])
    assert len(first) <= 2 and len(again) == 0 and len(other) <= 2, (first, again, other)
    y_jit, aux_jit = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(y, y_jit, rtol=1e-6, atol=1e-6)
    assert aux["router_logits"].shape == (2, 6, 4)
    np.testing.assert_allclose(aux["loss"], aux_jit["loss"], rtol=1e-6)
