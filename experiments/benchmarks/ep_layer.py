"""Expert-parallel MoE layer per exchange backend vs the single-device layer, to JSON.

Times one jitted forward and one jitted forward+backward of
``aristax.parallel.expert_parallel_moe`` on host CPU devices (forced with
``--xla_force_host_platform_device_count``) for each runnable exchange backend
("ragged" needs GPU/TPU: it is timed only where the platform runs it), and the same
steps of ``aristax.moe.moe`` on one device. On a CPU host the "devices" share the same
cores, so the numbers measure overhead (exchange, padding), not speed-up.

Usage: PYTHONPATH=. python experiments/benchmarks/ep_layer.py [--devices 8] [--tokens 4096]
       [--out experiments/benchmarks/results/ep_layer.json]
"""

from __future__ import annotations

import argparse
import os
import sys

_args = argparse.ArgumentParser(description=__doc__.splitlines()[0])
_args.add_argument("--devices", type=int, default=8)
_args.add_argument("--mesh", default="2x4", help="data x expert, e.g. 1x8, 2x4, 4x2")
_args.add_argument("--tokens", type=int, default=4096)
_args.add_argument("--d-model", type=int, default=256)
_args.add_argument("--d-ff", type=int, default=512)
_args.add_argument("--experts", type=int, default=16)
_args.add_argument("--top-k", type=int, default=2)
_args.add_argument("--capacity-factor", type=float, default=None)
_args.add_argument("--repeats", type=int, default=5)
_args.add_argument("--out", default="experiments/benchmarks/results/ep_layer.json")
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
from aristax.parallel import EXCHANGE_BACKENDS, expert_parallel_moe  # noqa: E402


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


def main() -> None:
    cfg = MoEConfig(num_experts=ARGS.experts, top_k=ARGS.top_k, d_model=ARGS.d_model,
                    d_ff=ARGS.d_ff, capacity_factor=ARGS.capacity_factor)
    ks = jax.random.split(jax.random.key(0), 5)
    E, D, F = cfg.num_experts, cfg.d_model, cfg.d_ff
    params = MoEParams(router_de=jax.random.normal(ks[0], (D, E)) * D ** -0.5,
                       up_edf=jax.random.normal(ks[1], (E, D, F)) * D ** -0.5,
                       gate_edf=jax.random.normal(ks[2], (E, D, F)) * D ** -0.5,
                       down_efd=jax.random.normal(ks[3], (E, F, D)) * F ** -0.5)
    x = jax.random.normal(ks[4], (ARGS.tokens, D))
    shape = tuple(int(v) for v in ARGS.mesh.split("x"))
    mesh = jax.make_mesh(shape, ("data", "expert"))
    result = {"machine": machine_info(), "args": vars(ARGS), "results": {}}
    result["results"]["single_device"] = steps(lambda x, p: moe(x, p, cfg), x, params)
    runnable = [b for b in EXCHANGE_BACKENDS if b != "ragged" or jax.default_backend() != "cpu"]
    for backend in runnable:
        fwd = lambda x, p, b=backend: expert_parallel_moe(x, p, cfg, mesh, backend=b)  # noqa: E731
        result["results"][f"ep_{backend}"] = steps(fwd, x, params)
        print(backend, {k: round(v["median_s"] * 1e3, 2)
                        for k, v in result["results"][f"ep_{backend}"].items()}, "ms",
              file=sys.stderr)
    result["machine"]["loadavg_at_end"] = os.getloadavg()
    Path(ARGS.out).parent.mkdir(parents=True, exist_ok=True)
    Path(ARGS.out).write_text(json.dumps(result, indent=2))
    print(json.dumps({k: {s: round(v[s]["median_s"] * 1e3, 2) for s in v}
                      for k, v in result["results"].items()}, indent=1))


if __name__ == "__main__":
    main()
