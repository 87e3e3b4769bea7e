"""Reference fused expert MLP: the unfused composition of the reference ops.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
M = T*K rows in expert order.

  rows     = permute(x, sort_order)                    [M, D]   compute dtype
  gate, up = ragged_dot(rows, gate_e), (rows, up_e)    [M, F]   float32
  h        = act(gate, up)                             [M, F]   float32, then cast
  out_rows = ragged_dot(h, down_e)                     [M, D]   float32
  y        = combine(out_rows, sort_order, weights)    [T, D]   float32

and with the ``EXTRAS``: each projection plus its expert's bias (float32), or rows
scaled by their assignment's weight and combined with weight 1 (input-side weights,
as ``aristax.dispatch.weight_rows``).

with the casts of ``aristax.experts.expert_mlp`` (rows and h in the compute dtype =
x's dtype, float32 accumulation; float64 throughout for float64 x). This is the test
oracle: its gradients are plain JAX autodiff of ``permute.reference``,
``ragged_dot.reference`` and ``combine``.

Activations (Shazeer 2020, "GLU Variants Improve Transformer", eq. 6 and ibid.):
  swiglu: silu(gate) * up;  geglu: gelu(gate) * up;  gelu: gelu(up)
with the exact (erf) GELU, as torch's default; and relu(up), GPT-OSS's clamped
SwiGLU (``hidden``).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from aristax.pallas_kernels.permute import reference as permute_ref
from aristax.pallas_kernels.ragged_dot import reference as ragged_dot_ref

ACTIVATIONS = ("swiglu", "geglu", "gelu")  # every moe_mlp backend's
GATED = ("swiglu", "geglu", "clamped_swiglu")  # those with a gate projection
# The activations beyond ACTIVATIONS: ``hidden``'s, and the backends' that list them
# in their ``EXTRAS`` (with expert biases and input-side weights).
OTHER_ACTIVATIONS = ("relu", "clamped_swiglu")
EXTRAS = frozenset(OTHER_ACTIVATIONS + ("expert_bias", "input_weights"))


class ExpertMlp(NamedTuple):
    """What each routed expert computes besides its weights (static, hashable).

    activation: one of ``ACTIVATIONS + OTHER_ACTIVATIONS``; limit, alpha: the clamp and
    the sigmoid's slope of "clamped_swiglu" (unused by the others); input_weights: the
    routing weight scales the expert's input row, and the rows' outputs are summed
    unweighted (Llama 4), instead of scaling its output.
    """

    activation: str
    limit: float = 7.0
    alpha: float = 1.702
    input_weights: bool = False

    def extras(self, biased: bool) -> frozenset[str]:
        """The ``EXTRAS`` a backend needs to compute this MLP (with expert biases when
        ``biased``); empty for the plain MLP every backend computes."""
        asked = {self.activation, "expert_bias" if biased else "",
                 "input_weights" if self.input_weights else ""}
        return frozenset(asked & EXTRAS)

    def hidden(self, pre: tuple[jax.Array, ...]) -> jax.Array:
        """``hidden_of`` with this MLP's activation and parameters."""
        return hidden_of(pre, self.activation, limit=self.limit, alpha=self.alpha)

    def hidden_vjp(self, pre: tuple[jax.Array, ...]):
        """``hidden_vjp`` with this MLP's activation and parameters."""
        return hidden_vjp(pre, self.activation, limit=self.limit, alpha=self.alpha)


def hidden(gate: jax.Array | None, up: jax.Array, activation: str, *,
           limit: float = 7.0, alpha: float = 1.702) -> jax.Array:
    """The expert activation of the pre-activations gate, up [..., F] (gate unused,
    and may be None, for "gelu" and "relu"). The one place these formulas live.

    "clamped_swiglu" is GPT-OSS's (``GptOssExperts._apply_gate``): g = min(gate,
    limit), u = clip(up, -limit, limit), (u + 1) * g * sigmoid(alpha * g).
    """
    if activation == "gelu":
        return jax.nn.gelu(up, approximate=False)
    if activation == "relu":
        return jax.nn.relu(up)
    if activation == "swiglu":
        return jax.nn.silu(gate) * up
    if activation == "geglu":
        return jax.nn.gelu(gate, approximate=False) * up
    if activation == "clamped_swiglu":
        g = jnp.minimum(gate, limit)
        return (jnp.clip(up, -limit, limit) + 1) * g * jax.nn.sigmoid(alpha * g)
    raise ValueError(f"activation={activation!r} is invalid: choose one of "
                     f"{ACTIVATIONS + OTHER_ACTIVATIONS}")


def hidden_of(pre: tuple[jax.Array, ...], activation: str, **params) -> jax.Array:
    """``hidden`` of the pre-activations ``pre``: (gate, up), or (up,) for "gelu" and
    "relu" (the fused loops carry only the ones there are); ``params``: its limit and
    alpha."""
    return hidden(*((None,) + tuple(pre) if len(pre) == 1 else pre), activation, **params)


def hidden_vjp(pre: tuple[jax.Array, ...], activation: str, **params):
    """(h, vjp) of ``hidden`` at the pre-activations ``pre``: (gate, up), or (up,) for
    "gelu" and "relu"; vjp maps dh to a tuple like ``pre``. "swiglu" is written out,
    its sigmoid s computed once for h and both gradients:
      h = g s u;  dgate = dh u (s + g s (1 - s));  dup = dh g s
    (with ``jax.vjp`` of silu(g) * u the fused "xla" loop's whole layer took 2-5% longer
    at E 64, F 128 on XLA:CPU; no difference measurable at E 8 and E 32); the others
    are ``jax.vjp`` of ``hidden`` (``params``: its limit and alpha)."""
    if activation == "swiglu":
        gate, up = pre
        s = jax.nn.sigmoid(gate)
        silu = gate * s
        return silu * up, lambda dh: (dh * up * (s + silu * (1 - s)), dh * silu)
    return jax.vjp(lambda *p: hidden_of(p, activation, **params), *pre)


def check(x: jax.Array, weights: jax.Array, up_edf: jax.Array, *,
          interpret: bool = False) -> None:
    """The reference serves every call the front door validated."""
    del x, weights, up_edf, interpret


def valid_rows(num_valid: jax.Array | int | None, group_sizes: jax.Array) -> jax.Array:
    """int32[]: the routed rows (``sum(group_sizes)`` when ``num_valid`` is None)."""
    if num_valid is None:
        return jnp.sum(group_sizes, dtype=jnp.int32)
    return jnp.asarray(num_valid, jnp.int32).reshape(())


def moe_mlp(
    x: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    gate_edf: jax.Array | None,
    up_edf: jax.Array,
    down_efd: jax.Array,
    *,
    mlp: ExpertMlp,
    biases: tuple[jax.Array | None, ...] = (None, None, None),
    num_valid: jax.Array | int | None = None,
) -> jax.Array:
    """y[t] = sum_k weights[t, k] * mlp_{e(t,k)}(x[t]) over the routed assignments
    (with ``mlp.input_weights``: sum_k mlp_{e(t,k)}(weights[t, k] * x[t])).

    Args:
      x: [T, D] in the compute dtype. sort_order: int32[M] flat assignment of each row in
        expert order. weights: [T, K]. group_sizes: int32[E] rows per expert.
      gate_edf: [E, D, F] or None ("gelu", "relu"). up_edf: [E, D, F]. down_efd:
        [E, F, D] (cast to x's dtype). mlp: ``ExpertMlp``.
      biases: (gate [E, F] or None, up [E, F] or None, down [E, D] or None), added to
        each projection of the row's expert in the accumulation dtype.
      num_valid: rows that take part (default ``sum(group_sizes)``); rows at or past
        it contribute nothing.
    Returns:
      y [T, D] in the accumulation dtype (float32, float64 for float64 inputs).
    """
    top_k = weights.shape[1]
    dtype = x.dtype
    acc = permute_ref.accumulation_dtype(dtype)
    nv = valid_rows(num_valid, group_sizes)
    expert = ragged_dot_ref.row_groups(group_sizes, sort_order.shape[0])  # [M]

    def gemm(lhs, rhs, bias):
        out = ragged_dot_ref.ragged_dot(lhs, rhs.astype(dtype), group_sizes,
                                        preferred_element_type=acc)
        return out if bias is None else out + jnp.take(bias.astype(acc), expert, axis=0)

    rows = permute_ref.permute(x, sort_order, nv, top_k=top_k)
    if mlp.input_weights:
        w_row = jnp.take(weights.reshape(-1).astype(acc), sort_order)[:, None]
        rows = (rows.astype(acc) * w_row).astype(dtype)
        weights = jnp.ones_like(weights)
    gate_bias, up_bias, down_bias = biases
    pre = (gemm(rows, up_edf, up_bias),)
    if gate_edf is not None:
        pre = (gemm(rows, gate_edf, gate_bias),) + pre
    out_rows = gemm(mlp.hidden(pre).astype(dtype), down_efd, down_bias)
    return permute_ref.combine(out_rows, sort_order, weights, nv)
