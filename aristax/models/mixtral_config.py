"""``MixtralConfig``: the hyper-parameters of ``aristax.models.Mixtral``, named as in
Hugging Face's config.json (its own module so that ``hf`` reads configs without
importing the model)."""

from __future__ import annotations

import dataclasses
from typing import Any

import jax

from aristax import MoEConfig
from aristax.config import check_float_dtype


# Fields of how this model computes, which config.json does not hold
_NOT_IN_CONFIG_JSON = ("dtype", "matmul_precision")
# transformers' MixtralConfig.attribute_map: config.json keys read as another field
_HF_ALIASES = {"num_experts": "num_local_experts"}


def _bad(field: str, value: Any, fix: str) -> ValueError:
    return ValueError(f"MixtralConfig.{field}={value!r} is invalid: {fix}")


@dataclasses.dataclass(frozen=True)
class MixtralConfig:
    """Hyper-parameters of a Mixtral decoder, named as in Hugging Face's config.json.

    ``head_dim`` None means ``hidden_size // num_attention_heads`` (resolved on build).
    ``dtype`` is the parameter and compute dtype of this model ("float32" by default;
    it is not read from a checkpoint, whose dtype only describes its storage).
    ``matmul_precision`` is the precision of a float32 model's matrix products, a
    ``jax.default_matmul_precision`` name: "highest" (default) computes them in full
    float32, as PyTorch and so Hugging Face do by default (JAX's own default lets an
    NVIDIA GPU use TF32, about 1e-3 relative, far outside the parity tolerance);
    "default" or "tensorfloat32" trade that for speed; None keeps JAX's current
    setting. The CPU computes float32 products in full float32 whatever this says;
    bfloat16 models ignore it.
    """

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    num_local_experts: int = 8
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = None
    max_position_embeddings: int = 4096 * 32
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    router_jitter_noise: float = 0.0
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    dtype: str = "float32"
    matmul_precision: str | None = "highest"

    def __post_init__(self):
        for name in ("vocab_size", "hidden_size", "intermediate_size", "num_hidden_layers",
                     "num_attention_heads", "num_key_value_heads", "num_local_experts",
                     "max_position_embeddings"):
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise _bad(name, value, "must be a positive integer")
        H, G = self.num_attention_heads, self.num_key_value_heads
        if H % G:
            raise _bad("num_key_value_heads", G, f"must divide num_attention_heads={H}")
        if self.head_dim is None:
            if self.hidden_size % H:
                raise _bad("head_dim", None, f"set it explicitly: hidden_size="
                           f"{self.hidden_size} is not divisible by num_attention_heads={H}")
            object.__setattr__(self, "head_dim", self.hidden_size // H)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise _bad("head_dim", self.head_dim, "must be a positive even integer (rotary)")
        E, K = self.num_local_experts, self.num_experts_per_tok
        if not isinstance(K, int) or not 1 <= K <= E:
            raise _bad("num_experts_per_tok", K, f"must be an integer in [1, {E}]")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise _bad("sliding_window", self.sliding_window, "use None or a positive integer")
        for name in ("rms_norm_eps", "rope_theta"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise _bad(name, getattr(self, name), "must be a number > 0")
        if not 0 <= self.router_jitter_noise < 1:
            raise _bad("router_jitter_noise", self.router_jitter_noise, "must be in [0, 1)")
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        check_float_dtype("dtype", self.dtype, "MixtralConfig")
        try:
            with jax.default_matmul_precision(self.matmul_precision):
                pass
        except ValueError:
            raise _bad("matmul_precision", self.matmul_precision,
                       "use a jax.default_matmul_precision name ('highest' for full "
                       "float32, 'default' for JAX's choice) or None") from None

    # ----------------------------------------------------------------- HF config
    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> MixtralConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x).

        Reads ``rope_theta`` from ``rope_parameters`` (5.x) or the top level (4.x);
        only the "default" rope type is supported. Keys this model does not use
        (``attention_dropout``, ``use_cache``, ...) are ignored.
        """
        model_type = hf.get("model_type", "mixtral")
        if model_type != "mixtral":
            raise ValueError(f"config.json has model_type={model_type!r}; Mixtral needs 'mixtral'")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json has hidden_act={act!r}; Mixtral experts need 'silu'")
        rope = hf.get("rope_parameters") or {}
        scaling = hf.get("rope_scaling")
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default" or scaling:
            raise ValueError(
                f"config.json asks for rope_type={rope_type!r} / rope_scaling={scaling!r}; "
                "only plain rotary embeddings ('default') are supported"
            )
        theta = rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta))
        hf = {_HF_ALIASES.get(key, key): value for key, value in hf.items()}
        kwargs = {f.name: hf[f.name] for f in dataclasses.fields(cls)
                  if f.name in hf and f.name not in _NOT_IN_CONFIG_JSON}
        kwargs["rope_theta"] = float(theta)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = hf.get("num_attention_heads", cls.num_attention_heads)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """The ``config.json`` dict that ``transformers.MixtralForCausalLM`` loads."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", *_NOT_IN_CONFIG_JSON)}
        if isinstance(out["eos_token_id"], tuple):
            out["eos_token_id"] = list(out["eos_token_id"])
        out.update(
            architectures=["MixtralForCausalLM"],
            model_type="mixtral",
            hidden_act="silu",
            attention_dropout=0.0,
            output_router_logits=False,
            use_cache=True,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            dtype=self.dtype,
        )
        return out

    def moe_config(self) -> MoEConfig:
        """The ``aristax.MoEConfig`` of one Mixtral MoE block."""
        return MoEConfig(
            num_experts=self.num_local_experts,
            top_k=self.num_experts_per_tok,
            d_model=self.hidden_size,
            d_ff=self.intermediate_size,
            activation="swiglu",
            router="softmax_topk",
            normalize_weights=True,
            lb_loss_coef=self.router_aux_loss_coef,
            param_dtype=self.dtype,  # router_jitter_noise: DecoderLayer jitters the input
        )

    def replace(self, **changes) -> MixtralConfig:
        return dataclasses.replace(self, **changes)
