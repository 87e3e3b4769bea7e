"""Building the :class:`Plan`, everything the planner decides: ``make_plan`` and the
baseline groupings it is checked against.

``make_plan(topology, model)`` runs, deterministically:

1. groups: :func:`~aristax.planner.lysi.lysi_group` (Aristos Alg. 1) on the
   :class:`ModelSpec`'s :class:`~aristax.planner.lysi.Workload`, or given ``groups``
   (see :func:`baseline_groups` for the Aristos Fig. 3 heuristics). With
   ``select="best"`` (default) LysiGroup's grouping is checked against the Fig. 3
   heuristics (single node, world, minimal) under :func:`~aristax.planner.simulate.
   simulate`'s model and the fastest is kept (ties: LysiGroup); each candidate's
   all-to-alls are timed at Aurora's bound, which the order step 3 builds reaches, so
   only the kept grouping builds its orders (the world grouping's alone take up to
   V^2 matchings: minutes at 512 devices). Why: eq. 4's compute term
   pi(g) = sum f / sum F assumes balanced experts; with skewed ``expert_load`` the
   hottest expert bounds compute and its rows grow with |g|, so LysiGroup can pick
   groups that are too large (e.g. Perlmutter 4x4, 128 Zipf-loaded experts: one
   16-GPU group, 3.6x slower than single-node groups). ``select="lysi"`` keeps
   LysiGroup's answer unconditionally. The candidates also include equal groups
   (:func:`equal_size_groups`: every size whose groups each hold the experts), which a
   device mesh needs (``mesh_from_plan``); ``equal_groups=True`` keeps only candidates
   of equal sizes whose groups share one expert layout (step 2), so that the plan runs
   in the layer;
2. placement per group: :func:`~aristax.planner.lysi.lysi_assign` (Aristos Alg. 2)
   with expert costs p_e |g| T K f (p = routing share of each expert), or, when
   ``model.num_replicas`` is set, :func:`~aristax.planner.replication.replicate_experts`
   with that many physical slots per group (equal slots per device); a group whose
   devices match the first group's (FLOP/s, expert capacity, place among the group's
   nodes) takes the first group's placement, its devices ordered to repeat it, so that
   the groups can be the rows of one mesh; ``assign="random"`` is Aurora section 8's
   random GPU assignment baseline;
3. the all-to-all transmission order per group: :func:`~aristax.planner.aurora.
   schedule_all_to_all` (Aurora Thm 4.2) on the expected dispatch *time* matrix
   (:func:`dispatch_times`), so round amounts are seconds of link time;
4. operator partitions: :func:`~aristax.planner.lancet.plan_partitions` (Lancet 5.1)
   over the forward of one MoE block (:func:`block_ops`) of the slowest group.

:func:`compare` sets the plan against the seeds' baselines under the simulator.

Modules, lowest first (each imports only those before it): :mod:`~aristax.planner.spec`
(:class:`ModelSpec`, :class:`Plan` and its index conventions), :mod:`~aristax.planner.
costs` (the cost terms: :func:`dispatch_times`, :func:`expert_compute`,
:func:`block_ops`, ...), :mod:`~aristax.planner.simulate`, then this module. The
names that lived here before that split are re-exported, so ``aristax.planner.plan.X``
still works for each of them.
"""

from __future__ import annotations

import dataclasses
from typing import Sequence

import numpy as np

from aristax.planner import aurora, lancet
from aristax.planner.costs import (ATTENTION_FLOPS_PER_TOKEN, block_ops, dispatch_bytes,
                                   dispatch_times, expert_compute, link_times)
from aristax.planner.lysi import POLICIES, lysi_assign, lysi_group
from aristax.planner.replication import replicate_experts
from aristax.planner.simulate import group_layer_time, iteration_time, simulate
from aristax.planner.spec import ModelSpec, Plan, check_groups
from aristax.planner.topology import Topology

__all__ = [  # with the names that moved to spec and costs, re-exported from here
    "ATTENTION_FLOPS_PER_TOKEN", "ModelSpec", "Plan", "baseline_groups", "block_ops",
    "check_groups", "compare", "dispatch_bytes", "dispatch_times", "equal_size_groups",
    "expert_compute", "link_times", "make_plan",
]


# ----------------------------------------------------------- building blocks
def baseline_groups(topology: Topology, num_experts: int, kind: str) -> list[list[int]]:
    """The expert-parallel grouping heuristics of Aristos Fig. 3 / section 3.

    - "world": one group of every device (Fedus et al.; Rajbhandari et al.).
    - "single_node": one group per host (``topology.node``; Narayanan et al.); a host
      that cannot hold all experts is merged with the next hosts until it can.
    - "minimal": min |CG|, consecutive devices until their expert_capacity holds all
      experts; a last group too small to hold them joins the previous one.
    """
    v = topology.num_devices
    cap = topology.expert_capacity
    if int(cap.sum()) < num_experts:
        raise ValueError(f"the cluster holds {int(cap.sum())} experts, fewer than num_experts={num_experts}.")
    if kind == "world":
        return [list(range(v))]
    if kind == "single_node":
        node = topology.host_ids
        units = [np.flatnonzero(node == n).tolist() for n in sorted(set(node.tolist()))]
    elif kind == "minimal":
        units = [[d] for d in range(v)]
    else:
        raise ValueError(f"kind must be 'world', 'single_node' or 'minimal', got {kind!r}.")
    groups: list[list[int]] = []
    cur: list[int] = []
    for u in units:
        cur = cur + u
        if cap[cur].sum() >= num_experts:
            groups.append(cur)
            cur = []
    if cur:
        groups[-1] = sorted(groups[-1] + cur)
    return groups


def equal_size_groups(topology: Topology, num_experts: int) -> dict[int, list[list[int]]]:
    """{size s: groups}: for each s dividing the device count whose groups each hold
    ``num_experts`` (their ``expert_capacity``), consecutive runs of s devices in host
    order (``topology.node``, then id)."""
    v = topology.num_devices
    node = topology.host_ids
    order = sorted(range(v), key=lambda d: (int(node[d]), d))
    out = {}
    for size in (s for s in range(1, v + 1) if v % s == 0):
        groups = [sorted(order[i:i + size]) for i in range(0, v, size)]
        if all(topology.expert_capacity[g].sum() >= num_experts for g in groups):
            out[size] = groups
    return out


def _slots_lysi(group: Sequence[int], topology: Topology, costs: np.ndarray) -> list[list[int]]:
    a = lysi_assign(topology.flops[list(group)], topology.expert_capacity[list(group)], costs)
    return [list(xs) for xs in a.experts]


def _slots_random(group: Sequence[int], topology: Topology, num_experts: int, rng) -> list[list[int]]:
    """Aurora 8's random GPU assignment: experts shuffled, dealt round robin over the
    group's devices in a random order, skipping devices whose memory is full."""
    cap = topology.expert_capacity[list(group)].astype(np.int64).copy()
    order = rng.permutation(len(group))
    slots: list[list[int]] = [[] for _ in group]
    k = 0
    for x in rng.permutation(num_experts).tolist():
        while cap[order[k % len(order)]] == 0:
            k += 1
        w = order[k % len(order)]
        slots[w].append(int(x))
        cap[w] -= 1
        k += 1
    return [sorted(s) for s in slots]


def _slots_replicated(group: Sequence[int], topology: Topology, costs: np.ndarray, num_replicas: int
                      ) -> list[list[int]]:
    n = len(group)
    if num_replicas % n:
        raise ValueError(f"model.num_replicas={num_replicas} must be a multiple of the group size {n} "
                         f"(group {list(group)}); pick a multiple or None.")
    if np.any(topology.expert_capacity[list(group)] < num_replicas // n):
        raise ValueError(f"model.num_replicas={num_replicas} puts {num_replicas // n} slots on each device "
                         f"of group {list(group)}, more than its expert_capacity; lower num_replicas.")
    rep = replicate_experts(costs, num_replicas, n)
    per = num_replicas // n
    return [list(rep.phy_to_log[w * per:(w + 1) * per]) for w in range(n)]


# ------------------------------------------------------------------ make_plan
def make_plan(
    topology: Topology,
    model: ModelSpec,
    *,
    groups: Sequence[Sequence[int]] | None = None,
    policy: str = "max_min_fair",
    assign: str = "lysi",
    seed: int = 0,
    max_partitions: int = 8,
    partition_overhead: float = 1e-5,
    select: str = "best",
    equal_groups: bool = False,
) -> Plan:
    """Plan expert parallelism for ``model`` on ``topology`` (see the module doc).

    ``groups`` overrides LysiGroup (e.g. :func:`baseline_groups`); ``assign`` is "lysi"
    (LysiAssign / replication) or "random" (Aurora 8 baseline, seeded by ``seed``);
    ``partition_overhead`` seconds per partitioned piece (Lancet 5.1's partition
    overhead: kernel launch plus split/concat), ``max_partitions`` = K.
    ``select``: "best" or "lysi" (module doc, step 1; ignored when ``groups`` is given);
    meta["grouping"] names the grouping kept ("lysi", "single_node", "world",
    "minimal", "equal:<size>" or "given") and meta["candidates"] the simulated
    iteration times of all candidates. ``equal_groups=True``: groups of one size whose
    devices lay the experts out alike (one layout, repeated by every group), as
    ``mesh_from_plan`` and the layer need (given ``groups`` or LysiGroup's with
    ``select="lysi"`` that are not are refused).
    Deterministic: equal inputs give equal plans (and equal JSON).
    """
    if not isinstance(topology, Topology):
        raise TypeError(f"topology must be an aristax.planner.Topology, got "
                        f"{type(topology).__name__}; e.g. topology.preset('perlmutter', 4).")
    if not isinstance(model, ModelSpec):
        raise TypeError(f"model must be an aristax.planner.ModelSpec, got {type(model).__name__}.")
    if assign not in ("lysi", "random"):
        raise ValueError(f"assign must be 'lysi' or 'random', got {assign!r}.")
    if select not in ("best", "lysi"):
        raise ValueError(f"select must be 'best' or 'lysi', got {select!r}.")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    if not isinstance(equal_groups, bool):
        raise TypeError(f"equal_groups must be True or False, got {equal_groups!r}.")
    kwargs = dict(policy=policy, assign=assign, seed=seed, max_partitions=max_partitions,
                  partition_overhead=partition_overhead)
    if groups is not None:
        check_groups(groups, topology.num_devices)
        _check_equal(groups, equal_groups, "groups=")
        return _check_layout(_make_plan(topology, model, groups, grouping="given", **kwargs),
                             equal_groups, "groups=")
    lysi_groups = lysi_group(topology, model.workload(), policy=policy)
    if select == "lysi":
        _check_equal(lysi_groups, equal_groups, "LysiGroup (select='lysi')")
        return _check_layout(_make_plan(topology, model, lysi_groups, grouping="lysi", **kwargs),
                             equal_groups, "LysiGroup (select='lysi')")
    candidates = {"lysi": lysi_groups}
    for kind in ("single_node", "world", "minimal"):
        candidates[kind] = baseline_groups(topology, model.num_experts, kind)
    for size, cand in equal_size_groups(topology, model.num_experts).items():
        candidates[f"equal:{size}"] = cand
    best, times = _fastest(candidates, topology, model, equal_groups, assign=assign, seed=seed)
    plan = _make_plan(topology, model, candidates[best], grouping=best, **kwargs)
    return dataclasses.replace(plan, meta=dict(plan.meta, candidates=times))


def _check_equal(groups, equal_groups: bool, what: str) -> None:
    sizes = [len(g) for g in groups]
    if equal_groups and len(set(sizes)) > 1:
        raise ValueError(f"equal_groups=True but {what} gives groups of sizes {sizes}; pass "
                         "groups of one size, or select='best' to choose among equal ones.")


# Why equal_groups=True refuses a grouping: the layer replicates its expert weights over
# the groups, so every group must lay the experts out alike.
_UNLIKE_LAYOUTS = ("groups of unlike devices (FLOP/s, expert capacity), whose expert layouts "
                   "differ, and the layer needs one")


def _one_layout(layouts) -> bool:
    """Whether every group's per-device slots (``Plan.replicas``' form) equal the first's."""
    first, *rest = [tuple(map(tuple, layout)) for layout in layouts]
    return all(layout == first for layout in rest)


def _check_layout(plan: Plan, equal_groups: bool, what: str) -> Plan:
    if equal_groups and not _one_layout(plan.replicas):
        raise ValueError(f"equal_groups=True but {what} gives {_UNLIKE_LAYOUTS}; pass groups "
                         "of matching devices, or select='best' to choose among groupings "
                         "that share one layout.")
    return plan


def _fastest(candidates: dict, topology: Topology, model: ModelSpec, equal_groups: bool, *,
             assign: str, seed: int) -> tuple[str, dict[str, float]]:
    """(the kind of the fastest candidate grouping under the simulator, {kind: time}),
    ties to the first; with ``equal_groups`` only groupings of one size. LysiGroup does
    not see num_replicas, so its groups may not hold the replicas (ValueError); then
    the fastest grouping that does is kept, and only when none does is an error
    (LysiGroup's, else the first) raised."""
    best, times, seen, errors = None, {}, {}, []
    for kind, groups in candidates.items():
        if equal_groups and len({len(g) for g in groups}) > 1:
            continue
        key = tuple(sorted(tuple(sorted(g)) for g in groups))
        if key in seen:  # the same grouping under another name
            if seen[key] in times:
                times[kind] = times[seen[key]]
            continue
        seen[key] = kind
        try:
            slots = _group_slots(topology, model, groups, assign=assign, seed=seed)
        except ValueError as error:  # e.g. num_replicas not a multiple of the group sizes
            errors.append(error)
            continue
        if equal_groups and not _one_layout([sl for _, sl in slots]):
            errors.append(ValueError(
                f"equal_groups=True: grouping {kind!r} has {_UNLIKE_LAYOUTS}; pass groups= "
                "of devices with matching FLOP/s and capacity"))
            continue
        layers = [group_layer_time(sl, g, topology, model) for g, sl in slots]
        times[kind] = iteration_time(layers, groups, topology, model)[2]
        if best is None or times[kind] < times[best]:
            best = kind
    if best is None:
        raise errors[0]
    return best, times


def _group_slots(topology: Topology, model: ModelSpec, groups, *, assign: str, seed: int
                 ) -> list[tuple[list[int], list]]:
    """make_plan step 2: (sorted group, logical experts in each device's slots) per group
    (LysiAssign, replication or the seeded random baseline)."""
    if assign == "random" and model.num_replicas is not None:
        raise ValueError("assign='random' places each expert once; pass num_replicas=None for it.")
    wl = model.workload()
    rng = np.random.default_rng(seed)
    p = model.shares()
    out, first = [], None
    for group in [sorted(int(d) for d in g) for g in groups]:
        if topology.expert_capacity[group].sum() < model.num_experts:
            raise ValueError(f"group {group} holds {int(topology.expert_capacity[group].sum())} experts, "
                             f"fewer than num_experts={model.num_experts}; merge it with another group.")
        costs = p * len(group) * model.tokens_per_device * model.top_k * wl.token_flops
        keys = _device_keys(group, topology)
        if assign == "random":
            slots = _slots_random(group, topology, model.num_experts, rng)
        elif first is not None and sorted(keys) == sorted(first[0]):
            group, slots = _like_first(group, keys, *first)
        else:
            slots = (_slots_replicated(group, topology, costs, model.num_replicas)
                     if model.num_replicas is not None else _slots_lysi(group, topology, costs))
            first = first or (keys, slots)
        out.append((group, slots))
    return out


def _device_keys(group: list[int], topology: Topology) -> list[tuple]:
    """What placement and the mesh see of each device of ``group``: (FLOP/s, expert
    capacity, index of its host among the group's hosts)."""
    node = topology.host_ids
    hosts = sorted({int(node[d]) for d in group})
    return [(float(topology.flops[d]), int(topology.expert_capacity[d]),
             hosts.index(int(node[d]))) for d in group]


def _like_first(group: list[int], keys: list[tuple], first_keys: list[tuple],
                first_slots: list) -> tuple[list[int], list]:
    """``group``'s devices ordered so that the w-th has the first group's w-th key (the
    lowest id first among equal keys), with the first group's slots."""
    pool: dict[tuple, list[int]] = {}
    for d, k in zip(group, keys):
        pool.setdefault(k, []).append(d)
    return [pool[k].pop(0) for k in first_keys], [list(xs) for xs in first_slots]


def _make_plan(topology: Topology, model: ModelSpec, groups, *, grouping: str, policy: str, assign: str,
               seed: int, max_partitions: int, partition_overhead: float) -> Plan:
    """make_plan steps 2-4 for fixed ``groups``."""
    placed = _group_slots(topology, model, groups, assign=assign, seed=seed)
    placement, replicas, schedules, worst = [], [], [], None
    for group, slots in placed:
        t = dispatch_times(slots, group, topology, model)
        sched = aurora.schedule_all_to_all(t)
        comp = expert_compute(slots, group, topology, model)
        combine = aurora.lower_bound(t.T)
        layer = float(comp.max()) + sched.makespan + combine
        if worst is None or layer > worst[0]:
            worst = (layer, comp, sched.makespan, combine, group)
        where: list[list[int]] = [[] for _ in range(model.num_experts)]
        for d, xs in zip(group, slots):
            for x in sorted(set(xs)):
                where[x].append(d)
        placement.append(tuple(tuple(w) for w in where))
        replicas.append(tuple(tuple(int(x) for x in xs) for xs in slots))
        schedules.append(sched)
    _, comp, disp, comb, group = worst
    ops = block_ops(comp, disp, comb, group, topology, model)
    parts = lancet.plan_partitions(ops, max_partitions, overhead=partition_overhead)
    meta = {"topology": topology.name, "model": model.to_dict(), "policy": policy, "grouping": grouping, "assign": assign,
            "seed": seed, "partition_overhead": partition_overhead}
    return Plan(topology.num_devices, model.num_experts, tuple(tuple(g) for g, _ in placed), tuple(placement),
                tuple(replicas), tuple(schedules), parts, tuple(o.name for o in ops), meta)


def compare(topology: Topology, model: ModelSpec, *, seed: int = 0) -> dict[str, float]:
    """Simulated iteration time of the planner's plan and of the seeds' baselines.

    Keys: "planner" (make_plan, select="best"); "lysi_group" (select="lysi"); groupings of Aristos Fig. 3 with LysiAssign and the
    Aurora order: "single_node", "world", "minimal"; Aurora 8 baselines on the
    planner's groups: "random_assign" (RGA), "random_order" (RCS), "sjf_order" (SJF).
    """
    plan = make_plan(topology, model)
    out = {"planner": simulate(plan, topology, model).iteration}
    lysi = make_plan(topology, model, select="lysi")
    out["lysi_group"] = simulate(lysi, topology, model).iteration
    for kind in ("single_node", "world", "minimal"):
        groups = baseline_groups(topology, model.num_experts, kind)
        out[kind] = simulate(make_plan(topology, model, groups=groups), topology, model).iteration
    if model.num_replicas is None:
        rga = make_plan(topology, model, groups=plan.groups, assign="random", seed=seed)
        out["random_assign"] = simulate(rga, topology, model).iteration
    out["random_order"] = simulate(plan, topology, model, order="random", seed=seed).iteration
    out["sjf_order"] = simulate(plan, topology, model, order="sjf").iteration
    return out
