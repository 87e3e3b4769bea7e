"""expert_parallel_moe on 8 CPU devices against the single-device aristax.moe.moe
(itself tested against the per-token reference in tests/moe_reference.py)."""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

import moe_reference as ref
from aristax import MoEConfig, MoEParams, moe
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.parallel import expert_parallel_moe, expert_permutation, layout_experts, mesh_from_plan
from aristax.parallel.expert_parallel import local_experts
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import uniform

D, F, T = 16, 24, 64
TOK = P(("data", "expert"), None)
AUX_EQUAL = ("lb_loss", "z_loss", "seq_aux_loss", "loss", "expert_load", "nonfinite_tokens",
             "unchosen_tokens")


def make_mesh(shape, explicit=True):
    kind = AxisType.Explicit if explicit else AxisType.Auto
    return jax.make_mesh(shape, ("data", "expert"), axis_types=(kind, kind))


def make_params(cfg: MoEConfig, seed=0) -> MoEParams:
    ks = jax.random.split(jax.random.key(seed), 7)
    E, Fs = cfg.num_experts, cfg.shared_width
    n = lambda k, s, scale: jax.random.normal(k, s) * scale  # noqa: E731
    shared = cfg.num_shared_experts > 0
    return MoEParams(
        router_de=n(ks[0], (D, E), 0.5),
        up_edf=n(ks[1], (E, D, F), D ** -0.5),
        gate_edf=None if cfg.activation == "gelu" else n(ks[2], (E, D, F), D ** -0.5),
        down_efd=n(ks[3], (E, F, D), F ** -0.5),
        shared_up_df=n(ks[4], (D, Fs), D ** -0.5) if shared else None,
        shared_gate_df=n(ks[5], (D, Fs), D ** -0.5) if shared else None,
        shared_down_fd=n(ks[6], (Fs, D), Fs ** -0.5) if shared else None,
    )


def value_and_grads(forward, x, params, ct):
    """One compiled call: (y, aux), d/d(x, params) of sum(y * ct) + aux["loss"]."""
    def f(x, params):
        y, aux = forward(x, params)
        return jnp.sum(y * ct) + aux["loss"], (y, aux)

    (_, out), grads = jax.jit(jax.value_and_grad(f, argnums=(0, 1), has_aux=True))(x, params)
    return out, grads


def per_shard_moe(x, params, cfg, shards):
    """The single-device layer on each source shard (capacity semantics of EP)."""
    ys, auxes = jax.lax.map(lambda xs: moe(xs, params, cfg), x.reshape(shards, -1, x.shape[-1]))
    return ys.reshape(x.shape), auxes


def plan_perm(shape, E):
    R, W = shape
    groups = [list(range(r * W, (r + 1) * W)) for r in range(R)]
    plan = make_plan(uniform(8, expert_capacity=E), ModelSpec(num_experts=E), groups=groups)
    perm = expert_permutation(plan)
    return plan, perm


CASES = {
    # id: (mesh shape, config changes, exchange, use the plan's expert permutation
    #      [, the expert every token picks first])
    "1x8_top1_dropless": ((1, 8), dict(num_experts=8, top_k=1), "padded", False),
    "2x4_top2_dropless_plan_shared": (
        (2, 4), dict(num_experts=16, top_k=2, normalize_weights=True, num_shared_experts=1,
                     z_loss_coef=1e-3), "ragged_emulated", True),
    "4x2_top3_dropless_geglu": ((4, 2), dict(num_experts=8, top_k=3, activation="geglu"),
                                "padded", False),
    "2x4_top2_capacity_position": ((2, 4), dict(num_experts=8, top_k=2, capacity_factor=1.0),
                                   "padded", False),
    "4x2_top1_capacity_probability": (
        (4, 2), dict(num_experts=16, top_k=1, capacity_factor=0.75, drop_policy="probability",
                     activation="gelu"), "ragged_emulated", True),
    # Pallas Triton kernels (interpret mode here): the route kernel's dropless dispatch
    # and the fused moe_mlp; with the plan, the dispatch of the physical slots
    "2x4_top2_dropless_triton": ((2, 4), dict(num_experts=8, top_k=2, implementation="triton"),
                                 "ragged_emulated", False),
    "2x4_top2_dropless_plan_triton": (
        (2, 4), dict(num_experts=8, top_k=2, implementation="triton", num_shared_experts=1),
        "padded", True),
    # hard cases: one device receives every token (the default buffer, Tl*K rows per
    # source, must hold them), every expert on every token, and the capacity drops of
    # a full expert
    "2x4_top1_dropless_all_on_one_expert": ((2, 4), dict(num_experts=8, top_k=1),
                                            "ragged_emulated", False, 5),
    "1x8_top8_dropless_k_equals_e": ((1, 8), dict(num_experts=8, top_k=8,
                                                  normalize_weights=True), "padded", False),
    "2x4_top2_capacity_all_on_one_expert": (
        (2, 4), dict(num_experts=8, top_k=2, capacity_factor=1.0), "padded", False, 3),
}


def steer_to(x, params, expert):
    """Feature 0 of every token set to 5 and router row 0 pushing ``expert`` by 6: every
    token picks ``expert`` first."""
    return x.at[:, 0].set(5.0), dataclasses.replace(
        params, router_de=params.router_de.at[0, expert].set(6.0))


@pytest.mark.parametrize("case", sorted(CASES))
def test_matches_single_device_layer(case, kernel_calls):
    """Output, aux and gradients against the single-device layer on the reference path.
    On kernels the layer's ``shard_map`` runs with JAX's varying-axes check off (Pallas
    interpret mode fails it), and the kernels it names must really run."""
    shape, changes, exchange, use_plan, *steered = CASES[case]
    cfg = MoEConfig(d_model=D, d_ff=F, **changes)
    mesh = make_mesh(shape, explicit=shape != (1, 8))
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    if steered:
        x, params = steer_to(x, params, steered[0])
    ct = jax.random.normal(jax.random.key(2), (T, D))
    perm = None
    ep_params = params
    if use_plan:
        plan, perm = plan_perm(shape, cfg.num_experts)
        mesh = mesh_from_plan(plan, jax.devices(), num_experts=cfg.num_experts)
        ep_params = layout_experts(params, perm)

    def ep(x, p):
        return expert_parallel_moe(x, p, cfg, mesh, expert_perm=perm, exchange=exchange)

    shards = shape[0] * shape[1]
    ref_cfg = cfg.replace(implementation=None)
    if cfg.capacity_factor is None:
        ref_fwd = lambda x, p: moe(x, p, ref_cfg)  # noqa: E731
    else:
        def ref_fwd(x, p):  # per-shard outputs, whole-batch aux losses
            return per_shard_moe(x, p, ref_cfg, shards)[0], moe(x, p, ref_cfg)[1]
    (y, aux), (gx, gp) = value_and_grads(ep, x, ep_params, ct)
    if cfg.implementation:
        assert set(kernel_calls) == {"triton"}
    else:  # no kernel but the platform's default grouped GEMM ("xla" on a CPU), if any
        default = set(ragged_dot_api.DEFAULT_ORDER.get(jax.default_backend(), ())[:1])
        assert set(kernel_calls) <= default - {"reference"}
    if cfg.implementation:
        assert {"route", "moe_mlp"} <= set(kernel_calls["triton"]), kernel_calls
    (y_ref, aux_glob), (rx, rp) = value_and_grads(ref_fwd, x, params, ct)
    if cfg.capacity_factor is None:
        dropped, routed = 0, int(aux_glob["expert_load"].sum())
    else:
        shard_aux = jax.jit(lambda x, p: per_shard_moe(x, p, ref_cfg, shards)[1])(x, params)
        dropped, routed = int(shard_aux["num_dropped"].sum()), T * cfg.top_k
        assert dropped > 0  # the case really drops
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=2e-5)
    for k in AUX_EQUAL:
        np.testing.assert_allclose(np.asarray(aux[k]), np.asarray(aux_glob[k]), rtol=1e-5,
                                   atol=1e-6, err_msg=k)
    np.testing.assert_array_equal(np.asarray(aux["router_logits"]),
                                  np.asarray(aux_glob["router_logits"]))
    assert int(aux["num_dropped"]) == dropped and int(aux["num_overflow"]) == 0
    np.testing.assert_allclose(float(aux["dropped_fraction"]), dropped / routed, rtol=1e-6)
    if steered:
        assert int(aux["expert_load"][steered[0]]) == T
    if cfg.top_k == cfg.num_experts:
        np.testing.assert_array_equal(np.asarray(aux["expert_load"]), [T] * cfg.top_k)

    # Gradients w.r.t. x and every parameter.
    if perm is not None:
        rp = layout_experts(rp, perm)
    np.testing.assert_allclose(np.asarray(gx), np.asarray(rx), atol=3e-5, rtol=3e-5)
    for field in dataclasses.fields(MoEParams):
        g, r = getattr(gp, field.name), getattr(rp, field.name)
        assert (g is None) == (r is None), field.name
        if g is not None:
            np.testing.assert_allclose(np.asarray(g), np.asarray(r), atol=3e-5, rtol=3e-5,
                                       err_msg=field.name)


@pytest.mark.parametrize("implementation,activation", [("reference", "gelu"),
                                                       ("triton", "swiglu")])
def test_local_experts_on_each_implementation(implementation, activation,
                                              kernel_calls):
    """A device's received buffer [W*B, D] (source i's rows from i*B, sorted by local
    expert, then padding): each routed row through its expert's MLP in place, padding
    rows 0; values and gradients against a per-row NumPy/jnp loop. Hard counts: a
    source that sends nothing, one that fills its block, a local expert with no rows.
    "triton" (interpret mode here) runs the fused moe_mlp with one slot per row."""
    W, B, El = 4, 6, 3
    recv_counts = jnp.array([[2, 0, 3], [0, 0, 0], [1, 0, 5], [4, 0, 1]], jnp.int32)
    cfg = MoEConfig(num_experts=El, top_k=1, d_model=D, d_ff=F, activation=activation,
                    implementation=implementation)
    params = make_params(cfg, seed=3)
    recv = jax.random.normal(jax.random.key(4), (W * B, D))
    ct = jax.random.normal(jax.random.key(5), (W * B, D))
    # local expert of each buffer row, -1 on padding (rows past a source's count)
    expert_of = np.full(W * B, -1)
    for i in range(W):
        ids = np.repeat(np.arange(El), np.asarray(recv_counts[i]))
        expert_of[i * B:i * B + ids.size] = ids
    routed = expert_of >= 0

    def reference(recv, p):  # each row through its own expert's weights, one einsum each
        e = np.maximum(expert_of, 0)
        gate = None if p.gate_edf is None else jnp.einsum("rd,rdf->rf", recv, p.gate_edf[e])
        h = ref._act(gate, jnp.einsum("rd,rdf->rf", recv, p.up_edf[e]), activation, jnp)
        return jnp.where(routed[:, None], jnp.einsum("rf,rfd->rd", h, p.down_efd[e]), 0.0)

    def value_and_grad(f):
        return jax.jit(jax.value_and_grad(lambda r, p: jnp.sum(f(r, p) * ct),
                                          argnums=(0, 1)))(recv, params)

    got = jax.jit(lambda r, p: local_experts(r, recv_counts, p, cfg, B))(recv, params)
    want = reference(recv, params)
    np.testing.assert_allclose(np.asarray(got), np.asarray(want), atol=2e-5, rtol=2e-5)
    assert not np.asarray(got)[~routed].any()
    (_, g), (_, r) = (value_and_grad(lambda x, p: local_experts(x, recv_counts, p, cfg, B)),
                      value_and_grad(reference))
    for a, b in zip(jax.tree.leaves(g), jax.tree.leaves(r)):
        np.testing.assert_allclose(np.asarray(a), np.asarray(b), atol=3e-5, rtol=3e-5)
    assert ("moe_mlp" in kernel_calls["triton"]) == (implementation == "triton")


def test_jitted_step_keeps_output_sharding():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    mesh = make_mesh((2, 4))
    params = make_params(cfg)
    x = jax.device_put(jax.random.normal(jax.random.key(1), (T, D)), NamedSharding(mesh, TOK))
    expert = NamedSharding(mesh, P("expert", None, None))
    params = params.replace(up_edf=jax.device_put(params.up_edf, expert),
                            gate_edf=jax.device_put(params.gate_edf, expert),
                            down_efd=jax.device_put(params.down_efd, expert))
    y, aux = jax.jit(lambda x, p: expert_parallel_moe(x, p, cfg, mesh))(x, params)
    assert y.sharding.spec == TOK and y.sharding.mesh == mesh
    assert aux["router_logits"].sharding.spec == TOK
    assert aux["expert_load"].sharding.is_fully_replicated


def overflow_reference(x, params, cfg, shape, B):
    """Per source shard, the dropless sort by expert; rows past B per destination drop."""
    R, W = shape
    El, K, Tl = cfg.num_experts // W, cfg.top_k, T // (R * W)
    pl = ref.plan(x, params.router_de, cfg)
    kept, n_over = [], 0
    for s in range(R * W):
        slots = [(e, t * K + k, t) for t in range(s * Tl, (s + 1) * Tl)
                 for k, e in enumerate(pl["ids"][t])]
        used = np.zeros(W, int)
        for e, _, t in sorted(slots):
            if used[e // El] < B:
                used[e // El] += 1
                kept.append((t, e))
            else:
                n_over += 1
    return dict(pl, kept=sorted(kept)), n_over


def test_small_buffer_overflow_is_counted_not_corrupting():
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    shape, B = (2, 4), 3
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    y, aux = jax.jit(lambda x, p: expert_parallel_moe(x, p, cfg, make_mesh(shape),
                                                      buffer_size=B))(x, params)
    pl, n_over = overflow_reference(x, params, cfg, shape, B)
    assert n_over > 0
    assert int(aux["num_overflow"]) == n_over == int(aux["num_dropped"])
    np.testing.assert_allclose(float(aux["dropped_fraction"]), n_over / (T * cfg.top_k))
    p = {f.name: getattr(params, f.name) for f in dataclasses.fields(params)}
    np.testing.assert_allclose(np.asarray(y), ref.forward(x, p, cfg, pl), atol=2e-5, rtol=2e-5)


@pytest.mark.parametrize("seq_len", [16, 4])  # 8 tokens a shard: sequences straddle or not
def test_jitter_and_sequence_loss_match(seq_len):
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F, router_jitter=0.1,
                    seq_aux_loss_coef=0.1)
    params = make_params(cfg)
    x = jax.random.normal(jax.random.key(1), (T, D))
    key = jax.random.key(7)
    mesh = make_mesh((4, 2), explicit=False)
    y, aux = jax.jit(lambda x: expert_parallel_moe(x, params, cfg, mesh, jitter_rng=key,
                                                   seq_len=seq_len))(x)
    y_ref, aux_ref = moe(x, params, cfg, jitter_rng=key, seq_len=seq_len)
    np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=2e-5)
    for k in ("seq_aux_loss", "loss", "lb_loss"):
        np.testing.assert_allclose(float(aux[k]), float(aux_ref[k]), rtol=1e-5, err_msg=k)


def test_errors_name_the_argument():
    mesh = make_mesh((1, 8))
    x = jnp.zeros((T, D))
    cfg = MoEConfig(num_experts=12, top_k=2, d_model=D, d_ff=F)
    with pytest.raises(ValueError, match="num_experts=12 is not a multiple"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh)
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    with pytest.raises(ValueError, match="T=60 tokens"):
        expert_parallel_moe(x[:60], make_params(cfg), cfg, mesh)
    with pytest.raises(ValueError, match="expert_choice"):
        ec = cfg.replace(router="expert_choice")
        expert_parallel_moe(x, make_params(ec), ec, mesh)
    for impl in ("mosaic_gpu", ["triton", "mosaic_gpu"]):  # its interpreter deadlocks here
        mg = cfg.replace(implementation=impl)
        with pytest.raises(ValueError, match="implementation=.*use implementation='triton'"):
            expert_parallel_moe(x, make_params(mg), mg, mesh)
    with pytest.raises(ValueError, match="exchange='nccl'"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, exchange="nccl")
    with pytest.raises(ValueError, match="needs a mesh"):
        expert_parallel_moe(x, make_params(cfg), cfg)
    with pytest.raises(ValueError, match=rf"x has shape \(2, 32, {D}\).*\[T, D\]"):
        expert_parallel_moe(x.reshape(2, 32, D), make_params(cfg), cfg, mesh)
    with pytest.raises(ValueError, match=rf"x has shape \({T}, {D - 1}\).*d_model={D}"):
        expert_parallel_moe(x[:, 1:], make_params(cfg), cfg, mesh)
    with pytest.raises(ValueError, match="seq_len=5 must be a positive divisor"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, seq_len=5)
    with pytest.raises(ValueError, match="params hold 16 experts"):
        expert_parallel_moe(x, make_params(cfg.replace(num_experts=16)), cfg, mesh)
    with pytest.raises(ValueError, match="token_axes=.*include the expert axes"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, token_axes=("data",))
    with pytest.raises(ValueError, match="buffer_size=True"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, buffer_size=True)
    with pytest.raises(ValueError, match="expert_perm must hold integer"):
        expert_parallel_moe(x, make_params(cfg), cfg, mesh, expert_perm=[0.0, 1, 2, 3, 4, 5, 6, 7])


def test_numpy_int_buffer_size_and_expert_axis_data():
    mesh = make_mesh((2, 4))
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    x, params = jax.random.normal(jax.random.key(2), (T, D)), make_params(cfg)
    y_ref, _ = moe(x, params, cfg)
    for kw in (dict(buffer_size=np.int64(T)), dict(expert_axis="data")):
        y, _ = expert_parallel_moe(x, params, cfg, mesh, **kw)
        np.testing.assert_allclose(np.asarray(y), np.asarray(y_ref), atol=2e-5, rtol=2e-5,
                                   err_msg=str(kw))


def test_eager_calls_compile_once_per_layout():
    """Eager calls (a notebook) with one layout reuse one compilation of the sharded
    layer, held by ``jax.jit``'s cache; a new layout compiles its own. Values stay
    those of the single-device layer."""
    from aristax.parallel.expert_parallel import _sharded_forward

    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F)
    params = make_params(cfg)
    mesh = make_mesh((2, 4), explicit=False)
    before = _sharded_forward._cache_size()
    for seed in (1, 2):
        x = jax.random.normal(jax.random.key(seed), (T, D))
        y, _ = expert_parallel_moe(x, params, cfg, mesh=mesh, expert_axis="expert")
        np.testing.assert_allclose(np.asarray(y), np.asarray(moe(x, params, cfg)[0]),
                                   atol=1e-5, rtol=1e-5)
    assert _sharded_forward._cache_size() == before + 1
    expert_parallel_moe(x, params, cfg.replace(top_k=3), mesh=mesh, expert_axis="expert")
    assert _sharded_forward._cache_size() == before + 2
