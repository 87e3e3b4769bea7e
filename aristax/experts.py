"""Expert MLPs: routed experts over grouped rows, shared experts over every token.

Letters: M rows in expert order, D model dim, F hidden dim, E experts. GEMMs take
inputs in the compute dtype and accumulate in float32 (float64 for float64 inputs).

  swiglu: down(silu(x Wg) * x Wu)   (Shazeer 2020, "GLU Variants", eq. 6)
  geglu:  down(gelu(x Wg) * x Wu)   (ibid.; exact erf GELU, as torch's default)
  gelu:   down(gelu(x Wu))
  relu:   down(relu(x Wu))          (Switch Transformers, T5's MLP)
  clamped_swiglu: down((clip(x Wu, -l, l) + 1) * g * sigmoid(a g)), g = min(x Wg, l)
                                    (GPT-OSS; l = swiglu_limit, a = swiglu_alpha)
With expert biases (GPT-OSS) each projection adds its expert's bias: x Wg + bg[e],
x Wu + bu[e], down(...) + bd[e].
"""

from __future__ import annotations

import functools
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp

from aristax.config import MoEConfig, accumulation_dtype
from aristax.pallas_kernels import frontdoor, ragged_dot
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.ragged_dot.reference import row_groups
from aristax.pallas_kernels.moe_mlp.reference import hidden

# (gate [..., F] float32 or None, up [..., F] float32) -> hidden [..., F]
Activation = Callable[[jax.Array | None, jax.Array], jax.Array]


def activation_of(config: MoEConfig) -> Activation:
    """The experts' activation of ``config`` (its name and clamp parameters)."""
    return functools.partial(hidden, activation=config.activation,
                             limit=config.swiglu_limit, alpha=config.swiglu_alpha)


def expert_mlp(
    rows: jax.Array,
    group_sizes: jax.Array,
    gate_edf: jax.Array | None,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    activation: Activation,
    implementation: str | Sequence[str] | None = None,
    gate_bias_ef: jax.Array | None = None,
    up_bias_ef: jax.Array | None = None,
    down_bias_ed: jax.Array | None = None,
) -> jax.Array:
    """Routed experts over rows grouped by expert.

    Args:
      rows: [M, D] in the compute dtype; expert e owns ``group_sizes[e]`` consecutive
        rows (rows past the sum give zeros without biases, and are not to be read with
        them).
      group_sizes: int32[E].
      gate_edf: [E, D, F] (None without a gate). up_edf: [E, D, F]. down_efd: [E, F, D].
      activation: ``activation_of(config)``.
      implementation: the layer's rule, as for its other ops: each GEMM runs on the
        first ``ragged_dot`` backend named that serves it, else on the reference
        (None: the platform's default choice).
      gate_bias_ef, up_bias_ef: [E, F]; down_bias_ed: [E, D]: expert biases, or None.
    Returns:
      [M, D] in the accumulation dtype (float32, or float64 for float64 rows).
    """
    dtype = rows.dtype
    acc = accumulation_dtype(dtype)
    if implementation is not None:
        implementation = frontdoor.with_reference(implementation, ragged_dot_api.BACKENDS)
    biased = any(b is not None for b in (gate_bias_ef, up_bias_ef, down_bias_ed))
    expert = row_groups(group_sizes, rows.shape[0]) if biased else None

    def gemm(lhs, rhs, bias):
        out = ragged_dot(lhs, rhs.astype(dtype), group_sizes,
                         preferred_element_type=acc, implementation=implementation)
        return out if bias is None else out + jnp.take(bias.astype(acc), expert, axis=0)

    gate = None if gate_edf is None else gemm(rows, gate_edf, gate_bias_ef)
    h = activation(gate, gemm(rows, up_edf, up_bias_ef))
    return gemm(h.astype(dtype), down_efd, down_bias_ed)


def dense_mlp(
    x: jax.Array,
    gate_df: jax.Array | None,
    up_df: jax.Array,
    down_fd: jax.Array,
    *,
    activation: Activation,
) -> jax.Array:
    """One dense MLP on every token (the shared experts): x[T, D] -> [T, D] accumulated
    in float32 (float64 for float64 x)."""
    dtype = x.dtype
    acc = accumulation_dtype(dtype)

    def gemm(lhs, rhs):
        return jnp.dot(lhs, rhs.astype(dtype), preferred_element_type=acc)

    gate = None if gate_df is None else gemm(x, gate_df)
    return gemm(activation(gate, gemm(x, up_df)).astype(dtype), down_fd)
