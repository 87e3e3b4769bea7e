"""Shared cases and helpers for the Mixtral tests: tiny random HF models.

Every test here compares aristax to ``transformers.MixtralForCausalLM`` (float32,
eager attention) built from a fixed torch seed.
"""

from __future__ import annotations

import dataclasses

import numpy as np
import pytest

torch = pytest.importorskip("torch")
transformers = pytest.importorskip("transformers")

from aristax.models import Mixtral  # noqa: E402

BASE = dict(vocab_size=160, hidden_size=32, intermediate_size=48, num_hidden_layers=2,
            num_attention_heads=4, max_position_embeddings=256, rope_theta=10000.0,
            bos_token_id=1, eos_token_id=None, pad_token_id=None)  # no EOS: full length

CASES = {
    # top-2 over 4 experts, GQA (4 query heads on 2 KV heads), window 6 < prompt lengths
    "top2_e4_gqa_window": dict(num_local_experts=4, num_experts_per_tok=2,
                               num_key_value_heads=2, sliding_window=6),
    # top-1 over 8 experts, plain multi-head attention, no window
    "top1_e8_mha": dict(num_local_experts=8, num_experts_per_tok=1, num_key_value_heads=4,
                        sliding_window=None, hidden_size=48, intermediate_size=64),
    # top-2 over 6 experts, one KV head, explicit head_dim, tied embeddings, window 9
    "top2_e6_mqa_tied": dict(num_local_experts=6, num_experts_per_tok=2,
                             num_key_value_heads=1, head_dim=12, sliding_window=9,
                             hidden_size=64, intermediate_size=40, tie_word_embeddings=True,
                             vocab_size=256),
}


@dataclasses.dataclass
class Pair:
    name: str
    hf: object  # transformers.MixtralForCausalLM
    ours: Mixtral
    path: object  # the checkpoint directory


def make_hf(overrides: dict, seed: int = 0):
    """A MixtralForCausalLM with weights ~ N(0, 0.2) (decisive routing and argmax)
    and norm weights 1 + N(0, 0.1)."""
    kwargs = {**BASE, **overrides}
    theta = kwargs.pop("rope_theta")
    cfg = transformers.MixtralConfig(
        **kwargs, rope_parameters={"rope_type": "default", "rope_theta": theta},
        attn_implementation="eager")
    torch.manual_seed(seed)
    return randomize(transformers.MixtralForCausalLM(cfg).eval())


def randomize(model):
    """``model`` (a transformers causal LM, built right after ``torch.manual_seed``)
    with weights ~ N(0, 0.2) and norm weights 1 + N(0, 0.1), in place."""
    with torch.no_grad():
        for name, p in model.named_parameters():
            if name.endswith("norm.weight"):
                p.copy_(1 + 0.1 * torch.randn_like(p))
            else:
                p.normal_(0.0, 0.2)
    return model


def left_padded(rng: np.random.Generator, lengths, seq: int, vocab: int):
    """(input_ids int64[B, seq], attention_mask int64[B, seq]) with row b holding
    ``lengths[b]`` real tokens at the end (pad id 0 in front)."""
    ids = rng.integers(3, vocab, size=(len(lengths), seq))
    mask = np.zeros_like(ids)
    for b, n in enumerate(lengths):
        mask[b, seq - n:] = 1
    return np.where(mask == 1, ids, 0), mask


def hf_logits(hf, ids, mask=None, **kw):
    with torch.no_grad():
        # torch.tensor copies: ids may be a read-only view of a JAX array
        return hf(torch.tensor(np.asarray(ids)), attention_mask=None if mask is None
                  else torch.tensor(np.asarray(mask)), **kw)
