"""``DecoderConfig``: the hyper-parameters the shared MoE decoder
(``aristax.models.decoder``) reads, named as in Hugging Face's config.json; the base of
``MixtralConfig`` and ``Qwen3MoeConfig`` (its own module so that ``hf`` reads configs
without importing a model).

A family subclass redeclares the fields whose defaults differ, adds its own fields,
sets the class-level description (``model_type``, ``architecture``, ...) and overrides
the properties under "what varies by family"; validation, ``from_hf``, ``to_hf`` and
``moe_config`` are shared.
"""

from __future__ import annotations

import dataclasses
from typing import Any, ClassVar

import jax

from aristax import MoEConfig
from aristax.config import check_float_dtype

# Fields of how this model computes, which config.json does not hold
_NOT_IN_CONFIG_JSON = ("dtype", "matmul_precision")


@dataclasses.dataclass(frozen=True)
class DecoderConfig:
    """Hyper-parameters of a decoder-only transformer whose MLPs are (mostly) MoE blocks
    with softmax top-K routing and SwiGLU experts, named as in Hugging Face's config.json.
    The defaults are Mixtral's; subclasses redeclare theirs.

    ``head_dim`` None means ``hidden_size // num_attention_heads`` (resolved on build).
    ``sliding_window`` None: full causal attention; else every layer sees the last W
    key slots (HF's ``sliding_window_overlay``).
    ``output_router_logits`` only round-trips config.json (there it makes HF's forward
    return the aux loss by default); aristax's cache-free forward always returns the
    aux loss and the router logits.
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

    # ------------------------------------------------ the family (set by subclasses)
    display_name: ClassVar[str] = "decoder"  # in error messages: "Mixtral", "Qwen3-MoE"
    model_type: ClassVar[str] = ""  # config.json's "model_type"
    architecture: ClassVar[str] = ""  # config.json's "architectures" entry
    experts_field: ClassVar[str] = "num_local_experts"  # the field holding E
    # config.json keys read as another field (transformers' attribute_map)
    hf_aliases: ClassVar[dict[str, str]] = {}
    # per-head RMSNorm of queries and keys before rotary (Qwen3)
    qk_norm: ClassVar[bool] = False

    vocab_size: int = 32000
    hidden_size: int = 4096
    intermediate_size: int = 14336
    num_hidden_layers: int = 32
    num_attention_heads: int = 32
    num_key_value_heads: int = 8
    head_dim: int | None = None
    num_experts_per_tok: int = 2
    rms_norm_eps: float = 1e-5
    rope_theta: float = 1e6
    sliding_window: int | None = None
    max_position_embeddings: int = 4096 * 32
    tie_word_embeddings: bool = False
    router_aux_loss_coef: float = 0.001
    output_router_logits: bool = False
    initializer_range: float = 0.02
    bos_token_id: int | None = 1
    eos_token_id: int | tuple[int, ...] | None = 2
    pad_token_id: int | None = None
    dtype: str = "float32"
    matmul_precision: str | None = "highest"

    # ------------------------------------------------ what varies by family
    @property
    def num_routed_experts(self) -> int:
        """E, the experts of each MoE block."""
        return getattr(self, self.experts_field)

    @property
    def expert_intermediate_size(self) -> int:
        """F, the hidden width of one expert."""
        return self.intermediate_size

    @property
    def normalize_topk_weights(self) -> bool:
        """Whether the K routing weights are renormalised to sum to 1."""
        return True

    @property
    def attention_bias(self) -> bool:
        """Whether q/k/v/o projections carry a bias."""
        return False

    @property
    def moe_input_jitter(self) -> float:
        """eps of the U(1 - eps, 1 + eps) noise on a MoE block's input in training."""
        return 0.0

    def layer_is_sparse(self, index: int) -> bool:
        """Whether layer ``index`` has a MoE block (else a dense SwiGLU MLP of width
        ``intermediate_size``)."""
        return True

    def _check_family(self) -> None:
        """The subclass's own fields (called by ``__post_init__`` after the shared ones
        that do not depend on them)."""

    @classmethod
    def _from_hf_family(cls, hf: dict, kwargs: dict) -> None:
        """Edit ``kwargs`` (read from config.json ``hf``) for the subclass's fields."""

    def _to_hf_family(self, out: dict) -> None:
        """Edit the config.json dict ``out`` for the subclass's fields."""

    # ------------------------------------------------ validation
    def _bad(self, field: str, value: Any, fix: str) -> ValueError:
        return ValueError(f"{type(self).__name__}.{field}={value!r} is invalid: {fix}")

    def _check_positive_ints(self, *names: str) -> None:
        for name in names:
            value = getattr(self, name)
            if not isinstance(value, int) or isinstance(value, bool) or value < 1:
                raise self._bad(name, value, "must be a positive integer")

    def __post_init__(self):
        self._check_positive_ints("vocab_size", "hidden_size", "intermediate_size",
                                  "num_hidden_layers", "num_attention_heads",
                                  "num_key_value_heads", self.experts_field,
                                  "max_position_embeddings")
        H, G = self.num_attention_heads, self.num_key_value_heads
        if H % G:
            raise self._bad("num_key_value_heads", G, f"must divide num_attention_heads={H}")
        if self.head_dim is None:
            if self.hidden_size % H:
                raise self._bad("head_dim", None, f"set it explicitly: hidden_size="
                                f"{self.hidden_size} is not divisible by num_attention_heads={H}")
            object.__setattr__(self, "head_dim", self.hidden_size // H)
        if not isinstance(self.head_dim, int) or self.head_dim < 2 or self.head_dim % 2:
            raise self._bad("head_dim", self.head_dim, "must be a positive even integer (rotary)")
        E, K = self.num_routed_experts, self.num_experts_per_tok
        if not isinstance(K, int) or not 1 <= K <= E:
            raise self._bad("num_experts_per_tok", K, f"must be an integer in [1, {E}]")
        if self.sliding_window is not None and (
            not isinstance(self.sliding_window, int) or self.sliding_window < 1
        ):
            raise self._bad("sliding_window", self.sliding_window, "use None or a positive integer")
        for name in ("rms_norm_eps", "rope_theta"):
            if not isinstance(getattr(self, name), (int, float)) or getattr(self, name) <= 0:
                raise self._bad(name, getattr(self, name), "must be a number > 0")
        self._check_family()
        if isinstance(self.eos_token_id, list):
            object.__setattr__(self, "eos_token_id", tuple(self.eos_token_id))
        check_float_dtype("dtype", self.dtype, type(self).__name__)
        try:
            with jax.default_matmul_precision(self.matmul_precision):
                pass
        except ValueError:
            raise self._bad("matmul_precision", self.matmul_precision,
                            "use a jax.default_matmul_precision name ('highest' for full "
                            "float32, 'default' for JAX's choice) or None") from None

    # ----------------------------------------------------------------- HF config
    @classmethod
    def from_hf(cls, hf: dict, **overrides) -> DecoderConfig:
        """Build from a Hugging Face ``config.json`` dict (transformers 4.x or 5.x).

        Reads ``rope_theta`` from ``rope_parameters`` (5.x) or the top level (4.x);
        only the "default" rope type is supported. Keys this model does not use
        (``attention_dropout``, ``use_cache``, ...) are ignored.
        """
        name = cls.display_name
        model_type = hf.get("model_type", cls.model_type)
        if model_type != cls.model_type:
            raise ValueError(f"config.json has model_type={model_type!r}; {name} needs "
                             f"{cls.model_type!r}")
        act = hf.get("hidden_act", "silu")
        if act != "silu":
            raise ValueError(f"config.json has hidden_act={act!r}; {name} experts need 'silu'")
        # transformers 5 reads a 4.x file's rope_scaling as rope_parameters
        key = "rope_parameters" if hf.get("rope_parameters") else "rope_scaling"
        rope = hf.get(key) or {}
        rope_type = rope.get("rope_type", rope.get("type", "default"))
        if rope_type != "default":
            raise ValueError(
                f"config.json asks for rope_type={rope_type!r} ({key}={rope!r}); only "
                "plain rotary embeddings (rope_type 'default') are supported"
            )
        theta = rope.get("rope_theta", hf.get("rope_theta", cls.rope_theta))
        aliased = {cls.hf_aliases.get(key, key): value for key, value in hf.items()}
        kwargs = {f.name: aliased[f.name] for f in dataclasses.fields(cls)
                  if f.name in aliased and f.name not in _NOT_IN_CONFIG_JSON}
        kwargs["rope_theta"] = float(theta)
        if kwargs.get("num_key_value_heads") is None:
            kwargs["num_key_value_heads"] = aliased.get("num_attention_heads",
                                                        cls.num_attention_heads)
        cls._from_hf_family(aliased, kwargs)
        kwargs.update(overrides)
        return cls(**kwargs)

    def to_hf(self) -> dict:
        """The ``config.json`` dict that the transformers model class loads."""
        out = {f.name: getattr(self, f.name) for f in dataclasses.fields(self)
               if f.name not in ("rope_theta", *_NOT_IN_CONFIG_JSON)}
        if isinstance(out["eos_token_id"], tuple):
            out["eos_token_id"] = list(out["eos_token_id"])
        out.update(
            architectures=[self.architecture],
            model_type=self.model_type,
            hidden_act="silu",
            attention_dropout=0.0,
            use_cache=True,
            rope_parameters={"rope_theta": self.rope_theta, "rope_type": "default"},
            dtype=self.dtype,
        )
        self._to_hf_family(out)
        return out

    def moe_config(self) -> MoEConfig:
        """The ``aristax.MoEConfig`` of one MoE block of this family."""
        return MoEConfig(
            num_experts=self.num_routed_experts,
            top_k=self.num_experts_per_tok,
            d_model=self.hidden_size,
            d_ff=self.expert_intermediate_size,
            activation="swiglu",
            router="softmax_topk",
            normalize_weights=self.normalize_topk_weights,
            lb_loss_coef=self.router_aux_loss_coef,
            param_dtype=self.dtype,  # moe_input_jitter: DecoderLayer jitters the input
        )

    def replace(self, **changes):
        return dataclasses.replace(self, **changes)
