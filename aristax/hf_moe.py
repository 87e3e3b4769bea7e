"""Hugging Face MoE blocks <-> aristax (public as ``aristax.models.hf_moe``; here, below
the NNX layer, so that ``MoE.from_hf`` uses it): ``config, params = from_hf(block)`` such that
``aristax.moe(x, params, config)[0]`` equals ``block(x)``, and ``to_hf(config, params,
like=block)`` gives the block's state dict back.

A block is the MoE MLP module a transformers decoder layer calls (``MixtralSparseMoeBlock``,
``Qwen2MoeSparseMoeBlock``, ``DeepseekV3MoE``, ``GptOssMLP``, ``Llama4TextMoe``, ``DbrxFFN``,
``SwitchTransformersSparseMLP``, ...). Its router class decides the routing
(``ROUTERS``: score function, normalisation, scaling, group rule, selection bias, where
the weight applies); its experts are read from the stacked layouts of transformers 5
(``gate_up_proj`` concatenated or interleaved, transposed or not, with or without
biases) or the per-model ones of Llama 4, DBRX and Switch; shared experts from their
``gate_proj``/``up_proj``/``down_proj`` MLP and Qwen2-MoE's ``shared_expert_gate``.

Every tensor of the block's state dict has one place in ``MoEParams`` or
``MoE``'s selection bias; a block with a tensor or a routing rule aristax does not
compute is refused with a ``NotImplementedError`` naming it (``SUPPORTED`` lists the
router classes; ``tests/conformance`` checks every block of the installed transformers).

torch and transformers are needed only to call these functions.
"""

from __future__ import annotations

import dataclasses
import warnings
from collections.abc import Callable
from typing import Any

import jax.numpy as jnp
import numpy as np

from aristax.config import MoEConfig
from aristax.moe import MoEParams, param_shapes

# MoEConfig fields that say how aristax runs or trains a layer, not what a block computes
# (``to_hf`` ignores them; ``MoE.from_hf`` takes them).
NOT_STRUCTURAL = ("bias_update_rate", "capacity_factor", "drop_policy", "router_jitter",
                   "lb_loss_coef", "seq_aux_loss_coef", "z_loss_coef", "loss_convention",
                   "dtype", "param_dtype", "implementation", "debug_checks", "num_chunks",
                   "exchange")


@dataclasses.dataclass(frozen=True)
class RouterRule:
    """How a router class routes, in ``MoEConfig`` terms.

    Attributes:
      router: ``MoEConfig.router``.
      normalize: renormalise the K weights: a bool, or the router attribute that says
        (``norm_topk_prob``).
      scale: the router's (else the block's) attribute holding
        ``routed_scaling_factor`` (None: 1).
      groups: the group rule when the router has ``num_group`` > 1 (None: no groups).
      selection_bias: dotted path, from the block, of the selection-only bias [E]
        (None: none).
      weight_side: ``MoEConfig.weight_side``.
      norm_eps: what the router adds to the weights' sum before dividing
        (``MoEConfig.weight_norm_eps``).
    """

    router: str
    normalize: bool | str = False
    scale: str | None = None
    groups: str | None = None
    selection_bias: str | None = None
    weight_side: str = "output"
    norm_eps: float = 0.0


_SOFTMAX = RouterRule("softmax_topk", normalize="norm_topk_prob")
_RENORM = RouterRule("softmax_topk", normalize=True)
_V3 = RouterRule("sigmoid", normalize="norm_topk_prob", scale="routed_scaling_factor",
                 groups="top2_sum", selection_bias="gate.e_score_correction_bias",
                 norm_eps=1e-20)
# Attributes (of a block or its router) of noise that HF applies in training only.
TRAINING_JITTER = ("jitter_noise", "router_jitter_noise", "input_jitter_noise", "moe_jitter_eps")
# Router class name -> its routing (read from transformers 5's modeling files).
ROUTERS: dict[str, RouterRule] = {
    **dict.fromkeys(("MixtralTopKRouter", "MiniMaxTopKRouter", "Qwen3_5MoeTopKRouter",
                     "HunYuanMoEV1Gate"), _RENORM),
    **dict.fromkeys(("Qwen2MoeTopKRouter", "Qwen3MoeTopKRouter", "Qwen3NextTopKRouter",
                     "Qwen4ExpTextTopKRouter", "OlmoeTopKRouter", "FlexOlmoTopKRouter",
                     "MellumTopKRouter", "JambaTopKRouter", "LaraMiniTopKRouter"), _SOFTMAX),
    **dict.fromkeys(("DeepseekV3TopkRouter", "DeepseekV32TopkRouter", "Dots1TopkRouter",
                     "Glm4MoeTopkRouter", "Glm4MoeLiteTopkRouter", "GlmMoeDsaTopkRouter",
                     "SolarOpenTopkRouter", "BailingHybridTopkRouter", "KimiLinearTopkRouter",
                     "ExaoneMoeTopkRouter", "Dots3NoteTextTopkRouter",
                     "MiMoV2FlashTopkRouter"), _V3),
    "Mistral4TopkRouter": dataclasses.replace(_V3, router="softmax_topk", selection_bias=None),
    "MistralLarge4TextTopkRouter": dataclasses.replace(_V3, router="softmax_topk",
                                                       selection_bias=None, normalize=True),
    "BeamTopKRouter": _V3,  # its scaling factor is the block's
    "FlintTopKRouter": RouterRule("sigmoid", normalize="norm_topk_prob"),
    "HYV3TopKRouter": RouterRule("sigmoid", normalize=True, scale="router_scaling_factor",
                                 selection_bias="e_score_correction_bias", norm_eps=1e-20),
    "AfmoeTokenChoiceRouter": RouterRule("sigmoid", normalize=True, scale="route_scale",
                                         selection_bias="expert_bias", norm_eps=1e-20),
    "DeepseekV2TopkRouter": RouterRule("softmax_topk", scale="routed_scaling_factor",
                                       groups="max"),
    "Ernie4_5_MoeTopKRouter": dataclasses.replace(
        _RENORM, selection_bias="gate.moe_statics.e_score_correction_bias"),
    "Lfm2MoeTopKRouter": RouterRule("sigmoid", normalize="norm_topk_prob",
                                    scale="routed_scaling_factor",
                                    selection_bias="expert_bias", norm_eps=1e-6),
    "MiniMaxM2TopKRouter": RouterRule("sigmoid", normalize=True,
                                      selection_bias="e_score_correction_bias"),
    **dict.fromkeys(("GptOssTopKRouter", "GraniteMoeTopKRouter", "GraniteMoeSharedTopKRouter",
                     "GraniteMoeHybridTopKRouter", "GraniteMoeSWATopKRouter",
                     "AriaTextTopKRouter"), RouterRule("topk_softmax")),
    "Llama4Router": RouterRule("sigmoid", weight_side="input"),
    "DbrxRouter": RouterRule("softmax_topk"),  # p-norm from the block
    "SwitchTransformersTop1Router": RouterRule("softmax_topk"),
}
SUPPORTED = tuple(ROUTERS)
# Router classes known and refused, with what aristax lacks to compute them.
REFUSED = {
    "PhimoeTopKRouter": "Phimoe's sparsemixer routing (masked argmax rounds with jitter)",
    "JetMoeTopKGating": "JetMoE's unweighted output bias and its attention experts",
    "Cohere2MoeTopKRouter": "Cohere2-MoE's average of routed and shared outputs",
    "LongcatFlashTopkRouter": "LongCat-Flash's identity (zero-computation) experts",
    "Gemma4TextRouter": "Gemma 4's router RMSNorm and per-expert output scales",
    "NemotronHTopkRouter": "Nemotron-H's squared-ReLU experts (and latent projections)",
    "DeepseekV4TopKRouter": "DeepSeek-V4's sqrt(softplus) scores",
    "HYV4TopkRouter": "HY-V4's SwiGLU clamped before the SiLU",
    "Glm5NextTextTopkRouter": "GLM-5-Next's SwiGLU clamped before the SiLU",
    "AXK1TopkRouter": "AXK1's RMSNorm after the experts",
    "AXK2TopkRouter": "AXK2's group mask by 0 instead of -inf",
    "Step3p7TopKRouter": "Step-3.7's clamp after the SiLU",
    "MiniMaxM3VLTopKRouter": "MiniMax-M3's clamped GLU on the shared expert's own layout",
    "OpenAIPrivacyFilterTopKRouter": "the privacy filter's weights scaled by K",
    "InklingTopkRouter": "Inkling's shared experts weighted by the router",
    "Inkling2TopKRouter": "Inkling-2's softcapped SwiGLU",
    "MuseSparkTopkRouter": "Muse-Spark's expert projections and norms",
    "Kolibri1TopKRouter": "Kolibri-1's selection bias on the logits",
    "LagunaTopKRouter": "Laguna's router softcap",
}

# state-dict key -> (MoEParams fields it fills, hf -> ours, ours -> hf), numpy arrays
Slot = tuple[tuple[str, ...], Callable[[np.ndarray], tuple], Callable[..., np.ndarray]]


def _t(w):  # [E, a, b] <-> [E, b, a]
    return np.swapaxes(w, -1, -2)


def _split(w: np.ndarray, axis: int, interleaved: bool) -> tuple[np.ndarray, np.ndarray]:
    """(gate, up) halves of a fused gate_up along ``axis``: [gate | up] or interleaved."""
    if interleaved:
        idx = np.arange(w.shape[axis])
        return np.take(w, idx[0::2], axis), np.take(w, idx[1::2], axis)
    return tuple(np.split(w, 2, axis=axis))


def _join(gate: np.ndarray, up: np.ndarray, axis: int, interleaved: bool) -> np.ndarray:
    if not interleaved:
        return np.concatenate([gate, up], axis=axis)
    out = np.stack([gate, up], axis=axis + 1 if axis >= 0 else axis)
    shape = list(gate.shape)
    shape[axis] *= 2
    return out.reshape(shape)


def _module(block, path: str):
    for name in path.split("."):
        block = getattr(block, name, None)
        if block is None:
            return None
    return block


def _activation(act, where: str) -> str:
    """The gated activation of a torch activation module: swiglu or geglu."""
    name = type(act).__name__
    if name in ("SiLUActivation", "SiLU") or getattr(act, "__name__", "") == "silu":
        return "swiglu"
    if name in ("GELUActivation", "GELU") and getattr(act, "approximate", "none") == "none":
        return "geglu"
    raise NotImplementedError(f"{where}: activation {name} is not one aristax computes "
                              "(SiLU or exact GELU for gated experts)")


def _experts(block, rule: RouterRule) -> tuple[dict[str, Any], dict[str, Slot]]:
    """Config values and state-dict slots of the routed experts."""
    ex = block.experts
    cls = type(ex).__name__
    if cls == "DbrxExperts":
        E, F = ex.num_experts, ex.ffn_hidden_size
        act = _activation(ex.mlp.activation_fn, cls)
        flat = lambda w: _t(w.reshape(E, F, -1))  # noqa: E731  [E*F, D] -> [E, D, F]
        back = lambda w: _t(w).reshape(E * F, -1)  # noqa: E731
        return dict(activation=act, d_ff=F), {
            "experts.mlp.w1": (("gate_edf",), lambda w: (flat(w),), back),
            "experts.mlp.v1": (("up_edf",), lambda w: (flat(w),), back),
            "experts.mlp.w2": (("down_efd",), lambda w: (w.reshape(E, F, -1),),
                               lambda w: w.reshape(E * F, -1))}
    if cls == "SwitchTransformersExperts":
        experts = [getattr(ex, f"expert_{e}") for e in range(ex.num_experts)]
        if any(type(e.act).__name__ != "ReLU" for e in experts):
            raise NotImplementedError(f"{cls}: only ReLU experts ('dense_act_fn': 'relu')")
        slots = {}
        for e, mod in enumerate(experts):
            for name, field in (("wi", "up_edf"), ("wo", "down_efd")):
                if getattr(mod, name).bias is not None:
                    raise NotImplementedError(f"{cls}: expert biases on {name}")
                slots[f"experts.expert_{e}.{name}.weight"] = ((field,), None, None)
        return dict(activation="relu", d_ff=experts[0].wi.out_features), slots
    if cls == "Llama4TextExperts":  # transposed, concatenated, the block's act
        transposed, concatenated, biased = True, True, False
        act = _activation(ex.act_fn, cls)
    elif hasattr(ex, "is_transposed"):
        transposed, concatenated = ex.is_transposed, ex.is_concatenated
        biased = ex.has_bias
        if not ex.has_gate or getattr(ex, "has_post_expert_norm", False):
            raise NotImplementedError(f"{cls}: experts without a gate or with a norm")
        act = ("clamped_swiglu" if hasattr(ex, "limit") and hasattr(ex, "alpha")
               else _activation(ex.act_fn, cls))
    else:
        raise NotImplementedError(f"{cls}: an expert layout aristax does not read")
    axis = -1 if transposed else -2  # the 2F axis of gate_up_proj
    F = ex.gate_up_proj.shape[axis] // 2
    il = not concatenated
    orient = (lambda w: w) if transposed else _t  # to [E, D, ...] / [E, F, D]
    slots = {
        "experts.gate_up_proj": (("gate_edf", "up_edf"),
                                 lambda w: tuple(orient(h) for h in _split(w, axis, il)),
                                 lambda g, u: _join(orient(g), orient(u), axis, il)),
        "experts.down_proj": (("down_efd",), lambda w: (orient(w),), orient)}
    if biased:
        slots["experts.gate_up_proj_bias"] = (("gate_bias_ef", "up_bias_ef"),
                                              lambda b: _split(b, -1, il),
                                              lambda g, u: _join(g, u, -1, il))
        slots["experts.down_proj_bias"] = (("down_bias_ed",), lambda b: (b,), lambda b: b)
    values = dict(activation=act, d_ff=F, expert_bias=biased)
    if act == "clamped_swiglu":
        values.update(swiglu_limit=float(ex.limit), swiglu_alpha=float(ex.alpha))
    return values, slots


def _shared(block, activation: str) -> tuple[dict[str, Any], dict[str, Slot]]:
    """Config values and slots of the shared experts (a gate/up/down MLP) and their
    per-token sigmoid gate."""
    for name in ("shared_expert", "shared_experts", "shared_mlp"):
        mlp = getattr(block, name, None)
        if mlp is not None:
            break
    else:
        return {}, {}
    where = f"{type(block).__name__}.{name}"
    if not all(hasattr(mlp, p) for p in ("gate_proj", "up_proj", "down_proj")):
        raise NotImplementedError(f"{where}: a shared MLP without gate/up/down projections")
    act = getattr(mlp, "act_fn", None) or getattr(mlp, "activation_fn", None)
    if _activation(act, where) != activation:
        raise NotImplementedError(f"{where}: its activation differs from the routed "
                                  "experts' (aristax gives both one activation)")
    slots = {}
    for proj, field in (("gate_proj", "shared_gate_df"), ("up_proj", "shared_up_df"),
                        ("down_proj", "shared_down_fd")):
        if getattr(mlp, proj).bias is not None:
            raise NotImplementedError(f"{where}.{proj}: a bias on a shared expert")
        slots[f"{name}.{proj}.weight"] = ((field,), lambda w: (w.T,), lambda w: w.T)
    values = dict(num_shared_experts=1, shared_d_ff=mlp.up_proj.out_features)
    gate = getattr(block, "shared_expert_gate", None)
    if gate is not None:
        if gate.bias is not None:
            raise NotImplementedError(f"{type(block).__name__}.shared_expert_gate: a bias")
        slots["shared_expert_gate.weight"] = (("shared_expert_gate_d",),
                                              lambda w: (w[0],), lambda w: w[None])
        values["shared_expert_gate"] = True
    return values, slots


def _router(block) -> tuple[Any, str, RouterRule]:
    """(router module, its state-dict prefix, its rule)."""
    for name in ("gate", "router"):
        router = getattr(block, name, None)
        if router is not None:
            break
    else:
        raise NotImplementedError(f"{type(block).__name__}: no router ('gate' or 'router') "
                                  "found; from_hf takes an MoE block module")
    cls = type(router).__name__
    if cls in REFUSED:
        raise NotImplementedError(f"{type(block).__name__}: {REFUSED[cls]} is not computed "
                                  "by aristax")
    if cls not in ROUTERS:
        raise NotImplementedError(f"{type(block).__name__}: router {cls} is not one "
                                  f"from_hf knows (aristax.models.hf_moe.SUPPORTED)")
    return router, name, ROUTERS[cls]


def _plan(block) -> tuple[dict[str, Any], dict[str, Slot], str | None]:
    """(MoEConfig values, state-dict slots, selection-bias key or None) of ``block``."""
    import torch

    router, prefix, rule = _router(block)
    cls = type(router).__name__
    weight = {"DbrxRouter": "layer.weight", "SwitchTransformersTop1Router": "classifier.weight",
              "HunYuanMoEV1Gate": "wg.weight", "AfmoeTokenChoiceRouter": "gate.weight",
              }.get(cls, "weight")
    bias_key = weight.replace("weight", "bias")
    w = _module(router, weight)
    E, D = w.shape
    values = dict(num_experts=E, d_model=D, router=rule.router, weight_side=rule.weight_side)
    slots = {f"{prefix}.{weight}": (("router_de",), lambda w: (w.T,), lambda w: w.T)}
    if isinstance(_module(router, bias_key), torch.nn.Parameter):
        slots[f"{prefix}.{bias_key}"] = (("router_bias_e",), lambda b: (b,), lambda b: b)
        values["router_bias"] = True
    top_k = getattr(router, "top_k", None) or getattr(block, "top_k", None)
    if cls == "SwitchTransformersTop1Router":
        top_k = 1
    values["top_k"] = int(top_k)
    normalize = rule.normalize
    values["normalize_weights"] = bool(getattr(router, normalize, False)
                                       if isinstance(normalize, str) else normalize)
    if values["normalize_weights"] and rule.norm_eps:
        values["weight_norm_eps"] = rule.norm_eps
    if cls == "Ernie4_5_MoeTopKRouter" and router.norm_min > top_k / E:
        # w / clamp(sum, norm_min): the clamp never binds while norm_min <= K / E, the
        # least a top-K softmax sum can be
        raise NotImplementedError(f"{type(block).__name__}: moe_norm_min={router.norm_min} "
                                  f"> top_k / E = {top_k / E} clamps the weights' sum, which "
                                  "aristax does not compute")
    if cls == "DbrxRouter":
        p = block.moe_normalize_expert_weights
        values.update(normalize_weights=p is not None, weight_norm_p=float(p or 1.0))
    if rule.scale is not None:
        scale = getattr(router, rule.scale, None)
        values["routed_scaling_factor"] = float(getattr(block, rule.scale) if scale is None
                                                else scale)
    groups = getattr(router, "num_group", None) or 1
    grouped = groups > 1 and (cls != "DeepseekV2TopkRouter"
                              or router.topk_method == "group_limited_greedy")
    if grouped:
        values.update(num_groups=int(groups), topk_groups=int(router.topk_group),
                      group_score=rule.groups)
    sel_key = None
    if rule.selection_bias is not None and _module(block, rule.selection_bias) is not None:
        if cls != "Lfm2MoeTopKRouter" or block.use_expert_bias:
            sel_key = rule.selection_bias
            values["selection_bias"] = True
    expert_values, expert_slots = _experts(block, rule)
    values.update(expert_values)
    shared_values, shared_slots = _shared(block, values["activation"])
    values.update(shared_values)
    return values, {**slots, **expert_slots, **shared_slots}, sel_key


def _numpy(t) -> np.ndarray:
    """A torch tensor as NumPy: float64 kept, the other floats as float32 (exact for
    bfloat16 and float16, which NumPy has no torch conversion for)."""
    import torch

    t = t.detach().to("cpu")
    return (t if t.dtype == torch.float64 else t.float()).numpy()


def _host(a) -> np.ndarray:
    """An array of ours as NumPy for torch: float64 kept, else float32."""
    a = np.asarray(a)
    return a if a.dtype == np.float64 else a.astype(np.float32)


def _unused(block, keys) -> None:
    """NotImplementedError naming a tensor of the block that has no place in aristax."""
    import torch

    state = {k: v for k, v in block.state_dict().items() if isinstance(v, torch.Tensor)}
    extra = sorted(set(state) - set(keys))
    if extra:
        raise NotImplementedError(f"{type(block).__name__}: tensor {extra[0]} has no place "
                                  f"in aristax ({len(extra)} such)")


def from_hf(block) -> tuple[MoEConfig, MoEParams]:
    """(``MoEConfig``, ``MoEParams``) computing the Hugging Face MoE block ``block``
    (a torch module): ``aristax.moe(x.reshape(-1, D), params, config)[0]`` equals
    ``block(x)`` (for blocks with a selection bias, pass ``bias=selection_bias(block)``;
    ``MoE.from_hf`` holds it). Parameters keep the block's dtype.

    Raises:
      NotImplementedError: naming the block's routing rule, layer or tensor that
        aristax does not compute.
    """
    values, slots, sel_key = _plan(block)
    state = block.state_dict()
    _unused(block, list(slots) + ([sel_key] if sel_key else []))
    jitter = max(float(getattr(m, name, 0.0) or 0.0) for m in (block, _router(block)[0])
                 for name in TRAINING_JITTER)
    if jitter > 0:
        warnings.warn(f"{type(block).__name__}: from_hf converts the block's eval-mode "
                      f"computation; its training jitter ({jitter}) is not carried "
                      "(MoEConfig.router_jitter jitters the router's input only)",
                      UserWarning, stacklevel=2)
    capacity = getattr(getattr(block, "router", None), "expert_capacity", None)
    if capacity is not None:  # Switch Transformers
        warnings.warn(f"{type(block).__name__}: the block drops tokens past "
                      f"expert_capacity={capacity} per sequence; the aristax layer is "
                      "dropless, equal to the block while no expert overflows (a sequence "
                      "of S tokens at a time with capacity_factor = expert_capacity * E / S "
                      "drops as the block does)", UserWarning, stacklevel=2)
    router_key = next(k for k, (names, _, _) in slots.items() if names == ("router_de",))
    dtype = jnp.dtype(str(state[router_key].dtype).removeprefix("torch."))
    fields = {}
    for key, (names, to_ours, _) in slots.items():
        if to_ours is None:  # Switch: one expert's Linear per key, stacked below
            continue
        for name, value in zip(names, to_ours(_numpy(state[key]))):
            fields[name] = jnp.asarray(value, dtype)
    if values["activation"] == "relu" and "up_edf" not in fields:  # Switch's experts
        E = values["num_experts"]
        fields["up_edf"] = jnp.asarray(np.stack([
            _numpy(state[f"experts.expert_{e}.wi.weight"]).T for e in range(E)]), dtype)
        fields["down_efd"] = jnp.asarray(np.stack([
            _numpy(state[f"experts.expert_{e}.wo.weight"]).T for e in range(E)]), dtype)
    return _config(block, values, str(dtype)), MoEParams(**fields)


def _config(block, values: dict, param_dtype: str) -> MoEConfig:
    """The ``MoEConfig`` of ``values``; a block setting with no aristax equivalent (a
    zero-width shared expert, more picks than the allowed groups hold, ...) raises
    ``NotImplementedError`` naming the block and the field."""
    try:
        return MoEConfig(**values, param_dtype=param_dtype)
    except ValueError as err:
        raise NotImplementedError(f"{type(block).__name__}: a setting aristax does not "
                                  f"compute: {err}") from None


def selection_bias(block) -> jnp.ndarray | None:
    """The block's selection-only bias float32[E] (DeepSeek-V3's
    ``e_score_correction_bias``, LFM2's ``expert_bias``), or None."""
    _, _, key = _plan(block)
    return None if key is None else jnp.asarray(
        _numpy(block.state_dict()[key]).reshape(-1), jnp.float32)


def to_hf(config: MoEConfig, params: MoEParams, like, *,
          selection_bias: Any = None) -> dict:
    """The state dict of a block of ``like``'s type holding ``params`` (as ``from_hf``
    reads it; ``like``'s own values are not used): ``like.load_state_dict(to_hf(...))``.
    ``selection_bias`` [E] fills the block's selection bias (else it keeps ``like``'s).

    Raises:
      ValueError: a field of ``config`` that the block's structure fixes differs from
        what ``from_hf(like)`` gives (another routing, size or activation).
    """
    import torch

    values, slots, sel_key = _plan(like)
    expected = _config(like, values, config.param_dtype)
    for field in dataclasses.fields(MoEConfig):
        if field.name in NOT_STRUCTURAL:
            continue
        ours, theirs = getattr(config, field.name), getattr(expected, field.name)
        if ours != theirs:
            raise ValueError(f"to_hf: MoEConfig.{field.name}={ours!r}, but a "
                             f"{type(like).__name__} like the one given computes "
                             f"{field.name}={theirs!r}")
    for name, shape in param_shapes(config).items():
        value = getattr(params, name)
        found = None if value is None else tuple(np.shape(value))
        if found != shape:
            raise ValueError(f"to_hf: params.{name} has shape {found}; this config's "
                             f"{type(like).__name__} needs {shape}")
    if selection_bias is not None and sel_key is None:
        raise ValueError(f"to_hf: selection_bias given, but a {type(like).__name__} like "
                         "the one given has no selection bias")
    state = like.state_dict()
    out = {}
    for key, (names, _, to_hf_fn) in slots.items():
        arrays = [_host(getattr(params, n)) for n in names]
        if to_hf_fn is None:  # Switch's per-expert Linear
            e = int(key.split(".")[1].removeprefix("expert_"))
            value = arrays[0][e].T
        else:
            value = to_hf_fn(*arrays)
        out[key] = torch.from_numpy(np.array(value)).to(state[key].dtype)
    if sel_key is not None:
        bias = state[sel_key] if selection_bias is None else torch.from_numpy(
            np.array(_host(selection_bias))).reshape(state[sel_key].shape)
        out[sel_key] = bias.to(state[sel_key].dtype)
    return out
