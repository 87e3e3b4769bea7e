"""Router jitter inside real training code: the RNG streams ordinary models have (NNX
``Rngs(params=, dropout=)``, Linen ``init``/``apply`` rngs) and a deterministic switch
that really turns it off (issue 31 A, B)."""

from __future__ import annotations

import dataclasses

import flax.linen as nn
import jax
import numpy as np
import pytest
from flax import nnx

from aristax import MoE, MoEConfig, moe, moe_linen

CFG = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16, router_jitter=0.3)
X = jax.random.normal(jax.random.key(0), (2, 5, 8))


def without_jitter(layer: MoE):
    """The layer's output on its own weights with router_jitter = 0."""
    return moe(X.reshape(-1, 8), layer.params(), dataclasses.replace(CFG, router_jitter=0.0))


def test_nnx_layer_jitters_from_the_dropout_stream():
    layer = MoE(CFG, rngs=nnx.Rngs(params=0, dropout=1))
    y1, y2 = layer(X)[0], layer(X)[0]
    assert not np.allclose(y1, y2)  # fresh noise per call
    plain = without_jitter(layer)[0].reshape(X.shape)  # eager: equal up to rounding
    close = lambda y: np.testing.assert_allclose(y, plain, rtol=1e-5, atol=1e-7)  # noqa: E731
    close(layer(X, deterministic=True)[0])
    layer.eval()
    close(layer(X)[0])
    close(MoE(CFG, rngs=nnx.Rngs(params=0, dropout=1), deterministic=True)(X)[0])


def test_nnx_view_deterministic_turns_jitter_off_beside_dropout():
    """Flax's eval idiom ``nnx.view(model, deterministic=True)`` reaches the layer as
    it reaches nnx.Dropout (a user trial: Dropout switched, the MoE kept jittering,
    and nnx.view raised nothing since Dropout used the key); ``False`` turns it on."""

    class Block(nnx.Module):
        def __init__(self, rngs):
            self.drop = nnx.Dropout(0.5, rngs=rngs)
            self.moe = MoE(CFG, rngs=rngs)

        def __call__(self, x):
            return self.moe(self.drop(x))[0]

    block = Block(nnx.Rngs(params=0, dropout=1))
    plain = without_jitter(block.moe)[0].reshape(X.shape)
    ev = nnx.view(block, deterministic=True)
    assert ev.drop.deterministic and ev.moe.deterministic
    np.testing.assert_allclose(ev(X), plain, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(ev(X), ev(X), rtol=1e-6)
    layer = MoE(CFG, rngs=nnx.Rngs(params=0, dropout=1))
    layer.eval()
    layer = nnx.view(layer, deterministic=False)
    assert not np.allclose(layer(X)[0], layer(X)[0])


def test_nnx_stream_order_and_call_time_rngs():
    a = MoE(CFG, rngs=nnx.Rngs(params=0, jitter=5, dropout=1))
    b = MoE(CFG, rngs=nnx.Rngs(params=0, jitter=5, dropout=2))
    np.testing.assert_array_equal(a(X)[0], b(X)[0])  # "jitter" wins over "dropout"
    layer = MoE(CFG, rngs=nnx.Rngs(params=0, dropout=1))
    key = jax.random.key(7)
    np.testing.assert_array_equal(layer(X, rngs=key)[0], layer(X, rngs=key)[0])
    np.testing.assert_array_equal(layer(X, rngs=nnx.Rngs(dropout=7))[0],
                                  layer(X, rngs=nnx.Rngs(dropout=7))[0])


def test_nnx_without_a_jitter_stream_names_the_fix():
    """Built from params-only rngs (an eval model, a Linen init): deterministic calls
    and calls given rngs= work; a jittered call without a stream names the fix."""
    layer = MoE(CFG, rngs=nnx.Rngs(params=0))
    with pytest.raises(ValueError, match="router_jitter.*'jitter', 'dropout', 'default'"):
        layer(X)
    plain = MoE(dataclasses.replace(CFG, router_jitter=0.0), rngs=nnx.Rngs(params=0))
    np.testing.assert_array_equal(layer(X, deterministic=True)[0], plain(X)[0])
    jittered = layer(X, rngs=nnx.Rngs(dropout=3))[0]
    assert not np.allclose(jittered, plain(X)[0])


class Block(nn.Module):
    cfg: MoEConfig

    @nn.compact
    def __call__(self, x, train: bool):
        return moe_linen(self.cfg)(x, deterministic=not train)[0]


def test_linen_jitter_follows_the_apply_rngs_and_deterministic():
    block = Block(CFG)
    variables = block.init({"params": jax.random.key(0), "dropout": jax.random.key(1)}, X,
                           train=True)
    run = lambda key: block.apply(variables, X, train=True,  # noqa: E731
                                  rngs={"dropout": jax.random.key(key)})
    np.testing.assert_array_equal(run(3), run(3))
    assert not np.allclose(run(3), run(4))  # the noise follows the key
    plain = Block(dataclasses.replace(CFG, router_jitter=0.0)).apply(variables, X, train=True)
    assert not np.allclose(run(3), plain)
    np.testing.assert_array_equal(block.apply(variables, X, train=False), plain)


def test_linen_jitter_without_an_rng_is_refused():
    """Flax's bridge adds a stream "default" seeded 0 at every apply without one: jitter
    must not draw from it (the same noise at every step), but refuse."""
    block = Block(CFG)
    variables = block.init({"params": jax.random.key(0)}, X, train=False)
    with pytest.raises(ValueError, match="rngs=\\{'dropout': key\\}"):
        block.apply(variables, X, train=True)
