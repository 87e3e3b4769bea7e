"""Plans the planner really produces, carried out by the EP layer on 8 CPU devices:
unequal experts per device (empty slots), groups that span nodes ((node, local) mesh and
the hierarchical exchange), and ``aristax.MoE(plan=...)``; each against the
single-device ``aristax.moe.moe`` with the logical weights."""

from __future__ import annotations

import math

import jax
import numpy as np
import pytest
from flax import nnx

from aristax import MoE, MoEConfig, moe
from aristax.parallel import (
    EMPTY_SLOT, HIERARCHICAL_AXES, expert_parallel_moe, expert_parallel_options,
    expert_permutation, layout_experts, mesh_from_plan)
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import two_level, uniform
from test_expert_parallel import D, F, T, make_params, value_and_grads

GROUPS_2X4 = [[0, 1, 2, 3], [4, 5, 6, 7]]


def skewed_plan(num_experts=8):
    load = tuple(float(v) for v in np.geomspace(1.0, 40.0, num_experts))
    return make_plan(uniform(8), ModelSpec(num_experts=num_experts, expert_load=load, top_k=2),
                     groups=GROUPS_2X4)


def two_nodes():
    return two_level(2, 4, intra_alpha=1e-6, intra_beta=1e-11, inter_alpha=1e-5,
                     inter_beta=1e-10, flops=1e12, expert_capacity=8, name="2x4")


def assert_matches_single_device(ep, cfg, params, perm, seed=3):
    x = jax.random.normal(jax.random.key(seed), (T, D))
    ct = jax.random.normal(jax.random.key(seed + 1), (T, D))
    (y, aux), (gx, gp) = value_and_grads(ep, x, layout_experts(params, perm), ct)
    (y_r, aux_r), (rx, rp) = value_and_grads(lambda x, p: moe(x, p, cfg), x, params, ct)
    tol = dict(atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_r), **tol)
    for k in ("loss", "lb_loss", "z_loss", "expert_load"):
        np.testing.assert_allclose(np.asarray(aux[k]), np.asarray(aux_r[k]), rtol=1e-5, err_msg=k)
    assert int(aux["num_overflow"]) == 0
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), **tol)
    phys = np.asarray(perm)
    for name in ("up_edf", "gate_edf", "down_efd"):
        g = np.asarray(getattr(gp, name))
        assert not np.any(g[phys == EMPTY_SLOT]), f"{name}: an empty slot got a gradient"
        for e in range(cfg.num_experts):  # each slot of e (a replica) gets e's gradient
            want = np.asarray(getattr(rp, name))[e]
            np.testing.assert_allclose(g[phys == e], np.broadcast_to(want, g[phys == e].shape),
                                       err_msg=f"{name} expert {e}", **tol)


def test_skewed_plan_pads_devices_with_empty_slots():
    plan = skewed_plan()
    counts = [len(s) for s in plan.replicas[0]]
    assert len(set(counts)) > 1, f"the planner gave equal counts {counts}; pick a skewed load"
    perm = expert_permutation(plan)
    width = max(counts)
    assert perm.shape == (4 * width,)
    for i, slots in enumerate(plan.replicas[0]):
        block = perm[i * width:(i + 1) * width].tolist()
        assert block == list(slots) + [EMPTY_SLOT] * (width - len(slots))


@pytest.mark.parametrize("capacity_factor", [None, 4.0])
def test_skewed_plan_equals_single_device(capacity_factor):
    plan = skewed_plan()
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F, capacity_factor=capacity_factor)
    mesh = mesh_from_plan(plan, num_experts=8)
    options = expert_parallel_options(plan, mesh, platform="cpu")
    assert options["exchange"] == "padded" and options["expert_axis"] == "expert"
    assert EMPTY_SLOT in options["expert_perm"]
    params = make_params(cfg)
    # capacity 4.0*Tl*K/E per source shard never binds here, so EP equals the whole batch
    assert_matches_single_device(lambda x, p: expert_parallel_moe(x, p, cfg, mesh, **options),
                                 cfg, params, options["expert_perm"])


def test_layout_round_trip_with_empty_slots():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    params = make_params(cfg)
    perm = expert_permutation(skewed_plan())
    phys = layout_experts(params, perm)
    assert not np.any(np.asarray(phys.up_edf)[perm == EMPTY_SLOT])
    back = layout_experts(phys, perm, inverse=True)
    np.testing.assert_array_equal(np.asarray(back.down_efd), np.asarray(params.down_efd))


def test_groups_spanning_nodes_get_a_node_local_mesh_and_hierarchical_exchange():
    topo = two_nodes()
    plan = make_plan(topo, ModelSpec(num_experts=8, top_k=2), groups=[list(range(8))])
    mesh = mesh_from_plan(plan, topology=topo)
    assert mesh.axis_names == HIERARCHICAL_AXES and mesh.devices.shape == (1, 2, 4)
    assert [d.id for d in mesh.devices[0, 1]] == [jax.devices()[i].id for i in range(4, 8)]
    options = expert_parallel_options(plan, mesh)
    assert options["exchange"] == "hierarchical" and options["expert_axis"] == ("node", "local")
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    perm = options["expert_perm"] or tuple(range(8))
    assert_matches_single_device(lambda x, p: expert_parallel_moe(x, p, cfg, mesh, **options),
                                 cfg, make_params(cfg), perm)
    flat = mesh_from_plan(plan, topology=topo, hierarchical=False)
    assert flat.axis_names == ("data", "expert")


def test_mesh_from_plan_rejects_groups_that_interleave_nodes():
    topo = two_nodes()
    plan = make_plan(topo, ModelSpec(num_experts=8), groups=[[0, 1, 2, 4], [3, 5, 6, 7]])  # 3 + 1
    with pytest.raises(ValueError, match="hierarchical=False"):
        mesh_from_plan(plan, topology=topo)
    with pytest.raises(ValueError, match="topology="):
        mesh_from_plan(plan, hierarchical=True)


@pytest.mark.parametrize("devices", [4, 16])
def test_mesh_from_plan_refuses_a_topology_of_another_size(devices):
    """It silently built the mesh (16) or raised a bare IndexError (4)."""
    plan = make_plan(two_nodes(), ModelSpec(num_experts=8))
    with pytest.raises(ValueError, match=f"topology= has {devices} devices but the plan "
                                         f"is for 8"):
        mesh_from_plan(plan, topology=uniform(devices))


def test_moe_refuses_a_mesh_not_built_from_its_plan():
    """A (4, 2) mesh for a plan of 2 groups of 4 was accepted: 4 experts per device, the
    plan's placement ignored."""
    plan = make_plan(uniform(8, expert_capacity=2), ModelSpec(num_experts=8, top_k=2))
    assert [len(g) for g in plan.groups] == [4, 4]
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    with pytest.raises(ValueError, match=r"mesh \{'data': 4, 'expert': 2\} is not the plan's"
                                         r".*2 expert-parallel groups of 4"):
        MoE(cfg, rngs=nnx.Rngs(0), mesh=jax.make_mesh((4, 2), ("data", "expert")), plan=plan)


@pytest.mark.parametrize("shape", [(4, 2), (2, 2), (1, 8), (2, 2, 2)])
def test_expert_parallel_options_refuses_a_mesh_not_built_from_its_plan(shape):
    """The functional API's front door to a plan took any mesh: a (4, 2) or (1, 8) mesh
    for 2 groups of 4 split the experts as the plan did not, and so did a (2, 2, 2)
    mesh with a third axis beside ("data", "expert"), of the plan's 2 groups and 8
    devices but groups of 2."""
    plan = make_plan(uniform(8, expert_capacity=2), ModelSpec(num_experts=8, top_k=2))
    names = ("data", "expert", "tensor")[:len(shape)]
    mesh = jax.make_mesh(shape, names, devices=jax.devices()[:math.prod(shape)])
    with pytest.raises(ValueError, match=rf"mesh \{{'data': {shape[0]}, 'expert': {shape[1]}"
                                         r".*\} is not the plan's.*mesh_from_plan"):
        expert_parallel_options(plan, mesh)
    assert expert_parallel_options(plan, mesh_from_plan(plan))["expert_axis"] == "expert"


def test_options_a_plan_cannot_run_are_refused_when_the_layer_is_built():
    """A user trial: exchange='hierarchical' on a flat plan mesh and expert choice with
    plan= were accepted by MoE(...) and refused at the first call, naming expert_axis
    (which a plan= user never sets) or no fix. Both are refused at construction now,
    naming what to do; the plan's own exchange on the node-split mesh still works."""
    topo = two_nodes()
    plan = make_plan(topo, ModelSpec(num_experts=8, top_k=2), groups=[list(range(8))])
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    with pytest.raises(ValueError, match=r"exchange='hierarchical' needs a plan mesh that "
                                         r"splits.*mesh_from_plan\(plan, devices, topology="):
        MoE(cfg.replace(exchange="hierarchical"), rngs=nnx.Rngs(0),
            mesh=mesh_from_plan(plan, hierarchical=False), plan=plan)
    with pytest.raises(ValueError, match="expert_choice.*use a token-choice router"):
        MoE(cfg.replace(router="expert_choice"), rngs=nnx.Rngs(0),
            mesh=mesh_from_plan(plan), plan=plan)
    layer = MoE(cfg.replace(exchange="hierarchical"), rngs=nnx.Rngs(0),
                mesh=mesh_from_plan(plan, topology=topo), plan=plan)
    assert layer.ep_options.exchange == "hierarchical"


def test_moe_module_carries_out_a_skewed_plan():
    plan = skewed_plan()
    mesh = mesh_from_plan(plan)
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    single = MoE(cfg, rngs=nnx.Rngs(0))
    layer = MoE(cfg, rngs=nnx.Rngs(0), mesh=mesh, plan=plan)
    perm = layer.ep_options.expert_perm
    assert layer.experts.up_edf[...].shape[0] == len(perm) > cfg.num_experts
    for name in ("up_edf", "gate_edf", "down_efd"):  # checkpoints see the logical order
        np.testing.assert_array_equal(np.asarray(getattr(layer.logical_params(), name)),
                                      np.asarray(getattr(single.params(), name)))
    x = jax.random.normal(jax.random.key(5), (4, T // 4, D))
    y, aux = nnx.jit(lambda m, x: m(x))(layer, x)
    y_r, aux_r = single(x)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_r), atol=3e-5, rtol=3e-5)
    np.testing.assert_allclose(np.asarray(aux["expert_load"]), np.asarray(aux_r["expert_load"]))
    # after nnx.jit the weights are typed sharded over the plan mesh's axes;
    # reading them back in logical order gathers along that dimension
    for name in ("up_edf", "gate_edf", "down_efd"):
        np.testing.assert_array_equal(np.asarray(getattr(layer.logical_params(), name)),
                                      np.asarray(getattr(single.params(), name)))
    with pytest.raises(ValueError, match="needs mesh="):
        MoE(cfg, rngs=nnx.Rngs(0), plan=plan)


def test_plan_chunk_count_is_capped_for_small_batches_and_num_chunks_overrides_it():
    # the plan's Lancet count is made for tokens_per_device=4096; a 2-token shard
    # must still run (capped at one chunk per token), and num_chunks=1 turns it off
    plan = make_plan(uniform(8), ModelSpec(num_experts=8, top_k=2), groups=GROUPS_2X4)
    mesh = mesh_from_plan(plan)
    planned = dict(expert_parallel_options(plan, mesh))["num_chunks"]
    assert planned > 2
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    single = MoE(cfg, rngs=nnx.Rngs(0))
    for num_chunks, tokens, expect in ((None, 16, 2), (None, 8 * planned, planned), (1, 16, 1),
                                       (4, 16, 2)):  # a set count is capped too
        layer = MoE(cfg.replace(num_chunks=num_chunks), rngs=nnx.Rngs(0), mesh=mesh, plan=plan)
        assert layer.plan_call_options(tokens)["num_chunks"] == expect
        x = jax.random.normal(jax.random.key(tokens), (1, tokens, D))
        y, aux = layer(x)
        np.testing.assert_allclose(np.asarray(y), np.asarray(single(x)[0]), atol=3e-5, rtol=3e-5)
