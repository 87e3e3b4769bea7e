"""Building blocks shared by the Pallas Mosaic GPU (Hopper) kernels of every op.

Interpret mode (the Mosaic GPU interpreter with its race detector) and the capability
checks every backend's ``check`` composes (``platform_reason``, ``dtype_reason``,
``raise_if``); the persistent launch (``launch``: ``grid=(SMs,)`` named "sm") and the
order its loops visit output tiles in (``band_order``); and kernel pieces: the
pipelined wgmma tile GEMM (``gmm_tile``), operands read transposed in SMEM
(``transposed``), row stores as a ladder of power-of-two TMA boxes (``store_rows``,
``store_smem_rows``) and one-row TMA gathers (``start_row_gathers``, ``gather_rows``).
Imports only JAX and ``tiling``.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.experimental import pallas as pl
from jax.experimental.pallas import mosaic_gpu as plgpu

try:  # Pallas' Mosaic GPU interpreter: private in JAX 0.10, needed for interpret mode only
    from jax._src.pallas.mosaic_gpu.interpret import gpu_callbacks as _gpu_callbacks
    from jax._src.pallas.mosaic_gpu.interpret.params import InterpretGPUParams
except ImportError:  # a JAX that moved them (e.g. a GPU image's): compiled kernels still run
    _gpu_callbacks = None

    class InterpretGPUParams:
        """Stands in for the missing class, so that isinstance checks stay valid."""

from aristax.pallas_kernels.tiling import varying_like

INPUT_DTYPES = (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
OUT_DTYPES = (jnp.dtype(jnp.float32), jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16))
ALIGN = 64  # tile widths are multiples of this (one wgmma warpgroup: 64 rows).
ROW_ALIGN = 8  # GMEM row counts must be multiples of this (TMA tiling of swizzled SMEM).
# A 1-D row of a tile spread over a warpgroup's 128 threads: epilogues that scale or
# reduce single rows need row widths that are multiples of this (layout inference
# failed at 64 columns).
WARPGROUP_ROW = 128
H100_SMS = 132  # SM count used when lowering for CUDA on a host without a GPU.
SMEM_BYTES = 227 * 1024  # SMEM per thread block on compute capability 9.0
INTERPRET_PROGRAMS = 2  # persistent programs simulated in interpret mode
COMPILER_PARAMS = plgpu.CompilerParams(
    lowering_semantics=plgpu.LoweringSemantics.Warpgroup
)


def interpret_params(*, detect_races: bool = True) -> InterpretGPUParams:
    """The interpreter settings ``interpret=True`` stands for.

    Out-of-bounds reads (a row tile running past M) give NaN instead of raising,
    as TMA allows them (it fills zeros); uninitialized memory is NaN.

    Raises:
      NotImplementedError: this JAX has no Mosaic GPU interpreter where JAX 0.10 has
        it (``jax._src.pallas.mosaic_gpu.interpret``).
    """
    if _gpu_callbacks is None:
        raise NotImplementedError(
            f"mosaic_gpu: interpret mode needs Pallas' Mosaic GPU interpreter at "
            f"jax._src.pallas.mosaic_gpu.interpret (JAX 0.10); jax {jax.__version__} has "
            f"none there. Run the compiled kernels (interpret=False) on a Hopper GPU.")
    return InterpretGPUParams(
        detect_races=detect_races,
        out_of_bounds_reads="uninitialized",
        uninitialized_memory="nan",
    )


def races_found() -> bool:
    """Whether the last interpreted kernel (with race detection on) saw a data race."""
    races = getattr(_gpu_callbacks, "_races", None)
    return bool(races is not None and races.races_found)


def reset_interpret_state() -> None:
    """Clear the interpreter's global state (needed after a kernel raised)."""
    if _gpu_callbacks is not None:
        _gpu_callbacks.reset_gpu_interpret_mode_state()


def resolve_interpret(interpret) -> bool | InterpretGPUParams:
    """None -> interpret iff JAX's default backend is the CPU (the front door's rule)."""
    return jax.default_backend() == "cpu" if interpret is None else interpret


def interpret_arg(interpret) -> InterpretGPUParams | None:
    if isinstance(interpret, InterpretGPUParams):
        return interpret
    return interpret_params() if interpret else None


def num_programs(interpret) -> int:
    """Persistent programs: the GPU's SM count (132, an H100, when cross-lowering)."""
    if interpret:
        return INTERPRET_PROGRAMS
    if jax.default_backend() == "gpu":
        return int(getattr(jax.devices()[0], "core_count", H100_SMS) or H100_SMS)
    return H100_SMS


def platform_reason(interpret) -> str | None:
    """Why the kernel cannot run here in this mode (None when it can): compiled, it
    needs a Hopper GPU or the CPU (cross-lowering); interpreted, this JAX's Mosaic GPU
    interpreter."""
    if interpret:
        return None if _gpu_callbacks is not None else (
            f"interpret mode needs Pallas' Mosaic GPU interpreter, which jax "
            f"{jax.__version__} does not have where JAX 0.10 has it")
    backend = jax.default_backend()
    if backend == "cpu":
        return None  # cross-lowering for CUDA with jax.export
    if backend != "gpu":
        return f"Mosaic GPU needs a CUDA GPU; the default backend is {backend!r}"
    cc = str(getattr(jax.devices()[0], "compute_capability", ""))
    if not cc.startswith("9."):
        return f"wgmma needs compute capability 9.x (Hopper); this GPU has {cc or '?'}"
    return None


def dtype_reason(a_dtype, b_dtype, out_dtype) -> str | None:
    if a_dtype != b_dtype or jnp.dtype(a_dtype) not in INPUT_DTYPES:
        return (f"inputs must both be bfloat16 or both float16 (float32 would run as "
                f"TF32 on wgmma); got {a_dtype} and {b_dtype}")
    if jnp.dtype(out_dtype) not in OUT_DTYPES:
        return f"out_dtype must be one of {[str(d) for d in OUT_DTYPES]}; got {out_dtype}"
    return None


def raise_if(op: str, *reasons: str | None) -> None:
    """NotImplementedError "{op}: {reason}" for the first reason that is not None (the
    front door then tries the next backend)."""
    for reason in reasons:
        if reason:
            raise NotImplementedError(f"{op}: {reason}")


def band_order(lin, rows: int, cols: int, band: int) -> tuple[jax.Array, jax.Array]:
    """(row, col) int32 of the ``lin``-th tile of a [rows, cols] grid of output tiles,
    visited in bands of ``band`` columns (the last band holds what is left): within a
    band row by row, each row's columns in order; the bands left to right, every other
    one with its rows backwards, so that consecutive tiles across a band boundary share
    their row. With ``band >= cols`` this is row-major order.

    Why: a persistent loop runs its next tiles (one per SM) at once. In row-major order
    they are about one row of all columns, so each row tile reads every column block of
    the right operand; where that operand is larger than L2 (one Mixtral expert's
    [4096, 14336] bf16 is 117 MB; Hopper's L2 is 50 MB), it is read from HBM once per
    row tile. In bands, the tiles in flight cover about #SMs / band rows of ``band``
    columns, and each operand block they share is read once."""
    band = min(band, cols)
    lin = jnp.asarray(lin, jnp.int32)
    if band == cols:
        return jax.lax.div(lin, jnp.int32(cols)), jax.lax.rem(lin, jnp.int32(cols))
    b = jax.lax.div(lin, jnp.int32(rows * band))
    within = lin - b * (rows * band)
    if cols % band:  # the last band is narrower
        width = jnp.where(b < cols // band, jnp.int32(band), jnp.int32(cols % band))
    else:
        width = jnp.int32(band)
    r = jax.lax.div(within, width)
    col = b * band + within - r * width
    return jnp.where(jax.lax.rem(b, jnp.int32(2)) == 0, r, rows - 1 - r), col


def release_delay(steps: int) -> int:
    """Steps a wgmma may keep its SMEM buffer after issue: 1 iff the pipeline has 2+."""
    return 1 if steps > 1 else 0


def mma(acc_ref, a, b, steps: int) -> None:
    """acc[bm,bn] += a[bm,bk] @ b[bk,bn] on the tensor cores (async wgmma).

    With one pipeline buffer the next TMA copy overwrites this step's operands, so
    the wgmma is waited for here; otherwise the next wgmma's implicit wait covers it.
    """
    plgpu.wgmma(acc_ref, a, b)
    if not release_delay(steps):
        plgpu.wgmma_wait(0)


def store_rows(tile, out_gmem, row0, lo, hi, col0, max_rows: int) -> None:
    """out[row0+lo : row0+hi, col0 : col0+bn] = tile[lo:hi] via SMEM and TMA stores."""

    def scope(o_smem):
        o_smem[...] = tile
        store_smem_rows(o_smem, out_gmem, row0, lo, hi, col0, max_rows)

    pl.run_scoped(scope, plgpu.SMEM(tile.shape, out_gmem.dtype))


def store_smem_rows(o_smem, out_gmem, row0, lo, hi, col0, max_rows: int, *,
                    wait: bool = True) -> None:
    """out[row0+lo : row0+hi, col0 : col0+bn] = o_smem[lo:hi] by TMA stores.

    ``hi - lo`` is only known at run time, a TMA box's shape at compile time: the
    rows go out as a ladder of power-of-two boxes (largest first), one per set bit
    of ``hi - lo``. ``max_rows`` (<= the tile height) bounds ``hi - lo``. With
    ``wait=False`` the stores stay in flight: the caller waits
    (``plgpu.wait_smem_to_gmem(0, wait_read_only=True)``) before it writes ``o_smem``
    again and before the kernel ends.
    """
    bn = o_smem.shape[1]
    plgpu.commit_smem()
    size = hi - lo
    offset = lo
    rows = 1 << int(math.log2(max_rows))
    while rows >= 1:
        this = rows

        @pl.when((size & this) != 0)
        def _():
            plgpu.copy_smem_to_gmem(
                o_smem.at[pl.ds(offset, this)],
                out_gmem.at[pl.ds(row0 + offset, this), pl.ds(col0, bn)],
            )

        offset = offset + (size & this)
        rows //= 2
    if wait:
        plgpu.wait_smem_to_gmem(0, wait_read_only=True)


def transposed(ref, scratch=None):
    """ref^T [cols, rows] (SMEM) as a wgmma operand.

    Compiled: a transposed view (wgmma reads MN-major operands from SMEM). The
    interpreter's wgmma cannot apply a transposed view (jax 0.10.2: ``TransposeTransform``
    has no ``indices`` in ``to_range``), so there ``scratch`` (SMEM [cols, rows])
    receives the transpose through registers first."""
    if scratch is None:
        return ref.transpose((1, 0))  # plgpu.transpose_ref is deprecated in JAX 0.11
    scratch[...] = ref[...].T
    plgpu.commit_smem()
    return scratch


def with_transpose_scratch(scope, acc_type, shape, dtype, interpret: bool):
    """``scope(acc_ref)`` in a scope holding the accumulator ``acc_type``; in interpret
    mode ``scope(acc_ref, scratch)`` with an SMEM scratch of ``shape`` for
    ``transposed`` (the interpreter allocates registers and SMEM in separate scopes)."""
    if not interpret:
        return pl.run_scoped(scope, acc_type)
    return pl.run_scoped(
        lambda scratch: pl.run_scoped(lambda acc: scope(acc, scratch), acc_type),
        plgpu.SMEM(shape, dtype))


def gmm_tile(lhs_gmem, rhs_gmem, block, ni, tiles, *, rhs_transposed: bool = False,
             interpret: bool = False) -> jax.Array:
    """f32[bm,bn] = lhs[block rows, :] @ rhs[:, ni cols] with a pipelined K loop; with
    ``rhs_transposed``, rhs_gmem is rhs^T [N, K] and its [bn, bk] tiles enter the wgmma
    as ``transposed`` views (no transposed copy of rhs in GMEM).

    ``tiles``: any object with ``block_m, block_n, block_k, max_concurrent_steps``
    (``ragged_dot.mosaic_gpu.MosaicTiles``' forward fields)."""
    bm, bn, bk, steps = tiles.block_m, tiles.block_n, tiles.block_k, tiles.max_concurrent_steps
    k = lhs_gmem.shape[1]
    delay = release_delay(steps)
    if rhs_transposed:
        rhs_spec = plgpu.BlockSpec((bn, bk), lambda kk: (ni, kk), delay_release=delay)
    else:
        rhs_spec = plgpu.BlockSpec((bk, bn), lambda kk: (kk, ni), delay_release=delay)

    def scope(acc_ref, scratch=None):
        def step(_, a, b):
            mma(acc_ref, a, transposed(b, scratch) if rhs_transposed else b, steps)

        plgpu.emit_pipeline(
            step,
            grid=(k // bk,),
            in_specs=[plgpu.BlockSpec((bm, bk), lambda kk: (block, kk), delay_release=delay),
                      rhs_spec],
            max_concurrent_steps=steps,
        )(lhs_gmem, rhs_gmem)
        return acc_ref[...]

    return with_transpose_scratch(scope, plgpu.ACC((bm, bn), jnp.float32), (bk, bn),
                                  rhs_gmem.dtype, rhs_transposed and interpret)


def launch(body, out_type, interpret, *, warpgroups: int = 1):
    """A persistent Mosaic GPU kernel over ``grid=(programs,)`` named "sm", whose
    outputs vary like its operands inside ``shard_map`` (``varying_like``). With
    ``warpgroups`` > 1 each program runs that many warpgroups, named "wg"."""
    threads = {} if warpgroups == 1 else dict(num_threads=warpgroups, thread_name="wg")
    kernel = plgpu.kernel(
        body,
        out_type=out_type,
        grid=(num_programs(interpret),),
        grid_names=("sm",),
        compiler_params=COMPILER_PARAMS,
        interpret=interpret_arg(interpret),
        **threads,
    )
    return lambda *operands: varying_like(kernel(*operands), *operands)


def zero_row(d: int, dtype) -> jax.Array:
    """A [1, d] zero row in GMEM: the TMA source of rows that must read as zero."""
    return jnp.zeros((1, d), dtype)


def start_row_gathers(src_gmem, zero_gmem, buf, barrier, source_row, col0,
                      block_d) -> None:
    """Issue one one-row TMA copy per row of ``buf`` (SMEM [R, block_d]):
    buf[r] = src[row, col0 : col0 + block_d] where ``source_row(r) -> (row, keep)``
    keeps the row, else ``zero_gmem``'s row; ``barrier`` (R arrivals) completes when
    they have landed, so every row arrives exactly once."""

    @pl.loop(0, buf.shape[0])
    def _(r):
        row, keep = source_row(r)
        dst = buf.at[pl.ds(r, 1)]

        @pl.when(keep)
        def _():
            plgpu.copy_gmem_to_smem(src_gmem.at[pl.ds(row, 1), pl.ds(col0, block_d)],
                                    dst, barrier)

        @pl.when(jnp.logical_not(keep))
        def _():
            plgpu.copy_gmem_to_smem(zero_gmem.at[:, pl.ds(col0, block_d)], dst, barrier)


def gather_rows(src_gmem, zero_gmem, buf, barrier, source_row, col0, block_d) -> None:
    """``start_row_gathers`` and wait for them.

    ``commit_smem`` first: the TMA copies write ``buf`` through the async proxy, which
    is ordered after this warpgroup's earlier reads of ``buf`` (the previous tile's or
    buffer's) only by that fence (JAX 0.11's interpreter reports the race without it).
    """
    plgpu.commit_smem()
    start_row_gathers(src_gmem, zero_gmem, buf, barrier, source_row, col0, block_d)
    plgpu.barrier_wait(barrier)
