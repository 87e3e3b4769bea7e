"""``Qwen3MoeConfig``: the hyper-parameters of ``aristax.models.Qwen3Moe``, named as in
Hugging Face's config.json (``transformers.Qwen3MoeConfig``). Validation and the
config.json mapping are ``aristax.models.decoder_config.DecoderConfig``'s."""

from __future__ import annotations

import dataclasses
from typing import ClassVar

from aristax.models.decoder_config import DecoderConfig

# transformers' default window when use_sliding_window is set without a size
_HF_DEFAULT_WINDOW = 4096


@dataclasses.dataclass(frozen=True)
class Qwen3MoeConfig(DecoderConfig):
    """Hyper-parameters of a Qwen3-MoE decoder (the shared fields are documented on
    ``DecoderConfig``; the defaults here are transformers' ``Qwen3MoeConfig``'s).

    Layer i has a MoE block of ``num_experts`` experts of width
    ``moe_intermediate_size`` when i is not in ``mlp_only_layers`` and
    ``(i + 1) % decoder_sparse_step == 0``, else a dense SwiGLU MLP of width
    ``intermediate_size``. ``norm_topk_prob``: renormalise the top-K routing weights.
    ``attention_bias``: q/k/v/o projections with biases. Queries and keys go through
    a per-head RMSNorm before rotary. ``sliding_window`` is the window in effect
    (config.json's ``sliding_window`` when ``use_sliding_window``, else None).
    """

    display_name: ClassVar[str] = "Qwen3-MoE"
    model_type: ClassVar[str] = "qwen3_moe"
    architecture: ClassVar[str] = "Qwen3MoeForCausalLM"
    experts_field: ClassVar[str] = "num_experts"
    # transformers 5 writes num_experts as num_local_experts
    hf_aliases: ClassVar[dict[str, str]] = {"num_local_experts": "num_experts"}
    qk_norm: ClassVar[bool] = True

    vocab_size: int = 151936
    hidden_size: int = 2048
    intermediate_size: int = 6144
    num_hidden_layers: int = 24
    num_key_value_heads: int = 4
    num_experts_per_tok: int = 8
    rms_norm_eps: float = 1e-6
    rope_theta: float = 10000.0
    max_position_embeddings: int = 32768
    bos_token_id: int | None = None
    eos_token_id: int | tuple[int, ...] | None = None

    num_experts: int = 128
    moe_intermediate_size: int = 768
    decoder_sparse_step: int = 1
    mlp_only_layers: tuple[int, ...] = ()
    norm_topk_prob: bool = False
    attention_bias: bool = False

    @property
    def expert_intermediate_size(self) -> int:
        return self.moe_intermediate_size

    @property
    def normalize_topk_weights(self) -> bool:
        return self.norm_topk_prob

    def layer_is_sparse(self, index: int) -> bool:
        """HF ``Qwen3MoeDecoderLayer``: a MoE block unless ``index`` is in
        ``mlp_only_layers`` or ``(index + 1) % decoder_sparse_step != 0``."""
        return (index not in self.mlp_only_layers
                and (index + 1) % self.decoder_sparse_step == 0)

    def _check_family(self) -> None:
        self._check_positive_ints("moe_intermediate_size", "decoder_sparse_step")
        for name in ("norm_topk_prob", "attention_bias"):
            if not isinstance(getattr(self, name), bool):
                raise self._bad(name, getattr(self, name), "must be true or false")
        layers = self.mlp_only_layers
        if layers is None:
            layers = ()
        if (isinstance(layers, (str, bytes)) or not hasattr(layers, "__iter__")
                or any(not isinstance(i, int) or isinstance(i, bool) or i < 0 for i in layers)):
            raise self._bad("mlp_only_layers", layers,
                            "use a list of layer indices (integers >= 0)")
        object.__setattr__(self, "mlp_only_layers", tuple(sorted(set(layers))))

    @classmethod
    def _from_hf_family(cls, hf: dict, kwargs: dict) -> None:
        if not hf.get("use_sliding_window", False):
            kwargs["sliding_window"] = None  # as transformers reads it
        elif "sliding_window" not in hf:
            kwargs["sliding_window"] = _HF_DEFAULT_WINDOW

    def _to_hf_family(self, out: dict) -> None:
        out["use_sliding_window"] = self.sliding_window is not None
        out["mlp_only_layers"] = list(self.mlp_only_layers)
