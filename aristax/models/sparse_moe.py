"""The MoE block of Mixtral's decode path: read only the experts that some token selected.

Decoding one token touches K of the E experts, so its cost should not grow with E.
The general path (``aristax.moe.moe``) groups rows with grouped GEMMs over the stacked
[E, D, F] weights; for a handful of tokens that reads (or, on XLA:CPU, copies) every
expert. Here, up to ``max_selected_tokens()`` tokens (64, or 8 on the CPU), each expert
that some token selected runs once, on all T rows (``_selected_moe``); an unselected
expert costs a predicate, a selected one one read of its weights. Beyond, rows are
grouped by expert and each expert's rows run ``chunk`` at a time, its last few in one
smaller GEMM (``_grouped_moe``; the CPU prefill and larger batches).

The weights are per-expert [out, in] copies (HF's layout) made once outside ``jit``
(``Mixtral.decode_weights``), gate and up concatenated into one matrix, and every
product goes through ``matmul_out_in``:
* for one row XLA:CPU streams a weight held [out, in] as ``w @ x.T`` at up to twice
  the rate of ``x @ w`` over [in, out] (a [4096, 1024] float32 GEMV: 24 vs 9.5 GB/s on
  2 cores of an Intel Xeon VM; on an AMD EPYC VM, with XNNPACK dots, the two layouts
  stream within 5% of each other); one gate|up GEMV streams about 5% faster than two;
* for 2 to ``CPU_MULTIPLY_SUM_ROWS`` rows XLA:CPU's dot is slow, and the product is
  written as a multiply summed over ``in`` instead (see ``matmul_out_in``);
* slicing the stacked [E, D, F] parameters inside ``jit`` instead copies each slice
  before its dot (on 2 cores it cost 150-200 ms per layer at T = 8 to 512).
For long inputs the [out, in] GEMMs run about 10% below [in, out] ones (T=512), a
small price next to the 2x that ``sparse_moe`` gains over ``aristax.moe`` on CPU.

A documented specialisation of the one layer body (``aristax.moe.layer_body``) for
dropless token choice without aux losses: y and the router logits equal ``moe``'s
(``tests/test_sparse_moe.py::test_parity_with_the_layer_body``).

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token.
Numerics follow HF ``MixtralExperts``: y = sum over selected e (ascending) of
w_e * down_e(silu(x gate_e) * (x up_e)).
"""

from __future__ import annotations

import functools
from collections.abc import Sequence

import jax
import jax.numpy as jnp

from aristax import routing as routing_lib
from aristax.config import RouterConfig, accumulation_dtype
from aristax.dispatch import stable_order
from aristax.moe import router_logits
from aristax.pallas_kernels.moe_mlp.reference import hidden
from aristax.pallas_kernels.permute import reference as permute_ref

# Off the CPU, up to this many tokens every selected expert runs on all T rows (T*E rows
# of GEMMs, next to free while reading the weights dominates); beyond, rows are grouped
# by expert. A forward given ``DecodeWeights`` uses them only up to this many tokens.
MAX_TOKENS = 64

# On the CPU the all-rows GEMMs cost compute, and rows are grouped beyond this many
# tokens. One layer (D 1024, F 4096, E 6, K 2; 2 cores, min of 10), ms:
#   T                        8     16    32    48    64
#   each expert on all rows  15.4  21.4  38.2  49.6  74.6
#   rows grouped by expert   15.5  15.0  22.6  30.9  34.6
CPU_MAX_SELECTED_TOKENS = 8

# On XLA:CPU, ``jnp.dot`` of 2 to 64 rows streams the weights at a fraction of the rate
# of its one-row GEMV; ``w[None] * x[:, None, :]`` summed over ``in`` fuses into one
# loop that reads the weights once for all rows (in this operand order: ``x * w`` runs
# 3x slower). 2 cores, float32, no XLA flags, min of 20, ms:
#   rows                         2     8     16    32    64
#   [8192, 1024]  dot          2.3   2.6   4.7   6.2   9.8
#                 multiply-sum 1.6   1.7   2.4   4.2   8.3
#                 torch        0.9   2.7   4.3   5.9   9.4
#   [1024, 4096]  dot          2.9   2.4   3.5   5.2   6.7
#                 multiply-sum 0.7   0.8   1.1   1.8   4.0
# A one-row GEMV of [8192, 1024] takes 1.0-1.2 ms, and one row stays a dot: on one row
# the multiply-sum took 119 ms. At batch 8 this took the 12-layer TinyMistral decode
# step (experiments/benchmarks/decode_vs_hf.py) from 449 to 229 ms. (Those figures are
# from an Intel Xeon VM. On an AMD EPYC VM with AVX-512 the two forms tie within 5% at
# 2 to 64 rows, over 12 weight copies so that none stays in cache.)
CPU_MULTIPLY_SUM_ROWS = 64

# (gate_ups, downs): E arrays each, [2F, D] (gate rows first) and [D, F].
ExpertWeights = tuple[Sequence[jax.Array], Sequence[jax.Array]]


def expert_weights(params) -> ExpertWeights:
    """``ExpertWeights`` of gated experts in logical order (an ``aristax.MoEParams``,
    e.g. ``MoE.logical_params()``: gate_edf, up_edf [E, D, F], down_efd [E, F, D]): per
    expert gate|up [2F, D] and down [D, F], new arrays (make them once, outside
    ``jit``)."""
    gate_up = jnp.concatenate([params.gate_edf, params.up_edf], axis=2)
    return (tuple(jnp.asarray(w.T) for w in gate_up),
            tuple(jnp.asarray(w.T) for w in params.down_efd))


def supports(config) -> bool:
    """Whether ``sparse_moe`` computes this ``MoEConfig``'s layer exactly: dropless
    token-choice routing, swiglu/geglu experts without biases weighted at their output,
    a router without a bias, in the input's dtype, no shared experts."""
    return (config.router != "expert_choice" and config.capacity_factor is None
            and config.activation in ("swiglu", "geglu") and config.num_shared_experts == 0
            and config.dtype is None and not config.router_bias and not config.expert_bias
            and config.weight_side == "output")


def use_decode_weights(num_tokens: int) -> bool:
    """Whether a forward of ``num_tokens`` rows given decode weights should use them.

    Always on CPU: on 2 cores (D=1024, F=4096, E=6, K=2) one ``sparse_moe`` layer took
    75-90 ms at T=80 and 270-320 ms at T=512, where ``aristax.moe`` took 655 ms and
    2.4 s (an earlier measurement): XLA:CPU's ``lax.ragged_dot`` computes every group
    densely.
    Elsewhere only up to ``MAX_TOKENS``; grouped GEMMs are the better choice beyond.
    """
    return num_tokens <= MAX_TOKENS or jax.default_backend() == "cpu"


def max_selected_tokens() -> int:
    """Up to how many tokens ``sparse_moe`` runs each selected expert on all rows (more
    are grouped by expert): ``CPU_MAX_SELECTED_TOKENS`` on the CPU, else ``MAX_TOKENS``."""
    return CPU_MAX_SELECTED_TOKENS if jax.default_backend() == "cpu" else MAX_TOKENS


def matmul_out_in(x: jax.Array, w_out_in: jax.Array, acc_dtype=None) -> jax.Array:
    """x[..., in] @ w_out_in[out, in].T -> [..., out], accumulated and returned in
    ``acc_dtype`` (default x's dtype). One row runs as the GEMV ``w @ x.T`` (the form
    XLA:CPU streams fastest); on the CPU, 2 to ``CPU_MULTIPLY_SUM_ROWS`` rows run as a
    multiply summed over ``in``."""
    lead = x.shape[:-1]
    x2 = x.reshape(-1, x.shape[-1])
    acc = acc_dtype or x.dtype
    w = w_out_in.astype(x.dtype)
    if 2 <= x2.shape[0] <= CPU_MULTIPLY_SUM_ROWS and jax.default_backend() == "cpu":
        y = jnp.sum(w[None].astype(acc) * x2[:, None, :].astype(acc), axis=-1)
    else:
        y = jnp.dot(w, x2.T, preferred_element_type=acc).T
    return y.reshape(*lead, w.shape[0])


def _expert_mlp(x, gate_up_fd, down_df, activation: str) -> jax.Array:
    """One expert's gated MLP on x[T, D] -> [T, D] in the accumulation dtype."""
    acc = accumulation_dtype(x.dtype)
    gate, up = jnp.split(matmul_out_in(x, gate_up_fd, acc), 2, axis=-1)
    return matmul_out_in(hidden(gate, up, activation).astype(x.dtype), down_df, acc)


def _chunk_rows(num_rows: int, num_experts: int) -> int:
    """Rows per full-chunk GEMM in ``_grouped_moe``: the mean rows per expert rounded
    up to a power of two, within [32, 128] (fewer rows waste most of a CPU GEMM)."""
    mean = -(-num_rows // num_experts)
    return max(32, min(128, 1 << (mean - 1).bit_length()))


def tail_sizes(chunk: int) -> tuple[int, ...]:
    """The row counts of the one GEMM that runs an expert's last ``rows_e % chunk``
    rows in ``_grouped_moe``: the smallest of these that holds them.

    Padding that tail to a whole chunk cost most of the grouped path: on 2 cores
    (D=1024, F=4096) an expert MLP on 64 rows takes 17.5 ms and on 128 rows 29.5 ms,
    and at T=512, E=6, K=2 the ~171 rows per expert ran as 2 x 128.
    """
    return tuple(s for s in (chunk // 8, chunk // 4, chunk // 2, chunk) if s >= 8)


def _grouped_moe(x, routing, weights, experts: ExpertWeights, activation: str) -> jax.Array:
    """The MoE for many tokens: rows sorted by expert; each expert's rows through its
    MLP ``chunk`` at a time, then its last ``rows_e % chunk`` rows in one GEMM of the
    smallest ``tail_sizes`` that holds them; then combined.

    At most T*K + E*chunk/2 rows of GEMMs (T*K plus under 2x each tail) instead of the
    T*E of running every selected expert on every token. Rows past an expert's segment
    need no mask: experts run in ascending order, so later experts overwrite them, and
    the last expert's land past ``num_valid``, which ``combine`` ignores. Returns
    y [T, D] in the accumulation dtype.
    """
    gate_ups, downs = experts
    T, K, E = x.shape[0], routing.expert_ids.shape[1], len(downs)
    ids = jnp.where(routing.mask, routing.expert_ids, E).reshape(-1)  # unrouted: last
    sort_order = stable_order(ids, E + 1)  # [T*K]
    counts = jnp.bincount(ids, length=E + 1)[:E].astype(jnp.int32)
    starts = jnp.cumsum(counts) - counts
    num_valid = jnp.sum(counts)
    chunk = _chunk_rows(T * K, E)
    tails = tail_sizes(chunk)
    rows = permute_ref.permute(x, sort_order, num_valid, top_k=K)
    rows = jnp.pad(rows, ((0, chunk), (0, 0)))  # slices past the end stay in bounds
    out = jnp.zeros(rows.shape, accumulation_dtype(x.dtype))
    for e in range(E):  # each lax op below traces its functions at once: e is current
        def mlp_rows(out, start, size):
            y = _expert_mlp(jax.lax.dynamic_slice_in_dim(rows, start, size), gate_ups[e],
                            downs[e], activation)
            return jax.lax.dynamic_update_slice_in_dim(out, y, start, 0)

        full = counts[e] // chunk
        out = jax.lax.fori_loop(
            0, full, lambda i, out: mlp_rows(out, starts[e] + i * chunk, chunk), out)
        tail = counts[e] - full * chunk
        branch = jnp.where(tail == 0, 0, 1 + jnp.searchsorted(jnp.asarray(tails), tail))
        out = jax.lax.switch(
            branch, [lambda out, start: out] + [functools.partial(mlp_rows, size=s)
                                                for s in tails],
            out, starts[e] + full * chunk)
    return permute_ref.combine(out[:T * K], sort_order, weights, num_valid)


def _selected_moe(x, routing, weights, experts: ExpertWeights, activation: str) -> jax.Array:
    """The MoE for a few tokens: each expert that some token selected runs once on all
    T rows (T*E rows at most, trivial at small T); an unselected expert costs a
    predicate. Experts add into y in ascending order, as HF does. Returns y [T, D] in
    float32."""
    gate_ups, downs = experts
    E = len(downs)
    chosen = (routing.expert_ids[..., None] == jnp.arange(E)) & routing.mask[..., None]
    combine = jnp.sum(jnp.where(chosen, weights[..., None], 0.0), axis=1)  # [T, E]
    selected = jnp.any(chosen, axis=(0, 1))  # [E]
    y = jnp.zeros(x.shape, jnp.float32)
    for e in range(E):
        def add_expert(y, e=e):
            out = _expert_mlp(x, gate_ups[e], downs[e], activation)
            return y + out.astype(jnp.float32) * combine[:, e:e + 1]

        y = jax.lax.cond(selected[e], add_expert, lambda y: y, y)
    return y


def sparse_moe(
    x: jax.Array, router_de: jax.Array, experts: ExpertWeights, config: RouterConfig,
    activation: str = "swiglu", *, bias: jax.Array | None = None,
) -> tuple[jax.Array, jax.Array]:
    """Mixtral MoE reading only the selected experts (each selected expert once up to
    ``max_selected_tokens()`` tokens, rows grouped by expert beyond).

    Args:
      x: [T, D].
      router_de: [D, E] router weight.
      experts: (gate_ups, downs), one array per expert each (see ``ExpertWeights``).
      config: routing config (``MoEConfig.router_config``); token-choice routers only.
      activation: the experts' gated activation ("swiglu" or "geglu").
      bias: the router's aux-loss-free balancing bias float32[E], if any.
    Returns:
      (y [T, D] in x's dtype, router_logits float32[T, E]).
    """
    if config.router == "expert_choice":
        raise ValueError("sparse_moe supports token-choice routers only (see supports)")
    logits = router_logits(x, router_de)
    routing = routing_lib.route(logits, config, bias=bias)
    weights = jnp.where(routing.mask, routing.weights, 0.0)
    if x.shape[0] > max_selected_tokens():
        y = _grouped_moe(x, routing, weights, experts, activation)
    else:
        y = _selected_moe(x, routing, weights, experts, activation)
    return y.astype(x.dtype), logits
