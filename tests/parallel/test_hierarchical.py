"""The "hierarchical" exchange (Tutel 2DH) on ("data", "node", "local") meshes of 8 CPU
devices against "padded" on the equivalent flat ("data", "expert") mesh and against the
single-device layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from aristax import MoEConfig, moe
from aristax.parallel import expert_parallel_moe, hierarchical_all_to_all
from test_expert_parallel import make_mesh, make_params, per_shard_moe

D, F, T = 16, 24, 64
AXES3 = ("data", "node", "local")


def mesh3(shape):
    return jax.make_mesh(shape, AXES3, axis_types=(AxisType.Explicit,) * 3)


@pytest.mark.parametrize("reverse", [False, True])
def test_hierarchical_all_to_all_equals_flat(reverse):
    mesh = jax.make_mesh((2, 4), ("node", "local"), axis_types=(AxisType.Auto,) * 2)
    buf = jax.random.normal(jax.random.key(0), (8 * 8, 3, 2))  # per device [W=8, B=3, 2]
    ax = ("node", "local")

    def body(b):
        return (hierarchical_all_to_all(b, ax, reverse=reverse),
                jax.lax.all_to_all(b, ax, 0, 0))

    got, want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(ax),
                                      out_specs=(P(ax), P(ax))))(buf)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


CASES = {
    "1x2x4_dropless_top2": ((1, 2, 4), dict(num_experts=8, top_k=2), 1),
    "2x2x2_capacity_chunks2": ((2, 2, 2), dict(num_experts=16, top_k=2, capacity_factor=0.75,
                                               num_shared_experts=1), 2),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_hierarchical_equals_flat_padded_and_single_device(case):
    shape, changes, chunks = CASES[case]
    cfg = MoEConfig(d_model=D, d_ff=F, **changes)
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    ct = jax.random.normal(jax.random.key(2), (T, D))
    flat = make_mesh((shape[0], shape[1] * shape[2]))
    shards = int(np.prod(shape))

    def grads(forward):
        def f(x, p):
            y, aux = forward(x, p)
            return jnp.sum(y * ct) + aux["loss"], (y, aux)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, params)

    kw = dict(num_chunks=chunks)
    (_, (y_h, aux_h)), g_h = grads(lambda x, p: expert_parallel_moe(
        x, p, cfg, mesh3(shape), expert_axis=("node", "local"), exchange="hierarchical", **kw))
    (_, (y_f, aux_f)), g_f = grads(lambda x, p: expert_parallel_moe(
        x, p, cfg, flat, exchange="padded", **kw))
    if cfg.capacity_factor is None:
        ref = lambda x, p: moe(x, p, cfg)  # noqa: E731
    else:
        def ref(x, p):  # EP capacity is per source shard; aux losses are whole-batch
            return per_shard_moe(x, p, cfg, shards)[0], moe(x, p, cfg)[1]
    (_, (y_r, aux_r)), g_r = grads(ref)

    np.testing.assert_allclose(np.asarray(y_h), np.asarray(y_f), atol=1e-6)
    np.testing.assert_allclose(np.asarray(y_h), np.asarray(y_r), atol=2e-5, rtol=2e-5)
    for k in ("loss", "lb_loss", "expert_load"):
        np.testing.assert_allclose(np.asarray(aux_h[k]), np.asarray(aux_r[k]), rtol=1e-5,
                                   err_msg=k)
    assert int(aux_h["num_dropped"]) == int(aux_f["num_dropped"])
    if cfg.capacity_factor is not None:
        assert int(aux_h["num_dropped"]) > 0  # the case really drops
    assert int(aux_h["num_overflow"]) == 0
    for a, b, r in zip(jax.tree.leaves(g_h), jax.tree.leaves(g_f), jax.tree.leaves(g_r)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
        np.testing.assert_allclose(np.asarray(a), np.asarray(r), atol=3e-5, rtol=3e-5)


def test_hierarchical_needs_an_axis_pair():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    x = jnp.zeros((T, D))
    with pytest.raises(ValueError, match="expert_axis=\\(outer, inner\\)"):
        expert_parallel_moe(x, make_params(cfg), cfg, make_mesh((2, 4)), exchange="hierarchical")
    with pytest.raises(ValueError, match="not a mesh axis"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh3((1, 2, 4)),
                            expert_axis=("node", "rack"), exchange="hierarchical")
