"""The Plan: everything the planner decides, as one JSON-serialisable value.

``make_plan(topology, model)`` runs, deterministically:

1. groups: :func:`~aristax.planner.lysi.lysi_group` (Aristos Alg. 1) on the
   :class:`ModelSpec`'s :class:`~aristax.planner.lysi.Workload`, or given ``groups``
   (see :func:`baseline_groups` for the Aristos Fig. 3 heuristics). With
   ``select="best"`` (default) LysiGroup's grouping is checked against the Fig. 3
   heuristics (single node, world, minimal) under :func:`~aristax.planner.simulate.
   simulate` and the fastest is kept (ties: LysiGroup). Why: eq. 4's compute term
   pi(g) = sum f / sum F assumes balanced experts; with skewed ``expert_load`` the
   hottest expert bounds compute and its rows grow with |g|, so LysiGroup can pick
   groups that are too large (e.g. Perlmutter 4x4, 128 Zipf-loaded experts: one
   16-GPU group, 3.6x slower than single-node groups). ``select="lysi"`` keeps
   LysiGroup's answer unconditionally;
2. placement per group: :func:`~aristax.planner.lysi.lysi_assign` (Aristos Alg. 2)
   with expert costs p_e |g| T K f (p = routing share of each expert), or, when
   ``model.num_replicas`` is set, :func:`~aristax.planner.replication.replicate_experts`
   with that many physical slots per group (equal slots per device); ``assign="random"``
   is Aurora section 8's random GPU assignment baseline;
3. the all-to-all transmission order per group: :func:`~aristax.planner.aurora.
   schedule_all_to_all` (Aurora Thm 4.2) on the expected dispatch *time* matrix
   (:func:`dispatch_times`), so round amounts are seconds of link time;
4. operator partitions: :func:`~aristax.planner.lancet.plan_partitions` (Lancet 5.1)
   over the forward of one MoE block (:func:`block_ops`) of the slowest group.

Index conventions: ``groups[g]`` lists global device ids (sorted); ``placement[g][e]``
global devices holding logical expert e; ``replicas[g][w]`` the logical experts in the
slots of the w-th device of ``groups[g]`` (flattened in group order: the
physical -> logical map); schedule sends use *local* indices into ``groups[g]``.
"""

from __future__ import annotations

import dataclasses
import json
import math
from typing import Any, Sequence

import numpy as np

from aristax.planner import aurora, lancet
from aristax.planner.lysi import POLICIES, Workload, lysi_assign, lysi_group
from aristax.planner.replication import replicate_experts
from aristax.planner.topology import Topology

ATTENTION_FLOPS_PER_TOKEN = 8.0  # x D^2: Q, K, V, O projections, 2 FLOPs per MAC


# ------------------------------------------------------------------ model spec
@dataclasses.dataclass(frozen=True)
class ModelSpec:
    """The MoE model and batch the planner plans for (letters of design.md).

    num_experts E, top_k K, d_model D, d_ff F, tokens_per_device T (one micro-batch),
    bytes_per_element (all-to-all activations), expert_load: optional [E] relative
    routing shares (normalised to sum 1; None = uniform), num_replicas: optional
    physical expert slots per group (replication of hot experts), plus the eq. 1
    fields of :class:`~aristax.planner.lysi.Workload` (num_layers, moe_every,
    param_bytes, training) and ``router_partitionable`` (Lancet 5.1: False when the
    gate's capacity is batch-global and the gate must not be split).
    """

    num_experts: int
    top_k: int = 1
    d_model: int = 1024
    d_ff: int = 4096
    tokens_per_device: int = 4096
    bytes_per_element: int = 2
    expert_load: tuple[float, ...] | None = None
    num_replicas: int | None = None
    num_layers: int = 24
    moe_every: int = 2
    param_bytes: int = 2
    training: bool = True
    router_partitionable: bool = True

    def __post_init__(self) -> None:
        if self.expert_load is not None:
            load = tuple(float(x) for x in self.expert_load)
            if len(load) != self.num_experts or not all(np.isfinite(load)) or min(load) < 0 or sum(load) <= 0:
                raise ValueError(
                    f"expert_load must hold {self.num_experts} (num_experts) finite non-negative shares "
                    f"with a positive sum, got {len(load)} values; pass None for uniform routing."
                )
            object.__setattr__(self, "expert_load", load)
        if self.num_replicas is not None and not isinstance(self.num_replicas, (int, np.integer)):
            raise ValueError(f"num_replicas={self.num_replicas!r} must be an integer (expert "
                             "slots per group) or None.")
        if self.num_replicas is not None and self.num_replicas < self.num_experts:
            raise ValueError(f"num_replicas={self.num_replicas} must be >= num_experts={self.num_experts} "
                             "(every expert needs a slot) or None.")
        try:
            self.workload()  # validates the shared fields
        except ValueError as e:  # the user built a ModelSpec, not a Workload
            raise ValueError(str(e).replace("Workload.", "ModelSpec.")) from None
        if self.top_k > self.num_experts:
            raise ValueError(f"top_k={self.top_k} must be between 1 and num_experts={self.num_experts} "
                             "(each token picks top_k distinct experts); lower top_k or add experts.")

    def workload(self) -> Workload:
        """The Aristos eq. 1-4 view of this model (SwiGLU expert: f = 6 D F per token)."""
        return Workload(num_experts=self.num_experts, tokens_per_device=self.tokens_per_device,
                        d_model=self.d_model, d_ff=self.d_ff, top_k=self.top_k,
                        bytes_per_element=self.bytes_per_element, param_bytes=self.param_bytes,
                        num_layers=self.num_layers, moe_every=self.moe_every, training=self.training)

    def shares(self) -> np.ndarray:
        """p[E]: fraction of the T K token-expert assignments that go to each expert."""
        if self.expert_load is None:
            return np.full(self.num_experts, 1.0 / self.num_experts)
        p = np.asarray(self.expert_load, dtype=np.float64)
        return p / p.sum()

    def to_dict(self) -> dict[str, Any]:
        d = dataclasses.asdict(self)
        if d["expert_load"] is not None:
            d["expert_load"] = list(d["expert_load"])
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "ModelSpec":
        d = dict(d)
        if d.get("expert_load") is not None:
            d["expert_load"] = tuple(d["expert_load"])
        return cls(**d)


# ------------------------------------------------------------------------ plan
@dataclasses.dataclass(frozen=True)
class Plan:
    """Groups, placement, replicas, all-to-all schedules and partition counts.

    - groups[G][|g|]: global device ids per expert-parallel group (a partition of
      range(num_devices)).
    - placement[G][E]: global device ids holding each logical expert, per group.
    - replicas[G][|g|]: logical experts in each device's slots (physical -> logical).
    - schedules[G]: :class:`~aristax.planner.aurora.Schedule` of the dispatch
      all-to-all, local indices, amounts in seconds of link time (combine = reverse).
    - partitions: :class:`~aristax.planner.lancet.PartitionPlan` over ``op_names``.
    - meta: inputs' summary (topology name, model spec, policy, ...), JSON values.
    """

    num_devices: int
    num_experts: int
    groups: tuple[tuple[int, ...], ...]
    placement: tuple[tuple[tuple[int, ...], ...], ...]
    replicas: tuple[tuple[tuple[int, ...], ...], ...]
    schedules: tuple[aurora.Schedule, ...]
    partitions: lancet.PartitionPlan
    op_names: tuple[str, ...] = ()
    meta: dict = dataclasses.field(default_factory=dict)

    def __post_init__(self) -> None:
        _validate(self)

    @property
    def partition_counts(self) -> tuple[int, ...]:
        return self.partitions.counts(len(self.op_names))

    def experts_on(self, g: int) -> dict[int, tuple[int, ...]]:
        """Global device id -> logical experts in its slots, for group g."""
        return dict(zip(self.groups[g], self.replicas[g]))

    def to_dict(self) -> dict[str, Any]:
        return {
            "num_devices": self.num_devices,
            "num_experts": self.num_experts,
            "groups": [list(g) for g in self.groups],
            "placement": [[list(d) for d in pg] for pg in self.placement],
            "replicas": [[list(s) for s in rg] for rg in self.replicas],
            "schedules": [s.to_dict() for s in self.schedules],
            "partitions": self.partitions.to_dict(),
            "op_names": list(self.op_names),
            "meta": self.meta,
        }

    def to_json(self, indent: int | None = None) -> str:
        return json.dumps(self.to_dict(), indent=indent)

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Plan":
        missing = {f.name for f in dataclasses.fields(cls)} - {"op_names", "meta"} - set(d)
        if missing:
            raise ValueError(f"plan is missing {sorted(missing)}; write it with Plan.to_json().")
        t3 = lambda xss: tuple(tuple(tuple(int(v) for v in xs) for xs in row) for row in xss)  # noqa: E731
        return cls(
            num_devices=int(d["num_devices"]),
            num_experts=int(d["num_experts"]),
            groups=tuple(tuple(int(v) for v in g) for g in d["groups"]),
            placement=t3(d["placement"]),
            replicas=t3(d["replicas"]),
            schedules=tuple(aurora.Schedule.from_dict(s) for s in d["schedules"]),
            partitions=lancet.PartitionPlan.from_dict(d["partitions"]),
            op_names=tuple(d.get("op_names", ())),
            meta=dict(d.get("meta", {})),
        )

    @classmethod
    def from_json(cls, text: str) -> "Plan":
        return cls.from_dict(json.loads(text))


def _check_groups(groups, num_devices: int) -> None:
    """groups must be non-empty lists of device ids that partition range(num_devices)."""
    if not groups or any(len(g) == 0 for g in groups):
        raise ValueError("groups must be non-empty lists of device ids.")
    flat = [int(d) for g in groups for d in g]
    bad = [d for d in flat if not 0 <= d < num_devices]
    if bad:
        raise ValueError(f"groups name device ids {bad[:5]} outside range(num_devices={num_devices}).")
    if sorted(flat) != list(range(num_devices)):
        raise ValueError(f"groups must partition range({num_devices}): every device in exactly one group.")


def _validate(p: Plan) -> None:
    v, e = p.num_devices, p.num_experts
    if v < 1 or e < 1:
        raise ValueError(f"num_devices ({v}) and num_experts ({e}) must be >= 1.")
    _check_groups(p.groups, v)
    n_g = len(p.groups)
    for name in ("placement", "replicas", "schedules"):
        if len(getattr(p, name)) != n_g:
            raise ValueError(f"{name} needs one entry per group ({n_g}), got {len(getattr(p, name))}.")
    for g, (group, place, reps, sched) in enumerate(zip(p.groups, p.placement, p.replicas, p.schedules)):
        if len(place) != e:
            raise ValueError(f"placement[{g}] must list devices for all {e} experts, got {len(place)}.")
        members = set(group)
        for x, devs in enumerate(place):
            if not devs:
                raise ValueError(f"expert {x} is not placed in group {g}; every group must hold every expert.")
            if not set(devs) <= members:
                raise ValueError(f"placement[{g}][{x}] = {devs} names devices outside group {g} {group}.")
        if len(reps) != len(group):
            raise ValueError(f"replicas[{g}] needs one slot list per device of group {g} ({len(group)}).")
        from_reps = sorted((x, d) for d, xs in zip(group, reps) for x in set(xs))
        from_place = sorted((x, d) for x, devs in enumerate(place) for d in set(devs))
        if from_reps != from_place:
            raise ValueError(f"replicas[{g}] and placement[{g}] disagree on which device holds which expert.")
        for r in sched.rounds:
            for i, j, _ in r.sends:
                if not (0 <= i < len(group) and 0 <= j < len(group)):
                    raise ValueError(f"schedules[{g}] sends {i}->{j}; use local indices < {len(group)}.")
    if p.op_names and len(p.partitions.counts()) != len(p.op_names):
        raise ValueError(f"partitions cover {len(p.partitions.counts())} ops but op_names has {len(p.op_names)}.")


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
        node = topology.node if topology.node is not None else np.zeros(v, dtype=np.int64)
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


def dispatch_bytes(slots: Sequence[Sequence[int]], model: ModelSpec) -> np.ndarray:
    """[n, n] expected bytes device i sends device j in one dispatch all-to-all.

    d_ij = T K D bytes * sum_e p_e r_ej / c_e, where r_ej = slots of expert e on j and
    c_e = its slots in the group (tokens split evenly over replicas). Diagonal = local.
    """
    n = len(slots)
    p = model.shares()
    count = np.zeros(model.num_experts)
    on = np.zeros((model.num_experts, n))
    for j, xs in enumerate(slots):
        for x in xs:
            on[x, j] += 1
            count[x] += 1
    if np.any(count == 0):
        raise ValueError("slots must hold every expert at least once.")
    recv_share = (p[:, None] * on / count[:, None]).sum(0)  # [n]
    per_dev = float(model.tokens_per_device * model.top_k * model.d_model * model.bytes_per_element)
    return np.tile(per_dev * recv_share, (n, 1))


def link_times(nbytes: np.ndarray, group: Sequence[int], topology: Topology) -> np.ndarray:
    """[n, n] t_ij = alpha_ij + nbytes_ij beta_ij for nbytes_ij > 0 (0 otherwise, and on
    the diagonal): the alpha-beta time of each message (Aristos Table 1)."""
    g = list(group)
    a, b = topology.alpha[np.ix_(g, g)], topology.beta[np.ix_(g, g)]
    t = np.where(nbytes > 0, a + nbytes * b, 0.0)
    np.fill_diagonal(t, 0.0)
    return t


def dispatch_times(slots, group, topology: Topology, model: ModelSpec) -> np.ndarray:
    """[n, n] seconds per message of the dispatch all-to-all of ``group``."""
    return link_times(dispatch_bytes(slots, model), group, topology)


def expert_compute(slots, group, topology: Topology, model: ModelSpec) -> np.ndarray:
    """[n] seconds of expert GEMMs per device: sum_{e on w} |g| T K p_e / c_e * f / F_w."""
    p = model.shares()
    count = np.zeros(model.num_experts)
    for xs in slots:
        for x in xs:
            count[x] += 1
    rows = len(group) * model.tokens_per_device * model.top_k
    f = model.workload().token_flops
    work = np.array([sum(rows * p[x] / count[x] for x in xs) * f for xs in slots])
    return work / topology.flops[list(group)]


def block_ops(compute: np.ndarray, dispatch: float, combine: float, group, topology: Topology,
              model: ModelSpec) -> list[lancet.Op]:
    """Forward of one MoE block for Lancet 5.1: attention projections (8 D^2 per token),
    gate (2 D E per token), dispatch, experts, combine; compute on the slowest device."""
    f_min = float(topology.flops[list(group)].min())
    t, d = model.tokens_per_device, model.d_model
    return [
        lancet.Op("attention", compute=t * ATTENTION_FLOPS_PER_TOKEN * d * d / f_min),
        lancet.Op("gate", compute=t * 2.0 * d * model.num_experts / f_min,
                  partitionable=model.router_partitionable),
        lancet.Op("dispatch", a2a=dispatch),
        lancet.Op("experts", compute=float(np.max(compute))),
        lancet.Op("combine", a2a=combine),
    ]


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
) -> Plan:
    """Plan expert parallelism for ``model`` on ``topology`` (see the module doc).

    ``groups`` overrides LysiGroup (e.g. :func:`baseline_groups`); ``assign`` is "lysi"
    (LysiAssign / replication) or "random" (Aurora 8 baseline, seeded by ``seed``);
    ``partition_overhead`` seconds per partitioned piece (Lancet 5.1's partition
    overhead: kernel launch plus split/concat), ``max_partitions`` = K.
    ``select``: "best" or "lysi" (module doc, step 1; ignored when ``groups`` is given);
    meta["grouping"] names the grouping kept and meta["candidates"] the simulated
    iteration times of all candidates.
    Deterministic: equal inputs give equal plans (and equal JSON).
    """
    if assign not in ("lysi", "random"):
        raise ValueError(f"assign must be 'lysi' or 'random', got {assign!r}.")
    if select not in ("best", "lysi"):
        raise ValueError(f"select must be 'best' or 'lysi', got {select!r}.")
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    if groups is not None:
        _check_groups(groups, topology.num_devices)
    kwargs = dict(policy=policy, assign=assign, seed=seed, max_partitions=max_partitions,
                  partition_overhead=partition_overhead)
    if groups is not None:
        return _make_plan(topology, model, groups, grouping="given", **kwargs)
    lysi_groups = lysi_group(topology, model.workload(), policy=policy)
    if select == "lysi":
        return _make_plan(topology, model, lysi_groups, grouping="lysi", **kwargs)
    from aristax.planner.simulate import simulate

    # LysiGroup does not see num_replicas, so its groups may not hold the replicas
    # (ValueError); then the best grouping that does is kept, and only when none
    # does is LysiGroup's error raised.
    best, best_t, times, lysi_error = None, math.inf, {}, None
    for kind in ("lysi", "single_node", "world", "minimal"):
        cand_groups = (lysi_groups if kind == "lysi"
                       else baseline_groups(topology, model.num_experts, kind))
        if kind != "lysi" and "lysi" in times and (
                sorted(map(sorted, cand_groups)) == sorted(map(sorted, lysi_groups))):
            times[kind] = times["lysi"]
            continue
        try:
            cand = _make_plan(topology, model, cand_groups, grouping=kind, **kwargs)
        except ValueError as error:  # e.g. num_replicas not a multiple of the group sizes
            lysi_error = error if kind == "lysi" else lysi_error
            continue
        times[kind] = simulate(cand, topology, model).iteration
        if best is None or times[kind] < best_t:
            best, best_t = cand, times[kind]
    if best is None:
        raise lysi_error
    meta = dict(best.meta, candidates=times)
    return dataclasses.replace(best, meta=meta)


def _make_plan(topology: Topology, model: ModelSpec, groups, *, grouping: str, policy: str, assign: str,
               seed: int, max_partitions: int, partition_overhead: float) -> Plan:
    """make_plan steps 2-4 for fixed ``groups``."""
    if assign == "random" and model.num_replicas is not None:
        raise ValueError("assign='random' places each expert once; pass num_replicas=None for it.")
    wl = model.workload()
    groups = [sorted(int(d) for d in g) for g in groups]
    rng = np.random.default_rng(seed)
    p = model.shares()
    placement, replicas, schedules, worst = [], [], [], None
    for group in groups:
        if topology.expert_capacity[group].sum() < model.num_experts:
            raise ValueError(f"group {group} holds {int(topology.expert_capacity[group].sum())} experts, "
                             f"fewer than num_experts={model.num_experts}; merge it with another group.")
        costs = p * len(group) * model.tokens_per_device * model.top_k * wl.token_flops
        if assign == "random":
            slots = _slots_random(group, topology, model.num_experts, rng)
        elif model.num_replicas is not None:
            slots = _slots_replicated(group, topology, costs, model.num_replicas)
        else:
            slots = _slots_lysi(group, topology, costs)
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
    return Plan(topology.num_devices, model.num_experts, tuple(tuple(g) for g in groups), tuple(placement),
                tuple(replicas), tuple(schedules), parts, tuple(o.name for o in ops), meta)
