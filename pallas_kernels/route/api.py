"""The router's front door: validation, backend choice and the ``custom_vjp``.

Letters: T tokens, D model dim, E experts, K = top_k.

A backend is a module in this folder (the protocol of ``frontdoor``) with
  ``check(x, w_router, top_k, *, interpret)``: NotImplementedError with the reason
      when it cannot serve;
  ``route(x, w_router, bias, *, top_k, score, normalize, interpret)`` -> ``RouteOutput``
      with the reference's contract.
The backward pass is shared and written in ``jnp`` on the saved logits (it is O(T*E),
the forward's GEMM transpose aside), so a backend only implements the forward.
"""

from __future__ import annotations

import functools
from types import ModuleType

import jax
import jax.numpy as jnp
import numpy as np

from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.route import mosaic_gpu, reference, triton
from aristax.pallas_kernels.route.reference import SCORES, RouteOutput
from aristax.pallas_kernels.tiling import vary_alike

OP = "route"
BACKENDS: dict[str, ModuleType] = {
    "mosaic_gpu": mosaic_gpu, "triton": triton, "reference": reference}
# Timed on an H200 (T 4096, D 4096, E 8, K 2; gpu_check.py): Triton 0.056 ms, the
# reference 0.057, Mosaic GPU 0.065 forward; the router GEMM alone 0.041. Triton stays
# first where a kernel is named; Mosaic GPU is named explicitly.
DEFAULT_ORDER: dict[str, tuple[str, ...]] = {"gpu": ("triton", "reference")}


def _validate(x, w_router, bias, top_k: int, score: str, normalize: bool) -> None:
    """ValueError naming the argument and the expected shape or value."""
    if x.ndim != 2:
        raise ValueError(f"route: x must be [T, D]; got shape {tuple(x.shape)}")
    T, D = x.shape
    if w_router.ndim != 2 or w_router.shape[0] != D:
        raise ValueError(
            f"route: w_router must be [D, E] = [{D}, E] (D from x); got shape "
            f"{tuple(w_router.shape)}")
    E = w_router.shape[1]
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"route: bias must be [E] = [{E}] or None; got shape "
                         f"{tuple(bias.shape)}")
    for name, arr in (("x", x), ("w_router", w_router), ("bias", bias)):
        if arr is not None and not jnp.issubdtype(arr.dtype, jnp.floating):
            raise ValueError(f"route: {name} must be floating point; got {arr.dtype}")
    if not frontdoor.is_count(top_k) or not 1 <= top_k <= E:
        raise ValueError(f"route: top_k must be an int in [1, E={E}]; got {top_k!r}")
    if score not in SCORES:
        raise ValueError(f"route: score must be one of {SCORES}; got {score!r}")
    if not isinstance(normalize, (bool, np.bool_)):  # "no" would renormalise
        raise ValueError(f"route: normalize must be True or False; got {normalize!r}")


def _score_vjp(logits: jax.Array, ids: jax.Array, dweights: jax.Array,
               score: str, normalize: bool) -> jax.Array:
    """d loss / d logits [T, E] through the weights (selection is piecewise constant).

    With g = scores[ids] and w = g / sum_k g:  dg = (dw - sum_k dw w) / sum_k g;
    dscores = scatter of dg to ids; softmax: dl = p (ds - <ds, p>); sigmoid:
    dl = ds s (1 - s). Non-finite tokens (weights 0, logits replaced) get 0.
    """
    finite = reference.finite_tokens(logits)
    scores = reference.router_scores(jnp.where(finite[:, None], logits, 0.0), score)
    dg = dweights.astype(scores.dtype)
    if normalize:
        g = jnp.take_along_axis(scores, ids, axis=-1)
        total = jnp.sum(g, axis=-1, keepdims=True)
        ok = total >= jnp.finfo(total.dtype).tiny  # else the weights are 0 (normalize_rows)
        total = jnp.where(ok, total, 1.0)
        dg = jnp.where(ok, (dg - jnp.sum(dg * g, axis=-1, keepdims=True) / total) / total, 0.0)
    dg = jnp.where(finite[:, None], dg, 0.0)
    onehot = jax.nn.one_hot(ids, logits.shape[1], dtype=scores.dtype)  # [T, K, E]
    dscores = jnp.einsum("tk,tke->te", dg, onehot, precision=jax.lax.Precision.HIGHEST)
    if score == "softmax":
        dl = scores * (dscores - jnp.sum(dscores * scores, axis=-1, keepdims=True))
    else:
        dl = dscores * scores * (1.0 - scores)
    return jnp.where(finite[:, None], dl, 0.0)


@functools.partial(jax.custom_vjp, nondiff_argnums=(3, 4, 5, 6, 7))
def _route(x, w_router, bias, top_k, score, normalize, name, interpret):
    return BACKENDS[name].route(x, w_router, bias, top_k=top_k, score=score,
                                normalize=normalize, interpret=interpret)


def _route_fwd(x, w_router, bias, top_k, score, normalize, name, interpret):
    out = _route(x, w_router, bias, top_k, score, normalize, name, interpret)
    return out, (x, w_router, bias, out.logits, out.expert_ids)


def _route_bwd(top_k, score, normalize, name, interpret, residuals, cotangents):
    """dx = dlogits_total @ w^T, dw = x^T @ dlogits_total; the bias only selects.
    Tokens with a NaN or inf feature are left out of dw (their dlogits are 0, and inf
    times 0 would be NaN)."""
    del top_k, name, interpret
    x, w_router, bias, logits, ids = residuals
    dlogits = cotangents.logits.astype(logits.dtype) + _score_vjp(
        logits, ids, cotangents.weights, score, normalize)
    hi = jax.lax.Precision.HIGHEST
    dx = jnp.dot(dlogits, w_router.astype(logits.dtype).T, precision=hi)
    x_finite = jnp.where(jnp.all(jnp.isfinite(x), axis=-1, keepdims=True), x, 0)
    dw = jnp.dot(x_finite.astype(logits.dtype).T, dlogits, precision=hi)
    dbias = None if bias is None else jnp.zeros_like(bias)
    return dx.astype(x.dtype), dw.astype(w_router.dtype), dbias


_route.defvjp(_route_fwd, _route_bwd)


def route(
    x: jax.Array,
    w_router: jax.Array,
    *,
    top_k: int,
    score: str = "softmax",
    bias: jax.Array | None = None,
    normalize: bool = False,
    implementation: frontdoor.Implementation = None,
    interpret: bool | None = None,
) -> RouteOutput:
    """Token-choice router and dropless expert order in one call.

    logits = x @ w_router; scores = softmax (Switch eq. 1) or sigmoid (DeepSeek-V3
    eq. 15); ids = top_k(scores + bias) with lax.top_k's tie rule (lowest expert
    first); weights = scores[ids], renormalised over K when ``normalize``; counts and
    sort_order give the stable expert order of the T*K assignments (``aristax.dispatch``'s
    dropless layout). Equals ``aristax.routing.route`` with router "softmax_topk" or
    "sigmoid", num_groups=1 and routed_scaling_factor=1 (``reference`` module docstring).

    Args:
      x: [T, D] tokens. w_router: [D, E].
      top_k: K in [1, E]. score: "softmax" | "sigmoid".
      bias: float[E] aux-loss-free bias; changes the selection, never the weights,
        and gets a zero gradient.
      normalize: renormalise the K weights of each token to sum to 1.
      implementation: backend name or ordered list ("mosaic_gpu", "triton",
        "reference"); None = the platform default ("triton" then "reference" on
        GPU, "reference" elsewhere).
      interpret: Pallas interpret mode; None = iff the default backend is the CPU.
    Returns:
      ``RouteOutput(logits[T,E], expert_ids int32[T,K], weights[T,K], counts
      int32[E], sort_order int32[T*K])``; logits and weights are differentiable
      w.r.t. x and w_router.
    """
    _validate(x, w_router, bias, top_k, score, normalize)
    names = frontdoor.candidates(OP, BACKENDS, DEFAULT_ORDER, implementation)
    interpret = frontdoor.resolve_interpret(interpret)
    name = frontdoor.choose(OP, BACKENDS, names, x, w_router, int(top_k), interpret=interpret)
    return _route(*vary_alike(x, w_router, bias), int(top_k), score, bool(normalize), name,
                  interpret)
