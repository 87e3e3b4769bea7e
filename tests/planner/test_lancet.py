"""Lancet Alg. 1 (weight-gradient scheduling) on small hand-checked graphs."""

import networkx as nx
import pytest

from aristax.planner.lancet import Instr, schedule_weight_gradients


def backward_graph():
    # two MoE layers' backward: a2a_2 <- expert grad <- a2a_1; weight grads hang off
    return [
        Instr("g_out", "other", 1.0),
        Instr("a2a_1", "a2a", 5.0, ("g_out",)),
        Instr("dx_exp", "other", 2.0, ("a2a_1",)),
        Instr("a2a_2", "a2a", 4.0, ("dx_exp",)),
        Instr("dw_attn", "wgrad", 3.0, ("g_out",)),
        Instr("dw_ffn", "wgrad", 2.0, ("g_out",)),
        Instr("dw_exp", "wgrad", 4.0, ("a2a_1",)),  # depends on a2a_1: may only overlap a2a_2
        Instr("dw_late", "wgrad", 1.0, ("a2a_2",)),
    ]


def test_labelling_and_greedy():
    s = schedule_weight_gradients(backward_graph())
    # a2a_1 (5): best fit 3 (|5-3|=2 beats |5-2|=3, |5-1|); then t_u=2 -> dw_ffn (2)
    assert s.assignment["dw_attn"] == "a2a_1" and s.assignment["dw_ffn"] == "a2a_1"
    # a2a_2 (4): dw_exp (4) fits exactly; dw_late depends on a2a_2 and is never eligible
    assert s.assignment["dw_exp"] == "a2a_2" and "dw_late" not in s.assignment
    assert s.overlapped == {"a2a_1": 5.0, "a2a_2": 4.0}


def test_order_is_valid_and_puts_wgrads_after_their_a2a():
    instrs = backward_graph()
    s = schedule_weight_gradients(instrs)
    g = nx.DiGraph([(d, i.name) for i in instrs for d in i.deps])
    where = {n: k for k, n in enumerate(s.order)}
    assert sorted(s.order) == sorted(i.name for i in instrs)
    assert all(where[u] < where[v] for u, v in g.edges)
    assert where["dw_attn"] == where["a2a_1"] + 1 or where["dw_ffn"] == where["a2a_1"] + 1
    assert where["dw_exp"] > where["a2a_2"]


def test_errors():
    with pytest.raises(ValueError, match="unknown"):
        schedule_weight_gradients([Instr("a", "a2a", 1.0, ("zz",))])
    with pytest.raises(ValueError, match="unique"):
        schedule_weight_gradients([Instr("a", "a2a", 1.0), Instr("a", "wgrad", 1.0)])


# ------------------------------------------------------------ partition pass (5)
import itertools
import math

from hypothesis import given, settings
from hypothesis import strategies as st

from aristax.planner.lancet import Op, PartitionPlan, pipeline_time, plan_partitions


def longest_path_time(ops, k, overhead):
    """Independent P(i, n, k): longest path through the pipeline DAG (networkx).

    Nodes are pieces (stage, partition); edges are the data dependency (previous stage
    of the same partition) and the resource order ((stage, partition) order on the
    compute or the communication stream); weights are piece durations.
    """
    pieces = []  # (kind, time) per op, in order, zero pieces dropped, merged by kind
    for op in ops:
        for kind, t in (("c", op.compute), ("m", op.a2a)):
            if t > 0:
                if pieces and pieces[-1][0] == kind:
                    pieces[-1] = (kind, pieces[-1][1] + t)
                else:
                    pieces.append((kind, t))
    if k == 1:
        return sum(t for _, t in pieces)
    if not all(op.partitionable for op in ops):
        return math.inf
    g = nx.DiGraph()
    last = {}
    for s, (kind, t) in enumerate(pieces):
        for p in range(k):
            node = (s, p)
            g.add_node(node, w=t / k + overhead)
            if s > 0:
                g.add_edge((s - 1, p), node)
            if kind in last:
                g.add_edge(last[kind], node)
            last[kind] = node
    if not pieces:
        return 0.0
    dist = {}
    for node in nx.topological_sort(g):
        dist[node] = g.nodes[node]["w"] + max((dist[u] for u in g.predecessors(node)), default=0.0)
    return max(dist.values())


def brute_force(ops, max_k, overhead):
    """min over every contiguous range partition (2^(N-1) of them) of sum_r min_k P."""
    n = len(ops)
    best = math.inf
    for cuts in itertools.product([False, True], repeat=n - 1):
        bounds = [0] + [i + 1 for i, c in enumerate(cuts) if c] + [n]
        total = sum(min(longest_path_time(ops[a:b], k, overhead) for k in range(1, max_k + 1))
                    for a, b in zip(bounds, bounds[1:]))
        best = min(best, total)
    return best


op_strategy = st.builds(
    Op,
    name=st.just("op"),
    compute=st.sampled_from([0.0, 0.5, 1.0, 2.0, 3.5]),
    a2a=st.sampled_from([0.0, 0.0, 1.0, 2.5, 4.0]),
    partitionable=st.sampled_from([True, True, True, False]),
)


def test_pipeline_time_by_hand():
    ops = [Op("gate", compute=2.0), Op("dispatch", a2a=4.0), Op("experts", compute=2.0)]
    # pieces 1, 2, 1: compute p0 [0,1] p1 [1,2]; a2a p0 [1,3] p1 [3,5];
    # compute p0 [3,4] p1 [5,6]
    assert pipeline_time(ops, 2) == 6.0
    assert pipeline_time(ops, 1) == 8.0
    # overhead 0.5 per piece: pieces 1.5, 2.5, 1.5 -> a2a p1 ends 1.5+2.5+2.5 = 6.5, +1.5
    assert pipeline_time(ops, 2, overhead=0.5) == 8.0
    assert pipeline_time(ops + [Op("x", 1.0, partitionable=False)], 2) == math.inf


@settings(max_examples=40, deadline=None)
@given(st.lists(op_strategy, min_size=1, max_size=6), st.integers(1, 4),
       st.sampled_from([0.0, 0.1, 0.4]))
def test_dp_equals_brute_force(ops, max_k, overhead):
    plan = plan_partitions(ops, max_partitions=max_k, overhead=overhead)
    assert math.isclose(plan.time, brute_force(ops, max_k, overhead), rel_tol=1e-9, abs_tol=1e-12)
    # the backtracked ranges cover the ops in order and reproduce T(N)
    assert [r[0] for r in plan.ranges][0] == 0 and plan.ranges[-1][1] == len(ops)
    assert all(a[1] == b[0] for a, b in zip(plan.ranges, plan.ranges[1:]))
    recomputed = sum(longest_path_time(ops[a:b], k, overhead) for a, b, k in plan.ranges)
    assert math.isclose(recomputed, plan.time, rel_tol=1e-9, abs_tol=1e-12)
    assert all(1 <= k <= max_k for _, _, k in plan.ranges)
    # non-partitionable ops are never split
    counts = plan.counts(len(ops))
    assert all(c == 1 for op, c in zip(ops, counts) if not op.partitionable)
    assert plan.time <= plan.serial_time + 1e-12


@settings(max_examples=20, deadline=None)
@given(st.lists(op_strategy, min_size=1, max_size=8))
def test_single_partition_is_serial(ops):
    plan = plan_partitions(ops, max_partitions=1)
    assert plan.time == plan.serial_time == sum(o.compute + o.a2a for o in ops)
    assert plan.counts() == (1,) * len(ops)


def test_overlap_found_and_max_range():
    ops = [Op("attn", 4.0), Op("gate", 1.0), Op("dispatch", a2a=4.0), Op("experts", 4.0),
           Op("combine", a2a=4.0), Op("post", 4.0)]
    plan = plan_partitions(ops, max_partitions=8, overhead=0.05)
    assert plan.time < plan.serial_time * 0.75 and max(plan.counts()) > 1
    limited = plan_partitions(ops, max_partitions=8, overhead=0.05, max_range=1)
    # one-op ranges cannot overlap compute with a following all-to-all
    assert limited.time == pytest.approx(plan.serial_time)
    assert PartitionPlan.from_dict(plan.to_dict()) == plan


def test_partition_errors():
    with pytest.raises(ValueError, match="max_partitions"):
        plan_partitions([Op("a", 1.0)], max_partitions=0)
    with pytest.raises(ValueError, match="compute"):
        Op("a", compute=-1.0)
    with pytest.raises(ValueError, match="max_range"):
        plan_partitions([Op("a", 1.0)], max_range=0)
    with pytest.raises(ValueError, match="max_partitions"):
        plan_partitions([Op("a", 1.0)], max_partitions=2.5)
    with pytest.raises(ValueError, match="overhead"):
        plan_partitions([Op("a", 1.0)], overhead=float("nan"))
    for t in (-1.0, float("nan")):
        with pytest.raises(ValueError, match="time"):
            Instr("w", "wgrad", t)


def test_equal_times_keep_the_fewest_partitions():
    # one compute op: k pieces of 1/k run back to back on the compute stream, so every
    # k takes 1.0; the tie goes to k = 1
    plan = plan_partitions([Op("a", compute=1.0)], 4)
    assert plan.ranges == ((0, 1, 1),) and plan.time == 1.0


def test_best_fit_ties_in_program_order_and_overlap_capped_by_the_a2a():
    # |1 - 1| ties: the first wgrad in program order fills the a2a, then t_u = 0 stops
    s = schedule_weight_gradients([Instr("a", "a2a", 1.0), Instr("w1", "wgrad", 1.0),
                                   Instr("w2", "wgrad", 1.0)])
    assert s.assignment == {"w1": "a"}
    # a wgrad longer than the a2a hides all of it, not more
    s = schedule_weight_gradients([Instr("a", "a2a", 1.0), Instr("w", "wgrad", 1.5)])
    assert s.assignment == {"w": "a"} and s.overlapped == {"a": 1.0}
