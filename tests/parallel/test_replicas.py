"""Replicated experts in expert_parallel_moe (a physical -> logical map with P > E slots)
on 8 CPU devices against the single-device layer."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aristax import MoEConfig, moe
from aristax.parallel import expert_parallel_moe, expert_permutation, layout_experts
from aristax.parallel.expert_parallel import replica_tables
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import uniform
from test_expert_parallel import make_mesh, make_params, per_shard_moe

D, F, T = 16, 24, 64
# 2 slots on each of the 4 devices of a group: logical 0 has 3 replicas, 3 has 2.
PHYS = (0, 3, 1, 0, 2, 4, 0, 3)


def test_replica_tables():
    slots, counts = replica_tables(PHYS, 5)
    np.testing.assert_array_equal(counts, [3, 1, 1, 2, 1])
    np.testing.assert_array_equal(slots[0], [0, 3, 6])
    np.testing.assert_array_equal(slots[3], [1, 7, 1])


@pytest.mark.parametrize("changes,chunks", [
    (dict(top_k=2), 1),
    (dict(top_k=2, capacity_factor=0.75, num_shared_experts=1), 2),
])
def test_replicated_equals_single_device(changes, chunks):
    cfg = MoEConfig(num_experts=5, d_model=D, d_ff=F, **changes)
    mesh = make_mesh((2, 4))
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    ct = jax.random.normal(jax.random.key(2), (T, D))

    def grads(forward, p):
        def f(x, p):
            y, aux = forward(x, p)
            return jnp.sum(y * ct) + aux["loss"], (y, aux)
        return jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, p)

    ep = lambda x, p: expert_parallel_moe(x, p, cfg, mesh, expert_perm=PHYS,  # noqa: E731
                                          num_chunks=chunks)
    if cfg.capacity_factor is None:
        ref = lambda x, p: moe(x, p, cfg)  # noqa: E731
    else:
        def ref(x, p):
            return per_shard_moe(x, p, cfg, 8)[0], moe(x, p, cfg)[1]
    (_, (y, aux)), (gx, gp) = grads(ep, layout_experts(params, PHYS))
    (_, (y_r, aux_r)), (rx, rp) = grads(ref, params)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_r), atol=2e-5, rtol=2e-5)
    for k in ("loss", "lb_loss", "expert_load"):
        np.testing.assert_allclose(np.asarray(aux[k]), np.asarray(aux_r[k]), rtol=1e-5,
                                   err_msg=k)
    if cfg.capacity_factor is not None:
        dropped = jax.jit(lambda x, p: per_shard_moe(x, p, cfg, 8)[1]["num_dropped"].sum())(
            x, params)
        assert int(aux["num_dropped"]) == int(dropped) > 0
    assert int(aux["num_overflow"]) == 0
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), atol=3e-5, rtol=3e-5)
    phys = np.asarray(PHYS)
    for name in ("up_edf", "gate_edf", "down_efd"):
        g = np.asarray(getattr(gp, name))
        assert np.all(np.abs(g).reshape(len(PHYS), -1).max(axis=1) > 0), name  # every replica works
        # each replica's gradient is its logical expert's (tie_replicas), so replicas
        # train as one; alone, each would get only its share of the tokens' gradient
        for e in range(cfg.num_experts):
            want = np.asarray(getattr(rp, name))[e]
            np.testing.assert_allclose(g[phys == e], np.broadcast_to(want, g[phys == e].shape),
                                       atol=3e-5, rtol=3e-5, err_msg=f"{name} expert {e}")
    np.testing.assert_allclose(np.asarray(gp.router_de), np.asarray(rp.router_de), atol=3e-5,
                               rtol=3e-5)


def test_plan_replicas_and_validation():
    plan = make_plan(uniform(8, expert_capacity=4), ModelSpec(num_experts=6, num_replicas=8),
                     groups=[[0, 1, 2, 3], [4, 5, 6, 7]])
    with pytest.raises(ValueError, match="allow_replicas"):
        expert_permutation(plan)
    perm = expert_permutation(plan, allow_replicas=True)
    assert len(perm) == 8 and sorted(set(perm.tolist())) == list(range(6))
    cfg = MoEConfig(num_experts=5, top_k=2, d_model=D, d_ff=F)
    x = jnp.zeros((T, D))
    with pytest.raises(ValueError, match="every one of"):
        expert_parallel_moe(x, make_params(cfg), cfg, make_mesh((2, 4)),
                            expert_perm=(0, 1, 2, 3, 0, 1, 2, 3))
    with pytest.raises(ValueError, match="physical slots"):
        expert_parallel_moe(x, make_params(cfg), cfg, make_mesh((2, 4)), expert_perm=PHYS)
