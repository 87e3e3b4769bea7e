"""An independent, per-token reference MoE, written from the papers, not from aristax.

Selection (which experts, which slots survive capacity) is decided in NumPy float64
with plain loops; the forward pass is a Python loop over tokens and their experts in
``jax.numpy`` so that ``jax.grad`` gives reference gradients (selection is piecewise
constant, so its gradient is zero almost everywhere).
"""

from __future__ import annotations

import math
from decimal import Decimal

import jax
import jax.numpy as jnp
import numpy as np


def _np_softmax(z):
    z = z - z.max(-1, keepdims=True)
    e = np.exp(z)
    return e / e.sum(-1, keepdims=True)


def _scores(logits, router):
    if router == "sigmoid":
        return 1.0 / (1.0 + np.exp(-logits))
    return _np_softmax(logits)


def allowed_experts(select_row, num_groups, topk_groups, rule="top2_sum", top_k=None):
    """Experts of the ``topk_groups`` best groups. A group's score: the sum of its two
    top scores ("top2_sum", DeepSeek-V3), its top score ("max", DeepSeek-V2), or the
    sum of its top_k // topk_groups top scores ("topk_over_groups", Megatron-Core)."""
    E = select_row.shape[0]
    size = E // num_groups
    take = {"top2_sum": 2, "max": 1, "topk_over_groups": (top_k or 1) // topk_groups}[rule]
    group_scores = []
    for g in range(num_groups):
        members = sorted(select_row[g * size:(g + 1) * size], reverse=True)
        group_scores.append(sum(members[: min(take, size)]))
    best = sorted(range(num_groups), key=lambda g: -group_scores[g])[:topk_groups]
    return sorted(e for g in best for e in range(g * size, (g + 1) * size))


def plan(x, router_de, cfg, bias=None, router_bias=None):
    """Which (token, expert, slot) assignments run, in NumPy.

    ``bias``: a selection bias [E] (selection only); ``router_bias``: a bias [E] on the
    logits (GPT-OSS). Returns a dict: assignments [(t, e)] that are kept, routed count,
    dropped count, load [E] (routed, before drops), and ids [T][*] chosen experts per
    token.
    """
    x = np.asarray(x, np.float64)
    logits = x @ np.asarray(router_de, np.float64)
    if router_bias is not None:
        logits = logits + np.asarray(router_bias, np.float64)
    T, E = logits.shape
    K = cfg.top_k
    finite = np.all(np.isfinite(logits), axis=-1)
    if cfg.router == "expert_choice":
        probs = _np_softmax(np.where(finite[:, None], logits, 0.0))
        factor = 1.0 if cfg.capacity_factor is None else cfg.capacity_factor
        C = min(T, max(1, math.ceil(factor * T * K / E)))
        chosen = [[] for _ in range(T)]
        for e in range(E):
            ranked = sorted((t for t in range(T) if finite[t]), key=lambda t: -probs[t, e])
            for t in sorted(ranked[:C]):
                chosen[t].append(e)
        pairs = [(t, e) for t in range(T) for e in chosen[t]]
        load = np.bincount([e for _, e in pairs], minlength=E)
        return dict(kept=pairs, routed=len(pairs), dropped=0, load=load, ids=chosen)

    ids = []
    for t in range(T):
        if not finite[t]:
            ids.append([])
            continue
        select = _scores(logits[t], cfg.router)
        if bias is not None:
            select = select + np.asarray(bias, np.float64)
        candidates = list(range(E))
        if cfg.num_groups > 1:
            candidates = allowed_experts(select, cfg.num_groups, cfg.topk_groups,
                                         getattr(cfg, "group_score", "top2_sum"), K)
        ids.append(sorted(candidates, key=lambda e: -select[e])[:K])
    load = np.bincount([e for row in ids for e in row], minlength=E)
    routed = int(load.sum())
    if cfg.capacity_factor is None:
        pairs = [(t, e) for t in range(T) for e in ids[t]]
        return dict(kept=pairs, routed=routed, dropped=0, load=load, ids=ids)

    C = max(1, math.ceil(Decimal(str(cfg.capacity_factor)) * T * K / E))  # decimal, exact
    slots = [(t, k) for t in range(T) for k in range(len(ids[t]))]
    if cfg.drop_policy == "position":
        slots.sort(key=lambda s: (s[1], s[0]))
    else:  # V-MoE batch prioritized routing: rank k over tokens by their top weight
        w = weights_np(logits, ids, cfg)
        slots.sort(key=lambda s: (s[1], -max(w[s[0]]), s[0]))
    used = np.zeros(E, int)
    kept = []
    for t, k in slots:
        e = ids[t][k]
        if used[e] < C:
            used[e] += 1
            kept.append((t, e))
    return dict(kept=sorted(kept), routed=routed, dropped=routed - len(kept), load=load, ids=ids)


def _token_weights(logits_t, chosen, cfg, xnp):
    """Combine weights of the chosen experts of one token (jnp, differentiable)."""
    if cfg.router == "topk_softmax":
        w = xnp.exp(logits_t[chosen] - xnp.max(logits_t[chosen]))
        w = w / xnp.sum(w)
    else:
        if cfg.router == "sigmoid":
            s = 1.0 / (1.0 + xnp.exp(-logits_t))
        else:
            s = xnp.exp(logits_t - xnp.max(logits_t))
            s = s / xnp.sum(s)
        w = s[chosen]
        if cfg.normalize_weights and cfg.router != "expert_choice":
            p = getattr(cfg, "weight_norm_p", 1.0)
            w = w / (xnp.sum(w ** p) ** (1.0 / p) + getattr(cfg, "weight_norm_eps", 0.0))
    return w * cfg.routed_scaling_factor


def weights_np(logits, ids, cfg):
    return [list(_token_weights(logits[t], list(ids[t]), cfg, np)) if ids[t] else []
            for t in range(len(ids))]


_np_erf = np.vectorize(math.erf)


def _act(h_gate, h_up, cfg_or_activation, xnp):
    activation = getattr(cfg_or_activation, "activation", cfg_or_activation)
    erf = jax.scipy.special.erf if xnp is jnp else _np_erf
    gelu = lambda h: 0.5 * h * (1.0 + erf(h / math.sqrt(2.0)))
    if activation == "gelu":
        return gelu(h_up)
    if activation == "relu":
        return xnp.maximum(h_up, 0.0)
    if activation == "clamped_swiglu":  # GPT-OSS, from its model card's formula
        limit, alpha = cfg_or_activation.swiglu_limit, cfg_or_activation.swiglu_alpha
        g = xnp.minimum(h_gate, limit)
        u = xnp.minimum(xnp.maximum(h_up, -limit), limit)
        return (u + 1.0) * g / (1.0 + xnp.exp(-alpha * g))
    gate = h_gate / (1.0 + xnp.exp(-h_gate)) if activation == "swiglu" else gelu(h_gate)
    return gate * h_up


def forward(x, p, cfg, pl, xnp=np):
    """y[T, D] by a loop over tokens and their kept experts.

    ``p``: dict router_de, gate_edf, up_edf, down_efd, and optional router_bias_e,
    gate_bias_ef, up_bias_ef, down_bias_ed, shared_* and shared_expert_gate_d arrays.
    ``pl``: the output of ``plan``. ``xnp``: ``np`` (float64, fast) or ``jnp`` (for
    ``jax.grad``). ``cfg.weight_side`` "input" feeds w * x to the expert (Llama 4).
    """
    if xnp is np:
        x = np.asarray(x, np.float64)
        p = {k: None if v is None else np.asarray(v, np.float64) for k, v in p.items()}
    T = x.shape[0]
    by_token = {t: [] for t in range(T)}
    for t, e in pl["kept"]:
        by_token[t].append(e)
    bias = lambda name, e: 0.0 if p.get(name) is None else p[name][e]  # noqa: E731
    input_side = getattr(cfg, "weight_side", "output") == "input"
    out = []
    for t in range(T):
        xt = x[t]
        yt = xnp.zeros_like(xt)
        chosen = pl["ids"][t]
        if chosen:
            logits_t = xt @ p["router_de"]
            if p.get("router_bias_e") is not None:
                logits_t = logits_t + p["router_bias_e"]
            w = _token_weights(logits_t, xnp.asarray(chosen), cfg, xnp)
            for k, e in enumerate(chosen):
                if e not in by_token[t]:
                    continue  # dropped
                xin = w[k] * xt if input_side else xt
                gate = (None if p.get("gate_edf") is None
                        else xin @ p["gate_edf"][e] + bias("gate_bias_ef", e))
                h = _act(gate, xin @ p["up_edf"][e] + bias("up_bias_ef", e), cfg, xnp)
                out_e = h @ p["down_efd"][e] + bias("down_bias_ed", e)
                yt = yt + (out_e if input_side else w[k] * out_e)
        if p.get("shared_up_df") is not None:
            gate = None if p.get("shared_gate_df") is None else xt @ p["shared_gate_df"]
            h = _act(gate, xt @ p["shared_up_df"], cfg, xnp)
            shared = h @ p["shared_down_fd"]
            if p.get("shared_expert_gate_d") is not None:
                shared = shared / (1.0 + xnp.exp(-(xt @ p["shared_expert_gate_d"])))
            yt = yt + shared
        out.append(yt)
    return xnp.stack(out)


def ragged_dot_with_grads(lhs, rhs, sizes, dout):
    """out[m] = lhs[m] @ rhs[g(m)] (group g owns the next sizes[g] rows, clipped to M;
    rows past the sum are 0) and its gradients dlhs, drhs for the cotangent dout, in
    float64 by a loop over the groups: the grouped GEMM's oracle."""
    lhs, rhs, dout = (np.asarray(a, np.float64) for a in (lhs, rhs, dout))
    out, dlhs, drhs = np.zeros((len(lhs), rhs.shape[2])), np.zeros_like(lhs), np.zeros_like(rhs)
    start = 0
    for g, size in enumerate(np.minimum(np.cumsum(sizes), len(lhs)) - np.minimum(
            np.cumsum(sizes) - sizes, len(lhs))):
        rows = slice(start, start + size)
        out[rows] = lhs[rows] @ rhs[g]
        dlhs[rows] = dout[rows] @ rhs[g].T
        drhs[g] = lhs[rows].T @ dout[rows]
        start += size
    return out, dlhs, drhs
