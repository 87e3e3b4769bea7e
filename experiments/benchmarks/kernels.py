"""Grouped GEMM and MoE-layer throughput per kernel backend, against the ceiling and peers.

For each shape and load (uniform, or Zipf-skewed group sizes) it times, in one run:
  * ``aristax.pallas_kernels.ragged_dot`` forward and forward+backward for every
    backend that serves the platform (GPU: "mosaic_gpu", "triton", "xla", "reference";
    CPU: "xla" and "reference": the Pallas backends run on CPU only in interpret mode,
    which is a correctness tool, not a speed);
  * ``jax.lax.ragged_dot`` (the peer XLA path);
  * a dense ``jnp.dot`` of the same FLOPs (the hardware ceiling, measured in the same
    run);
  * ``torch._grouped_mm`` on the same GPU, when torch with CUDA is installed;
  * the full ``aristax.moe`` layer, forward+backward, per backend;
  * ``aristax.pallas_kernels.route`` (router GEMM, softmax, top-k, weights, counts
    and the expert order) per backend, against the router GEMM alone (``jnp.dot``,
    the part every router must do) and the reference (XLA).
Every row prints TFLOP/s and its ratios: to the dense matmul and to ``lax.ragged_dot``
(route rows: to the router GEMM and to the reference router).
Targets on H100/H200 (issue 6): grouped GEMM >= 0.85 of dense, MoE layer fwd+bwd
>= 0.70, >= 1.5x ``lax.ragged_dot``. On a machine without a GPU the JSON says
``"gpu": "unmeasured"`` and the CPU shapes are scaled down. A kernel backend that fails
(compiling or running) is listed under ``"failures"`` and the run goes on; the JSON is
rewritten after each shape and token count, so a run cut short keeps what it measured.

Usage: aristax bench kernels [--shapes mixtral,fine]
       [--tokens 4096,16384] [--repeats 5]
       [--out OUT.json (default: results/kernels_<platform>.json beside this script)]
"""

from __future__ import annotations

import argparse
import json
import os
import platform
import time
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np

from aristax import MoEConfig, MoEParams, moe
from aristax.argtypes import positive_int
from aristax.pallas_kernels import frontdoor, ragged_dot, route
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.route import api as route_api

# (E, D, F, K): Mixtral 8x7B and a fine-grained (DeepSeek/Qwen-style) layer.
GPU_SHAPES = {"mixtral": (8, 4096, 14336, 2), "fine": (128, 2048, 768, 8)}
CPU_SHAPES = {"mixtral": (8, 256, 896, 2), "fine": (32, 128, 48, 8)}  # same ratios, CPU-sized


def machine_info() -> dict:
    devices = jax.devices()
    return {"platform": platform.platform(), "python": platform.python_version(),
            "cpu": platform.processor() or platform.machine(), "cpu_count": os.cpu_count(),
            "jax": jax.__version__, "backend": jax.default_backend(),
            "devices": [getattr(d, "device_kind", str(d)) for d in devices],
            "loadavg": os.getloadavg()}


def group_sizes(rows: int, num_groups: int, load: str, seed: int = 0) -> np.ndarray:
    """int32[G] summing to ``rows``: uniform, or Zipf(s=1.2) shares over a random order."""
    if load == "uniform":
        sizes = np.full(num_groups, rows // num_groups)
    else:
        share = 1.0 / np.arange(1, num_groups + 1) ** 1.2
        np.random.default_rng(seed).shuffle(share)
        sizes = np.floor(share / share.sum() * rows).astype(np.int64)
    sizes[0] += rows - sizes.sum()
    return sizes.astype(np.int32)


def median_seconds(fn, *args, repeats: int) -> float:
    jax.block_until_ready(fn(*args))  # compile + warm up
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn(*args))
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


# Backends that failed: {"op", "impl", ..., "error"} each (see ``or_failure``).
FAILURES: list[dict] = []


def or_failure(what: dict, seconds) -> float | None:
    """``seconds()``, or None with the error added to ``FAILURES``: a kernel's first
    compile on a new GPU may fail, and the other rows still count."""
    try:
        return seconds()
    except Exception as err:  # noqa: BLE001 - recorded in the JSON and printed
        message = f"{type(err).__name__}: {err}"
        FAILURES.append({**what, "error": message[:4000]})
        print(f"FAILED {what}: {message[:300]}")
        return None


def available_backends(registry=ragged_dot_api.BACKENDS) -> list[str]:
    """Backends worth timing here: every registered one on GPU; on CPU the plain-XLA
    ones (Pallas runs there only interpreted)."""
    if jax.default_backend() == "cpu":
        return [n for n in registry if n in frontdoor.PLAIN_XLA and n != "reference"] + [
            "reference"]
    return [n for n in registry if n != "reference"] + ["reference"]


def grouped_gemm_rows(E, D, F, K, tokens, load, dtype, repeats) -> list[dict]:
    """ragged_dot [T*K, D] x [E, D, F] per backend, next to lax.ragged_dot and dense."""
    M = tokens * K
    kx, kw, kg = jax.random.split(jax.random.key(0), 3)
    lhs = jax.random.normal(kx, (M, D), dtype)
    rhs = (jax.random.normal(kw, (E, D, F), jnp.float32) * D ** -0.5).astype(dtype)
    sizes = jnp.asarray(group_sizes(M, E, load))
    dout = jax.random.normal(kg, (M, F), dtype)
    flops = 2.0 * M * D * F
    acc = jnp.float32

    def fwd(fn):
        return jax.jit(lambda a, b: fn(a, b))

    def fwd_bwd(fn):
        def f(a, b):
            out, vjp = jax.vjp(fn, a, b)
            return out, vjp(dout.astype(out.dtype))
        return jax.jit(f)

    peers = {
        "dense": lambda a, b: jnp.dot(a, b[0], preferred_element_type=acc),
        "lax.ragged_dot": lambda a, b: jax.lax.ragged_dot(a, b, sizes,
                                                          preferred_element_type=acc),
    }
    ours = {name: (lambda a, b, n=name: ragged_dot(a, b, sizes, preferred_element_type=acc,
                                                   implementation=n))
            for name in available_backends()}
    seconds = {name: {"fwd": median_seconds(fwd(fn), lhs, rhs, repeats=repeats),
                      "fwd_bwd": median_seconds(fwd_bwd(fn), lhs, rhs, repeats=repeats)}
               for name, fn in peers.items()}
    for name, fn in ours.items():
        what = dict(op="ragged_dot", impl=name, E=E, tokens=tokens, load=load)
        seconds[name] = {pass_: or_failure({**what, "pass": pass_}, lambda wrap=wrap, fn=fn:
                                           median_seconds(wrap(fn), lhs, rhs, repeats=repeats))
                         for pass_, wrap in (("fwd", fwd), ("fwd_bwd", fwd_bwd))}
    torch_s = torch_grouped_mm_seconds(lhs, rhs, sizes, repeats)
    if torch_s is not None:
        seconds["torch._grouped_mm"] = {"fwd": torch_s, "fwd_bwd": None}
    rows = []
    for name, s in seconds.items():
        for pass_, factor in (("fwd", 1.0), ("fwd_bwd", 3.0)):
            if s[pass_] is None:
                continue
            rows.append({
                "op": "ragged_dot", "impl": name, "pass": pass_, "E": E, "D": D, "F": F,
                "K": K, "tokens": tokens, "load": load, "dtype": jnp.dtype(dtype).name,
                "seconds": s[pass_], "tflops": factor * flops / s[pass_] / 1e12,
                "vs_dense": seconds["dense"][pass_] / s[pass_],
                "vs_lax_ragged_dot": seconds["lax.ragged_dot"][pass_] / s[pass_],
            })
    return rows


def torch_grouped_mm_seconds(lhs, rhs, sizes, repeats) -> float | None:
    """``torch._grouped_mm`` forward on the same GPU, or None (no torch/CUDA/op)."""
    try:
        import torch
    except ImportError:
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    return or_failure({"op": "ragged_dot", "impl": "torch._grouped_mm"},  # a private op
                      lambda: _torch_grouped_mm_seconds(torch, lhs, rhs, sizes, repeats))


def _torch_grouped_mm_seconds(torch, lhs, rhs, sizes, repeats) -> float:
    a = torch.from_numpy(np.asarray(lhs, np.float32)).to("cuda", torch.bfloat16)
    b = torch.from_numpy(np.asarray(rhs, np.float32)).to("cuda", torch.bfloat16)
    offs = torch.from_numpy(np.cumsum(np.asarray(sizes)).astype(np.int32)).cuda()
    torch._grouped_mm(a, b, offs=offs)
    torch.cuda.synchronize()
    times = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        torch._grouped_mm(a, b, offs=offs)
        torch.cuda.synchronize()
        times.append(time.perf_counter() - t0)
    return float(np.median(times))


def moe_layer_rows(E, D, F, K, tokens, dtype, repeats) -> list[dict]:
    """aristax.moe forward+backward per backend vs a dense MLP of the same FLOPs."""
    cfg = dict(num_experts=E, top_k=K, d_model=D, d_ff=F, dtype=jnp.dtype(dtype).name)
    ks = jax.random.split(jax.random.key(1), 5)
    params = MoEParams(
        router_de=jax.random.normal(ks[0], (D, E)) * 0.02,
        gate_edf=(jax.random.normal(ks[1], (E, D, F)) * D ** -0.5).astype(dtype),
        up_edf=(jax.random.normal(ks[2], (E, D, F)) * D ** -0.5).astype(dtype),
        down_efd=(jax.random.normal(ks[3], (E, F, D)) * F ** -0.5).astype(dtype))
    x = jax.random.normal(ks[4], (tokens, D), dtype)
    flops = 3 * 2.0 * tokens * K * D * F * 3  # 3 GEMMs, forward + 2x backward

    def step(config):
        def loss(p, x):
            y, aux = moe(x, p, config)
            return jnp.sum(y.astype(jnp.float32)) + aux["loss"]
        return jax.jit(jax.grad(loss))

    # the ceiling: the same three GEMMs on T*K rows with one dense expert, fwd + bwd
    w = params.gate_edf[0], params.up_edf[0], params.down_efd[0]
    rows_in = jnp.tile(x, (K, 1))

    def dense_loss(w, a):
        h = jax.nn.silu(a @ w[0]) * (a @ w[1])
        return jnp.sum((h @ w[2]).astype(jnp.float32))

    dense_s = median_seconds(jax.jit(jax.grad(dense_loss)), w, rows_in, repeats=repeats)
    out = []
    with jax.numpy_dtype_promotion("standard"):
        lax_s = median_seconds(step(MoEConfig(**cfg, implementation="reference")), params, x,
                               repeats=repeats)
        for name in available_backends():
            s = lax_s if name == "reference" else or_failure(
                dict(op="moe_layer", impl=name, E=E, tokens=tokens),
                lambda n=name: median_seconds(step(MoEConfig(**cfg, implementation=n)),
                                              params, x, repeats=repeats))
            if s is None:
                continue
            out.append({"op": "moe_layer", "impl": name, "pass": "fwd_bwd", "E": E, "D": D,
                        "F": F, "K": K, "tokens": tokens, "load": "router",
                        "dtype": jnp.dtype(dtype).name, "seconds": s,
                        "tflops": flops / s / 1e12, "vs_dense": dense_s / s,
                        "vs_lax_ragged_dot": lax_s / s})
    return out


def route_rows(E, D, K, tokens, dtype, repeats) -> list[dict]:
    """route (softmax, top-K, normalised weights) per backend vs the router GEMM alone."""
    kx, kw = jax.random.split(jax.random.key(2))
    x = jax.random.normal(kx, (tokens, D), dtype)
    w = (jax.random.normal(kw, (D, E), jnp.float32) * D ** -0.5).astype(dtype)
    flops = 2.0 * tokens * D * E
    gemm_s = median_seconds(jax.jit(lambda x, w: jnp.dot(
        x, w, preferred_element_type=jnp.float32)), x, w, repeats=repeats)
    seconds = {}
    for name in available_backends(route_api.BACKENDS):
        fn = jax.jit(lambda x, w, n=name: route(x, w, top_k=K, normalize=True,
                                                implementation=n, interpret=False))
        seconds[name] = (median_seconds(fn, x, w, repeats=repeats) if name == "reference"
                         else or_failure(dict(op="route", impl=name, E=E, tokens=tokens),
                                         lambda fn=fn: median_seconds(fn, x, w, repeats=repeats)))
    return [{"op": "route", "impl": name, "pass": "fwd", "E": E, "D": D, "K": K,
             "tokens": tokens, "load": "router", "dtype": jnp.dtype(dtype).name,
             "seconds": s, "tflops": flops / s / 1e12, "vs_dense": gemm_s / s,
             "vs_reference": seconds["reference"] / s}
            for name, s in seconds.items() if s is not None]


def main() -> None:
    on_gpu = jax.default_backend() == "gpu"
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default="mixtral,fine")
    parser.add_argument("--tokens", default="4096,16384" if on_gpu else "1024")
    parser.add_argument("--loads", default="uniform,zipf")
    parser.add_argument("--dtype", default="bfloat16" if on_gpu else "float32")
    parser.add_argument("--repeats", type=positive_int, default=10 if on_gpu else 3)
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    table = GPU_SHAPES if on_gpu else CPU_SHAPES
    dtype = jnp.dtype(args.dtype)
    out = Path(args.out or Path(__file__).resolve().parent / "results"
               / f"kernels_{jax.default_backend()}.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    rows = []

    def write(complete: bool) -> None:
        result = {"machine": machine_info(),
                  "shapes": {k: table[k] for k in args.shapes.split(",")},
                  "gpu": "measured" if on_gpu else "unmeasured (no GPU on this machine; CPU "
                  "shapes scaled down; Pallas backends not timed in interpret mode)",
                  "complete": complete, "rows": rows, "failures": FAILURES}
        out.write_text(json.dumps(result, indent=1))

    for shape in args.shapes.split(","):
        E, D, F, K = table[shape]
        for tokens in (int(t) for t in args.tokens.split(",")):
            for load in args.loads.split(","):
                rows += grouped_gemm_rows(E, D, F, K, tokens, load, dtype, args.repeats)
            rows += moe_layer_rows(E, D, F, K, tokens, dtype, args.repeats)
            rows += route_rows(E, D, K, tokens, dtype, args.repeats)
            write(complete=False)
    for r in rows:
        peer = (f"x{r['vs_reference']:.2f} of the reference" if r["op"] == "route" else
                f"x{r['vs_lax_ragged_dot']:.2f} of lax.ragged_dot")
        print(f"{r['op']:10s} {r['impl']:18s} {r['pass']:7s} E{r['E']:<4d} T{r['tokens']:<6d} "
              f"{r['load']:7s} {r['tflops']:8.3f} TFLOP/s  x{r['vs_dense']:.2f} of dense  "
              + peer)
    write(complete=True)
    print(f"wrote {out}" + (f"; {len(FAILURES)} backend(s) failed, listed under 'failures'"
                            if FAILURES else ""))


if __name__ == "__main__":
    main()
