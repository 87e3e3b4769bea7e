"""Meshes and expert layouts from a planner ``Plan``.

Letters: E experts, W expert-parallel group size (devices per group), R groups
(data-parallel replicas of the expert layer), V = R * W devices.

The mesh has axes ("data", "expert") of shape (R, W): row r is ``plan.groups[r]``,
so every plan group is one expert-parallel group and "data" runs across groups. When
the groups span N > 1 hosts the expert axis splits into ("node", "local") of shape
(N, W/N), which the "hierarchical" exchange uses.
Checkpoints keep experts in logical order; ``expert_permutation(plan)`` gives the
physical order (num_slots slots, num_slots/W per device: the plan's placement, its
replicas, and empty slots where a device holds fewer experts), and ``layout_experts``
applies it to the weights once, when they are laid out.
"""

from __future__ import annotations

from collections.abc import Sequence

import jax
import numpy as np
from jax.sharding import AxisType, Mesh
from jax.sharding import PartitionSpec as P

from aristax.moe import MoEParams
from aristax.pallas_kernels.tiling import on_auto_axes
from aristax.sharding import DATA_AXIS, EXPERT_AXIS, EXPERT_FIELDS

MESH_AXES = (DATA_AXIS, EXPERT_AXIS)
HIERARCHICAL_AXES = (DATA_AXIS, "node", "local")
EMPTY_SLOT = -1  # a physical slot that holds no expert (see expert_permutation)


def _group_nodes(plan, topology) -> int:
    """Nodes per group (1: every group inside one node) from ``topology.node``.

    Raises ValueError unless each group is node-contiguous (its devices of one node
    consecutive) with the same number of devices on each of its nodes, the layout a
    ("node", "local") pair of mesh axes can hold.
    """
    if topology is None or topology.node is None:
        return 1
    counts = set()
    for r, group in enumerate(plan.groups):
        nodes = [int(topology.node[d]) for d in group]
        runs = [n for i, n in enumerate(nodes) if i == 0 or n != nodes[i - 1]]
        if len(runs) != len(set(runs)) or len({nodes.count(n) for n in runs}) != 1:
            raise ValueError(
                f"plan.groups[{r}] = {list(group)} lies on nodes {nodes}; a (node, local) mesh "
                "needs each node's devices consecutive and equally many per node: pass "
                "hierarchical=False for a flat ('data', 'expert') mesh")
        counts.add(len(runs))
    if len(counts) != 1:
        raise ValueError(f"plan groups span different numbers of nodes {sorted(counts)}; pass "
                         "hierarchical=False for a flat ('data', 'expert') mesh")
    return counts.pop()


def mesh_from_plan(
    plan,
    devices: Sequence[jax.Device] | None = None,
    *,
    num_experts: int | None = None,
    axis_types: tuple[AxisType, ...] | None = None,
    topology=None,
    hierarchical: bool | None = None,
) -> Mesh:
    """A ("data", "expert") mesh of shape (R, W) whose rows are the plan's groups, or a
    ("data", "node", "local") mesh of shape (R, N, W/N) when the groups span N > 1
    nodes (for the "hierarchical" exchange; ``expert_parallel_options`` picks it).

    Args:
      plan: ``aristax.planner.Plan``; ``plan.groups[r][i]`` is an index into
        ``devices``.
      devices: the V devices the plan was made for, in the planner's device order
        (default ``jax.devices()``).
      num_experts: when given, must equal ``plan.num_experts`` (the model's E).
      axis_types: mesh axis types (default: ``Auto`` for every axis, so that ordinary
        model code around the layer (embedding lookups, integer-label cross-entropy)
        runs on it: JAX has no sharding rule for those ops on Explicit axes).
        ``expert_parallel_moe`` accepts either kind.
      topology: the ``aristax.planner.Topology`` the plan was made for; its ``node``
        ids tell which devices share a host.
      hierarchical: True: the 3-axis mesh (needs ``topology.node``); False: always
        the 2-axis mesh; None: 3 axes iff the groups span more than one node.
    Raises:
      ValueError: the plan's device count differs from ``len(devices)``, its expert
        count from ``num_experts``, its groups have unequal sizes, or (3 axes) a
        group's devices are not node-contiguous with equal devices per node.
    """
    devices = list(jax.devices() if devices is None else devices)
    if plan.num_devices != len(devices):
        raise ValueError(
            f"plan.num_devices={plan.num_devices} but {len(devices)} devices were given; "
            "pass the devices the plan was made for (devices=...) or re-plan for "
            f"{len(devices)} devices.")
    if topology is not None and topology.num_devices != plan.num_devices:
        raise ValueError(
            f"topology= has {topology.num_devices} devices but the plan is for "
            f"{plan.num_devices}: pass the topology the plan was made for, or re-plan.")
    if num_experts is not None and num_experts != plan.num_experts:
        raise ValueError(
            f"plan.num_experts={plan.num_experts} but num_experts={num_experts}; make the "
            "plan with ModelSpec(num_experts=<the model's E>).")
    sizes = sorted({len(g) for g in plan.groups})
    if len(sizes) != 1:
        raise ValueError(
            f"plan.groups have unequal sizes {[len(g) for g in plan.groups]}; a mesh needs "
            "equal expert-parallel groups: make the plan with "
            "make_plan(..., equal_groups=True) (or groups= of one size).")
    if hierarchical and (topology is None or topology.node is None):
        raise ValueError("hierarchical=True needs topology= with node ids (Topology.node)")
    nodes = _group_nodes(plan, topology) if hierarchical is not False else 1
    grid = np.array([[devices[d] for d in group] for group in plan.groups], dtype=object)
    names = MESH_AXES
    if nodes > 1 or hierarchical:
        grid = grid.reshape(len(plan.groups), nodes, sizes[0] // nodes)
        names = HIERARCHICAL_AXES
    if axis_types is None:
        axis_types = (AxisType.Auto,) * len(names)
    return Mesh(grid, names, axis_types=axis_types)


def expert_axes_of(mesh) -> str | tuple[str, str]:
    """The expert-parallel axis of a ``mesh_from_plan`` mesh: "expert" or ("node", "local")."""
    if EXPERT_AXIS in mesh.axis_names:
        return EXPERT_AXIS
    if all(a in mesh.axis_names for a in HIERARCHICAL_AXES[1:]):
        return HIERARCHICAL_AXES[1:]
    raise ValueError(f"mesh axes {mesh.axis_names} have no expert axis: build the mesh with "
                     "mesh_from_plan, or name an 'expert' axis")


def expert_permutation(plan, *, allow_replicas: bool = False) -> np.ndarray:
    """int32[num_slots]: ``perm[s]`` = logical expert in physical slot s, or
    ``EMPTY_SLOT`` (-1).

    Slots are the plan's ``replicas`` of group 0 concatenated in group order, each
    device padded to the most experts any device holds: device i of every group
    holds slots i*El .. (i+1)*El - 1 (El = num_slots / W). Padding slots (a device
    that holds fewer experts, as LysiAssign gives slower or smaller devices) are
    ``EMPTY_SLOT``: zero weights, never routed to. num_slots = E when the plan places
    every expert once on equally loaded devices; then ``perm`` is a permutation.

    ``allow_replicas``: accept a replicated placement (``ModelSpec.num_replicas``):
    experts may then occupy several slots.

    Every group must use the same local layout (the "expert" shards are replicated
    over "data").

    Raises:
      ValueError: an expert is missing, replicated without ``allow_replicas``, or
        groups lay experts out differently.
    """
    first = plan.replicas[0]
    for g, reps in enumerate(plan.replicas[1:], start=1):
        if tuple(map(tuple, reps)) != tuple(map(tuple, first)):
            raise ValueError(
                f"plan.replicas[{g}] lays experts out differently from plan.replicas[0]; "
                "expert-parallel weights are replicated over 'data', so every group needs "
                "the same per-device layout: plan with make_plan(..., equal_groups=True), "
                "which keeps only groupings that share one.")
    width = max(len(s) for s in first)
    perm = np.asarray([e for slots in first for e in tuple(slots)
                       + (EMPTY_SLOT,) * (width - len(slots))], dtype=np.int32)
    held = perm[perm != EMPTY_SLOT].tolist()
    if sorted(set(held)) != list(range(plan.num_experts)):
        raise ValueError(f"plan.replicas[0] holds experts {sorted(set(held))}, not every one of "
                         f"the {plan.num_experts} experts")
    if len(held) != len(set(held)) and not allow_replicas:
        raise ValueError(
            "plan.replicas[0] replicates experts; pass expert_permutation(plan, "
            "allow_replicas=True) for the replicated layout")
    return perm


def logical_slots(perm: Sequence[int], num_experts: int) -> np.ndarray:
    """int32[E]: the first physical slot of each logical expert in ``perm``
    int[num_slots]."""
    perm = np.asarray(perm)
    return np.asarray([np.flatnonzero(perm == e)[0] for e in range(num_experts)], np.int32)


def inverse_permutation(perm: Sequence[int]) -> np.ndarray:
    """int32[E]: ``inv[e]`` = physical slot of logical expert e, for ``perm`` a
    permutation of range(E) (one slot per expert; see ``logical_slots`` for layouts
    with replicas or empty slots)."""
    perm = np.asarray(perm)
    if not np.array_equal(np.sort(perm), np.arange(perm.size)):
        raise ValueError(f"perm={perm.tolist()} is not a permutation of range({perm.size}); "
                         "for replicated experts or empty slots use logical_slots")
    inv = np.empty_like(perm, dtype=np.int32)
    inv[perm] = np.arange(perm.size, dtype=np.int32)
    return inv


def layout_expert_weights(w, perm: Sequence[int], *, inverse: bool = False):
    """One stacked expert array from logical [E, ...] to physical [num_slots, ...] order
    (``inverse``: back). Physical slot s holds logical expert ``perm[s]``
    (``EMPTY_SLOT``: zeros); back to logical order, a replicated expert is read from
    its first slot."""
    perm = np.asarray(perm, dtype=np.int32)
    # a gather along a dimension sharded over Explicit axes (after nnx.jit on a mesh
    # from a plan) needs those axes Auto; the result is replicated. A NumPy array (a
    # checkpoint on the host) is gathered by NumPy.
    def gather(w, rows):
        if isinstance(w, np.ndarray):
            return w[rows]
        return on_auto_axes(lambda w: w[rows], w, out_sharding=P())

    if inverse:
        return gather(w, logical_slots(perm, int(perm.max()) + 1))
    out = gather(w, np.maximum(perm, 0))
    empty = perm == EMPTY_SLOT
    if empty.any():
        out = out * (~empty).astype(out.dtype).reshape((-1,) + (1,) * (out.ndim - 1))
    return out


def layout_experts(params: MoEParams, perm: Sequence[int], *, inverse: bool = False) -> MoEParams:
    """``layout_expert_weights`` on the expert weights of ``params``; the router and
    shared experts are unchanged (routing stays logical; the EP forward maps ids to
    slots)."""
    return params.replace(**{
        name: None if getattr(params, name) is None
        else layout_expert_weights(getattr(params, name), perm, inverse=inverse)
        for name in EXPERT_FIELDS})
