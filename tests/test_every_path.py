"""Every routing, activation and dispatch option through every path of the layer (one
device, Lancet chunks, expert parallelism), with kernels named and not, against the
per-token reference of tests/moe_reference.py: outputs, drop counts and gradients.

One compiled program per case runs its paths and their gradients. Expert
parallelism applies capacity per source shard (GShard), so its reference runs shard by
shard; it refuses expert choice (batch-global by definition) with a clear error.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest

import moe_reference as ref
from aristax import MoEConfig, MoEParams, moe
from aristax.parallel import expert_parallel_moe
from aristax.parallel.overlap import chunked_moe

D, F, E, T = 8, 12, 8, 16
MESH_SHAPE = (2, 4)  # 8 token shards of T / 8 tokens
SHARDS = MESH_SHAPE[0] * MESH_SHAPE[1]
ROUTERS = {
    "softmax_topk": dict(router="softmax_topk", top_k=2, normalize_weights=True),
    "topk_softmax": dict(router="topk_softmax", top_k=3),
    "sigmoid_groups": dict(router="sigmoid", top_k=2, num_groups=4, topk_groups=2,
                           routed_scaling_factor=2.0),
    "expert_choice": dict(router="expert_choice", top_k=2),
}
DISPATCH = {"dropless": {}, "capacity": dict(capacity_factor=1.0)}
ACTIVATIONS = ("swiglu", "geglu", "gelu")
# Every router x dispatch on the default backends with two of the three activations,
# and with a kernel named with the third: each (router, dispatch) meets every
# activation, each activation every router and dispatch on both backends. With a kernel
# named the chunked path is left out here (its three chunks of interpreted kernels were
# about half of such a case's 14-15 s of lowering and compiling on the 2-core VM):
# tests/parallel/test_overlap.py runs chunks on the named route and fused expert kernels
# (dropless and capacity) and test_overlap_ep.py expert-parallel chunks on them,
# against the unchunked layer.
PAIRS = [(r, d) for r in ROUTERS for d in DISPATCH]
CASES = [(r, d, ACTIVATIONS[(i + j) % 3], None) for i, (r, d) in enumerate(PAIRS)
         for j in (0, 1)] + [(r, d, ACTIVATIONS[(i + 2) % 3], "triton")
                             for i, (r, d) in enumerate(PAIRS)]


def make_params(cfg: MoEConfig, seed: int) -> MoEParams:
    ks = iter(jax.random.split(jax.random.key(seed), 12))
    n = lambda s, scale: jax.random.normal(next(ks), s) * scale  # noqa: E731
    Fs = cfg.shared_width
    shared, biased = cfg.num_shared_experts > 0, cfg.expert_bias
    return MoEParams(
        router_de=n((D, E), 1.0),
        up_edf=n((E, D, F), D ** -0.5),
        gate_edf=n((E, D, F), D ** -0.5) if cfg.gated else None,
        down_efd=n((E, F, D), F ** -0.5),
        router_bias_e=n((E,), 1.0) if cfg.router_bias else None,
        gate_bias_ef=n((E, F), 0.5) if biased and cfg.gated else None,
        up_bias_ef=n((E, F), 0.5) if biased else None,
        down_bias_ed=n((E, D), 0.5) if biased else None,
        shared_up_df=n((D, Fs), D ** -0.5) if shared else None,
        shared_gate_df=n((D, Fs), D ** -0.5) if shared and cfg.gated else None,
        shared_down_fd=n((Fs, D), Fs ** -0.5) if shared else None,
        shared_expert_gate_d=n((D,), 1.0) if cfg.shared_expert_gate else None)


def reference(x, p: MoEParams, cfg: MoEConfig, shards: int, ct):
    """(y [T, D] float64, dropped, d<y, ct>/d(x, params by field)) of the per-token
    reference, applied to each of ``shards`` consecutive token blocks (the gradients
    once per reference, not once per path: eager, they are most of a case's time)."""
    pd = {f.name: getattr(p, f.name) for f in dataclasses.fields(MoEParams)}
    blocks = np.split(np.asarray(x, np.float64), shards)
    plans = [ref.plan(xb, pd["router_de"], cfg, router_bias=pd["router_bias_e"])
             for xb in blocks]
    y = np.concatenate([ref.forward(xb, pd, cfg, pl) for xb, pl in zip(blocks, plans)])

    def loss(x, pd):
        ys = [ref.forward(xb, pd, cfg, pl, xnp=jnp)
              for xb, pl in zip(jnp.split(x, shards), plans)]
        return jnp.sum(jnp.concatenate(ys) * ct)

    return y, sum(pl["dropped"] for pl in plans), jax.grad(loss, argnums=(0, 1))(x, pd)


def run_paths(cfg: MoEConfig, x, params: MoEParams, ct, paths):
    """{path: (y, num_dropped, (dx, dparams))} of each path, in one jit."""
    @jax.jit
    def run(x, params):
        out = {}
        for name, forward in paths.items():
            def loss(x, p, forward=forward):
                y, aux = forward(x, p)
                return jnp.sum(y * ct), (y, aux["num_dropped"])
            (_, (y, dropped)), grads = jax.value_and_grad(
                loss, argnums=(0, 1), has_aux=True)(x, params)
            out[name] = (y, dropped, grads)
        return out

    return run(x, params)


def assert_grads(got, want, err_msg):
    (gx, gp), (rx, rp) = got, want
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), atol=5e-5, rtol=5e-4,
                               err_msg=f"{err_msg}: dx")
    for field in dataclasses.fields(MoEParams):
        g, r = getattr(gp, field.name), rp.get(field.name)
        if g is not None:
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=5e-5, rtol=5e-4,
                                       err_msg=f"{err_msg}: d{field.name}")


@pytest.mark.parametrize("router,dispatch,activation,implementation", CASES,
                         ids=["-".join(str(v) for v in case) for case in CASES])
def test_every_option_in_every_path(router, dispatch, activation, implementation,
                                    kernel_calls):
    cfg = MoEConfig(num_experts=E, d_model=D, d_ff=F, activation=activation,
                    implementation=implementation, **ROUTERS[router], **DISPATCH[dispatch])
    seed = CASES.index((router, dispatch, activation, implementation))
    params = make_params(cfg, seed)
    x = jax.random.normal(jax.random.key(seed + 100), (T, D))
    ct = jax.random.normal(jax.random.key(seed + 200), (T, D))
    mesh = jax.make_mesh(MESH_SHAPE, ("data", "expert"))
    paths = {"one_device": lambda x, p: moe(x, p, cfg)}
    if implementation is None:  # chunks on a named kernel: tests/parallel/test_overlap*.py
        paths["chunked"] = lambda x, p: chunked_moe(x, p, cfg, num_chunks=3)
    ep = lambda x, p: expert_parallel_moe(x, p, cfg, mesh, exchange="padded")  # noqa: E731
    if router == "expert_choice":
        with pytest.raises(ValueError, match="router='expert_choice'"):
            ep(x, params)
    else:
        paths["expert_parallel"] = ep
    out = run_paths(cfg, x, params, ct, paths)
    # where capacity applies, EP's reference is per source shard; elsewhere one batch
    whole = reference(x, params, cfg, shards=1, ct=ct)
    sharded = (reference(x, params, cfg, shards=SHARDS, ct=ct)
               if "expert_parallel" in paths and dispatch == "capacity" else whole)
    for name, (y, dropped, grads) in out.items():
        y_ref, dropped_ref, want = sharded if name == "expert_parallel" else whole
        np.testing.assert_allclose(np.asarray(y), y_ref, atol=3e-5, rtol=3e-4, err_msg=name)
        assert int(dropped) == dropped_ref, name
        assert_grads(grads, want, name)
    if dispatch == "capacity" and router != "expert_choice":
        assert whole[1] > 0 and sharded[1] > 0  # the capacity really drops
    if implementation == "triton":  # the kernels ran; dropless top-k routes and the
        # experts run fused (the route kernel serves ungrouped routers only)
        assert set(kernel_calls["triton"]) & {"ragged_dot", "moe_mlp"}, kernel_calls
        if dispatch == "dropless" and router == "softmax_topk":
            assert {"route", "moe_mlp"} <= set(kernel_calls["triton"]), kernel_calls


# The options of Hugging Face's blocks (issue 33), each combination named after a block
# that uses it, through every path with kernels named and not (the kernels that do not
# compute an option fall back to the reference for that step).
HF_OPTIONS = {
    "gpt_oss": dict(router="topk_softmax", top_k=2, router_bias=True, expert_bias=True,
                    activation="clamped_swiglu", swiglu_limit=0.6, swiglu_alpha=1.3),
    "llama4": dict(router="sigmoid", top_k=1, weight_side="input", num_shared_experts=1),
    "qwen2_moe": dict(router="softmax_topk", top_k=3, num_shared_experts=2,
                      shared_expert_gate=True),
    "deepseek_v2_groups": dict(router="softmax_topk", top_k=2, num_groups=4, topk_groups=2,
                               group_score="max", routed_scaling_factor=1.5),
    "megatron_groups_pnorm": dict(router="sigmoid", top_k=4, num_groups=4, topk_groups=2,
                                  group_score="topk_over_groups", normalize_weights=True,
                                  weight_norm_p=2.0, weight_norm_eps=0.3),
    "switch_relu": dict(router="softmax_topk", top_k=1, activation="relu",
                        capacity_factor=1.0, expert_bias=True),
}
# kernels named and not for the options a kernel does not compute (router bias, expert
# biases and the clamped SwiGLU; weights on the input), one of the two for the others
HF_CASES = [("gpt_oss", None), ("gpt_oss", "triton"), ("llama4", None), ("llama4", "triton"),
            ("qwen2_moe", "triton"), ("deepseek_v2_groups", None),
            ("megatron_groups_pnorm", "triton"), ("switch_relu", None)]


@pytest.mark.parametrize("name,implementation", HF_CASES,
                         ids=[f"{n}-{i}" for n, i in HF_CASES])
def test_hf_block_options_in_every_path(name, implementation):
    cfg = MoEConfig(num_experts=E, d_model=D, d_ff=F, implementation=implementation,
                    **HF_OPTIONS[name])
    seed = 1000 + HF_CASES.index((name, implementation))
    params = make_params(cfg, seed)
    x = jax.random.normal(jax.random.key(seed + 100), (T, D))
    ct = jax.random.normal(jax.random.key(seed + 200), (T, D))
    mesh = jax.make_mesh(MESH_SHAPE, ("data", "expert"))
    paths = {"one_device": lambda x, p: moe(x, p, cfg),
             "chunked": lambda x, p: chunked_moe(x, p, cfg, num_chunks=3),
             "expert_parallel": lambda x, p: expert_parallel_moe(x, p, cfg, mesh,
                                                                 exchange="padded")}
    out = run_paths(cfg, x, params, ct, paths)
    capacity = cfg.capacity_factor is not None
    whole = reference(x, params, cfg, shards=1, ct=ct)
    sharded = reference(x, params, cfg, shards=SHARDS, ct=ct) if capacity else whole
    for path, (y, dropped, grads) in out.items():
        y_ref, dropped_ref, want = sharded if path == "expert_parallel" else whole
        np.testing.assert_allclose(np.asarray(y), y_ref, atol=3e-5, rtol=3e-4, err_msg=path)
        assert int(dropped) == dropped_ref, path
        assert_grads(grads, want, path)
