"""Meshes and expert layouts from a planner ``Plan``.

Letters: E experts, G expert-parallel group size (devices per group), R groups
(data-parallel replicas of the expert layer), V = R * G devices.

The mesh has axes ("data", "expert") of shape (R, G): row r is ``plan.groups[r]``,
so every plan group is one expert-parallel group and "data" runs across groups.
Checkpoints keep experts in logical order; ``expert_permutation(plan)`` gives the
physical order (device g of a group holds physical slots g*E/G .. (g+1)*E/G - 1),
and ``layout_experts`` applies it to the weights once, when they are laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh

from aristax.moe import MoEParams
from aristax.sharding import DATA_AXIS, EXPERT_AXIS

MESH_AXES = (DATA_AXIS, EXPERT_AXIS)
_EXPERT_FIELDS = ("gate_edf", "up_edf", "down_efd")


def mesh_from_plan(
    plan,
    devices: Sequence[jax.Device] | None = None,
    *,
    num_experts: int | None = None,
    axis_types: tuple[AxisType, AxisType] | None = None,
) -> Mesh:
    """A ("data", "expert") mesh of shape (R, G) whose rows are the plan's groups.

    Args:
      plan: ``aristax.planner.Plan``; ``plan.groups[r][i]`` is an index into
        ``devices``.
      devices: the V devices the plan was made for, in the planner's device order
        (default ``jax.devices()``).
      num_experts: when given, must equal ``plan.num_experts`` (the model's E).
      axis_types: mesh axis types (default: ``Explicit`` for both, as
        ``jax.make_mesh``); ``expert_parallel_moe`` accepts either kind.
    Raises:
      ValueError: the plan's device count differs from ``len(devices)``, its expert
        count from ``num_experts``, or its groups have unequal sizes.
    """
    devices = list(jax.devices() if devices is None else devices)
    if plan.num_devices != len(devices):
        raise ValueError(
            f"plan.num_devices={plan.num_devices} but {len(devices)} devices were given; "
            "pass the devices the plan was made for (devices=...) or re-plan for "
            f"{len(devices)} devices.")
    if num_experts is not None and num_experts != plan.num_experts:
        raise ValueError(
            f"plan.num_experts={plan.num_experts} but num_experts={num_experts}; make the "
            "plan with ModelSpec(num_experts=<the model's E>).")
    sizes = sorted({len(g) for g in plan.groups})
    if len(sizes) != 1:
        raise ValueError(
            f"plan.groups have unequal sizes {[len(g) for g in plan.groups]}; a mesh needs "
            "equal expert-parallel groups: make the plan with equal groups "
            "(make_plan(..., groups=...)).")
    grid = np.empty((len(plan.groups), sizes[0]), dtype=object)
    for r, group in enumerate(plan.groups):
        for i, d in enumerate(group):
            grid[r, i] = devices[d]
    if axis_types is None:
        axis_types = (AxisType.Explicit, AxisType.Explicit)
    return Mesh(grid, MESH_AXES, axis_types=axis_types)


def expert_permutation(plan, *, allow_replicas: bool = False) -> np.ndarray:
    """int32[E]: ``perm[p]`` = logical expert in physical slot p.

    ``allow_replicas``: accept a replicated placement (``ModelSpec.num_replicas``);
    the result is then int32[P], P >= E slots with every expert at least once, the
    physical -> logical map ``expert_parallel_moe(expert_perm=...)`` takes.

    Slots are the plan's ``replicas`` of group 0 concatenated in group order, so
    device i of every group holds slots i*E/G .. (i+1)*E/G - 1. Every group must
    use the same local layout (the "expert" shards are replicated over "data").

    Raises:
      ValueError: an expert is replicated or missing, devices hold unequal numbers
        of experts, or groups lay experts out differently.
    """
    first = plan.replicas[0]
    for g, reps in enumerate(plan.replicas[1:], start=1):
        if tuple(map(tuple, reps)) != tuple(map(tuple, first)):
            raise ValueError(
                f"plan.replicas[{g}] lays experts out differently from plan.replicas[0]; "
                "expert-parallel weights are replicated over 'data', so every group needs "
                "the same per-device layout.")
    counts = [len(s) for s in first]
    if len(set(counts)) != 1:
        raise ValueError(
            f"plan.replicas[0] puts {counts} experts on the devices of a group; the "
            "expert-parallel layer needs E/G experts on every device (plan with uniform "
            "expert_load or num_replicas=None and equal device capacities).")
    perm = np.asarray([e for slots in first for e in slots], dtype=np.int32)
    if allow_replicas and sorted(set(perm.tolist())) == list(range(plan.num_experts)):
        return perm
    if sorted(perm.tolist()) != list(range(plan.num_experts)):
        raise ValueError(
            f"plan.replicas[0] holds experts {sorted(perm.tolist())}, not each of the "
            f"{plan.num_experts} experts exactly once; replicated placements are not "
            "accepted only with expert_permutation(plan, allow_replicas=True).")
    return perm


def inverse_permutation(perm: Sequence[int]) -> np.ndarray:
    """int32[E]: ``inv[e]`` = physical slot of logical expert e."""
    perm = np.asarray(perm)
    inv = np.empty_like(perm, dtype=np.int32)
    inv[perm] = np.arange(perm.size, dtype=np.int32)
    return inv


def layout_experts(params: MoEParams, perm: Sequence[int], *, inverse: bool = False) -> MoEParams:
    """Expert weights [E, ...] from logical to physical order (``inverse``: back).

    Physical slot p holds logical expert ``perm[p]``; the router and shared experts
    are unchanged (routing stays logical; the EP forward maps ids to slots).
    """
    index = inverse_permutation(perm) if inverse else np.asarray(perm, dtype=np.int32)
    changes = {
        name: None if getattr(params, name) is None else getattr(params, name)[index]
        for name in _EXPERT_FIELDS
    }
    return params.replace(**changes)
