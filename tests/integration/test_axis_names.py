"""The mesh axes are the user's (issue 31 D): ``MoE(axes=MoEAxes(...))`` or Flax logical
axis rules put the expert weights on whatever axes a model's mesh has, Flax's SPMD
recipe (``nnx.get_partition_spec`` + ``with_sharding_constraint`` inside ``nnx.jit``)
places them, the layer runs expert parallel over the axis the experts map to, and the
result equals the single-device layer (``aristax.moe`` on one device, the reference)."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import AxisType, PartitionSpec as P

from aristax import MoE, MoEConfig, moe
from aristax.parallel import mesh_from_plan
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import two_level
from aristax.sharding import LOGICAL_AXES, MoEAxes

CFG = MoEConfig(num_experts=8, top_k=2, d_model=16, d_ff=32, num_shared_experts=1)


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def spec(a: jax.Array) -> tuple:
    """The mesh axes of each dimension of placed array ``a`` (None: not split)."""
    entries = tuple(a.sharding.spec)
    return entries + (None,) * (a.ndim - len(entries))


def flax_recipe(mesh, axes, rules=()):
    """The layer built and placed the way Flax's SPMD guide places a model."""

    @nnx.jit
    def create():
        layer = MoE(CFG, rngs=nnx.Rngs(params=0, dropout=1), axes=axes)
        state = nnx.state(layer)
        nnx.update(layer, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return layer

    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        return create()


def loss_of_layer(layer, x):
    y, aux = layer(x)
    return jnp.sum(y * jnp.cos(y)) + aux["loss"]


def check_against_one_device(layer, mesh, x, rules=()):
    """The layer's loss and gradients under ``mesh`` (and ``rules``), traced through
    the expert-parallel forward, equal the single-device ``aristax.moe`` on the same
    weights."""
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules):
        graphdef, state = nnx.split(layer)
        jaxpr = str(jax.make_jaxpr(lambda s, x: nnx.merge(graphdef, s)(x)[0])(state, x))
        value, grads = nnx.jit(nnx.value_and_grad(loss_of_layer))(layer, x)
    assert "shard_map" in jaxpr  # the expert-parallel forward, not the one-device layer
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), layer.params())

    def reference(p):
        y, aux = moe(x.reshape(-1, CFG.d_model), p, CFG)
        return jnp.sum(y * jnp.cos(y)) + aux["loss"]

    want_value, want = jax.value_and_grad(reference)(params)
    np.testing.assert_allclose(float(value), float(want_value), rtol=1e-5)
    got = {"router_de": grads.router.weight_de, "up_edf": grads.experts.up_edf,
           "gate_edf": grads.experts.gate_edf, "down_efd": grads.experts.down_efd,
           "shared_up_df": grads.shared_experts.up_df}
    for name, g in got.items():
        np.testing.assert_allclose(np.asarray(g[...]), np.asarray(getattr(want, name)),
                                   rtol=2e-4, atol=2e-5, err_msg=name)


def test_fsdp_tensor_mesh_with_named_axes():
    """A ("fsdp", "tensor") mesh: experts over "fsdp" (expert parallel there, tokens
    over "fsdp"), hidden F over "tensor". Before: 'Resource axis: expert ... is not
    found in mesh'."""
    mesh = auto_mesh((4, 2), ("fsdp", "tensor"))
    layer = flax_recipe(mesh, MoEAxes(expert="fsdp", mlp="tensor", batch=None))
    assert spec(layer.experts.up_edf[...]) == ("fsdp", None, "tensor")
    assert spec(layer.experts.down_efd[...]) == ("fsdp", "tensor", None)
    assert spec(layer.shared_experts.up_df[...]) == (None, "tensor")
    shard = layer.experts.up_edf[...].addressable_shards[0].data.shape
    assert shard == (CFG.num_experts // 4, CFG.d_model, CFG.d_ff // 2)
    check_against_one_device(layer, mesh, jax.random.normal(jax.random.key(1), (8, 5, 16)))


def test_logical_axis_rules_map_the_layer_onto_a_data_model_mesh():
    """``LOGICAL_AXES`` names and the user's rules: experts over "model", tokens over
    ("data", "model"), the rest replicated."""
    mesh = auto_mesh((2, 4), ("data", "model"))
    rules = (("batch", "data"), ("expert", "model"), ("embed", None), ("mlp", None))
    layer = flax_recipe(mesh, LOGICAL_AXES, rules)
    assert spec(layer.experts.gate_edf[...]) == ("model", None, None)
    assert layer.router.weight_de[...].sharding.is_fully_replicated
    with nnx.logical_axis_rules(rules):
        specs = nnx.get_partition_spec(nnx.state(layer, nnx.Param))
    assert specs["experts"]["up_edf"].get_value() == P("model", None, None)
    check_against_one_device(layer, mesh, jax.random.normal(jax.random.key(2), (8, 3, 16)),
                             rules)


def test_fsdp_without_an_expert_axis_shards_the_experts_and_does_not_warn(recwarn):
    """Experts split over D only (no expert axis): no expert parallelism, no
    replication, so no warning; the result is the single-device layer's."""
    mesh = auto_mesh((8,), ("fsdp",))
    layer = flax_recipe(mesh, MoEAxes(expert=None, embed="fsdp", batch="fsdp"))
    assert spec(layer.experts.up_edf[...]) == (None, "fsdp", None)
    x = jax.random.normal(jax.random.key(3), (8, 2, 16))
    with jax.set_mesh(mesh):
        y, _ = nnx.jit(lambda m, x: m(x))(layer, x)
    assert not [w for w in recwarn if "aristax.MoE" in str(w.message)]
    params = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), layer.params())
    want, _ = moe(x.reshape(-1, 16), params, CFG)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), np.asarray(want), rtol=1e-5,
                               atol=1e-6)


def test_rules_mapping_the_experts_nowhere_warn_with_the_fix():
    mesh = auto_mesh((4, 2), ("data", "model"))
    layer = MoE(CFG, rngs=nnx.Rngs(0), axes=LOGICAL_AXES)
    x = jax.random.normal(jax.random.key(4), (4, 2, 16))
    rules = (("batch", "data"), ("expert", None))
    with jax.set_mesh(mesh), nnx.logical_axis_rules(rules), pytest.warns(
            UserWarning, match=r"axes.expert='expert'.*MoEAxes\(expert="):
        nnx.jit(lambda m, x: m(x))(layer, x)


def test_logical_names_called_without_their_rules_warn_naming_the_rules():
    """Logical names resolve through the rules in effect where the layer is traced: a
    call outside ``nnx.logical_axis_rules`` runs without expert parallelism, and the
    warning says which rules it saw."""
    mesh = auto_mesh((4, 2), ("data", "model"))
    layer = MoE(CFG, rngs=nnx.Rngs(0), axes=LOGICAL_AXES)
    x = jax.random.normal(jax.random.key(4), (4, 2, 16))
    with jax.set_mesh(mesh), pytest.warns(
            UserWarning, match=r"rules in effect at this call \(none\).*where the layer is "
                               r"called or traced"):
        nnx.jit(lambda m, x: m(x))(layer, x)


def test_a_two_node_plan_mesh_takes_the_flax_recipe():
    """On mesh_from_plan's ("data", "node", "local") mesh the plan's layer writes its
    expert axis into the metadata: the Flax recipe places the experts over
    ("node", "local") instead of raising 'Resource axis: expert ... not found'."""
    topology = two_level(2, 4, intra_alpha=1e-6, intra_beta=1e-11, inter_alpha=1e-5,
                         inter_beta=1e-10, flops=1e12, expert_capacity=8, name="2x4")
    plan = make_plan(topology, ModelSpec(num_experts=8, top_k=2), groups=[list(range(8))])
    mesh = mesh_from_plan(plan, topology=topology)
    layer = MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh, plan=plan)
    state = nnx.state(layer)
    specs = nnx.get_partition_spec(state)
    assert specs["experts"]["up_edf"].get_value() == P(("node", "local"), None, None)
    with jax.set_mesh(mesh):
        placed = jax.jit(lambda s: jax.lax.with_sharding_constraint(s, specs))(state)
    assert placed["experts"]["up_edf"][...].addressable_shards[0].data.shape[0] == 1
    nnx.update(layer, placed)
    x = jax.random.normal(jax.random.key(5), (8, 2, 16))
    with jax.set_mesh(mesh):
        y, _ = nnx.jit(lambda m, x: m(x))(layer, x)
    want, _ = moe(x.reshape(-1, 16), jax.tree.map(np.asarray, layer.logical_params()), CFG)
    np.testing.assert_allclose(np.asarray(y).reshape(-1, 16), np.asarray(want), rtol=1e-5,
                               atol=1e-6)


def test_axes_are_checked_at_construction():
    with pytest.raises(ValueError, match="one axis for two dimensions"):
        MoEAxes(expert="fsdp", embed="fsdp")
    with pytest.raises(ValueError, match="MoEAxes.mlp=3"):
        MoEAxes(mlp=3)
    with pytest.raises(TypeError, match="MoEAxes"):
        MoE(CFG, rngs=nnx.Rngs(0), axes={"expert": "fsdp"})
    assert MoEAxes(expert=["node", "local"]).expert == ("node", "local")
    with pytest.raises(ValueError, match=r"MoEAxes.embed=\('a', 'a'\) names an axis twice"):
        MoEAxes(embed=("a", "a"))
