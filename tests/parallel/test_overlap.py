"""Lancet chunking (aristax.parallel.overlap) against the unchunked aristax.moe.moe."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest

from aristax import MoEConfig, MoEParams, moe
from aristax import routing as routing_lib
from aristax.dispatch import capacity_dispatch
from aristax.parallel import overlap

D, F, T = 8, 12, 30  # T = 30: k = 4 does not divide it


def make_params(cfg: MoEConfig, seed=0) -> MoEParams:
    ks = jax.random.split(jax.random.key(seed), 4)
    E = cfg.num_experts
    return MoEParams(router_de=jax.random.normal(ks[0], (D, E)) * 0.7,
                     up_edf=jax.random.normal(ks[1], (E, D, F)) * D ** -0.5,
                     gate_edf=jax.random.normal(ks[2], (E, D, F)) * D ** -0.5,
                     down_efd=jax.random.normal(ks[3], (E, F, D)) * F ** -0.5)


CONFIGS = {
    "dropless_top2": dict(top_k=2),
    "capacity_position_top2": dict(top_k=2, capacity_factor=0.75),
    "capacity_position_top3": dict(top_k=3, capacity_factor=0.5, normalize_weights=True),
    "capacity_probability_top2": dict(top_k=2, capacity_factor=0.75, drop_policy="probability"),
}


@pytest.mark.parametrize("name", CONFIGS)
def test_chunked_equals_unchunked(name):
    cfg = MoEConfig(num_experts=4, d_model=D, d_ff=F, z_loss_coef=1e-3, **CONFIGS[name])
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    ct = jax.random.normal(jax.random.key(2), (T, D))
    ks = (1, 2, 3, 4)

    def all_layers(x, p):  # one compiled program: the unchunked layer and every k
        outs = [moe(x, p, cfg)] + [overlap.chunked_moe(x, p, cfg, num_chunks=k) for k in ks]
        return jnp.stack([y for y, _ in outs]), jax.tree.map(lambda *a: jnp.stack(a),
                                                              *[a for _, a in outs])

    @jax.jit
    def run(x, p):  # outputs, aux, and each layer's vjp of <y, ct>, in one compile
        ys, aux = all_layers(x, p)
        # Gradients for the unchunked layer and k = 4 (uneven chunks of T = 30) only:
        # each extra vjp costs a compile on the shared 2-core test machine.
        grads = [jax.grad(lambda x, p, f=f: jnp.sum(f(x, p)[0] * ct), argnums=(0, 1))(x, p)
                 for f in (lambda x, p: moe(x, p, cfg),
                           lambda x, p: overlap.chunked_moe(x, p, cfg, num_chunks=4))]
        return ys, aux, grads

    ys, aux, grads = run(x, params)
    if cfg.capacity_factor is not None:
        assert int(aux["num_dropped"][0]) > 0  # the capacity cases really drop
    for i, k in enumerate(ks, start=1):
        np.testing.assert_allclose(np.asarray(ys[i]), np.asarray(ys[0]), atol=1e-6, rtol=1e-6)
        assert int(aux["num_dropped"][i]) == int(aux["num_dropped"][0]), k
        np.testing.assert_array_equal(np.asarray(aux["expert_load"][i]),
                                      np.asarray(aux["expert_load"][0]))
        for key in ("loss", "lb_loss", "z_loss", "dropped_fraction"):
            np.testing.assert_allclose(float(aux[key][i]), float(aux[key][0]), rtol=1e-6,
                                       err_msg=key)
    g0, g4 = grads
    for a, b in zip(jax.tree.leaves(g4), jax.tree.leaves(g0)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=1e-5, rtol=1e-5)


def test_chunks_run_on_the_fused_kernel(kernel_calls):
    """implementation="triton" (interpret mode here): every chunk goes through the fused
    moe_mlp, its dropped slots past num_valid, and equals the unchunked reference
    layer, values and gradients (the dropless case runs in tests/test_layers.py)."""
    cfg = MoEConfig(num_experts=4, d_model=D, d_ff=F, **CONFIGS["capacity_position_top3"])
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(3), (T, D))
    ct = jax.random.normal(jax.random.key(4), (T, D))
    fused = cfg.replace(implementation="triton")

    def value_and_grad(f):  # ((<y, ct>, y), d/d(x, params))
        def loss(x, p):
            y = f(x, p)[0]
            return jnp.sum(y * ct), y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)

    assert int(jax.jit(lambda x, p: moe(x, p, cfg)[1]["num_dropped"])(x, params)) > 0
    got = value_and_grad(lambda x, p: overlap.chunked_moe(x, p, fused, num_chunks=3))
    assert kernel_calls["triton"].count("moe_mlp") == 3, kernel_calls
    want = value_and_grad(lambda x, p: moe(x, p, cfg))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_chunks_route_on_the_named_kernel(router, kernel_calls):
    """A dropless chunked layer with implementation="triton" routes the whole batch on
    the fused route kernel (once; counted), as the unchunked layer does, and equals the
    unchunked reference layer, values and gradients."""
    cfg = MoEConfig(num_experts=4, d_model=D, d_ff=F, top_k=2, router=router,
                    normalize_weights=True)
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(5), (T, D))
    ct = jax.random.normal(jax.random.key(6), (T, D))

    def value_and_grad(f):
        def loss(x, p):
            y, aux = f(x, p)
            return jnp.sum(y * ct) + aux["loss"], y

        return jax.jit(jax.value_and_grad(loss, argnums=(0, 1), has_aux=True))(x, params)

    got = value_and_grad(lambda x, p: overlap.chunked_moe(
        x, p, cfg.replace(implementation="triton"), num_chunks=3))
    assert kernel_calls["triton"].count("route") == 1, kernel_calls
    want = value_and_grad(lambda x, p: moe(x, p, cfg))
    for a, b in zip(jax.tree.leaves(got), jax.tree.leaves(want)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=2e-5, rtol=2e-5)


def test_naive_micro_batching_would_differ():
    """Per-chunk capacity C/k (no carry) changes the drops: the test above can fail."""
    cfg = MoEConfig(num_experts=4, top_k=2, d_model=D, d_ff=F, capacity_factor=0.75)
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T - 2, D))

    @jax.jit
    def run(x):
        naive = jnp.concatenate([moe(c, params, cfg)[0] for c in jnp.split(x, 4)])
        return moe(x, params, cfg)[0], naive, overlap.chunked_moe(x, params, cfg, num_chunks=4)[0]

    y, naive, y_c = run(x)
    assert not np.allclose(np.asarray(naive), np.asarray(y), atol=1e-4)
    np.testing.assert_allclose(np.asarray(y_c), np.asarray(y), atol=1e-6)


@pytest.mark.parametrize("seed", range(2))
@pytest.mark.parametrize("k", (2, 5))
def test_carried_keep_position_matches_global(seed, k):
    E, K, Tn = 6, 3, 23
    logits = jax.random.normal(jax.random.key(seed), (Tn, E)) * 2
    cfg = MoEConfig(num_experts=E, top_k=K, d_model=D, d_ff=F)
    routing = routing_lib.route(logits, cfg.router_config)
    routing = routing.replace(mask=routing.mask.at[3, 1].set(False))  # an unassigned slot
    for C in (1, 3, 7):
        bounds = overlap.chunk_bounds(Tn, k)
        kept = overlap.carried_keep_position(routing, C, bounds)
        want = capacity_dispatch(routing, C, "position").kept
        np.testing.assert_array_equal(np.asarray(kept), np.asarray(want))
        carry = overlap.capacity_carry(routing, kept, bounds)
        assert carry.shape == (k, E) and int(carry[0].sum()) == 0
        used = np.asarray(jnp.sum(jax.nn.one_hot(routing.expert_ids, E, dtype=jnp.int32)
                                  * kept[..., None].astype(jnp.int32), axis=(0, 1)))
        assert (used <= C).all() and (np.asarray(carry[-1]) <= used).all()
        assert (np.diff(np.asarray(carry), axis=0) >= 0).all()


def test_chunk_bounds_and_errors():
    assert overlap.chunk_bounds(10, 4) == ((0, 3), (3, 6), (6, 8), (8, 10))
    assert overlap.chunk_bounds(5, 1) == ((0, 5),)
    with pytest.raises(ValueError, match="num_chunks"):
        overlap.chunk_bounds(5, 0)
    with pytest.raises(ValueError, match="num_chunks=6"):
        overlap.chunk_bounds(5, 6)


def test_num_chunks_from_plan():
    from aristax.planner import ModelSpec, make_plan
    from aristax.planner.topology import uniform
    plan = make_plan(uniform(8, expert_capacity=8), ModelSpec(num_experts=8),
                     groups=[list(range(8))], max_partitions=4)
    k = overlap.num_chunks_from_plan(plan)
    assert k == plan.partition_counts[plan.op_names.index("dispatch")]
    assert 1 <= k <= 4
    with pytest.raises(ValueError, match="op="):
        overlap.num_chunks_from_plan(plan, op="nope")
