"""measure_topology: the pure fit and pairing on exact data; one run on 8 CPU devices."""

import itertools

import jax
import numpy as np
import pytest

from aristax.parallel.measure import (
    DEFAULT_EXPERT_CAPACITY,
    all_pairs,
    fit_alpha_beta,
    measure_topology,
    pair_matrix,
    round_robin_pairs,
)
from aristax.planner import ModelSpec, Topology, make_plan


def test_fit_two_sizes_is_exact():
    # t = 5 us + n / (10 GB/s) at n = 4 KiB and 1 MiB, for a [2, 3] batch of pairs
    alpha = np.array([[5e-6, 1e-6, 0.0], [2e-5, 3e-6, 7e-6]])
    beta = np.array([[1e-10, 2e-11, 5e-10], [0.0, 1e-9, 3e-12]])
    sizes = np.array([4096.0, 1048576.0])
    times = alpha[..., None] + beta[..., None] * sizes
    a, b = fit_alpha_beta(sizes, times)
    np.testing.assert_allclose(a, alpha, rtol=1e-9, atol=1e-15)
    np.testing.assert_allclose(b, beta, rtol=1e-9, atol=1e-20)


def test_fit_least_squares_three_sizes():
    # points (0, 1), (1, 3), (2, 2): least-squares line 1.5 + 0.5 x
    a, b = fit_alpha_beta([0, 1, 2], [1.0, 3.0, 2.0])
    assert a == pytest.approx(1.5) and b == pytest.approx(0.5)


def test_fit_clamps_negative_slope_and_intercept():
    # larger message faster (noise): beta = 0, alpha = mean time
    a, b = fit_alpha_beta([100, 200], [3.0, 1.0])
    assert (a, b) == (pytest.approx(2.0), 0.0)
    # line through the points has alpha = -1: alpha = 0, beta = sum(s t) / sum(s^2)
    a, b = fit_alpha_beta([1, 2], [1.0, 3.0])
    assert a == 0.0 and b == pytest.approx((1 * 1 + 2 * 3) / (1 + 4))


@pytest.mark.parametrize("bad,match", [(dict(sizes=[8, 8], times=[1.0, 2.0]), "sizes"),
                                       (dict(sizes=[8, 16], times=[1.0, 2.0, 3.0]), "times"),
                                       (dict(sizes=[8, 16], times=[1.0, np.inf]), "finite")])
def test_fit_rejects(bad, match):
    with pytest.raises(ValueError, match=match):
        fit_alpha_beta(**bad)


@pytest.mark.parametrize("v", [1, 2, 3, 4, 5, 8, 9])
def test_round_robin_is_a_one_factorization(v):
    rounds = round_robin_pairs(v)
    assert len(rounds) == (0 if v == 1 else v - 1 if v % 2 == 0 else v)
    for r in rounds:
        used = [d for p in r for d in p]
        assert len(used) == len(set(used)) and len(r) == v // 2  # disjoint, maximal
    got = sorted(p for r in rounds for p in r)
    assert got == list(itertools.combinations(range(v), 2))
    assert sorted(p for [p] in all_pairs(v)) == got


def test_pair_matrix_symmetric_and_complete():
    probes = [[(0, 1)], [(0, 2), ], [(1, 2)]]
    m = pair_matrix(probes, [[1.0, 2.0], [3.0, 4.0], [5.0, 6.0]], 3)
    assert m.shape == (3, 3, 2)
    np.testing.assert_array_equal(m[:, :, 0], [[0, 1, 3], [1, 0, 5], [3, 5, 0]])
    with pytest.raises(ValueError, match="cover"):
        pair_matrix(probes[:2], [[1.0, 2.0], [3.0, 4.0]], 3)


@pytest.mark.parametrize("method,n", [("rounds", 8), ("pairs", 4)])
def test_measure_topology_on_cpu_devices(method, n):
    devices = jax.devices()[:n]
    assert len(devices) == n  # conftest gives 8 host devices
    top = measure_topology(devices, sizes=(64, 16384), repeats=2, inner=2, method=method)
    assert isinstance(top, Topology) and top.num_devices == n
    for m in (top.alpha, top.beta):
        assert m.shape == (n, n)
        np.testing.assert_array_equal(m, m.T)
        assert np.all(m >= 0) and np.all(np.diag(m) == 0)
    off = ~np.eye(n, dtype=bool)
    assert np.all(top.p2p_time(16384)[off] > 0)  # every pair took measurable time
    assert top.flops.shape == (n,) and np.all(top.flops > 0)
    assert np.all(top.expert_capacity == DEFAULT_EXPERT_CAPACITY)
    np.testing.assert_array_equal(top.node, [d.process_index for d in devices])
    assert Topology.from_dict(top.to_dict()) == top  # validates again
    plan = make_plan(top, ModelSpec(num_experts=2 * n, d_model=64, d_ff=128, tokens_per_device=64))
    assert sorted(d for g in plan.groups for d in g) == list(range(n))


def test_measure_topology_given_flops_capacity_and_errors():
    devices = jax.devices()[:2]
    top = measure_topology(devices, sizes=(64, 4096), repeats=1, inner=1, flops=[1e12, 2e12],
                           expert_capacity=3)
    np.testing.assert_array_equal(top.flops, [1e12, 2e12])
    np.testing.assert_array_equal(top.expert_capacity, [3, 3])
    one = measure_topology(devices[:1], sizes=(64, 4096), repeats=1, flops=1e12)
    assert one.num_devices == 1 and one.alpha[0, 0] == 0.0
    with pytest.raises(ValueError, match="sizes"):
        measure_topology(devices, sizes=(64,))
    with pytest.raises(ValueError, match="method"):
        measure_topology(devices, method="ring")
    with pytest.raises(ValueError, match="flops"):
        measure_topology(devices, flops=[1.0, 2.0, 3.0])


def test_matmul_flops_counts_every_product_of_the_chain(monkeypatch):
    """FLOP/s = chain * 2 n^3 / the best time of one program that chains the products
    (a @ b with b = 1/n keeps a: the chain's result shows it ran every product)."""
    from aristax.parallel import measure

    results = []

    def fake_min_time(fn, repeats):
        results.append(np.asarray(fn()))
        return 0.25

    monkeypatch.setattr(measure, "min_time", fake_min_time)
    monkeypatch.setitem(measure.MATMUL_PROBE, "cpu", (64, 5))
    assert measure.matmul_flops(jax.devices("cpu")[0]) == 5 * 2 * 64**3 / 0.25
    np.testing.assert_array_equal(results[0], np.ones((64, 64), np.float32))
