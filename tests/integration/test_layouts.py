"""State that crosses expert layouts is refused, not silently wrong (issue 31 E): a
``MoE`` saves its layout with its state, and a layer whose structure computes with
another layout raises naming the way to load the logical weights."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import orbax.checkpoint as ocp
import pytest
from flax import nnx

from aristax import MoE, MoEConfig
from aristax.layers import layouts_checked
from aristax.parallel import layout_experts, mesh_from_plan
from aristax.planner import ModelSpec, make_plan, uniform

CFG = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=16)
X = jax.random.normal(jax.random.key(0), (4, 6, 8))


def plan_layer(seed=0, skew=40.0):
    """A layer carrying a plan for skewed expert loads: skew 40 gives 12 slots (empty
    ones pad the devices), skew 3 a permutation of the 8 experts."""
    load = tuple(float(v) for v in np.geomspace(1.0, skew, 8))
    plan = make_plan(uniform(8), ModelSpec(num_experts=8, expert_load=load, top_k=2),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    return MoE(CFG, rngs=nnx.Rngs(seed), mesh=mesh_from_plan(plan), plan=plan)


def test_a_plan_state_loaded_without_the_plan_is_refused():
    planned = plan_layer()
    single = MoE(CFG, rngs=nnx.Rngs(1))
    nnx.update(single, nnx.state(planned))
    with pytest.raises(ValueError, match="logical_params"):
        single(X)


def permuted_state_layer() -> MoE:
    """A one-device layer holding the state of one whose experts are stored rolled by
    3 (what a checkpoint of that layout restores)."""
    layer, other = MoE(CFG, rngs=nnx.Rngs(0)), MoE(CFG, rngs=nnx.Rngs(0))
    perm = np.roll(np.arange(8), 3)
    physical = layout_experts(other.params(), perm)
    for name in ("gate_edf", "up_edf", "down_efd"):
        getattr(other.experts, name).set_value(getattr(physical, name))
    other.expert_layout.set_value(np.asarray(perm, np.int32))
    nnx.update(layer, nnx.state(other))
    return layer


@pytest.mark.parametrize("jitted", [False, True])
def test_a_permuted_state_of_equal_shape_is_refused(jitted):
    layer = permuted_state_layer()
    call = nnx.jit(lambda m, x: m(x)) if jitted else (lambda m, x: m(x))
    with pytest.raises(Exception, match="layout"):
        jax.block_until_ready(call(layer, X))
        jax.effects_barrier()


def test_the_logical_weights_load_into_any_layout():
    planned = plan_layer()
    single = MoE(CFG, rngs=nnx.Rngs(1))
    single.load_logical_params(planned.logical_params())
    y_single = single(X)[0]
    y_plan = nnx.jit(lambda m, x: m(x))(planned, X)[0]
    np.testing.assert_allclose(np.asarray(y_single), np.asarray(y_plan), rtol=3e-5, atol=3e-5)
    layer = MoE(CFG, rngs=nnx.Rngs(2))  # a layout-free layer keeps the identity
    jax.block_until_ready(nnx.jit(lambda m, x: m(x))(layer, X))
    jax.effects_barrier()


def test_loaded_weights_stay_free_to_move_to_a_mesh():
    """A layer built outside any mesh holds uncommitted weights, which a later mesh
    places; weights loaded into it (from a plan's devices, here committed to the plan
    mesh) must be too, not pinned to one device ("incompatible devices" under the
    mesh), and give the same output there."""
    source = plan_layer()
    fresh, loaded = MoE(CFG, rngs=nnx.Rngs(1)), MoE(CFG, rngs=nnx.Rngs(1))
    loaded.load_logical_params(source.logical_params())
    fresh.load_logical_params(jax.tree.map(np.asarray, source.logical_params()))
    assert not any(a.committed for a in jax.tree.leaves(nnx.state(loaded, nnx.Param)))
    mesh = jax.make_mesh((2, 4), ("data", "expert"),
                         axis_types=(jax.sharding.AxisType.Auto,) * 2)
    with jax.set_mesh(mesh):
        y = nnx.jit(lambda m, x: m(x))(loaded, X)[0]
        y_fresh = nnx.jit(lambda m, x: m(x))(fresh, X)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_fresh), rtol=1e-6, atol=1e-6)
    expected = nnx.jit(lambda m, x: m(x))(source, X)[0]
    np.testing.assert_allclose(np.asarray(y), np.asarray(expected), rtol=3e-5, atol=3e-5)


def test_load_logical_params_refuses_weights_of_another_config():
    layer = MoE(CFG, rngs=nnx.Rngs(0))
    other = MoE(dataclasses.replace(CFG, d_ff=24), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match=r"params.gate_edf has shape \(8, 8, 24\)"):
        layer.load_logical_params(other.params())
    shared = MoE(dataclasses.replace(CFG, num_shared_experts=1), rngs=nnx.Rngs(0))
    with pytest.raises(ValueError, match="shared_up_df"):
        layer.load_logical_params(shared.params())


def _abstract(tree):
    """Orbax restore targets: shapes, dtypes and shardings of ``tree``'s arrays."""
    return jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=a.sharding),
                        tree)


class Stack(nnx.Module):
    """Two MoE layers in a model, as ``layouts_checked`` finds them."""

    def __init__(self, first: MoE, second: MoE):
        self.blocks = nnx.List([first, second])

    def __call__(self, x):
        return self.blocks[1](self.blocks[0](x)[0])[0]


def test_layouts_checked_refuses_a_wrong_layout_up_front():
    """The check moved out of the steps is made on entry, for every layer found."""
    with pytest.raises(ValueError, match=r"layout.*load_logical_params"):
        with layouts_checked(Stack(MoE(CFG, rngs=nnx.Rngs(1)), permuted_state_layer())):
            pytest.fail("entered with a wrong layout")


def test_steps_traced_in_layouts_checked_have_no_host_callback():
    """The run-time check is a host callback, which keeps the step out of JAX's
    persistent compilation cache; inside ``layouts_checked`` it is left out, and a step
    traced after it has the check again. The outputs are the same."""
    model = Stack(MoE(CFG, rngs=nnx.Rngs(1)), plan_layer(seed=2))

    def text(model):
        graphdef, state = nnx.split(model)
        return jax.jit(lambda s, x: nnx.merge(graphdef, s)(x)).lower(state, X).as_text()

    checked = text(model)
    with layouts_checked(model):
        unchecked = text(model)
        y = nnx.jit(lambda m, x: m(x))(model, X)
    assert "callback" in checked and "callback" not in unchecked
    assert "callback" in text(model)
    np.testing.assert_array_equal(np.asarray(y), np.asarray(nnx.jit(lambda m, x: m(x))(model, X)))


def test_orbax_between_a_plan_layout_and_one_device(tmp_path):
    """Through orbax's own API: a plan layer's raw state restored on one device is
    refused at the next call, naming load_logical_params (a permuted plan: the shapes
    agree); its logical weights restore on one device, and one device's restore into
    a plan layer of 12 slots, with equal outputs."""
    planned = plan_layer(skew=3.0)
    assert planned.ep_options.expert_perm is not None
    y_plan = nnx.jit(lambda m, x: m(x))(planned, X)[0]
    with ocp.StandardCheckpointer() as checkpointer:
        checkpointer.save(tmp_path / "state", nnx.state(planned))
        checkpointer.save(tmp_path / "logical", planned.logical_params())
        checkpointer.wait_until_finished()

        single = MoE(CFG, rngs=nnx.Rngs(1))
        nnx.update(single, checkpointer.restore(tmp_path / "state", _abstract(nnx.state(single))))
        with pytest.raises(ValueError, match=r"layout.*MoE.load_logical_params\(params\)"):
            single(X)
        single.load_logical_params(
            checkpointer.restore(tmp_path / "logical", _abstract(single.params())))
        y_single = single(X)[0]
        np.testing.assert_allclose(np.asarray(y_single), np.asarray(y_plan), rtol=3e-5,
                                   atol=3e-5)

        checkpointer.save(tmp_path / "from_single", single.logical_params())
        checkpointer.wait_until_finished()
        other = plan_layer(seed=5)
        other.load_logical_params(
            checkpointer.restore(tmp_path / "from_single", _abstract(single.params())))
    assert other.experts.up_edf[...].sharding.mesh.shape == planned.mesh.shape
    y_other = nnx.jit(lambda m, x: m(x))(other, X)[0]
    np.testing.assert_allclose(np.asarray(y_other), np.asarray(y_plan), rtol=3e-5, atol=3e-5)


def test_replicated_experts_train_as_one():
    """A plan with 16 slots for 8 experts (hot ones copied up to 6 times): each copy sees
    part of its expert's tokens, yet SGD must move every copy by the expert's whole
    gradient, as the one-device layer does. The copies drifted apart before."""
    import optax

    plan = make_plan(uniform(8, expert_capacity=4),
                     ModelSpec(num_experts=8, top_k=2, num_replicas=16,
                               expert_load=(50, 20, 10, 5, 2, 1, 1, 1)),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    mesh = mesh_from_plan(plan)
    single = MoE(CFG, rngs=nnx.Rngs(0))
    planned = MoE(CFG, rngs=nnx.Rngs(3), mesh=mesh, plan=plan)
    planned.load_logical_params(single.logical_params())
    perm = np.asarray(planned.expected_layout())
    assert len(perm) == 16 and np.bincount(perm).max() > 1  # replicas present
    target = jnp.roll(X, 1, axis=1)

    def step(model, opt):
        loss, grads = nnx.value_and_grad(
            lambda m: jnp.mean((m(X)[0] - target) ** 2))(model)
        opt.update(model, grads)
        return loss

    opts = [nnx.Optimizer(m, optax.sgd(0.5), wrt=nnx.Param) for m in (single, planned)]
    for _ in range(3):
        loss_single = nnx.jit(step)(single, opts[0])
        with jax.set_mesh(mesh):
            loss_planned = nnx.jit(step)(planned, opts[1])
        np.testing.assert_allclose(float(loss_planned), float(loss_single), rtol=1e-5)
    for name in ("gate_edf", "up_edf", "down_efd"):
        w = np.asarray(getattr(planned.experts, name)[...])
        for e in range(8):
            copies = w[perm == e]
            np.testing.assert_array_equal(copies, np.broadcast_to(copies[0], copies.shape))
        np.testing.assert_allclose(getattr(planned.logical_params(), name),
                                   getattr(single.logical_params(), name), atol=1e-6)
