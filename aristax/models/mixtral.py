"""Mixtral (Jiang et al. 2024, "Mixtral of Experts") with Hugging Face parity.

A decoder-only transformer whose MLPs are ``aristax.MoE`` layers with Mixtral routing
(softmax over E in float32, top-K, renormalised; SwiGLU experts), following
``transformers.models.mixtral.modeling_mixtral`` (5.x) operation by operation. The
modules, the forward pass, the KV cache and the decode path are the shared decoder's
(``aristax.models.decoder``, re-exported here); ``MixtralConfig`` says what is
Mixtral's: every layer a MoE block, no q/k norm, no projection biases, and the
training-time ``router_jitter_noise`` on the MoE input.
"""

from __future__ import annotations

from typing import ClassVar

from aristax.models.decoder import (
    Attention,
    DecodeWeights,
    DecoderLayer,
    DecoderLM,
    DecoderOutput,
    DenseMLP,
    KVCache,
    LayerDecodeWeights,
    RMSNorm,
    apply_rope,
    attention_mask,
    check_token_ids,
    dot_attention,
    forward,
    load_balancing_loss,
    matmul_precision_context,
    rms_norm,
    rope_cos_sin,
)
from aristax.models.mixtral_config import MixtralConfig

# The output of every model of the shared decoder; the Mixtral name is kept.
MixtralOutput = DecoderOutput

# The shared decoder's names are re-exported: ``aristax.models.mixtral`` held them first.
__all__ = ["Attention", "DecodeWeights", "DecoderLM", "DecoderLayer", "DecoderOutput",
           "DenseMLP", "KVCache", "LayerDecodeWeights", "Mixtral", "MixtralConfig",
           "MixtralOutput", "RMSNorm", "apply_rope", "attention_mask", "check_token_ids",
           "dot_attention", "forward", "load_balancing_loss", "matmul_precision_context",
           "rms_norm", "rope_cos_sin"]


class Mixtral(DecoderLM):
    """Mixtral causal LM: ``model(input_ids, attention_mask=None) -> MixtralOutput``.

    Parameters: embed_vd [V, D] (HF embed_tokens.weight), layers (``DecoderLayer``,
    each with an ``aristax.MoE`` block), norm, lm_head_dv [D, V] (HF lm_head.weight
    transposed; None when ``tie_word_embeddings``, then the head is embed_vd.T).

    ``moe_config`` replaces the Mixtral MoE block (``config.moe_config()``) by any
    ``aristax.MoEConfig`` of the same E and D (other routers, capacity, shared
    experts: a Switch- or DeepSeek-style decoder); Hugging Face parity holds only for
    the default. ``mesh``/``plan`` go to every ``aristax.MoE`` (expert parallelism).
    ``from_pretrained``/``save_pretrained`` read and write Hugging Face Mixtral
    directories (``aristax.models.hf``).
    """

    config_class: ClassVar[type[MixtralConfig]] = MixtralConfig
