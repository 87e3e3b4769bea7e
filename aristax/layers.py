"""Flax NNX modules: thin owners of parameters around the pure ``aristax.moe``.

Letters: D model dim, F expert hidden dim, E experts, Fs shared hidden dim.
"""

from __future__ import annotations

import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
from flax import nnx
from flax.nnx import bridge
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aristax import routing as routing_lib
from aristax.config import MoEConfig
from aristax.moe import MoEParams, check_array, moe
from aristax.parallel import (chunked_moe, expert_parallel_moe, expert_parallel_options,
                              layout_experts, tokens_per_shard)
from aristax.sharding import EXPERT_AXIS, sharded_param

# Fan-in scaling of a stacked [E, in, out] weight: each expert on its own.
_expert_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
_dense_init = nnx.initializers.lecun_normal()


class BalanceBias(nnx.Variable):
    """Aux-loss-free balancing bias [E]: changed by ``MoE.update_balance_bias``, never
    by the optimizer (it is not an ``nnx.Param``)."""


class Router(nnx.Module):
    """Router weight [D, E] and, with aux-loss-free balancing, its bias [E]."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        D, E = config.d_model, config.num_experts
        self.weight_de = sharded_param(
            "router_weight_de", nnx.initializers.normal(0.02), rngs, (D, E), config.param_dtype
        )
        self.balance_bias_e = (
            BalanceBias(jnp.zeros((E,), jnp.float32)) if config.bias_update_rate > 0 else None
        )


class Experts(nnx.Module):
    """E stacked expert MLPs: gate_edf/up_edf [E, D, F], down_efd [E, F, D]."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        E, D, F, dt = config.num_experts, config.d_model, config.d_ff, config.param_dtype
        self.gate_edf = (
            None if config.activation == "gelu"
            else sharded_param("ffw_gate_edf", _expert_init, rngs, (E, D, F), dt)
        )
        self.up_edf = sharded_param("ffw_up_edf", _expert_init, rngs, (E, D, F), dt)
        self.down_efd = sharded_param("ffw_down_efd", _expert_init, rngs, (E, F, D), dt)


class SharedExperts(nnx.Module):
    """The shared experts fused into one dense MLP: gate_df/up_df [D, Fs], down_fd [Fs, D]."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs):
        D, Fs, dt = config.d_model, config.shared_width, config.param_dtype
        self.gate_df = (
            None if config.activation == "gelu"
            else sharded_param("shared_gate_df", _dense_init, rngs, (D, Fs), dt)
        )
        self.up_df = sharded_param("shared_up_df", _dense_init, rngs, (D, Fs), dt)
        self.down_fd = sharded_param("shared_down_fd", _dense_init, rngs, (Fs, D), dt)


def _value(param: nnx.Variable | None) -> jax.Array | None:
    return None if param is None else param[...]


@dataclasses.dataclass(frozen=True)
class ExpertParallelOptions:
    """The ``expert_parallel_moe`` keyword arguments a plan sets
    (``aristax.parallel.expert_parallel_options``), frozen and hashable: a ``MoE``
    keeps them as static module state, in its ``nnx`` graph definition.

    Attributes:
      expert_perm: int[num_slots], the logical expert in each physical slot (None:
        identity). expert_axis: "expert" or ("node", "local"). exchange: the
        all-to-all strategy. num_chunks: the plan's Lancet chunk count.
    """

    expert_perm: tuple[int, ...] | None
    expert_axis: str | tuple[str, ...]
    exchange: str
    num_chunks: int

    def as_kwargs(self) -> dict:
        """The options as ``expert_parallel_moe`` keyword arguments (a new dict)."""
        return dataclasses.asdict(self)


def on_tokens(forward, x: jax.Array, params: MoEParams, config: MoEConfig, **kwargs):
    """``forward`` (a layer of [T, D] tokens: ``moe``, ``chunked_moe``,
    ``expert_parallel_moe``) on x [..., D] flattened to tokens: y [..., D], and aux with
    router_logits [..., E]."""
    lead = x.shape[:-1]
    y, aux = forward(x.reshape(-1, config.d_model), params, config, **kwargs)
    aux = {**aux, "router_logits": aux["router_logits"].reshape(*lead, config.num_experts)}
    return y.reshape(*lead, y.shape[-1]), aux


@functools.partial(jax.jit, static_argnames=("config", "seq_len", "num_chunks"))
def one_device_layer(x: jax.Array, params: MoEParams, config: MoEConfig, *, bias=None,
                     jitter_rng=None, seq_len: int | None = None, num_chunks: int = 1):
    """The layer on one device for x [..., D]: ``moe``, or ``chunked_moe`` with
    ``num_chunks`` > 1, through ``on_tokens``. One jitted program (JAX's cache, keyed on
    the config, shapes and chunk count), so an eager call (a notebook) compiles once per
    input shape instead of once per op; inside a user's ``jit`` it is inlined."""
    forward = moe if num_chunks == 1 else functools.partial(chunked_moe, num_chunks=num_chunks)
    return on_tokens(forward, x, params, config, bias=bias, jitter_rng=jitter_rng,
                     seq_len=seq_len)


class ExpertLayout(nnx.Variable):
    """int32[num_slots]: the logical expert held in each stored expert slot of a ``MoE``
    (``EMPTY_SLOT`` for an empty slot); ``arange(E)`` without a plan. It is saved with
    the layer's state (not a parameter: optimizers leave it alone), so a state loaded
    into a layer of another layout is refused at the next call (``check_layout``)."""


def _layout_error(stored, expected) -> ValueError:
    return ValueError(
        f"this MoE stores its experts in layout {np.asarray(expected).tolist()} (logical "
        f"expert per slot), but its state holds layout {np.asarray(stored).tolist()}: the "
        f"state was saved by a layer with another plan (or none). Load the logical "
        f"weights instead: MoE.logical_params() of the saving layer (or "
        f"aristax.parallel.layout_experts(params, saved_layout, inverse=True)), then "
        f"MoE.apply_plan(plan) to lay them out for this layer's plan")


def check_layout(stored: jax.Array, expected: np.ndarray) -> None:
    """Raise ``_layout_error`` unless ``stored`` (an ``ExpertLayout`` value) equals
    ``expected``: now when it is concrete; under ``jit`` at run time, through a host
    callback that runs only when the values differ (under ``vmap``, where both branches
    run, the callback compares again before raising)."""
    if stored.shape[-1:] != expected.shape:
        raise _layout_error(stored, expected)
    if not isinstance(stored, jax.core.Tracer):
        if not np.array_equal(np.asarray(stored), expected):
            raise _layout_error(stored, expected)
        return

    def fail(values):
        if not (np.asarray(values) == expected).all():
            raise _layout_error(np.asarray(values).reshape(-1, expected.size)[0], expected)

    jax.lax.cond(jnp.any(stored != expected), lambda v: jax.debug.callback(fail, v),
                 lambda v: None, stored)


def _place(module: nnx.Module, sharding: NamedSharding) -> None:
    """Every array variable of ``module`` put on ``sharding``."""
    state = nnx.state(module, nnx.Variable)
    nnx.update(module, jax.tree.map(lambda a: jax.device_put(a, sharding), state))


# The RNG streams router jitter draws from, in order of preference.
JITTER_STREAMS = ("jitter", "dropout", "default")


def jitter_stream(rngs: nnx.Rngs) -> nnx.RngStream:
    """The first stream of ``JITTER_STREAMS`` that ``rngs`` holds; a ValueError naming
    them and the fix when it holds none."""
    for name in JITTER_STREAMS:
        if name in rngs:
            return rngs[name]
    raise ValueError(
        f"MoEConfig.router_jitter > 0 draws from an RNG stream named one of "
        f"{JITTER_STREAMS}; these rngs have none: add one, e.g. "
        f"nnx.Rngs(params=0, dropout=1), or set router_jitter=0")


def _jitter_key(rngs: nnx.Rngs | nnx.RngStream | jax.Array) -> jax.Array:
    """A fresh key from an ``nnx.Rngs`` (its jitter stream), a stream, or a key."""
    if isinstance(rngs, nnx.Rngs):
        return jitter_stream(rngs)()
    return rngs() if isinstance(rngs, nnx.RngStream) else rngs


class MoE(nnx.Module):
    """A Mixture-of-Experts layer: ``y, aux = moe(x)`` for x[..., D].

    ``aux`` holds ``loss`` (the weighted auxiliary losses to add to the training loss),
    lb_loss, seq_aux_loss, z_loss, expert_load[E], dropped_fraction, num_dropped,
    nonfinite_tokens, unchosen_tokens and router_logits[..., E]; see ``aristax.moe.moe``.

    Router jitter (``config.router_jitter > 0``) is applied unless the layer is
    deterministic: ``deterministic=`` of the call, else of the constructor (set by
    ``module.eval()`` / ``module.train()``). It draws from the first RNG stream of
    ``JITTER_STREAMS`` that ``rngs`` holds ("jitter", else "dropout", else "default":
    ``nnx.Rngs(params=0, dropout=1)`` jitters from "dropout"), or from ``rngs=`` of the
    call (an ``nnx.Rngs``, a stream or a key).

    Expert parallelism: when a mesh with an "expert" axis is active, the layer runs
    ``aristax.parallel.expert_parallel_moe`` (experts sharded over "expert", tokens
    over ("data", "expert")). The mesh is ``mesh=`` when given, else the one set by
    ``with jax.set_mesh(mesh):`` (read with ``jax.sharding.get_abstract_mesh()``, so
    it works inside ``jit``). Without such a mesh it runs the single-device
    ``aristax.moe.moe``.

    ``plan=`` (an ``aristax.planner.Plan``, with ``mesh=mesh_from_plan(plan, ...)``)
    carries out the plan: the experts are stored in the plan's physical order
    ([num_slots, ...] slots: placement, replicas, empty slots; ``logical_params()``
    gives the logical [E, ...] order for checkpoints), and the expert axis, exchange
    and Lancet chunk count come from ``aristax.parallel.expert_parallel_options``,
    kept in ``ep_options`` (``config.exchange`` and a ``config.num_chunks`` that is
    set override them; the plan's chunk count, made for the plan's batch, is capped at
    one chunk per local token).
    """

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, mesh: Mesh | None = None,
                 plan=None, deterministic: bool = False):
        self.config = config
        self.mesh = mesh
        self.ep_options: ExpertParallelOptions | None = None
        self.expert_layout = ExpertLayout(jnp.arange(config.num_experts, dtype=jnp.int32))
        self.router = Router(config, rngs=rngs)
        self.experts = Experts(config, rngs=rngs)
        self.shared_experts = (
            SharedExperts(config, rngs=rngs) if config.num_shared_experts else None
        )
        self.jitter_rngs = jitter_stream(rngs).fork() if config.router_jitter > 0 else None
        self.deterministic = deterministic
        if plan is not None:
            self.apply_plan(plan)

    def apply_plan(self, plan) -> None:
        """Carry out ``plan`` (as ``plan=`` does) on a layer built without one, whose
        experts are in logical order (e.g. just loaded from a checkpoint): store them in
        the plan's physical slots, sharded over the plan mesh's expert axis (the other
        weights replicated on it), and take its expert-parallel options."""
        if self.ep_options is not None:
            raise ValueError("this MoE already carries a plan; build a new layer for another")
        if self.mesh is None:
            raise ValueError("MoE(plan=...) needs mesh=mesh_from_plan(plan, devices)")
        if plan.num_experts != self.config.num_experts:
            raise ValueError(f"plan.num_experts={plan.num_experts} but MoEConfig.num_experts="
                             f"{self.config.num_experts}; plan for the model's E")
        self.ep_options = ExpertParallelOptions(**expert_parallel_options(plan, self.mesh))
        if self.ep_options.expert_perm is not None:
            physical = layout_experts(self.params(), self.ep_options.expert_perm)
            for name in ("gate_edf", "up_edf", "down_efd"):
                variable = getattr(self.experts, name)
                if variable is not None:
                    variable.set_value(getattr(physical, name))
        self.expert_layout.set_value(jax.device_put(
            jnp.asarray(self.expected_layout()), NamedSharding(self.mesh, P())))
        expert_spec = P(self.ep_options.expert_axis, None, None)
        _place(self.experts, NamedSharding(self.mesh, expert_spec))  # slots over devices
        for module in (self.router, self.shared_experts):
            if module is not None:
                _place(module, NamedSharding(self.mesh, P()))

    def expected_layout(self) -> np.ndarray:
        """int32[num_slots]: the layout this layer's structure computes with (its plan's
        ``expert_perm``, else the identity)."""
        perm = None if self.ep_options is None else self.ep_options.expert_perm
        return np.asarray(np.arange(self.config.num_experts) if perm is None else perm,
                          np.int32)

    def logical_params(self) -> MoEParams:
        """``params()`` with experts in logical order [E, ...] (a replicated expert
        from its first slot): what checkpoints hold."""
        check_layout(self.expert_layout[...], self.expected_layout())
        if self.ep_options is None or self.ep_options.expert_perm is None:
            return self.params()
        return layout_experts(self.params(), self.ep_options.expert_perm, inverse=True)

    def params(self) -> MoEParams:
        """The layer's weights as arrays, experts as stored ([E, ...], or a plan's
        [num_slots, ...] physical slots)."""
        shared = self.shared_experts
        return MoEParams(
            router_de=self.router.weight_de[...],
            gate_edf=_value(self.experts.gate_edf),
            up_edf=self.experts.up_edf[...],
            down_efd=self.experts.down_efd[...],
            shared_gate_df=None if shared is None else _value(shared.gate_df),
            shared_up_df=None if shared is None else shared.up_df[...],
            shared_down_fd=None if shared is None else shared.down_fd[...],
        )

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """y [..., D], aux for x [..., D]. ``deterministic``: no router jitter (None: the
        layer's ``deterministic``). ``rngs``: where this call's jitter comes from (None:
        the stream the layer took at construction)."""
        cfg = self.config
        check_array(x)
        if x.ndim < 1 or x.shape[-1] != cfg.d_model:
            raise ValueError(
                f"x has shape {x.shape}, but MoEConfig.d_model={cfg.d_model}: the last "
                "dimension of x must equal d_model"
            )
        check_layout(self.expert_layout[...], self.expected_layout())
        lead = x.shape[:-1]
        seq_len = lead[-1] if len(lead) >= 2 else None
        deterministic = self.deterministic if deterministic is None else deterministic
        jitter_rng = None
        if cfg.router_jitter > 0 and not deterministic:
            jitter_rng = _jitter_key(self.jitter_rngs if rngs is None else rngs)
        bias = self.router.balance_bias_e
        y, aux = self._forward(math.prod(lead))(
            x, self.params(), cfg, bias=None if bias is None else bias[...],
            jitter_rng=jitter_rng, seq_len=seq_len)
        if cfg.debug_checks:
            _raise_if_nonfinite(aux["nonfinite_tokens"])
        return y, aux

    def _forward(self, num_tokens: int):
        """The function of (x [..., D], params, config, bias=, jitter_rng=, seq_len=) ->
        (y [..., D], aux) a call on ``num_tokens`` tokens runs: the expert-parallel
        forward when an expert mesh is active, else ``one_device_layer`` (``moe``, or
        ``chunked_moe`` when ``num_chunks > 1``)."""
        cfg = self.config
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        chunks = min(cfg.num_chunks or 1, num_tokens)  # at most one chunk per token
        if self.ep_options is not None:
            return functools.partial(on_tokens, functools.partial(
                expert_parallel_moe, mesh=mesh, **self.plan_call_options(num_tokens)))
        if mesh is not None and not mesh.empty and EXPERT_AXIS in mesh.axis_names:
            local = tokens_per_shard(num_tokens, mesh)
            return functools.partial(on_tokens, functools.partial(
                expert_parallel_moe, mesh=mesh, num_chunks=max(1, min(chunks, local)),
                exchange=cfg.exchange))
        if mesh is not None and not mesh.empty and mesh.size > 1:
            warnings.warn(
                f"aristax.MoE: the active mesh {dict(mesh.shape)} has no {EXPERT_AXIS!r} "
                f"axis, so every device holds all {cfg.num_experts} experts' weights and "
                f"runs the single-device layer on its tokens. For expert parallelism give "
                f"the mesh an {EXPERT_AXIS!r} axis (e.g. aristax.parallel.mesh_from_plan)",
                UserWarning, stacklevel=3)
        return functools.partial(one_device_layer, num_chunks=chunks)

    def plan_call_options(self, num_tokens: int) -> dict | None:
        """The ``expert_parallel_moe`` options a call on ``num_tokens`` tokens uses when
        the layer carries out a plan (None without one): the plan's, with
        ``config.exchange`` and a set ``config.num_chunks`` in their place;
        the chunk count (the plan's is made for its planned batch) is capped at one
        chunk per local token."""
        if self.ep_options is None:
            return None
        cfg = self.config
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        options = self.ep_options.as_kwargs()
        if cfg.exchange is not None:
            options["exchange"] = cfg.exchange
        local = tokens_per_shard(num_tokens, mesh, options["expert_axis"])
        options["num_chunks"] = max(1, min(cfg.num_chunks or options["num_chunks"], local))
        return options

    def update_balance_bias(self, expert_load: jax.Array) -> None:
        """Aux-loss-free balancing step from the last step's ``aux["expert_load"]``
        (int32[E], assignments routed to each expert before drops)."""
        if self.router.balance_bias_e is None:
            raise ValueError(
                "update_balance_bias needs MoEConfig.bias_update_rate > 0 (it is 0)"
            )
        bias = self.router.balance_bias_e
        bias[...] = routing_lib.update_balance_bias(
            bias[...], expert_load, self.config.bias_update_rate
        )


def _raise_if_nonfinite(count: jax.Array) -> None:
    """Raise (also under jit, through a host callback) when router logits were NaN/inf."""

    def check(n):
        if int(n) > 0:
            raise FloatingPointError(
                f"{int(n)} tokens have non-finite router logits (MoEConfig.debug_checks)"
            )

    if isinstance(count, jax.core.Tracer):
        jax.debug.callback(check, count)
    else:
        check(count)


def moe_linen(config: MoEConfig, *, name: str | None = None):
    """The ``MoE`` layer as a Flax Linen module (through ``flax.nnx.bridge``).

    Use inside a Linen model: ``y, aux = moe_linen(cfg)(x, deterministic=not train)``
    with x [..., D] and y [..., D] (as ``MoE``); its parameters live in the "params"
    collection, and ``init`` needs a "params" RNG. Router jitter draws, at every
    ``apply``, from the Linen RNG named "jitter", else "dropout" (``apply(...,
    rngs={"dropout": key})``), and is off with ``deterministic=True``. Parameters
    carry ``nn.Partitioned`` sharding names, so ``nn.scan`` over layers (with
    ``metadata_params={nn.PARTITION_NAME: ...}``) gives the stacked weights the layer
    axis in front of the expert axis.
    """
    return bridge.to_linen(MoE, config, name=name, metadata_fn=_linen_box)


def _linen_box(variable: nnx.Variable):
    """The Linen metadata box of a bridged ``MoE`` variable: ``nn.Partitioned`` with
    its sharding names where it has them, so that ``nn.scan``/``nn.vmap`` over layers
    add their axis to the spec (Flax's default box, ``NNXMeta``, keeps the unstacked
    spec); Flax's default box otherwise."""
    names = variable.get_metadata().get("out_sharding")
    if names is None:
        return bridge.variables.to_linen_var(variable)
    return nn.Partitioned(variable.get_value(), names=tuple(names))
