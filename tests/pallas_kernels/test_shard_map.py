"""Every kernel inside ``shard_map`` (the expert-parallel layer's setting), lowered for
CUDA on this CPU machine.

Tokens vary over the mesh axis; the weights are replicated (invariant). Under
``check_vma=True`` (the default, and ``aristax.parallel``'s) a kernel's output type must
say how it varies, and the ``custom_vjp`` must return cotangents of its operands'
types; the front doors cast the operands alike, so the replicated weights' gradients
come back through a psum.

Pallas interpret mode fails JAX 0.10's varying-axes check inside ``shard_map``, and
compiled kernels are what a GPU runs, so this exports the compiled kernels with the
check on. (The expert-parallel layer's numbers on the Triton kernels are checked in
interpret mode, the check off, in tests/parallel/test_expert_parallel.py.)
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import pytest
from jax.sharding import NamedSharding, PartitionSpec as P

from cuda_export import TRITON_CUDA, export_for_cuda, gpu_mesh
from aristax import MoEConfig, MoEParams
from aristax.pallas_kernels import combine, frontdoor, moe_mlp, permute, ragged_dot, route
from aristax.parallel import expert_parallel_moe

CHECKS = {"triton": TRITON_CUDA,
          "mosaic_gpu": []}
N = 8  # devices
T, D, F, E, K = 64, 128, 128, 4, 2  # per device (Mosaic GPU combine: D % 128 == 0)


def _ragged_dot(impl, x, w, order, sizes, gate, up, down):
    return ragged_dot(x, up, sizes[:E], implementation=impl, interpret=False)


def _permute_combine(impl, x, w, order, sizes, gate, up, down):
    rows = permute(x, order, top_k=K, implementation=impl, interpret=False)
    return combine(rows.astype(jnp.float32), order, w, implementation=impl,
                   interpret=False)


def _route(impl, x, w, order, sizes, gate, up, down):
    return route(x, up[:, :, 0].T, top_k=K, implementation=impl, interpret=False).weights


def _moe_mlp(impl, x, w, order, sizes, gate, up, down):
    return moe_mlp(x, order, w, sizes[:E], gate, up, down, activation="swiglu",
                   implementation=impl, interpret=False)


CASES = {  # id: (op, implementation, kernels the exported gradient must contain)
    "ragged_dot-triton": (_ragged_dot, "triton", ("ragged_dot_gmm", "ragged_dot_tgmm")),
    "ragged_dot-mosaic_gpu": (_ragged_dot, "mosaic_gpu", ("mosaic_gpu",)),
    "permute_combine-triton": (_permute_combine, "triton",
                               ("permute_gather", "combine_gather_sum")),
    "permute_combine-mosaic_gpu": (_permute_combine, "mosaic_gpu", ("mosaic_gpu",)),
    "route-triton": (_route, "triton", ("route_topk",)),
    "route-mosaic_gpu": (_route, "mosaic_gpu", ("mosaic_gpu",)),
    "moe_mlp-triton": (_moe_mlp, "triton", ("moe_mlp_gate_up", "ragged_dot_tgmm")),
    "moe_mlp-mosaic_gpu": (_moe_mlp, "mosaic_gpu", ("mosaic_gpu",)),
}


@pytest.mark.parametrize("case", sorted(CASES))
def test_gradient_inside_shard_map_lowers_for_cuda(case):
    op, impl, kernels = CASES[case]
    backend = impl if isinstance(impl, str) else impl[0]
    mesh = gpu_mesh(jax.make_mesh((N,), ("e",), axis_types=(jax.sharding.AxisType.Explicit,),
                                  devices=jax.devices("cpu")[:N]))

    def loss(x, w, order, sizes, gate, up, down):
        def local(*a):
            return jax.lax.psum(jnp.sum(op(impl, *a).astype(jnp.float32) ** 2), "e")

        return jax.shard_map(local, mesh=mesh, out_specs=P(),
                             in_specs=(P("e"),) * 4 + (P(),) * 3)(
            x, w, order, sizes, gate, up, down)

    def struct(shape, dtype, spec):
        return jax.ShapeDtypeStruct(shape, dtype, sharding=NamedSharding(mesh, spec))

    bf16 = jnp.bfloat16
    avals = (struct((N * T, D), bf16, P("e")), struct((N * T, K), jnp.float32, P("e")),
             struct((N * T * K,), jnp.int32, P("e")), struct((N * E,), jnp.int32, P("e")),
             struct((E, D, F), bf16, P()), struct((E, D, F), bf16, P()),
             struct((E, F, D), bf16, P()))
    grad = jax.jit(jax.grad(loss, argnums=(0, 1, 4, 5, 6)))
    text = export_for_cuda(grad, *avals, disabled_checks=CHECKS[backend]).mlir_module()
    for kernel in kernels:
        assert kernel in text, kernel


@pytest.mark.parametrize("expert_perm", [None, (3, 0, 2, 1, 7, 5, 6, 4)])
def test_expert_parallel_layer_lowers_for_cuda_on_the_kernels(expert_perm, monkeypatch):
    """``expert_parallel_moe`` with ``implementation="triton"`` on a 2x4 mesh: the
    gradient of the whole layer lowers for CUDA with the router on the fused route
    kernel (its dropless dispatch when no expert permutation is given, the plain
    dispatch of the physical slots otherwise) and the local experts on the fused
    moe_mlp. Its numbers are checked in interpret mode by
    tests/parallel/test_expert_parallel.py. The layer has no ``interpret`` argument,
    so ``interpret=None`` is made to resolve to compiled, as on a GPU host (where
    ``shard_map`` keeps its varying-axes check)."""
    cfg = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=F, implementation="triton")
    mesh = gpu_mesh(jax.make_mesh((2, 4), ("data", "expert"), devices=jax.devices("cpu")[:8],
                                  axis_types=(jax.sharding.AxisType.Explicit,) * 2))
    f32 = jnp.float32
    params = MoEParams(
        router_de=jax.ShapeDtypeStruct((D, 8), f32),
        up_edf=jax.ShapeDtypeStruct((8, D, F), f32),
        gate_edf=jax.ShapeDtypeStruct((8, D, F), f32),
        down_efd=jax.ShapeDtypeStruct((8, F, D), f32))
    x = jax.ShapeDtypeStruct((N * T, D), f32, sharding=NamedSharding(mesh, P(("data", "expert"))))

    monkeypatch.setattr(frontdoor, "resolve_interpret",
                        lambda interpret: bool(interpret))  # None -> compiled

    def loss(x, p):
        y, aux = expert_parallel_moe(x, p, cfg, mesh, expert_perm=expert_perm,
                                     exchange="ragged")
        return jnp.sum(y ** 2) + aux["loss"]

    checks = CHECKS["triton"] + [jax.export.DisabledSafetyCheck.custom_call("ragged_all_to_all")]
    text = export_for_cuda(jax.jit(jax.grad(loss, argnums=(0, 1))), x, params,
                           disabled_checks=checks).mlir_module()
    for kernel in ("route_topk", "moe_mlp_gate_up", "ragged_all_to_all"):
        assert kernel in text, kernel
