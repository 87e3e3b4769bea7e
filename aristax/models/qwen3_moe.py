"""Qwen3-MoE (Qwen team 2025, "Qwen3 Technical Report") with Hugging Face parity.

The shared decoder (``aristax.models.decoder``) configured by ``Qwen3MoeConfig``,
following ``transformers.models.qwen3_moe.modeling_qwen3_moe`` (5.x) operation by
operation: queries and keys pass a per-head RMSNorm (over the head dim) before rotary;
q/k/v/o carry biases when ``attention_bias``; layer i has an ``aristax.MoE`` block
(softmax over E in float32, top-K, renormalised only when ``norm_topk_prob``; SwiGLU
experts of width ``moe_intermediate_size``) unless it is in ``mlp_only_layers`` or
``(i + 1) % decoder_sparse_step != 0``, when it has a dense SwiGLU MLP of width
``intermediate_size``. The router logits and the load-balancing loss cover the MoE
layers only, as HF's do.
"""

from __future__ import annotations

from typing import ClassVar

from aristax.models.decoder import DecoderLM, DecoderOutput
from aristax.models.qwen3_moe_config import Qwen3MoeConfig

# The output of every model of the shared decoder, under this model's name.
Qwen3MoeOutput = DecoderOutput


class Qwen3Moe(DecoderLM):
    """Qwen3-MoE causal LM: ``model(input_ids, attention_mask=None) -> Qwen3MoeOutput``.

    Parameters: embed_vd [V, D], layers (``DecoderLayer``: ``attn`` with q_norm/k_norm
    and, with ``attention_bias``, the projection biases; ``moe`` an ``aristax.MoE`` in
    MoE layers, ``mlp`` a ``DenseMLP`` in the others), norm, lm_head_dv [D, V] (None
    when ``tie_word_embeddings``). ``moe_config``, ``mesh``, ``plan``: as for
    ``Mixtral``, applied to the MoE layers. ``from_pretrained``/``save_pretrained``
    read and write Hugging Face Qwen3-MoE directories (``aristax.models.hf``).
    """

    config_class: ClassVar[type[Qwen3MoeConfig]] = Qwen3MoeConfig
