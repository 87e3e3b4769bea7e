"""``MoE(plan=, mesh=)`` places its own weights on the plan's mesh, and the planner's
public names cover what the README recipe needs (issue 31 H)."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

import aristax.planner as planner
from aristax import MoE, MoEConfig
from aristax.parallel import mesh_from_plan


def test_planner_exports_the_topology_builders():
    assert planner.uniform(4).num_devices == 4
    assert "uniform" in planner.__all__ and "two_level" in planner.__all__


def test_plan_layer_shards_expert_slots_over_the_expert_axis():
    load = tuple(float(v) for v in np.geomspace(1.0, 40.0, 8))
    plan = planner.make_plan(planner.uniform(8), planner.ModelSpec(
        num_experts=8, expert_load=load, top_k=2), groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    mesh = mesh_from_plan(plan)
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=16, num_shared_experts=1)
    layer = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, plan=plan)
    axis = layer.ep_options.expert_axis
    width = mesh.shape[axis] if isinstance(axis, str) else np.prod([mesh.shape[a] for a in axis])
    for name in ("gate_edf", "up_edf", "down_efd"):
        w = getattr(layer.experts, name)[...]
        assert w.sharding.mesh.shape == mesh.shape and w.sharding.spec == P(axis, None, None)
        assert {s.data.shape[0] for s in w.addressable_shards} == {w.shape[0] // width}
    for w in (layer.router.weight_de[...], layer.shared_experts.up_df[...]):
        assert w.sharding.is_fully_replicated and len(w.sharding.device_set) == mesh.size
    y, _ = nnx.jit(lambda m, x: m(x))(layer, jax.random.normal(jax.random.key(0), (8, 4, 8)))
    assert np.isfinite(np.asarray(y)).all()


def test_a_mesh_without_an_expert_axis_says_the_experts_are_replicated():
    """Issue 31 D's silent half: on a ("data", "model") mesh the layer runs on one
    device per shard with every expert on every device, and says so."""
    layer = MoE(MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16), rngs=nnx.Rngs(0))
    mesh = jax.make_mesh((4, 2), ("data", "model"))
    x = jax.random.normal(jax.random.key(0), (8, 3, 8))
    with jax.set_mesh(mesh), pytest.warns(UserWarning, match="no axis for axes.expert='expert'.*all 4"):
        y, _ = nnx.jit(lambda m, x: m(x))(layer, x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(layer(x)[0]), rtol=1e-5, atol=1e-6)
