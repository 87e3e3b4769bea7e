"""Every kernel on one GPU in one call: outputs, gradients and timings against references.

For each case (shape x dtype x matmul precision) and each op -- ``ragged_dot``,
``moe_mlp``, the whole ``aristax.moe`` layer, ``route``, ``permute``, ``combine`` --
and each backend (every registered one; the layer per ``implementation``), one
compiled function computes the outputs and their ``jax.vjp`` gradients for a random
cotangent. Each is compared with a reference in float32 at HIGHEST precision on the
same (upcast) inputs by relative Frobenius error, with METHOD's tolerances:

  bfloat16 operands 1e-2; float32 under JAX's default precision (TF32 on an NVIDIA
  GPU) 2e-3; float32 at "highest" 1e-4. NaN never passes; integer outputs (expert
  ids, counts, expert order) must be equal.

References: ``ragged_dot`` and ``moe_mlp`` against a brute force written here (a scan
over the groups, each a dense product of its own rows), independent of every backend
and of ``jax.lax.ragged_dot`` (which runs as the "reference" backend and is checked
too); ``route``, ``permute``, ``combine`` and the layer against their "reference"
backend (plain jnp/lax). Inputs are random normal (never zero), group sizes hard:
empty groups, one heavy group, trailing rows past ``sum(group_sizes)``; routed rows
with tokens routed nowhere. Before each run the free device memory is poisoned with
NaN (XLA allocates the outputs itself, from what was just freed), so rows a kernel
never writes show up as NaN.

Timed cases (the Mixtral and fine-grained shapes) also time each function: host clock
around back-to-back dispatches synchronised at the end, after a warm-up, median of the
repeats (``seconds``; the kernels here run for 0.1 to 10 ms, far above the dispatch
cost, so this is the device time; ``torch._grouped_mm`` is timed with CUDA events).
Rows put each kernel against a dense matmul of equal FLOPs (the ceiling, measured in
the same run), ``jax.lax.ragged_dot`` and ``torch._grouped_mm`` (when torch with CUDA
imports), at uniform and Zipf-skewed group sizes. At the two timed shapes the Mosaic GPU
grouped GEMM also runs with other tiles (``TILE_VARIANTS``: one warpgroup per output
tile instead of the warp-specialized default, bands of 8 column tiles, tgmm steps of
128 rows, tgmm warp-specialized, row tiles of 64), as backends "mosaic_gpu.<variant>".

A step that fails is recorded with its error and the run goes on; the JSON is
rewritten after each step. A worker process runs the steps; where it dies (a kernel
that faults the GPU) or a step outlives ``--step-timeout-s`` (a kernel that hangs),
the parent records that step and starts another worker after it. The plan is ordered
by value: steps past ``--budget-s`` (7 minutes by default, so that a 15-minute lease
holds the machine's start and a rerun) are recorded as skipped, and ``--only REGEX``
runs the steps whose ids match (to finish a plan in a later lease).
``--dry-run`` takes the same path on the CPU at tiny shapes (Pallas interpret mode),
so the script cannot rot between GPU sessions (``tests/test_gpu_check.py``).

The device machine starts bare: where aristax is not installed, the script imports it
from this source tree (``import_source_tree``); everything else it needs (jax, flax,
optax, rich, pyyaml; torch optional) is in the device image.

Usage: python experiments/benchmarks/gpu_check.py [--dry-run] [--budget-s 420]
       [--step-timeout-s 180] [--only REGEX] [--repeats 10]
       [--out OUT.json (default: results/gpu_check_gpu.json beside this script;
        gpu_check_dry_run.json with --dry-run)]
"""

from __future__ import annotations

import argparse
import dataclasses
import importlib
import importlib.util
import json
import os
import platform
import re
import subprocess
import sys
import time
import traceback
import zlib
from collections.abc import Callable
from pathlib import Path

import numpy as np

ROOT = Path(__file__).resolve().parents[2]


def import_source_tree() -> str:
    """Make ``import aristax`` work: the installed package, else this checkout.

    The checkout maps ``aristax`` to aristax/ and ``aristax.pallas_kernels``,
    ``aristax.parallel`` to the top-level folders (pyproject's package-dir), so the
    package's search path is [aristax/, the checkout's root]. Returns where it came
    from."""
    try:
        importlib.import_module("aristax.pallas_kernels")
        return "installed: " + str(Path(sys.modules["aristax"].__file__).parent)
    except ImportError:
        pass
    spec = importlib.util.spec_from_file_location(
        "aristax", ROOT / "aristax" / "__init__.py",
        submodule_search_locations=[str(ROOT / "aristax"), str(ROOT)])
    module = importlib.util.module_from_spec(spec)
    sys.modules["aristax"] = module
    spec.loader.exec_module(module)
    return "source tree: " + str(ROOT)


ARISTAX_FROM = import_source_tree()

import jax  # noqa: E402
import jax.numpy as jnp  # noqa: E402

from aristax import MoEConfig, MoEParams, moe  # noqa: E402
from aristax.argtypes import positive_float, positive_int  # noqa: E402
from aristax.pallas_kernels import BACKEND_NAMES  # noqa: E402
from aristax.pallas_kernels.moe_mlp import api as moe_mlp_api  # noqa: E402
from aristax.pallas_kernels.permute import api as permute_api  # noqa: E402
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api  # noqa: E402
from aristax.pallas_kernels.ragged_dot import mosaic_gpu as ragged_dot_mosaic_gpu  # noqa: E402
from aristax.pallas_kernels.route import api as route_api  # noqa: E402

sys.path.insert(0, str(Path(__file__).resolve().parent))
# kernels.py's timing loads: uniform, or Zipf(1.2) shares in random order
from kernels import group_sizes as load_group_sizes  # noqa: E402

HIGHEST = jax.lax.Precision.HIGHEST
F32 = jnp.float32


# ---------------------------------------------------------------------------
# Cases
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Shape:
    """E experts, D model dim, F expert hidden dim, K experts per token, T tokens."""

    name: str
    E: int
    D: int
    F: int
    K: int
    T: int


@dataclasses.dataclass(frozen=True)
class Case:
    """One shape in one dtype under one ``jax.default_matmul_precision`` (None: JAX's
    default); ``timed`` cases are also timed; ``tile_variants``: the Mosaic GPU grouped
    GEMM is also checked (and timed) with these ``TILE_VARIANTS`` of its tiles."""

    shape: Shape
    dtype: str
    precision: str | None = None
    timed: bool = False
    tile_variants: tuple[str, ...] = ()

    @property
    def name(self) -> str:
        return f"{self.shape.name}/{self.dtype}" + (f"/{self.precision}" if self.precision
                                                     else "")

    @property
    def tolerance(self) -> float:
        """METHOD's relative Frobenius bounds: bf16 1e-2, TF32 2e-3, float32 1e-4."""
        if self.dtype == "bfloat16":
            return 1e-2
        return 1e-4 if self.precision == "highest" else 2e-3


# Changes to the Mosaic GPU grouped GEMM's default tiles (``MosaicTiles.for_shape``)
# run beside it as backend "mosaic_gpu.<name>": one warpgroup per [128, 128] output
# tile in gmm and tgmm (the defaults before they were warp-specialized), the same in
# tgmm alone (its default since results/gpu_check_h200_7*.json), bands of 8 column
# tiles instead of 16 (forward and tgmm), tgmm steps of 128 rows instead of 64, row
# tiles of 64 (at the fine-grained shape, where groups of about 128 rows straddle
# two). Measured and dropped (results/gpu_check_h200_4.json): the row-major tile
# order, bands of 32, [64, 256] tiles on one warpgroup, a 6-step pipeline.
TILE_VARIANTS = {"one_wg": dict(compute_wgs=1, tgmm_compute_wgs=1),
                 "band8": dict(band_n=8, tgmm_band_n=8),
                 "tgmm_m128": dict(tgmm_block_m=128),
                 "tgmm_one_wg": dict(tgmm_compute_wgs=1),
                 "m64": dict(block_m=64)}
SMALL = Shape("small", E=8, D=256, F=192, K=2, T=264)
MIXTRAL = Shape("mixtral", E=8, D=4096, F=14336, K=2, T=4096)
FINE = Shape("fine", E=128, D=2048, F=768, K=8, T=2048)
ODD = Shape("odd", E=6, D=200, F=136, K=3, T=37)  # unaligned: Mosaic GPU refuses

# Most valuable first (a run cut short by --budget-s keeps what it did): every kernel
# at the two real shapes in bf16, timed; the precision rule; unaligned shapes.
GPU_PLAN = (
    Case(MIXTRAL, "bfloat16", timed=True, tile_variants=("tgmm_one_wg", "one_wg", "band8",
                                                         "tgmm_m128")),
    Case(FINE, "bfloat16", timed=True, tile_variants=("tgmm_one_wg", "m64", "one_wg")),
    Case(SMALL, "float32", "highest"),
    Case(SMALL, "float32"),
    Case(ODD, "bfloat16"),
    Case(MIXTRAL, "float32"),
    Case(ODD, "float32"),
    Case(SMALL, "bfloat16"),
)
# The same path on the CPU: tiny shapes, every kernel in interpret mode, one timing.
# (Unaligned shapes are left to the kernel tests, which run Triton at odd shapes.)
DRY_PLAN = (
    Case(Shape("tiny", E=4, D=128, F=64, K=2, T=16), "bfloat16", timed=True,
         tile_variants=("one_wg",)),
    Case(Shape("tiny", E=4, D=128, F=64, K=2, T=16), "float32", "highest"),
)
OPS = ("ragged_dot", "moe_mlp", "layer", "route", "permute", "combine")


def backends(op: str) -> list:
    """Every backend of ``op`` (the layer: every ``implementation``, None first)."""
    registry = {"ragged_dot": ragged_dot_api.BACKENDS, "moe_mlp": moe_mlp_api.BACKENDS,
                "route": route_api.BACKENDS, "permute": permute_api.BACKENDS,
                "combine": permute_api.BACKENDS}.get(op)
    if registry is None:
        return [None, *BACKEND_NAMES]
    return [n for n in registry if n != "reference"] + ["reference"]


# ---------------------------------------------------------------------------
# Inputs (NumPy on the host: random, never zero)
# ---------------------------------------------------------------------------


def hard_group_sizes(rows: int, groups: int, rng: np.random.Generator) -> np.ndarray:
    """int32[G]: a quarter of the groups empty, one holding about half the rows, and
    rows/16 trailing rows past the sum (they must come out as zeros)."""
    total = rows - max(1, rows // 16)
    share = rng.uniform(0.2, 1.0, groups)
    empty = rng.choice(groups, size=groups // 4, replace=False)
    share[empty] = 0.0
    heavy = rng.choice(np.setdiff1d(np.arange(groups), empty))
    share[heavy] += share.sum()
    sizes = np.floor(share / share.sum() * total).astype(np.int64)
    sizes[heavy] += total - sizes.sum()
    return sizes.astype(np.int32)


def routed_rows(T: int, K: int, E: int, rng: np.random.Generator) -> dict:
    """A dropless expert order: K distinct experts per token drawn from Zipf-skewed
    shares (an eighth of the experts, at least one, never chosen when E - K allows),
    1/16 of the tokens (at least one, never token 0) routed nowhere (their slots last,
    out of the counts).
    Returns sort_order int32[T*K], group_sizes int32[E], num_valid, weights f32[T, K]."""
    share = 1.0 / rng.permutation(np.arange(1, E + 1)) ** 1.2
    unused = min(E - K, max(1, E // 8))
    share[rng.choice(E, size=unused, replace=False)] = 0.0
    gumbel = rng.gumbel(size=(T, E))
    with np.errstate(divide="ignore"):
        ids = np.argsort(-(np.log(share) + gumbel), axis=1)[:, :K]
    valid = np.ones(T, bool)
    valid[rng.choice(np.arange(1, T), size=min(T - 1, max(1, T // 16)), replace=False)] = False
    slot_valid = np.repeat(valid, K)
    flat = ids.reshape(-1)
    order = np.argsort(np.where(slot_valid, flat, E), kind="stable").astype(np.int32)
    counts = np.bincount(flat[slot_valid], minlength=E).astype(np.int32)
    return dict(sort_order=order, group_sizes=counts, num_valid=np.int32(counts.sum()),
                weights=rng.uniform(0.1, 1.0, (T, K)).astype(np.float32))


def normal(rng: np.random.Generator, shape, scale: float = 1.0) -> np.ndarray:
    return (rng.standard_normal(shape) * scale).astype(np.float32)


# ---------------------------------------------------------------------------
# References (float32, HIGHEST)
# ---------------------------------------------------------------------------


def brute_ragged_dot(lhs, rhs, group_sizes, max_group: int):
    """lhs[M, K] @ rhs[G, K, N] by groups: a scan over g, each a dense product of the
    group's own rows (a window of ``max_group`` rows from its start, masked), added
    into its rows of the output; rows past sum(group_sizes) stay 0. Differentiable."""
    (M, _), (G, _, N) = lhs.shape, rhs.shape
    padded = jnp.pad(lhs, ((0, max_group), (0, 0)))
    starts = jnp.cumsum(group_sizes) - group_sizes
    window = jnp.arange(max_group)[:, None]

    def one_group(out, g):
        rows = jax.lax.dynamic_slice_in_dim(padded, starts[g], max_group)
        rows = jnp.where(window < group_sizes[g], rows, 0)
        part = jnp.dot(rows, rhs[g], precision=HIGHEST, preferred_element_type=F32)
        here = jax.lax.dynamic_slice_in_dim(out, starts[g], max_group)
        return jax.lax.dynamic_update_slice_in_dim(out, here + part, starts[g], 0), None

    out, _ = jax.lax.scan(one_group, jnp.zeros((M + max_group, N), F32), jnp.arange(G))
    return out[:M]


def window_rows(group_sizes: np.ndarray) -> int:
    """The brute force's static window: the largest group, rounded up to 64 rows."""
    return int(-(-max(int(group_sizes.max()), 1) // 64) * 64)


def brute_moe_mlp(x, weights, gate, up, down, sort_order, group_sizes, num_valid, *,
                  top_k: int, max_group: int):
    """y[T, D] = sum_k w[t, k] * swiglu expert MLP of x[t] (brute-force GEMMs)."""
    M = sort_order.shape[0]
    valid = (jnp.arange(M) < num_valid)[:, None]
    rows = jnp.where(valid, jnp.take(x, sort_order // top_k, axis=0), 0)
    g = brute_ragged_dot(rows, gate, group_sizes, max_group)
    u = brute_ragged_dot(rows, up, group_sizes, max_group)
    out = brute_ragged_dot(jax.nn.silu(g) * u, down, group_sizes, max_group)
    w = jnp.where(valid, jnp.take(weights.reshape(-1), sort_order)[:, None], 0)
    return jnp.zeros(x.shape, F32).at[sort_order // top_k].add(w * out)


# ---------------------------------------------------------------------------
# One op in one case: {"diff": arrays with gradients, "fixed": the rest}, and
# fn(backend) / reference: (diff, fixed) -> (float outputs, integer outputs)
# ---------------------------------------------------------------------------


@dataclasses.dataclass
class Problem:
    diff: dict
    fixed: dict
    fn: Callable[[object], Callable]
    reference: Callable
    load: str = "routed"  # the timing load's name where ``loads`` is empty
    loads: dict = dataclasses.field(default_factory=dict)  # name -> fixed (timing)


def ragged_dot_problem(s: Shape, dtype, rng) -> Problem:
    M = s.T * s.K
    sizes = hard_group_sizes(M, s.E, rng)
    diff = dict(lhs=normal(rng, (M, s.D)), rhs=normal(rng, (s.E, s.D, s.F), s.D ** -0.5))

    def fn(name):
        name, _, variant = name.partition(".")  # "mosaic_gpu.<TILE_VARIANTS key>"
        tiles = None
        if variant:
            tiles = {name: dataclasses.replace(
                ragged_dot_mosaic_gpu.MosaicTiles.for_shape(M, s.D, s.F, s.E),
                **TILE_VARIANTS[variant])}

        def f(diff, fixed):
            return dict(out=ragged_dot_api.ragged_dot(
                diff["lhs"], diff["rhs"], fixed["group_sizes"], preferred_element_type=F32,
                implementation=name, tiles=tiles)), {}
        return f

    def reference(diff, fixed):
        return dict(out=brute_ragged_dot(diff["lhs"], diff["rhs"], fixed["group_sizes"],
                                         window_rows(sizes))), {}

    loads = {load: dict(group_sizes=load_group_sizes(M, s.E, load))
             for load in ("uniform", "zipf")}
    return Problem(diff, dict(group_sizes=sizes), fn, reference, loads=loads)


def moe_mlp_problem(s: Shape, dtype, rng) -> Problem:
    r = routed_rows(s.T, s.K, s.E, rng)
    diff = dict(x=normal(rng, (s.T, s.D)), weights=r.pop("weights"),
                gate=normal(rng, (s.E, s.D, s.F), s.D ** -0.5),
                up=normal(rng, (s.E, s.D, s.F), s.D ** -0.5),
                down=normal(rng, (s.E, s.F, s.D), s.F ** -0.5))
    window = window_rows(r["group_sizes"])

    def fn(name):
        def f(d, fixed):
            return dict(y=moe_mlp_api.moe_mlp(
                d["x"], fixed["sort_order"], d["weights"], fixed["group_sizes"], d["gate"],
                d["up"], d["down"], activation="swiglu", num_valid=fixed["num_valid"],
                implementation=name)), {}
        return f

    def reference(d, fixed):
        return dict(y=brute_moe_mlp(d["x"], d["weights"], d["gate"], d["up"], d["down"],
                                    fixed["sort_order"], fixed["group_sizes"],
                                    fixed["num_valid"], top_k=s.K, max_group=window)), {}

    return Problem(diff, r, fn, reference, load="router")


def layer_problem(s: Shape, dtype, rng) -> Problem:
    """``aristax.moe`` (Mixtral routing: softmax top-K, renormalised) per
    ``implementation``; the reference is implementation="reference" in float32."""
    diff = dict(x=normal(rng, (s.T, s.D)), params=MoEParams(
        router_de=normal(rng, (s.D, s.E), s.D ** -0.5),
        gate_edf=normal(rng, (s.E, s.D, s.F), s.D ** -0.5),
        up_edf=normal(rng, (s.E, s.D, s.F), s.D ** -0.5),
        down_efd=normal(rng, (s.E, s.F, s.D), s.F ** -0.5)))

    def layer(implementation, compute_dtype):
        cfg = MoEConfig(num_experts=s.E, top_k=s.K, d_model=s.D, d_ff=s.F,
                        normalize_weights=True, dtype=compute_dtype,
                        implementation=implementation)

        def f(d, fixed):
            y, aux = moe(d["x"], d["params"], cfg)
            ids = jax.lax.top_k(aux["router_logits"], s.K)[1]
            return (dict(y=y, loss=aux["loss"]),
                    dict(expert_load=aux["expert_load"], expert_ids=jnp.sort(ids, axis=1)))
        return f

    return Problem(diff, {}, lambda name: layer(name, dtype), layer("reference", "float32"),
                   load="router")


def route_problem(s: Shape, dtype, rng) -> Problem:
    diff = dict(x=normal(rng, (s.T, s.D)), w=normal(rng, (s.D, s.E), s.D ** -0.5))

    def fn(name):
        def f(d, fixed):
            out = route_api.route(d["x"], d["w"], top_k=s.K, normalize=True,
                                  implementation=name)
            return (dict(logits=out.logits, weights=out.weights),
                    dict(expert_ids=out.expert_ids, counts=out.counts,
                         sort_order=out.sort_order))
        return f

    return Problem(diff, {}, fn, fn("reference"), load="router")


def permute_problem(s: Shape, dtype, rng) -> Problem:
    r = routed_rows(s.T, s.K, s.E, rng)
    del r["weights"], r["group_sizes"]

    def fn(name):
        def f(d, fixed):
            return dict(rows=permute_api.permute(
                d["x"], fixed["sort_order"], top_k=s.K, num_valid=fixed["num_valid"],
                implementation=name)), {}
        return f

    return Problem(dict(x=normal(rng, (s.T, s.D))), r, fn, fn("reference"))


def combine_problem(s: Shape, dtype, rng) -> Problem:
    r = routed_rows(s.T, s.K, s.E, rng)
    del r["group_sizes"]
    diff = dict(rows=normal(rng, (s.T * s.K, s.D)), weights=r.pop("weights"))

    def fn(name):
        def f(d, fixed):
            return dict(y=permute_api.combine(
                d["rows"], fixed["sort_order"], d["weights"], num_valid=fixed["num_valid"],
                implementation=name)), {}
        return f

    return Problem(diff, r, fn, fn("reference"))


PROBLEMS = {"ragged_dot": ragged_dot_problem, "moe_mlp": moe_mlp_problem,
            "layer": layer_problem, "route": route_problem, "permute": permute_problem,
            "combine": combine_problem}
# Combine weights and the layer's router stay float32 (as the layer holds them).
KEEP_F32 = ("weights", "router_de")


def cast_diff(diff: dict, dtype) -> dict:
    """Device arrays: each leaf in ``dtype``, except the float32 ones ``KEEP_F32``."""
    def cast(path, leaf):
        name = getattr(path[-1], "key", getattr(path[-1], "name", ""))
        return jnp.asarray(leaf, F32 if name in KEEP_F32 else dtype)
    return jax.tree_util.tree_map_with_path(cast, diff)


# ---------------------------------------------------------------------------
# Running, comparing, timing
# ---------------------------------------------------------------------------


def with_grads(f: Callable) -> Callable:
    """(diff, fixed, cotangents) -> (float outputs, int outputs, d diff): the forward
    and its vjp in one program."""
    def run(diff, fixed, cot):
        out, vjp, ints = jax.vjp(lambda d: f(d, fixed), diff, has_aux=True)
        return out, ints, vjp(jax.tree.map(lambda c, o: c.astype(o.dtype), cot, out))[0]
    return run


def compiled(fn: Callable, precision: str | None, *args, autotune: bool = True):
    """(the compiled ``jit(fn)`` for ``args``, its kernel counts), traced and compiled
    under ``jax.default_matmul_precision(precision)`` (None: JAX's default).

    ``autotune=False`` compiles without XLA's GEMM autotuning: on the H200 it took
    most of the 24 to 60 s that each float32 reference cost at the Mixtral shape.
    Programs that are timed keep it."""
    options = {} if autotune else {"xla_gpu_autotune_level": 0}
    with jax.default_matmul_precision(precision):
        traced = jax.jit(fn).trace(*args)
        lowered = traced.lower()
        return lowered.compile(options), kernel_calls(traced.jaxpr, lowered.as_text())


# The custom call of each Pallas GPU backend in a lowered module.
KERNEL_TARGETS = {"triton": "__gpu$xla.gpu.triton", "mosaic_gpu": "mosaic_gpu"}


def kernel_calls(jaxpr, module_text: str) -> dict:
    """How many Pallas kernels a program runs, per backend (none: plain XLA; the layer
    runs the reference where a named kernel does not serve). Compiled kernels are
    custom calls in the module; in interpret mode (CPU) they are plain HLO, and the
    jaxpr's kernels are counted instead (Triton's ``pallas_call``s; Mosaic GPU's
    ``plgpu.kernel`` is an ``mpmd_map``)."""
    if jax.default_backend() == "cpu":
        text = str(jaxpr)
        return {"interpreted": text.count("pallas_call[") + text.count("mpmd_map[")}
    return {name: module_text.count(f"custom_call @{target}")
            for name, target in KERNEL_TARGETS.items()}


def poison_free_memory(nbytes: int) -> None:
    """Fill ``nbytes`` of device memory with NaN and free it: XLA takes the next
    outputs from freed memory, so an output row no kernel writes reads NaN."""
    if jax.default_backend() == "cpu" or nbytes <= 0:
        return
    block = jnp.full((nbytes // 4 + 1,), jnp.nan, F32)
    block.block_until_ready()
    del block


def rel_error(ours, ref) -> float:
    """||ours - ref||_F / ||ref||_F in float32 (NaN if ours has a non-finite value)."""
    ours, ref = ours.astype(F32), ref.astype(F32)
    if not bool(jnp.all(jnp.isfinite(ours))):
        return float("nan")
    scale = float(jnp.linalg.norm(ref.ravel()))
    diff = float(jnp.linalg.norm((ours - ref).ravel()))
    return diff / scale if scale > 0 else diff


def leaves_by_name(tree, prefix: str) -> dict:
    flat = jax.tree_util.tree_flatten_with_path(tree)[0]
    return {prefix + jax.tree_util.keystr(path, simple=True, separator="."): leaf
            for path, leaf in flat if leaf is not None}


def nbytes(tree) -> int:
    return sum(int(np.prod(x.shape)) * x.dtype.itemsize for x in jax.tree.leaves(tree))


def median_seconds(fn: Callable, *args, repeats: int, sample_s: float = 0.02) -> float:
    """Median over ``repeats`` samples of the time per call, each sample a batch of
    back-to-back calls (enough for ``sample_s``) synchronised at the end."""
    jax.block_until_ready(fn(*args))
    t0 = time.perf_counter()
    jax.block_until_ready(fn(*args))
    calls = int(min(200, max(1, sample_s / max(time.perf_counter() - t0, 1e-6))))
    samples = []
    for _ in range(repeats):
        t0 = time.perf_counter()
        for _ in range(calls):
            out = fn(*args)
        jax.block_until_ready(out)
        samples.append((time.perf_counter() - t0) / calls)
    return float(np.median(samples))


# ---------------------------------------------------------------------------
# Steps and the report: one JSON, rewritten after every step
# ---------------------------------------------------------------------------


@dataclasses.dataclass(frozen=True)
class Step:
    """One unit of the run: "environment", "ceilings", "peers" (of a timed case) or
    "check" (one backend of one op in one case)."""

    kind: str
    case: Case | None = None
    op: str | None = None
    backend: str | None = None

    @property
    def id(self) -> str:
        parts = [self.kind] + ([self.case.name] if self.case else [])
        return ":".join(parts + ([self.op, str(self.backend)] if self.op else []))


def plan_steps(plan, only: str | None = None) -> list[Step]:
    """The steps of ``plan`` in order; with ``only``, those whose id it matches
    (``re.search``; the environment is always taken)."""
    steps = [Step("environment"), Step("ceilings")]
    for case in plan:
        if case.timed:
            steps.append(Step("peers", case))
        for op in OPS:
            names = backends(op) + ([f"mosaic_gpu.{v}" for v in case.tile_variants]
                                    if op == "ragged_dot" else [])
            steps += [Step("check", case, op, name) for name in names]
    return [s for s in steps
            if only is None or s.kind == "environment" or re.search(only, s.id)]


class Report:
    """The JSON: environment, ceilings, peers, checks, timings, failures, and the ids
    of the steps done; ``current`` names the step in progress and since when."""

    def __init__(self, path: Path):
        self.path = path
        self.data = json.loads(path.read_text()) if path.exists() else {
            "complete": False, "environment": {}, "ceilings": {}, "peers": [],
            "checks": [], "timings": [], "failures": [], "workers": [], "done": [],
            "step_s": {}, "current": None}

    def write(self) -> None:
        """Atomically: the parent reads it while the worker writes."""
        tmp = self.path.with_name(self.path.name + ".tmp")
        tmp.write_text(json.dumps(self.data, indent=1, default=str))
        os.replace(tmp, self.path)

    def fail(self, step_id: str, error: str, **extra) -> None:
        self.data["failures"].append({"step": step_id, "error": error[:4000], **extra})
        self.data["done"].append(step_id)


# An error after which the process's CUDA context is unusable: the worker stops and
# the parent starts a fresh one after the step.
FATAL = ("illegal memory access", "ILLEGAL_ADDRESS", "launch failure", "misaligned address",
         "hardware exception", "CUDA_ERROR_LAUNCH", "device-side assert")


def run_worker(args, plan) -> int:
    """Run the steps of ``plan`` not yet in the report, in order, until done or a
    fatal CUDA error (exit 3). A step's exception is recorded and the run goes on."""
    report = Report(Path(args.out))
    done, cache = set(report.data["done"]), {}
    faults = dict(f.split(":", 1)[::-1] for f in args.fault or [])
    for step in plan_steps(plan, args.only):
        if step.id in done:
            continue
        if time.time() > args.deadline:
            report.fail(step.id, "skipped: over --budget-s")
            report.write()
            continue
        started = time.time()
        report.data["current"] = {"step": step.id, "since": started}
        report.write()
        inject_fault(faults.get(step.id))
        try:
            run_step(report, step, cache, args)
            report.data["done"].append(step.id)
        except Exception as err:  # noqa: BLE001 - recorded, and the run goes on
            message = f"{type(err).__name__}: {err}"
            report.fail(step.id, message, traceback=traceback.format_exc()[-3000:])
            print(f"  FAILED {step.id}: {message[:300]}", flush=True)
            if any(sign in message for sign in FATAL):
                return 3
        finally:
            report.data["current"] = None
            report.data["step_s"][step.id] = round(time.time() - started, 2)
            report.data["timings"] = timing_rows(report.data)
            report.write()
    return 0


def inject_fault(kind: str | None) -> None:
    """``--fault exit:STEP`` / ``hang:STEP`` (tests): die or hang at that step, as a
    kernel that faults the GPU or never finishes would."""
    if kind == "exit":
        os._exit(7)
    if kind == "hang":
        time.sleep(3600)


def run_step(report: Report, step: Step, cache: dict, args) -> None:
    data = report.data
    if step.kind == "environment":
        data["environment"] = environment(ARISTAX_FROM)
        print(json.dumps(data["environment"], indent=1), flush=True)
    elif step.kind == "ceilings":
        data["ceilings"] = ceilings(args.dry_run)
    elif step.kind == "peers":
        data["peers"].append({"case": step.case.name,
                              "peers": peer_timings(step.case, args.repeats)})
    else:
        key = (step.case.name, step.op)
        if key not in cache:
            cache.clear()  # one op's arrays on the device at a time
            cache[key] = prepare(step.op, step.case)
        data["checks"].append(check_backend(cache[key], step, args.repeats))


def run_parent(args, argv) -> int:
    """Start a worker; when one dies (a crash, a fatal CUDA error) or a step outlives
    ``--step-timeout-s``, record that step as failed and start another after it."""
    out = Path(args.out)
    out.unlink(missing_ok=True)
    report = Report(out)
    deadline = time.time() + args.budget_s
    report.data["plan"] = [c.name + (" (timed)" if c.timed else "") for c in plan_of(args)]
    report.write()
    command = [sys.executable, __file__, *argv, "--worker", "--deadline", str(deadline)]
    for _ in range(MAX_WORKERS):
        if time.time() > deadline:
            break  # the steps left are recorded as skipped below
        outcome = watch(subprocess.Popen(command), out, args.step_timeout_s, deadline)
        if outcome == 2:
            return 2  # no GPU and no --dry-run: the worker said so in one line
        report = Report(out)
        report.data["workers"].append(outcome)
        if outcome == 0:
            break
        current = report.data["current"]
        if current is not None:
            report.fail(current["step"], f"worker died: {outcome}")
            report.data["current"] = None
        report.write()
        if current is None and outcome != 3:
            break  # it died outside any step: another would too
    for step in plan_steps(plan_of(args), args.only):
        if step.id not in report.data["done"]:
            report.fail(step.id, "skipped: over --budget-s")
    report.data["complete"] = not any(f["error"].startswith("skipped")
                                      for f in report.data["failures"])
    report.data["wall_s"] = round(time.time() - deadline + args.budget_s, 1)
    report.write()
    print_summary(report.data)
    print(f"wrote {out}")
    statuses = {c["status"] for c in report.data["checks"]}
    return 0 if report.data["complete"] and statuses <= {"pass", "refused"} and not \
        report.data["failures"] else 1


MAX_WORKERS = 20


def watch(proc: subprocess.Popen, out: Path, step_timeout_s: float, deadline: float):
    """The worker's exit code, or why it was killed (a step over its time, or the
    whole run a minute past its budget)."""
    while True:
        try:
            return proc.wait(timeout=1.0)
        except subprocess.TimeoutExpired:
            pass
        try:
            current = json.loads(out.read_text())["current"]
        except (OSError, ValueError, KeyError):
            current = None
        reason = None
        if current and time.time() - current["since"] > step_timeout_s:
            reason = f"killed: the step ran over --step-timeout-s {step_timeout_s:g}"
        elif time.time() > deadline + 60:
            reason = "killed: the run went a minute over --budget-s"
        if reason:
            proc.kill()
            proc.wait()
            return reason


def plan_of(args):
    return DRY_PLAN if args.dry_run else GPU_PLAN


def environment(source: str) -> dict:
    """Device, driver, versions, and which kernel backends import."""
    env = {"aristax": source, "python": platform.python_version(),
           "platform": platform.platform(), "jax": jax.__version__,
           "jaxlib": getattr(jax.lib, "__version__", None) or _version("jaxlib"),
           "backend": jax.default_backend(),
           "devices": [str(getattr(d, "device_kind", d)) for d in jax.devices()],
           "compute_capability": getattr(jax.devices()[0], "compute_capability", None),
           "matmul_precision": jax.config.jax_default_matmul_precision}
    try:
        env["nvidia_smi"] = subprocess.run(
            ["nvidia-smi", "--query-gpu=name,driver_version,memory.total,clocks.max.sm",
             "--format=csv,noheader"], capture_output=True, text=True, timeout=20
        ).stdout.strip() or None
    except (OSError, subprocess.SubprocessError) as err:
        env["nvidia_smi"] = f"unavailable: {err}"
    importable = {}
    for name in ("jax.experimental.pallas.triton", "jax.experimental.pallas.mosaic_gpu",
                 "triton", "torch"):
        try:
            module = __import__(name, fromlist=["_"])
            importable[name] = getattr(module, "__version__", True)
        except Exception as err:  # noqa: BLE001
            importable[name] = f"no: {type(err).__name__}: {err}"[:200]
    env["importable"] = importable
    torch = _torch_cuda()
    env["torch_cuda"] = None if torch is None else torch.cuda.get_device_name(0)
    return env


def _version(package: str) -> str | None:
    from importlib import metadata
    try:
        return metadata.version(package)
    except metadata.PackageNotFoundError:
        return None


def _torch_cuda():
    """torch when it imports with CUDA and has ``_grouped_mm``, else None."""
    try:
        import torch
    except Exception:  # noqa: BLE001 - torch is optional
        return None
    if not torch.cuda.is_available() or not hasattr(torch, "_grouped_mm"):
        return None
    return torch


def ceilings(dry_run: bool) -> dict:
    """The dense bf16 matmul rate and the copy bandwidth, measured here."""
    n = 256 if dry_run else 8192
    a = jax.random.normal(jax.random.key(0), (n, n), jnp.bfloat16)
    b = jax.random.normal(jax.random.key(1), (n, n), jnp.bfloat16)
    mm = median_seconds(jax.jit(lambda a, b: jnp.dot(a, b, preferred_element_type=F32)),
                        a, b, repeats=5)
    big = jax.random.normal(jax.random.key(2), ((1 << 20) if dry_run else (1 << 30) // 4,),
                            F32)
    copy = median_seconds(jax.jit(lambda x: x * 1.0001), big, repeats=5)
    return {"matmul_bf16_tflops": 2.0 * n ** 3 / mm / 1e12, "matmul_n": n,
            "copy_gbps": 2 * big.size * 4 / copy / 1e9}


@dataclasses.dataclass
class Prepared:
    """One op in one case, ready for each backend: its problem, the arrays (ours in
    the case's dtype), the cotangents, and the reference's outputs and gradients."""

    problem: Problem
    diff: dict
    fixed: dict
    cot: dict
    refs: dict
    ref_ints: dict


def prepare(op: str, case: Case) -> Prepared:
    """Random inputs (seeded by op and case) and the float32 HIGHEST reference."""
    rng = np.random.default_rng(zlib.crc32(f"{op} {case.name}".encode()))
    problem = PROBLEMS[op](case.shape, jnp.dtype(case.dtype), rng)
    fixed = jax.tree.map(jnp.asarray, problem.fixed)
    diff = cast_diff(problem.diff, jnp.dtype(case.dtype))
    ref_diff = cast_diff(diff, F32)  # the same values, rounded to the case's dtype
    ref_shapes = jax.eval_shape(lambda d: problem.reference(d, fixed)[0], ref_diff)
    cot = jax.tree.map(lambda sd: jnp.asarray(normal(rng, sd.shape)), ref_shapes)
    ref_fn, _ = compiled(with_grads(problem.reference), "highest", ref_diff, fixed, cot,
                         autotune=False)
    ref_out, ref_ints, ref_grads = jax.block_until_ready(ref_fn(ref_diff, fixed, cot))
    refs = {**leaves_by_name(ref_out, "out."), **leaves_by_name(ref_grads, "grad.")}
    return Prepared(problem, diff, fixed, cot, refs, ref_ints)


def check_backend(p: Prepared, step: Step, repeats: int) -> dict:
    """One backend's row: status pass / fail / refused, the error of every output and
    gradient, integer mismatches, compile seconds, and timings in a timed case."""
    case, name = step.case, step.backend
    row = {"step": step.id, "op": step.op, "backend": name, "case": case.name,
           "shape": dataclasses.asdict(case.shape), "dtype": case.dtype,
           "precision": case.precision or "default", "tolerance": case.tolerance}
    t0 = time.perf_counter()
    try:
        fn, kernels = compiled(with_grads(p.problem.fn(name)), case.precision, p.diff,
                               p.fixed, p.cot, autotune=case.timed)
    except NotImplementedError as err:  # the named backend does not serve this case
        print(f"  {step.op:10s} {str(name):10s} {case.name:22s} refused", flush=True)
        return {**row, "status": "refused", "reason": str(err)[:600]}
    row.update(kernels=kernels, compile_s=round(time.perf_counter() - t0, 2))
    result = jax.block_until_ready(fn(p.diff, p.fixed, p.cot))
    if jax.default_backend() != "cpu":  # again, into memory poisoned with NaN
        poison_free_memory(nbytes(result))
        del result
        result = jax.block_until_ready(fn(p.diff, p.fixed, p.cot))
    out, ints, grads = result
    ours = {**leaves_by_name(out, "out."), **leaves_by_name(grads, "grad.")}
    row["errors"] = {k: rel_error(ours[k], ref) for k, ref in p.refs.items()}
    row["int_mismatches"] = {k: int(jnp.sum(ints[k] != ref)) for k, ref in p.ref_ints.items()}
    worst = max(row["errors"].values(), default=0.0)
    ok = (all(e <= case.tolerance for e in row["errors"].values())
          and not any(row["int_mismatches"].values()))
    row.update(status="pass" if ok else "fail", max_error=worst)
    # Mosaic GPU's interpreter (race detection on) takes seconds per call: not timed
    if case.timed and not (jax.default_backend() == "cpu"
                           and str(name).startswith("mosaic_gpu")):
        row["timings"] = time_backend(p, step, fn, repeats)
    print(f"  {step.op:10s} {str(name):10s} {case.name:22s} {row['status']:5s} "
          f"max err {worst:.2e} (tol {case.tolerance:.0e}) compile {row['compile_s']} s",
          flush=True)
    return row


# Ops also timed forward only (a second compile; the expert MLP and the layer are
# timed as they train, forward + backward).
FORWARD_TIMED = ("ragged_dot", "route", "permute", "combine")


def time_backend(p: Prepared, step: Step, fn, repeats: int) -> dict:
    """{load: {"fwd": s, "fwd_bwd": s}} at the problem's timing loads (uniform and
    Zipf group sizes), else at the checked routing ("router" or "routed")."""
    loads = ({k: jax.tree.map(jnp.asarray, v) for k, v in p.problem.loads.items()}
             or {p.problem.load: p.fixed})
    out = {load: {"fwd_bwd": median_seconds(fn, p.diff, fixed, p.cot, repeats=repeats)}
           for load, fixed in loads.items()}
    if step.op in FORWARD_TIMED:
        fwd, _ = compiled(lambda d, fixed: p.problem.fn(step.backend)(d, fixed)[0],
                          step.case.precision, p.diff, p.fixed)
        for load, fixed in loads.items():
            out[load]["fwd"] = median_seconds(fwd, p.diff, fixed, repeats=repeats)
    return out


def peer_timings(case: Case, repeats: int) -> dict:
    """The ceilings and peers of the timed ops in ``case``: a dense matmul of the
    grouped GEMM's FLOPs, the dense SwiGLU MLP of the expert MLP's, the router GEMM,
    and ``torch._grouped_mm`` at each load."""
    s, dtype = case.shape, jnp.dtype(case.dtype)
    M = s.T * s.K
    keys = jax.random.split(jax.random.key(3), 6)
    lhs = jax.random.normal(keys[0], (M, s.D), dtype)
    w = [(jax.random.normal(k, (s.D, s.F), F32) * s.D ** -0.5).astype(dtype)
         for k in keys[1:3]] + [(jax.random.normal(keys[3], (s.F, s.D)) * s.F ** -0.5
                                 ).astype(dtype)]
    # In the compute dtype throughout, as a user writes it (float32 accumulation inside
    # the GEMM): with float32 outputs the backward's cotangents would be float32 and its
    # GEMMs float32 too, where the kernels' backward runs in bf16.
    dense = jnp.dot

    def dense_bwd(a, b):
        out, vjp = jax.vjp(dense, a, b)
        return vjp(out)

    def mlp(ws, a):
        h = jax.nn.silu(dense(a, ws[0])) * dense(a, ws[1])
        return jnp.sum(dense(h, ws[2]).astype(F32))

    def t(fn, *args):
        return median_seconds(jax.jit(fn), *args, repeats=repeats)

    router = jax.random.normal(keys[4], (s.D, s.E), dtype)
    peers = {
        "dense_gemm": {"fwd": t(dense, lhs, w[0]), "fwd_bwd": t(dense_bwd, lhs, w[0])},
        "dense_swiglu_mlp": {"fwd": t(mlp, w, lhs),
                             "fwd_bwd": t(jax.grad(mlp, argnums=(0, 1)), w, lhs)},
        "router_gemm": {"fwd": t(lambda x, r: jnp.dot(x, r, preferred_element_type=F32),
                                 lhs[:s.T], router)},
    }
    torch = _torch_cuda()
    if torch is not None and dtype == jnp.bfloat16:
        peers["torch._grouped_mm"] = {
            load: torch_grouped_mm_seconds(torch, M, s, load_group_sizes(M, s.E, load),
                                           repeats) for load in ("uniform", "zipf")}
    return peers


def torch_grouped_mm_seconds(torch, M: int, s: Shape, sizes: np.ndarray,
                             repeats: int) -> dict:
    """``torch._grouped_mm`` bf16 forward and forward+backward, CUDA-event timed."""
    a = torch.randn(M, s.D, device="cuda", dtype=torch.bfloat16)
    b = torch.randn(s.E, s.D, s.F, device="cuda", dtype=torch.bfloat16) * s.D ** -0.5
    offs = torch.from_numpy(np.cumsum(sizes).astype(np.int32)).cuda()

    def fwd():
        return torch._grouped_mm(a, b, offs=offs)

    def fwd_bwd():
        ar, br = a.detach().requires_grad_(), b.detach().requires_grad_()
        out = torch._grouped_mm(ar, br, offs=offs)
        out.backward(out.detach())

    result = {}
    for name, body in (("fwd", fwd), ("fwd_bwd", fwd_bwd)):
        try:
            body()
            torch.cuda.synchronize()
            times = []
            for _ in range(repeats):
                start, end = torch.cuda.Event(enable_timing=True), torch.cuda.Event(
                    enable_timing=True)
                start.record()
                body()
                end.record()
                end.synchronize()
                times.append(start.elapsed_time(end) / 1e3)
            result[name] = float(np.median(times))
        except Exception as err:  # noqa: BLE001 - a private op; recorded
            result[name] = f"{type(err).__name__}: {err}"[:300]
    return result


# ---------------------------------------------------------------------------
# Summary
# ---------------------------------------------------------------------------


def timing_rows(data: dict) -> list[dict]:
    """Flat timing rows with their ratios to the dense ceiling and the peers."""
    rows = []
    peers = {p["case"]: p for p in data["peers"]} if "peers" in data else {}
    for check in data["checks"]:
        if "timings" not in check:
            continue
        peer = peers.get(check["case"], {})
        s = check["shape"]
        M = s["T"] * s["K"]
        flops = {"ragged_dot": 2.0 * M * s["D"] * s["F"],
                 "moe_mlp": 6.0 * M * s["D"] * s["F"], "layer": 6.0 * M * s["D"] * s["F"],
                 "route": 2.0 * s["T"] * s["D"] * s["E"]}.get(check["op"])
        ceiling = {"ragged_dot": "dense_gemm", "moe_mlp": "dense_swiglu_mlp",
                   "layer": "dense_swiglu_mlp", "route": "router_gemm"}.get(check["op"])
        for load, passes in check["timings"].items():
            for pass_, seconds in passes.items():
                row = {"op": check["op"], "backend": check["backend"], "case": check["case"],
                       "load": load, "pass": pass_, "seconds": seconds}
                factor = 3.0 if pass_ == "fwd_bwd" else 1.0
                if flops:
                    row["tflops"] = factor * flops / seconds / 1e12
                dense = peer.get("peers", {}).get(ceiling, {}).get(pass_)
                if isinstance(dense, float):
                    row["vs_dense"] = dense / seconds
                lax_row = next((c for c in data["checks"] if c["op"] == check["op"]
                                and c["case"] == check["case"] and c["backend"] == "reference"
                                and "timings" in c), None)
                if lax_row and check["op"] == "ragged_dot":
                    row["vs_lax_ragged_dot"] = lax_row["timings"][load][pass_] / seconds
                torch_s = peer.get("peers", {}).get("torch._grouped_mm", {}).get(load, {})
                if check["op"] == "ragged_dot" and isinstance(torch_s.get(pass_), float):
                    row["vs_torch_grouped_mm"] = torch_s[pass_] / seconds
                rows.append(row)
    return rows


def print_summary(data: dict) -> None:
    print("\n== correctness (max relative Frobenius error over outputs and gradients)")
    for c in data["checks"]:
        detail = (c.get("reason", "")[:70] if c["status"] == "refused" else
                  f"{c['max_error']:.2e} / {c['tolerance']:.0e}  kernels {c['kernels']}"
                  + (f"  int mismatches {c['int_mismatches']}"
                     if any(c["int_mismatches"].values()) else ""))
        print(f"{c['op']:10s} {str(c['backend']):10s} {c['case']:24s} {c['status']:7s} "
              f"{detail}")
    print("\n== timings (ms; x of the dense ceiling / lax.ragged_dot / torch._grouped_mm)")
    for r in data["timings"]:
        ratios = "  ".join(f"{k[3:]} x{r[k]:.2f}" for k in
                           ("vs_dense", "vs_lax_ragged_dot", "vs_torch_grouped_mm") if k in r)
        print(f"{r['op']:10s} {str(r['backend']):10s} {r['case']:18s} {r['load']:7s} "
              f"{r['pass']:7s} {1e3 * r['seconds']:9.3f}  {ratios}")
    failures = data["failures"]
    counts = {k: sum(c["status"] == k for c in data["checks"])
              for k in ("pass", "fail", "refused")}
    print(f"\n{counts['pass']} pass, {counts['fail']} fail, {counts['refused']} refused, "
          f"{len(failures)} step(s) failed or skipped; wall {data['wall_s']} s")


def main(argv: list[str] | None = None) -> int:
    argv = sys.argv[1:] if argv is None else list(argv)
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--dry-run", action="store_true",
                        help="tiny shapes on the CPU, kernels in interpret mode")
    parser.add_argument("--budget-s", type=positive_float, default=420.0,
                        help="steps after this many seconds are recorded as skipped")
    parser.add_argument("--step-timeout-s", type=positive_float, default=180.0,
                        help="a step running longer is killed and recorded as failed")
    parser.add_argument("--repeats", type=positive_int, default=None,
                        help="timing samples (default 10; 1 with --dry-run)")
    parser.add_argument("--only", default=None, metavar="REGEX",
                        help="run the steps whose id matches, e.g. "
                        "'check:mixtral/bfloat16:(ragged_dot|layer):triton' (ids: the JSON)")
    parser.add_argument("--out", default=None)
    parser.add_argument("--worker", action="store_true", help=argparse.SUPPRESS)
    parser.add_argument("--deadline", type=float, help=argparse.SUPPRESS)
    parser.add_argument("--fault", action="append", help=argparse.SUPPRESS)
    args = parser.parse_args(argv)
    args.repeats = args.repeats or (1 if args.dry_run else 10)
    if args.out is None:
        name = "gpu_check_dry_run.json" if args.dry_run else "gpu_check_gpu.json"
        args.out = str(Path(__file__).resolve().parent / "results" / name)
        argv += ["--out", args.out]
    Path(args.out).parent.mkdir(parents=True, exist_ok=True)
    if not args.worker:  # the parent never starts a JAX backend: the worker owns the GPU
        return run_parent(args, argv)
    if jax.default_backend() != "gpu" and not args.dry_run:
        print(f"gpu_check: JAX's default backend is {jax.default_backend()!r}, not a GPU; "
              "run with --dry-run to take the same path at tiny shapes", file=sys.stderr)
        return 2
    return run_worker(args, plan_of(args))


if __name__ == "__main__":
    sys.exit(main())
