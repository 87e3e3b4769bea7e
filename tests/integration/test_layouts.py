"""State that crosses expert layouts is refused, not silently wrong (issue 31 E): a
``MoE`` saves its layout with its state, and a layer whose structure computes with
another layout raises naming the way to load the logical weights."""

from __future__ import annotations

import jax
import numpy as np
import pytest
from flax import nnx

from aristax import MoE, MoEConfig
from aristax.parallel import layout_experts, mesh_from_plan
from aristax.planner import ModelSpec, make_plan, uniform

CFG = MoEConfig(num_experts=8, top_k=2, d_model=8, d_ff=16)
X = jax.random.normal(jax.random.key(0), (4, 6, 8))


def plan_layer():
    load = tuple(float(v) for v in np.geomspace(1.0, 40.0, 8))
    plan = make_plan(uniform(8), ModelSpec(num_experts=8, expert_load=load, top_k=2),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    return MoE(CFG, rngs=nnx.Rngs(0), mesh=mesh_from_plan(plan), plan=plan)


def test_a_plan_state_loaded_without_the_plan_is_refused():
    planned = plan_layer()
    single = MoE(CFG, rngs=nnx.Rngs(1))
    nnx.update(single, nnx.state(planned))
    with pytest.raises(ValueError, match="logical_params"):
        single(X)


@pytest.mark.parametrize("jitted", [False, True])
def test_a_permuted_state_of_equal_shape_is_refused(jitted):
    layer = MoE(CFG, rngs=nnx.Rngs(0))
    perm = np.roll(np.arange(8), 3)
    other = MoE(CFG, rngs=nnx.Rngs(0))
    physical = layout_experts(other.params(), perm)
    for name in ("gate_edf", "up_edf", "down_efd"):
        getattr(other.experts, name).set_value(getattr(physical, name))
    other.expert_layout.set_value(np.asarray(perm, np.int32))
    nnx.update(layer, nnx.state(other))  # what a checkpoint of that layout restores
    call = nnx.jit(lambda m, x: m(x)) if jitted else (lambda m, x: m(x))
    with pytest.raises(Exception, match="layout"):
        jax.block_until_ready(call(layer, X))
        jax.effects_barrier()


def test_the_logical_weights_load_into_any_layout():
    planned = plan_layer()
    single = MoE(CFG, rngs=nnx.Rngs(1))
    logical = planned.logical_params()
    for name in ("gate_edf", "up_edf", "down_efd"):
        getattr(single.experts, name).set_value(getattr(logical, name))
    single.router.weight_de.set_value(logical.router_de)
    y_single = single(X)[0]
    y_plan = nnx.jit(lambda m, x: m(x))(planned, X)[0]
    np.testing.assert_allclose(np.asarray(y_single), np.asarray(y_plan), rtol=3e-5, atol=3e-5)
    layer = MoE(CFG, rngs=nnx.Rngs(2))  # a layout-free layer keeps the identity
    jax.block_until_ready(nnx.jit(lambda m, x: m(x))(layer, X))
    jax.effects_barrier()
