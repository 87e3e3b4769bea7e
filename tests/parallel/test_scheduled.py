"""The "scheduled" exchange (ppermute rounds) against "padded" on 8 CPU devices."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx
from jax.sharding import PartitionSpec as P

from aristax import MoE, MoEConfig, moe
from aristax.parallel import (collectives, complete_rounds, expert_parallel_moe,
                              mesh_from_plan, rounds_from_schedule, scheduled_all_to_all)
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import uniform
from test_expert_parallel import make_mesh, make_params, per_shard_moe

D, T = 16, 64


def _assert_every_pair_once(rounds, W):
    pairs = [p for r in rounds for p in r]
    assert sorted(pairs) == [(i, j) for i in range(W) for j in range(W) if i != j]
    for r in rounds:
        assert r and len({i for i, _ in r}) == len(r) == len({j for _, j in r})


def test_complete_rounds_covers_every_pair_once_and_validates():
    _assert_every_pair_once(complete_rounds((((0, 1), (1, 0)),), 3), 3)
    # a pair given twice is sent once, in its first round
    rounds = complete_rounds((((0, 1), (1, 0)), ((0, 1), (1, 2)), ((1, 0),)), 3)
    _assert_every_pair_once(rounds, 3)
    assert rounds[:2] == (((0, 1), (1, 0)), ((1, 2),))
    with pytest.raises(ValueError, match="partial permutation"):
        complete_rounds((((0, 1), (0, 2)),), 3)
    with pytest.raises(ValueError, match="self-send"):
        complete_rounds((((1, 1),),), 3)


@pytest.mark.parametrize("rounds", [None, (((0, 3), (3, 0)), ((1, 2), (5, 6), (7, 1)))])
def test_scheduled_all_to_all_equals_all_to_all(rounds):
    mesh = jax.make_mesh((8,), ("expert",), axis_types=(jax.sharding.AxisType.Auto,))
    buf = jax.random.normal(jax.random.key(0), (8 * 8, 3, 2))  # per device [W=8, B=3, 2]
    full = complete_rounds(rounds, 8)

    def body(b):
        return (scheduled_all_to_all(b, "expert", full), jax.lax.all_to_all(b, "expert", 0, 0))

    got, want = jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P("expert"),
                                      out_specs=(P("expert"), P("expert"))))(buf)
    np.testing.assert_array_equal(np.asarray(got), np.asarray(want))


@pytest.mark.parametrize("shape,changes,use_plan", [
    ((1, 8), dict(num_experts=8, top_k=2), True),
    ((2, 4), dict(num_experts=8, top_k=2, capacity_factor=0.75), False),
])
def test_ep_scheduled_equals_padded(shape, changes, use_plan):
    cfg = MoEConfig(d_model=D, d_ff=24, **changes)
    mesh = make_mesh(shape)
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    ct = jax.random.normal(jax.random.key(2), (T, D))
    schedule = None
    if use_plan:
        R, W = shape
        plan = make_plan(uniform(8, expert_capacity=cfg.num_experts),
                         ModelSpec(num_experts=cfg.num_experts),
                         groups=[list(range(r * W, (r + 1) * W)) for r in range(R)])
        schedule = rounds_from_schedule(plan.schedules[0])
        assert schedule  # the plan really gives rounds

    def loss(x, p, exchange, sched):
        y, aux = expert_parallel_moe(x, p, cfg, mesh, exchange=exchange, schedule=sched)
        return jnp.sum(y * ct) + aux["loss"], y

    @jax.jit
    def run(x, p):
        g = jax.value_and_grad(loss, argnums=(0, 1), has_aux=True)
        return g(x, p, "padded", None), g(x, p, "scheduled", schedule)

    ((_, y0), g0), ((_, y1), g1) = run(x, params)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y0), atol=1e-6)
    for a, b in zip(jax.tree.leaves(g1), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-6)
    # and both equal the independent single-device layer (per source shard: capacity)
    y_ref = jax.jit(lambda x, p: per_shard_moe(x, p, cfg, 8)[0])(x, params)
    np.testing.assert_allclose(np.asarray(y1), np.asarray(y_ref), atol=2e-5, rtol=2e-5)


def test_schedule_needs_scheduled_exchange():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24)
    with pytest.raises(ValueError, match="schedule="):
        expert_parallel_moe(jnp.zeros((T, D)), make_params(cfg), cfg, make_mesh((1, 8)),
                            exchange="padded", schedule=(((0, 1),),))


def test_ragged_exchange_is_refused_on_a_cpu_mesh():
    """XLA:CPU has no ragged_all_to_all: refused while tracing, naming the options that
    run there, on a concrete CPU mesh and inside jit (an abstract mesh)."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24)
    mesh, x, params = make_mesh((1, 8)), jnp.zeros((T, D)), make_params(cfg)
    with pytest.raises(ValueError, match="exchange='ragged'.*'ragged_emulated'"):
        expert_parallel_moe(x, params, cfg, mesh, exchange="ragged")
    with jax.set_mesh(mesh), pytest.raises(ValueError, match="exchange='ragged'"):
        jax.jit(lambda x: expert_parallel_moe(x, params, cfg, exchange="ragged"))(x)


def test_rounds_from_a_skewed_plan_send_each_pair_once():
    # Aurora splits pairs over several rounds under skew; the exchange moves a whole
    # block per pair, so each pair is kept only in the round that carries most of it
    load = tuple(float(v) for v in np.geomspace(1.0, 40.0, 8))
    plan = make_plan(uniform(8), ModelSpec(num_experts=8, expert_load=load, top_k=2),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    amounts = [{(i, j): a for i, j, a in r.sends if i != j} for r in plan.schedules[0].rounds]
    sends = [p for r in amounts for p in r]
    assert len(sends) > len(set(sends))  # the plan really splits some pair
    largest = {p: max(r.get(p, 0.0) for r in amounts) for p in sends}
    rounds = rounds_from_schedule(plan.schedules[0])
    _assert_every_pair_once(complete_rounds(rounds, 4), 4)
    assert sorted(p for r in rounds for p in r) == sorted(set(sends))
    for r in rounds:  # each kept round is part of one Aurora round carrying its pairs' most
        assert any(all(a.get(p) == largest[p] for p in r) for a in amounts), r


def test_a_plan_layer_with_exchange_scheduled_runs_the_plans_rounds(monkeypatch):
    """``MoE(plan=, mesh=)`` with ``exchange="scheduled"`` exchanges in the plan's
    Aurora order (its slowest group's rounds) and equals one device. A user trial found
    the plan's schedule never reaching the layer: it ran the generic shift rounds."""
    spec = ModelSpec(num_experts=8, top_k=2, expert_load=[8, 4, 2, 1, 1, 1, 1, 1])
    plan = make_plan(uniform(8, expert_capacity=8), spec,
                     groups=[list(range(4)), list(range(4, 8))])
    want = rounds_from_schedule(max(plan.schedules, key=lambda s: s.makespan))
    assert want and want != complete_rounds(None, 4)[:len(want)]  # not the shift order
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=24, exchange="scheduled")
    mesh = mesh_from_plan(plan)
    layer = MoE(cfg, rngs=nnx.Rngs(0), plan=plan, mesh=mesh)
    assert layer.plan_call_options(T)["schedule"] == want
    seen = []
    real = collectives.exchange

    def spy(*args, **kwargs):
        seen.append(kwargs.get("schedule"))
        return real(*args, **kwargs)

    monkeypatch.setattr(collectives, "exchange", spy)
    x = jax.random.normal(jax.random.key(3), (T, D))
    y, _ = nnx.jit(lambda m, x: m(x))(layer, x)
    assert seen and all(s == want for s in seen)  # dispatch and return trips
    y_one, _ = jax.jit(lambda x, p: moe(x, p, dataclasses.replace(cfg, exchange=None)))(
        x, layer.logical_params())
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_one), atol=2e-5, rtol=2e-5)
    padded = MoE(dataclasses.replace(cfg, exchange="padded"), rngs=nnx.Rngs(0), plan=plan,
                 mesh=mesh)
    assert padded.plan_call_options(T)["schedule"] is None
