"""A small-T MoE path for decoding: read only the experts that some token selected.

Decoding one token touches K of the E experts, so its cost should not grow with E.
The general path (``aristax.moe.moe``) groups rows with grouped GEMMs over the stacked
[E, D, F] weights; for a handful of tokens that reads (or, on XLA:CPU, copies) every
expert. Here each expert's weights are separate arrays (``expert_views``, made once
outside ``jit``) and expert e runs under ``lax.cond(any token selected e)``: an
unselected expert costs a predicate, a selected one exactly one read of its weights.
Slicing the stacked weights inside ``jit`` instead makes XLA:CPU copy the slice before
the dot, which triples the memory traffic of a memory-bound decode step.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.
Numerics follow HF ``MixtralExperts``: y = sum over selected e (ascending) of
w_e * down_e(silu(x gate_e) * (x up_e)).
"""

from __future__ import annotations

import jax
import jax.numpy as jnp

from aristax import routing as routing_lib
from aristax.config import RouterConfig
from aristax.experts import dense_mlp
from aristax.moe import router_logits

# Up to this many tokens, ``Mixtral`` uses this path when it is given expert views
# (each selected expert then runs on all T rows: T*E FLOPs, trivial at small T).
MAX_TOKENS = 64


def use_sparse(num_tokens: int) -> bool:
    """Whether ``Mixtral`` (given expert views) should run ``sparse_moe`` for T tokens.

    Always on CPU: measured on 2 cores (D=1024, F=4096, E=6, K=2), one layer takes
    228 ms here vs 655 ms in ``aristax.moe`` at T=80, and 1.1 s vs 2.4 s at T=512,
    because XLA:CPU's ``lax.ragged_dot`` computes every group densely. Elsewhere only
    for T <= MAX_TOKENS, where grouped GEMMs are the better choice beyond that.
    """
    return num_tokens <= MAX_TOKENS or jax.default_backend() == "cpu"

ExpertViews = tuple[tuple[jax.Array, ...], tuple[jax.Array, ...], tuple[jax.Array, ...]]


def expert_views(moe_module) -> ExpertViews:
    """Split an ``aristax.MoE``'s stacked experts into per-expert arrays.

    Returns (gates, ups, downs): E arrays [D, F], E arrays [D, F], E arrays [F, D].
    This copies the expert weights once (call it outside ``jit``).
    """
    ex = moe_module.experts
    if ex.gate_edf is None:
        raise ValueError("expert_views needs a gated activation (swiglu/geglu)")
    split = lambda w: tuple(jnp.asarray(w[...][e]) for e in range(w.shape[0]))  # noqa: E731
    return split(ex.gate_edf), split(ex.up_edf), split(ex.down_efd)


def sparse_moe(
    x: jax.Array, router_de: jax.Array, views: ExpertViews, config: RouterConfig,
    activation: str = "swiglu",
) -> tuple[jax.Array, jax.Array]:
    """Mixtral MoE for a few tokens, reading only the selected experts.

    Args:
      x: [T, D].
      router_de: [D, E] router weight.
      views: ``expert_views`` of the layer.
      config: routing config (``MoEConfig.router_config``); token-choice routers only.
      activation: the experts' gated activation ("swiglu" or "geglu").
    Returns:
      (y [T, D] in x's dtype, router_logits float32[T, E]).
    """
    if config.router == "expert_choice":
        raise ValueError("sparse_moe supports token-choice routers only")
    gates, ups, downs = views
    T, D = x.shape
    E = len(gates)
    logits = router_logits(x, router_de)
    routing = routing_lib.route(logits, config)
    weights = jnp.where(routing.mask, routing.weights, 0.0)
    combine = jnp.zeros((T, E), jnp.float32).at[
        jnp.arange(T)[:, None], routing.expert_ids].add(weights)  # [T, E]
    selected = jnp.any((routing.expert_ids[..., None] == jnp.arange(E)) &
                       routing.mask[..., None], axis=(0, 1))  # [E]

    def expert(e):
        def run(x):
            out = dense_mlp(x, gates[e], ups[e], downs[e], activation=activation)
            return out.astype(jnp.float32) * combine[:, e:e + 1]

        return run

    y = jnp.zeros((T, D), jnp.float32)
    for e in range(E):
        y = y + jax.lax.cond(selected[e], expert(e),
                             lambda x: jnp.zeros((T, D), jnp.float32), x)
    return y.astype(x.dtype), logits
