"""Where one MoE layer's forward + backward spends its time, op by op (XLA:CPU).

For each shape (the issue's three by default, float32, T 4096, uniform routing), the
``aristax.MoE`` step of ``moe_layer.py`` (and with ``--unfused`` the layer with its
fused default off) runs under ``jax.profiler.trace``; each executed XLA thunk of the
trace is joined to its instruction in the optimized HLO (dumped by this script) and
put in one class by its name and its JAX op:

* ``gemm``: dots (Eigen ``dot`` or YNNPACK ``ynn_fusion`` of a dot_general);
* ``zero_fill``: broadcasts of a constant (accumulators and loop buffers set to 0);
* ``gather_scatter``: gathers, scatters and scatter-adds (token rows in, results out);
* ``copies``: dynamic slices and updates, copies, concatenates, transposes;
* ``routing``: sorts, top-k and other custom calls;
* ``elementwise``: every other fusion (activation and its gradient, router softmax,
  masks, the aux losses).

Thunk times are summed over the trace's executed thunks (a loop body's once per
trip), as a share of their sum: the time each class holds a thread, not wall time
(the two cores run some thunks side by side). The wall-time median of separate calls
is reported beside it. Eigen's dots (the ones YNNPACK does not take, such as a
contraction over both operands' rows) report less than they run: at E 8 the weight
gradients' [512, 512]^T @ [512, 1024] dots added up to over 800 GFLOP/s, twice the 2
cores' peak, so ``gemm`` is a lower bound.

Wall-time measures beside it, in interleaved rounds with the step(s) and the dense
ceiling (``moe_layer.dense_step``):

* ``gemm``: the fused loop's expert GEMMs per tile (nine; eight, one of them wider,
  where it joins gate's and up's weight gradients) alone, on the tiles its schedule
  cuts for this routing's group sizes, with contiguous rows and nothing else (no
  gather, activation, scatter, saved array or routing). ``non_gemm_share`` = 1 - gemm /
  the step's wall time is what everything but the expert GEMMs costs, on the clock.
* ``routing``: the layer's step with the expert op stubbed out (router, softmax,
  top-K, sort, aux loss and the loss, forward and backward).
* ``movement``: the loop's token gathers and scatter-adds alone, on the same tiles.
* ``floor`` = their sum: what the layer would cost with no overhead beyond the work
  each part has to do, over the dense ceiling (``floor_over_dense``) and its own
  non-GEMM share. Where these exceed 1.25x and 15%, no overhead cut reaches them.

Usage: python experiments/benchmarks/layer_profile.py [--shapes T,D,F,E,K;...]
       [--runs 3] [--rounds 5] [--unfused] [--out OUT.json]
"""

from __future__ import annotations

import os
import tempfile

DUMP = tempfile.mkdtemp(prefix="layer_profile_hlo_")
# Before JAX starts: dump the optimized HLO whose instruction names the trace reports.
os.environ["XLA_FLAGS"] = (os.environ.get("XLA_FLAGS", "") +
                           f" --xla_dump_to={DUMP} --xla_dump_hlo_as_text").strip()

import argparse  # noqa: E402
import collections  # noqa: E402
import contextlib  # noqa: E402
import glob  # noqa: E402
import gzip  # noqa: E402
import importlib  # noqa: E402
import json  # noqa: E402
import re  # noqa: E402
import shutil  # noqa: E402
import sys  # noqa: E402
from pathlib import Path  # noqa: E402

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402
import numpy as np  # noqa: E402
from jax import lax  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
import moe_layer  # noqa: E402

from aristax.argtypes import positive_int  # noqa: E402
from aristax.pallas_kernels.moe_mlp import xla as moe_mlp_xla  # noqa: E402

SKIP = ("$", "PjitFunction", "ThunkExecutor", "CommonPjRt", "ExecuteReplicated",
        "SlinkyThreadPool", "cond", "while", "call")  # wrappers: their children count
CLASSES = ("gemm", "zero_fill", "gather_scatter", "copies", "routing", "elementwise")


def hlo_ops(files: set[str]) -> dict[str, tuple[str, str]]:
    """{instruction name: (opcode, JAX op_name)} of the largest optimized module among
    the dumped ``files`` (the step's)."""
    modules = [f for f in files if f.endswith(".cpu_after_optimizations.txt")]
    text = Path(max(modules, key=os.path.getsize)).read_text()
    ops = {}
    for m in re.finditer(r'^\s*(?:ROOT )?%?([\w.\-]+) = \S+ (\w[\w-]*)\(.*?'
                         r'metadata=\{op_name="([^"]+)"', text, re.M):
        ops[m.group(1)] = (m.group(2), m.group(3))
    return ops


def classify(name: str, op: tuple[str, str]) -> str:
    """One of CLASSES for thunk ``name`` and its (opcode, op_name)."""
    opcode, op_name = op
    last = op_name.rsplit("/", 1)[-1]
    if (name.startswith(("dot", "ynn_fusion")) or opcode == "dot") and last == "dot_general":
        return "gemm"
    if name.startswith("wrapped_broadcast") or last == "broadcast_in_dim" and "fusion" not in name:
        return "zero_fill"
    if re.search(r"gather|scatter", name) or last in ("gather", "scatter-add", "scatter"):
        return "gather_scatter"
    if re.search(r"dynamic[-_]slice|dynamic[-_]update|copy|concatenate|transpose", name):
        return "copies"
    if name.startswith(("sort", "custom-call")) or last in ("sort", "top_k"):
        return "routing"
    return "elementwise"


def profile(step, runs: int, trace_dir: str) -> list[dict]:
    """The trace's thunk events of ``runs`` calls of ``step`` (compiled before)."""
    with jax.profiler.trace(trace_dir):
        for _ in range(runs):
            jax.block_until_ready(step())
    path = glob.glob(f"{trace_dir}/**/*.trace.json.gz", recursive=True)[0]
    events = json.load(gzip.open(path))["traceEvents"]
    return [e for e in events if e.get("ph") == "X" and not e["name"].startswith(SKIP)]


def top_k_routing(w, K: int):
    """(top-K experts int[T, K] of ``w``'s router logits, group sizes int32[E], the fused
    loop's tiles for them, M = T*K): the routing the floor steps run their tiles for."""
    (D, E), F = w["router"].shape, w["gate"].shape[2]
    M = w["x"].shape[0] * K
    top = np.argsort(-(w["x"] @ w["router"]), axis=1, kind="stable")[:, :K]
    sizes = jnp.asarray(np.bincount(top.ravel(), minlength=E), jnp.int32)
    return top, sizes, moe_mlp_xla._tiles_for(None, M, D, F, E), M


def gemm_floor_step(w, K: int):
    """The fused loop's expert GEMMs alone (module docstring) for the top-K routing of
    ``w`` (``moe_layer.weights``): per tile of s rows of expert e, with r, dy
    [s, D] contiguous rows,
      forward   g = r @ gate[e], u = r @ up[e], o = g @ down[e]
      backward  gh = dy @ down[e]^T, ddown[e] += g^T @ dy,
                dr = gh @ gate[e]^T + u @ up[e]^T, dgate[e] += r^T @ gh, dup[e] += r^T @ u
    (g, u and gh stand in for h and the pre-activations' gradients: same shapes; the
    last two as one r^T @ [gh | u] where the loop joins them, F <= JOINED_WGRAD_MAX_F)."""
    (D, E), F = w["router"].shape, w["gate"].shape[2]
    _, sizes, tiles, M = top_k_routing(w, K)
    P = moe_mlp_xla.padded_rows(M, E, tiles) + tiles.block_m
    rng = np.random.default_rng(2)
    rows, dy = (jnp.asarray(rng.standard_normal((P, D)), jnp.float32) for _ in range(2))
    mats = tuple(jnp.asarray(w[k]) for k in ("gate", "up", "down"))
    dot = lambda a, b, c: lax.dot_general(a, b, ((c[:1], c[1:]), ((), ())))  # noqa: E731
    joined = F <= moe_mlp_xla.JOINED_WGRAD_MAX_F

    @jax.jit
    def step(sizes, rows, dy, mats):
        sched = moe_mlp_xla.schedules(sizes, M, tiles)

        def group(i, total):
            e = sched.order[i]
            gate, up, down = (lax.dynamic_index_in_dim(m, e, keepdims=False) for m in mats)

            def tile(lo, size, carry):
                out, grads = carry
                r, d = (lax.dynamic_slice_in_dim(a, lo, size) for a in (rows, dy))
                g, u = dot(r, gate, (1, 0)), dot(r, up, (1, 0))
                gh = dot(d, down, (1, 1))
                dr = dot(gh, gate, (1, 1)) + dot(u, up, (1, 1))
                out = out + jnp.sum(dot(g, down, (1, 0))) + jnp.sum(dr)
                if joined:  # the loop's one [D, 2F] product (its JOINED_WGRAD_MAX_F)
                    wgrads = (dot(g, d, (0, 0)), dot(r, jnp.concatenate([gh, u], 1), (0, 0)))
                else:
                    wgrads = (dot(g, d, (0, 0)), dot(r, gh, (0, 0)), dot(r, u, (0, 0)))
                grads = tuple(a + b for a, b in zip(grads, wgrads))
                return out, grads
            zero = (jnp.zeros((F, D)),) + (((jnp.zeros((D, 2 * F)),) if joined else
                                            (jnp.zeros((D, F)), jnp.zeros((D, F)))))
            out, grads = moe_mlp_xla._group_tiles_run(sched, tiles, e, tile,
                                                      (jnp.zeros(()), zero))
            return total + out + sum(jnp.sum(a) for a in grads)
        return lax.fori_loop(0, sched.count, group, jnp.zeros(()))
    return lambda: step(sizes, rows, dy, mats)


def routing_step(w, K: int):
    """The layer's step (``moe_layer.aristax_step``) with the expert op stubbed out: y =
    x * (the sum of each token's routing weights), one elementwise pass instead of the
    fused loop, so router, softmax, top-K, sort, aux loss and the loss (forward and
    backward) remain: what the layer costs around its experts."""
    moe = importlib.import_module("aristax.moe")

    def stub(x, sort_order, weights, group_sizes, *args, **kwargs):
        return x * jnp.sum(weights, axis=1, keepdims=True).astype(x.dtype)

    @contextlib.contextmanager
    def stubbed():
        real, moe.moe_mlp = moe.moe_mlp, stub
        try:
            yield
        finally:
            moe.moe_mlp = real
    return moe_layer.aristax_step(w, K, traced_in=stubbed)


def movement_step(w, K: int):
    """The fused loop's token movement alone, on its tiles for the top-K routing of ``w``:
    per tile of s rows, forward x rows gathered and y[tok] += w * rows; backward x and dy
    rows gathered and dx[tok] += rows (the GEMMs, activation and routing left out)."""
    T = w["x"].shape[0]
    top, sizes, tiles, M = top_k_routing(w, K)
    order = jnp.asarray(np.argsort(top.ravel(), kind="stable"), jnp.int32)
    x, dy = (jnp.asarray(w["x"] + i) for i in range(2))
    weights = jnp.ones((T, K), jnp.float32)

    @jax.jit
    def step(sizes, order, x, dy, weights):
        sched = moe_mlp_xla.schedules(sizes, M, tiles)
        padded = jnp.pad(order, (0, tiles.block_m))

        def group(i, carry):
            g = sched.order[i]

            def tile(lo, size, carry):
                y, dx = carry
                ids, tok = moe_mlp_xla._rows_of_tile(sched, g, lo, size, padded, M, K, T)
                take = lambda a: jnp.take(a, tok, axis=0, mode="fill", fill_value=0)  # noqa: E731
                wt = jnp.take(weights.reshape(-1), ids, mode="fill", fill_value=0)[:, None]
                y = y.at[tok].add(wt * take(x), mode="drop")
                return y, dx.at[tok].add(take(x) + take(dy), mode="drop")
            return moe_mlp_xla._group_tiles_run(sched, tiles, g, tile, carry)
        return lax.fori_loop(0, sched.count, group, (jnp.zeros_like(x), jnp.zeros_like(x)))
    return lambda: step(sizes, order, x, dy, weights)


def floors(w, K: int, layers: dict, rounds: int) -> dict:
    """Median wall times (ms) over interleaved rounds (``moe_layer.interleaved``; this
    VM's speed drifts by 10-25% within minutes) of the GEMM floor, the routing and the
    token movement measured alone, the dense ceiling (``moe_layer.dense_step``) and the
    ``layers`` steps; ``floor``: the first three's sum (the layer with zero overhead
    beyond them), ``floor_over_dense`` and the floor's non-GEMM share (1 - gemm / floor)."""
    steps = {"gemm": gemm_floor_step(w, K), "routing": routing_step(w, K),
             "movement": movement_step(w, K), "dense": moe_layer.dense_step(w, K), **layers}
    out = {name: 1e3 * float(np.median(t))
           for name, t in moe_layer.interleaved(steps, rounds).items()}
    out["floor"] = out["gemm"] + out["routing"] + out["movement"]
    out["floor_over_dense"] = out["floor"] / out["dense"]
    out["floor_non_gemm_share"] = 1 - out["gemm"] / out["floor"]
    return out


def row(label: str, make_step, runs: int) -> tuple[dict, object]:
    """The profile of the step ``make_step()`` returns (its HLO: the files it dumps), and
    the step."""
    before = set(glob.glob(f"{DUMP}/*"))
    step = make_step()
    jax.block_until_ready(step())  # compiled by now (here, or ahead of time)
    dumped = set(glob.glob(f"{DUMP}/*")) - before
    trace_dir = tempfile.mkdtemp(prefix="layer_profile_trace_")
    try:
        events = profile(step, runs, trace_dir)
    finally:
        shutil.rmtree(trace_dir, ignore_errors=True)
    ops = hlo_ops(dumped)
    by_class, by_op = collections.Counter(), collections.Counter()
    for e in events:
        op = ops.get(e["name"], ("", ""))
        by_class[classify(e["name"], op)] += e["dur"] / runs / 1e3
        by_op[(e["name"], op[1])] += e["dur"] / runs / 1e3
    total = sum(by_class.values())
    out = {"step": label, "thunk_ms": total,
           "class_ms": {c: by_class[c] for c in CLASSES},
           "class_share": {c: by_class[c] / total for c in CLASSES},
           "top_ops": [{"thunk": n, "op": o, "ms": ms} for (n, o), ms in by_op.most_common(12)]}
    print(f"  {label:8s} thunks {total:6.1f} ms  " + "  ".join(
        f"{c} {100 * s:4.1f}%" for c, s in out["class_share"].items()))
    return out, step


def main() -> None:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--shapes", default=moe_layer.SHAPES, help="T,D,F,E,K;...")
    parser.add_argument("--runs", type=positive_int, default=3, help="profiled calls per step")
    parser.add_argument("--rounds", type=positive_int, default=5, help="interleaved timing rounds")
    parser.add_argument("--unfused", action="store_true", help="profile the unfused layer too")
    parser.add_argument("--out", default=None)
    args = parser.parse_args()
    out = Path(args.out or Path(__file__).resolve().parent / "results"
               / f"layer_profile_{jax.default_backend()}.json")
    result = {"machine": moe_layer.machine(), "dtype": "float32", "rows": []}
    for shape in args.shapes.split(";"):
        T, D, F, E, K = (int(v) for v in shape.split(","))
        print(f"T{T} D{D} F{F} E{E} K{K} uniform")
        w = moe_layer.weights(T, D, F, E, "uniform")
        steps = [("fused", lambda: moe_layer.aristax_step(w, K))]
        if args.unfused:
            steps.append(("unfused", lambda: moe_layer.aristax_step(
                w, K, traced_in=moe_layer.unfused_default)))
        profiled = [row(label, make, args.runs) for label, make in steps]
        rows = [r for r, _ in profiled]
        parts = floors(w, K, {r["step"]: step for r, step in profiled}, args.rounds)
        for r in rows:
            r["wall_ms"] = parts.pop(r["step"])
            r["non_gemm_share"] = 1 - parts["gemm"] / r["wall_ms"]
            r["over_dense"] = r["wall_ms"] / parts["dense"]
        print(f"  gemm floor {parts['gemm']:6.1f} ms: everything else is " + ", ".join(
            f"{100 * r['non_gemm_share']:.0f}% of {r['step']}" for r in rows))
        print(f"  gemm + routing {parts['routing']:.1f} + movement {parts['movement']:.1f} ms"
              f" = {parts['floor']:.1f} ms: {parts['floor_over_dense']:.2f}x dense "
              f"({parts['dense']:.1f} ms), non-GEMM {100 * parts['floor_non_gemm_share']:.0f}%;"
              " the layer " + ", ".join(
                  f"{r['wall_ms']:.1f} ms, {r['over_dense']:.2f}x ({r['step']})" for r in rows))
        result["rows"].append({"shape": dict(T=T, D=D, F=F, E=E, K=K),
                               "gemm_floor_ms": parts["gemm"], "floors_ms": parts,
                               "steps": rows})
        out.write_text(json.dumps(result, indent=1))
    shutil.rmtree(DUMP, ignore_errors=True)
    print(f"wrote {out}")


if __name__ == "__main__":
    main()
