"""Expert-parallel MoE layer per exchange and chunk count vs single-device peers.

Times one jitted forward and one jitted forward+backward of
``aristax.parallel.expert_parallel_moe`` on host CPU devices (forced with
``--xla_force_host_platform_device_count``) for each exchange ("padded",
"scheduled" (ppermute rounds), "hierarchical" (Tutel 2DH over a ("data", "node",
"local") mesh), "ragged" where the platform runs it) and each Lancet chunk count
(``num_chunks``), next to two single-device peers on the same batch:
  * ``aristax.moe.moe`` (sorted dropless/capacity dispatch + grouped GEMM), and
  * a GShard-style dense dispatch (Lepikhin et al. 2020, Algorithm 2): one-hot
    dispatch and combine tensors [T, E, C] and einsums, position-priority capacity
    C = ceil(cf * T * K / E) (``--dense-capacity-factor``). It is checked against
    ``aristax.moe.moe`` with the same capacity before it is timed.
Every row prints its ratio to both peers. On a CPU host the "devices" share the same
cores, so the numbers measure overhead (exchange, padding, chunking), not speed-up.

Usage: aristax bench ep_layer [--devices 8] [--tokens 4096]
       [--chunks 1,2,3,4] [--exchanges padded,scheduled,hierarchical]
       [--out OUT.json (default: results/ep_layer.json beside this script)]
"""

from __future__ import annotations

import argparse
import os
import sys

from aristax.argtypes import mesh_shape, positive_float, positive_int, positive_ints

_args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_args.add_argument("--devices", type=positive_int, default=8)
_args.add_argument("--mesh", type=mesh_shape, default="2x4", help="data x expert, e.g. 1x8, 2x4, 4x2")
_args.add_argument("--nodes", type=positive_int, default=2,
                   help="'hierarchical': the expert axis W split as nodes x W/nodes")
_args.add_argument("--chunks", type=positive_ints, default="1,2,3,4", help="num_chunks values to time")
_args.add_argument("--exchanges", default="padded,scheduled,hierarchical,ragged",
                   help="exchanges, the all-to-all strategies ('ragged' is skipped on CPU)")
_args.add_argument("--dense-capacity-factor", type=positive_float, default=1.25,
                   help="capacity factor of the GShard dense-dispatch peer")
_args.add_argument("--tokens", type=positive_int, default=4096)
_args.add_argument("--d-model", type=positive_int, default=256)
_args.add_argument("--d-ff", type=positive_int, default=512)
_args.add_argument("--experts", type=positive_int, default=16)
_args.add_argument("--top-k", type=positive_int, default=2)
_args.add_argument("--capacity-factor", type=positive_float, default=None)
_args.add_argument("--repeats", type=positive_int, default=5)
_args.add_argument("--out", default=os.path.join(os.path.dirname(os.path.abspath(__file__)),
                                                 "results", "ep_layer.json"))
ARGS = _args.parse_args()
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "")
                           + f" --xla_force_host_platform_device_count={ARGS.devices}").strip()

import json  # noqa: E402
import platform  # noqa: E402
import time  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402

from aristax import MoEConfig, MoEParams, moe  # noqa: E402
from aristax import routing as routing_lib  # noqa: E402
from aristax.parallel import EXCHANGES, expert_parallel_moe  # noqa: E402


def machine_info() -> dict:
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [str(d) for d in jax.devices()], "loadavg": os.getloadavg()}


def timed(fn, *args) -> dict:
    """Compile time and the median of ``ARGS.repeats`` steady-state calls (seconds)."""
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    compile_s = time.perf_counter() - t0
    runs = []
    for _ in range(ARGS.repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        runs.append(time.perf_counter() - t0)
    return {"compile_s": compile_s, "median_s": float(np.median(runs)), "runs_s": runs}


def steps(forward, x, params):
    def loss(x, p):
        y, aux = forward(x, p)
        return jnp.sum(y * y) + aux["loss"]
    return {"forward": timed(jax.jit(forward), x, params),
            "forward_backward": timed(jax.jit(jax.grad(loss, argnums=(0, 1))), x, params)}


def gshard_dense(x, params: MoEParams, cfg: MoEConfig):
    """GShard dense dispatch (Lepikhin et al. 2020, Alg. 2) on one device, swiglu experts.

    Routing from ``aristax.routing.route`` (same router); "position" priority (all
    top-1 choices in token order, then all top-2, ...); dispatch/combine [T, E, C].
    Returns (y[T, D], {"loss": lb_loss * coef}) like the other peers.
    """
    T = x.shape[0]
    E, K, C = cfg.num_experts, cfg.top_k, cfg.capacity(T)
    r = routing_lib.route(x @ params.router_de, cfg.router_config)
    onehot = jax.nn.one_hot(r.expert_ids, E, dtype=x.dtype) * r.mask[..., None]  # [T, K, E]
    by_rank = onehot.transpose(1, 0, 2).reshape(K * T, E)
    place = (jnp.cumsum(by_rank, axis=0) - by_rank).reshape(K, T, E).transpose(1, 0, 2)
    keep = onehot * (place < C)
    slot = jax.nn.one_hot(jnp.sum(place * keep, axis=-1).astype(jnp.int32), C,
                          dtype=x.dtype)  # [T, K, C]
    dispatch = jnp.einsum("tke,tkc->tec", keep, slot)
    combine = jnp.einsum("tke,tkc,tk->tec", keep, slot, r.weights.astype(x.dtype))
    xe = jnp.einsum("tec,td->ecd", dispatch, x)
    h = jax.nn.silu(jnp.einsum("ecd,edf->ecf", xe, params.gate_edf)) * jnp.einsum(
        "ecd,edf->ecf", xe, params.up_edf)
    y = jnp.einsum("tec,ecd->td", combine, jnp.einsum("ecf,efd->ecd", h, params.down_efd))
    return y, {"loss": cfg.lb_loss_coef * routing_lib.load_balancing_loss(r)}


def hier_mesh(shape):
    R, W = shape
    if W % ARGS.nodes:
        raise SystemExit(f"--nodes={ARGS.nodes} does not divide the expert axis W={W}")
    return jax.make_mesh((R, ARGS.nodes, W // ARGS.nodes), ("data", "node", "local"))


def ratio_table(results: dict) -> str:
    base, dense = results["single_device"], results["gshard_dense"]
    lines = [f"{'config':<28}{'fwd ms':>9}{'f+b ms':>9}{'fwd/moe':>9}{'f+b/moe':>9}"
             f"{'fwd/dense':>10}{'f+b/dense':>10}"]
    for name, v in results.items():
        f, fb = v["forward"]["median_s"], v["forward_backward"]["median_s"]
        lines.append(f"{name:<28}{f * 1e3:>9.2f}{fb * 1e3:>9.2f}"
                     f"{f / base['forward']['median_s']:>9.2f}"
                     f"{fb / base['forward_backward']['median_s']:>9.2f}"
                     f"{f / dense['forward']['median_s']:>10.2f}"
                     f"{fb / dense['forward_backward']['median_s']:>10.2f}")
    return "\n".join(lines)


def main() -> None:
    unknown = set(ARGS.exchanges.split(",")) - set(EXCHANGES)
    if unknown:
        _args.error(f"--exchanges: {sorted(unknown)} are not exchanges; choose from "
                    f"{','.join(EXCHANGES)}")
    if len(ARGS.mesh) != 2 or ARGS.mesh[0] * ARGS.mesh[1] != ARGS.devices:
        _args.error(f"--mesh {'x'.join(map(str, ARGS.mesh))}: give data x expert sizes whose "
                    f"product is --devices {ARGS.devices}, e.g. 2x{ARGS.devices // 2}")
    if "hierarchical" in ARGS.exchanges.split(",") and ARGS.mesh[1] % ARGS.nodes:
        _args.error(f"--nodes {ARGS.nodes} must divide the expert axis ({ARGS.mesh[1]}) for "
                    f"the hierarchical exchange")
    cfg = MoEConfig(num_experts=ARGS.experts, top_k=ARGS.top_k, d_model=ARGS.d_model,
                    d_ff=ARGS.d_ff, capacity_factor=ARGS.capacity_factor)
    dense_cfg = cfg.replace(capacity_factor=ARGS.dense_capacity_factor)
    ks = jax.random.split(jax.random.key(0), 5)
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    params = MoEParams(router_de=jax.random.normal(ks[0], (D, E)) * D ** -0.5,
                       up_edf=jax.random.normal(ks[1], (E, D, F)) * D ** -0.5,
                       gate_edf=jax.random.normal(ks[2], (E, D, F)) * D ** -0.5,
                       down_efd=jax.random.normal(ks[3], (E, F, D)) * F ** -0.5)
    x = jax.random.normal(ks[4], (ARGS.tokens, D))
    shape = ARGS.mesh
    mesh = jax.make_mesh(shape, ("data", "expert"))
    chunks = ARGS.chunks
    exchanges = [e for e in ARGS.exchanges.split(",")
                 if e != "ragged" or jax.default_backend() != "cpu"]  # XLA:CPU has none
    note = (f"{len(jax.devices())} {jax.default_backend()} devices share "
            f"{os.cpu_count()} CPU cores of one host (forced host platform devices): EP "
            "numbers measure exchange/padding/chunking overhead, not speed-up; "
            "the machine may be shared (loadavg recorded). The gshard_dense peer always "
            f"runs with capacity_factor={ARGS.dense_capacity_factor} (it needs a capacity); "
            f"moe and EP rows use capacity_factor={ARGS.capacity_factor} (None = dropless).")
    result = {"machine": machine_info(), "note": note, "args": vars(ARGS), "results": {}}
    # the dense peer computes moe() with capacity: check before timing
    y_dense = jax.jit(lambda x, p: gshard_dense(x, p, dense_cfg)[0])(x, params)
    y_moe = jax.jit(lambda x, p: moe(x, p, dense_cfg)[0])(x, params)
    err = float(jnp.max(jnp.abs(y_dense - y_moe)))
    result["gshard_dense_check"] = {"max_abs_diff_vs_moe": err,
                                    "capacity_factor": ARGS.dense_capacity_factor}
    print(f"gshard_dense vs moe(capacity_factor={ARGS.dense_capacity_factor}): "
          f"max |diff| = {err:.2e}", file=sys.stderr)
    assert err < 1e-3, err
    res = result["results"]
    res["single_device"] = steps(lambda x, p: moe(x, p, cfg), x, params)
    res["gshard_dense"] = steps(lambda x, p: gshard_dense(x, p, dense_cfg), x, params)
    for exchange in exchanges:
        m, ax = (hier_mesh(shape), ("node", "local")) if exchange == "hierarchical" else (
            mesh, "expert")
        for k in chunks:
            fwd = lambda x, p, e=exchange, m=m, ax=ax, k=k: expert_parallel_moe(  # noqa: E731
                x, p, cfg, m, exchange=e, expert_axis=ax, num_chunks=k)
            name = f"ep_{exchange}_k{k}"
            res[name] = steps(fwd, x, params)
            print(name, {s: round(v["median_s"] * 1e3, 2) for s, v in res[name].items()},
                  "ms", file=sys.stderr)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(json.dumps(result, indent=2))
    print(note)
    print(ratio_table(res))


if __name__ == "__main__":
    main()
