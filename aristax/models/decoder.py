"""The decoder shared by ``Mixtral`` and ``Qwen3Moe``: config-driven modules with
Hugging Face parity.

A decoder-only transformer whose MLPs are ``aristax.MoE`` layers (softmax over E in
float32, top-K, optionally renormalised; SwiGLU experts) or, where the config says so,
dense SwiGLU MLPs. The numerics follow ``transformers.models.mixtral.modeling_mixtral``
and ``...qwen3_moe.modeling_qwen3_moe`` (5.x) operation by operation: RMSNorm in
float32, rotary embeddings with ``rotate_half``, grouped-query attention with an
optional sliding window, softmax in float32. What differs by family is read from its
``DecoderConfig`` subclass: per-head q/k RMSNorm (``qk_norm``), projection biases
(``attention_bias``), which layers are MoE (``layer_is_sparse``), the routing
renormalisation and the experts' width, and the training-time jitter of the MoE input.

Letters: B batch, S query tokens, L key slots (the KV-cache length, or S without a
cache), V vocabulary, D hidden size, H query heads, G key/value heads, Dh head dim,
E experts, K experts per token, F expert (or dense MLP) hidden size, N layers.

Sliding window (as HF's ``sliding_window_overlay``): the query in slot q sees key slot
l iff ``q - W < l <= q`` and the key is not padding. Slots are cache indices, so with
left padding the window counts real tokens exactly as HF does.
"""

from __future__ import annotations

import contextlib
import os
from collections.abc import Sequence
from functools import partial
from typing import ClassVar, NamedTuple

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from aristax import MoE, MoEConfig
from aristax import routing as routing_lib
from aristax.config import RouterConfig
from aristax.layers import JitterView, jitter_stream
from aristax.models import hf, sparse_moe
from aristax.models.decoder_config import DecoderConfig
from aristax.models.generation_config import GenerationConfig
from aristax.sharding import DecoderAxes


def matmul_precision_context(config: DecoderConfig) -> contextlib.AbstractContextManager:
    """The context a model of ``config`` computes in: ``jax.default_matmul_precision``
    of ``config.matmul_precision`` for a float32 model, else JAX's current setting."""
    if config.matmul_precision is None or jnp.dtype(config.dtype) != jnp.float32:
        return contextlib.nullcontext()
    return jax.default_matmul_precision(config.matmul_precision)


def check_token_ids(input_ids, vocab_size: int) -> None:
    """Raise unless every id is in [0, vocab_size) (an embedding lookup would give NaN
    rows, or wrap -1 to the last token, silently). Traced ids are not checked."""
    if isinstance(input_ids, jax.core.Tracer):
        return
    ids = np.asarray(input_ids)
    if ids.size and (ids.min() < 0 or ids.max() >= vocab_size):
        raise ValueError(f"input_ids hold ids from {ids.min()} to {ids.max()}, outside this "
                         f"model's vocabulary [0, {vocab_size}); check the tokenizer or "
                         "the padding id")


def check_call_inputs(input_ids, attention_mask, position_ids, cache) -> None:
    """Raise naming the argument unless input_ids is an array [B, S], attention_mask
    and position_ids are None or [B, S], and the cache has B rows and room for S more
    tokens (its index is checked only when concrete: eager calls)."""
    if not hasattr(input_ids, "ndim"):
        raise TypeError(f"input_ids must be an integer array [batch, seq], got "
                        f"{type(input_ids).__name__}; pass jnp.asarray(ids)")
    if input_ids.ndim != 2:
        raise ValueError(f"input_ids must be [batch, seq], got shape {input_ids.shape}")
    B, S = input_ids.shape
    for name, value in (("attention_mask", attention_mask), ("position_ids", position_ids)):
        if value is not None and tuple(np.shape(value)) != (B, S):
            raise ValueError(f"{name} has shape {tuple(np.shape(value))}; it must be "
                             f"[batch, seq] = {(B, S)}, input_ids' shape")
    if cache is None:
        return
    rows, length = cache.key_valid.shape
    if rows != B:
        raise ValueError(f"the cache holds {rows} rows and input_ids {B}: build it with "
                         f"KVCache.init(config, batch={B}, length=...)")
    if not isinstance(cache.index, jax.core.Tracer) and int(cache.index) + S > length:
        raise ValueError(f"the cache has {length} slots, {int(cache.index)} written, and "
                         f"{S} more tokens do not fit: build it with a longer length")


# --------------------------------------------------------------------- pure functions
def rms_norm(x: jax.Array, weight_d: jax.Array, eps: float) -> jax.Array:
    """weight * x / sqrt(mean(x^2) + eps), statistics in float32 (HF MixtralRMSNorm,
    Qwen3MoeRMSNorm).

    x: [..., D]; weight_d: [D], cast to x's dtype. Returns [..., D] in x's dtype (HF
    multiplies in the promoted dtype; the two agree where, as in these models, the
    weight and x share a dtype).
    """
    x32 = x.astype(jnp.float32)
    var = jnp.mean(x32 * x32, axis=-1, keepdims=True)
    normed = (x32 * jax.lax.rsqrt(var + eps)).astype(x.dtype)
    return weight_d.astype(x.dtype) * normed


def rope_cos_sin(positions: jax.Array, head_dim: int, theta: float, dtype) -> tuple:
    """cos, sin [B, S, Dh] of rotary embeddings (Su et al. 2021) in HF's layout.

    inv_freq[i] = 1 / theta^(2i / Dh) in float32; angles = positions * inv_freq, repeated
    twice along the last axis (HF ``MixtralRotaryEmbedding``). positions: int[B, S].

    torch raises float32 theta to the float32 exponents; the power is taken here in
    float64 and rounded, which agrees with torch's where numpy's float32 ``pow`` is one
    rounding step off (for theta 1e6, Dh 128: 1 of 64 frequencies differ, against 14),
    and a wrong last bit moves cos/sin by up to ~1e-3 at positions near 32k.
    """
    exponent = np.arange(0, head_dim, 2, dtype=np.float32) / np.float32(head_dim)
    power = (np.float64(np.float32(theta)) ** exponent.astype(np.float64)).astype(np.float32)
    inv_freq = np.float32(1.0) / power
    freqs = positions.astype(jnp.float32)[..., None] * jnp.asarray(inv_freq, jnp.float32)
    emb = jnp.concatenate([freqs, freqs], axis=-1)
    return jnp.cos(emb).astype(dtype), jnp.sin(emb).astype(dtype)


def apply_rope(x: jax.Array, cos: jax.Array, sin: jax.Array) -> jax.Array:
    """x * cos + rotate_half(x) * sin for x [B, S, heads, Dh], cos/sin [B, S, Dh]."""
    half = x.shape[-1] // 2
    rotated = jnp.concatenate([-x[..., half:], x[..., :half]], axis=-1)
    return x * cos[:, :, None, :] + rotated * sin[:, :, None, :]


def attention_mask(
    key_valid: jax.Array, query_slots: jax.Array, sliding_window: int | None
) -> jax.Array:
    """bool[B, S, L]: causal, padding and sliding-window mask over key slots.

    key_valid: bool[B, L] (False: padding or an unwritten cache slot);
    query_slots: int[S], the cache slot of each query.
    """
    L = key_valid.shape[-1]
    slots = jnp.arange(L, dtype=query_slots.dtype)
    allowed = slots[None, :] <= query_slots[:, None]
    if sliding_window is not None:
        allowed &= slots[None, :] > query_slots[:, None] - sliding_window
    return allowed[None] & key_valid[:, None, :]


def dot_attention(q, k, v, mask, scale: float) -> jax.Array:
    """Grouped-query attention (HF ``eager_attention_forward``).

    q: [B, S, H, Dh]; k, v: [B, L, G, Dh]; mask: bool[B, S, L]. Head h reads key/value
    head h // (H // G). Scores and softmax in float32; masked scores are set to the
    float32 minimum (as HF adds it), so fully masked rows (padding queries) stay finite.
    Returns [B, S, H, Dh] in q's dtype.

    The products run head-major, one [(H/G)*S, Dh] x [Dh, L] GEMM per (batch, KV
    head): on 2 CPU cores that takes a 512-token prefill's attention from 145 to 80 ms
    per layer and a batch-8 decode step's from 5.7 to 3.5 ms (einsums straight on the
    [B, S, G, H/G, Dh] layout made XLA:CPU transpose inside each product).
    """
    B, S, H, Dh = q.shape
    G, L = k.shape[2], k.shape[1]
    r = H // G
    q_heads = q.reshape(B, S, G, r, Dh).transpose(0, 2, 3, 1, 4).reshape(B, G, r * S, Dh)
    k_heads, v_heads = k.transpose(0, 2, 1, 3), v.transpose(0, 2, 1, 3)  # [B, G, L, Dh]
    scores = jnp.einsum("bgmd,bgld->bgml", q_heads, k_heads,
                        preferred_element_type=jnp.float32) * scale
    scores = jnp.where(mask[:, None, None], scores.reshape(B, G, r, S, L),
                       jnp.finfo(jnp.float32).min)
    probs = jax.nn.softmax(scores, axis=-1).astype(q.dtype).reshape(B, G, r * S, L)
    out = jnp.einsum("bgml,bgld->bgmd", probs, v_heads, preferred_element_type=jnp.float32)
    return out.reshape(B, G, r, S, Dh).transpose(0, 3, 1, 2, 4).reshape(
        B, S, H, Dh).astype(q.dtype)


def load_balancing_loss(
    router_logits: Sequence[jax.Array],
    num_experts: int,
    top_k: int,
    attention_mask: jax.Array | None = None,
) -> jax.Array:
    """Hugging Face Mixtral's and Qwen3-MoE's ``load_balancing_loss_func`` (Switch
    Transformer eq. 4-6).

    All layers' rows are pooled (as HF concatenates / accumulates them):
    ``E * sum_e f_e * P_e`` with f_e the top-K assignments of expert e per row and
    P_e the mean router probability of e, both averaged over rows of every layer and
    weighted by ``attention_mask`` (padding rows count zero) when it is given.

    Args:
      router_logits: one float[..., E] per layer (each [B, S, E] or [B*S, E]).
      attention_mask: optional [B, S] with 1 for real tokens.
    Returns:
      float32[] loss.
    """
    logits = jnp.concatenate(
        [lg.reshape(-1, num_experts).astype(jnp.float32) for lg in router_logits], axis=0
    )  # [N*T, E]
    rows = None
    if attention_mask is not None:
        rows = jnp.tile(attention_mask.reshape(-1), len(router_logits))
    routing = routing_lib.route(logits, RouterConfig(num_experts=num_experts, top_k=top_k))
    return routing_lib.load_balancing_loss(routing, rows)


# --------------------------------------------------------------------- cache / outputs
@flax.struct.dataclass
class KVCache:
    """A fixed-size key/value cache.

    Attributes:
      keys, values: one [B, L, G, Dh] array per layer (rotary already applied to keys).
      key_valid: bool[B, L], False for padding and for slots not yet written.
      index: int32[], the next slot to write (the same for every row: prompts are
        left-padded).
    """

    keys: tuple[jax.Array, ...]
    values: tuple[jax.Array, ...]
    key_valid: jax.Array
    index: jax.Array

    @classmethod
    def init(cls, config: DecoderConfig, batch: int, length: int) -> KVCache:
        shape = (batch, length, config.num_key_value_heads, config.head_dim)
        zeros = tuple(jnp.zeros(shape, config.dtype) for _ in range(config.num_hidden_layers))
        return cls(keys=zeros, values=tuple(jnp.zeros_like(z) for z in zeros),
                   key_valid=jnp.zeros((batch, length), bool),
                   index=jnp.zeros((), jnp.int32))


class LayerDecodeWeights(NamedTuple):
    """One decoder layer's streamed weights in [out, in] layout (HF's): qkv_nd
    [(H + 2G)*Dh, D] (q, k, v stacked), o_dn [D, H*Dh]; experts: (gate_ups E x [2F, D],
    downs E x [D, F]) or None (see ``sparse_moe``; None too in a dense layer); mlp: a
    dense layer's (gate_up [2F, D], down [D, F]), None in a MoE layer."""

    qkv_nd: jax.Array
    o_dn: jax.Array
    experts: sparse_moe.ExpertWeights | None
    mlp: tuple[jax.Array, jax.Array] | None = None


class DecodeWeights(NamedTuple):
    """[out, in] copies of every weight a decode step streams (``DecoderLM.decode_weights``):
    one ``LayerDecodeWeights`` per layer and head_vd [V, D]."""

    layers: tuple[LayerDecodeWeights, ...]
    head_vd: jax.Array


@flax.struct.dataclass
class DecoderOutput:
    """logits float[B, S, V]; router_logits: one float32[B, S, E] per MoE layer (as HF
    returns them: dense layers have none); aux_loss: float32[] HF's load-balancing loss
    (None with a cache); cache: the updated ``KVCache`` (None without one); moe_aux:
    each layer's ``aristax.MoE`` aux dict (loss, lb/z losses, expert_load[E],
    dropped_fraction, ...; None for dense layers and for layers that ran the sparse
    decode path)."""

    logits: jax.Array
    router_logits: tuple[jax.Array, ...]
    aux_loss: jax.Array | None = None
    cache: KVCache | None = None
    moe_aux: tuple[dict | None, ...] = ()


# --------------------------------------------------------------------- modules
def _normal(rngs: nnx.Rngs, shape, std: float, dtype, axes: DecoderAxes, name: str
            ) -> nnx.Param:
    """Parameter ``name`` (``DECODER_PARAM_DIMS``) drawn from N(0, std^2), annotated
    with ``axes``."""
    value = jax.random.normal(rngs.params(), shape, jnp.float32).astype(dtype) * std
    return axes.param(name, value)


def _project(x: jax.Array, w: nnx.Param, bias: nnx.Param | None) -> jax.Array:
    """x @ w (+ bias) with a parameter w [in, out]."""
    y = x @ w[...]
    return y if bias is None else y + bias[...]


class RMSNorm(nnx.Module):
    """RMSNorm with weight_d [D] (initialised to ones; split as ``axes`` says of
    ``name``, "norm_d" or "head_norm" in ``DECODER_PARAM_DIMS``)."""

    def __init__(self, dim: int, eps: float, dtype, axes: DecoderAxes = DecoderAxes(),
                 name: str = "norm_d"):
        self.weight_d = axes.param(name, jnp.ones((dim,), dtype))
        self.eps = eps

    def __call__(self, x: jax.Array) -> jax.Array:
        return rms_norm(x, self.weight_d[...], self.eps)


class Attention(nnx.Module):
    """Grouped-query self-attention: q_dn [D, H*Dh], k_dm, v_dm [D, G*Dh], o_nd [H*Dh, D]
    (the transposes of HF's q/k/v/o_proj.weight). With ``config.attention_bias``
    also q_bias_n [H*Dh], k_bias_m, v_bias_m [G*Dh], o_bias_d [D] (HF's *_proj.bias,
    initialised to zeros); with ``config.qk_norm`` q_norm, k_norm (RMSNorm over Dh,
    applied per head before rotary, as HF Qwen3's q_norm/k_norm). Each weight is split
    as ``axes`` says (``DECODER_PARAM_DIMS``)."""

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs,
                 axes: DecoderAxes = DecoderAxes()):
        c, dt = config, config.dtype
        D, H, G, Dh = c.hidden_size, c.num_attention_heads, c.num_key_value_heads, c.head_dim
        std = c.initializer_range
        self.q_dn = _normal(rngs, (D, H * Dh), std, dt, axes, "q_dn")
        self.k_dm = _normal(rngs, (D, G * Dh), std, dt, axes, "k_dm")
        self.v_dm = _normal(rngs, (D, G * Dh), std, dt, axes, "v_dm")
        self.o_nd = _normal(rngs, (H * Dh, D), std, dt, axes, "o_nd")
        bias = (lambda n, name: axes.param(name, jnp.zeros((n,), dt))) if c.attention_bias \
            else (lambda n, name: None)
        self.q_bias_n, self.k_bias_m = bias(H * Dh, "q_bias_n"), bias(G * Dh, "k_bias_m")
        self.v_bias_m, self.o_bias_d = bias(G * Dh, "v_bias_m"), bias(D, "o_bias_d")
        norm = (lambda: RMSNorm(Dh, c.rms_norm_eps, dt, axes, "head_norm")) if c.qk_norm \
            else (lambda: None)
        self.q_norm, self.k_norm = norm(), norm()
        self.num_heads, self.num_kv_heads, self.head_dim = H, G, Dh
        self.sliding_window = c.sliding_window

    def __call__(self, x, cos, sin, key_valid, query_slots, kv=None, index=None,
                 weights: LayerDecodeWeights | None = None):
        """x [B, S, D] -> ([B, S, D], (k, v)); with ``kv`` ([B, L, G, Dh] each) the new
        keys/values are written at slot ``index`` and attention reads the whole cache.
        ``weights``: this layer's decode copies, used instead of the parameters."""
        B, S, _ = x.shape
        H, G, Dh = self.num_heads, self.num_kv_heads, self.head_dim
        if weights is None:
            q = _project(x, self.q_dn, self.q_bias_n)
            k = _project(x, self.k_dm, self.k_bias_m)
            v = _project(x, self.v_dm, self.v_bias_m)
        else:
            q, k, v = jnp.split(sparse_moe.matmul_out_in(x, weights.qkv_nd),
                                [H * Dh, (H + G) * Dh], axis=-1)
            if self.q_bias_n is not None:
                q, k, v = q + self.q_bias_n[...], k + self.k_bias_m[...], v + self.v_bias_m[...]
        q, k = q.reshape(B, S, H, Dh), k.reshape(B, S, G, Dh)
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        q, k = apply_rope(q, cos, sin), apply_rope(k, cos, sin)
        v = v.reshape(B, S, G, Dh)
        if kv is not None:
            k = jax.lax.dynamic_update_slice_in_dim(kv[0], k.astype(kv[0].dtype), index, 1)
            v = jax.lax.dynamic_update_slice_in_dim(kv[1], v.astype(kv[1].dtype), index, 1)
        mask = attention_mask(key_valid, query_slots, self.sliding_window)
        out = dot_attention(q, k, v, mask, Dh ** -0.5).reshape(B, S, H * Dh)
        if weights is None:
            return _project(out, self.o_nd, self.o_bias_d), (k, v)
        out = sparse_moe.matmul_out_in(out, weights.o_dn)
        return (out if self.o_bias_d is None else out + self.o_bias_d[...]), (k, v)

    def decode_weights(self) -> tuple[jax.Array, jax.Array]:
        """(qkv_nd, o_dn): the projections in [out, in] layout (copies)."""
        qkv = jnp.concatenate([self.q_dn[...], self.k_dm[...], self.v_dm[...]], axis=1)
        return jnp.asarray(qkv.T), jnp.asarray(self.o_nd[...].T)


class DenseMLP(nnx.Module):
    """down(silu(x gate) * (x up)) (HF ``Qwen3MoeMLP``): gate_df, up_df [D, F], down_fd
    [F, D] (the transposes of HF's gate/up/down_proj.weight), split as ``axes`` says."""

    def __init__(self, dim: int, hidden: int, std: float, dtype, *, rngs: nnx.Rngs,
                 axes: DecoderAxes = DecoderAxes()):
        self.gate_df = _normal(rngs, (dim, hidden), std, dtype, axes, "gate_df")
        self.up_df = _normal(rngs, (dim, hidden), std, dtype, axes, "up_df")
        self.down_fd = _normal(rngs, (hidden, dim), std, dtype, axes, "down_fd")

    def __call__(self, x: jax.Array, weights: tuple[jax.Array, jax.Array] | None = None):
        """x [..., D] -> [..., D]; ``weights``: (gate_up [2F, D], down [D, F]) decode
        copies, used instead of the parameters."""
        if weights is None:
            return (jax.nn.silu(x @ self.gate_df[...]) * (x @ self.up_df[...])) @ self.down_fd[...]
        gate, up = jnp.split(sparse_moe.matmul_out_in(x, weights[0]), 2, axis=-1)
        return sparse_moe.matmul_out_in(jax.nn.silu(gate) * up, weights[1])

    def decode_weights(self) -> tuple[jax.Array, jax.Array]:
        """(gate_up [2F, D], down [D, F]) in [out, in] layout (copies)."""
        gate_up = jnp.concatenate([self.gate_df[...], self.up_df[...]], axis=1)
        return jnp.asarray(gate_up.T), jnp.asarray(self.down_fd[...].T)


class DecoderLayer(JitterView, nnx.Module):
    """x + attn(norm(x)), then h + mlp(norm(h)) (HF ``MixtralDecoderLayer``,
    ``Qwen3MoeDecoderLayer``), the MLP an ``aristax.MoE`` block (``moe``; ``mlp`` None)
    when ``sparse``, else a ``DenseMLP`` of width ``config.intermediate_size`` (``mlp``;
    ``moe`` None).

    In training mode (``deterministic`` False, ``model.train()``) with
    ``config.moe_input_jitter`` eps > 0 (Mixtral's ``router_jitter_noise``) the MoE
    block's input is multiplied by U(1 - eps, 1 + eps) noise, which the router and the
    experts both see (HF ``MixtralSparseMoeBlock``; ``MoEConfig.router_jitter``
    jitters the router only), drawn from the stream ``aristax.layers.jitter_stream``
    picks ("jitter", "dropout" or "default").
    """

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs, moe_config: MoEConfig,
                 mesh=None, plan=None, sparse: bool = True, axes: DecoderAxes = DecoderAxes()):
        D, eps, dt = config.hidden_size, config.rms_norm_eps, config.dtype
        self.input_norm = RMSNorm(D, eps, dt, axes)
        self.attn = Attention(config, rngs=rngs, axes=axes)
        self.post_attention_norm = RMSNorm(D, eps, dt, axes)
        if sparse:
            self.moe = MoE(moe_config, rngs=rngs, mesh=mesh, plan=plan, axes=axes.moe())
            self.mlp = None
        else:
            self.moe = None
            self.mlp = DenseMLP(D, config.intermediate_size, config.initializer_range, dt,
                                rngs=rngs, axes=axes)
        self.jitter_noise = config.moe_input_jitter if sparse else 0.0
        self.jitter_rngs = jitter_stream(rngs).fork() if self.jitter_noise > 0 else None
        self.deterministic = False

    def __call__(self, x, cos, sin, key_valid, query_slots, kv=None, index=None,
                 weights: LayerDecodeWeights | None = None):
        """Returns (x [B, S, D], router_logits float32[B, S, E] or None (dense), (k, v),
        MoE aux or None).

        ``weights``: this layer's decode copies, used instead of the parameters; the
        MoE block then runs ``sparse_moe`` (no aux) unless ``weights.experts`` is None."""
        a, kv = self.attn(self.input_norm(x), cos, sin, key_valid, query_slots, kv, index,
                          weights)
        h = x + a
        m_in = self.post_attention_norm(h)
        if self.moe is None:
            y = self.mlp(m_in, None if weights is None else weights.mlp)
            return h + y.astype(h.dtype), None, kv, None
        if self.jitter_rngs is not None and not self.deterministic:
            m_in = routing_lib.apply_jitter(m_in, self.jitter_noise, self.jitter_rngs())
        B, S, D = m_in.shape
        cfg, router = self.moe.config, self.moe.router
        if weights is not None and weights.experts is not None:
            bias = router.balance_bias_e
            y, logits = sparse_moe.sparse_moe(
                m_in.reshape(B * S, D), router.weight_de[...], weights.experts,
                cfg.router_config, cfg.activation, bias=None if bias is None else bias[...])
            y, logits, aux = y.reshape(B, S, D), logits.reshape(B, S, -1), None
        else:
            y, aux = self.moe(m_in)
            logits = aux["router_logits"]
        return h + y.astype(h.dtype), logits, kv, aux

    def decode_weights(self) -> LayerDecodeWeights:
        """This layer's ``LayerDecodeWeights`` (copies, experts in logical order; experts
        None where ``sparse_moe.supports`` rejects the MoE config, or in a dense layer)."""
        if self.moe is None:
            return LayerDecodeWeights(*self.attn.decode_weights(), experts=None,
                                      mlp=self.mlp.decode_weights())
        experts = (sparse_moe.expert_weights(self.moe.logical_params())
                   if sparse_moe.supports(self.moe.config) else None)
        return LayerDecodeWeights(*self.attn.decode_weights(), experts=experts)


class DecoderLM(nnx.Module):
    """A causal LM of the shared decoder: ``model(input_ids, attention_mask=None) ->
    DecoderOutput``. ``Mixtral`` and ``Qwen3Moe`` are this class with their
    ``config_class``.

    Parameters: embed_vd [V, D] (HF embed_tokens.weight), layers (``DecoderLayer``),
    norm, lm_head_dv [D, V] (HF lm_head.weight transposed; None when
    ``tie_word_embeddings``, then the head is embed_vd.T).

    ``moe_config`` replaces the family's MoE block (``config.moe_config()``) in every
    MoE layer by any ``aristax.MoEConfig`` of the same E and D (other routers,
    capacity, shared experts: a Switch- or DeepSeek-style decoder); Hugging Face
    parity holds only for the default. ``mesh``/``plan`` go to every ``aristax.MoE``
    (expert parallelism).

    Sharding: ``axes`` (``aristax.sharding.DecoderAxes``) names the axes each weight
    dimension is split over (vocab, embed, heads, kv_heads, mlp, expert), written
    into every parameter's sharding metadata, the MoE blocks' included
    (``axes.moe()``), so the Flax recipe places the whole model:
    ``nnx.get_named_sharding(nnx.state(model, nnx.Param), mesh)`` (inside
    ``nnx.logical_axis_rules`` for logical names), then ``jax.device_put``, or
    ``with_sharding_constraint`` of ``nnx.get_partition_spec``. The default
    replicates all but the experts.
    """

    config_class: ClassVar[type[DecoderConfig]] = DecoderConfig

    def __init__(self, config: DecoderConfig, *, rngs: nnx.Rngs,
                 moe_config: MoEConfig | None = None, mesh=None, plan=None,
                 axes: DecoderAxes = DecoderAxes()):
        if not isinstance(config, self.config_class):
            raise TypeError(f"{type(self).__name__} needs a {self.config_class.__name__}, "
                            f"got a {type(config).__name__}")
        if not isinstance(axes, DecoderAxes):
            raise TypeError(f"axes={axes!r}: give an aristax.sharding.DecoderAxes, e.g. "
                            "DecoderAxes(embed='fsdp')")
        self.config = config
        # HF generate's defaults; from_pretrained reads generation_config.json
        self.generation_config = GenerationConfig.from_model_config(config)
        V, D, dt = config.vocab_size, config.hidden_size, config.dtype
        moe_config = config.moe_config() if moe_config is None else moe_config
        E = config.num_routed_experts
        if (moe_config.num_experts, moe_config.d_model) != (E, D):
            raise ValueError(
                f"moe_config has num_experts={moe_config.num_experts}, d_model="
                f"{moe_config.d_model}; the model needs {E}, {D}")
        self.embed_vd = _normal(rngs, (V, D), config.initializer_range, dt, axes, "embed_vd")
        self.layers = nnx.List(
            [DecoderLayer(config, rngs=rngs, moe_config=moe_config, mesh=mesh, plan=plan,
                          sparse=config.layer_is_sparse(i), axes=axes)
             for i in range(config.num_hidden_layers)]
        )
        self.norm = RMSNorm(D, config.rms_norm_eps, dt, axes)
        self.lm_head_dv = (
            None if config.tie_word_embeddings
            else _normal(rngs, (D, V), config.initializer_range, dt, axes, "lm_head_dv")
        )

    def head_dv(self) -> jax.Array:
        """The LM head [D, V]."""
        return self.embed_vd[...].T if self.lm_head_dv is None else self.lm_head_dv[...]

    def decode_weights(self) -> DecodeWeights:
        """[out, in] copies of the weights a decode step streams; make them once, outside
        ``jit``, and pass them to ``forward``/``generate`` (this copies the attention,
        expert, dense MLP and head weights)."""
        return DecodeWeights(layers=tuple(layer.decode_weights() for layer in self.layers),
                             head_vd=jnp.asarray(self.head_dv().T))

    def __call__(
        self,
        input_ids: jax.Array,
        attention_mask: jax.Array | None = None,
        position_ids: jax.Array | None = None,
        *,
        cache: KVCache | None = None,
        decode_weights: DecodeWeights | None = None,
        last_only: bool = False,
    ) -> DecoderOutput:
        """Forward pass.

        Args:
          input_ids: int[B, S], ids in [0, vocab_size).
          attention_mask: [B, S], 1 for real tokens, 0 for (left) padding; None: all 1.
          position_ids: int[B, S]; None: ``index + arange(S)`` as HF's forward (note:
            ``generate`` passes ``cumsum(attention_mask) - 1`` for padded prompts).
          cache: a ``KVCache``; the S tokens are written at ``cache.index``.
          decode_weights: ``self.decode_weights()``. When given (and
            ``sparse_moe.use_decode_weights(B*S)``: always on CPU, else up to
            ``sparse_moe.MAX_TOKENS`` tokens), every projection reads these [out, in]
            copies and the MoE blocks run ``sparse_moe``: only the selected experts,
            no ``moe_aux`` (the decode path).
          last_only: compute logits for the last position only ([B, 1, V]).
        Returns:
          ``DecoderOutput``.
        Matrix products run at ``config.matmul_precision`` (see ``DecoderConfig``).
        """
        with matmul_precision_context(self.config):
            return self._run(input_ids, attention_mask, position_ids, cache, decode_weights,
                             last_only)

    def _run(self, input_ids, attention_mask, position_ids, cache, decode_weights,
             last_only) -> DecoderOutput:
        cfg = self.config
        check_call_inputs(input_ids, attention_mask, position_ids, cache)
        check_token_ids(input_ids, cfg.vocab_size)
        B, S = input_ids.shape
        valid = (jnp.ones((B, S), bool) if attention_mask is None
                 else jnp.asarray(attention_mask).astype(bool))
        index = jnp.zeros((), jnp.int32) if cache is None else cache.index
        query_slots = index + jnp.arange(S, dtype=jnp.int32)
        if position_ids is None:
            position_ids = jnp.broadcast_to(query_slots, (B, S))
        key_valid = valid if cache is None else jax.lax.dynamic_update_slice_in_dim(
            cache.key_valid, valid, index, 1)

        x = jnp.take(self.embed_vd[...], input_ids, axis=0)
        cos, sin = rope_cos_sin(position_ids, cfg.head_dim, cfg.rope_theta, x.dtype)
        streamed = decode_weights is not None and sparse_moe.use_decode_weights(B * S)
        router_logits, keys, values, moe_aux = [], [], [], []
        for i, layer in enumerate(self.layers):
            kv = None if cache is None else (cache.keys[i], cache.values[i])
            weights = decode_weights.layers[i] if streamed else None
            x, logits, (k, v), aux = layer(x, cos, sin, key_valid, query_slots, kv, index,
                                           weights)
            if logits is not None:
                router_logits.append(logits)
            moe_aux.append(aux)
            keys.append(k)
            values.append(v)
        x = self.norm(x)
        if last_only:
            x = x[:, -1:]
        logits = (sparse_moe.matmul_out_in(x, decode_weights.head_vd) if streamed
                  else x @ self.head_dv())
        if cache is None:
            aux = (load_balancing_loss(router_logits, cfg.num_routed_experts,
                                       cfg.num_experts_per_tok, attention_mask)
                   if router_logits else jnp.zeros((), jnp.float32))
            new_cache = None
        else:
            aux = None
            new_cache = KVCache(keys=tuple(keys), values=tuple(values),
                                key_valid=key_valid, index=index + S)
        return DecoderOutput(logits=logits, router_logits=tuple(router_logits),
                             aux_loss=aux, cache=new_cache, moe_aux=tuple(moe_aux))

    # ----------------------------------------------------------------- checkpoints
    @classmethod
    def from_pretrained(cls, directory: str | os.PathLike, *, dtype: str | None = None,
                        matmul_precision: str | None = DecoderConfig.matmul_precision,
                        mesh=None, plan=None, axes: DecoderAxes = DecoderAxes()):
        """Load a local Hugging Face checkpoint directory of this family (see
        ``aristax.models.hf.load_pretrained``)."""
        return hf.load_pretrained(cls, directory, dtype=dtype, matmul_precision=matmul_precision,
                                  mesh=mesh, plan=plan, axes=axes)

    def save_pretrained(self, directory: str | os.PathLike, *,
                        max_shard_bytes: int | None = None) -> None:
        """Write config.json + safetensors that ``transformers`` loads."""
        hf.save_pretrained(self, directory, max_shard_bytes=max_shard_bytes)


@partial(jax.jit, static_argnames=("graphdef", "last_only"))
def _forward(graphdef, state, input_ids, attention_mask, position_ids, decode_weights,
             last_only):
    model = nnx.merge(graphdef, state)
    return model(input_ids, attention_mask, position_ids, decode_weights=decode_weights,
                 last_only=last_only)


def forward(
    model: DecoderLM,
    input_ids: jax.Array,
    attention_mask: jax.Array | None = None,
    position_ids: jax.Array | None = None,
    *,
    decode_weights: DecodeWeights | None = None,
    last_only: bool = False,
) -> DecoderOutput:
    """``model(input_ids, ...)`` without a cache, compiled once per input shape.

    Calling the module directly runs op by op (each op compiled on first use); this
    traces the whole forward into one ``jax.jit`` program over ``nnx.split(model)``.
    """
    check_call_inputs(input_ids, attention_mask, position_ids, None)
    check_token_ids(input_ids, model.config.vocab_size)
    graphdef, state = nnx.split(model)
    return _forward(graphdef, state, input_ids, attention_mask, position_ids,
                    decode_weights, last_only)
