"""Hot-expert replication and balanced packing of replicas onto GPUs.

Follows the published description of DeepSeek's EPLB (expert-parallel load
balancer): (hierarchical) pack expert groups onto nodes, replicate experts inside
each node by repeatedly giving one more replica to the expert with the largest load
per replica, then pack the replicas onto the node's GPUs; (global) the same with one
group and one node. Packing is EPLB's balanced packing (heaviest item first, into the
lightest pack that still has room; every pack holds the same number of items).

``improve=True`` adds, on top: a swap pass after each packing that only accepts
swaps lowering the heavier pack's load (so on the same replicas the GPU packing never
gets a higher maximum); in hierarchical mode, a second group -> node placement made
more even by that swap pass; with one node and num_groups dividing E, a second
expert order (groups heaviest first, EPLB's tie order there). A more even node split
can still raise the per-GPU maximum (issue 32), so every candidate goes through
replication and GPU packing and the one with the lowest maximum GPU load is kept
(ties: the more even node split, then plain EPLB's).

Guarantee: the maximum GPU load (hence max/mean) is never above plain EPLB's on the
same input, up to float rounding: ``improve=False`` (ties: equal weights in input
order, packs and experts by lower id), and, with one node, EPLB's hierarchical tie
order as well. It is not a guarantee of optimality (the problem is NP-hard).

Shapes: load[E] (tokens or time per logical expert); num_replicas physical slots,
num_replicas % num_gpus == 0; with hierarchy num_groups % num_nodes == 0,
E % num_groups == 0 and num_gpus % num_nodes == 0.
"""

from __future__ import annotations

import dataclasses
import heapq

import numpy as np

from aristax.planner.topology import check_int


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


def _node_experts(node_of_group: np.ndarray, group_load: np.ndarray, group_size: int, node: int) -> np.ndarray:
    """experts[E / nodes] of ``node``: its groups heaviest first (EPLB's rank in pack,
    which decides replication ties), each group's experts in id order."""
    here = np.flatnonzero(node_of_group == node)
    here = here[np.argsort(-group_load[here], kind="stable")]
    return (here[:, None] * group_size + np.arange(group_size)).ravel()


def _place(load: np.ndarray, node_of_group: np.ndarray, group_load: np.ndarray, num_replicas: int,
           num_gpus: int, improve: bool) -> tuple[np.ndarray, list[list[int]]]:
    """EPLB steps 2-3 for a group -> node placement node_of_group[num_groups] (every node
    holds a group): (counts[E], experts on each of the num_gpus GPUs, node by node)."""
    num_nodes = int(node_of_group.max()) + 1
    group_size = len(load) // len(group_load)
    counts = np.zeros(len(load), dtype=np.int64)
    per_gpu_lists: list[list[int]] = []
    for node in range(num_nodes):
        experts = _node_experts(node_of_group, group_load, group_size, node)
        counts[experts] = replicate_counts(load[experts], num_replicas // num_nodes)
        per_gpu_lists += _pack_slots(experts, load, counts, num_gpus // num_nodes, improve)
    return counts, per_gpu_lists


def _gpu_loads(load: np.ndarray, counts: np.ndarray, per_gpu_lists: list[list[int]]) -> list[float]:
    """gpu_load[G]: sum over each GPU's replicas of load[e] / counts[e]."""
    return [float(sum(load[x] / counts[x] for x in lst)) for lst in per_gpu_lists]


def _node_placements(group_load: np.ndarray, num_nodes: int, improve: bool) -> list[np.ndarray]:
    """Candidate node_of_group[num_groups]: EPLB's packing, then (if ``improve`` and it
    differs) the swap-improved one."""
    plain = balanced_packing(group_load, num_nodes, improve=False)
    if not improve:
        return [plain]
    better = balanced_packing(group_load, num_nodes, improve=True)
    return [plain] if np.array_equal(plain, better) else [plain, better]


def _layouts(load: np.ndarray, num_nodes: int, num_groups: int, hierarchical: bool,
             improve: bool) -> list[tuple[np.ndarray, np.ndarray]]:
    """Candidates (node_of_group[g], group_load[g]) for :func:`_place`, plain EPLB first.

    Hierarchical: EPLB's group -> node packing (+ the swap-improved one). Global: one
    group on one node (experts in id order); with ``improve``, one node and num_groups
    dividing E, also those groups on the one node, heaviest first (EPLB's tie order).
    """
    if hierarchical:
        group_load = load.reshape(num_groups, -1).sum(1)
        return [(p, group_load) for p in _node_placements(group_load, num_nodes, improve)]
    out = [(np.zeros(1, dtype=np.int64), load.sum(keepdims=True))]
    if improve and num_nodes == 1 and num_groups > 1 and len(load) % num_groups == 0:
        out.append((np.zeros(num_groups, dtype=np.int64), load.reshape(num_groups, -1).sum(1)))
    return out


def replicate_experts(load, num_replicas: int, num_gpus: int, *, num_nodes: int = 1, num_groups: int = 1,
                      improve: bool = True) -> Replication:
    """Replicate hot experts and place replicas on GPUs (EPLB-style, see module doc).

    Hierarchical when num_nodes > 1 and num_groups % num_nodes == 0 (groups -> nodes,
    replicas within nodes, replicas -> GPUs); global otherwise. ``improve=False`` is
    plain EPLB; ``improve=True`` never has a higher maximum GPU load (module doc).
    """
    check_int("replicate_experts", num_replicas=num_replicas, num_gpus=num_gpus,
              num_nodes=num_nodes, num_groups=num_groups)
    load = np.asarray(load, dtype=np.float64)
    e = len(load)
    if load.ndim != 1 or e == 0 or np.any(~np.isfinite(load)) or np.any(load < 0):
        raise ValueError("load must be a non-empty 1-D array of non-negative finite values, one per expert.")
    if num_gpus < 1 or num_replicas % num_gpus:
        raise ValueError(f"num_replicas={num_replicas} must be a multiple of num_gpus={num_gpus}.")
    if num_replicas < e:
        raise ValueError(f"num_replicas={num_replicas} must be >= the number of experts ({e}).")
    hierarchical = num_nodes > 1 and num_groups % num_nodes == 0
    if hierarchical and (e % num_groups or num_gpus % num_nodes or num_replicas % num_nodes):
        raise ValueError("hierarchical replication needs E % num_groups == 0, num_gpus % num_nodes == 0 "
                         "and num_replicas % num_nodes == 0; fix the sizes or pass num_nodes=1.")
    best = None
    for node_of_group, group_load in _layouts(load, num_nodes, num_groups, hierarchical, improve):
        counts, per_gpu_lists = _place(load, node_of_group, group_load, num_replicas, num_gpus, improve)
        gpu_load = _gpu_loads(load, counts, per_gpu_lists)
        key = (max(gpu_load), np.bincount(node_of_group, group_load).max())  # ties: evener nodes, then plain
        if best is None or key < best[0]:
            best = (key, counts, per_gpu_lists, gpu_load)
    _, counts, per_gpu_lists, gpu_load = best
    phy = [x for lst in per_gpu_lists for x in lst]
    log_to_phy = [[] for _ in range(e)]
    for p, x in enumerate(phy):
        log_to_phy[x].append(p)
    return Replication(tuple(phy), tuple(tuple(v) for v in log_to_phy), tuple(counts.tolist()), tuple(gpu_load))
