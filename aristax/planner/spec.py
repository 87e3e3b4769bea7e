"""The planner's value types: :class:`ModelSpec`, what it plans for, and
:class:`Plan`, everything it decides, as one JSON-serialisable value.

Index conventions: ``groups[g]`` lists global device ids (``make_plan``: sorted, or in
the order that repeats the first group's placement); ``placement[g][e]``
global devices holding logical expert e; ``replicas[g][w]`` the logical experts in the
slots of the w-th device of ``groups[g]`` (flattened in group order: the
physical -> logical map); schedule sends use *local* indices into ``groups[g]``.

Imports only the planner's algorithm modules (aurora, lancet, lysi), so that
:mod:`~aristax.planner.costs`, :mod:`~aristax.planner.simulate` and
:mod:`~aristax.planner.plan` (which builds plans) can all import it.
"""

from __future__ import annotations

import dataclasses
import json
from typing import Any

import numpy as np

from aristax.planner import aurora, lancet
from aristax.planner.lysi import Workload


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
        if not isinstance(self.router_partitionable, (bool, np.bool_)):
            raise ValueError(f"router_partitionable must be True or False, got "
                             f"{self.router_partitionable!r}.")
        if self.expert_load is not None and np.ndim(self.expert_load) != 1:
            raise ValueError(f"expert_load must be a sequence of {self.num_experts} "
                             f"(num_experts) shares, got {self.expert_load!r}; pass None for "
                             "uniform routing.")
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


def check_groups(groups, num_devices: int) -> None:
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
    check_groups(p.groups, v)
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
        for k, r in enumerate(sched.rounds):
            for i, j, amount in r.sends:
                if not (0 <= i < len(group) and 0 <= j < len(group)):
                    raise ValueError(f"schedules[{g}] sends {i}->{j}; use local indices < {len(group)}.")
                if not amount >= 0:
                    raise ValueError(f"schedules[{g}] round {k} sends {amount} from {i} to {j}; "
                                     "amounts are non-negative.")
            senders, receivers = [i for i, _, _ in r.sends], [j for _, j, _ in r.sends]
            if len(set(senders)) != len(senders) or len(set(receivers)) != len(receivers):
                raise ValueError(f"schedules[{g}] round {k} has a device sending or receiving twice; "
                                 "each round must be a partial permutation (contention-free).")
    if p.op_names and len(p.partitions.counts()) != len(p.op_names):
        raise ValueError(f"partitions cover {len(p.partitions.counts())} ops but op_names has {len(p.op_names)}.")
