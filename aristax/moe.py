"""The MoE layer as one pure function: route -> dispatch -> experts -> combine.

Letters: T tokens, D model dim, F expert hidden dim, E experts, K experts per token,
C capacity, S sequence length.
"""

from __future__ import annotations

from collections.abc import Callable

import flax.struct
import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import PartitionSpec as P

from aristax import dispatch as dispatch_lib
from aristax import routing as routing_lib
from aristax.config import MoEConfig, accumulation_dtype
from aristax.experts import activation_of, dense_mlp, expert_mlp
from aristax.pallas_kernels import frontdoor
from aristax.pallas_kernels.moe_mlp import fused_backend, moe_mlp
from aristax.pallas_kernels.moe_mlp.reference import ExpertMlp
from aristax.pallas_kernels.permute import api as permute_api
from aristax.pallas_kernels.permute.reference import inverse_order
from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
from aristax.pallas_kernels.route import api as route_api
from aristax.pallas_kernels.tiling import on_auto_axes, row_spec


@flax.struct.dataclass
class MoEParams:
    """The arrays of one MoE layer.

    Attributes:
      router_de: [D, E] router weight.
      up_edf: [E, D, F]; gate_edf: [E, D, F] or None (an ungated activation);
        down_efd: [E, F, D].
      shared_up_df, shared_gate_df: [D, Fs]; shared_down_fd: [Fs, D] (None when there
        are no shared experts; Fs = num_shared_experts * shared_d_ff).
      router_bias_e: [E] (``MoEConfig.router_bias``), else None.
      gate_bias_ef, up_bias_ef: [E, F]; down_bias_ed: [E, D] (``expert_bias``; no
        gate bias without a gate), else None.
      shared_expert_gate_d: [D] (``shared_expert_gate``), else None.
    """

    router_de: jax.Array
    up_edf: jax.Array
    down_efd: jax.Array
    gate_edf: jax.Array | None = None
    shared_up_df: jax.Array | None = None
    shared_down_fd: jax.Array | None = None
    shared_gate_df: jax.Array | None = None
    router_bias_e: jax.Array | None = None
    gate_bias_ef: jax.Array | None = None
    up_bias_ef: jax.Array | None = None
    down_bias_ed: jax.Array | None = None
    shared_expert_gate_d: jax.Array | None = None


def param_shapes(config: MoEConfig, num_slots: int | None = None
                 ) -> dict[str, tuple[int, ...] | None]:
    """The shape of every ``MoEParams`` field for ``config`` (None: the field is None),
    expert-indexed fields with ``num_slots`` rows (default E)."""
    D, F, E = config.d_model, config.d_ff, config.num_experts
    slots, Fs, gated = num_slots or E, config.shared_width, config.gated
    shared, biased = config.num_shared_experts > 0, config.expert_bias
    return {
        "router_de": (D, E), "up_edf": (slots, D, F), "down_efd": (slots, F, D),
        "gate_edf": (slots, D, F) if gated else None,
        "shared_up_df": (D, Fs) if shared else None,
        "shared_down_fd": (Fs, D) if shared else None,
        "shared_gate_df": (D, Fs) if shared and gated else None,
        "router_bias_e": (E,) if config.router_bias else None,
        "gate_bias_ef": (slots, F) if biased and gated else None,
        "up_bias_ef": (slots, F) if biased else None,
        "down_bias_ed": (slots, D) if biased else None,
        "shared_expert_gate_d": (D,) if config.shared_expert_gate else None,
    }


def router_logits(x: jax.Array, router_de: jax.Array,
                  router_bias_e: jax.Array | None = None) -> jax.Array:
    """[T, E] = x[T, D] @ router_de[D, E] (+ router_bias_e [E] when given), in float32
    (float64 for float64 x), at full
    precision whatever ``jax.default_matmul_precision`` says, as the route kernels and
    Hugging Face compute it (on a GPU JAX's default, TF32, could pick other experts
    at near-ties than the fused route kernel; the product is small).

    A token with a NaN or inf feature gets NaN logits (so it is routed nowhere) and
    adds nothing to router_de's gradient: its row is zeroed before the product, since
    in x.T @ dlogits its inf times its zero cotangent would be NaN.
    """
    dtype = accumulation_dtype(x.dtype)
    finite = jnp.all(jnp.isfinite(x), axis=-1, keepdims=True)
    logits = jnp.dot(jnp.where(finite, x, 0).astype(dtype), router_de.astype(dtype),
                     precision=jax.lax.Precision.HIGHEST)
    if router_bias_e is not None:
        logits = logits + router_bias_e.astype(dtype)
    return jnp.where(finite, logits, jnp.nan)


def check_array(x) -> None:
    """Raise a ``TypeError`` unless x is an array (a list has no shape to check)."""
    if not hasattr(x, "ndim"):
        raise TypeError(f"x must be an array, got {type(x).__name__}; pass jnp.asarray(x)")


def check_tokens(x: jax.Array, config: MoEConfig) -> None:
    """Raise a ``ValueError`` unless x is [T, D] floating with T >= 1, D = d_model (a
    ``TypeError`` when x is not an array or config not a ``MoEConfig``)."""
    if isinstance(config, jax.core.Tracer):
        raise TypeError("config is a traced value: jax.jit traced the MoEConfig argument; "
                        "mark it static (jax.jit(aristax.moe, static_argnames='config')) "
                        "or close over it (functools.partial(aristax.moe, config=config))")
    if not isinstance(config, MoEConfig):
        raise TypeError(f"config must be a MoEConfig, got {type(config).__name__} (the "
                        "arguments are (x, params, config))")
    check_array(x)
    if not all(isinstance(n, (int, np.integer)) for n in x.shape):
        raise ValueError(f"x has symbolic shape {x.shape} (jax.export shape "
                         "polymorphism): the layer's tiles and loops are planned for "
                         "concrete shapes; export one program per token count")
    D = config.d_model
    if x.ndim != 2 or x.shape[1] != D:
        raise ValueError(f"x has shape {x.shape}; it must be [T, D] with D = MoEConfig."
                         f"d_model={D} (flatten the leading dimensions: x.reshape(-1, {D}))")
    if x.shape[0] == 0:
        raise ValueError("x has no tokens (T=0); pass at least one row")
    if not jnp.issubdtype(x.dtype, jnp.floating):
        raise ValueError(f"x has dtype {x.dtype}; pass floating-point tokens")


def check_inputs(
    x: jax.Array, params: MoEParams, config: MoEConfig, *,
    bias: jax.Array | None = None, seq_len: int | None = None,
    num_slots: int | None = None,
) -> int | None:
    """Raise a ``ValueError`` naming the argument when x, params, bias or seq_len do
    not fit ``config``; return seq_len as a Python int (or None). Shapes are static, so
    this runs while tracing, before XLA compiles anything.

    Expects x as ``check_tokens`` does; params as ``MoEParams`` for this config
    (expert weights with ``num_slots`` rows, default E: an expert-parallel layout may
    hold more); bias float[E]; seq_len a positive divisor of T (a Python or NumPy
    integer).
    """
    check_tokens(x, config)
    if not isinstance(params, MoEParams):
        raise TypeError(f"params must be MoEParams (e.g. MoE(...).params()), got "
                        f"{type(params).__name__}")
    E = config.num_experts
    expected = param_shapes(config, num_slots)
    for name, shape in expected.items():
        value = getattr(params, name)
        found = None if value is None else tuple(value.shape)
        if found != shape:
            raise ValueError(
                f"params.{name} has shape {found}, but MoEConfig(num_experts={E}, "
                f"d_model={config.d_model}, d_ff={config.d_ff}, activation="
                f"{config.activation!r}, num_shared_experts={config.num_shared_experts}, "
                f"router_bias={config.router_bias}, expert_bias={config.expert_bias}, "
                f"shared_expert_gate={config.shared_expert_gate}) needs {shape}; build "
                "the params for this config (e.g. aristax.MoE(config, rngs=...).params())")
        if value is not None and not jnp.issubdtype(value.dtype, jnp.floating):
            raise ValueError(
                f"params.{name} has dtype {value.dtype}; the layer's weights are real "
                f"floating point (float32, bfloat16, float16 or float64): cast it, e.g. "
                f"params.replace({name}=params.{name}.astype(jnp.float32))")
    if bias is not None and tuple(bias.shape) != (E,):
        raise ValueError(f"bias has shape {tuple(bias.shape)}; it must be [E] = ({E},), one "
                         "selection bias per expert")
    T = x.shape[0]
    if seq_len is not None and (not isinstance(seq_len, (int, np.integer))
                                or isinstance(seq_len, bool)):
        raise TypeError(f"seq_len={seq_len!r} must be a Python or NumPy integer (or None: one "
                        "sequence)")
    if seq_len is not None and (seq_len < 1 or T % seq_len):
        raise ValueError(f"seq_len={seq_len!r} must be a positive divisor of the T={T} "
                         "tokens (or None: one sequence)")
    return None if seq_len is None else int(seq_len)


def make_dispatch(
    routing: routing_lib.Routing, config: MoEConfig
) -> dispatch_lib.Dispatch:
    """Dropless, capacity, or (expert choice) exactly the experts' picks."""
    T = routing.expert_ids.shape[0]
    if is_dropless(config, T):
        return dispatch_lib.dropless_dispatch(routing)
    if config.router == "expert_choice":
        # Each expert holds exactly its C picks, in token order: nothing is dropped.
        C = routing_lib.expert_choice_capacity(T, config.router_config)
        return dispatch_lib.capacity_dispatch(routing, C, "position")
    return dispatch_lib.capacity_dispatch(routing, config.capacity(T), config.drop_policy)


def is_dropless(config: MoEConfig, num_tokens: int) -> bool:
    """Whether ``make_dispatch`` lays T tokens out dropless (token choice, no capacity)."""
    return config.router != "expert_choice" and config.capacity(num_tokens) is None


def moe(
    x: jax.Array,
    params: MoEParams,
    config: MoEConfig,
    *,
    bias: jax.Array | None = None,
    jitter_rng: jax.Array | None = None,
    seq_len: int | None = None,
) -> tuple[jax.Array, dict[str, jax.Array]]:
    """One MoE layer on a flat batch of tokens.

    Args:
      x: [T, D] tokens.
      params: ``MoEParams``.
      config: the layer's ``MoEConfig``.
      bias: float32[E] aux-loss-free balancing bias (selection only), or None.
      jitter_rng: PRNG key; when given and ``config.router_jitter > 0`` the router
        input is multiplied by U(1-eps, 1+eps) noise (the experts see clean x).
      seq_len: S for the sequence-wise balance loss (T % S == 0); None: one sequence.
    Returns:
      y: [T, D] in x's dtype (the compute dtype when ``config.dtype`` is set).
      aux: dict with
        loss: weighted sum of the auxiliary losses (add it to the training loss),
        lb_loss, seq_aux_loss, z_loss: float32[] (float64 for float64 x, as are
          router_logits),
        expert_load: int32[E] routed assignments per expert (before drops),
        dropped_fraction: float32[] dropped / routed assignments,
        num_dropped: int32[], nonfinite_tokens: int32[] tokens with NaN/inf logits
          (routed nowhere), unchosen_tokens: int32[] finite tokens that no expert
          chose under expert choice (y = 0 there; 0 for token choice),
          router_logits: float32[T, E].
    Raises:
      ValueError: x, params, bias or seq_len do not fit ``config`` (``check_inputs``).

    Differentiation: reverse mode (``jax.grad``, ``jax.vjp``) works on every path.
    The kernel front doors are ``custom_vjp`` functions, so forward mode (``jax.jvp``,
    ``jax.linearize``, ``jax.jacfwd``, ``jax.hessian``) raises JAX's "can't apply
    forward-mode autodiff (jvp) to a custom_vjp function" on every path. The "xla"
    fused expert MLP (the CPU default) and, at most sizes, the "xla" grouped GEMM have
    backward passes that loop over traced trip counts, so a second reverse derivative
    (grad of grad) raises a ``NotImplementedError`` naming the fix there; with
    ``config.implementation="reference"`` it works.
    """
    seq_len = check_inputs(x, params, config, bias=bias, seq_len=seq_len)
    # Tokens typed on a mesh with Explicit axes (plain data parallelism under
    # jax.set_mesh): sort and gather have no sharding rule there, so the layer runs with
    # those axes Auto; y and the router logits keep x's row sharding.
    def layer(x, params, bias, jitter_rng):
        return _moe(x, params, config, bias, jitter_rng, seq_len)

    def rows_like_x():
        row = row_spec(x)
        shapes = jax.eval_shape(layer, *jax.tree.map(
            lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), (x, params, bias, jitter_rng)))
        return jax.tree.map(lambda s: row if s.ndim == 2 else P(), shapes)  # [T, .]

    return on_auto_axes(layer, x, params, bias, jitter_rng, out_sharding=rows_like_x)


def _moe(x, params, config, bias, jitter_rng, seq_len):
    """``moe`` after its checks, on inputs with no Explicit mesh axes: ``layer_body``
    with every routed assignment's expert on this device."""
    def on_this_device(xc, routing, fused_dispatch):
        dispatch = fused_dispatch if fused_dispatch is not None else make_dispatch(routing,
                                                                                  config)
        y = routed_experts(xc, dispatch, routing.weights, params, config,
                           dropless=is_dropless(config, xc.shape[0]))
        return y, dispatch.num_dropped, None

    return layer_body(x, router_input(x, config, jitter_rng), params, config, bias, seq_len,
                      on_this_device)


def router_input(x: jax.Array, config: MoEConfig, jitter_rng: jax.Array | None) -> jax.Array:
    """What the router reads: x [T, D], times U(1 - eps, 1 + eps) noise when
    ``jitter_rng`` is given and ``config.router_jitter`` = eps > 0."""
    if jitter_rng is not None and config.router_jitter > 0:
        return routing_lib.apply_jitter(x, config.router_jitter, jitter_rng)
    return x


# (xc [T, D] in the compute dtype, Routing [T, K], the fused route kernel's dropless
# Dispatch or None) -> (routed experts' y [T, D] in the accumulation dtype, int32[]
# assignments dropped for capacity, int32[] rows over an exchange buffer or None)
RoutedExperts = Callable[[jax.Array, routing_lib.Routing, dispatch_lib.Dispatch | None],
                         tuple[jax.Array, jax.Array, jax.Array | None]]


def layer_body(x: jax.Array, router_in: jax.Array, params: MoEParams, config: MoEConfig,
               bias: jax.Array | None, seq_len: int | None, routed: RoutedExperts,
               **aux_kw) -> tuple[jax.Array, dict[str, jax.Array]]:
    """The MoE layer's one body: route -> ``routed`` experts -> shared experts -> aux.

    Every path runs it and supplies only what differs: ``routed`` (all experts on this
    device, Lancet chunks, or the expert-parallel exchange) and, over token shards,
    ``moe_aux``'s reducer keywords (``aux_kw``). x, router_in: [T, D] (router_in: x
    with jitter, ``router_input``). Returns (y [T, D] in the compute dtype, aux).
    """
    routing, fused_dispatch = route_tokens(router_in, params, config, bias)
    dtype = jnp.dtype(config.dtype) if config.dtype is not None else x.dtype
    xc = x.astype(dtype)
    y, num_dropped, num_overflow = routed(xc, routing, fused_dispatch)
    y = with_shared_experts(y, xc, params, config)
    return y.astype(dtype), moe_aux(routing, num_dropped, config, seq_len,
                                    num_overflow=num_overflow, **aux_kw)


def with_shared_experts(y: jax.Array, xc: jax.Array, params: MoEParams,
                        config: MoEConfig) -> jax.Array:
    """y [T, D] plus the shared experts' dense MLP of xc [T, D] (y itself when there
    are none), scaled per token by sigmoid(xc @ shared_expert_gate_d) when the config
    has ``shared_expert_gate`` (Qwen2-MoE). A token with a NaN or inf feature is
    routed nowhere and gets y = 0; it gets no shared output either, and adds nothing
    to the shared weights' gradient (its inf times a zero cotangent would be NaN)."""
    if params.shared_up_df is None:
        return y
    finite = jnp.all(jnp.isfinite(xc), axis=-1, keepdims=True)
    x0 = jnp.where(finite, xc, 0)
    shared = dense_mlp(x0, params.shared_gate_df, params.shared_up_df,
                       params.shared_down_fd, activation=activation_of(config))
    if params.shared_expert_gate_d is not None:
        gate = jnp.dot(x0, params.shared_expert_gate_d.astype(x0.dtype),
                       preferred_element_type=shared.dtype)
        shared = jax.nn.sigmoid(gate)[:, None] * shared
    return y + jnp.where(finite, shared, 0)


def route_tokens(
    router_in: jax.Array, params: MoEParams, config: MoEConfig,
    bias: jax.Array | None,
) -> tuple[routing_lib.Routing, dispatch_lib.Dispatch | None]:
    """The layer's ``Routing`` of router_in [T, D] by the router of ``params``: on the
    fused route kernel when ``fused_routing`` applies, with the dropless ``Dispatch``
    it yields; else on the plain router, with None (the caller makes the dispatch)."""
    fused = fused_routing(router_in, params.router_de, config, bias)
    if fused is not None:
        return fused
    logits = router_logits(router_in, params.router_de, params.router_bias_e)
    return routing_lib.route(logits, config.router_config, bias=bias), None


# router -> (score of the route kernel, whether it renormalises the K weights; None:
# the config's normalize_weights). topk_softmax's softmax over the K picked logits is
# the picked softmax scores renormalised.
KERNEL_ROUTERS = {"softmax_topk": ("softmax", None), "topk_softmax": ("softmax", True),
                  "sigmoid": ("sigmoid", None)}


def fused_routing(
    router_in: jax.Array, router_de: jax.Array, config: MoEConfig,
    bias: jax.Array | None,
) -> tuple[routing_lib.Routing, dispatch_lib.Dispatch] | None:
    """``Routing`` and dropless ``Dispatch`` from the fused ``pallas_kernels.route`` op
    on the backends ``config.implementation`` names (the reference where none
    serves), or None when the plain path must run: no kernel named, a capacity or
    expert-choice layout, or what the kernel does not do: group-limited routing, a
    router bias, a weight norm other than p = 1 without epsilon.

    router_in: [T, D] router input; router_de: [D, E]; bias: float32[E] or None.
    Equal to ``routing_lib.route`` + ``dropless_dispatch`` (the kernel's contract).
    """
    rc = config.router_config
    names = (None if config.implementation is None else
             frontdoor.with_reference(config.implementation, route_api.BACKENDS))
    if (names in (None, ["reference"]) or rc.router not in KERNEL_ROUTERS
            or rc.num_groups > 1 or not is_dropless(config, router_in.shape[0])
            or config.router_bias
            or (rc.normalize_weights and (rc.weight_norm_p != 1 or rc.weight_norm_eps))):
        return None
    score, normalize = KERNEL_ROUTERS[rc.router]
    out = route_api.route(router_in, router_de, top_k=rc.top_k, score=score, bias=bias,
                          normalize=rc.normalize_weights if normalize is None else normalize,
                          implementation=names)
    T, K = out.expert_ids.shape
    finite = routing_lib.finite_rows(out.logits)[:, None]
    _, probs = routing_lib.token_scores(jnp.where(finite, out.logits, 0.0), rc.router)
    routing = routing_lib.Routing(
        expert_ids=out.expert_ids, weights=out.weights * rc.routed_scaling_factor,
        mask=jnp.broadcast_to(finite, (T, K)), probs=jnp.where(finite, probs, 0.0),
        logits=out.logits)
    num_routed = jnp.sum(out.counts, dtype=jnp.int32)
    dispatch = dispatch_lib.Dispatch(
        sort_order=out.sort_order,
        row_valid=jnp.arange(T * K, dtype=jnp.int32) < num_routed,
        row_of=inverse_order(out.sort_order).reshape(T, K), kept=routing.mask,
        group_sizes=out.counts, num_routed=num_routed,
        num_dropped=jnp.zeros((), jnp.int32))
    return routing, dispatch


def routed_experts(
    xc: jax.Array,
    dispatch: dispatch_lib.Dispatch,
    weights: jax.Array,
    params: MoEParams,
    config: MoEConfig,
    *,
    dropless: bool,
) -> jax.Array:
    """The routed experts' weighted sum y[T, D] (float32; float64 for float64 xc).

    A ``dropless`` dispatch runs the fused ``moe_mlp`` (gather, expert MLP and
    weighted combine in one op) where one serves (``fused_experts``: a kernel that
    ``config.implementation`` names, or with None the platform's default, the "xla"
    loop on the CPU). Else permute -> ``expert_mlp`` -> combine; with
    ``implementation=None`` a dropless layout is first aligned to the default grouped
    GEMM's tiles (``dispatch.align_groups``); when ``config.implementation`` names
    kernels, permute and combine run on the ``pallas_kernels`` backends it names that
    serve them (the reference where none does). xc: [T, D] in the compute dtype;
    weights: [T, K] combine weights.
    """
    input_side = config.weight_side == "input"
    combine_weights = jnp.ones_like(weights) if input_side else weights

    def experts(rows, sort_order):
        if input_side:  # each row times its assignment's weight (Llama 4)
            rows = dispatch_lib.weight_rows(rows, sort_order, weights)
        return routed_mlp(rows, dispatch.group_sizes, params, config)

    if dropless:
        y = fused_experts(xc, dispatch.sort_order, weights, dispatch.group_sizes,
                          dispatch.num_routed, params, config, input_weights=input_side)
        if y is not None:
            return y
    if not dropless or config.implementation is None:
        if dropless:  # each expert's rows from a whole tile of the grouped GEMM's backend
            dispatch = dispatch_lib.align_groups(dispatch, ragged_dot_api.row_alignment(
                dispatch.sort_order.shape[0], config.num_experts, xc.dtype))
        rows = dispatch_lib.permute(xc, dispatch)
        return dispatch_lib.combine(experts(rows, dispatch.sort_order), dispatch,
                                    combine_weights)
    sort_order = dispatch.sort_order
    names = frontdoor.with_reference(config.implementation, permute_api.BACKENDS)
    kw = dict(num_valid=dispatch.num_routed, implementation=names)
    rows = permute_api.permute(xc, sort_order, top_k=weights.shape[1], **kw)
    return permute_api.combine(experts(rows, sort_order), sort_order, combine_weights, **kw)


def routed_mlp(rows: jax.Array, group_sizes: jax.Array, params: MoEParams,
               config: MoEConfig) -> jax.Array:
    """``expert_mlp`` of rows [M, D] grouped by ``group_sizes`` int32[E] with the
    layer's expert weights, biases, activation and grouped-GEMM rule: [M, D] float32
    (float64 for float64 rows)."""
    return expert_mlp(rows, group_sizes, params.gate_edf, params.up_edf, params.down_efd,
                      activation=activation_of(config), implementation=config.implementation,
                      gate_bias_ef=params.gate_bias_ef, up_bias_ef=params.up_bias_ef,
                      down_bias_ed=params.down_bias_ed)


def fused_experts(
    x: jax.Array,
    sort_order: jax.Array,
    weights: jax.Array,
    group_sizes: jax.Array,
    num_valid: jax.Array,
    params: MoEParams,
    config: MoEConfig,
    *,
    input_weights: bool,
) -> jax.Array | None:
    """``moe_mlp`` (gather, expert MLP, weighted combine in one op) on the backend that
    ``config.implementation`` picks (None: the platform's layer default, "xla" on the
    CPU), or None when it picks none (``moe_mlp.fused_backend``: "reference" first, no
    default on the platform, or every named kernel refuses or does not compute the
    config's activation, expert biases or input-side weights); callers then run the
    unfused path.

    x: [T, D] compute dtype; sort_order: int32[T*K] flat assignment t*K + k of each row
    in expert order (``Dispatch.sort_order``); weights: [T, K]; group_sizes: int32[E];
    num_valid: routed rows (rows past it add nothing); input_weights: the weights scale
    the experts' input rows (``weight_side="input"``) instead of their outputs. Returns
    y [T, D] in the accumulation dtype, or None.
    """
    mlp = ExpertMlp(config.activation, config.swiglu_limit, config.swiglu_alpha,
                    input_weights)
    fused = fused_backend(config.implementation, x, weights, params.up_edf,
                          extras=mlp.extras(config.expert_bias))
    if fused is None:
        return None
    return moe_mlp(x, sort_order, weights, group_sizes, params.gate_edf, params.up_edf,
                   params.down_efd, activation=config.activation, num_valid=num_valid,
                   gate_bias_ef=params.gate_bias_ef, up_bias_ef=params.up_bias_ef,
                   down_bias_ed=params.down_bias_ed,
                   weight_side="input" if input_weights else "output",
                   swiglu_limit=config.swiglu_limit, swiglu_alpha=config.swiglu_alpha,
                   implementation=fused)


def moe_aux(
    routing: routing_lib.Routing,
    num_dropped: jax.Array,
    config: MoEConfig,
    seq_len: int | None,
    *,
    num_overflow: jax.Array | None = None,
    reduce=routing_lib.same,
    num_shards: int = 1,
    token_offset=0,
) -> dict[str, jax.Array]:
    """The ``aux`` dict of ``moe`` (see there), the whole batch's statistics.

    Args:
      routing: ``Routing`` of the Tl tokens here. num_dropped: int32[] routed
        assignments dropped here for lack of capacity. seq_len: S, or None for one
        sequence.
      num_overflow, reduce, num_shards, token_offset: over token shards (expert
        parallelism): rows over an exchange buffer (dropped too, and reported as
        ``num_overflow``); the sum over shards (``jax.lax.psum``; ``same`` on one
        device); how many shards of Tl tokens; this shard's first global token.
    """
    logits = routing.logits
    T = logits.shape[0] * num_shards
    finite = routing_lib.finite_rows(logits)
    counted = routing
    if config.loss_convention == "megatron":  # a plain top-k of the unbiased scores
        counted = routing.replace(expert_ids=routing_lib.plain_top_k(logits, config.top_k))
    lb = routing_lib.load_balancing_loss(counted, reduce=reduce)
    if config.loss_convention == "megatron":
        lb = lb / config.top_k
    z = routing_lib.router_z_loss(logits, finite, reduce=reduce)
    seq = routing_lib.sequence_balance_loss(counted, seq_len or T, reduce=reduce,
                                            token_offset=token_offset, num_tokens=T)
    routed = reduce(jnp.sum(routing.mask, dtype=jnp.int32))
    dropped = reduce(num_dropped if num_overflow is None else num_dropped + num_overflow)
    aux = {
        "loss": config.lb_loss_coef * lb + config.seq_aux_loss_coef * seq
        + config.z_loss_coef * z,
        "lb_loss": lb,
        "seq_aux_loss": seq,
        "z_loss": z,
        "expert_load": reduce(routing.expert_load()),
        "dropped_fraction": dropped.astype(jnp.float32)
        / jnp.maximum(routed, 1).astype(jnp.float32),
        "num_dropped": dropped,
        "nonfinite_tokens": reduce(jnp.sum(~finite, dtype=jnp.int32)),
        "unchosen_tokens": reduce(routing_lib.unchosen_tokens(routing)),
        "router_logits": logits,
    }
    if num_overflow is not None:
        aux["num_overflow"] = reduce(num_overflow)
    return aux
