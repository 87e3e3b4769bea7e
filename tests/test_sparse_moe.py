"""aristax.models.sparse_moe (the decode/prefill MoE of Mixtral.decode_weights) against
the per-token reference in tests/moe_reference.py, on both of its paths: each selected
expert once on all rows (T <= max_selected_tokens()), and rows grouped by expert in
chunks (larger T); and its ``matmul_out_in`` against NumPy on each of its forms."""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

import moe_reference as ref
from aristax import MoE, MoEConfig, moe
from aristax.models import sparse_moe

SMALL, LARGE = 7, 150  # the two paths, on any backend: T <= max_selected_tokens() < T
D, F, E = 16, 24, 6


def run_and_compare(cfg: MoEConfig, x, router_de=None, bias=None, seed=0):
    module = MoE(cfg, rngs=nnx.Rngs(seed))
    if router_de is None:
        router_de = jax.random.normal(jax.random.key(seed + 1), (D, cfg.num_experts)) * 0.5
    module.router.weight_de[...] = router_de
    p = {"router_de": router_de, "gate_edf": module.experts.gate_edf[...],
         "up_edf": module.experts.up_edf[...], "down_efd": module.experts.down_efd[...]}
    y, logits = jax.jit(sparse_moe.sparse_moe, static_argnums=(3, 4))(
        x, router_de, sparse_moe.expert_weights(module.params()), cfg.router_config,
        cfg.activation, bias=bias)
    pl = ref.plan(x, router_de, cfg, bias=None if bias is None else np.asarray(bias))
    np.testing.assert_allclose(np.asarray(y), ref.forward(x, p, cfg, pl), rtol=2e-5,
                               atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(x) @ np.asarray(router_de),
                               rtol=1e-5, atol=1e-5)
    return pl


def tokens(T, seed=3):
    return jax.random.normal(jax.random.key(seed), (T, D))


@pytest.mark.parametrize("T", [SMALL, LARGE])
@pytest.mark.parametrize("activation", ["swiglu", "geglu"])
def test_matches_reference_mixtral_routing(T, activation):
    assert SMALL <= sparse_moe.max_selected_tokens() < LARGE
    cfg = MoEConfig(num_experts=E, top_k=2, d_model=D, d_ff=F, activation=activation,
                    normalize_weights=True)
    run_and_compare(cfg, tokens(T))


@pytest.mark.parametrize("T", [SMALL, LARGE, 2 * LARGE + 1])
def test_hard_loads_all_on_one_expert_and_empty_experts(T):
    """Top-1, every token on expert 2 (the others empty): the grouped path runs one
    expert over many chunks, with a partial last chunk."""
    cfg = MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F)
    router = jnp.zeros((D, E)).at[:, 2].set(1.0)
    x = jnp.abs(tokens(T)) + 0.1  # positive rows: expert 2's logit is the largest
    pl = run_and_compare(cfg, x, router_de=router)
    assert pl["load"][2] == T and pl["load"].sum() == T


def routed_exactly(counts, seed=4):
    """x [T, D] and router [D, E] under which top-1 sends counts[e] tokens to expert e
    (in a random token order): token t is a one-hot of its expert plus small noise."""
    expert_of = np.random.default_rng(seed).permutation(np.repeat(np.arange(len(counts)),
                                                                  counts))
    noise = np.random.default_rng(seed + 1).normal(size=(len(expert_of), D)) * 0.1
    x = np.eye(D, dtype=np.float32)[expert_of] * 4.0 + noise.astype(np.float32)
    return jnp.asarray(x), jnp.eye(D, len(counts))


def test_grouped_path_runs_every_tail_size():
    """Exact per-expert row counts on the grouped path: empty, a tail of 1 row, a
    whole chunk (no tail), and tails that need each of ``tail_sizes``' GEMMs,
    including the largest (chunk - 1 rows)."""
    chunk = 64
    counts = [0, 1, chunk, chunk + 30, 2 * chunk + 12, chunk - 1]  # E = 6
    assert sparse_moe._chunk_rows(sum(counts), E) == chunk
    tails = sparse_moe.tail_sizes(chunk)
    needed = {min(s for s in tails if s >= c % chunk) for c in counts if c % chunk}
    assert needed == set(tails), (needed, tails)
    x, router = routed_exactly(counts)
    pl = run_and_compare(MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F), x,
                         router_de=router)
    np.testing.assert_array_equal(pl["load"], counts)


def test_few_tokens_path_with_empty_and_uneven_experts():
    """Exact per-expert counts on the few-tokens path: the empty experts are skipped,
    each other one runs once on all rows."""
    counts = [0, 1, 3, 0, 2, 1]
    assert sum(counts) <= sparse_moe.max_selected_tokens()
    x, router = routed_exactly(counts)
    pl = run_and_compare(MoEConfig(num_experts=E, top_k=1, d_model=D, d_ff=F), x,
                         router_de=router)
    np.testing.assert_array_equal(pl["load"], counts)


@pytest.mark.parametrize("rows", [1, 2, 5, sparse_moe.CPU_MULTIPLY_SUM_ROWS,
                                  sparse_moe.CPU_MULTIPLY_SUM_ROWS + 1])
@pytest.mark.parametrize("dtype,acc_dtype", [("float32", None), ("bfloat16", "float32"),
                                             ("bfloat16", None)])
def test_matmul_out_in_each_form(rows, dtype, acc_dtype):
    """One row (the GEMV), 2..CPU_MULTIPLY_SUM_ROWS rows (on the CPU, a multiply
    summed over ``in``) and beyond (a dot), with two leading dims, odd sizes and a
    weight held in float32 for bf16 inputs: all equal x @ w.T in float64 NumPy, in
    the accumulation dtype asked for."""
    kx, kw = jax.random.split(jax.random.key(rows))
    x = jax.random.normal(kx, (rows, 1, 37)).astype(dtype)
    w = jax.random.normal(kw, (19, 37))
    y = jax.jit(sparse_moe.matmul_out_in, static_argnums=2)(x, w, acc_dtype)
    assert y.shape == (rows, 1, 19) and y.dtype == jnp.dtype(acc_dtype or dtype)
    w_used = np.asarray(w.astype(dtype), np.float64)  # the weight in x's dtype
    expected = np.asarray(x, np.float64) @ w_used.T
    tol = 1e-5 if y.dtype == jnp.float32 else 2e-2
    np.testing.assert_allclose(np.asarray(y, np.float64), expected, rtol=tol, atol=tol)


@pytest.mark.parametrize("T", [SMALL, LARGE])
def test_k_equals_e(T):
    cfg = MoEConfig(num_experts=4, top_k=4, d_model=D, d_ff=F, normalize_weights=True)
    run_and_compare(cfg, tokens(T))


@pytest.mark.parametrize("T", [SMALL, LARGE])
def test_grouped_sigmoid_router_with_balance_bias(T):
    """DeepSeek-V3 selection: group-limited sigmoid scores, a balancing bias that moves
    the selection (not the weights), a routed scaling factor."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F, router="sigmoid",
                    normalize_weights=True, num_groups=4, topk_groups=2,
                    routed_scaling_factor=2.5, bias_update_rate=0.01)
    bias = jax.random.normal(jax.random.key(9), (8,)) * 0.5
    run_and_compare(cfg, tokens(T), bias=bias)


def test_supports_only_configs_it_computes_exactly():
    base = MoEConfig(num_experts=E, top_k=2, d_model=D, d_ff=F)
    assert sparse_moe.supports(base)
    for change in (dict(capacity_factor=1.0), dict(num_shared_experts=1),
                   dict(activation="gelu"), dict(router="expert_choice"),
                   dict(dtype="bfloat16")):
        assert not sparse_moe.supports(base.replace(**change)), change


@pytest.mark.parametrize("T", [SMALL, LARGE])
@pytest.mark.parametrize("router", ["softmax_topk", "sigmoid"])
def test_parity_with_the_layer_body(T, router):
    """The decode path is a specialisation of ``aristax.moe.moe`` (the one layer body)
    for dropless token choice without aux: y and the router logits equal the layer's on
    both of its paths."""
    cfg = MoEConfig(num_experts=E, top_k=2, d_model=D, d_ff=F, router=router,
                    normalize_weights=True)
    module = MoE(cfg, rngs=nnx.Rngs(4))
    x = tokens(T, seed=5)
    y, logits = jax.jit(sparse_moe.sparse_moe, static_argnums=(3, 4))(
        x, module.router.weight_de[...], sparse_moe.expert_weights(module.params()),
        cfg.router_config, cfg.activation)
    y_body, aux = jax.jit(moe, static_argnames="config")(x, module.params(), config=cfg)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_body), rtol=2e-5, atol=2e-5)
    np.testing.assert_allclose(np.asarray(logits), np.asarray(aux["router_logits"]),
                               rtol=1e-6, atol=1e-6)
