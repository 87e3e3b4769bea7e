"""The front door of the fused expert MLP: validation, backend choice, the custom_vjp.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
M = T*K rows in expert order.

A backend is a module in this folder (the protocol of ``frontdoor``) with
  ``check(x, weights, up_edf, *, interpret)``: NotImplementedError with the reason
      when it cannot serve (forward and backward);
  ``moe_mlp(x, sort_order, weights, group_sizes, num_valid, gate_edf, up_edf,
      down_efd, *, activation, tiles, interpret)`` -> y [T, D] float32;
  ``backward_tiles(tiles)``: the ``ragged_dot`` tiles of its backward GEMMs;
and its backward runs on the backends of the same name of ``ragged_dot`` and
``permute``, unless the backend has a backward of its own:
  ``forward(x, sort_order, weights, group_sizes, num_valid, gate, up, down, biases, *,
      mlp, tiles, interpret)`` -> (y, saved) and
  ``backward(residuals, saved, dy, *, mlp, tiles, interpret)`` -> the gradients of the
      residuals (x, sort_order, weights, group_sizes, num_valid, gate, up, down,
      biases) as the forward took them ("xla" does: its tile loops gather and
      scatter themselves and save the pre-activations), ``mlp`` a
      ``reference.ExpertMlp`` and biases (gate [E, F], up [E, F], down [E, D], each
      or None).
Options beyond the plain MLP (``reference.EXTRAS``: "relu", "clamped_swiglu",
"expert_bias", "input_weights") reach only a backend that lists them in its
``EXTRAS`` (it needs a backward of its own); the others are passed over for them.
"reference" is the unfused composition under plain JAX autodiff.

The backward of a kernel backend (``_kernel_bwd``) is unfused and runs on the
backends of the same name of ``permute`` and ``ragged_dot``. With w_m = weights.flat
[sort_order[m]] the weight of row m, it recomputes
  rows = permute(x);  gate, up = rows @ {gate, up}[e];  h = act(gate, up)
and, for the cotangent dy [T, D] (float32), gathers dy_rows = permute(dy) and uses
out_rows[m] = h[m] @ down[e] only through g = dy_rows @ down[e]^T ([M, F]):
  dweights[assignment of m] = <h[m], g[m]>     (= <dy[token], out_rows[m]>, no out_rows)
  dh = w * g;  ddown = tgmm(h, w * dy_rows)
  dgate, dup = the activation's vjp (jnp) at (gate, up) applied to dh
  drows = [dgate | dup] @ [gate[e]^T; up[e]^T];  dgate_w, dup_w = tgmm(rows, dgate/dup)
  dx = permute_bwd(drows)                    (sum of a token's valid rows)
GEMM operands in the compute dtype, float32 accumulation (as ``ragged_dot``'s own
custom_vjp); rows past num_valid are zero in rows and dy_rows, so they add nothing.
sort_order, group_sizes and num_valid get no gradient.
"""

from __future__ import annotations

import functools
from types import ModuleType
from typing import Any

import jax
import jax.numpy as jnp

from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.moe_mlp import mosaic_gpu, reference, triton, xla
from aristax.pallas_kernels.permute import api as permute_api
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.tiling import vary_alike

OP = "moe_mlp"
BACKENDS: dict[str, ModuleType] = {
    "reference": reference, "triton": triton, "mosaic_gpu": mosaic_gpu, "xla": xla}
# On a GPU "xla" serves what Triton refuses or does not compute (expert biases, the
# clamped SwiGLU, weights on the input): on an H200 (gpu_check.py, bf16, 2026-11-27)
# its forward and backward took 38.7 ms against the reference's 184.5 (Mixtral shape)
# and 43.8 against 181.8 (fine-grained).
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {
    "gpu": ("triton", "xla", "reference"),
    "cuda": ("triton", "xla", "reference"),
    "cpu": ("xla", "reference"),
}
# What ``fused_backend(None, ...)`` (the MoE layer's default, ``implementation=None``)
# runs per platform; elsewhere the layer stays unfused. On the CPU the fused "xla"
# loop took 0.60-0.72x the unfused layer's time (experiments/benchmarks/moe_layer.py);
# on a GPU the unfused layer was the fastest (gpu_check.py).
LAYER_DEFAULT: dict[str, str] = {"cpu": "xla"}


def _fail(name: str, expected: str, got: Any) -> None:
    raise ValueError(f"{OP}: {name} must be {expected}; got {got}")


def _shape(arr) -> str:
    return f"{arr.dtype}{list(arr.shape)}"


def _validate(x, sort_order, weights, group_sizes, gate_edf, up_edf, down_efd,
              activation, num_valid, biases, weight_side) -> None:
    """ValueError naming the argument and the expected shape or value."""
    activations = reference.ACTIVATIONS + reference.OTHER_ACTIVATIONS
    if activation not in activations:
        _fail("activation", f"one of {activations}", repr(activation))
    if weight_side not in ("output", "input"):
        _fail("weight_side", "'output' or 'input'", repr(weight_side))
    if x.ndim != 2 or not jnp.issubdtype(x.dtype, jnp.floating):
        _fail("x", "a floating [T, D] array", _shape(x))
    (T, D) = x.shape
    if weights.ndim != 2 or weights.shape[0] != T or not jnp.issubdtype(weights.dtype,
                                                                        jnp.floating):
        _fail("weights", f"a floating [T, K] = [{T}, K] array (T from x)", _shape(weights))
    M = T * weights.shape[1]
    if sort_order.shape != (M,) or not jnp.issubdtype(sort_order.dtype, jnp.integer):
        _fail("sort_order", f"an integer array of shape [T*K] = [{M}]", _shape(sort_order))
    if group_sizes.ndim != 1 or not jnp.issubdtype(group_sizes.dtype, jnp.integer):
        _fail("group_sizes", "an integer array of shape [E]", _shape(group_sizes))
    E = group_sizes.shape[0]
    if up_edf.ndim != 3 or up_edf.shape[:2] != (E, D):
        _fail("up_edf", f"[E, D, F] = [{E}, {D}, F] (E from group_sizes, D from x)",
              _shape(up_edf))
    F = up_edf.shape[2]
    if down_efd.shape != (E, F, D):
        _fail("down_efd", f"[E, F, D] = [{E}, {F}, {D}]", _shape(down_efd))
    gated = activation in reference.GATED
    if gated and (gate_edf is None or gate_edf.shape != up_edf.shape):
        _fail("gate_edf", f"[E, D, F] = [{E}, {D}, {F}] for {activation!r}",
              None if gate_edf is None else _shape(gate_edf))
    if not gated and gate_edf is not None:
        _fail("gate_edf", f"None for {activation!r}", _shape(gate_edf))
    for name, bias, shape in zip(("gate_bias_ef", "up_bias_ef", "down_bias_ed"), biases,
                                 ((E, F), (E, F), (E, D))):
        if bias is not None and bias.shape != shape:
            _fail(name, f"None or [{', '.join(map(str, shape))}]", _shape(bias))
    if biases[0] is not None and not gated:
        _fail("gate_bias_ef", f"None for {activation!r} (no gate projection)",
              _shape(biases[0]))
    frontdoor.check_num_valid("moe_mlp", num_valid)


@functools.partial(jax.custom_vjp, nondiff_argnums=(9, 10, 11, 12, 13))
def _kernel_moe_mlp(x, sort_order, weights, group_sizes, nv, gate, up, down, biases,
                    name, mlp, interpret, tiles, precision):
    """y [T, D] float32 by backend ``name``'s fused kernels. ``precision``:
    ``frontdoor.matmul_precision()`` at the call, for the backward."""
    del precision  # the forward is traced in the caller's context
    residuals = (x, sort_order, weights, group_sizes, nv, gate, up, down, biases)
    return _forward(name, mlp, interpret, tiles, residuals)[0]


def _forward(name, mlp, interpret, tiles, residuals):
    """(y, what the backend's own backward reads, or None) of backend ``name``."""
    backend = BACKENDS[name]
    if hasattr(backend, "backward"):  # saves what its own backward reads
        return backend.forward(*residuals, mlp=mlp, tiles=tiles, interpret=interpret)
    # the kernels compute the plain MLP alone (fused_backend and moe_mlp pick by EXTRAS)
    return backend.moe_mlp(*residuals[:-1], activation=mlp.activation, tiles=tiles,
                           interpret=interpret), None


def _kernel_fwd(x, sort_order, weights, group_sizes, nv, gate, up, down, biases,
                name, mlp, interpret, tiles, precision):
    del precision
    residuals = (x, sort_order, weights, group_sizes, nv, gate, up, down, biases)
    y, saved = _forward(name, mlp, interpret, tiles, residuals)
    return y, (residuals, saved)


def _gemms(name: str, group_sizes, tiles, interpret: bool):
    """(gmm, gmm_t, tgmm) of ragged_dot's backend ``name`` bound to group_sizes and
    tiles; gmm_t(lhs, rhs) = lhs[m] @ rhs[group]^T (``ragged_dot_api.gmm_t``)."""
    backend = ragged_dot_api.BACKENDS[name]
    kw = dict(tiles=tiles, interpret=interpret)

    def gmm(lhs, rhs, dt):
        return backend.gmm(lhs, rhs, group_sizes, out_dtype=dt, **kw)

    def gmm_t(lhs, rhs, dt):
        return ragged_dot_api.gmm_t(name, lhs, rhs, group_sizes, out_dtype=dt, **kw)

    return gmm, gmm_t, lambda lhs, dout, dt: backend.tgmm(lhs, dout, group_sizes,
                                                          out_dtype=dt, **kw)


def _hidden_and_vjp(gmm, rows, gate, up, activation: str):
    """(h [M, F] float32, its vjp over the pre-activations) recomputed from rows."""
    pre = (gmm(rows, up, jnp.float32),)
    return reference.hidden_vjp(pre if gate is None else (gmm(rows, gate, jnp.float32),) + pre,
                                activation)


def _assignment_values(values, sort_order, shape):
    """[T, K] from per-row values [M]: out.flat[sort_order[m]] = values[m]."""
    return jnp.zeros_like(values).at[sort_order].set(values).reshape(shape)


def _kernel_bwd(name, mlp, interpret, tiles, precision, residuals, dy):
    """Gradients for x, weights, gate, up, down and the biases (module docstring); None
    for the integer arguments. Traced at the forward call's matmul precision."""
    with jax.default_matmul_precision(precision):
        return frontdoor.guard_second_derivative(OP, name, functools.partial(
            _backend_grads, name, mlp, interpret, tiles), residuals, dy)


def _backend_grads(name, mlp, interpret, tiles, residuals, dy):
    residuals, saved = residuals
    backend = BACKENDS[name]
    if hasattr(backend, "backward"):
        return backend.backward(residuals, saved, dy, mlp=mlp, tiles=tiles,
                                interpret=interpret)
    return _kernel_grads(name, mlp.activation, interpret, tiles, residuals[:-1], dy) + (
        residuals[-1],)  # the biases: all None here


def _kernel_grads(name, activation, interpret, tiles, residuals, dy):
    x, sort_order, weights, group_sizes, nv, gate, up, down = residuals
    dtype, top_k, f32 = x.dtype, weights.shape[1], jnp.float32
    gmm, gmm_t, tgmm = _gemms(name, group_sizes, BACKENDS[name].backward_tiles(tiles),
                              interpret)
    permute = functools.partial(permute_api.BACKENDS[name].permute, sort_order=sort_order,
                                num_valid=nv, top_k=top_k, interpret=interpret)
    rows = permute(x)
    h, act_vjp = _hidden_and_vjp(gmm, rows, gate, up, activation)
    h = h.astype(dtype)
    dy_rows = permute(dy.astype(f32))  # [M, D], zero past nv
    g = gmm_t(dy_rows.astype(dtype), down, f32)
    w = jnp.take(weights.reshape(-1).astype(f32), sort_order)[:, None]
    dweights = _assignment_values(jnp.sum(h.astype(f32) * g, axis=1), sort_order, weights.shape)
    ddown = tgmm(h, (w * dy_rows).astype(dtype), down.dtype)
    dh = (w * g).astype(dtype).astype(f32)  # h entered the down GEMM in the compute dtype
    d_pre = [d.astype(dtype) for d in act_vjp(dh)]
    mats = (up,) if gate is None else (gate, up)
    # One GEMM over [dgate | dup] [M, 2F] and [gate | up] [E, D, 2F] read transposed
    drows = gmm_t(jnp.concatenate(d_pre, axis=1), jnp.concatenate(mats, axis=2), f32)
    dmats = [tgmm(rows, d, m.dtype) for d, m in zip(d_pre, mats)]
    dx = permute_api.BACKENDS[name].permute_bwd(drows, sort_order, nv, top_k=top_k,
                                                x_dtype=dtype, interpret=interpret)
    dgate, dup = (None, dmats[0]) if gate is None else dmats
    return (dx, None, dweights.astype(weights.dtype), None, None, dgate, dup, ddown)


_kernel_moe_mlp.defvjp(_kernel_fwd, _kernel_bwd)


def extras_of(name: str) -> frozenset[str]:
    """The ``reference.EXTRAS`` backend ``name`` computes (its ``EXTRAS``; none when it
    declares none): "reference" all, "xla" all, the GPU kernels none."""
    return frozenset(getattr(BACKENDS[name], "EXTRAS", ()))


def fused_backend(implementation: frontdoor.Implementation, x, weights, up_edf, *,
                  interpret: bool | None = None,
                  extras: frozenset[str] = frozenset()) -> str | None:
    """The kernel backend ``moe_mlp`` would run for ``implementation``, or None.

    For ``implementation=None``: ``LAYER_DEFAULT``'s backend for the platform if it
    serves (the CPU: "xla"), else None (callers keep their unfused path). None also
    when "reference" comes before any kernel that serves, or every kernel refuses or
    lacks one of ``extras`` (``ExpertMlp.extras``: what the call asks beyond the plain
    MLP). Names that this op does not register but ``ragged_dot`` does (e.g.
    "mosaic_gpu") are skipped; others raise ValueError. x [T, D], weights [T, K],
    up_edf [E, D, F] as in ``moe_mlp``.
    """
    if implementation is None:
        implementation = LAYER_DEFAULT.get(jax.default_backend())
        if implementation is None:
            return None
    known = {**ragged_dot_api.BACKENDS, **BACKENDS}
    names = frontdoor.candidates(OP, known, DEFAULT_ORDER, implementation)
    interpret = frontdoor.resolve_interpret(interpret)
    for name in (n for n in names if n in BACKENDS):
        if name == "reference":
            return None
        if not extras <= extras_of(name):
            continue
        try:
            BACKENDS[name].check(x, weights, up_edf, interpret=interpret)
        except NotImplementedError:
            continue
        return name
    return None


def _computing(names: list[str], extras: frozenset[str]) -> list[str]:
    """The backends of ``names`` that compute ``extras``; NotImplementedError naming
    what is missing when none does."""
    kept = [n for n in names if extras <= extras_of(n)]
    if not kept:
        raise NotImplementedError(
            f"{OP}: no backend in {names} computes {sorted(extras)} (only "
            f"{[n for n in BACKENDS if extras <= extras_of(n)]} do); add 'reference' to "
            f"the list or use the plain MLP")
    return kept


def moe_mlp(
    x: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    gate_edf: jax.Array | None,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    activation: str,
    num_valid: jax.Array | int | None = None,
    gate_bias_ef: jax.Array | None = None,
    up_bias_ef: jax.Array | None = None,
    down_bias_ed: jax.Array | None = None,
    weight_side: str = "output",
    swiglu_limit: float = 7.0,
    swiglu_alpha: float = 1.702,
    implementation: frontdoor.Implementation = None,
    interpret: bool | None = None,
    tiles: Any = None,
) -> jax.Array:
    """The routed experts of the dropless MoE, from tokens to the combined output.

    rows[m] = x[sort_order[m] // K] (expert order); h = act(rows @ gate[e] + bg[e],
    rows @ up[e] + bu[e]) per expert group; out_rows = h @ down[e] + bd[e];
    y[t] = sum_k weights[t, k] * out_rows[row of assignment t*K + k] (with
    ``weight_side="input"``: rows[m] scaled by its assignment's weight instead, and
    y[t] the plain sum). Rows at or past ``num_valid`` contribute nothing. Equals
    ``aristax.moe``'s dropless path (permute -> expert_mlp -> combine), casts included.

    Args:
      x: [T, D] tokens in the compute dtype. sort_order: int[T*K] flat assignment of each
        row in expert order (``route``). weights: [T, K] routing weights.
      group_sizes: int[E] rows per expert.
      gate_edf: [E, D, F] ("swiglu", "geglu", "clamped_swiglu") or None ("gelu",
        "relu"). up_edf: [E, D, F]. down_efd: [E, F, D]. Cast to x's dtype (their
        gradients flow back through the cast).
      activation: "swiglu" | "geglu" | "gelu" (exact erf GELU) on every backend;
        "relu" | "clamped_swiglu" (GPT-OSS: ``aristax.experts``) on those with these
        ``EXTRAS`` ("xla", "reference").
      num_valid: routed rows (default ``sum(group_sizes)``).
      gate_bias_ef, up_bias_ef: [E, F]; down_bias_ed: [E, D]: expert biases (GPT-OSS),
        or None. weight_side: "output" (default) or "input" (Llama 4). Both, like the
        last two activations, are ``EXTRAS`` that only some backends compute.
      swiglu_limit, swiglu_alpha: "clamped_swiglu"'s clamp and sigmoid slope.
      implementation: backend name or ordered list ("triton", "mosaic_gpu", "xla",
        "reference"); None = ``DEFAULT_ORDER`` ("triton", "xla", "reference" on GPU:
        at the Mixtral shape, T 4096, on an H200 forward and backward took 35 ms on
        Triton and 65 ms on Mosaic GPU, ``gpu_check.py``; "xla", "reference" on CPU).
        Backends that do not compute the call's ``EXTRAS`` are skipped.
      interpret: Pallas interpret mode; None = iff the default backend is the CPU
        (pass False to lower the real kernels, e.g. under ``jax.export``).
      tiles: the backend's tiles (``MoeMlpTiles`` for "triton", ``MosaicMoeMlpTiles``
        for "mosaic_gpu", ``XlaTiles`` for "xla"), a mapping {backend: tiles}, or None
        (heuristics).
    Returns:
      y [T, D] in the accumulation dtype (float32; float64 for float64 inputs).
      Differentiable in x, weights, the expert weights and the biases.
    """
    biases = (gate_bias_ef, up_bias_ef, down_bias_ed)
    group_sizes = frontdoor.group_sizes_array(OP, group_sizes)
    _validate(x, sort_order, weights, group_sizes, gate_edf, up_edf, down_efd,
              activation, num_valid, biases, weight_side)
    mlp = reference.ExpertMlp(activation, float(swiglu_limit), float(swiglu_alpha),
                              weight_side == "input")
    gate, up, down = (None if w is None else w.astype(x.dtype)
                      for w in (gate_edf, up_edf, down_efd))
    sort_order, group_sizes = sort_order.astype(jnp.int32), group_sizes.astype(jnp.int32)
    names = _computing(frontdoor.candidates(OP, BACKENDS, DEFAULT_ORDER, implementation),
                       mlp.extras(any(b is not None for b in biases)))
    interpret = frontdoor.resolve_interpret(interpret)
    name = frontdoor.choose(OP, BACKENDS, names, x, weights, up, interpret=interpret)
    if name == "reference":
        return reference.moe_mlp(x, sort_order, weights, group_sizes, gate, up, down,
                                 mlp=mlp, biases=biases, num_valid=num_valid)
    nv = reference.valid_rows(num_valid, group_sizes)
    *operands, gb, ub, db = vary_alike(x, sort_order, weights, group_sizes, nv, gate, up, down,
                                       *biases)
    return _kernel_moe_mlp(*operands, (gb, ub, db), name, mlp, interpret,
                           frontdoor.tiles_for(tiles, name), frontdoor.matmul_precision())
