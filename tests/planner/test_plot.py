"""Pure helpers behind `aristax plan --png`."""

import numpy as np
import pytest

from aristax.planner import ModelSpec, make_plan
from aristax.planner.plot import gantt_bars, group_order, message_bytes, slowest_group
from aristax.planner.topology import heterogeneous_mix, perlmutter


def test_group_order_makes_groups_contiguous():
    plan = make_plan(perlmutter(2), ModelSpec(num_experts=16), groups=[[1, 3, 5, 7], [0, 2, 4, 6]])
    order, spans = group_order(plan)
    assert order.tolist() == [1, 3, 5, 7, 0, 2, 4, 6]
    assert spans == [(0, 4), (4, 8)]


def test_message_bytes_uniform_share():
    plan = make_plan(perlmutter(2), ModelSpec(num_experts=16), groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    model = ModelSpec(num_experts=16, top_k=2, d_model=8, tokens_per_device=100, bytes_per_element=2)
    assert message_bytes(plan, model) == 100 * 2 * 8 * 2 / 4


def test_gantt_bars_cover_the_schedule():
    topo = heterogeneous_mix(1, 1)
    plan = make_plan(topo, ModelSpec(num_experts=24, top_k=2, tokens_per_device=256))
    g = slowest_group(plan)
    assert plan.schedules[g].makespan == max(s.makespan for s in plan.schedules)
    bars = gantt_bars(plan, g)
    group, sched = plan.groups[g], plan.schedules[g]
    # every positive send appears once, starting at its round's start, receiver in global ids
    starts = [sum(r.duration for r in sched.rounds[:k]) for k in range(sched.num_rounds)]
    expected = sorted((i, starts[k], a, group[j], k) for k, r in enumerate(sched.rounds)
                      for i, j, a in r.sends if a > 0)
    assert len(bars) == len(expected) > 0
    np.testing.assert_allclose(np.array(sorted(bars)), np.array(expected), rtol=1e-12)
    assert max(s + l for _, s, l, _, _ in bars) == pytest.approx(sched.makespan)
