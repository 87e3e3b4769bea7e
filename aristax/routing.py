"""Routing: router logits -> which experts each token visits, with what weight.

Pure functions, no parameters. Letters: T tokens, E experts, K expert choices per
token (an assignment (t, k) is token t's k-th choice). Token-choice routers fill
K = top_k choices per token. Expert choice fills K = E choices (choice e belongs to
expert e) and marks the tokens each expert picked in ``mask``.

Losses:
  * ``load_balancing_loss``: Switch Transformer eq. 4 / GShard, in Hugging Face
    Mixtral's normalisation.
  * ``sequence_balance_loss``: DeepSeek-V3 eq. 17-20 (sequence-wise auxiliary loss).
  * ``router_z_loss``: ST-MoE eq. 5.
"""

from __future__ import annotations


import flax.struct
import jax
import jax.numpy as jnp

from aristax.config import RouterConfig, accumulation_dtype, expert_capacity
# the route kernel's: rows of underflowed sigmoid scores stay 0, not 0/0
from aristax.pallas_kernels.route.reference import normalize_rows


@flax.struct.dataclass
class Routing:
    """Where each token goes.

    Attributes:
      expert_ids: int32[T, K] expert of each choice.
      weights: float32[T, K] combine weight of each choice (0 where ``mask`` is False).
      mask: bool[T, K] choice is assigned (False: not picked by expert choice, or the
        token's logits were not finite). Capacity drops are decided later, in
        ``aristax.dispatch``.
      probs: float32[T, E] router probabilities used by the balancing losses
        (softmax of the logits, or normalised sigmoid scores).
      logits: float32[T, E] raw router logits.
    """

    expert_ids: jax.Array
    weights: jax.Array
    mask: jax.Array
    probs: jax.Array
    logits: jax.Array

    @property
    def num_experts(self) -> int:
        return self.logits.shape[-1]

    def expert_load(self) -> jax.Array:
        """int32[E]: assignments per expert (before capacity drops)."""
        return expert_counts(self.expert_ids, self.mask, self.num_experts)


def expert_counts(expert_ids: jax.Array, mask: jax.Array, num_experts: int,
                  segment_ids: jax.Array | None = None, num_segments: int = 1) -> jax.Array:
    """Masked assignments per expert, by ``jnp.bincount`` (no [T, K, E] one-hot).

    Args:
      expert_ids, mask: [T, K]. segment_ids: optional int32[T], each token's segment
        in [0, num_segments) (e.g. its sequence).
    Returns:
      int32[E], or int32[num_segments, E] with ``segment_ids``.
    """
    E = num_experts
    segment = 0 if segment_ids is None else segment_ids.astype(jnp.int32)[:, None]
    flat = jnp.where(mask, segment * E + expert_ids, num_segments * E)  # masked: one past
    counts = jnp.bincount(flat.reshape(-1), length=num_segments * E + 1)[:-1]
    shape = (E,) if segment_ids is None else (num_segments, E)
    return counts.astype(jnp.int32).reshape(shape)


def same(value):
    """The ``reduce`` of one device: each loss below sums its per-token statistics
    over all tokens with ``reduce`` (``jax.lax.psum`` over the token shards inside
    ``shard_map``; this identity on one device)."""
    return value


def apply_jitter(x: jax.Array, eps: float, rng: jax.Array) -> jax.Array:
    """x * U(1 - eps, 1 + eps), elementwise (Switch Transformer; Mixtral jitter)."""
    noise = jax.random.uniform(rng, x.shape, jnp.float32, 1.0 - eps, 1.0 + eps)
    return (x.astype(jnp.float32) * noise).astype(x.dtype)


def group_scores(select: jax.Array, num_groups: int, rule: str, top_k: int,
                 topk_groups: int) -> jax.Array:
    """float32[T, num_groups]: each group's score from its experts' selection scores
    select [T, E] (E split into ``num_groups`` equal consecutive groups).

    rule: "top2_sum", the sum of the group's two best (DeepSeek-V3; one when a group
    has one expert); "max", its best (DeepSeek-V2 ``group_limited_greedy``);
    "topk_over_groups", the sum of its top_k // topk_groups best (Megatron-Core
    ``group_limited_topk``).
    """
    T, E = select.shape
    grouped = select.reshape(T, num_groups, E // num_groups)
    if rule == "max":
        return jnp.max(grouped, axis=-1)
    n = 2 if rule == "top2_sum" else top_k // topk_groups
    return jnp.sum(jax.lax.top_k(grouped, min(n, E // num_groups))[0], axis=-1)


def _limit_to_top_groups(select: jax.Array, cfg: RouterConfig) -> jax.Array:
    """select [T, E] with -inf outside each token's ``cfg.topk_groups`` best groups
    (``group_scores`` by ``cfg.group_score``; ties go to the lower group index)."""
    T, E = select.shape
    G = cfg.num_groups
    score = group_scores(select, G, cfg.group_score, cfg.top_k, cfg.topk_groups)
    _, top_groups = jax.lax.top_k(score, cfg.topk_groups)  # [T, topk_groups]
    keep = jnp.any(top_groups[:, :, None] == jnp.arange(G, dtype=jnp.int32)[None, None, :],
                   axis=1)  # [T, G]
    return jnp.where(jnp.repeat(keep, E // G, axis=1), select, -jnp.inf)


def normalize_weights(weights: jax.Array, p: float, eps: float = 0.0) -> jax.Array:
    """weights [T, K] / (their p-norm over K + eps) (p = 1, eps = 0: ``normalize_rows``,
    sum to 1; a row of zeros stays 0). DBRX's ``moe_normalize_expert_weights`` is p;
    LFM2 adds eps = 1e-6, DeepSeek-V3 1e-20."""
    if p == 1 and eps == 0:
        return normalize_rows(weights)
    norm = jnp.sum(jnp.abs(weights) ** p, axis=-1, keepdims=True) ** (1.0 / p) + eps
    return jnp.where(norm > 0, weights / jnp.where(norm > 0, norm, 1.0), 0.0)


def finite_rows(logits: jax.Array) -> jax.Array:
    """bool[T]: every logit of the token is finite (the others are routed nowhere)."""
    return jnp.all(jnp.isfinite(logits), axis=-1)


def unchosen_tokens(routing: Routing) -> jax.Array:
    """int32[]: tokens with finite logits that no assignment serves (expert choice: chosen by
    no expert, so y = 0 there; always 0 for token choice, whose capacity drops are
    counted by ``aristax.dispatch``)."""
    served = jnp.any(routing.mask, axis=1)
    return jnp.sum(finite_rows(routing.logits) & ~served, dtype=jnp.int32)


def token_scores(logits: jax.Array, router: str) -> tuple[jax.Array, jax.Array]:
    """(scores, probs) [T, E] of finite logits for a token-choice router: the
    selection scores (sigmoid, or softmax over E) and the probs the balancing losses
    use (the sigmoid scores normalised over E, see ``normalize_rows``, or the softmax)."""
    if router == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        return scores, normalize_rows(scores)
    scores = jax.nn.softmax(logits, axis=-1)
    return scores, scores


def _token_choice(
    logits: jax.Array, cfg: RouterConfig, bias: jax.Array | None
) -> tuple[jax.Array, jax.Array, jax.Array]:
    """Returns (ids[T,K], weights[T,K], probs[T,E]) for the token-choice routers."""
    K = cfg.top_k
    scores, probs = token_scores(logits, cfg.router)
    # topk_softmax ranks the logits; ranking softmax scores is the same order.
    select = scores if bias is None else scores + bias.astype(scores.dtype)
    if cfg.num_groups > 1:
        select = _limit_to_top_groups(select, cfg)
    _, ids = jax.lax.top_k(select, K)
    if cfg.router == "topk_softmax":
        weights = jax.nn.softmax(jnp.take_along_axis(logits, ids, axis=-1), axis=-1)
    else:
        weights = jnp.take_along_axis(scores, ids, axis=-1)
        if cfg.normalize_weights:
            weights = normalize_weights(weights, cfg.weight_norm_p, cfg.weight_norm_eps)
    return ids, weights * cfg.routed_scaling_factor, probs


def plain_top_k(logits: jax.Array, top_k: int) -> jax.Array:
    """int32[T, K]: each token's K highest logits' experts, with no selection bias and
    no group limit (every score function here is increasing in the logit, so this is
    the plain top-k of the scores): what Megatron-Core's auxiliary losses count.
    Non-finite rows give arbitrary ids (their ``Routing.mask`` is False)."""
    finite = finite_rows(logits)[:, None]
    return jax.lax.top_k(jnp.where(finite, logits, 0.0), top_k)[1].astype(jnp.int32)


def expert_choice_capacity(num_tokens: int, cfg: RouterConfig) -> int:
    """C = ceil(capacity * T * K / E) tokens per expert under expert choice, in [1, T]."""
    factor = cfg.expert_capacity_factor
    return min(num_tokens, expert_capacity(num_tokens, cfg.top_k, cfg.num_experts, factor))


def _expert_choice(
    logits: jax.Array, cfg: RouterConfig, finite: jax.Array
) -> tuple[jax.Array, ...]:
    """Expert choice (Zhou et al. 2022): expert e takes the C tokens with the highest
    probability for e, C = ceil(capacity * T * K / E) (at most T). Tokens with
    ``finite`` False rank below every other token.

    Returns (ids[T,E], weights[T,E], mask[T,E], probs[T,E]); choice e is expert e.
    """
    T, E = logits.shape
    probs = jax.nn.softmax(logits, axis=-1)
    C = expert_choice_capacity(T, cfg)
    ranked = jnp.where(finite[:, None], probs, -1.0)
    _, token_ids = jax.lax.top_k(ranked.T, C)  # [E, C]
    mask = jnp.zeros((E, T), bool).at[jnp.arange(E, dtype=jnp.int32)[:, None], token_ids].set(True).T
    ids = jnp.broadcast_to(jnp.arange(E, dtype=jnp.int32), (T, E))
    weights = jnp.where(mask, probs, 0.0) * cfg.routed_scaling_factor
    return ids, weights, mask, probs


def route(
    logits: jax.Array, cfg: RouterConfig, *, bias: jax.Array | None = None
) -> Routing:
    """Route tokens from their router logits.

    Args:
      logits: float[T, E] router logits (float32, or float64 when given).
      cfg: the routing choices (``MoEConfig.router_config``).
      bias: optional float32[E] aux-loss-free balancing bias; it changes which
        experts are selected but never the combine weights (DeepSeek-V3 eq. 16).
    Returns:
      ``Routing``. Tokens whose logits are not all finite get ``mask`` False in every
      choice, weight 0 and probs 0, so they go nowhere and cannot disturb the others'
      routing. They still count in the T of the balance losses (``load_balancing_loss``:
      f_i is each expert's share of all T tokens' choices), which they lower;
      ``router_z_loss`` leaves them out.
    Raises:
      TypeError: cfg is not a ``RouterConfig`` (e.g. a ``MoEConfig``: pass its
        ``router_config``).
      ValueError: logits is not [T, E] or bias not [E], E = ``cfg.num_experts``.
    """
    if not isinstance(cfg, RouterConfig):
        raise TypeError(f"cfg must be a RouterConfig, got {type(cfg).__name__}; from a "
                        "MoEConfig pass config.router_config")
    bias = None if bias is None else jnp.asarray(bias)
    E = cfg.num_experts
    if logits.ndim != 2 or logits.shape[1] != E:
        raise ValueError(f"logits has shape {logits.shape}; route takes logits[T, E] with "
                         f"E = RouterConfig.num_experts={E}")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; it must be [E] = ({E},)")
    logits = logits.astype(accumulation_dtype(logits.dtype))
    finite = finite_rows(logits)  # [T]
    safe = jnp.where(finite[:, None], logits, 0.0)
    if cfg.router == "expert_choice":
        ids, weights, mask, probs = _expert_choice(safe, cfg, finite)
        mask = mask & finite[:, None]
    else:
        ids, weights, probs = _token_choice(safe, cfg, bias)
        mask = jnp.broadcast_to(finite[:, None], ids.shape)
    weights = jnp.where(mask, weights, 0.0)
    probs = jnp.where(finite[:, None], probs, 0.0)
    return Routing(
        expert_ids=ids.astype(jnp.int32), weights=weights, mask=mask, probs=probs,
        logits=logits,
    )


def load_balancing_loss(routing: Routing, row_weights: jax.Array | None = None, *,
                        reduce=same) -> jax.Array:
    """Switch Transformer eq. 4: E * sum_e f_e * P_e.

    f_e = (assignments to e) / T, counted over all K choices (so a perfectly balanced
    top-k router scores K, as in Hugging Face's ``load_balancing_loss_func``), and
    P_e = mean router probability of e. Gradients flow through P only.

    ``row_weights`` [T] (e.g. an attention mask): both means become weighted means,
    so padding rows (weight 0) count for nothing, as in Hugging Face. ``reduce``
    sums over token shards (``same`` on one device): T and the means are the whole
    batch's.
    """
    Tl, E = routing.probs.shape
    dtype = routing.probs.dtype
    w = jnp.ones((Tl,), dtype) if row_weights is None else row_weights.astype(dtype)
    if row_weights is None:
        assigned = routing.expert_load().astype(dtype)
    else:
        flat = jnp.where(routing.mask, routing.expert_ids, E).reshape(-1)
        per_choice = jnp.broadcast_to(w[:, None], routing.mask.shape).reshape(-1)
        assigned = jnp.bincount(flat, weights=per_choice, length=E + 1)[:E]
    total = reduce(jnp.sum(w))
    f = reduce(assigned) / total
    P = reduce(jnp.sum(routing.probs * w[:, None], axis=0)) / total
    return E * jnp.sum(f * P)


def sequence_balance_loss(routing: Routing, seq_len: int, *, reduce=same,
                          token_offset=0, num_tokens: int | None = None) -> jax.Array:
    """DeepSeek-V3 sequence-wise balance loss (eq. 17-20), averaged over sequences.

    Per sequence of length S: f_i = E / (K S) * (tokens of the sequence sent to i),
    P_i = mean over the sequence of the normalised scores; loss = sum_i f_i P_i.
    Tokens are split into consecutive sequences of ``seq_len`` (T % seq_len == 0).

    Over token shards: ``routing`` holds this shard's Tl tokens, from global token
    ``token_offset`` of ``num_tokens`` T (default Tl); ``reduce`` sums over shards.
    Where a sequence may straddle shards (Tl % S != 0) its counts and probability sums
    [T/S, E] are reduced first.
    """
    Tl, E = routing.probs.shape
    K = routing.expert_ids.shape[1]
    dtype = routing.probs.dtype
    T = num_tokens or Tl
    if Tl % seq_len == 0:  # every sequence lies in this shard
        seq_id = jnp.arange(Tl, dtype=jnp.int32) // seq_len
        counts = expert_counts(routing.expert_ids, routing.mask, E, seq_id, Tl // seq_len)
        P = routing.probs.reshape(Tl // seq_len, seq_len, E).mean(axis=1)
        f = counts.astype(dtype) * (E / (K * seq_len))
        return reduce(jnp.sum(f * P)) / (T // seq_len)
    seq_id = (token_offset + jnp.arange(Tl, dtype=jnp.int32)) // seq_len
    counts = reduce(expert_counts(routing.expert_ids, routing.mask, E, seq_id, T // seq_len))
    P = reduce(jax.ops.segment_sum(routing.probs, seq_id, T // seq_len)) / seq_len
    return jnp.mean(jnp.sum(counts.astype(dtype) * (E / (K * seq_len)) * P, axis=-1))


def router_z_loss(logits: jax.Array, mask: jax.Array | None = None, *,
                  reduce=same) -> jax.Array:
    """ST-MoE eq. 5: mean over tokens of logsumexp(logits)^2.

    Args:
      logits: float[T, E].
      mask: optional bool[T]; tokens with False are left out of the mean and of the
        gradient (``masked_z``).
      reduce: sums over token shards (``same`` on one device).
    """
    if mask is None and reduce is same:
        return jnp.mean(jax.nn.logsumexp(logits, axis=-1) ** 2)
    if mask is None:
        mask = jnp.ones(logits.shape[:1], bool)
    z = masked_z(logits, mask)
    return reduce(jnp.sum(z)) / jnp.maximum(reduce(jnp.sum(mask, dtype=jnp.int32)), 1
                                            ).astype(z.dtype)


def masked_z(logits: jax.Array, mask: jax.Array) -> jax.Array:
    """float[T]: logsumexp(logits)^2 per token, 0 (value and gradient) where mask[T] is
    False; masked logits are replaced before ``logsumexp``, whose gradient at a NaN or
    inf logit would be NaN even times a zero cotangent."""
    z = jax.nn.logsumexp(jnp.where(mask[:, None], logits, 0.0), axis=-1) ** 2
    return jnp.where(mask, z, 0.0)


def update_balance_bias(bias: jax.Array, expert_load: jax.Array, rate: float) -> jax.Array:
    """Aux-loss-free balancing update (DeepSeek-V3 section 2.1.2).

    bias_e += rate * sign(mean_load - load_e): overloaded experts become less
    attractive, underloaded ones more.

    Args:
      bias: float32[..., E]. expert_load: [..., E] assignments per expert in the last
        step; leading axes (e.g. the layers of a scanned stack, [L, E]) are updated
        each against its own mean.
    """
    load = expert_load.astype(jnp.float32)
    return bias + rate * jnp.sign(jnp.mean(load, axis=-1, keepdims=True) - load)
