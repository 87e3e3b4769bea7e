"""Lancet chunks inside the expert-parallel forward (8 CPU devices) against the
single-device layer (per source shard in capacity mode, as EP defines it)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aristax import MoEConfig, moe
from aristax.parallel import expert_parallel_moe
from test_expert_parallel import make_mesh, make_params, per_shard_moe

D, T = 16, 64  # 8 tokens per device on a 2x4 mesh: k = 3 does not divide them

CASES = {
    "dropless": dict(num_experts=8, top_k=2),
    "capacity_position": dict(num_experts=8, top_k=2, capacity_factor=0.75),
    "capacity_probability": dict(num_experts=8, top_k=2, capacity_factor=0.75,
                                 drop_policy="probability"),
    # chunks on the Pallas Triton kernels (interpret mode), against the reference path
    "dropless_triton": dict(num_experts=8, top_k=2, implementation="triton"),
}


@pytest.mark.parametrize("name", CASES)
def test_ep_chunks_equal_single_device(name, kernel_calls):
    cfg = MoEConfig(d_model=D, d_ff=24, **CASES[name])
    mesh = make_mesh((2, 4))
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(3), (T, D))
    ct = jax.random.normal(jax.random.key(4), (T, D))
    ks = (1, 2, 3, 4)

    def ep(x, p, k):
        return expert_parallel_moe(x, p, cfg, mesh, num_chunks=k)

    ref_cfg = cfg.replace(implementation=None)

    def ref(x, p):
        y, aux = moe(x, p, ref_cfg)  # expert_load counts assignments before drops: whole batch
        if cfg.capacity_factor is None:
            return y, aux
        y, shards = per_shard_moe(x, p, ref_cfg, 8)
        return y, {"num_dropped": jnp.sum(shards["num_dropped"]),
                   "expert_load": aux["expert_load"]}

    @jax.jit
    def run(x, p):
        outs = [ep(x, p, k) for k in ks]
        y_ref, aux_ref = ref(x, p)
        grad = lambda f: jax.grad(lambda x, p: jnp.sum(f(x, p)[0] * ct), argnums=(0, 1))(x, p)  # noqa: E731
        grads = [grad(ref), grad(lambda x, p: ep(x, p, 3))]
        return outs, (y_ref, aux_ref), grads

    outs, (y_ref, aux_ref), (g_ref, g3) = run(x, params)
    if cfg.implementation:  # the kernels really ran, not a fallback
        assert {"route", "moe_mlp"} <= set(kernel_calls["triton"]), kernel_calls
    if cfg.capacity_factor is not None:
        assert int(aux_ref["num_dropped"]) > 0
    for k, (y, aux) in zip(ks, outs):
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=1e-5, rtol=1e-5)
        assert int(aux["num_dropped"]) == int(aux_ref["num_dropped"]), k
        assert int(aux["num_overflow"]) == 0
        np.testing.assert_array_equal(np.asarray(aux["expert_load"]),
                                      np.asarray(aux_ref["expert_load"]))
    for a, b in zip(jax.tree.leaves(g3), jax.tree.leaves(g_ref)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=3e-5)


def test_ep_num_chunks_validated():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24)
    with pytest.raises(ValueError, match="num_chunks=9"):
        expert_parallel_moe(jnp.zeros((T, D)), make_params(cfg), cfg, make_mesh((2, 4)),
                            num_chunks=9)


def test_layer_caps_num_chunks_at_the_tokens_of_each_shard():
    """MoE(num_chunks=4) on a (2, 4) mesh with T = 8, one token per shard (as in
    decoding): the layer runs one chunk and equals the single-device layer; the
    functional forward given the same count raises and says it is per shard."""
    from flax import nnx

    from aristax import MoE

    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24, num_chunks=4)
    mesh = make_mesh((2, 4))
    layer, single = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh), MoE(cfg, rngs=nnx.Rngs(0))
    x = jax.random.normal(jax.random.key(1), (8, D))  # 1 token per shard
    y, aux = layer(x)
    y_ref, aux_ref = moe(x, single.params(), cfg.replace(num_chunks=None))
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=3e-5, rtol=3e-5)
    np.testing.assert_array_equal(aux["expert_load"], aux_ref["expert_load"])
    with pytest.raises(ValueError, match=r"num_chunks=4 exceeds the 1 tokens of each token "
                                         r"shard \(T=8 over 8 shards\)"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, num_chunks=4)
