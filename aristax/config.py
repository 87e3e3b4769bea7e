"""Frozen, validated configuration dataclasses.

Letters (see ``../shared/design.md``): T tokens, D model dim, F expert hidden dim,
E experts, K experts per token, C capacity.

Every field is checked when the dataclass is built, so a bad value raises a
``ValueError`` naming the field and the allowed values long before ``jit``.
"""

from __future__ import annotations

import dataclasses
import math
from collections.abc import Sequence
from fractions import Fraction
from typing import Any

import jax
import jax.numpy as jnp
import numpy as np

from aristax.pallas_kernels import BACKEND_NAMES

ROUTERS = ("softmax_topk", "topk_softmax", "sigmoid", "expert_choice")
ACTIVATIONS = ("swiglu", "geglu", "gelu", "relu", "clamped_swiglu")
GATED_ACTIVATIONS = ("swiglu", "geglu", "clamped_swiglu")  # those with a gate projection
# How a group of experts is scored for group-limited routing (``routing.group_scores``).
GROUP_SCORES = ("top2_sum", "max", "topk_over_groups")
WEIGHT_SIDES = ("output", "input")
LOSS_CONVENTIONS = ("aristax", "megatron")
DROP_POLICIES = ("position", "probability")
# Expert-parallel token exchanges (``aristax.parallel.collectives``).
EXCHANGES = ("padded", "ragged", "ragged_emulated", "scheduled", "hierarchical")


def _fail(field: str, value: Any, allowed: str, owner: str = "MoEConfig") -> None:
    raise ValueError(f"{owner + '.' if owner else ''}{field}={value!r} is invalid: {allowed}")


def _is_int(value: Any) -> bool:
    """An integer that is not a bool (``True`` is an int in Python)."""
    return isinstance(value, int) and not isinstance(value, bool)


def _is_number(value: Any) -> bool:
    """An int or float that is not a bool."""
    return isinstance(value, (int, float)) and not isinstance(value, bool)


def _is_finite_positive(value: Any) -> bool:
    """A finite number > 0."""
    return _is_number(value) and math.isfinite(value) and value > 0


def _plain_scalars(cfg: Any, owner: str, bool_fields: Sequence[str]) -> None:
    """NumPy scalars as Python ones (np.int64(8) -> 8, so the config compares and hashes
    as with 8), and the ``bool_fields`` checked to be bools ("false" is truthy)."""
    for field in dataclasses.fields(cfg):
        value = getattr(cfg, field.name)
        if isinstance(value, (np.bool_, np.integer, np.floating)):
            object.__setattr__(cfg, field.name, value.item())
    for name in bool_fields:
        if not isinstance(getattr(cfg, name), bool):
            _fail(name, getattr(cfg, name), "must be True or False", owner)


def _check_routing(cfg: Any, owner: str) -> None:
    """The checks ``MoEConfig`` and ``RouterConfig`` share (their routing fields)."""
    E, K, num_groups = cfg.num_experts, cfg.top_k, cfg.num_groups
    if not _is_int(E) or E < 1:
        _fail("num_experts", E, "must be a positive integer", owner)
    if not _is_int(K) or not 1 <= K <= E:
        _fail("top_k", K, f"must be an integer in [1, num_experts={E}]", owner)
    if cfg.router not in ROUTERS:
        _fail("router", cfg.router, f"choose one of {ROUTERS}", owner)
    if not _is_int(num_groups) or num_groups < 1 or E % num_groups:
        _fail("num_groups", num_groups,
              f"must be a positive integer dividing num_experts={E}", owner)
    if not _is_int(cfg.topk_groups) or not 1 <= cfg.topk_groups <= num_groups:
        _fail("topk_groups", cfg.topk_groups,
              f"must be an integer in [1, num_groups={num_groups}]", owner)
    if num_groups > 1 and K > cfg.topk_groups * (E // num_groups):
        _fail("top_k", K, f"must be <= topk_groups * experts per group = "
              f"{cfg.topk_groups * (E // num_groups)} with group-limited routing", owner)
    if num_groups > 1 and cfg.router == "expert_choice":
        _fail("num_groups", num_groups,
              "group-limited routing needs a token-choice router; use 1", owner)
    scale = cfg.routed_scaling_factor
    if not _is_finite_positive(scale):
        _fail("routed_scaling_factor", scale, "must be a finite number > 0", owner)
    if cfg.group_score not in GROUP_SCORES:
        _fail("group_score", cfg.group_score, f"choose one of {GROUP_SCORES}", owner)
    if num_groups > 1 and cfg.group_score == "topk_over_groups" and K < cfg.topk_groups:
        _fail("group_score", cfg.group_score, f"'topk_over_groups' sums the top_k // "
              f"topk_groups best scores of a group (Megatron-Core), so top_k={K} must be "
              f">= topk_groups={cfg.topk_groups}", owner)
    p = cfg.weight_norm_p
    if not _is_finite_positive(p):
        _fail("weight_norm_p", p, "must be a finite number > 0 (1: weights sum to 1)", owner)
    eps = cfg.weight_norm_eps
    if not _is_number(eps) or not math.isfinite(eps) or eps < 0:
        _fail("weight_norm_eps", eps, "must be a finite number >= 0", owner)
    _check_unused_routing(cfg, owner)


def _check_unused_routing(cfg: Any, owner: str) -> None:
    """Refuse routing settings that the chosen router would ignore (rather than accept
    them and compute as if they were left out)."""
    if cfg.router == "expert_choice" and cfg.normalize_weights:
        _fail("normalize_weights", True, "renormalises a token's K weights, and expert "
              "choice has no per-token K: use False", owner)
    normalized = cfg.normalize_weights and cfg.router not in ("topk_softmax", "expert_choice")
    for name, default in (("weight_norm_p", 1.0), ("weight_norm_eps", 0.0)):
        if not normalized and getattr(cfg, name) != default:
            _fail(name, getattr(cfg, name), f"applies only where the weights are "
                  f"renormalised (normalize_weights=True with a router other than "
                  f"'topk_softmax' or 'expert_choice'); leave the default {default}", owner)
    if cfg.num_groups == 1 and cfg.group_score != "top2_sum":
        _fail("group_score", cfg.group_score, "scores groups of experts, and num_groups=1 "
              "has none: set num_groups > 1 or leave the default 'top2_sum'", owner)


def _check_implementation(value: Any) -> None:
    """None, a kernel backend name, or a non-empty list of them."""
    names = [value] if isinstance(value, str) else value
    if value is not None and (
        not isinstance(names, Sequence) or not names
        or any(name not in BACKEND_NAMES for name in names)
    ):
        _fail("implementation", value,
              f"use None, a name or an ordered list of names from {BACKEND_NAMES}")


def check_float_dtype(field: str, value: Any, owner: str = "MoEConfig") -> None:
    """A floating dtype that JAX can hold now (None passes): float64 needs 64-bit mode,
    without which JAX silently makes float32 arrays."""
    if value is None:
        return
    try:
        dtype = jnp.dtype(value)
    except TypeError:
        dtype = None
    if dtype is None or not jnp.issubdtype(dtype, jnp.floating):
        _fail(field, value, "use a floating JAX dtype such as 'float32' or 'bfloat16'", owner)
    if dtype == jnp.float64 and not jax.config.jax_enable_x64:
        _fail(field, value, "float64 needs JAX's 64-bit mode (JAX_ENABLE_X64=1 or "
              "jax.config.update('jax_enable_x64', True)) before the config is built; "
              "otherwise use 'float32'", owner)


@dataclasses.dataclass(frozen=True)
class RouterConfig:
    """What the pure routing functions in ``aristax.routing`` need, nothing more.

    Built from a ``MoEConfig`` by ``MoEConfig.router_config``; see ``MoEConfig`` for
    the meaning of each field.
    """

    num_experts: int
    top_k: int
    router: str = "softmax_topk"
    normalize_weights: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    expert_capacity_factor: float = 1.0
    group_score: str = "top2_sum"
    weight_norm_p: float = 1.0
    weight_norm_eps: float = 0.0

    def __post_init__(self):
        _plain_scalars(self, "RouterConfig", ("normalize_weights",))
        _check_routing(self, "RouterConfig")
        factor = self.expert_capacity_factor
        if not _is_finite_positive(factor):
            _fail("expert_capacity_factor", factor, "must be a finite number > 0",
                  "RouterConfig")


@dataclasses.dataclass(frozen=True)
class MoEConfig:
    """Configuration of one MoE layer.

    Attributes:
      num_experts: E, routed experts.
      top_k: K, experts per token. For ``router="expert_choice"`` it is the average
        number of experts per token: each expert takes ``C = ceil(capacity * T * K / E)``
        tokens, where ``capacity`` is ``capacity_factor`` (1.0 when None).
      d_model: D, the token width (the last dimension of ``x``).
      d_ff: F, the hidden width of each routed expert.
      activation: "swiglu" (silu(x Wg) * x Wu), "geglu" (gelu(x Wg) * x Wu), "gelu"
        (gelu(x Wu)), "relu" (relu(x Wu); Switch Transformers) or "clamped_swiglu"
        (GPT-OSS: g = min(x Wg, limit), u = clip(x Wu, -limit, limit),
        (u + 1) * g * sigmoid(alpha * g), with ``swiglu_limit`` and ``swiglu_alpha``).
        Shared experts use the same activation.
      swiglu_limit, swiglu_alpha: the clamp and the sigmoid's slope of
        "clamped_swiglu" (GPT-OSS's 7.0 and 1.702); other values are refused with the
        other activations, which do not use them.
      router: "softmax_topk" (softmax over E, then top-k; Mixtral/Switch),
        "topk_softmax" (top-k logits, then softmax over the K), "sigmoid" (sigmoid
        scores; DeepSeek-V3), "expert_choice" (each expert picks its tokens; Zhou et
        al. 2022; a token no expert picks gets y = 0, counted in
        ``aux["unchosen_tokens"]``).
      normalize_weights: renormalise the K combine weights to unit ``weight_norm_p``
        norm (Mixtral, DeepSeek-V3: p = 1, the weights sum to 1). Ignored by
        "topk_softmax", whose weights always sum to 1.
      weight_norm_p: p of that norm, w / (sum_k |w_k|^p)^(1/p) (DBRX's
        ``moe_normalize_expert_weights``); 1 by default.
      weight_norm_eps: added to that norm before dividing (LFM2's 1e-6, DeepSeek-V3's
        1e-20); 0 by default.
      num_groups, topk_groups: group-limited routing: experts are split into
        ``num_groups`` equal groups, each scored by ``group_score``, and tokens choose
        experts only inside their ``topk_groups`` best groups. ``num_groups=1``
        disables it.
      group_score: a group's score from its experts' selection scores: "top2_sum"
        (the sum of its two best; DeepSeek-V3, HF ``DeepseekV3TopkRouter``), "max"
        (its best; DeepSeek-V2 ``group_limited_greedy``) or "topk_over_groups" (the
        sum of its top_k // topk_groups best; Megatron-Core ``group_limited_topk``).
      router_bias: a learned router bias b [E]: logits = x Wr + b, so it changes the
        combine weights as well as the selection (GPT-OSS). ``selection_bias`` is the
        other kind.
      selection_bias: the layer holds a fixed per-expert bias [E] added to the scores
        for selection only, never to the weights (DeepSeek-V3's
        ``e_score_correction_bias`` at inference); ``bias_update_rate > 0`` holds and
        updates the same bias.
      routed_scaling_factor: multiplies the routed combine weights (DeepSeek-V3).
      weight_side: where a routed expert's weight w applies: "output" (y = sum_k w_k
        E_k(x); Mixtral and most) or "input" (y = sum_k E_k(w_k x); Llama 4).
      expert_bias: every routed expert has biases: on the gate and up projections
        [E, F] and on the down projection [E, D] (GPT-OSS); y = sum_k w_k (E_k(x) +
        b_down). Shared experts have none.
      shared_expert_gate: the shared experts' output is scaled per token by
        sigmoid(x w_g), w_g [D] learned (Qwen2-MoE, Qwen3-Next).
      bias_update_rate: > 0 enables aux-loss-free balancing (DeepSeek-V3): a per-expert
        bias, added to the scores for *selection only*, updated by
        ``bias += rate * sign(mean_load - load)``; the optimizer never sees it.
      capacity_factor: None = dropless. Otherwise C = ceil(capacity_factor * T * K / E)
        assignments per expert; the rest are dropped, counted and reported.
      drop_policy: which assignments keep their place (row) when an expert overflows:
        "position" (top-1 choices of all tokens first, then top-2, ..., in token order;
        GShard) or "probability" (the same rounds with tokens ordered by their highest
        routing weight; V-MoE's batch prioritized routing).
      num_shared_experts: dense experts applied to every token (DeepSeek), fused into
        one MLP of width ``num_shared_experts * (shared_d_ff or d_ff)``.
      shared_d_ff: width of one shared expert (default ``d_ff``).
      router_jitter: multiplicative noise U(1-eps, 1+eps) on the router input during
        training (Switch Transformer). Mixtral's ``router_jitter_noise`` jitters the
        experts' input as well; ``aristax.models.Mixtral`` applies that itself.
      lb_loss_coef: weight of the Switch/GShard load-balancing loss in ``aux["loss"]``.
      seq_aux_loss_coef: weight of the sequence-wise balance loss (DeepSeek-V3).
      z_loss_coef: weight of the router z-loss (ST-MoE).
      loss_convention: "aristax" (the load-balancing loss E * sum_e f_e P_e as Hugging
        Face's ``load_balancing_loss_func``, balanced = K; the losses count the slots
        actually routed, after selection bias and group limits) or "megatron"
        (Megatron-Core: the same divided by K, balanced = 1, as DeepSeek-V3's eq. 17;
        the losses count a plain top-k of the unbiased, ungrouped scores). See the
        README's table of the losses.
      dtype: compute dtype of the expert MLPs (None: the dtype of ``x``). Router math
        runs in float32; GEMMs accumulate in float32.
      param_dtype: dtype of the parameters.
      implementation: backend name or ordered list of names for
        ``aristax.pallas_kernels`` ops, each falling back to the reference where none
        serves. None: the plain router; on the CPU the dropless experts run the fused
        "xla" ``moe_mlp`` loop (0.60-0.72x the unfused layer's time,
        ``experiments/benchmarks/moe_layer.py``), on a GPU the plain dispatch and
        combine and the grouped GEMMs on ``ragged_dot``'s platform default (Mosaic GPU,
        Triton, then the reference); the fused ``route`` runs only when a kernel is
        named. On an H200 at the Mixtral shape (T 4096, bf16) the GPU default was the
        fastest layer, forward and backward in 22 ms, against 37 ms with "triton" named
        and 70 ms with "mosaic_gpu" (``experiments/benchmarks/gpu_check.py``).
      debug_checks: the ``MoE`` layer raises when some router logits are not finite:
        a ``FloatingPointError`` after an eager call; under ``jit`` a host callback
        fails the computation, which JAX reports as a ``jax.errors.JaxRuntimeError``
        whose message ends in that error's text (``except FloatingPointError`` does
        not catch it; for a typed error there, read ``aux["nonfinite_tokens"]``
        after the jitted call). Otherwise, and always in the functional ``moe``,
        ``chunked_moe`` and ``expert_parallel_moe``, such tokens are routed nowhere and
        counted in ``aux["nonfinite_tokens"]``.
      num_chunks: Lancet overlap: split the tokens into this many chunks so one chunk's
        all-to-all can overlap another's experts; capacity is carried across chunks, so
        the result equals ``num_chunks=1`` (``aristax.parallel.overlap``). None: the
        plan's count when the layer carries out a plan, else 1 (no chunking). The
        ``MoE`` layer caps it at one chunk per token of each shard (a short batch,
        e.g. one decode token per shard, runs with fewer chunks; under expert
        parallelism the token count must still divide over the token shards).
      exchange: expert-parallel token exchange, the all-to-all strategy ("padded",
        "ragged", ...; see ``EXCHANGES``); None picks it from the platform.
    """

    num_experts: int
    top_k: int
    d_model: int
    d_ff: int
    activation: str = "swiglu"
    router: str = "softmax_topk"
    normalize_weights: bool = False
    num_groups: int = 1
    topk_groups: int = 1
    routed_scaling_factor: float = 1.0
    group_score: str = "top2_sum"
    weight_norm_p: float = 1.0
    weight_norm_eps: float = 0.0
    router_bias: bool = False
    selection_bias: bool = False
    weight_side: str = "output"
    expert_bias: bool = False
    shared_expert_gate: bool = False
    swiglu_limit: float = 7.0
    swiglu_alpha: float = 1.702
    loss_convention: str = "aristax"
    bias_update_rate: float = 0.0
    capacity_factor: float | None = None
    drop_policy: str = "position"
    num_shared_experts: int = 0
    shared_d_ff: int | None = None
    router_jitter: float = 0.0
    lb_loss_coef: float = 0.01
    seq_aux_loss_coef: float = 0.0
    z_loss_coef: float = 0.0
    dtype: Any = None
    param_dtype: Any = "float32"
    implementation: str | Sequence[str] | None = None
    debug_checks: bool = False
    num_chunks: int | None = None
    exchange: str | None = None

    def __post_init__(self):
        _plain_scalars(self, "MoEConfig", ("normalize_weights", "debug_checks", "router_bias",
                                           "selection_bias", "expert_bias",
                                           "shared_expert_gate"))
        for name in ("d_model", "d_ff"):
            value = getattr(self, name)
            if not _is_int(value) or value < 1:
                _fail(name, value, "must be a positive integer")
        _check_routing(self, "MoEConfig")
        if self.activation not in ACTIVATIONS:
            _fail("activation", self.activation, f"choose one of {ACTIVATIONS}")
        for name, default in (("swiglu_limit", 7.0), ("swiglu_alpha", 1.702)):
            if not _is_finite_positive(getattr(self, name)):
                _fail(name, getattr(self, name), "must be a finite number > 0")
            if self.activation != "clamped_swiglu" and getattr(self, name) != default:
                _fail(name, getattr(self, name), f"is used by activation='clamped_swiglu' "
                      f"only, not {self.activation!r}: leave it at {default} or set "
                      "activation='clamped_swiglu'")
        if self.weight_side not in WEIGHT_SIDES:
            _fail("weight_side", self.weight_side, f"choose one of {WEIGHT_SIDES}")
        if self.loss_convention not in LOSS_CONVENTIONS:
            _fail("loss_convention", self.loss_convention, f"choose one of {LOSS_CONVENTIONS}")
        if self.shared_expert_gate and self.num_shared_experts == 0:
            _fail("shared_expert_gate", True, "gates the shared experts, and there are none: "
                  "set num_shared_experts > 0 or leave it False")
        if self.drop_policy not in DROP_POLICIES:
            _fail("drop_policy", self.drop_policy, f"choose one of {DROP_POLICIES}")
        if self.capacity_factor is not None and not _is_finite_positive(self.capacity_factor):
            _fail("capacity_factor", self.capacity_factor,
                  "use None (dropless) or a finite number > 0")
        for name in ("bias_update_rate", "router_jitter", "lb_loss_coef",
                     "seq_aux_loss_coef", "z_loss_coef"):
            value = getattr(self, name)
            if not _is_number(value) or value < 0 or not math.isfinite(value):
                _fail(name, value, "must be a finite number >= 0")
        if self.router_jitter >= 1:
            _fail("router_jitter", self.router_jitter, "must be in [0, 1)")
        if self.router == "expert_choice":  # token-choice settings it would ignore
            if self.bias_update_rate > 0:
                _fail("bias_update_rate", self.bias_update_rate,
                      "aux-loss-free balancing needs a token-choice router; use 0")
            if self.seq_aux_loss_coef > 0:
                _fail("seq_aux_loss_coef", self.seq_aux_loss_coef, "the sequence-wise "
                      "balance loss (DeepSeek-V3) needs a token-choice router; use 0")
            if self.drop_policy != "position":
                _fail("drop_policy", self.drop_policy, "expert choice picks its tokens "
                      "itself (no capacity drops); leave the default 'position'")
            if self.selection_bias:
                _fail("selection_bias", True, "a selection bias needs a token-choice "
                      "router; use False")
            if self.loss_convention == "megatron":
                _fail("loss_convention", "megatron", "Megatron-Core's losses count a "
                      "token-choice top-k; use 'aristax' with expert choice")
        elif self.drop_policy != "position" and self.capacity_factor is None:
            _fail("drop_policy", self.drop_policy, "decides which assignments a full expert "
                  "drops, and capacity_factor=None drops none: set capacity_factor or "
                  "leave the default 'position'")
        if not _is_int(self.num_shared_experts) or self.num_shared_experts < 0:
            _fail("num_shared_experts", self.num_shared_experts, "must be an integer >= 0")
        if self.shared_d_ff is not None and (
            not _is_int(self.shared_d_ff) or self.shared_d_ff < 1
        ):
            _fail("shared_d_ff", self.shared_d_ff, "use None (= d_ff) or a positive integer")
        if self.shared_d_ff is not None and self.num_shared_experts == 0:
            _fail("shared_d_ff", self.shared_d_ff, "sizes the shared experts, and there are "
                  "none: set num_shared_experts > 0 or leave shared_d_ff None")
        if self.num_chunks is not None and (not _is_int(self.num_chunks) or self.num_chunks < 1):
            _fail("num_chunks", self.num_chunks,
                  "must be None (the plan's count, else 1) or a positive integer (1 = no chunking)")
        if self.exchange is not None and self.exchange not in EXCHANGES:
            _fail("exchange", self.exchange,
                  f"use None (chosen from the platform) or one of {EXCHANGES}")
        _check_implementation(self.implementation)
        if isinstance(self.implementation, Sequence) and not isinstance(self.implementation, str):
            # a list (from a YAML config, say) as a tuple: the config must stay hashable
            object.__setattr__(self, "implementation", tuple(self.implementation))
        check_float_dtype("dtype", self.dtype)
        check_float_dtype("param_dtype", self.param_dtype)

    @property
    def router_config(self) -> RouterConfig:
        return RouterConfig(
            num_experts=self.num_experts,
            top_k=self.top_k,
            router=self.router,
            normalize_weights=self.normalize_weights,
            num_groups=self.num_groups,
            topk_groups=self.topk_groups,
            routed_scaling_factor=self.routed_scaling_factor,
            expert_capacity_factor=1.0 if self.capacity_factor is None else self.capacity_factor,
            group_score=self.group_score,
            weight_norm_p=self.weight_norm_p,
            weight_norm_eps=self.weight_norm_eps,
        )

    @property
    def gated(self) -> bool:
        """Whether the experts have a gate projection (``GATED_ACTIVATIONS``)."""
        return self.activation in GATED_ACTIVATIONS

    @property
    def holds_selection_bias(self) -> bool:
        """Whether the layer holds a selection bias [E] (fixed, or updated by
        aux-loss-free balancing)."""
        return self.selection_bias or self.bias_update_rate > 0

    @property
    def shared_width(self) -> int:
        """Hidden width of the fused shared-expert MLP (0 when there is none)."""
        return self.num_shared_experts * (self.shared_d_ff or self.d_ff)

    def capacity(self, num_tokens: int) -> int | None:
        """C = ceil(capacity_factor * T * K / E), or None when dropless."""
        if self.capacity_factor is None:
            return None
        return expert_capacity(num_tokens, self.top_k, self.num_experts, self.capacity_factor)

    def replace(self, **changes) -> MoEConfig:
        return dataclasses.replace(self, **changes)


def accumulation_dtype(*dtypes) -> jnp.dtype:
    """float64 if any input is float64, else float32: the dtype sums and router math
    run in (bf16/f16/f32 inputs accumulate in float32)."""
    return jnp.dtype(jnp.float64 if any(jnp.dtype(d) == jnp.float64 for d in dtypes)
                     else jnp.float32)


def expert_capacity(num_tokens: int, top_k: int, num_experts: int, factor: float) -> int:
    """C = ceil(factor * T * K / E) (GShard), at least 1, with the factor taken as the
    decimal it is written as: in floats 1.1 * 100 / 2 is 55.00000000000001, whose
    ceiling would give one place too many."""
    exact = Fraction(repr(float(factor))) * num_tokens * top_k / num_experts
    return max(1, math.ceil(exact))
