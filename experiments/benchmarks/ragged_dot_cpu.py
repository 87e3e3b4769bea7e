"""The grouped GEMM on XLA:CPU: the forms we considered, against a dense matmul.

``ragged_dot`` [M, K] x [G, K, N] forward and forward + backward (float32), at the
rows the MoE layer's shapes give (M = T*K rows of width D into F, T = 4096), at
router-like group sizes (multinomial, uniform shares) and Zipf(1.2) ones, timed in
interleaved rounds (medians); each form's ratio is to a dense matmul of the routed
rows (the same FLOPs), measured in the same rounds:

* ``jax.lax.ragged_dot`` (XLA:CPU masks lhs into [G, M, K]: G times the work);
* the "xla" backend on rows as given (masked tiles: each group's last tile is
  masked and read-modify-written), for block_m 128 / 256 / 512;
* the "xla" backend on rows laid out as the layer lays them (each group a whole
  multiple of ``align``, zero-padded: ``dispatch.align_groups``): full tiles and
  remainder tiles, unmasked, for (block_m, align) pairs (the ratio is still to the
  dense product of the routed rows, so the padding counts against them);
* a capacity slab: every group in a [G, C, K] slab with C the largest group size
  (read on the host, so no drop), one batched einsum;
* the sort that puts rows in group order (argsort of T*K expert ids), for scale.

Results: ``results/ragged_dot_cpu.json`` beside this script, with the machine.

Usage: python experiments/benchmarks/ragged_dot_cpu.py [--rounds 5] [--out OUT.json]
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

from aristax.argtypes import positive_int
from aristax.pallas_kernels.ragged_dot import api, xla

# (name, M rows = T*K, K = D, N = F, G = E): the MoE layer's gate/up GEMM at T = 4096
SHAPES = [("E8 K2 F1024", 8192, 512, 1024, 8), ("E32 K4 F256", 16384, 512, 256, 32),
          ("E64 K8 F128", 32768, 512, 128, 64)]
MASKED = (128, 256, 512)
ALIGNED = ((512, 64), (256, 32), (128, 32), (256, 256))


def group_sizes(m: int, g: int, load: str, rng) -> np.ndarray:
    if load == "uniform":
        return rng.multinomial(m, np.full(g, 1.0 / g)).astype(np.int32)
    share = rng.permutation(1.0 / np.arange(1, g + 1) ** 1.2)
    return rng.multinomial(m, share / share.sum()).astype(np.int32)


def aligned_layout(lhs: np.ndarray, sizes: np.ndarray, align: int):
    """Each group moved to a multiple of ``align`` and zero-padded to one; the row count
    is the layer's static bound M + G * (align - 1), rounded up."""
    m, g = len(lhs), len(sizes)
    rows = -(-(m + g * (align - 1)) // align) * align
    padded = -(-sizes // align) * align
    out = np.zeros((rows, lhs.shape[1]), lhs.dtype)
    src, dst = np.cumsum(sizes) - sizes, np.cumsum(padded) - padded
    for s, d, n in zip(src, dst, sizes):
        out[d:d + n] = lhs[s:s + n]
    return out, padded.astype(np.int32)


def slab(lhs, rhs, sizes, capacity: int):
    """Rows of each group gathered into [G, C, K] (C from the host), one batched einsum,
    scattered back."""
    m = lhs.shape[0]
    starts = jnp.cumsum(sizes) - sizes
    idx = starts[:, None] + jnp.arange(capacity)[None, :]
    valid = jnp.arange(capacity)[None, :] < sizes[:, None]
    x = jnp.where(valid[..., None], jnp.take(lhs, jnp.minimum(idx, m - 1), axis=0), 0)
    y = jnp.einsum("gck,gkn->gcn", x, rhs)
    return jnp.zeros((m + 1, rhs.shape[2]), y.dtype).at[jnp.where(valid, idx, m)].set(y)[:m]


def fwd_and_fwd_bwd(fn):
    def fwd_bwd(lhs, rhs, sizes):
        out, vjp = jax.vjp(lambda a, b: fn(a, b, sizes), lhs, rhs)
        return vjp(out)
    return jax.jit(fn), jax.jit(fwd_bwd)


def forms(m, k, n, g, sizes, lhs, rhs):
    """{name: (fwd, fwd_bwd, args, rows of work)}."""
    routed = int(sizes.sum())
    out = {}

    def add(name, fn, args, rows):
        out[name] = (*fwd_and_fwd_bwd(fn), args, rows)
    add("dense (routed rows)", lambda a, b, s: a[:routed] @ b[0], (lhs, rhs, sizes), routed)
    add("lax.ragged_dot", lambda a, b, s: jax.lax.ragged_dot(a, b, s), (lhs, rhs, sizes), routed)
    for b in MASKED:
        tiles = xla.XlaTiles(block_m=b, align=8)
        add(f"xla masked b{b}",
            lambda a, w, s, t=tiles: api.ragged_dot(a, w, s, implementation="xla", tiles=t),
            (lhs, rhs, sizes), routed)
    for b, a in ALIGNED:
        lhs_a, sizes_a = aligned_layout(np.asarray(lhs), np.asarray(sizes), a)
        tiles = xla.XlaTiles(block_m=b, align=a)
        add(f"xla aligned b{b} a{a}",
            lambda x, w, s, t=tiles: api.ragged_dot(x, w, s, implementation="xla", tiles=t),
            (jnp.asarray(lhs_a), rhs, jnp.asarray(sizes_a)), routed)
    capacity = int(sizes.max())
    add(f"capacity slab C{capacity}", lambda a, b, s: slab(a, b, s, capacity),
        (lhs, rhs, sizes), routed)
    return out


def bench(name, m, k, n, g, load, rounds) -> dict:
    rng = np.random.default_rng(0)
    sizes = jnp.asarray(group_sizes(m, g, load, rng))
    lhs = jnp.asarray(rng.standard_normal((m, k)), jnp.float32)
    rhs = jnp.asarray(rng.standard_normal((g, k, n)) * k ** -0.5, jnp.float32)
    table = forms(m, k, n, g, sizes, lhs, rhs)
    ids = jnp.asarray(rng.integers(0, g, m), jnp.int32)
    sort = jax.jit(lambda i: jnp.argsort(i, stable=True))
    for fwd, fwd_bwd, args, _ in table.values():
        jax.block_until_ready((fwd(*args), fwd_bwd(*args)))
    jax.block_until_ready(sort(ids))
    times = {(f, p): [] for f in table for p in ("fwd", "fwd_bwd")}
    sort_times = []
    for _ in range(rounds):
        for f, (fwd, fwd_bwd, args, _) in table.items():
            for p, fn in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
                t0 = time.perf_counter()
                jax.block_until_ready(fn(*args))
                times[f, p].append(time.perf_counter() - t0)
        t0 = time.perf_counter()
        jax.block_until_ready(sort(ids))
        sort_times.append(time.perf_counter() - t0)
    row = {"shape": name, "M": m, "K": k, "N": n, "G": g, "load": load,
           "sizes": np.asarray(sizes).tolist(), "forms": {},
           "argsort_ms": 1e3 * float(np.median(sort_times))}
    for f in table:
        row["forms"][f] = {}
        for p in ("fwd", "fwd_bwd"):
            ratio = np.array(times["dense (routed rows)", p]) / np.array(times[f, p])
            row["forms"][f][p] = {"ms": 1e3 * float(np.median(times[f, p])),
                                  "x_dense": float(np.median(ratio))}
    print(f"{name} {load}: argsort {row['argsort_ms']:.1f} ms")
    for f, r in row["forms"].items():
        print(f"   {f:26s} fwd {r['fwd']['ms']:8.1f} ms x{r['fwd']['x_dense']:.2f}   "
              f"fwd+bwd {r['fwd_bwd']['ms']:8.1f} ms x{r['fwd_bwd']['x_dense']:.2f}")
    return row


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--rounds", type=positive_int, default=5)
    parser.add_argument("--loads", default="uniform,zipf")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).resolve().parent / "results" / "ragged_dot_cpu.json")
    out.parent.mkdir(parents=True, exist_ok=True)
    result = {"machine": {"platform": platform.platform(), "processor": platform.processor(),
                          "cpu_count": os.cpu_count(), "jax": jax.__version__},
              "dtype": "float32", "rows": []}
    for shape in SHAPES:
        for load in args.loads.split(","):
            result["rows"].append(bench(*shape, load, args.rounds))
            out.write_text(json.dumps(result, indent=1))
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
