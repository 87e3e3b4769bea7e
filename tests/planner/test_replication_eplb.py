"""replicate_experts is never less balanced than DeepSeek's EPLB on the same input.

The reference below is written from the published description of EPLB's
``rebalance_experts`` (plain Python, nothing imported from aristax's packing code):

* balanced packing: items sorted by weight, heaviest first (ties: lower index first),
  each into the lightest pack that is not yet full (ties: lower pack id); every pack
  ends with the same item count; with one item per pack, item i goes to pack i;
* replication: every expert starts with one replica; each further replica goes to the
  expert with the largest load / replica count (ties: lower index);
* hierarchical (num_groups % num_nodes == 0, one node included: there it only sets
  replication's tie order): pack the groups' summed loads onto the nodes; lay each
  node's experts out group by group in the order the groups entered the node, then
  expert by expert; replicate inside the node over R / nodes slots; pack the node's
  replicas (load / count each, in slot order: one per expert, then the extra ones in
  the order they were made) onto its G / nodes GPUs;
* global (otherwise): the same with one group and one node.

Issue 32 (item 7): the group -> node swap pass made node loads more even and the
per-GPU maximum worse (E 16, 32 slots, 16 GPUs, 2 nodes, 8 groups, Zipf: 1.299 vs
EPLB's 1.154 max/mean).
"""

import numpy as np
import pytest
from hypothesis import HealthCheck, given, settings
from hypothesis import strategies as st

from aristax.planner.replication import replicate_experts

REL = 1e-9


# ---------------- reference EPLB (independent, plain Python) ----------------
def ref_pack(weights: list[float], num_packs: int) -> tuple[list[int], list[int]]:
    """EPLB balanced packing of N items: (pack[N], rank_in_pack[N]), N / num_packs per pack."""
    n = len(weights)
    per = n // num_packs
    if per == 1:
        return list(range(n)), [0] * n
    pack, rank = [-1] * n, [-1] * n
    total, fill = [0.0] * num_packs, [0] * num_packs
    for i in sorted(range(n), key=lambda i: -weights[i]):  # sorted() is stable
        best = -1
        for p in range(num_packs):
            if fill[p] < per and (best < 0 or total[p] < total[best]):
                best = p
        pack[i], rank[i] = best, fill[best]
        total[best] += weights[i]
        fill[best] += 1
    return pack, rank


def ref_replicate(weights: list[float], slots: int) -> tuple[list[int], list[int]]:
    """(count[n], slot_expert[slots]): one replica each, then one at a time to max w / count."""
    n = len(weights)
    count = [1] * n
    slot_expert = list(range(n))
    for _ in range(slots - n):
        best = 0
        for k in range(1, n):
            if weights[k] / count[k] > weights[best] / count[best]:
                best = k
        count[best] += 1
        slot_expert.append(best)
    return count, slot_expert


def ref_gpu_loads(load, replicas: int, gpus: int, nodes: int, groups: int) -> list[float]:
    """gpu_load[G] of EPLB's rebalance_experts (hierarchical or global, as EPLB picks)."""
    load = [float(x) for x in load]
    if groups % nodes:
        nodes, groups = 1, 1
    e = len(load)
    gs, gpn = e // groups, groups // nodes
    node_of, rank_of = ref_pack([sum(load[g * gs:(g + 1) * gs]) for g in range(groups)], nodes)
    layout = [0] * e  # node-major position -> logical expert
    for g in range(groups):
        for j in range(gs):
            layout[(node_of[g] * gpn + rank_of[g]) * gs + j] = g * gs + j
    per_node = e // nodes
    out: list[float] = []
    for node in range(nodes):
        w = [load[x] for x in layout[node * per_node:(node + 1) * per_node]]
        count, slot_expert = ref_replicate(w, replicas // nodes)
        items = [w[k] / count[k] for k in slot_expert]
        sums = [0.0] * (gpus // nodes)
        for item, p in zip(items, ref_pack(items, gpus // nodes)[0]):
            sums[p] += item
        out += sums
    return out


# ---------------- checks on aristax's result ----------------
def check_structure(r, load, replicas, gpus, nodes, groups):
    """Maps agree, every expert has a replica, GPU loads add up, groups stay on a node."""
    load = np.asarray(load, dtype=np.float64)
    e = len(load)
    assert len(r.phy_to_log) == replicas and len(r.counts) == e and len(r.log_to_phy) == e
    assert all(0 <= x < e for x in r.phy_to_log)
    assert min(r.counts) >= 1 and sum(r.counts) == replicas
    for x, slots in enumerate(r.log_to_phy):
        assert len(slots) == r.counts[x] == r.phy_to_log.count(x)
        assert all(r.phy_to_log[p] == x for p in slots)
    per = replicas // gpus  # slot p lives on GPU p // per: every GPU holds per slots
    assert len(r.gpu_load) == gpus
    recomputed = [sum(load[x] / r.counts[x] for x in r.phy_to_log[g * per:(g + 1) * per]) for g in range(gpus)]
    np.testing.assert_allclose(r.gpu_load, recomputed, rtol=1e-12, atol=1e-12 * max(load.max(), 1.0))
    if nodes > 1 and groups % nodes == 0:
        gs, slots_per_node = e // groups, replicas // nodes
        node_groups = [set() for _ in range(nodes)]
        for g in range(groups):
            where = {p // slots_per_node for x in range(g * gs, (g + 1) * gs) for p in r.log_to_phy[x]}
            assert len(where) == 1, f"group {g} is split over nodes {where}"
            node_groups[where.pop()].add(g)
        assert all(len(s) == groups // nodes for s in node_groups)


def assert_not_worse(load, replicas, gpus, nodes, groups):
    """aristax's max GPU load <= EPLB's (relative slack REL); structure valid. Returns both."""
    r = replicate_experts(load, replicas, gpus, num_nodes=nodes, num_groups=groups)
    check_structure(r, load, replicas, gpus, nodes, groups)
    ours, ref = max(r.gpu_load), max(ref_gpu_loads(load, replicas, gpus, nodes, groups))
    assert ours <= ref * (1 + REL) + 1e-300, (ours, ref)
    return ours, ref


# ---------------- inputs ----------------
KINDS = ("zipf", "uniform", "tied", "few_values", "zero", "sparse", "integers")


def make_load(kind: str, e: int, seed: int) -> np.ndarray:
    """load[e] of one family: Zipf, random, all tied, a few repeated values, all zero, mostly zero."""
    rng = np.random.default_rng(seed)
    if kind == "zipf":
        return rng.zipf(1.2 + rng.random(), e).clip(max=10_000).astype(float)
    if kind == "uniform":
        return rng.random(e) * 100
    if kind == "tied":
        return np.full(e, float(rng.integers(1, 5)))
    if kind == "few_values":
        return rng.choice([1.0, 2.0, 3.0, 6.0], e)
    if kind == "zero":
        return np.zeros(e)
    if kind == "sparse":
        return np.where(rng.random(e) < 0.7, 0.0, rng.random(e) * 50)
    return rng.integers(0, 8, e).astype(float)


@st.composite
def cases(draw):
    """(load, replicas, gpus, nodes, groups), valid for replicate_experts (and EPLB)."""
    nodes = draw(st.integers(1, 4))
    gpus = nodes * draw(st.integers(1, 8))
    groups = draw(st.integers(1, 8))
    e = groups * draw(st.integers(1, 8))  # E % groups == 0
    extra = draw(st.integers(0, 3))
    replicas = gpus * (-(-e // gpus) + extra)  # multiple of the GPUs, >= E
    load = make_load(draw(st.sampled_from(KINDS)), e, draw(st.integers(0, 2**32 - 1)))
    return load, replicas, gpus, nodes, groups


# derandomize: the same examples every run, so CI is reproducible
SETTINGS = dict(deadline=None, database=None, derandomize=True,
                suppress_health_check=[HealthCheck.too_slow])


@settings(max_examples=5000, **SETTINGS)
@given(cases())
def test_never_worse_than_eplb(case):
    assert_not_worse(*case)


@st.composite
def two_node_zipf(draw):
    """The issue's family: E 16, 32 slots, 16 GPUs, 2 nodes, 8 groups, Zipf loads."""
    seed = draw(st.integers(0, 2**32 - 1))
    a = draw(st.floats(1.1, 2.5))
    return np.random.default_rng(seed).zipf(a, 16).clip(max=10_000).astype(float)


@settings(max_examples=2500, **SETTINGS)
@given(two_node_zipf())
def test_issue_family_never_worse_than_eplb(load):
    assert_not_worse(load, 32, 16, 2, 8)


def test_issue_32_regression():
    # Zipf loads, E 16, 32 slots, 16 GPUs, 2 nodes, 8 groups of 2. The swap pass evens
    # the group -> node split, after which the per-GPU maximum was 1.375 x the mean;
    # EPLB's own split gives 1.2.
    load = np.array([1, 1, 1, 6, 1, 4, 14, 1, 1, 3, 1, 29, 1, 8, 2, 1], dtype=float)
    ref = ref_gpu_loads(load, 32, 16, 2, 8)
    assert max(ref) / np.mean(ref) == pytest.approx(1.2)
    ours, _ = assert_not_worse(load, 32, 16, 2, 8)
    assert ours / np.mean(ref) == pytest.approx(1.2)


def test_reference_matches_plain_packing_on_a_hand_case():
    # 2 nodes, 4 groups of 2 (sums 12, 4, 8, 6): node 0 gets groups 0 and 1 (10 3 2 1 ->
    # GPUs 10+1, 3+2), node 1 groups 2 and 3 (5 4 3 2 -> GPUs 5+2, 4+3)
    load = [10.0, 2.0, 3.0, 1.0, 5.0, 3.0, 4.0, 2.0]
    assert ref_gpu_loads(load, 8, 4, 2, 4) == [11.0, 5.0, 7.0, 7.0]
    assert ref_pack([3.0, 3.0, 2.0, 2.0, 2.0, 2.0], 2)[0] == [0, 1, 0, 1, 0, 1]
    assert ref_replicate([6.0, 2.0, 1.0], 5) == ([3, 1, 1], [0, 1, 2, 0, 0])
