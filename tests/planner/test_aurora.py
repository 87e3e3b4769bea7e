"""Aurora: schedules meet Thm 4.2 exactly; colocation equals brute force."""

import itertools

import numpy as np
import pytest
from hypothesis import given, settings
from hypothesis import strategies as st

from aristax.planner import aurora


def check_schedule(traffic, sched, bandwidth=None):
    d = np.array(traffic, dtype=float)
    np.fill_diagonal(d, 0)
    n = d.shape[0]
    b = np.ones(n) if bandwidth is None else np.broadcast_to(np.asarray(bandwidth, float), (n,))
    scale = np.minimum(b[:, None], b[None, :])
    for r in sched.rounds:
        src = [i for i, _, _ in r.sends]
        dst = [j for _, j, _ in r.sends]
        assert len(set(src)) == len(src), "a GPU sends two messages in one round"
        assert len(set(dst)) == len(dst), "a GPU receives two messages in one round"
        assert all(i != j for i, j in zip(src, dst))
        # the round lasts as long as its longest message
        assert r.duration == pytest.approx(max(a / scale[i, j] for i, j, a in r.sends), rel=1e-9)
    # every byte is delivered, nothing more
    np.testing.assert_allclose(sched.delivered(n), d, rtol=1e-9, atol=1e-9 * max(d.max(), 1))


def square(n, rng, kind):
    if kind == "dense":
        return rng.uniform(0, 10, (n, n))
    if kind == "sparse":
        return rng.uniform(0, 10, (n, n)) * (rng.random((n, n)) < 0.3)
    if kind == "int":
        return rng.integers(0, 5, (n, n)).astype(float)
    if kind == "zipf":
        return rng.zipf(1.5, (n, n)).clip(max=1000).astype(float)
    raise AssertionError(kind)


@settings(max_examples=40, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 9), st.sampled_from(["dense", "sparse", "int", "zipf"]),
       st.floats(0.5, 4.0))
def test_makespan_equals_lower_bound(seed, n, kind, bw):
    d = square(n, np.random.default_rng(seed), kind)
    sched = aurora.schedule_all_to_all(d, bw)
    check_schedule(d, sched, bw)
    lb = aurora.lower_bound(d, bw)
    assert sched.makespan == pytest.approx(lb, rel=1e-9, abs=1e-12)
    assert sched.num_rounds <= max(n * n - 2 * n + 2, 1)


@pytest.mark.parametrize("name", ["zeros", "one_hot_row", "one_hot_col", "diagonal", "permutation", "single"])
def test_adversarial(name):
    n = 6
    d = {
        "zeros": np.zeros((n, n)),
        "one_hot_row": np.eye(n)[[2] * n] * 0 + np.outer(np.eye(n)[2], np.ones(n)) * 3,
        "one_hot_col": np.outer(np.ones(n), np.eye(n)[4]) * 2,
        "diagonal": np.diag(np.arange(1.0, n + 1)),
        "permutation": np.eye(n)[np.roll(np.arange(n), 1)] * 5,
        "single": np.pad([[7.0]], ((0, n - 1), (0, n - 1)))[::-1],
    }[name]
    sched = aurora.schedule_all_to_all(d)
    check_schedule(d, sched)
    assert sched.makespan == pytest.approx(aurora.lower_bound(d))
    if name in ("zeros", "diagonal"):
        assert sched.num_rounds == 0 and aurora.lower_bound(d) == 0
    if name == "permutation":
        assert sched.num_rounds == 1


def test_figure4_example():
    # Fig. 4: GPU1 sends to 2 and 3, GPU2 to 1 and 3, one unit each -> 2 units, not 3
    d = np.array([[0, 1, 1], [1, 0, 1], [0, 0, 0]], float)
    sched = aurora.schedule_all_to_all(d)
    assert aurora.lower_bound(d) == 2 and sched.makespan == pytest.approx(2)


def test_rejects_bad_input():
    with pytest.raises(ValueError, match="square"):
        aurora.lower_bound(np.ones((2, 3)))
    with pytest.raises(ValueError, match="non-negative"):
        aurora.schedule_all_to_all(-np.ones((2, 2)))
    with pytest.raises(ValueError, match="bandwidth"):
        aurora.lower_bound(np.ones((2, 2)), [1.0, 0.0])
    with pytest.raises(ValueError, match="max_rounds"):
        aurora.schedule_all_to_all(np.zeros((2, 2)), max_rounds=0)
    with pytest.raises(ValueError, match="expert_load"):
        aurora.assign_experts([1.0, np.nan], [1.0, 1.0])
    for speed in ([0.0, 0.0], [-1.0, -1.0], [1.0, 1.0, 1.0]):  # equal speeds are checked too
        with pytest.raises(ValueError, match="gpu_speed"):
            aurora.colocate(np.ones((2, 2)), np.ones((2, 2)), speed)
    for unit in (np.nan, -5.0):  # nan raised a TypeError from inside, -5 was taken
        with pytest.raises(ValueError, match="compute_per_unit"):
            aurora.colocate(np.ones((3, 3)), np.eye(3), [1.0, 2.0, 3.0], compute_per_unit=unit)


def test_heterogeneous_bound_not_reachable_one_peer_at_a_time():
    d = np.array([[0, 1, 1], [0, 0, 0], [0, 0, 0]], float)
    bw = [2.0, 1.0, 1.0]
    assert aurora.lower_bound(d, bw) == 1.0  # Thm 5.2
    sched = aurora.schedule_all_to_all(d, bw)
    check_schedule(d, sched, bw)
    assert sched.makespan == pytest.approx(2.0)  # the min(B_i, B_j) decomposition (Appx. B)


def test_bounded_rounds_stop_the_decomposition_at_the_bound(monkeypatch):
    """max_rounds ran the whole Birkhoff-von Neumann decomposition (up to n^2 rounds,
    a matching each) before falling back: 5.9 s for n = 96. It stops once the rounds
    pass the bound: at most max_rounds + 1 matchings, then the colouring's."""
    matchings = []
    match = aurora._perfect_matching
    monkeypatch.setattr(aurora, "_perfect_matching",
                        lambda support: matchings.append(1) or match(support))
    n = 24
    d = np.random.default_rng(0).random((n, n))
    np.fill_diagonal(d, 0.0)
    bounded = aurora.schedule_all_to_all(d, max_rounds=n)
    check_schedule(d, bounded)
    assert bounded.num_rounds <= n - 1
    assert len(matchings) <= (n + 1) + (n - 1)  # the full decomposition takes ~n^2


@settings(max_examples=20, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 8))
def test_bounded_rounds(seed, n):
    rng = np.random.default_rng(seed)
    d = square(n, rng, "sparse")
    full = aurora.schedule_all_to_all(d)
    s = (d * (1 - np.eye(n)) > 0)
    delta = int(max(s.sum(0).max(), s.sum(1).max()))
    if delta == 0:
        return
    bounded = aurora.schedule_all_to_all(d, max_rounds=delta)
    check_schedule(d, bounded)
    assert bounded.num_rounds <= delta
    assert bounded.makespan >= aurora.lower_bound(d) * (1 - 1e-9)
    if full.num_rounds <= delta:
        assert bounded == full  # the optimal schedule already fits
    else:
        # the colouring fallback sends each message whole, in exactly one round
        assert sum(len(r.sends) for r in bounded.rounds) == int(s.sum())
    if delta > 1 and full.num_rounds > delta - 1:
        with pytest.raises(ValueError, match="max_rounds"):
            aurora.schedule_all_to_all(d, max_rounds=delta - 1)


def test_schedule_json_roundtrip():
    d = np.random.default_rng(0).uniform(0, 3, (5, 5))
    s = aurora.schedule_all_to_all(d)
    assert aurora.Schedule.from_dict(s.to_dict()) == s


def test_assign_experts_thm51():
    gpu = aurora.assign_experts([5, 1, 9, 3], [1.0, 4.0, 2.0, 3.0])
    # loads descending: e2(9), e0(5), e3(3), e1(1); speeds descending: g1, g3, g2, g0
    assert gpu.tolist() == [3, 0, 1, 2]
    with pytest.raises(ValueError, match="equal length"):
        aurora.assign_experts([1, 2], [1.0])


def test_assign_experts_matches_brute_force():
    rng = np.random.default_rng(1)
    for _ in range(20):
        n = 5
        load, speed = rng.uniform(1, 10, n), rng.uniform(1, 4, n)
        gpu = aurora.assign_experts(load, speed)
        got = (load / speed[gpu]).max()
        best = min((load / speed[list(p)]).max() for p in itertools.permutations(range(n)))
        assert got == pytest.approx(best)


@settings(max_examples=30, deadline=None)
@given(st.integers(0, 10_000), st.integers(1, 7), st.booleans(), st.sampled_from([1.0, 1e-9, 1e9]))
def test_colocation_equals_brute_force(seed, n, symmetric, unit):
    rng = np.random.default_rng(seed)  # unit: traffic in seconds or bytes picks the same case
    a, b = rng.uniform(0, 10, (n, n)) * unit, rng.uniform(0, 10, (n, n)) * unit
    if symmetric:  # Case I: every GPU sends what it receives
        a, b = a + a.T, b + b.T
    c = aurora.colocate(a, b)
    assert c.method == ("case1" if symmetric or n == 1 else "case2")
    assert sorted(c.b_partner) == list(range(n))
    assert c.bottleneck == pytest.approx(aurora.colocation_cost(a, b, c.b_partner, c.gpu, None))
    assert c.bottleneck == pytest.approx(aurora.brute_force_colocation(a, b))


def test_bottleneck_matching_small():
    w = np.array([[1, 9], [2, 3]], float)
    perm, v = aurora.bottleneck_matching(w)
    assert perm.tolist() == [0, 1] and v == 3
    perm, v = aurora.bottleneck_matching(np.zeros((0, 0)))
    assert perm.shape == (0,) and v == 0.0


@settings(max_examples=15, deadline=None)
@given(st.integers(0, 10_000), st.integers(2, 5))
def test_heterogeneous_colocation_vs_brute_force(seed, n):
    rng = np.random.default_rng(seed)
    a, b = rng.uniform(0, 10, (n, n)), rng.uniform(0, 10, (n, n))
    speed = rng.choice([1.0, 0.8, 0.5, 0.4], n)  # the section 8.1 bandwidth ratios
    if np.allclose(speed, speed[0]):
        speed[0] = 1.0 if speed[0] != 1.0 else 0.5
    c = aurora.colocate(a, b, speed)
    assert c.method == "hetero" and sorted(c.gpu) == list(range(n))
    got = aurora.colocation_cost(a, b, c.b_partner, c.gpu, speed)
    assert got == pytest.approx(c.bottleneck)
    best = aurora.brute_force_colocation(a, b, speed)
    assert got >= best * (1 - 1e-12)


def test_inference_time_exclusive_eq3():
    d = np.array([[0, 4, 0], [1, 0, 1], [0, 2, 0]], float)
    t = aurora.inference_time_exclusive(d, gate=1.0, ffn=[2.0, 3.0, 1.0], agg=0.5)
    # |G| + max row/col (6 received by GPU 1) + max F + same for the reverse + |A|
    assert t == pytest.approx(1 + 6 + 3 + 6 + 0.5)


def test_inference_time_colocated_table2():
    # all computation zero: the layer is the aggregated first all-to-all plus both second ones
    assert aurora.inference_time_colocated(2.0, 3.0, 2.0, 1.0) == pytest.approx(3 + 2 + 1)
    t = aurora.inference_time_colocated(2.0, 3.0, 2.0, 1.0, gate=(1, 1), ffn=(4, 1), agg=(1, 1))
    # E_Fa = max(1,2)+4 = 6; E_Nb = 3; E_Fb = 7; E_Ca = 8; E_Aa = 9; E_Cb = 9; E_Ab = 10; + G^a
    assert t == pytest.approx(11)


def test_inference_time_colocated_waits_for_the_slower_gate_of_b():
    # b's gate (5) outlasts a's first all-to-all (2): a's FFN starts after it.
    # E_Fa = max(5,2)+4 = 9; E_Nb = max(5,3) = 5; E_Fb = 9+1 = 10; E_Ca = 9+2 = 11;
    # E_Aa = max(10,11)+1 = 12; E_Cb = 11+1 = 12; E_Ab = 12+1 = 13; + G^a (1) = 14
    t = aurora.inference_time_colocated(2.0, 3.0, 2.0, 1.0, gate=(1, 5), ffn=(4, 1), agg=(1, 1))
    assert t == pytest.approx(14)


def test_inference_time_front_exclusive_by_hand():
    d = np.array([[0, 4, 0], [1, 0, 1], [0, 2, 0]], float)
    # homogeneous: eq. 3 = |G| + max(row, col sums) + max F + the same for D^T + |A|
    t = aurora.inference_time(d, gate=1.0, ffn=[2.0, 3.0, 1.0], agg=0.5)
    assert t == pytest.approx(1 + 6 + 3 + 6 + 0.5)
    # heterogeneous (Thm 5.2): expert i on GPU gpu_of_expert[i] runs at that GPU's B.
    # gpu_of_expert = [2, 0, 1], B = [2, 1, 4] -> expert bandwidths [4, 2, 1];
    # sends 4/4, 2/2, 2/1; receives 1/4, 6/2, 1/1 -> |N| = |C| = 3
    t = aurora.inference_time(d, gate=1.0, ffn=[2.0, 3.0, 1.0], agg=0.5, bandwidth=[2, 1, 4],
                              gpu_of_expert=[2, 0, 1])
    assert t == pytest.approx(1 + 3 + 3 + 3 + 0.5)
    with pytest.raises(ValueError, match="permutation"):
        aurora.inference_time(d, gpu_of_expert=[0, 0, 1])
    with pytest.raises(ValueError, match="colocated_with"):
        aurora.inference_time(d, colocation=[0, 1, 2])


def test_inference_time_front_colocated_by_hand():
    da = np.array([[0, 4], [1, 0]], float)
    db = np.array([[0, 1], [3, 0]], float)
    kw = dict(gate=1.0, ffn=2.0, agg=1.0, gate_b=1.0, ffn_b=1.0, agg_b=1.0)
    # identity: D^a + D^b = [[0, 5], [4, 0]] -> |N^a+N^b| = 5; |N^a| = |C^a| = 4; |C^b| = 3.
    # Table 2: E_Fa = max(1, 4) + 2 = 6; E_Nb = max(1, 5) = 5; E_Fb = 6 + 1 = 7;
    # E_Ca = 6 + 4 = 10; E_Aa = 10 + 1 = 11; E_Cb = 10 + 3 = 13; E_Ab = 13 + 1 = 14; + |G^a|
    assert aurora.inference_time(da, colocated_with=db, **kw) == pytest.approx(15)
    # swapped partners: D^b moves with its experts -> [[0, 3], [1, 0]], aggregate 7:
    # E_Fa = 6; E_Nb = 7; E_Fb = 8; E_Ca = 11; E_Aa = 12; E_Cb = 14; E_Ab = 15; + 1
    assert aurora.inference_time(da, colocated_with=db, colocation=[1, 0], **kw) == pytest.approx(16)
    # colocate() minimises the aggregate and picks the identity here
    c = aurora.colocate(da, db)
    assert c.b_partner == (0, 1)
    assert aurora.inference_time(da, colocated_with=db, colocation=c, **kw) == pytest.approx(15)
    # heterogeneous: pairs on GPUs (1, 0) with B = [4, 2] -> pair bandwidths [2, 4];
    # aggregate sends 5/2, 4/4, receives 4/2, 5/4 -> 2.5; |N^a| = 4/2 = 2; |C^b| = 3/2;
    # no computation: E_Ca = max(2, 2.5) + 2 = 4.5, E_Cb = 4.5 + 1.5 = 6
    hetero = aurora.Colocation((0, 1), (1, 0), 0.0, "hetero")
    assert aurora.inference_time(da, bandwidth=[4, 2], colocated_with=db, colocation=hetero) == pytest.approx(6)
    with pytest.raises(ValueError, match="shape"):
        aurora.inference_time(da, colocated_with=np.zeros((3, 3)))
