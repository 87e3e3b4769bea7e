"""mesh_from_plan, expert_permutation and layout_experts."""

from __future__ import annotations

import jax
import numpy as np
import pytest

from aristax import MoEParams
from aristax.parallel import (
    expert_permutation, inverse_permutation, layout_experts, mesh_from_plan)
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import uniform

GROUPS_2X4 = [[0, 2, 4, 6], [1, 3, 5, 7]]


def plan_for(groups, num_experts=16, **model):
    return make_plan(uniform(8), ModelSpec(num_experts=num_experts, **model), groups=groups)


@pytest.mark.parametrize("groups", [[list(range(8))], GROUPS_2X4, [[0, 1], [2, 3], [4, 5], [6, 7]]])
def test_mesh_rows_are_plan_groups(groups):
    plan = plan_for(groups)
    devices = jax.devices()
    mesh = mesh_from_plan(plan, devices, num_experts=16)
    assert mesh.axis_names == ("data", "expert")
    assert mesh.devices.shape == (len(groups), len(groups[0]))
    for r, g in enumerate(plan.groups):
        assert [d.id for d in mesh.devices[r]] == [devices[i].id for i in g]


def test_mesh_uses_given_device_order():
    plan = plan_for(GROUPS_2X4)
    devices = jax.devices()[::-1]
    mesh = mesh_from_plan(plan, devices)
    assert mesh.devices[0, 1] == devices[2]


def test_mesh_errors_name_the_mismatch():
    plan = plan_for(GROUPS_2X4)
    with pytest.raises(ValueError, match="num_devices=8 but 4 devices"):
        mesh_from_plan(plan, jax.devices()[:4])
    with pytest.raises(ValueError, match="num_experts=16 but num_experts=8"):
        mesh_from_plan(plan, num_experts=8)
    uneven = plan_for([[0, 1, 2], [3, 4, 5, 6, 7]], num_experts=8)
    with pytest.raises(ValueError, match="unequal sizes"):
        mesh_from_plan(uneven)


def test_expert_permutation_follows_placement():
    plan = plan_for(GROUPS_2X4)
    perm = expert_permutation(plan)
    El = 4
    assert sorted(perm.tolist()) == list(range(16))
    for i, dev in enumerate(plan.groups[0]):
        held = {e for e, devs in enumerate(plan.placement[0]) if dev in devs}
        assert set(perm[i * El:(i + 1) * El].tolist()) == held
    np.testing.assert_array_equal(inverse_permutation(perm)[perm], np.arange(16))
    with pytest.raises(ValueError, match="not a permutation.*logical_slots"):
        inverse_permutation([2, -1, 0, 1])  # an empty slot: expert 3 has none


def test_expert_permutation_rejects_replicas_without_opt_in():
    replicated = plan_for(GROUPS_2X4, num_replicas=20)
    with pytest.raises(ValueError, match="allow_replicas=True"):
        expert_permutation(replicated)


def test_layout_round_trip():
    w = np.arange(4 * 2 * 3, dtype=np.float32).reshape(4, 2, 3)
    params = MoEParams(router_de=np.zeros((2, 4), np.float32), up_edf=w, gate_edf=w + 1,
                       down_efd=w.transpose(0, 2, 1))
    perm = np.array([2, 0, 3, 1])
    phys = layout_experts(params, perm)
    np.testing.assert_array_equal(phys.up_edf[1], w[0])
    back = layout_experts(phys, perm, inverse=True)
    for name in ("up_edf", "gate_edf", "down_efd", "router_de"):
        np.testing.assert_array_equal(getattr(back, name), getattr(params, name))
