"""aristax.MoE runs the expert-parallel forward when a mesh is active."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import moe_reference as ref
from compiles import count_compiles
from aristax import MoE, MoEConfig, moe
from aristax.parallel import expert_parallel_moe
from test_expert_parallel import per_shard_moe
from test_moe import param_dict

B, S, D = 4, 8, 16


def build(cfg, mesh=None):
    module = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh)
    module.router.weight_de[...] = jax.random.normal(
        jax.random.key(100), module.router.weight_de.shape) * 0.5
    return module


@nnx.jit
def apply(module, x):
    return module(x)


def test_set_mesh_routes_to_expert_parallel():
    # Capacity mode tells the two paths apart: EP capacity is per source shard.
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24, capacity_factor=0.5)
    mesh = jax.make_mesh((2, 4), ("data", "expert"))
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    module = build(cfg)
    y_single, aux_single = apply(module, x)
    # the independent reference: the single-device layer on each of the 8 source shards
    y_ref, aux_ref = jax.jit(lambda x: per_shard_moe(x.reshape(-1, D), module.params(), cfg,
                                                     8))(x)
    with jax.set_mesh(mesh):
        y_mesh, aux_mesh = apply(module, x)
    y_ep, aux_ep = jax.jit(lambda x: expert_parallel_moe(
        x.reshape(-1, D), module.params(), cfg, mesh, seq_len=S))(x)
    np.testing.assert_allclose(np.asarray(y_mesh).reshape(-1, D), np.asarray(y_ep), atol=1e-6)
    assert int(aux_mesh["num_dropped"]) == int(aux_ep["num_dropped"])
    np.testing.assert_allclose(np.asarray(y_mesh).reshape(-1, D), np.asarray(y_ref),
                               atol=2e-5, rtol=2e-5)
    assert int(aux_mesh["num_dropped"]) == int(np.sum(aux_ref["num_dropped"])) > 0
    assert int(aux_mesh["num_dropped"]) != int(aux_single["num_dropped"])
    assert aux_mesh["router_logits"].shape == (B, S, 8)
    np.testing.assert_allclose(float(aux_mesh["lb_loss"]), float(aux_single["lb_loss"]),
                               rtol=1e-5)
    assert not np.allclose(np.asarray(y_mesh), np.asarray(y_single), atol=1e-6)


def test_eager_calls_under_set_mesh_equal_one_device_and_compile_once():
    """A notebook's eager calls: under ``jax.set_mesh`` with Auto axes a fresh layer
    (weights on one device, no ``mesh=``) runs expert-parallel and equals the
    single-device layer, gradients included (it raised TypeError: the weights were
    constrained to the abstract mesh); a second call compiles nothing (every eager call
    compiled the whole shard_map again)."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24)
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    module = build(cfg)
    x = jax.random.normal(jax.random.key(3), (B, S, D))
    y_ref, aux_ref = moe(x.reshape(-1, D), module.params(), cfg)
    loss = lambda m, x: jnp.sum(m(x)[0] ** 2)  # noqa: E731
    grads_ref = nnx.grad(loss)(module, x)
    x_again = x + 1.0
    with jax.set_mesh(mesh):
        y, aux = module(x)
        with count_compiles() as compiles:
            y_again, _ = module(x_again)
        grads = nnx.grad(loss)(module, x)
    assert compiles == []
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), np.asarray(y_ref), atol=2e-5,
                               rtol=2e-5)
    np.testing.assert_array_equal(aux["expert_load"], aux_ref["expert_load"])
    assert not np.allclose(np.asarray(y_again), np.asarray(y), atol=1e-3)
    for g, g_ref in zip(jax.tree.leaves(grads), jax.tree.leaves(grads_ref)):
        np.testing.assert_allclose(np.asarray(g), np.asarray(g_ref), atol=2e-5, rtol=2e-5)


def test_explicit_mesh_attribute_and_gradients():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24)
    mesh = jax.make_mesh((4, 2), ("data", "expert"), axis_types=(AxisType.Auto,) * 2)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (B, S, D)),
                       NamedSharding(mesh, P("data")))
    single, sharded = build(cfg), build(cfg, mesh=mesh)

    def loss(module, x):
        y, aux = module(x)
        return jnp.sum(y ** 2) + aux["loss"]

    grad = nnx.jit(nnx.grad(loss, argnums=(0, 1)))
    (gm_single, gx_single), (gm_mesh, gx_mesh) = grad(single, x), grad(sharded, x)
    np.testing.assert_allclose(np.asarray(gx_mesh), np.asarray(gx_single), atol=3e-5, rtol=3e-5)
    flat_single = jax.tree.leaves(nnx.to_pure_dict(gm_single))
    flat_mesh = jax.tree.leaves(nnx.to_pure_dict(gm_mesh))
    assert len(flat_single) == len(flat_mesh) > 0
    for a, b in zip(flat_single, flat_mesh):
        np.testing.assert_allclose(np.asarray(b), np.asarray(a), atol=3e-5, rtol=3e-5)


def test_mesh_without_expert_axis_runs_single_device():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24, router="expert_choice")
    module = build(cfg)
    x = jax.random.normal(jax.random.key(1), (B, S, D))
    auto = (AxisType.Auto,)
    with jax.set_mesh(jax.make_mesh((8,), ("data",), axis_types=auto)), pytest.warns(
            UserWarning, match="no axis for axes.expert"):  # said, not silent
        y, _ = apply(module, x)
    xf, p = x.reshape(-1, D), param_dict(module)
    y_ref = ref.forward(xf, p, cfg, ref.plan(xf, p["router_de"], cfg))
    np.testing.assert_allclose(np.asarray(y).reshape(-1, D), np.asarray(y_ref), atol=2e-5,
                               rtol=2e-5)
    with jax.set_mesh(jax.make_mesh((1, 8), ("data", "expert"), axis_types=auto * 2)), pytest.raises(
            ValueError, match="expert_choice"):
        apply(module, x)
