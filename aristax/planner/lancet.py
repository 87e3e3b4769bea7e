"""Lancet (Jiang et al., MLSys 2024): overlap all-to-alls with the rest of the graph.

Implemented: :func:`schedule_weight_gradients`, the weight-gradient schedule pass
(section 4, Alg. 1), and :func:`plan_partitions`, the operator-partition pass's range
selection (section 5.1, the T(n) dynamic program) with the pipeline simulation of
section 5.3 (:func:`pipeline_time`) as its cost P(i, n, k).

Op model picked for the partition pass (section 5 works on a forward instruction
sequence; we keep only what the DP needs): an :class:`Op` is one instruction of a
linear chain (each op consumes the previous op's output) that runs ``compute``
seconds of computation and then ``a2a`` seconds of all-to-all (either may be 0).
``partitionable=False`` marks ops the partition axis inferrer of section 5.2 cannot
split (e.g. a gate whose capacity is batch-global, Lancet 5.1): every range that
contains one gets P(i, n, k) = inf for k >= 2, so such an op always runs whole.
Splitting a range into k parts splits every piece evenly (time / k) and adds
``overhead`` seconds to every piece (kernel launch, partition and reconstruction
instructions of Fig. 8a); k = 1 costs exactly the serial sum, with no overhead.
"""

from __future__ import annotations

import dataclasses
import numbers
from typing import Sequence

import networkx as nx


@dataclasses.dataclass(frozen=True)
class Instr:
    """One IR instruction: ``kind`` is "a2a", "wgrad" or anything else; ``time`` its
    execution time; ``deps`` the names of instructions whose outputs it consumes."""

    name: str
    kind: str
    time: float
    deps: tuple[str, ...] = ()

    def __post_init__(self) -> None:
        _check_time(f"Instr {self.name!r}: time", self.time)


def _check_time(what: str, value) -> None:
    if not (value >= 0.0) or value == float("inf"):
        raise ValueError(f"{what} must be a finite time >= 0 s, got {value!r}.")


@dataclasses.dataclass(frozen=True)
class WgradSchedule:
    """assignment: wgrad name -> the all-to-all it overlaps; order: the reordered names;
    overlapped: per all-to-all, min(t_a2a, sum of its wgrads) (the objective of 4.2)."""

    assignment: dict[str, str]
    order: tuple[str, ...]
    overlapped: dict[str, float]


def _graph(instructions: Sequence[Instr]) -> nx.DiGraph:
    g = nx.DiGraph()
    names = [i.name for i in instructions]
    if len(set(names)) != len(names):
        raise ValueError("instructions must have unique names.")
    g.add_nodes_from(names)
    for i in instructions:
        for d in i.deps:
            if d not in g:
                raise ValueError(f"instruction {i.name!r} depends on unknown {d!r}; list it first.")
            g.add_edge(d, i.name)
    if not nx.is_directed_acyclic_graph(g):
        raise ValueError("instructions have a dependency cycle.")
    return g


def schedule_weight_gradients(instructions: Sequence[Instr]) -> WgradSchedule:
    """Lancet Alg. 1: label, then best-fit greedy, then reorder.

    Labelling (4.1): a wgrad may overlap an all-to-all iff no directed path joins them
    either way (networkx ancestors/descendants). Scheduling (4.2): all-to-alls in
    program order; each repeatedly takes the unused eligible wgrad minimising
    |t_u - t_w| (ties: program order) while its unoverlapped time t_u > 0. Reorder:
    a topological sort that places each assigned wgrad right after its all-to-all
    whenever its own dependencies allow (lexicographic topological sort keyed by
    position), so the result is always a valid order.
    """
    g = _graph(instructions)
    pos = {ins.name: k for k, ins in enumerate(instructions)}
    by_name = {ins.name: ins for ins in instructions}
    wgrads = [i.name for i in instructions if i.kind == "wgrad"]
    used: set[str] = set()
    assignment: dict[str, str] = {}
    overlapped: dict[str, float] = {}
    for a in (i for i in instructions if i.kind == "a2a"):
        related = nx.ancestors(g, a.name) | nx.descendants(g, a.name)
        eligible = [w for w in wgrads if w not in related]
        t_u = a.time
        while t_u > 0:
            free = [w for w in eligible if w not in used]
            if not free:
                break
            w = min(free, key=lambda w: (abs(t_u - by_name[w].time), pos[w]))
            t_u -= by_name[w].time
            used.add(w)
            assignment[w] = a.name
        overlapped[a.name] = min(a.time, sum(by_name[w].time for w, x in assignment.items() if x == a.name))
    key = {n: (pos[assignment[n]] + 0.5, pos[n]) if n in assignment else (pos[n], 0) for n in pos}
    order = tuple(nx.lexicographical_topological_sort(g, key=lambda n: key[n]))
    return WgradSchedule(assignment, order, overlapped)


# ------------------------------------------------------------ partition pass (5)
@dataclasses.dataclass(frozen=True)
class Op:
    """One forward instruction for the partition pass: ``compute`` seconds of
    computation, then ``a2a`` seconds of all-to-all; ``partitionable`` = the partition
    axis inferrer (Lancet 5.2) can split it. Ops form a chain in list order."""

    name: str
    compute: float = 0.0
    a2a: float = 0.0
    partitionable: bool = True

    def __post_init__(self) -> None:
        for field in ("compute", "a2a"):
            _check_time(f"Op {self.name!r}: {field}", getattr(self, field))


@dataclasses.dataclass(frozen=True)
class PartitionPlan:
    """Result of :func:`plan_partitions`.

    ranges: ((start, stop, k), ...) half-open op ranges covering all ops in order, each
    run in k parts; time: T(N), the pipelined end-to-end time; serial_time: sum of all
    compute and a2a (the unpartitioned time, T(N) with K = 1).
    """

    ranges: tuple[tuple[int, int, int], ...]
    time: float
    serial_time: float

    def counts(self, num_ops: int | None = None) -> tuple[int, ...]:
        """Partition count per op ([N]); 1 for ops run whole."""
        out = [k for start, stop, k in self.ranges for _ in range(start, stop)]
        if num_ops is not None and len(out) != num_ops:
            raise ValueError(f"num_ops={num_ops} does not match the {len(out)} ops of this plan.")
        return tuple(out)

    def to_dict(self) -> dict:
        return {"ranges": [list(r) for r in self.ranges], "time": self.time, "serial_time": self.serial_time}

    @classmethod
    def from_dict(cls, d: dict) -> "PartitionPlan":
        return cls(tuple(tuple(int(x) for x in r) for r in d["ranges"]), float(d["time"]), float(d["serial_time"]))


def _stages(ops: Sequence[Op]) -> list[tuple[str, float]]:
    """Lancet 5.3 stages of one partition: maximal runs of consecutive pieces of one
    type ("compute" or "a2a"), as (type, total unpartitioned time); zero pieces dropped."""
    stages: list[tuple[str, float]] = []
    for op in ops:
        for kind, t in (("compute", op.compute), ("a2a", op.a2a)):
            if t <= 0.0:
                continue
            if stages and stages[-1][0] == kind:
                stages[-1] = (kind, stages[-1][1] + t)
            else:
                stages.append((kind, t))
    return stages


def pipeline_time(ops: Sequence[Op], k: int, *, overhead: float = 0.0) -> float:
    """P(i, n, k) of Lancet 5.1: end-to-end time of ``ops`` split into k parts (5.3).

    Each of the k partitions runs the stages of :func:`_stages`; a piece of a stage
    takes stage_time / k + overhead (k >= 2; k = 1 is the serial sum, no overhead).
    Schedule (Fig. 9): per resource (compute stream, communication stream), pieces in
    (stage, partition) order. Start of a piece = max(end of the same partition's
    previous stage, end of the previous piece on the same resource); P = last end.
    Returns inf if k >= 2 and some op is not partitionable.
    """
    if k < 1:
        raise ValueError(f"k must be >= 1 partitions, got {k}.")
    stages = _stages(ops)
    if k == 1:
        return float(sum(t for _, t in stages))
    if any(not op.partitionable for op in ops):
        return float("inf")
    free = {"compute": 0.0, "a2a": 0.0}
    done = [0.0] * k  # end of each partition's previous stage
    for kind, t in stages:
        piece = t / k + overhead
        for p in range(k):
            start = max(done[p], free[kind])
            done[p] = free[kind] = start + piece
    return float(max(done)) if stages else 0.0


def plan_partitions(ops: Sequence[Op], max_partitions: int = 8, *, overhead: float = 0.0,
                    max_range: int | None = None) -> PartitionPlan:
    """Lancet 5.1 partition range selection: T(n) = min_{i<n} T(i) + min_k P(i, n, k).

    ops[N] (:class:`Op`), K = ``max_partitions``, ranges of at most ``max_range`` ops
    (None: no limit). Half-open indexing: T(0) = 0 and P(i, n, k) covers ops i..n-1,
    so the paper's O(N^2 K) evaluations of :func:`pipeline_time`. Ties prefer the
    earlier split point, then fewer partitions (deterministic). Returns the ranges of
    the optimum T(N) (backtracked) in op order.
    """
    ops = list(ops)
    if not isinstance(max_partitions, numbers.Integral) or max_partitions < 1:
        raise ValueError(f"max_partitions must be an integer >= 1, got {max_partitions!r}.")
    if max_range is not None and (not isinstance(max_range, numbers.Integral) or max_range < 1):
        raise ValueError(f"max_range must be an integer >= 1 (ops) or None, got {max_range!r}.")
    _check_time("overhead", overhead)
    n_ops = len(ops)
    best = [0.0] + [float("inf")] * n_ops
    choice: list[tuple[int, int]] = [(0, 1)] * (n_ops + 1)
    for n in range(1, n_ops + 1):
        lo = 0 if max_range is None else max(0, n - max_range)
        for i in range(lo, n):
            for k in range(1, max_partitions + 1):
                t = best[i] + pipeline_time(ops[i:n], k, overhead=overhead)
                if t < best[n]:
                    best[n], choice[n] = t, (i, k)
    ranges = []
    n = n_ops
    while n > 0:
        i, k = choice[n]
        ranges.append((i, n, k))
        n = i
    serial = float(sum(op.compute + op.a2a for op in ops))
    return PartitionPlan(tuple(reversed(ranges)), float(best[n_ops]), serial)
