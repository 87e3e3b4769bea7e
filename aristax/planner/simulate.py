"""Iteration-time model of a :class:`~aristax.planner.spec.Plan` (the same equations).

One MoE layer execution in group g (Aristos eq. 4, with the plan's actual placement
and transmission order instead of eq. 4's idealised terms):

    layer_g = compute_g + dispatch_g + combine_g
    compute_g  = max_w (expert FLOPs on w) / F_w          (costs.expert_compute; eq. 4's
                 pi(g) = sum f / sum F when the placement is perfectly balanced)
    dispatch_g = makespan of the dispatch all-to-all of the time matrix
                 t_ij = alpha_ij + d_ij beta_ij  (costs.dispatch_times)
    combine_g  = the same for the transpose (tokens travel back)

    iteration = gamma(W) * max_g layer_g + T_rho(|G|)      (eq. 1, eq. 4 Rabenseifner)

Contention model (Aurora section 4): one-port, every GPU sends to at most one peer and
receives from at most one at a time; a message i -> j holds both ports for t_ij. A
message split over several rounds pays its alpha once (its chunks stream back to back),
so the Birkhoff-von Neumann order's makespan is the port-load bound max(row, column
sums of t) (Aurora Thm 4.2) and no order can beat it in this model. Orders:

- "plan": the plan's stored rounds (the traffic must be what the plan expected);
- "aurora": Aurora's optimal order recomputed for this workload (= its lower bound);
- "random" (Aurora 8's RCS) and "sjf" (shortest job first): greedy non-preemptive
  list scheduling, each message whole, started as soon as both of its ports are free,
  scanning messages in the order's priority (:func:`list_schedule`).

Under uniform routing, balanced placement and a symmetric topology the layer time
equals Aristos eq. 4's gamma-free term: eta = 2 all-to-alls of max_i sum_j
(alpha_ij + d/|g| beta_ij) each (tested), so LysiGroup's objective and this model agree.
"""

from __future__ import annotations

import dataclasses

import numpy as np

from aristax.planner import aurora
from aristax.planner.costs import dispatch_times, expert_compute
from aristax.planner.lysi import allreduce_time
from aristax.planner.spec import ModelSpec, Plan
from aristax.planner.topology import Topology

ORDERS = ("plan", "aurora", "random", "sjf")


@dataclasses.dataclass(frozen=True)
class SimResult:
    """Simulated times in seconds. Per group [G]: compute, dispatch, combine, layer;
    allreduce = T_rho(|G|) (largest over groups); gamma = eq. 1's layer executions per
    iteration; iteration = gamma * max(layer) + allreduce."""

    compute: tuple[float, ...]
    dispatch: tuple[float, ...]
    combine: tuple[float, ...]
    layer: tuple[float, ...]
    allreduce: float
    gamma: float
    iteration: float

    def to_dict(self) -> dict:
        return dataclasses.asdict(self)


def list_schedule(times: np.ndarray, priority: list[tuple[int, int]]) -> float:
    """Makespan of greedy one-port list scheduling.

    times[n, n]: seconds of each message (0 = none); priority: the (src, dst) pairs in
    priority order. At each event time, scan pending messages in priority order and
    start every one whose sender and receiver are both idle; advance to the next
    completion. Non-preemptive; never below :func:`aurora.lower_bound` of ``times``.
    """
    n = times.shape[0]
    pending = [(i, j) for i, j in priority if i != j and times[i, j] > 0]
    send_free = np.zeros(n)
    recv_free = np.zeros(n)
    now, end = 0.0, 0.0
    while pending:
        rest = []
        for i, j in pending:
            if send_free[i] <= now and recv_free[j] <= now:
                send_free[i] = recv_free[j] = now + times[i, j]
                end = max(end, now + times[i, j])
            else:
                rest.append((i, j))
        pending = rest
        if pending:
            busy = np.concatenate([send_free[send_free > now], recv_free[recv_free > now]])
            now = float(busy.min())
    return float(end)


def order_time(times: np.ndarray, order: str, rng: np.random.Generator) -> float:
    """All-to-all makespan of ``times`` under a transmission ``order`` (not "plan").
    "aurora": its lower bound, which the order ``aurora.schedule_all_to_all`` builds
    reaches (Thm 4.2; ``times`` are seconds, so one bandwidth), without building it:
    O(n^2) instead of up to n^2 matchings."""
    if order == "aurora":
        return aurora.lower_bound(times)
    pairs = [(int(i), int(j)) for i, j in zip(*np.nonzero(times))]
    if order == "sjf":
        pairs.sort(key=lambda ij: (times[ij], ij))
    elif order == "random":
        pairs = [pairs[k] for k in rng.permutation(len(pairs))]
    else:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}.")
    return list_schedule(times, pairs)


def simulate(plan: Plan, topology: Topology, model: ModelSpec, *, order: str = "plan",
             seed: int = 0) -> SimResult:
    """Iteration time of ``plan`` for ``model`` on ``topology`` (see the module doc).

    ``model`` may differ from the one planned for (e.g. other expert loads); then use
    order="aurora" (recomputed) or a baseline order, since the stored rounds only
    carry the expected traffic. ``seed`` drives order="random".
    """
    if order not in ORDERS:
        raise ValueError(f"order must be one of {ORDERS}, got {order!r}.")
    if plan.num_devices != topology.num_devices or plan.num_experts != model.num_experts:
        raise ValueError(f"plan is for {plan.num_devices} devices / {plan.num_experts} experts, but topology "
                         f"has {topology.num_devices} and model {model.num_experts}; re-plan for these inputs.")
    rng = np.random.default_rng(seed)
    comp, disp, comb = [], [], []
    for g, group in enumerate(plan.groups):
        slots = plan.replicas[g]
        t = dispatch_times(slots, group, topology, model)
        comp.append(float(expert_compute(slots, group, topology, model).max()))
        if order == "plan":
            stored = plan.schedules[g]
            if not np.allclose(stored.delivered(len(group)), t, rtol=1e-9, atol=1e-15):
                raise ValueError(f"plan.schedules[{g}] does not carry this model's traffic; "
                                 "simulate with order='aurora' or re-plan for this model.")
            disp.append(stored.makespan)
            comb.append(order_time(t.T, "aurora", rng))
        else:
            disp.append(order_time(t, order, rng))
            comb.append(order_time(t.T, order, rng))
    layer = [c + d + b for c, d, b in zip(comp, disp, comb)]
    ar, gamma, iteration = iteration_time(layer, plan.groups, topology, model)
    return SimResult(tuple(comp), tuple(disp), tuple(comb), tuple(layer), ar, gamma, iteration)


def group_layer_time(slots, group, topology: Topology, model: ModelSpec) -> float:
    """layer_g of a group whose devices hold ``slots`` (logical experts per device), its
    all-to-alls in Aurora's order: ``simulate(..., order="aurora")``'s term, without a
    plan."""
    t = dispatch_times(slots, group, topology, model)
    return (float(expert_compute(slots, group, topology, model).max())
            + aurora.lower_bound(t) + aurora.lower_bound(t.T))


def iteration_time(layers, groups, topology: Topology, model: ModelSpec
                   ) -> tuple[float, float, float]:
    """(allreduce, gamma, iteration) of ``groups`` whose layers take ``layers`` seconds
    (eq. 1 with eq. 4's Rabenseifner all-reduce)."""
    wl = model.workload()
    ar = max(allreduce_time(len(groups), len(g), topology, wl) for g in groups)
    gamma = wl.gamma(topology.num_devices)
    return float(ar), float(gamma), float(gamma * max(layers) + ar)

