"""Hot-expert replication and balanced packing of replicas onto GPUs.

Follows the published description of DeepSeek's EPLB (expert-parallel load
balancer): (hierarchical) pack expert groups onto nodes, replicate experts inside
each node by repeatedly giving one more replica to the expert with the largest
load per replica, then pack the replicas onto the node's GPUs; (global) replicate
over all slots and pack onto all GPUs. Packing is EPLB's balanced packing (heaviest
item first, into the lightest pack that still has room; every pack holds the same
number of items), followed here by a swap-improvement pass that only accepts swaps
lowering the heavier pack's load, so the result is never worse than plain packing.

Shapes: load[E] (tokens or time per logical expert); num_replicas physical slots,
num_replicas % num_gpus == 0; with hierarchy num_groups % num_nodes == 0,
E % num_groups == 0 and num_gpus % num_nodes == 0.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np


@dataclasses.dataclass(frozen=True)
class Replication:
    """phy_to_log[P]: logical expert in physical slot p (slot p is on GPU p // (P / G));
    log_to_phy[E]: slots of each expert; counts[E]: replicas per expert;
    gpu_load[G]: sum over a GPU's slots of load[e] / counts[e]."""

    phy_to_log: tuple[int, ...]
    log_to_phy: tuple[tuple[int, ...], ...]
    counts: tuple[int, ...]
    gpu_load: tuple[float, ...]

    @property
    def max_over_mean(self) -> float:
        g = np.asarray(self.gpu_load)
        return float(g.max() / g.mean()) if g.mean() > 0 else 1.0


def replicate_counts(load: np.ndarray, slots: int) -> np.ndarray:
    """Give ``slots`` replicas to experts, one at a time to max load / count (EPLB).

    Every expert gets at least one; the greedy minimises max_e load_e / count_e
    (each extra replica goes where it lowers the current maximum). Ties: lower id.
    """
    e = len(load)
    if slots < e:
        raise ValueError(f"num_replicas per node/cluster ({slots}) must be >= the experts there ({e}).")
    counts = np.ones(e, dtype=np.int64)
    heap = [(-float(load[i]), i) for i in range(e)]
    heapq.heapify(heap)
    for _ in range(slots - e):
        _, i = heapq.heappop(heap)
        counts[i] += 1
        heapq.heappush(heap, (-float(load[i]) / counts[i], i))
    return counts


def balanced_packing(weights: np.ndarray, num_packs: int, *, improve: bool = True) -> np.ndarray:
    """pack_of[N]: EPLB balanced packing, N / num_packs items per pack.

    Heaviest item first into the lightest non-full pack (ties: lower pack id); then,
    if ``improve``, swap an item of the heaviest pack with a lighter item elsewhere
    whenever both packs end strictly below the heaviest pack's old load.
    """
    n = len(weights)
    if num_packs < 1 or n % num_packs:
        raise ValueError(f"{n} items do not split evenly into num_packs={num_packs}; make it a divisor.")
    per = n // num_packs
    pack_of = np.empty(n, dtype=np.int64)
    loads = np.zeros(num_packs)
    sizes = np.zeros(num_packs, dtype=np.int64)
    for i in np.argsort(-np.asarray(weights, dtype=np.float64), kind="stable"):
        open_packs = np.flatnonzero(sizes < per)
        p = open_packs[np.argmin(loads[open_packs])]
        pack_of[i] = p
        loads[p] += weights[i]
        sizes[p] += 1
    if improve:
        _improve(np.asarray(weights, dtype=np.float64), pack_of, loads)
    return pack_of


def _improve(w: np.ndarray, pack_of: np.ndarray, loads: np.ndarray, max_iters: int = 10_000) -> None:
    for _ in range(max_iters):
        h = int(np.argmax(loads))
        best = None
        for x in np.flatnonzero(pack_of == h):
            for y in np.flatnonzero((pack_of != h) & (w < w[x])):
                p = pack_of[y]
                new_h, new_p = loads[h] - w[x] + w[y], loads[p] - w[y] + w[x]
                worst = max(new_h, new_p)
                if worst < loads[h] - 1e-12 * max(loads[h], 1.0) and (best is None or worst < best[0]):
                    best = (worst, x, y, p)
        if best is None:
            return
        _, x, y, p = best
        loads[h] += w[y] - w[x]
        loads[p] += w[x] - w[y]
        pack_of[x], pack_of[y] = p, h


def _pack_slots(experts: np.ndarray, load: np.ndarray, counts: np.ndarray, num_gpus: int,
                improve: bool) -> list[list[int]]:
    """Replicas of ``experts`` (with ``counts``) onto num_gpus GPUs: lists of experts per GPU."""
    items = np.repeat(experts, counts[experts])
    weights = load[items] / counts[items]
    pack_of = balanced_packing(weights, num_gpus, improve=improve)
    return [sorted(items[pack_of == g].tolist()) for g in range(num_gpus)]


def replicate_experts(load, num_replicas: int, num_gpus: int, *, num_nodes: int = 1, num_groups: int = 1,
                      improve: bool = True) -> Replication:
    """Replicate hot experts and place replicas on GPUs (EPLB-style, see module doc).

    Hierarchical when num_nodes > 1 and num_groups % num_nodes == 0 (groups -> nodes,
    replicas within nodes, replicas -> GPUs); global otherwise. ``improve=False`` is
    the plain EPLB packing.
    """
    load = np.asarray(load, dtype=np.float64)
    e = len(load)
    if load.ndim != 1 or e == 0 or np.any(~np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be a non-empty 1-D array of non-negative finite values, one per expert.")
    if num_gpus < 1 or num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}.")
    if num_replicas < e:
        raise ValueError(f"num_replicas={num_replicas} must be >= the number of experts ({e}).")
    per_gpu_lists: list[list[int]]
    counts = np.zeros(e, dtype=np.int64)
    if num_nodes > 1 and num_groups % num_nodes == 0:
        if e % num_groups or num_gpus % num_nodes or num_replicas % num_nodes:
            raise ValueError("hierarchical replication needs E % num_groups == 0, num_gpus % num_nodes == 0 "
                             "and num_replicas % num_nodes == 0; fix the sizes or pass num_nodes=1.")
        group_size = e // num_groups
        group_load = load.reshape(num_groups, group_size).sum(1)
        node_of_group = balanced_packing(group_load, num_nodes, improve=improve)
        per_gpu_lists = []
        for node in range(num_nodes):
            # a node's groups heaviest first (EPLB's rank in pack): the order in which
            # ties go to lower positions below
            here = np.flatnonzero(node_of_group == node)
            here = here[np.argsort(-group_load[here], kind="stable")]
            experts = np.concatenate([np.arange(g * group_size, (g + 1) * group_size)
                                      for g in here])
            c = replicate_counts(load[experts], num_replicas // num_nodes)
            counts[experts] = c
            per_gpu_lists += _pack_slots(experts, load, counts, num_gpus // num_nodes, improve)
    else:
        counts = replicate_counts(load, num_replicas)
        per_gpu_lists = _pack_slots(np.arange(e), load, counts, num_gpus, improve)
    phy = [x for lst in per_gpu_lists for x in lst]
    log_to_phy = [[] for _ in range(e)]
    for p, x in enumerate(phy):
        log_to_phy[x].append(p)
    gpu_load = [float(sum(load[x] / counts[x] for x in lst)) for lst in per_gpu_lists]
    return Replication(tuple(phy), tuple(tuple(v) for v in log_to_phy), tuple(counts.tolist()), tuple(gpu_load))
