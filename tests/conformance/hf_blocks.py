"""Registry of Hugging Face ``transformers`` MoE blocks for conformance tests.

Every entry of :data:`BLOCKS` builds ONE MoE block (the MLP module a decoder layer calls) of an
installed ``transformers`` model from a tiny, locally built config, fills every parameter/buffer
with seeded random values, and knows how to call it exactly like its decoder layer does.

Conventions used in the ``notes`` strings (all read from the installed transformers source):

* ``x``: one token, shape [D]; ``T`` = B*S tokens; ``E`` routed experts; ``k`` = top-k.
* ``W_r``: router weight as stored, [E, D]; ``l = x @ W_r.T`` are the router logits.
* "F.linear layout" means a stored matrix ``W[out, in]`` used as ``x @ W.T``.
* The target layout for a converter is ``gate[E, D, F]``, ``up[E, D, F]``, ``down[E, F, D]`` with
  ``o_e(x) = (act(x @ gate[e]) * (x @ up[e])) @ down[e]``.
* Unless stated otherwise the routed combine is ``y = sum_j w_j * o_{e_j}(x)`` (weight applied to the
  expert OUTPUT) accumulated with ``index_add_`` in the dtype of ``x``; every block is run in float32.
* "topk" is ``torch.topk`` (``sorted`` does not matter: results are summed).

All blocks use the HF "eager" experts path (``config._experts_implementation = "eager"``), i.e. the
per-expert python loop that is the reference implementation.
"""

from __future__ import annotations

import importlib
from collections.abc import Callable
from dataclasses import dataclass

import torch
from torch import nn

__all__ = ["BLOCKS", "LEFT_OUT", "BlockSpec"]

D = 32  # hidden size of every tiny block
F_E = 24  # routed-expert hidden size
F_S = 40  # shared-expert hidden size (kept different from F_E so layouts cannot be confused)


@dataclass(frozen=True)
class BlockSpec:
    build: Callable[[int], nn.Module]
    run: Callable[[nn.Module, torch.Tensor], tuple[torch.Tensor, torch.Tensor | None]]
    notes: str
    model_type: str
    router_param: str  # dotted name (in the built block) of the router weight, rows = experts
    num_experts: int
    top_k: int
    hidden_size: int = D
    num_logits: int | None = None  # width of the captured router logits when it differs from num_experts
    dense: bool = False  # True if every expert contributes to every token (not the case for any entry)


BLOCKS: dict[str, BlockSpec] = {}

# ----------------------------------------------------------------------------------------------
# helpers
# ----------------------------------------------------------------------------------------------


def _config(model_type: str, **kwargs):
    from transformers import CONFIG_MAPPING

    cfg = CONFIG_MAPPING[model_type](**kwargs)
    cfg._experts_implementation = "eager"
    return cfg


def _cls(module: str, name: str):
    mod = importlib.import_module(f"transformers.models.{module}.modeling_{module}")
    return getattr(mod, name)


def _fill(block: nn.Module, seed: int, overrides: dict[str, Callable[[torch.Tensor], torch.Tensor]] | None = None):
    """Fill every floating parameter and buffer with seeded random values.

    weights: 0.2 * N(0,1); biases: 0.5 * N(0,1); router correction biases: 0.2 * N(0,1);
    norm weights: 1 + 0.1 * N(0,1) (or 0.1 * N(0,1) when the norm stores ``1 + w`` and inits w = 0).
    """
    g = torch.Generator().manual_seed(seed)
    tensors: dict[str, torch.Tensor] = dict(block.named_parameters())
    for name, buf in block.named_buffers():
        tensors.setdefault(name, buf)
    for name in sorted(tensors):
        t = tensors[name]
        if not t.is_floating_point():
            continue
        parent = block.get_submodule(name.rsplit(".", 1)[0]) if "." in name else block
        leaf = name.rsplit(".", 1)[-1]
        r = torch.randn(t.shape, generator=g, dtype=torch.float32)
        if overrides and name in overrides:
            val = overrides[name](r)
        elif "correction_bias" in name or leaf in ("expert_bias",):
            val = 0.2 * r
        elif "norm" in type(parent).__name__.lower() and leaf == "weight":
            val = 0.1 * r if bool((t == 0).all()) else 1.0 + 0.1 * r
        elif leaf.endswith("bias"):
            val = 0.5 * r
        else:
            val = 0.2 * r
        with torch.no_grad():
            t.copy_(val.to(t.dtype))
    return block


def _capture_run(logits_at: str | None, logits_index: int | None = 0, call=None):
    """Run ``block`` (or ``call(block, x)``), return (y reshaped to x.shape, router logits [T, E] or None).

    The router logits are captured with a forward hook on ``logits_at`` (output, or output[logits_index]).
    """

    def run(block: nn.Module, x: torch.Tensor):
        captured: dict[str, torch.Tensor] = {}
        handle = None
        if logits_at is not None:

            def hook(_m, _inp, out):
                t = out[logits_index] if (logits_index is not None and isinstance(out, tuple)) else out
                captured["logits"] = t.detach()

            handle = block.get_submodule(logits_at).register_forward_hook(hook)
        try:
            with torch.set_grad_enabled(x.requires_grad):  # graph only for gradient tests
                out = call(block, x.clone()) if call is not None else block(x.clone())
        finally:
            if handle is not None:
                handle.remove()
        if isinstance(out, tuple):
            out = out[0]
        y = out.reshape(x.shape)
        logits = captured.get("logits")
        if logits is not None:
            logits = logits.reshape(-1, logits.shape[-1])
        return y, logits

    return run


def _add(
    name: str,
    *,
    module: str,
    cls_name: str,
    config_type: str,
    cfg: dict,
    notes: str,
    router_param: str,
    num_experts: int,
    top_k: int,
    logits_at: str | None = "gate",
    logits_index: int | None = 0,
    ctor: Callable | None = None,
    overrides: dict | None = None,
    call=None,
    num_logits: int | None = None,
):
    def build(seed: int) -> nn.Module:
        config = _config(config_type, hidden_size=D, **cfg)
        cls = _cls(module, cls_name)
        block = ctor(cls, config) if ctor is not None else cls(config)
        block = block.float().eval()
        return _fill(block, seed, overrides)

    BLOCKS[name] = BlockSpec(
        build=build,
        run=_capture_run(logits_at, logits_index, call),
        notes=notes.strip(),
        model_type=config_type,
        router_param=router_param,
        num_experts=num_experts,
        top_k=top_k,
        num_logits=num_logits,
    )


class _MoEPlusShared(nn.Module):
    """Granite-style decoder-layer combination: ``block_sparse_moe(h) + shared_mlp(h)``."""

    def __init__(self, moe: nn.Module, shared: nn.Module):
        super().__init__()
        self.block_sparse_moe = moe
        self.shared_mlp = shared

    def forward(self, h):
        return self.block_sparse_moe(h) + self.shared_mlp(h)


class _GemmaMoEBranch(nn.Module):
    """The MoE branch of Gemma4TextDecoderLayer (router on the raw residual, experts on a pre-norm)."""

    def __init__(self, module: str, prefix: str, config):
        super().__init__()
        norm = _cls(module, f"{prefix}RMSNorm")
        self.router = _cls(module, f"{prefix}TextRouter")(config)
        self.experts = _cls(module, f"{prefix}TextExperts")(config)
        self.pre_feedforward_layernorm_2 = norm(config.hidden_size, eps=config.rms_norm_eps)
        self.post_feedforward_layernorm_2 = norm(config.hidden_size, eps=config.rms_norm_eps)

    def forward(self, residual):
        flat = residual.reshape(-1, residual.shape[-1])
        _, top_k_weights, top_k_index = self.router(flat)
        h = self.pre_feedforward_layernorm_2(flat)
        h = self.experts(h, top_k_index, top_k_weights)
        return self.post_feedforward_layernorm_2(h.reshape(residual.shape))


# ----------------------------------------------------------------------------------------------
# shared note fragments
# ----------------------------------------------------------------------------------------------

EXPERTS_STD = (
    "experts: gate_up_proj [E, 2F, D], down_proj [E, D, F], F.linear layout, no biases: "
    "h = x @ gate_up_proj[e].T; gate = h[:F], up = h[F:] (CONCATENATED [gate|up]); "
    "o_e = ({act}(gate) * up) @ down_proj[e].T. "
    "map: gate[e] = gate_up_proj[e, :F, :].T, up[e] = gate_up_proj[e, F:, :].T, down[e] = down_proj[e].T."
)


def _experts(act: str = "silu") -> str:
    return EXPERTS_STD.format(act=act)


def _shared(width: str, act: str = "silu", extra: str = "") -> str:
    return (
        f"shared expert (always on, weight 1{extra}): SwiGLU nn.Linear gate_proj/up_proj [Fs, D], down_proj [D, Fs], no bias, "
        f"Fs = {width}; s(x) = down_proj({act}(gate_proj(x)) * up_proj(x)); "
        "map: gate = gate_proj.weight.T, up = up_proj.weight.T, down = down_proj.weight.T."
    )


V3_ROUTER = (
    "router: l = x.float() @ W_r.float().T (fp32, no bias; logits returned fp32); s = sigmoid(l); "
    "c = s + e_score_correction_bias[E] (bias used for SELECTION ONLY); "
    "group-limited selection: c viewed [n_group, E/n_group], group score = SUM OF TOP-2 c in the group, "
    "keep topk_group groups (topk), other experts' c := -inf, then idx = topk(c, k); "
    "weights w = s[idx] (NO bias); if norm_topk_prob: w = w / (sum(w) + 1e-20); w = w * routed_scaling_factor."
)


# ----------------------------------------------------------------------------------------------
# priority entries
# ----------------------------------------------------------------------------------------------

_add(
    "mixtral",
    module="mixtral",
    cls_name="MixtralSparseMoeBlock",
    config_type="mixtral",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, router_jitter_noise=0.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
MixtralSparseMoeBlock. router (MixtralTopKRouter): l = x @ W_r.T (x dtype, no bias); p = softmax(l.float()) over E;
(w, idx) = topk(p, k); w = w / sum(w) (always renormalised, no eps). {_experts()} F = intermediate_size.
No shared expert. router_jitter_noise only in training.
""",
)

_QWEN_ROUTER = (
    "router (TopKRouter): l = x @ W_r.T (x dtype, no bias); p = softmax(l, dtype=float32) over E; (w, idx) = topk(p, k); "
    "{norm}; w cast to l.dtype."
)

_add(
    "qwen2_moe",
    module="qwen2_moe",
    cls_name="Qwen2MoeSparseMoeBlock",
    config_type="qwen2_moe",
    cfg=dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=F_E,
        shared_expert_intermediate_size=F_S,
        norm_topk_prob=False,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Qwen2MoeSparseMoeBlock. {_QWEN_ROUTER.format(norm="norm_topk_prob=False here: w NOT renormalised (if True: w /= sum(w), no eps)")}
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size", extra=" times a learned sigmoid gate")}
SHARED-EXPERT GATE: y = routed + sigmoid(x @ shared_expert_gate.weight.T) * s(x), shared_expert_gate = nn.Linear(D, 1, bias=False) (weight [1, D]).
""",
)

for _name, _norm in (("qwen3_moe", True), ("qwen3_moe_nonorm", False)):
    _add(
        _name,
        module="qwen3_moe",
        cls_name="Qwen3MoeSparseMoeBlock",
        config_type="qwen3_moe",
        cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, norm_topk_prob=_norm),
        router_param="gate.weight",
        num_experts=8,
        top_k=2,
        notes=f"""
Qwen3MoeSparseMoeBlock, norm_topk_prob={_norm}. {_QWEN_ROUTER.format(norm="if norm_topk_prob: w = w / sum(w) (no eps)" + ("  [ON here]" if _norm else "  [OFF here]"))}
{_experts()} F = moe_intermediate_size. No shared expert.
""",
    )

_add(
    "qwen3_next",
    module="qwen3_next",
    cls_name="Qwen3NextSparseMoeBlock",
    config_type="qwen3_next",
    cfg=dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=F_E,
        shared_expert_intermediate_size=F_S,
        norm_topk_prob=True,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Qwen3NextSparseMoeBlock: identical math to qwen2_moe but with norm_topk_prob=True.
{_QWEN_ROUTER.format(norm="w = w / sum(w) (norm_topk_prob=True, no eps)")}
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size", extra=" times a learned sigmoid gate")}
y = routed + sigmoid(x @ shared_expert_gate.weight.T) * s(x), shared_expert_gate weight [1, D], no bias.
""",
)

for _name, _method in (("deepseek_v2_greedy", "greedy"), ("deepseek_v2_group_limited", "group_limited_greedy")):
    _add(
        _name,
        module="deepseek_v2",
        cls_name="DeepseekV2Moe",
        config_type="deepseek_v2",
        cfg=dict(
            n_routed_experts=16,
            num_experts_per_tok=4,
            n_group=4,
            topk_group=2,
            topk_method=_method,
            moe_intermediate_size=F_E,
            n_shared_experts=2,
            routed_scaling_factor=2.0,
            norm_topk_prob=True,  # ignored by the V2 router (documented below)
            mlp_bias=False,
        ),
        router_param="gate.weight",
        num_experts=16,
        top_k=4,
        notes=f"""
DeepseekV2Moe, topk_method="{_method}" (E=16, k=4, n_group=4, topk_group=2, routed_scaling_factor=2.0).
router: l = x.float() @ W_r.float().T (fp32, no bias); s = softmax(l, fp32) over E.
  greedy: (w, idx) = topk(s, k).
  group_limited_greedy: s viewed [n_group, E/n_group]; group score = MAX of s within the group; keep topk_group groups
  (topk); s of experts in other groups := 0.0; (w, idx) = topk(masked s, k).
  [this entry uses: {_method}]
NO renormalisation (config.norm_topk_prob is IGNORED by the V2 router, it is True in this config); w = w * routed_scaling_factor (fp32).
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 48 here)", extra="")} (bias = config.mlp_bias = False)
y = routed + shared(x).
""",
    )

_add(
    "deepseek_v3",
    module="deepseek_v3",
    cls_name="DeepseekV3MoE",
    config_type="deepseek_v3",
    cfg=dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=F_E,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
DeepseekV3MoE (E=16, k=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5).
{V3_ROUTER}
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).
""",
)

_add(
    "glm4_moe",
    module="glm4_moe",
    cls_name="Glm4MoeMoE",
    config_type="glm4_moe",
    cfg=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        n_group=1,
        topk_group=1,
        moe_intermediate_size=F_E,
        n_shared_experts=1,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Glm4MoeMoE: code identical to DeepseekV3MoE. Uses the config defaults n_group=1, topk_group=1 (group step is a
no-op), norm_topk_prob=True, routed_scaling_factor=2.5, E=8, k=2.
{V3_ROUTER}
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).
""",
)

_add(
    "olmoe",
    module="olmoe",
    cls_name="OlmoeSparseMoeBlock",
    config_type="olmoe",
    cfg=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=F_E, norm_topk_prob=False),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
OlmoeSparseMoeBlock (norm_topk_prob=False, the config default).
{_QWEN_ROUTER.format(norm="norm_topk_prob=False: w NOT renormalised (if True: w /= sum(w), no eps)")}
{_experts()} F = intermediate_size. No shared expert.
""",
)

_add(
    "gpt_oss",
    module="gpt_oss",
    cls_name="GptOssMLP",
    config_type="gpt_oss",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, swiglu_limit=1.5, swiglu_alpha=1.702),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes="""
GptOssMLP (returns (y, router_scores[T, k]); the decoder keeps y).
router: l = x @ W_r.T + b_r (router.bias [E], nonzero here; x dtype); (v, idx) = topk(l, k) on LOGITS;
w = softmax(v) over the k selected (dtype of l).
experts (GptOssExperts; TRANSPOSED + INTERLEAVED + BIASES): gate_up_proj [E, D, 2F] used as x @ W (no transpose),
gate_up_proj_bias [E, 2F]; h = x @ gate_up_proj[e] + gate_up_proj_bias[e]; gate = h[..., 0::2], up = h[..., 1::2] (INTERLEAVED);
gate = clamp(gate, max=limit) (no lower clamp); up = clamp(up, -limit, +limit); glu = gate * sigmoid(alpha * gate);
a = (up + 1) * glu; o_e = a @ down_proj[e] + down_proj_bias[e] (down_proj [E, F, D], bias [E, D]).
alpha = swiglu_alpha = 1.702, limit = swiglu_limit = 1.5 HERE (config default 7.0; 1.5 keeps the clamps active).
y = sum_j w_j * o_{e_j}(x) (the down bias is scaled by w_j too).
map: gate[e] = gate_up_proj[e][:, 0::2], up[e] = gate_up_proj[e][:, 1::2], down[e] = down_proj[e];
     b_gate[e] = gate_up_proj_bias[e, 0::2], b_up[e] = gate_up_proj_bias[e, 1::2], b_down[e] = down_proj_bias[e].
No shared expert.
""",
)

_LLAMA4_NOTES = """
Llama4TextMoe (E=8, k={k}). Block is called on [B, S, D], flattens to [T, D], returns (out [T, D], router_logits [T, E]);
the decoder reshapes out to [B, S, D].
router (Llama4Router = nn.Linear(D, E, bias=False)): l = x @ W_r.T (x dtype); (v, idx) = topk(l, k);
scores[T, E] = sigmoid(l) at idx, 0 elsewhere (sigmoid(-inf)); sigmoid in float32 then cast to x dtype. NO normalisation.
ROUTING WEIGHT APPLIED TO THE EXPERT *INPUT*: all E experts run densely on in_e = x * scores[:, e]:
o_e = (silu(in_e @ G_e) * (in_e @ U_e)) @ Dn_e, out = shared(x) + sum_e o_e. Experts have no bias, so experts with score 0
contribute exactly 0 (equivalent to a sparse top-k with input scaling). NB o_e(w*x) != w*o_e(x).
experts (Llama4TextExperts, TRANSPOSED layout, bmm): gate_up_proj [E, D, 2F] used as x @ W, CONCATENATED [gate|up] on the last dim;
down_proj [E, F, D] used as h @ W. map: gate[e] = gate_up_proj[e][:, :F], up[e] = gate_up_proj[e][:, F:], down[e] = down_proj[e].
shared expert: Llama4TextMLP(config) with width = config.intermediate_size (SAME F as the routed experts), silu, no bias,
gate_proj/up_proj [F, D], down_proj [D, F] (F.linear layout), added unweighted.
"""

for _name, _k in (("llama4_text", 1), ("llama4_text_top2", 2)):
    _add(
        _name,
        module="llama4",
        cls_name="Llama4TextMoe",
        config_type="llama4_text",
        cfg=dict(num_local_experts=8, num_experts_per_tok=_k, intermediate_size=F_E, intermediate_size_mlp=F_S),
        router_param="router.weight",
        num_experts=8,
        top_k=_k,
        logits_at="router",
        logits_index=1,
        notes=_LLAMA4_NOTES.format(k=_k)
        + ("(config default k=1; this entry uses k=2 to check that the k scores are NOT normalised.)" if _k == 2 else ""),
    )

_add(
    "ernie4_5_moe",
    module="ernie4_5_moe",
    cls_name="Ernie4_5_MoeSparseMoeBlock",
    config_type="ernie4_5_moe",
    cfg=dict(
        moe_num_experts=8,
        moe_k=2,
        moe_intermediate_size=F_E,
        moe_num_shared_experts=2,
        use_bias=False,
        moe_norm_min=1e-12,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Ernie4_5_MoeSparseMoeBlock (E=8, k=2, 2 shared experts).
router (fp32, autocast disabled): l = x.float() @ W_r.float().T (no bias); p = softmax(l, dim=-1) fp32 over E;
idx = topk(p + e_score_correction_bias, k) with the bias stored as PARAMETER gate.moe_statics.e_score_correction_bias [1, E]
(squeezed; SELECTION ONLY); w = p[idx] / clamp(sum(p[idx]), min=moe_norm_min=1e-12) (always normalised); w cast to x dtype.
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * moe_num_shared_experts (= 48 here)")} (bias = config.use_bias = False)
y = routed + shared(x).
""",
)

_add(
    "lfm2_moe",
    module="lfm2_moe",
    cls_name="Lfm2MoeSparseMoeBlock",
    config_type="lfm2_moe",
    cfg=dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=F_E,
        use_expert_bias=True,
        norm_topk_prob=True,
        routed_scaling_factor=1.5,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Lfm2MoeSparseMoeBlock (use_expert_bias=True, norm_topk_prob=True, routed_scaling_factor=1.5 here; config default 1.0).
router: l = x @ W_r.T (x dtype, no bias); s = sigmoid(l);
if use_expert_bias: idx = topk(s + expert_bias, k) with expert_bias = BLOCK buffer `expert_bias` [E] (SELECTION ONLY), w = s[idx];
else (w, idx) = topk(s, k).
if norm_topk_prob: w = w / (sum(w) + 1e-6)   <-- EPSILON 1e-6 (not 1e-20);  then w = w * routed_scaling_factor.
{_experts("F.silu (hard-coded)")} F = moe_intermediate_size. No shared expert.
""",
)

for _name, _p in (("dbrx", 2.0), ("dbrx_p1", 1.0)):
    _add(
        _name,
        module="dbrx",
        cls_name="DbrxFFN",
        config_type="dbrx",
        cfg=dict(
            d_model=D,
            ffn_config=dict(
                ffn_hidden_size=F_E,
                moe_num_experts=8,
                moe_top_k=2,
                moe_normalize_expert_weights=_p,
                moe_jitter_eps=None,
                ffn_act_fn={"name": "silu"},
            ),
        ),
        router_param="router.layer.weight",
        num_experts=8,
        top_k=2,
        logits_at="router",
        logits_index=None,
        notes=f"""
DbrxFFN (built from the full DbrxConfig; E=8, k=2, moe_normalize_expert_weights p={_p}).
router (DbrxRouter.layer = nn.Linear(D, E, bias=False)): l = x @ W_r.T; p = softmax(l) over E (x dtype);
(w, idx) = topk(p, k); if moe_normalize_expert_weights is not None: w = w / torch.norm(w, p=P, dim=-1) (P-NORM over the k
weights, no eps; P = {_p} here; P=1 is L1 = sum renorm since w > 0). moe_jitter_eps only in training.
experts (DbrxExperts/DbrxExpertGLU): w1, v1, w2 each stored FLAT [E*F, D]; per expert W1 = w1.view(E, F, D)[e],
V1 = v1.view(E, F, D)[e], W2 = w2.view(E, F, D)[e]; o_e = (silu(x @ W1.T) * (x @ V1.T)) @ W2   (W2 is NOT transposed).
map: gate[e] = w1.view(E,F,D)[e].T, up[e] = v1.view(E,F,D)[e].T, down[e] = w2.view(E,F,D)[e]. act = ffn_act_fn["name"] = silu.
No shared expert. Called on [B, S, D], returns [B, S, D].
""",
    )

for _name, _cap, _rb in (("switch_transformers", 64, False), ("switch_transformers_capacity2", 2, True)):
    _add(
        _name,
        module="switch_transformers",
        cls_name="SwitchTransformersSparseMLP",
        config_type="switch_transformers",
        cfg=dict(d_model=D, d_ff=F_E, num_experts=8, expert_capacity=_cap, router_bias=_rb, router_jitter_noise=0.0,
                 dense_act_fn="relu", dropout_rate=0.0),
        router_param="router.classifier.weight",
        num_experts=8,
        top_k=1,
        logits_at="router",
        logits_index=2,
        notes=f"""
SwitchTransformersSparseMLP (top-1; expert_capacity={_cap}, router_bias={_rb} here).
router (SwitchTransformersTop1Router, router_dtype float32): l = x.float() @ W_r.T (+ classifier.bias if router_bias);
p = softmax(l) over E; e* = argmax(p); w = max(p) (the top-1 probability, NOT renormalised).
CAPACITY: routing is done on [B, S, D]; per batch row b, position t keeps its expert only if
cumsum_{{t' <= t}} onehot(e*_{{b,t'}})[e*] <= expert_capacity (first come first served in sequence order, not by probability);
a dropped token gets block output 0 (the residual is added outside, in SwitchTransformersLayerFF).
{"(capacity 64 >= S here, so nothing is dropped.)" if _cap >= 64 else "(capacity 2 with S=5 here, so tokens ARE dropped.)"}
experts (SwitchTransformersDenseActDense, one nn.Module per expert): o_e = wo(relu(wi(x))), wi.weight [F, D], wo.weight [D, F],
no biases, NO gate matrix, dropout off in eval. map: up[e] = experts.expert_e.wi.weight.T, down[e] = experts.expert_e.wo.weight.T
(non-gated: o = relu(x @ up) @ down). y = w * o_{{e*}}(x) (0 if dropped). jitter only in training.
""",
    )

_GRANITE_ROUTER = (
    "router (TopKRouter): l = (x @ W_r.T).float() (no bias); (v, idx) = topk(l, k) on LOGITS; w = softmax(v) over the k, "
    "cast to x dtype."
)
_GRANITE_SHARED = (
    "shared_mlp (lives in the DECODER LAYER: out = block_sparse_moe(h) + shared_mlp(h); built here as a wrapper with "
    "attributes block_sparse_moe / shared_mlp): input_linear.weight [2Fs, D] (F.linear), chunk(2) -> gate = first Fs rows, "
    "up = last Fs rows (CONCATENATED); s = output_linear(silu(gate) * up), output_linear.weight [D, Fs]; no biases; Fs = "
    "shared_intermediate_size. map: gate = input_linear.weight[:Fs].T, up = input_linear.weight[Fs:].T, down = output_linear.weight.T. "
    "(The decoder then scales the sum by residual_multiplier, outside this block.)"
)

_add(
    "granitemoe",
    module="granitemoe",
    cls_name="GraniteMoeMoE",
    config_type="granitemoe",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes=f"""
GraniteMoeMoE. {_GRANITE_ROUTER}
{_experts()} F = intermediate_size. No shared expert (decoder multiplies the output by residual_multiplier outside the block).
""",
)

for _name, _module, _moe, _mlp in (
    ("granitemoeshared", "granitemoeshared", "GraniteMoeSharedMoE", "GraniteMoeSharedMLP"),
    ("granitemoehybrid", "granitemoehybrid", "GraniteMoeHybridMoE", "GraniteMoeHybridMLP"),
    ("granitemoe_swa", "granitemoe_swa", "GraniteMoeSWAMoE", "GraniteMoeSWAMLP"),
):
    _add(
        _name,
        module=_module,
        cls_name=_moe,
        config_type=_module,
        cfg=dict(
            num_local_experts=8,
            num_experts_per_tok=2,
            intermediate_size=F_E,
            shared_intermediate_size=F_S,
            **(dict(mamba_n_heads=8, mamba_d_head=8) if _module == "granitemoehybrid" else {}),
        ),
        router_param="block_sparse_moe.router.weight",
        num_experts=8,
        top_k=2,
        logits_at="block_sparse_moe.router",
        ctor=(lambda m, mlp: (lambda cls, cfg: _MoEPlusShared(cls(cfg), _cls(m, mlp)(cfg))))(_module, _mlp),
        notes=f"""
{_moe} + {_mlp} (code identical to granitemoe + shared MLP). {_GRANITE_ROUTER}
{_experts()} F = intermediate_size.
{_GRANITE_SHARED}
""",
    )


# ----------------------------------------------------------------------------------------------
# DeepSeek-V3-style blocks (sigmoid + e_score_correction_bias + group-limited top-k + shared experts)
# ----------------------------------------------------------------------------------------------

_V3_CFG = dict(
    n_routed_experts=16,
    num_experts_per_tok=4,
    n_group=4,
    topk_group=2,
    moe_intermediate_size=F_E,
    n_shared_experts=1,
    routed_scaling_factor=2.5,
    norm_topk_prob=True,
)


def _v3_clone(name, module, cls_name, config_type, what, cfg=None, extra="", experts=None, shared=None):
    c = dict(_V3_CFG)
    c.update(cfg or {})
    _add(
        name,
        module=module,
        cls_name=cls_name,
        config_type=config_type,
        cfg=c,
        router_param="gate.weight",
        num_experts=16,
        top_k=4,
        notes=f"""
{cls_name}: {what} (E=16, k=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5 here).
{V3_ROUTER}
{experts or _experts()} F = moe_intermediate_size.
{shared or _shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).{extra}
""",
    )


_v3_clone("deepseek_v32", "deepseek_v32", "DeepseekV32MoE", "deepseek_v32", "code identical to DeepseekV3MoE")
_v3_clone("dots1", "dots1", "Dots1MoE", "dots1", "code identical to DeepseekV3MoE")
_v3_clone("glm4_moe_lite", "glm4_moe_lite", "Glm4MoeLiteMoE", "glm4_moe_lite", "code identical to DeepseekV3MoE")
_v3_clone("glm_moe_dsa", "glm_moe_dsa", "GlmMoeDsaMoE", "glm_moe_dsa", "code identical to DeepseekV3MoE (GLM-5 / GlmMoeDsa)")
_v3_clone("solar_open", "solar_open", "SolarOpenMoE", "solar_open", "code identical to DeepseekV3MoE")
_v3_clone(
    "bailing_hybrid",
    "bailing_hybrid",
    "BailingHybridMoE",
    "bailing_hybrid",
    "code identical to DeepseekV3MoE (config names: num_experts, num_experts_per_token, num_expert_group, moe_renormalize, "
    "num_shared_experts are attribute_map aliases of the V3 names)",
    cfg=dict(n_routed_experts=None, num_experts=16),
)
_v3_clone(
    "kimi_linear",
    "kimi_linear",
    "KimiLinearMoE",
    "kimi_linear",
    "code identical to DeepseekV3MoE (config aliases as bailing: num_experts, num_experts_per_token, num_expert_group, "
    "moe_renormalize, num_shared_experts)",
    cfg=dict(n_routed_experts=None, num_experts=16),
)
_v3_clone(
    "exaone_moe",
    "exaone_moe",
    "ExaoneMoeSparseMoEBlock",
    "exaone_moe",
    "code identical to DeepseekV3MoE except the shared width uses config.num_shared_experts",
    cfg=dict(n_routed_experts=None, n_shared_experts=None, num_experts=16, num_shared_experts=1),
    shared=_shared("moe_intermediate_size * num_shared_experts (= 24 here)"),
)
_v3_clone(
    "dots3_note_text",
    "dots3_note",
    "Dots3NoteTextMoE",
    "dots3_note_text",
    "DeepseekV3MoE math; shared width from shared_experts_intermediate_size",
    cfg=dict(shared_experts_intermediate_size=F_S),
    shared=_shared("shared_experts_intermediate_size * n_shared_experts (= 40 here)"),
)
_v3_clone(
    "axk1",
    "axk1",
    "AXK1MoE",
    "axk1",
    "DeepseekV3MoE math PLUS a post-MoE RMSNorm inside the block",
    extra="\nthen out = post_mlp_layernorm(y): RMSNorm, fp32: y * rsqrt(mean(y^2) + rms_norm_eps) * weight (weight [D], plain "
    "multiply, cast back to x dtype before * weight); rms_norm_eps = config.rms_norm_eps.",
)

_CLAMPED_SILU = (
    "experts: gate_up_proj [E, 2F, D], down_proj [E, D, F], F.linear layout, no biases: h = x @ gate_up_proj[e].T; "
    "gate = h[:F], up = h[F:] (CONCATENATED); gate = clamp(gate, max=L) (no lower clamp); up = clamp(up, -L, L); "
    "o_e = (silu(gate) * up) @ down_proj[e].T   (clamp BEFORE silu; L = swiglu_limit = 1.5 here, config default 10.0). "
    "map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T."
)

_v3_clone(
    "hy_v4",
    "hy_v4",
    "HYV4MoE",
    "hy_v4",
    "DeepseekV3MoE math with CLAMPED SwiGLU experts (shared expert NOT clamped)",
    cfg=dict(swiglu_limit=1.5),
    experts=_CLAMPED_SILU,
)
_v3_clone(
    "glm5_next_text",
    "glm5_next",
    "Glm5NextTextMoE",
    "glm5_next_text",
    "DeepseekV3MoE math with CLAMPED SwiGLU experts AND a clamped shared expert",
    cfg=dict(swiglu_limit=1.5),
    experts=_CLAMPED_SILU,
    shared=_shared("moe_intermediate_size * n_shared_experts (= 24 here)", act="silu")
    + " SHARED IS CLAMPED TOO (Glm5NextTextMLP): s = down_proj(silu(clamp(gate_proj(x), max=L)) * clamp(up_proj(x), -L, L)).",
)

_add(
    "axk2",
    module="axk2",
    cls_name="AXK2MoE",
    config_type="axk2",
    cfg=dict(_V3_CFG),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
AXK2MoE (DeepseekV3MoE block) with AXK2TopkRouter (E=16, k=4, n_group=4, topk_group=2 here; config default n_group=None = no grouping).
router: l = x.float() @ W_r.float().T; s = sigmoid(l); c = s + e_score_correction_bias (selection only);
if n_group is not None: group score = sum of top-2 c per group, keep topk_group groups, masked experts' c := 0.0
(ZERO, not -inf: since c can be negative with the bias, a masked expert can still win against an unmasked one with c < 0);
idx = topk(c, k); w = s[idx]; if norm_topk_prob: w = w / (sum(w) + 1e-20); w = w * routed_scaling_factor.
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).
""",
)

_add(
    "mimo_v2_flash",
    module="mimo_v2_flash",
    cls_name="MiMoV2FlashMoE",
    config_type="mimo_v2_flash",
    cfg=dict(_V3_CFG, n_shared_experts=None),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
MiMoV2FlashMoE: DeepseekV3 router, NO shared expert (E=16, k=4, n_group=4, topk_group=2, norm, scale 2.5 here).
{V3_ROUTER}
{_experts()} F = moe_intermediate_size. y = routed only.
""",
)

_add(
    "mistral4",
    module="mistral4",
    cls_name="Mistral4MoE",
    config_type="mistral4",
    cfg=dict(_V3_CFG, routed_scaling_factor=1.5),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
Mistral4MoE (DeepseekV3MoE block) with Mistral4TopkRouter (E=16, k=4, n_group=4, topk_group=2, norm_topk_prob=True, scale 1.5).
router: l = x @ W_r.T (x dtype, NOT forced to fp32; no bias); s = softmax(l) over E (SOFTMAX, no correction bias);
group score = SUM OF TOP-2 s in each of n_group groups; keep topk_group groups; masked s := 0.0; idx = topk(masked s, k);
w = s[idx]; if norm_topk_prob: w = w / (sum(w) + 1e-20); w = w * routed_scaling_factor.
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).
""",
)

_add(
    "mistral_large4_text",
    module="mistral_large4",
    cls_name="MistralLarge4TextMoE",
    config_type="mistral_large4_text",
    cfg=dict(_V3_CFG, routed_scaling_factor=1.5),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
MistralLarge4TextMoE (DeepseekV3MoE block) with MistralLarge4TextTopkRouter (E=16, k=4, n_group=4, topk_group=2, scale 1.5).
router: l = x.float() @ W_r.float().T (fp32, no bias); s = softmax(l) over E (no correction bias);
group score = SUM OF TOP-2 s per group; keep topk_group groups; masked s := 0.0; idx = topk(masked s, k);
w = s[idx] / (sum(s[idx]) + 1e-20) (ALWAYS normalised, no norm_topk_prob flag); w = w * routed_scaling_factor.
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * n_shared_experts (= 24 here)")}
y = routed + shared(x).
""",
)

_add(
    "beam",
    module="beam",
    cls_name="BeamMoE",
    config_type="beam",
    cfg=dict(
        num_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=F_E,
        norm_topk_prob=True,
        routed_scaling_factor=2.5,
    ),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes="""
BeamMoE (E=16, k=4, n_group=4, topk_group=2, norm_topk_prob=True, routed_scaling_factor=2.5; NO shared expert).
router (BeamTopKRouter): l = x.float() @ W_r.float().T; s = sigmoid(l); c = s + e_score_correction_bias (selection only);
group score = sum of top-2 c per group; keep topk_group groups; other c := -inf; idx = topk(c, k); w = s[idx];
if norm_topk_prob: w = w / (sum(w) + 1e-20). The ROUTER does NOT scale; the BLOCK multiplies the combined routed output:
y = routed_scaling_factor * sum_j w_j o_{e_j}(x)  (same result as scaling w).
experts: same layout as the standard experts (gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear),
but act computed in fp32: a = (silu(gate.float()) * up.float()).to(gate dtype).
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T.
""",
)

_add(
    "nemotron_h",
    module="nemotron_h",
    cls_name="NemotronHMoE",
    config_type="nemotron_h",
    cfg=dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=F_E,
        moe_shared_expert_intermediate_size=F_S,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        moe_latent_size=None,
    ),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
NemotronHMoE without latent projection (E=16, k=4, n_group=4, topk_group=2, norm, scale 2.5 here).
{V3_ROUTER}
experts (NemotronHExperts, NON-GATED): up_proj [E, F, D], down_proj [E, D, F] (F.linear layout), no biases:
o_e = relu2(x @ up_proj[e].T) @ down_proj[e].T with relu2(z) = relu(z)^2 (mlp_hidden_act). map: up[e] = up_proj[e].T,
down[e] = down_proj[e].T (NO gate matrix). The routed sum is accumulated in the dtype of the weights (fp32), then cast to x dtype.
shared expert (NemotronHMLP, NON-GATED): s = down_proj(relu2(up_proj(x))), up_proj [Fs, D], down_proj [D, Fs], bias=mlp_bias=False,
Fs = moe_shared_expert_intermediate_size (= 40 here). y = routed + s(x).
""",
)

_add(
    "nemotron_h_latent",
    module="nemotron_h",
    cls_name="NemotronHMoE",
    config_type="nemotron_h",
    cfg=dict(
        n_routed_experts=16,
        num_experts_per_tok=4,
        n_group=4,
        topk_group=2,
        moe_intermediate_size=F_E,
        moe_shared_expert_intermediate_size=F_S,
        routed_scaling_factor=2.5,
        norm_topk_prob=True,
        mlp_hidden_act="relu2",
        mlp_bias=False,
        moe_latent_size=16,
    ),
    router_param="gate.weight",
    num_experts=16,
    top_k=4,
    notes=f"""
NemotronHMoE WITH latent projection (moe_latent_size=16 = Dl): as nemotron_h but the routed experts act in a latent space:
z = fc1_latent_proj(x) (nn.Linear(D, Dl), bias=mlp_bias=False); routed_z = sum_j w_j * o_{{e_j}}(z) with experts up_proj [E, F, Dl],
down_proj [E, Dl, F]; routed = fc2_latent_proj(routed_z) (nn.Linear(Dl, D)); the ROUTER and the shared expert still see x (D).
{V3_ROUTER}
o_e(z) = relu2(z @ up_proj[e].T) @ down_proj[e].T (non-gated, relu2(z) = relu(z)^2).
shared expert: s = down_proj(relu2(up_proj(x))), width moe_shared_expert_intermediate_size (= 40). y = routed + s(x).
""",
)

_add(
    "deepseek_v4",
    module="deepseek_v4",
    cls_name="DeepseekV4SparseMoeBlock",
    config_type="deepseek_v4",
    cfg=dict(
        n_routed_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=F_E,
        n_shared_experts=1,
        routed_scaling_factor=1.5,
        swiglu_limit=1.5,
        scoring_func="sqrtsoftplus",
        num_hidden_layers=2,
        mlp_layer_types=["moe", "moe"],
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    ctor=lambda cls, cfg: cls(cfg, layer_idx=1),
    notes="""
DeepseekV4SparseMoeBlock for a learned-router layer (mlp_layer_types[i] == "moe"; the "hash_moe" layers are LEFT_OUT).
router (DeepseekV4TopKRouter): l = x @ W_r.T (x dtype, no bias); s = sqrt(softplus(l)) (scoring_func "sqrtsoftplus");
idx = topk(s + e_score_correction_bias, k) (selection only, NO groups); w = s[idx] / (sum + 1e-20) (always normalised);
w = w * routed_scaling_factor (1.5 here).
experts: standard layout (gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear) with CLAMPED SwiGLU:
gate = clamp(gate, max=L), up = clamp(up, -L, L), o_e = (silu(gate) * up) @ down_proj[e].T, L = swiglu_limit (1.5 here, config default 10.0).
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T.
shared expert (DeepseekV4MLP): width config.intermediate_size == moe_intermediate_size (attribute alias; n_shared_experts is NOT
used), ALSO CLAMPED the same way: s = down_proj(silu(clamp(gate_proj(x), max=L)) * clamp(up_proj(x), -L, L)), no bias.
y = routed + s(x).
""",
)


# ----------------------------------------------------------------------------------------------
# other learned-router blocks
# ----------------------------------------------------------------------------------------------

_add(
    "phimoe",
    module="phimoe",
    cls_name="PhimoeSparseMoeBlock",
    config_type="phimoe",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, router_jitter_noise=0.1, input_jitter_noise=0.0),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes=f"""
PhimoeSparseMoeBlock, sparsemixer routing in eval mode (top_k must be 2). eps = router_jitter_noise (0.1 here; config default 0.01)
is NOT only a training jitter: it sets the eval-time mask threshold.
router (PhimoeTopKRouter = nn.Linear(D, E, bias=False)): l = x @ W_r.T (x dtype).
top-1: m1 = max(l), e1 = argmax(l); mask1_i = (m1 - l_i) / max(|l_i|, m1) > 2*eps; w1 = softmax(where(mask1, -inf, l))[e1].
top-2: l2 = l with l[e1] := -inf; m2 = max(l2), e2 = argmax(l2); mask2_i = (m2 - l_i) / max(|l_i|, m2) > 2*eps (computed on the
ORIGINAL l, factor = clamp(|l_i|, min=m2)); w2 = softmax(where(mask2, -inf, l2))[e2] (e1 stays -inf via l2).
No renormalisation of (w1, w2). {_experts()} F = intermediate_size. input_jitter only in training. No shared expert.
""",
)

_add(
    "jetmoe",
    module="jetmoe",
    cls_name="JetMoeMoE",
    config_type="jetmoe",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, activation_function="silu"),
    router_param="router.layer.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    logits_index=4,
    notes="""
JetMoeMoE (the MLP MoE; the attention MoA is LEFT_OUT).
router (JetMoeTopKGating.layer = nn.Linear(D, E, bias=False)): l = (x @ W_r.T).float(); (v, idx) = topk(l, k) on LOGITS;
w = softmax(v) over the k, cast to x dtype.
experts: input_linear.weight [E, 2F, D], output_linear.weight [E, D, F] (F.linear layout), no per-expert biases:
h = x @ input_linear.weight[e].T; gate = h[:F], up = h[F:] (CONCATENATED); o_e = (silu(gate) * up) @ output_linear.weight[e].T.
map: gate[e] = input_linear.weight[e, :F].T, up[e] = input_linear.weight[e, F:].T, down[e] = output_linear.weight[e].T.
OUTPUT BIAS: y = sum_j w_j o_{e_j}(x) + bias, with block parameter `bias` [D] added ONCE (not weighted). act = activation_function (silu).
""",
)

_add(
    "minimax",
    module="minimax",
    cls_name="MiniMaxSparseMoeBlock",
    config_type="minimax",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, router_jitter_noise=0.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
MiniMaxSparseMoeBlock: code identical to Mixtral. router: l = x @ W_r.T; p = softmax(l.float()); (w, idx) = topk(p, k);
w = w / sum(w) (no eps). {_experts()} F = intermediate_size. No shared expert.
""",
)

_SIGMOID_BIAS_NORM = (
    "router: l = x @ W_r.T (x cast to weight dtype, no bias); s = sigmoid(l.float()); idx = topk(s + e_score_correction_bias, k) "
    "(bias used for SELECTION ONLY); w = s[idx] / sum(s[idx]) (always normalised, NO eps)."
)

_add(
    "minimax_m2",
    module="minimax_m2",
    cls_name="MiniMaxM2SparseMoeBlock",
    config_type="minimax_m2",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, router_jitter_noise=0.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
MiniMaxM2SparseMoeBlock. e_score_correction_bias is a BLOCK buffer [E] passed to the router.
{_SIGMOID_BIAS_NORM} No scaling factor.
{_experts()} F = intermediate_size. No shared expert.
""",
)

_add(
    "minimax_m3_vl_text",
    module="minimax_m3_vl",
    cls_name="MiniMaxM3VLSparseMoeBlock",
    config_type="minimax_m3_vl_text",
    cfg=dict(
        num_local_experts=8,
        num_experts_per_tok=2,
        intermediate_size=F_E,
        shared_intermediate_size=F_S,
        routed_scaling_factor=2.0,
        swiglu_alpha=1.702,
        swiglu_limit=1.5,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes="""
MiniMaxM3VLSparseMoeBlock (text decoder MoE of MiniMax-M3-VL). e_score_correction_bias is a ROUTER buffer.
router: l = x @ W_r.T (no bias); s = sigmoid(l.float()); idx = topk(s + e_score_correction_bias, k) (selection only);
w = s[idx] / sum(s[idx]) (no eps).
experts: gate_up_proj [E, 2F, D] (CONCATENATED [gate|up]), down_proj [E, D, F], F.linear layout, no biases, GPT-OSS-style clamped GLU:
gate = clamp(gate, max=L); up = clamp(up, -L, L); a = (up + 1) * gate * sigmoid(alpha * gate); o_e = a @ down_proj[e].T;
alpha = swiglu_alpha = 1.702, L = swiglu_limit = 1.5 here (config default 7.0).
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T.
y = routed_scaling_factor (2.0) * sum_j w_j o_{e_j}(x) + shared(x).
shared expert (MiniMaxM3VLDenseMLP, width shared_intermediate_size = 40): gate_up_proj nn.Linear(D, 2Fs) (weight [2Fs, D], chunk ->
gate first Fs rows, up last Fs rows), same clamped GLU (up + 1) * gate * sigmoid(alpha*gate), down_proj nn.Linear(Fs, D), no bias,
not scaled.
""",
)

_add(
    "hunyuan_v1_moe",
    module="hunyuan_v1_moe",
    cls_name="HunYuanMoEV1Moe",
    config_type="hunyuan_v1_moe",
    cfg=dict(num_experts=8, moe_topk=2, intermediate_size=F_E),
    router_param="gate.wg.weight",
    num_experts=8,
    top_k=2,
    ctor=lambda cls, cfg: cls(cfg, layer_idx=0),
    notes=f"""
HunYuanMoEV1Moe (num_experts / moe_topk may be per-layer lists in checkpoints; ints here).
router (HunYuanMoEV1Gate.wg = nn.Linear(D, E, bias=False, dtype float32)): x cast to float32 when wg is fp32; l = x @ W_r.T;
p = softmax(l, fp32) over E; (w, idx) = topk(p, k); w = w / sum(w) (always, no eps); w cast to l dtype.
{_experts()} F = intermediate_size.
{_shared("intermediate_size (SAME width as the routed experts)")} (HunYuanMoEV1MLP)
y = routed + shared(x).
""",
)

_add(
    "qwen3_5_moe_text",
    module="qwen3_5_moe",
    cls_name="Qwen3_5MoeSparseMoeBlock",
    config_type="qwen3_5_moe_text",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, shared_expert_intermediate_size=F_S),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Qwen3_5MoeSparseMoeBlock (text decoder of Qwen3.5-MoE): qwen2_moe math with ALWAYS-normalised top-k.
{_QWEN_ROUTER.format(norm="w = w / sum(w) (always, no norm_topk_prob flag, no eps)")}
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size", extra=" times a learned sigmoid gate")}
y = routed + sigmoid(x @ shared_expert_gate.weight.T) * s(x) (shared_expert_gate weight [1, D], no bias).
""",
)

_add(
    "qwen4_exp_text",
    module="qwen4_exp",
    cls_name="Qwen4ExpTextSparseMoeBlock",
    config_type="qwen4_exp_text",
    cfg=dict(
        num_experts=8,
        num_experts_per_tok=2,
        moe_intermediate_size=F_E,
        shared_expert_intermediate_size=F_S,
        norm_topk_prob=True,
    ),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Qwen4ExpTextSparseMoeBlock: code identical to qwen3_next (norm_topk_prob=True).
{_QWEN_ROUTER.format(norm="if norm_topk_prob: w = w / sum(w) (no eps) [ON here]")}
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size", extra=" times a learned sigmoid gate")}
y = routed + sigmoid(x @ shared_expert_gate.weight.T) * s(x).
""",
)

_add(
    "flex_olmo",
    module="flex_olmo",
    cls_name="FlexOlmoSparseMoeBlock",
    config_type="flex_olmo",
    cfg=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=F_E, norm_topk_prob=False),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
FlexOlmoSparseMoeBlock: code identical to olmoe (norm_topk_prob=False here).
{_QWEN_ROUTER.format(norm="norm_topk_prob=False: w NOT renormalised")}
{_experts()} F = intermediate_size. No shared expert.
""",
)

_add(
    "mellum",
    module="mellum",
    cls_name="MellumSparseMoeBlock",
    config_type="mellum",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, norm_topk_prob=True),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
MellumSparseMoeBlock: qwen3_moe math (norm_topk_prob=True here).
{_QWEN_ROUTER.format(norm="if norm_topk_prob: w = w / sum(w) (no eps) [ON here]")}
{_experts()} F = moe_intermediate_size. No shared expert.
""",
)

_add(
    "jamba",
    module="jamba",
    cls_name="JambaSparseMoeBlock",
    config_type="jamba",
    cfg=dict(num_experts=8, num_experts_per_tok=2, intermediate_size=F_E),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes=f"""
JambaSparseMoeBlock. router: l = x @ W_r.T (no bias); p = softmax(l, dtype=float32) over E; (w, idx) = topk(p, k);
NO renormalisation; w cast to x dtype. {_experts()} F = intermediate_size. No shared expert.
""",
)

for _name, _fn, _nshared, _strategy in (
    ("cohere2_moe", "softmax", 1, "average"),
    ("cohere2_moe_sigmoid", "sigmoid", 1, "sum"),
):
    _add(
        _name,
        module="cohere2_moe",
        cls_name="Cohere2MoeSparseMoeBlock",
        config_type="cohere2_moe",
        cfg=dict(
            num_experts=8,
            num_experts_per_tok=2,
            intermediate_size=F_E,
            num_shared_experts=_nshared,
            shared_expert_combination_strategy=_strategy,
            expert_selection_fn=_fn,
            norm_topk_prob=True,
        ),
        router_param="gate.weight",
        num_experts=8,
        top_k=2,
        notes=f"""
Cohere2MoeSparseMoeBlock (expert_selection_fn="{_fn}", num_shared_experts={_nshared}, combination "{_strategy}").
router: l = x @ W_r.T (x dtype, no bias); (v, idx) = topk(l, k) on LOGITS;
  "softmax": w = softmax(v, fp32) over the k;   "sigmoid": w = sigmoid(v); if norm_topk_prob: w = w / sum(w) (no eps);
  w cast to x dtype. [this entry: {_fn}{", norm_topk_prob=True" if _fn == "sigmoid" else ""}]
{_experts()} F = intermediate_size.
{_shared("intermediate_size * num_shared_experts (= 24 here)")}
combination: "sum": y = routed + s(x); "average": y = (routed + s(x)) / 2.  [this entry: {_strategy}]
""",
    )

_add(
    "afmoe",
    module="afmoe",
    cls_name="AfmoeSparseMoeBlock",
    config_type="afmoe",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, num_shared_experts=2, route_scale=1.5),
    router_param="router.gate.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes=f"""
AfmoeSparseMoeBlock. expert_bias is a BLOCK parameter [E] (requires_grad=False) passed to the router.
router (AfmoeTokenChoiceRouter.gate = nn.Linear(D, E, bias=False)): l = (x @ W_r.T).float(); s = sigmoid(l);
idx = topk(s + expert_bias, k) (selection only); w = s[idx] / (sum(s[idx]) + 1e-20); w = w * route_scale (1.5 here).
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * num_shared_experts (= 48 here)")}
y = shared(x) + routed.
""",
)

_add(
    "longcat_flash",
    module="longcat_flash",
    cls_name="LongcatFlashMoE",
    config_type="longcat_flash",
    cfg=dict(n_routed_experts=8, zero_expert_num=4, moe_topk=3, expert_ffn_hidden_size=F_E, routed_scaling_factor=1.5,
             router_bias=False),
    router_param="router.classifier.weight",
    num_experts=12,
    top_k=3,
    logits_at="router",
    notes="""
LongcatFlashMoE with ZERO-COMPUTATION (identity) experts: n_routed_experts=8 real experts + zero_expert_num=4 identity experts,
router over E_tot = 12, k=3. No shared expert inside the block (the decoder's shortcut MLP is separate).
router: l = x.float() @ classifier.weight.float().T ([E_tot, D]; classifier.bias, if router_bias, is NOT used in forward);
p = softmax(l) over E_tot (NOT sigmoid); idx = topk(p + e_score_correction_bias [E_tot], k) (selection only);
w = p[idx] * routed_scaling_factor (1.5 here); NO renormalisation.
experts: for e < 8: standard SwiGLU, gate_up_proj [E_tot, 2F, D] (only the first 8 rows are ever used; rows 8..11 are allocated
but unused), concatenated [gate|up], down_proj [8, D, F], F.linear layout, silu. For e >= 8: o_e(x) = x (identity).
y = sum_j w_j o_{e_j}(x). map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T (e < 8).
""",
)

_add(
    "aria_text",
    module="aria",
    cls_name="AriaTextMoELayer",
    config_type="aria_text",
    cfg=dict(moe_num_experts=8, moe_topk=2, intermediate_size=F_E, moe_num_shared_experts=2, mlp_bias=False),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes="""
AriaTextMoELayer. router: l = x @ W_r.T (x dtype, no bias); (v, idx) = topk(l, k) on LOGITS; w = softmax(v) over the k (x dtype).
experts (AriaExperts, TRANSPOSED): gate_up_proj [E, D, 2F] used as x @ W, CONCATENATED [gate|up] on the last dim;
down_proj [E, F, D] used as h @ W; act = silu (hard-coded); no biases.
map: gate[e] = gate_up_proj[e][:, :F], up[e] = gate_up_proj[e][:, F:], down[e] = down_proj[e].
shared experts (AriaSharedExpertsMLP): SwiGLU nn.Linear gate_proj/up_proj [Fs, D], down_proj [D, Fs], bias = mlp_bias (False),
Fs = intermediate_size * moe_num_shared_experts (= 48 here), act = hidden_act (silu). y = routed + shared(x).
""",
)

_add(
    "gemma4_text",
    module="gemma4",
    cls_name="Gemma4TextExperts",  # unused: built by ctor
    config_type="gemma4_text",
    cfg=dict(enable_moe_block=True, num_experts=8, top_k_experts=2, moe_intermediate_size=F_E, rms_norm_eps=1e-6),
    router_param="router.proj.weight",
    num_experts=8,
    top_k=2,
    logits_at="router.proj",
    logits_index=None,
    ctor=lambda cls, cfg: _GemmaMoEBranch("gemma4", "Gemma4", cfg),
    overrides={
        "router.scale": lambda r: 1.0 + 0.2 * r,
        "router.per_expert_scale": lambda r: 1.0 + 0.2 * r,
    },
    notes="""
MoE BRANCH of Gemma4TextDecoderLayer (enable_moe_block=True). In the real layer it runs in parallel with the dense MLP:
out = post_feedforward_layernorm(post_ffn_ln_1(mlp(pre_ffn_ln(r))) + THIS(r)); this entry is THIS(r) only (a wrapper holding the
layer's router / experts / pre_feedforward_layernorm_2 / post_feedforward_layernorm_2):
  router on the RAW residual r (not normed): h = rms(r) (Gemma4RMSNorm with_scale=False: r * (mean(r^2) + eps)^-0.5, fp32);
  h = h * router.scale[D] * D^-0.5; l = h @ router.proj.weight.T ([E, D], no bias); p = softmax(l, fp32) over E;
  (w, idx) = topk(p, k); w = w / sum(w) (no eps); w = w * router.per_expert_scale[idx] (learned [E] scale, AFTER renorm).
  (router returns p, not l; the hook here captures l from router.proj.)
  experts input: z = pre_feedforward_layernorm_2(r) (RMSNorm fp32, * weight, plain weight not 1+w);
  experts: standard layout gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear, no bias,
  act = hidden_activation = gelu_pytorch_tanh (GELU tanh approximation), o_e = (gelu_tanh(gate) * up) @ down_proj[e].T.
  out = post_feedforward_layernorm_2(sum_j w_j o_{e_j}(z)) (RMSNorm with weight).
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T. RMSNorm eps = rms_norm_eps (1e-6).
""",
)

_add(
    "flint",
    module="flint",
    cls_name="FlintSparseMoeBlock",
    config_type="flint",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, shared_expert_intermediate_size=F_S,
             norm_topk_prob=True),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
FlintSparseMoeBlock. router (fp32, autocast off): l = x.float() @ W_r.float().T (no bias); s = sigmoid(l); (w, idx) = topk(s, k)
(NO correction bias); if norm_topk_prob: w = w / sum(w) (no eps) [ON here]; no scaling; w stays fp32.
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size (= 40 here)")} (no gate)
y = routed + shared(x).
""",
)

_add(
    "lara_mini",
    module="lara_mini",
    cls_name="LaraMiniSparseMoeBlock",
    config_type="lara_mini",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, shared_expert_intermediate_size=F_S,
             norm_topk_prob=True),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
LaraMiniSparseMoeBlock. router: l = x.float() @ W_r.float().T; p = softmax(l) fp32 over E; (w, idx) = topk(p, k);
if norm_topk_prob: w = w / sum(w) (no eps) [ON here]; w cast to x dtype.
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size (= 40 here)")} (no gate)
y = routed + shared(x).
""",
)

_add(
    "kolibri1",
    module="kolibri1",
    cls_name="Kolibri1SparseMoeBlock",
    config_type="kolibri1",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, shared_expert_intermediate_size=F_S,
             norm_topk_prob=True),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
Kolibri1SparseMoeBlock. router: l = x.float() @ W_r.float().T (fp32; on CUDA an fp32-output mm); idx = topk(l + e_score_correction_bias, k)
-- the correction bias is added to the LOGITS (not to sigmoid scores), selection only; w = sigmoid(l[idx]);
if norm_topk_prob: w = w / sum(w) (no eps) [ON here]; no scaling; w fp32.
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size (= 40 here)")} (no gate)
y = routed + shared(x).
""",
)

_add(
    "laguna",
    module="laguna",
    cls_name="LagunaSparseMoeBlock",
    config_type="laguna",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, shared_expert_intermediate_size=F_S,
             moe_routed_scaling_factor=1.5, moe_router_logit_softcapping=2.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
LagunaSparseMoeBlock (moe_router_logit_softcapping=2.0, moe_routed_scaling_factor=1.5 here; config defaults 0.0 / 1.0).
router: l = (x @ W_r.T).float(); if softcap > 0: l = tanh(l / softcap) * softcap (the returned logits are the CAPPED ones);
s = sigmoid(l); idx = topk(s + e_score_correction_bias, k) (PARAMETER gate.e_score_correction_bias [E], selection only);
w = s[idx] / sum(s[idx]) (no eps); w cast to x dtype. Block: routed = moe_routed_scaling_factor * sum_j w_j o_{{e_j}}(x).
{_experts()} F = moe_intermediate_size.
{_shared("shared_expert_intermediate_size (= 40 here)")} (no gate, not scaled)
y = routed + shared(x). (config.moe_apply_router_weight_on_input is not read by the modeling code.)
""",
)

_add(
    "hy_v3",
    module="hy_v3",
    cls_name="HYV3MoE",
    config_type="hy_v3",
    cfg=dict(num_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, num_shared_experts=1,
             router_scaling_factor=2.5, enable_moe_fp32_combine=True, mlp_bias=False),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes=f"""
HYV3MoE. e_score_correction_bias is a BLOCK buffer [E] passed to the router.
router: l = x.float() @ W_r.float().T; s = sigmoid(l); idx = topk(s + e_score_correction_bias, k) (selection only);
w = s[idx] / (sum(s[idx]) + 1e-20); w = w * router_scaling_factor (2.5 here).
{_experts()} F = moe_intermediate_size.
{_shared("moe_intermediate_size * num_shared_experts (= 24 here)")} (bias = mlp_bias = False)
y = routed + shared(x) (summed in fp32 when enable_moe_fp32_combine, then cast to x dtype).
""",
)

_add(
    "step3p7",
    module="step3p7",
    cls_name="Step3p7SparseMoeBlock",
    config_type="step3p5",
    cfg=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, share_expert_dim=F_S,
             moe_router_scaling_factor=1.5, num_hidden_layers=2, swiglu_limits=[1.5, 1.5],
             swiglu_limits_shared=[2.0, 2.0], mlp_bias=False),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    ctor=lambda cls, cfg: cls(cfg, layer_idx=0),
    notes=f"""
Step3p7SparseMoeBlock (Step-3.7 text decoder, config type "step3p5" = Step3p7TextConfig), layer 0 with
swiglu_limits[0] = 1.5 and swiglu_limits_shared[0] = 2.0 here (None / 0 means no clamp).
{_SIGMOID_BIAS_NORM} (e_score_correction_bias is a ROUTER buffer.)
experts: standard layout (gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear, no bias) with clamp
AFTER the activation: a = clamp(silu(gate), max=L) * clamp(up, -L, L), o_e = a @ down_proj[e].T, L = swiglu_limits[layer].
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T.
routed = moe_router_scaling_factor (1.5) * sum_j w_j o_{{e_j}}(x).
shared expert (Step3p7MLP, width share_expert_dim = 40, bias = mlp_bias = False): s = down_proj(clamp(silu(gate_proj(x)), max=Ls)
* clamp(up_proj(x), -Ls, Ls)), Ls = swiglu_limits_shared[layer] (2.0 here). y = routed + s(x).
""",
)

_add(
    "openai_privacy_filter",
    module="openai_privacy_filter",
    cls_name="OpenAIPrivacyFilterMLP",
    config_type="openai_privacy_filter",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, intermediate_size=F_E, swiglu_limit=1.5, swiglu_alpha=1.702),
    router_param="router.weight",
    num_experts=8,
    top_k=2,
    logits_at="router",
    notes="""
OpenAIPrivacyFilterMLP (returns (y, router_scores); decoder keeps y). GPT-OSS math computed in FP32 with a CONCATENATED gate_up:
router: l = x.float() @ W_r.float().T + bias.float() (router.bias [E]); (v, idx) = topk(l, k); w = softmax(v) / k;
the block multiplies the combined output by k again, so effectively w = softmax(v) (exactly as GPT-OSS).
experts (transposed, biases): gate_up_proj [E, D, 2F] used as x @ W, gate_up_proj_bias [E, 2F]; h = x @ W + b;
gate = h[..., :F], up = h[..., F:] (CONCATENATED, unlike GPT-OSS); gate = clamp(gate, max=L); up = clamp(up, -L, L);
a = (up + 1) * gate * sigmoid(alpha * gate); o_e = a @ down_proj[e] + down_proj_bias[e] (down_proj [E, F, D]); all fp32,
alpha = 1.702, L = swiglu_limit = 1.5 here (config default 7.0). y = k * sum_j (softmax(v)_j / k) o_{e_j}(x).
map: gate[e] = gate_up_proj[e][:, :F], up[e] = gate_up_proj[e][:, F:], down[e] = down_proj[e]; b_gate = gate_up_proj_bias[e, :F],
b_up = gate_up_proj_bias[e, F:], b_down = down_proj_bias[e] (scaled by w). No shared expert.
""",
)

_add(
    "inkling_text",
    module="inkling",
    cls_name="InklingMoE",
    config_type="inkling_text",
    cfg=dict(n_routed_experts=8, num_experts_per_tok=2, n_shared_experts=2, moe_intermediate_size=F_E, route_scale=2.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    num_logits=8,
    overrides={"gate.global_scale": lambda r: 1.0 + 0.2 * r},
    notes="""
InklingMoE (E=8 routed + S=2 shared experts that are ALSO scored by the router; router weight [E+S, D]; k=2).
router (fp32, autocast off): l = x.float() @ W_r.float().T  ([E+S] logits, last S columns belong to the shared experts);
s = sigmoid(l); idx = topk(s[:E] + e_score_correction_bias[E], k) (selection only, routed experts only);
the k selected routed logits and ALL S shared logits are jointly normalised:
  g = [sigmoid(l[idx]), sigmoid(l[E:])] / sum(sigmoid(l[idx])) + sum(sigmoid(l[E:]))   (= exp(logsigmoid - logsumexp(logsigmoid)))
  g = g * route_scale (2.0 here) * global_scale (learned [1] parameter gate.global_scale); w = g[:k], gamma = g[k:] (per shared expert).
  (the returned/captured logits are the routed ones l[:E].)
experts: standard layout (gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear), silu, no bias.
shared experts (InklingSharedExperts): gate_proj, up_proj [S, F, D], down_proj [S, D, F] (per-shared-expert F.linear layout,
width F = moe_intermediate_size); shared = sum_s ((silu(x @ gate_proj[s].T) * (x @ up_proj[s].T) * gamma_s) @ down_proj[s].T),
i.e. the gamma weight multiplies the hidden activation before down (equivalent to weighting the output), summed in fp32.
y = routed + shared.
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T; shared: gate_proj[s].T, up_proj[s].T,
down_proj[s].T.
""",
)

_add(
    "inkling2_text",
    module="inkling2",
    cls_name="Inkling2SparseMoeBlock",
    config_type="inkling2_text",
    cfg=dict(n_routed_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, route_scale=2.0,
             scoring_func="sigmoid", mlp_gate_softcap=1.0, mlp_up_softcap=2.0),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes="""
Inkling2SparseMoeBlock (no shared expert). router (fp32): l = x.float() @ W_r.T; s = score_fn(l) (scoring_func = sigmoid);
idx = topk(s + e_score_correction_bias, k) (selection only); w = s[idx] / (sum + 1e-20); w = w * routed_scaling_factor
(= config.route_scale, attribute alias; 2.0 here).
experts: standard layout (gate_up_proj [E, 2F, D] concatenated [gate|up], down_proj [E, D, F], F.linear, no bias) with a
SOFTCAPPED SwiGLU computed in fp32: a = softcap(gate, cg) * sigmoid(gate) * softcap(up, cu), softcap(z, c) = tanh(z / c) * c;
the sigmoid sees the RAW gate; cg = mlp_gate_softcap (1.0 here, default 4.0), cu = mlp_up_softcap (2.0 here, default 25.0).
o_e = a @ down_proj[e].T; routed sum accumulated in fp32, cast to x dtype.
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T.
""",
)

_add(
    "muse_spark_text",
    module="muse_spark",
    cls_name="MuseSparkMoE",
    config_type="muse_spark_text",
    cfg=dict(num_local_experts=8, num_experts_per_tok=2, moe_intermediate_size=F_E, moe_hidden_size=16,
             routed_scaling_factor=1.5, output_multiplier=0.5, rms_norm_eps=1e-6, post_norm_eps=1e-8,
             num_attention_heads=4, num_key_value_heads=2, head_dim=8),
    router_param="gate.weight",
    num_experts=8,
    top_k=2,
    notes="""
MuseSparkMoE: routed experts live in a projected space of width Dm = moe_hidden_size (16 here); no shared expert.
router (on x, width D): l = (x.float() @ W_r.float().T) * output_multiplier (0.5 here; the captured logits INCLUDE the multiplier);
s = sigmoid(l); idx = topk(s + e_score_correction_bias, k) (selection only); w = s[idx] / (sum(s[idx]) + 1e-15) (EPS 1e-15);
w = w * routed_scaling_factor (1.5 here).
z = pre_expert_norm(pre_expert_proj(x)): pre_expert_proj = nn.Linear(D, Dm, bias=False); pre_expert_norm =
MuseSparkTextCenteredRMSNorm (despite the name NO mean subtraction): z * rsqrt(mean(z^2) + rms_norm_eps) * (1 + weight), fp32.
experts on z: standard layout gate_up_proj [E, 2F, Dm] concatenated [gate|up], down_proj [E, Dm, F], F.linear, silu, no bias;
then a POST-EXPERT NORM shared by all experts (weight [Dm]): n(o) = rmsnorm(o * (1 + weight)) with eps = post_norm_eps (1e-8),
i.e. scale FIRST then normalise, no weight after; applied to each expert output BEFORE the routing weight.
y = post_expert_proj(sum_j w_j n(o_{e_j}(z))), post_expert_proj = nn.Linear(Dm, D, bias=False).
map: gate[e] = gate_up_proj[e, :F].T, up[e] = gate_up_proj[e, F:].T, down[e] = down_proj[e].T (all in Dm).
""",
)


# ----------------------------------------------------------------------------------------------
# MoE blocks found in the installed transformers but not registered
# ----------------------------------------------------------------------------------------------

LEFT_OUT: dict[str, str] = {
    "deepseek_v4 (hash_moe layers, DeepseekV4HashRouter)": (
        "hash routing: the expert ids come from a frozen tid2eid[input_ids] table, not from the router; only the weights use "
        "the learned gate. The learned-router layers (mlp_layer_types == 'moe') are registered as `deepseek_v4`."
    ),
    "nllb_moe (NllbMoeSparseMLP / NllbMoeTop2Router)": (
        "HF eager path is broken in 5.24: NllbMoeExperts one_hot()s the already one-hot top_1_mask, so the 'expert index' is the "
        "mask VALUE and only expert_0 (weighted by the top-2 prob) and expert_1 (weighted by the top-1 prob) are ever evaluated "
        "(checked: with 8 experts only experts 0 and 1 are called). Not a usable reference. (Routing itself: top-2 with "
        "capacity / moe_eval_capacity_token_fraction and batch_prioritized_routing.)"
    ),
    "jetmoe (JetMoeMoA)": "mixture-of-attention (expert q/o projections inside attention), not an MLP MoE; JetMoeMoE is registered.",
    "zaya (ZayaSparseMoeBlock / ZayaRouter)": (
        "router is not linear: down_proj(D->R, bias) [+ previous layer's router state * scale ('EDA', recurrent across layers)] "
        "-> RMSNorm -> fc1+GELU -> fc2+GELU -> out_proj to E+1 classes (extra 'skip' class with balancing bias -1, skipped "
        "slots get weight 0); needs the cross-layer router state."
    ),
    "doge (DogeCDMoE)": (
        "product-key retrieval of single-neuron experts (router_gate -> two key sets -> top-k over key products, embedding "
        "lookups down_embed/up_embed) added to a dense MLP; not a top-k over FFN experts."
    ),
    "vitpose_backbone (VitPoseNaiveMoe)": "expert chosen by the dataset_index input (no learned router).",
    "diffusion_gemma_text (DiffusionGemmaTextRouter / Experts)": (
        "duplicate: router, experts and decoder-layer wiring are identical to gemma4_text's MoE branch."
    ),
    "inkling2_loop_text (Inkling2LoopSparseMoeBlock)": "duplicate: router/experts/block code identical to inkling2_text.",
    "glm4v_moe_text (Glm4vMoeTextMoE)": "multimodal duplicate of glm4_moe (identical code).",
    "qwen3_vl_moe_text (Qwen3VLMoeTextSparseMoeBlock)": (
        "multimodal duplicate of qwen3_moe with norm_topk_prob=True (router always renormalises)."
    ),
    "qwen3_omni_moe thinker (Qwen3OmniMoeThinkerTextSparseMoeBlock)": "multimodal duplicate of qwen3_moe (same router flag).",
    "qwen3_omni_moe talker (Qwen3OmniMoeTalkerTextSparseMoeBlock)": (
        "multimodal (speech talker) duplicate of qwen2_moe / qwen3_next: gated shared expert, norm_topk_prob flag."
    ),
    "ernie4_5_vl_moe (Ernie4_5_VLMoeMoeBlock)": (
        "multimodal: two expert sets (text_moe / vision_moe, per-modality moe_intermediate_size) selected per token by "
        "moe_mm_token_type_ids, + shared experts; each per-modality block has the ernie4_5_moe math (softmax + statics "
        "correction bias for selection, clamp(sum, min=moe_norm_min) renorm)."
    ),
    "hy_v4_vl_text (HYV4VLMoE)": "multimodal duplicate of hy_v4 (identical code).",
    "deepseek_ocr2_text (DeepseekOcr2TextMoe)": "multimodal/OCR duplicate of deepseek_v2 (identical router/experts/block).",
    "unlimited_ocr_text (UnlimitedOcrTextMoe)": "OCR duplicate of deepseek_v2 (identical router/experts/block).",
    "dots3_note vision encoder (Dots3NoteVisionMoE)": (
        "vision-tower MoE with per-layer vision config; math = hy_v3 router (sigmoid + block correction bias, renorm +1e-20, "
        "router_scaling_factor) without shared experts."
    ),
    "sarvam_moe / sarvam_mla / kimi_k25": (
        "config-only aliases: AutoModel maps them to Glm4MoeModel / DeepseekV3Model (kimi_k25's text_config is deepseek_v3)."
    ),
    "multimodal wrappers (aria, llama4, gemma4, glm5_next, qwen3_5_moe, qwen4_exp, muse_spark, inkling_mm_model, dots3_note, "
    "minimax_m3_vl, mistral_large4)": "their language models use the *_text blocks registered above.",
}
