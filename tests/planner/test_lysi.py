"""LysiGroup / LysiAssign against independent, from-scratch computations."""

import itertools
import math

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aristax.planner.lysi import (
    POLICIES,
    Workload,
    allreduce_time,
    edge_order,
    group_cost,
    local_cost,
    lysi_assign,
    lysi_group,
    merge_accepted,
    merge_accepted_array,
    partition_cost,
)
from aristax.planner.topology import Topology, heterogeneous_mix, perlmutter

INF = math.inf


# ----------------------------------------------------------------- references
def reference_lysi_group(top, wl, policy):
    """Edge by edge, T recomputed from scratch for every decision (no caching)."""
    eu, ev, _ = edge_order(top, wl)
    of = {i: frozenset([i]) for i in range(top.num_devices)}
    for u, v in zip(eu.tolist(), ev.tolist()):
        gu, gv = of[u], of[v]
        if gu == gv:
            continue
        n = len(set(of.values()))
        t_u, t_v = group_cost(gu, n, top, wl), group_cost(gv, n, top, wl)
        t_uv = group_cost(gu | gv, n - 1, top, wl)
        if merge_accepted(policy, t_u, t_v, t_uv):
            for d in gu | gv:
                of[d] = gu | gv
    groups = set(of.values())
    while any(math.isinf(local_cost(g, top, wl)) for g in groups):
        a = min((g for g in groups if math.isinf(local_cost(g, top, wl))), key=min)
        b = min((g for g in groups if g != a), key=lambda g: (local_cost(a | g, top, wl), min(g)))
        groups = (groups - {a, b}) | {a | b}
    return sorted(sorted(g) for g in groups)


def random_topology(seed, v):
    rng = np.random.default_rng(seed)
    a = rng.uniform(1e-6, 5e-5, (v, v))
    b = rng.uniform(1e-12, 1e-10, (v, v))
    a, b = (a + a.T) / 2, (b + b.T) / 2
    np.fill_diagonal(a, 0)
    np.fill_diagonal(b, 0)
    return Topology(a, b, rng.uniform(5e13, 3e14, v), rng.integers(1, 9, v))


# ------------------------------------------------------------------- policies
@pytest.mark.parametrize(
    "policy, t_u, t_v, t_uv, want",
    [
        ("max_min_fair", 2.0, 2.0, 2.0, True),  # equality: r_u + r_v = 0
        ("max_min_fair", 1.0, 3.0, 2.0, False),  # 2 (1 + 1/3) > 2
        ("max_min_fair", 1.0, 4.0, 1.5, True),  # 1.5 * 1.25 <= 2: v gains more than u loses
        ("pareto", 1.0, 4.0, 1.5, False),  # u gets worse
        ("pareto", 2.0, 2.0, 2.0, False),  # strict
        ("pareto", 2.0, 3.0, 1.0, True),
        # infinities, both policies
        ("max_min_fair", INF, INF, INF, True),  # accumulate memory
        ("pareto", INF, INF, INF, True),
        ("max_min_fair", INF, INF, 5.0, True),
        ("max_min_fair", INF, 2.0, 2.0, True),  # feasible side not worse
        ("max_min_fair", INF, 2.0, 3.0, False),  # the 2*T limit form would merge here
        ("pareto", INF, 2.0, 2.0, False),
        ("pareto", 2.0, INF, 1.0, True),
        ("max_min_fair", 2.0, 3.0, INF, False),
    ],
)
def test_merge_accepted_table(policy, t_u, t_v, t_uv, want):
    assert merge_accepted(policy, t_u, t_v, t_uv) is want
    assert bool(merge_accepted_array(policy, [t_u], [t_v], [t_uv])[0]) is want


@settings(max_examples=60, deadline=None)
@given(st.lists(st.tuples(*(st.one_of(st.just(INF), st.floats(1e-3, 10)),) * 3), min_size=1, max_size=20),
       st.sampled_from(POLICIES))
def test_merge_accepted_array_matches_scalar(triples, policy):
    t = np.array(triples)
    vec = merge_accepted_array(policy, t[:, 0], t[:, 1], t[:, 2])
    assert vec.tolist() == [merge_accepted(policy, *map(float, row)) for row in t]


def test_bad_arguments():
    with pytest.raises(ValueError, match="policy"):
        lysi_group(perlmutter(1), Workload(num_experts=8), policy="greedy")
    for chunk in (0, -1):  # a chunk < 1 never advanced the edge scan (hung)
        with pytest.raises(ValueError, match="chunk"):
            lysi_group(perlmutter(1), Workload(num_experts=8), chunk=chunk)
    for field, value in (("recompute", float("nan")), ("eta", float("nan")), ("global_batch", 0),
                         ("flops_per_token", -1.0), ("allreduce_bytes", -1.0)):
        with pytest.raises(ValueError, match=f"Workload.{field}"):
            Workload(num_experts=8, **{field: value})


# ------------------------------------------------------------------ cost model
def test_cost_matches_equation_by_hand():
    t = perlmutter(2)
    wl = Workload(num_experts=48, tokens_per_device=1024, d_model=512, d_ff=1024, num_layers=4,
                  moe_every=2)
    g = [0, 1, 4]
    d = 1024 * 512 * 2
    gamma = 2 * 4 / 2  # (2 + r) L / i with r = 0 and B = W b
    compute = 3 * 1024 * 6 * 512 * 1024 / (3 * t.flops[0])
    c0 = 9e-6 + 30e-6 + d / 3 * (t.beta[0, 1] + t.beta[0, 4])
    c4 = 2 * (30e-6 + d / 3 * t.beta[0, 4])
    local = gamma * (compute + 2 * max(c0, c4))
    assert local_cost(g, t, wl) == pytest.approx(local, rel=1e-12)
    n = 4
    d_ar = 3 * 512 * 1024 * 48 * 2 / 3
    ar = 2 * (n - 1) * (30e-6 + d_ar * t.beta[0, 4] / n)
    assert group_cost(g, n, t, wl) == pytest.approx(local + ar, rel=1e-12)
    assert allreduce_time(1, 3, t, wl) == 0.0
    assert local_cost([0], t, wl) == INF  # 32 < 48 experts: eq. 3
    inference = Workload(num_experts=48, tokens_per_device=1024, d_model=512, d_ff=1024, training=False)
    assert group_cost(g, n, t, inference) == pytest.approx(local_cost(g, t, inference))


def test_edge_order_sorted_and_deterministic():
    t = perlmutter(2)
    u, v, w = edge_order(t, Workload(num_experts=8))
    assert np.all(np.diff(w) >= 0) and len(u) == 8 * 7 // 2
    assert (u < v).all()
    # intra-node edges (cheap) come first
    assert all(t.node[a] == t.node[b] for a, b in zip(u[:12], v[:12]))


# ------------------------------------------------------------------ LysiGroup
def _check_partition(groups, top, wl):
    flat = sorted(d for g in groups for d in g)
    assert flat == list(range(top.num_devices))
    for g in groups:
        assert top.expert_capacity[g].sum() >= wl.num_experts


@settings(max_examples=25, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 11), st.integers(1, 24), st.sampled_from(POLICIES),
       st.booleans())
def test_matches_edge_by_edge_reference(seed, v, experts, policy, training):
    top = random_topology(seed, v)
    if top.expert_capacity.sum() < experts:
        return
    wl = Workload(num_experts=experts, tokens_per_device=2048, d_model=512, d_ff=1024, training=training)
    got = lysi_group(top, wl, policy=policy, chunk=7)  # tiny chunks exercise the scanning
    assert got == reference_lysi_group(top, wl, policy)
    _check_partition(got, top, wl)
    assert got == lysi_group(top, wl, policy=policy)  # chunking does not change the answer


@pytest.mark.parametrize("seed", range(6))
@pytest.mark.parametrize("policy", POLICIES)
def test_asymmetric_topology_matches_edge_by_edge_reference(seed, policy):
    """alpha[i, j] != alpha[j, i]: merging must add each member's sends to the other
    group (alpha[member, others]), not its receives."""
    rng = np.random.default_rng(seed)
    v = 9
    a = rng.uniform(1e-6, 5e-5, (v, v))
    a = np.tril(a) + 0.01 * np.triu(a, 1)  # j -> i costs 100x i -> j for i < j
    b = rng.uniform(1e-12, 1e-10, (v, v))
    np.fill_diagonal(a, 0)
    np.fill_diagonal(b, 0)
    top = Topology(a, b, rng.uniform(5e13, 3e14, v), rng.integers(1, 9, v), symmetric=False)
    assert not np.allclose(top.alpha, top.alpha.T)
    wl = Workload(num_experts=min(12, int(top.expert_capacity.sum())), tokens_per_device=2048,
                  d_model=512, d_ff=1024)
    got = lysi_group(top, wl, policy=policy, chunk=7)
    assert got == reference_lysi_group(top, wl, policy)
    _check_partition(got, top, wl)


@pytest.mark.parametrize("experts", [16, 32, 64, 128])
@pytest.mark.parametrize("policy", POLICIES)
def test_perlmutter_presets_match_reference(experts, policy):
    top, wl = perlmutter(4), Workload(num_experts=experts)
    got = lysi_group(top, wl, policy=policy)
    assert got == reference_lysi_group(top, wl, policy)
    _check_partition(got, top, wl)


def test_perlmutter_groups_follow_nodes():
    top = perlmutter(4)
    # 32 experts per GPU: 16 and 32 experts fit on one GPU, 64 need two GPUs, 128 four.
    # Groups never split a node's NVLink island across a more expensive inter-node group.
    for experts, sizes in ((16, {4}), (64, {8}), (128, {16})):
        groups = lysi_group(top, Workload(num_experts=experts))
        assert {len(g) for g in groups} == sizes, experts
        for g in groups:
            assert len(g) % 4 == 0 and all(sum(top.node[g] == n) in (0, 4) for n in range(4))


def test_limit_rule_would_be_worse():
    """The documented reason for the one-infinite rule (see merge_accepted)."""
    top, wl = perlmutter(16), Workload(num_experts=256)
    ours = lysi_group(top, wl)
    assert max(len(g) for g in ours) <= 24
    assert partition_cost(ours, top, wl) < partition_cost([list(range(64))], top, wl)


def test_heterogeneous_and_infeasible():
    top = heterogeneous_mix()
    groups = lysi_group(top, Workload(num_experts=64))
    _check_partition(groups, top, Workload(num_experts=64))
    with pytest.raises(ValueError, match="expert_capacity"):
        lysi_group(perlmutter(1), Workload(num_experts=129))


def test_single_device():
    top = Topology([[0.0]], [[0.0]], [1e14], [8])
    assert lysi_group(top, Workload(num_experts=8)) == [[0]]


def test_leftover_infeasible_group_joins_cheapest():
    # pareto never lets device 2 (capacity 1) join: feasible groups only get worse.
    a = np.array([[0, 1e-6, 1e-3], [1e-6, 0, 2e-3], [1e-3, 2e-3, 0]])
    top = Topology(a, np.zeros((3, 3)), [1e14] * 3, [4, 4, 1])
    wl = Workload(num_experts=4, training=False)
    groups = lysi_group(top, wl, policy="pareto")
    assert groups == reference_lysi_group(top, wl, "pareto")
    _check_partition(groups, top, wl)
    assert [2] not in groups


# ----------------------------------------------------------------- LysiAssign
def brute_force_makespan(flops, cap, costs):
    best = INF
    w = len(flops)
    for owners in itertools.product(range(w), repeat=len(costs)):
        counts = np.bincount(owners, minlength=w)
        if np.any(counts > cap):
            continue
        load = np.bincount(owners, weights=costs, minlength=w)
        best = min(best, float((load / flops).max()))
    return best


def _check_assignment(a, flops, cap, costs):
    flat = sorted(x for xs in a.experts for x in xs)
    assert flat == list(range(len(costs)))  # every expert exactly once
    for w, xs in enumerate(a.experts):
        assert len(xs) <= cap[w]
        assert a.load[w] == pytest.approx(sum(costs[x] for x in xs))
    assert a.makespan == pytest.approx(max(l / f for l, f in zip(a.load, flops)))
    assert a.makespan >= a.lower_bound * (1 - 1e-12)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 4), st.integers(1, 7))
def test_assign_vs_brute_force(seed, w, x):
    rng = np.random.default_rng(seed)
    flops = rng.choice([1.0, 2.0, 3.0], w)
    cap = rng.integers(1, 5, w)
    if cap.sum() < x:
        cap[0] += x - cap.sum()
    costs = rng.uniform(1, 10, x)
    paper = lysi_assign(flops, cap, costs, improve=False)
    a = lysi_assign(flops, cap, costs)
    opt = brute_force_makespan(flops, cap, costs)
    for result in (paper, a):
        _check_assignment(result, flops, cap, costs)
        assert result.makespan >= opt * (1 - 1e-12)
    assert a.makespan <= paper.makespan * (1 + 1e-12)
    # without binding memory Alg. 2 is within 2x of optimal (fair share + one expert)
    if np.all(cap >= x):
        assert paper.makespan <= 2 * opt * (1 + 1e-12)


def test_assign_improves_alg2_when_memory_binds():
    # Alg. 2: the 10x and 4x workers hold one expert each and take experts that fit
    # their budgets, so the largest (52.2) lands on the slowest worker
    flops, cap = [4.0, 1.0, 10.0], [1, 4, 1]
    costs = [1.5, 0.6, 0.5, 22.7, 0.25, 52.2]
    opt = brute_force_makespan(flops, cap, costs)
    paper = lysi_assign(flops, cap, costs, improve=False)
    a = lysi_assign(flops, cap, costs)
    _check_assignment(a, flops, cap, costs)
    assert paper.makespan > 5 * opt
    assert a.makespan == pytest.approx(opt)


def test_assign_exact_cases():
    a = lysi_assign([1.0, 1.0], [4, 4], [1.0] * 8)
    assert a.makespan == a.lower_bound == 4.0
    # FLOP-proportional budgets: the 3x faster worker takes 3x the work
    a = lysi_assign([3.0, 1.0], [8, 8], [1.0] * 8)
    assert a.load == (6.0, 2.0) and a.makespan == 2.0
    # memory binds: the fast worker may only hold one expert
    a = lysi_assign([10.0, 1.0], [1, 8], [5.0, 1.0, 1.0])
    assert a.experts == ((0,), (1, 2))
    # leftovers (each larger than every budget) go where they finish first
    a = lysi_assign([1.0, 1.0, 1.0], [3, 3, 3], [4.0, 4.0, 4.0, 4.0])
    assert sorted(len(x) for x in a.experts) == [1, 1, 2]


def test_assign_expert_exactly_filling_the_budget_is_taken():
    # budgets 8/2 = 4 each. Worker 0: BestFit 3 (expert 0), then budget 1 fits expert 1
    # exactly (cost == budget fits). Worker 1: 2 (expert 3), then 2 (expert 2) = 4.
    a = lysi_assign([1.0, 1.0], [2, 2], [3.0, 1.0, 2.0, 2.0], improve=False)
    assert a.experts == ((0, 1), (2, 3))


def test_assign_wraparound_ties_go_to_the_earlier_worker():
    # budgets 16/3: each worker takes one 4 (largest id first: 3, 2, 1); expert 0 is
    # left over and finishes at (4 + 4) / 1 = 8 on every worker: the first in the
    # rotation (worker 0) takes it
    a = lysi_assign([1.0] * 3, [3] * 3, [4.0] * 4)
    assert a.experts == ((0, 3), (2,), (1,))


def test_assign_errors():
    with pytest.raises(ValueError, match="capacity"):
        lysi_assign([1.0, 1.0], [1, 1], [1.0, 1.0, 1.0])
    with pytest.raises(ValueError, match="flops"):
        lysi_assign([0.0], [1], [1.0])
    with pytest.raises(ValueError, match="expert_costs"):
        lysi_assign([1.0], [1], [-1.0])
