"""Flax NNX modules: thin owners of parameters around the pure ``aristax.moe``.

Letters: D model dim, F expert hidden dim, E experts, Fs shared hidden dim.
"""

from __future__ import annotations

import contextlib
import contextvars
import dataclasses
import functools
import math
import warnings

import jax
import jax.numpy as jnp
import flax.linen as nn
import numpy as np
from flax import nnx
from flax.core import FrozenDict
from flax.core import spmd as flax_spmd
from flax.nnx import bridge
from jax.experimental import multihost_utils
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aristax import hf_moe
from aristax import routing as routing_lib
from aristax.config import MoEConfig
from aristax.moe import MoEParams, check_array, moe
from aristax.parallel import (chunked_moe, expert_parallel_moe, expert_parallel_options,
                              layout_experts, tokens_per_shard)
from aristax.parallel.expert_parallel import EXPERT_CHOICE_REFUSAL
from aristax.sharding import EXPERT_AXIS, EXPERT_FIELDS, PARAM_DIMS, MoEAxes, sharded_param

# Fan-in scaling of a stacked [E, in, out] weight: each expert on its own.
_expert_init = nnx.initializers.variance_scaling(
    1.0, "fan_in", "truncated_normal", in_axis=-2, out_axis=-1, batch_axis=(0,)
)
_dense_init = nnx.initializers.lecun_normal()


class BalanceBias(nnx.Variable):
    """Selection bias [E] (``MoEConfig.selection_bias``, or aux-loss-free balancing):
    added to the scores for selection only; changed by ``MoE.update_balance_bias``
    or set by the user, never by the optimizer (it is not an ``nnx.Param``)."""


class Router(nnx.Module):
    """Router weight [D, E], its bias [E] (``router_bias``) and the selection bias [E]
    (``selection_bias`` or aux-loss-free balancing)."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, axes: MoEAxes):
        D, E, dt = config.d_model, config.num_experts, config.param_dtype
        self.weight_de = sharded_param(
            "router_de", nnx.initializers.normal(0.02), rngs, (D, E), dt, axes)
        self.bias_e = (sharded_param("router_bias_e", nnx.initializers.zeros, rngs, (E,), dt,
                                     axes) if config.router_bias else None)
        self.balance_bias_e = (
            BalanceBias(jnp.zeros((E,), jnp.float32)) if config.holds_selection_bias else None
        )


class Experts(nnx.Module):
    """E stacked expert MLPs: gate_edf/up_edf [E, D, F], down_efd [E, F, D]; with
    ``expert_bias``, gate_bias_ef/up_bias_ef [E, F] and down_bias_ed [E, D] (zeros)."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, axes: MoEAxes):
        E, D, F, dt = config.num_experts, config.d_model, config.d_ff, config.param_dtype
        gated, biased = config.gated, config.expert_bias
        self.gate_edf = (sharded_param("gate_edf", _expert_init, rngs, (E, D, F), dt, axes)
                         if gated else None)
        self.up_edf = sharded_param("up_edf", _expert_init, rngs, (E, D, F), dt, axes)
        self.down_efd = sharded_param("down_efd", _expert_init, rngs, (E, F, D), dt, axes)
        zeros = nnx.initializers.zeros
        self.gate_bias_ef = (sharded_param("gate_bias_ef", zeros, rngs, (E, F), dt, axes)
                             if biased and gated else None)
        self.up_bias_ef = (sharded_param("up_bias_ef", zeros, rngs, (E, F), dt, axes)
                           if biased else None)
        self.down_bias_ed = (sharded_param("down_bias_ed", zeros, rngs, (E, D), dt, axes)
                             if biased else None)


class SharedExperts(nnx.Module):
    """The shared experts fused into one dense MLP: gate_df/up_df [D, Fs], down_fd [Fs, D];
    with ``shared_expert_gate``, the per-token gate's weight gate_d [D]."""

    def __init__(self, config: MoEConfig, *, rngs: nnx.Rngs, axes: MoEAxes):
        D, Fs, dt = config.d_model, config.shared_width, config.param_dtype
        self.gate_df = (sharded_param("shared_gate_df", _dense_init, rngs, (D, Fs), dt, axes)
                        if config.gated else None)
        self.up_df = sharded_param("shared_up_df", _dense_init, rngs, (D, Fs), dt, axes)
        self.down_fd = sharded_param("shared_down_fd", _dense_init, rngs, (Fs, D), dt, axes)
        self.gate_d = (sharded_param("shared_expert_gate_d", nnx.initializers.normal(0.02),
                                     rngs, (D,), dt, axes)
                       if config.shared_expert_gate else None)


@dataclasses.dataclass(frozen=True)
class ExpertParallelOptions:
    """The ``expert_parallel_moe`` keyword arguments a plan sets
    (``aristax.parallel.expert_parallel_options``), frozen and hashable: a ``MoE``
    keeps them as static module state, in its ``nnx`` graph definition.

    Attributes:
      expert_perm: int[num_slots], the logical expert in each physical slot (None:
        identity). expert_axis: "expert" or ("node", "local"). exchange: the
        all-to-all strategy. num_chunks: the plan's Lancet chunk count. schedule:
        the plan's Aurora rounds with exchange "scheduled", else None.
    """

    expert_perm: tuple[int, ...] | None
    expert_axis: str | tuple[str, ...]
    exchange: str
    num_chunks: int
    schedule: tuple[tuple[tuple[int, int], ...], ...] | None = None

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
        f"state was saved by a layer with another plan (or none). Save and load the "
        f"logical weights instead: MoE.logical_params() of the saving layer (for a saved "
        f"state: aristax.parallel.layout_experts(params, saved_layout, inverse=True)), "
        f"then MoE.load_logical_params(params) on this one, which lays them out for its "
        f"plan")


# False inside ``layouts_checked``: traced calls leave out the run-time layout check.
_CHECK_TRACED_LAYOUTS = contextvars.ContextVar("aristax_check_traced_layouts", default=True)


def _host_value(a) -> np.ndarray:
    """a on the host, also a global array other processes hold part of."""
    if isinstance(a, jax.Array) and not a.is_fully_addressable:
        return np.asarray(multihost_utils.process_allgather(a, tiled=True))
    return np.asarray(a)


def check_layout(stored: jax.Array, expected: np.ndarray) -> None:
    """Raise ``_layout_error`` unless ``stored`` (an ``ExpertLayout`` value) equals
    ``expected``: now when it is concrete; under ``jit`` at run time, through a host
    callback that runs only when the values differ (under ``vmap``, where both branches
    run, the callback compares again before raising), unless inside
    ``layouts_checked``."""
    if stored.shape[-1:] != expected.shape:
        raise _layout_error(stored, expected)
    if not isinstance(stored, jax.core.Tracer):
        if not np.array_equal(_host_value(stored), expected):
            raise _layout_error(stored, expected)
        return
    if not _CHECK_TRACED_LAYOUTS.get():
        return

    def fail(values):
        if not (np.asarray(values) == expected).all():
            raise _layout_error(np.asarray(values).reshape(-1, expected.size)[0], expected)

    jax.lax.cond(jnp.any(stored != expected), lambda v: jax.debug.callback(fail, v),
                 lambda v: None, stored)


@contextlib.contextmanager
def layouts_checked(module: nnx.Module):
    """Check the stored expert layout of every ``MoE`` in ``module`` now (concretely,
    ``_layout_error`` on a mismatch), then, inside the ``with``, trace calls without
    the run-time check: a host callback, which keeps a compiled program out of JAX's
    persistent compilation cache. For a loop whose steps cannot change the layouts
    (an optimizer leaves ``ExpertLayout`` alone), e.g. ``aristax train``'s steps,
    traced inside it. The switch is not per module: every ``MoE`` traced inside skips
    the check, so call only layers of ``module`` there (and do not load another state
    into them inside it). Programs traced inside it and called after it still skip the
    check (JAX caches traces)."""
    for _, layer in nnx.iter_modules(module):
        if isinstance(layer, MoE):
            check_layout(layer.expert_layout[...], layer.expected_layout())
    token = _CHECK_TRACED_LAYOUTS.set(False)
    try:
        yield
    finally:
        _CHECK_TRACED_LAYOUTS.reset(token)


# The RNG streams router jitter draws from, in order of preference.
JITTER_STREAMS = ("jitter", "dropout", "default")


def jitter_stream(rngs: nnx.Rngs, *, required: bool = True) -> nnx.RngStream | None:
    """The first stream of ``JITTER_STREAMS`` that ``rngs`` holds; when it holds none,
    None if not ``required``, else a ValueError naming them and the fix."""
    for name in JITTER_STREAMS:
        if name in rngs:
            return rngs[name]
    if not required:
        return None
    raise ValueError(
        f"MoEConfig.router_jitter > 0 draws from an RNG stream named one of "
        f"{JITTER_STREAMS}; the rngs given (and any the layer was built with) have none: "
        f"add one, e.g. nnx.Rngs(params=0, dropout=1) (Linen: apply(..., "
        f"rngs={{'dropout': key}})), pass rngs= to the call, call with "
        f"deterministic=True, or set router_jitter=0")


def _jitter_key(rngs: nnx.Rngs | nnx.RngStream | jax.Array | None) -> jax.Array:
    """A fresh key from an ``nnx.Rngs`` (its jitter stream), a stream, or a key; None
    (no stream anywhere) raises ``jitter_stream``'s error."""
    if rngs is None or isinstance(rngs, nnx.Rngs):
        return jitter_stream(nnx.Rngs() if rngs is None else rngs)()
    if isinstance(rngs, nnx.RngStream):
        return rngs()
    if not isinstance(rngs, jax.Array) or rngs.ndim > 1:
        raise TypeError(f"rngs= of the call must be an nnx.Rngs, an nnx.RngStream or one "
                        f"PRNG key, e.g. jax.random.key(0); got {type(rngs).__name__}")
    return rngs


# The constructor's keywords that ``MoE.from_hf`` passes on (besides ``rngs``).
FROM_HF_MODULE_OPTIONS = ("mesh", "plan", "deterministic", "axes")


class JitterView:
    """``set_view`` of a module with a ``deterministic`` jitter switch, so that
    ``nnx.view(model, deterministic=True)`` (Flax's eval idiom) reaches it as it
    reaches ``nnx.Dropout``."""

    def set_view(self, deterministic: bool | None = None):
        """deterministic: True turns the module's jitter off, False on (None: as is)."""
        if deterministic is not None:
            self.deterministic = deterministic


class MoE(JitterView, nnx.Module):
    """A Mixture-of-Experts layer: ``y, aux = moe(x)`` for x[..., D].

    ``aux`` holds ``loss`` (the weighted auxiliary losses to add to the training loss),
    lb_loss, seq_aux_loss, z_loss, expert_load[E], dropped_fraction, num_dropped,
    nonfinite_tokens, unchosen_tokens and router_logits[..., E]; see ``aristax.moe.moe``.

    Router jitter (``config.router_jitter > 0``) is applied unless the layer is
    deterministic: ``deterministic=`` of the call, else of the constructor (set by
    ``module.eval()`` / ``module.train()``, or ``nnx.view(module, deterministic=...)``).
    It draws from the first RNG stream of ``JITTER_STREAMS`` that ``rngs`` holds
    ("jitter", else "dropout", else "default": ``nnx.Rngs(params=0, dropout=1)``
    jitters from "dropout"), or from ``rngs=`` of the call (an ``nnx.Rngs``, a stream
    or a key).

    Sharding: ``axes`` (``aristax.sharding.MoEAxes``) names the axes each weight
    dimension is split over -- mesh axes, or logical names that Flax's logical axis
    rules map -- written into the parameters' sharding metadata (so the Flax recipe,
    ``nnx.get_partition_spec`` then ``with_sharding_constraint``, places them). By
    default experts are split over "expert", tokens over "data", the rest replicated.
    When the active mesh has the axis ``axes.expert`` stands for (through the rules in
    effect at the call), the layer runs ``aristax.parallel.expert_parallel_moe`` over
    it (tokens over ``axes.batch`` and the expert axis). The mesh is ``mesh=`` when
    given, else the one set by ``with jax.set_mesh(mesh):`` (read with
    ``jax.sharding.get_abstract_mesh()``, so it works inside ``jit``); eager
    gradients on a mesh of Explicit axes (``jax.make_mesh``'s default) need the
    ``set_mesh`` context, or ``nnx.jit``, as JAX's own Explicit arrays do. Otherwise it
    runs the single-device ``aristax.moe.moe``, warning when a multi-device mesh
    splits none of the expert weights' dimensions (every device would hold them all).

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
                 plan=None, deterministic: bool = False, axes: MoEAxes = MoEAxes()):
        if not isinstance(config, MoEConfig):
            raise TypeError(f"config must be an aristax.MoEConfig, got "
                            f"{type(config).__name__}; e.g. MoEConfig(**values)")
        if not isinstance(rngs, nnx.Rngs):
            raise TypeError(f"rngs must be a flax.nnx.Rngs, got {type(rngs).__name__}; "
                            f"e.g. rngs=nnx.Rngs(0)")
        if not isinstance(axes, MoEAxes):
            raise TypeError(f"axes={axes!r}: give an aristax.sharding.MoEAxes, e.g. "
                            "MoEAxes(expert='fsdp')")
        self.config = config
        self.mesh = mesh
        self.axes = axes
        self.ep_options: ExpertParallelOptions | None = None
        self.expert_layout = ExpertLayout(jnp.arange(config.num_experts, dtype=jnp.int32))
        self.router = Router(config, rngs=rngs, axes=axes)
        self.experts = Experts(config, rngs=rngs, axes=axes)
        self.shared_experts = (
            SharedExperts(config, rngs=rngs, axes=axes) if config.num_shared_experts else None
        )
        stream = jitter_stream(rngs, required=False) if config.router_jitter > 0 else None
        self.jitter_rngs = None if stream is None else stream.fork()  # None: rngs= at calls
        self.deterministic = deterministic
        if plan is not None:
            self.apply_plan(plan)

    @classmethod
    def from_hf(cls, block, *, rngs: nnx.Rngs, **kwargs) -> MoE:
        """A layer computing the Hugging Face MoE block ``block`` (a torch module; see
        ``aristax.models.hf_moe.from_hf`` for the blocks it reads): its config, its
        weights and its selection bias (``aristax.hf_moe``, also named
        ``aristax.models.hf_moe``). ``kwargs``: the constructor's (mesh, plan, axes,
        deterministic; with a plan the weights are laid out for it), and the
        ``MoEConfig`` fields that say how the layer runs or trains rather than what
        the block computes (``hf_moe.NOT_STRUCTURAL``: implementation, num_chunks,
        capacity_factor, the aux-loss coefficients, bias_update_rate, dtype, ...), e.g.
        ``MoE.from_hf(block, rngs=rngs, implementation="xla", bias_update_rate=1e-3)``.

        Raises:
          NotImplementedError: naming what of the block aristax does not compute.
          TypeError: a keyword that is neither (a field the block decides, such as
            top_k, is named as such).
        """
        config, params = hf_moe.from_hf(block)
        options = {k: kwargs.pop(k) for k in list(kwargs) if k in hf_moe.NOT_STRUCTURAL}
        structural = sorted(set(kwargs) & {f.name for f in dataclasses.fields(MoEConfig)})
        unknown = sorted(set(kwargs) - set(structural) - set(FROM_HF_MODULE_OPTIONS))
        if structural or unknown:
            said = (f"{', '.join(structural)}: what the {type(block).__name__} computes, "
                    "read from the block" if structural else f"{', '.join(unknown)}: unknown")
            raise TypeError(
                f"MoE.from_hf got {said}; it takes the MoE constructor's "
                f"{', '.join(FROM_HF_MODULE_OPTIONS)} and how the layer runs or trains: "
                f"{', '.join(hf_moe.NOT_STRUCTURAL)}")
        layer = cls(config.replace(**options), rngs=rngs, **kwargs)
        layer.load_logical_params(params)
        bias = hf_moe.selection_bias(block)
        if bias is not None:
            var = layer.router.balance_bias_e
            var.set_value(layer._placed(None, bias, var[...]))
        return layer

    def apply_plan(self, plan) -> None:
        """Carry out ``plan`` (as ``plan=`` does) on a layer built without one, whose
        experts are in logical order (e.g. just loaded from a checkpoint): store them in
        the plan's physical slots, sharded over the plan mesh's expert axis (which
        becomes ``axes.expert`` and the experts' sharding metadata; the other weights
        placed by ``axes``), and take its expert-parallel options."""
        if self.ep_options is not None:
            raise ValueError("this MoE already carries a plan; build a new layer for another")
        if self.mesh is None:
            raise ValueError("MoE(plan=...) needs mesh=mesh_from_plan(plan, devices)")
        if plan.num_experts != self.config.num_experts:
            raise ValueError(f"plan.num_experts={plan.num_experts} but MoEConfig.num_experts="
                             f"{self.config.num_experts}; plan for the model's E")
        if self.config.router == "expert_choice":
            raise ValueError(EXPERT_CHOICE_REFUSAL)
        logical = self.logical_params()
        self.ep_options = ExpertParallelOptions(**expert_parallel_options(
            plan, self.mesh, exchange=self.config.exchange))
        expert_axis = self.ep_options.expert_axis
        if self.axes.expert not in (EXPERT_AXIS, expert_axis):
            raise ValueError(
                f"MoE(plan=...) splits the experts over the plan mesh's {expert_axis!r}, "
                f"but axes.expert={self.axes.expert!r}: leave MoEAxes.expert at its default "
                "with a plan")
        self.axes = dataclasses.replace(self.axes, expert=expert_axis)
        for field, variable in self._param_variables().items():
            variable.set_metadata(out_sharding=self.axes.param_spec(field))
        if self.router.balance_bias_e is not None:
            bias = self.router.balance_bias_e
            bias.set_value(jax.device_put(bias[...], NamedSharding(self.mesh, P())))
        self.load_logical_params(logical)

    def load_logical_params(self, params: MoEParams) -> None:
        """Set the layer's weights from ``params`` in logical expert order [E, ...]
        (``logical_params()`` of any layer of this config, e.g. restored from a
        checkpoint), cast to the parameters' dtypes: laid out in the plan's physical
        slots and placed on its mesh when the layer carries a plan, else placed as the
        current weights are. The stored layout is reset to the one the layer computes
        with, so a state refused by the layout check is repaired by this call."""
        self._check_one_layer("load_logical_params", "params")
        variables = self._param_variables()
        given = {f for f in PARAM_DIMS if getattr(params, f) is not None}
        if given != set(variables):
            raise ValueError(f"params hold {sorted(given)} but this MoE has "
                             f"{sorted(variables)}: load the weights of a layer of this config")
        for field, variable in variables.items():
            want = variable[...].shape
            if field in EXPERT_FIELDS:
                want = (self.config.num_experts,) + want[1:]
            if getattr(params, field).shape != want:
                raise ValueError(f"params.{field} has shape {getattr(params, field).shape}; "
                                 f"this MoE takes {want} (logical expert order)")
        perm = None if self.ep_options is None else self.ep_options.expert_perm
        if perm is not None:
            params = layout_experts(params, perm)
        for field, variable in variables.items():
            variable.set_value(self._placed(field, getattr(params, field), variable[...]))
        layout = self.expert_layout
        layout.set_value(self._placed(None, jnp.asarray(self.expected_layout()), layout[...]))

    def _placed(self, field: str | None, value: jax.Array, current: jax.Array) -> jax.Array:
        """``value`` as ``current``'s dtype, on the plan mesh by ``field``'s spec (None:
        replicated) when the layer carries a plan, else where ``current`` is; where
        ``current`` is not committed to a device (a layer built outside any mesh), not
        committed either, so that a mesh or ``jit`` may place it later."""
        value = jnp.asarray(value, current.dtype)
        if self.ep_options is not None:
            spec = P() if field is None else self.mesh_spec(field, self.mesh.axis_names)
            return jax.device_put(value, NamedSharding(self.mesh, spec))
        if not isinstance(current, jax.Array) or isinstance(current, jax.core.Tracer):
            return value
        if current.committed:
            return jax.device_put(value, current.sharding)
        if getattr(value, "committed", False):  # device_put cannot uncommit: via the host
            return jnp.asarray(np.asarray(value))
        return value

    def expected_layout(self) -> np.ndarray:
        """int32[num_slots]: the layout this layer's structure computes with (its plan's
        ``expert_perm``, else the identity)."""
        perm = None if self.ep_options is None else self.ep_options.expert_perm
        return np.asarray(np.arange(self.config.num_experts) if perm is None else perm,
                          np.int32)

    def logical_params(self) -> MoEParams:
        """``params()`` with experts in logical order [E, ...] (a replicated expert
        from its first slot): what checkpoints hold."""
        self._check_one_layer("logical_params")
        check_layout(self.expert_layout[...], self.expected_layout())
        if self.ep_options is None or self.ep_options.expert_perm is None:
            return self.params()
        return layout_experts(self.params(), self.ep_options.expert_perm, inverse=True)

    def _check_one_layer(self, method: str, args: str = "") -> None:
        """ValueError naming the per-layer recipe when this module is a stack of layers
        (``nnx.vmap`` of the constructor: its layout is [L, ..., E])."""
        stack = self.expert_layout[...].shape[:-1]
        if stack:
            lam = f"lambda layer{', ' + args if args else ''}"
            raise ValueError(
                f"this MoE is a stack of layers {stack} (nnx.vmap of its constructor): "
                f"{method}({args}) works on one layer; map it over the stack, e.g. "
                f"nnx.vmap({lam}: layer.{method}({args}), in_axes=0, out_axes=0)"
                f"(stack{', ' + args if args else ''})")

    def _param_variables(self) -> dict[str, nnx.Param]:
        """The layer's parameters by ``MoEParams`` field (fields it lacks left out)."""
        shared = self.shared_experts
        variables = {
            "router_de": self.router.weight_de,
            "router_bias_e": self.router.bias_e,
            **{field: getattr(self.experts, field) for field in EXPERT_FIELDS},
            "shared_gate_df": None if shared is None else shared.gate_df,
            "shared_up_df": None if shared is None else shared.up_df,
            "shared_down_fd": None if shared is None else shared.down_fd,
            "shared_expert_gate_d": None if shared is None else shared.gate_d,
        }
        return {field: v for field, v in variables.items() if v is not None}

    def params(self) -> MoEParams:
        """The layer's weights as arrays, experts as stored ([E, ...], or a plan's
        [num_slots, ...] physical slots)."""
        return MoEParams(**{field: v[...] for field, v in self._param_variables().items()})

    def mesh_spec(self, field: str, mesh_axes) -> P:
        """The ``PartitionSpec`` of ``MoEParams`` field ``field`` on a mesh with axes
        ``mesh_axes``: each dimension's role resolved by ``MoEAxes.on_mesh`` (under the
        logical axis rules in effect)."""
        dims = [() if role is None else self.axes.on_mesh(role, mesh_axes)
                for role in PARAM_DIMS[field]]
        return P(*(None if not a else a[0] if len(a) == 1 else a for a in dims))

    def __call__(self, x: jax.Array, *, deterministic: bool | None = None,
                 rngs: nnx.Rngs | nnx.RngStream | jax.Array | None = None,
                 seq_len: int | None = None,
                 ) -> tuple[jax.Array, dict[str, jax.Array]]:
        """y [..., D], aux for x [..., D]. ``deterministic``: no router jitter (None: the
        layer's ``deterministic``). ``rngs``: where this call's jitter comes from (None:
        the stream the layer took at construction). ``seq_len``: tokens per sequence
        for the sequence-wise balance loss, each sequence's tokens consecutive in x's
        row-major order (None: S of x [..., S, D]; for x [T, D], one sequence); give
        it for flattened [B*S, D] tokens, and make time-major [S, B, D] batch-major."""
        cfg = self.config
        check_array(x)
        if x.ndim < 1 or x.shape[-1] != cfg.d_model:
            raise ValueError(
                f"x has shape {x.shape}, but MoEConfig.d_model={cfg.d_model}: the last "
                "dimension of x must equal d_model"
            )
        check_layout(self.expert_layout[...], self.expected_layout())
        lead = x.shape[:-1]
        if seq_len is None:
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
        if mesh is None or mesh.empty:
            return functools.partial(one_device_layer, num_chunks=chunks)
        names = mesh.axis_names
        expert_axes = self.axes.on_mesh("expert", names)
        if expert_axes:
            tokens = tuple(dict.fromkeys(self.axes.on_mesh("batch", names) + expert_axes))
            local = tokens_per_shard(num_tokens, mesh, expert_axes, tokens)
            return functools.partial(on_tokens, functools.partial(
                expert_parallel_moe, mesh=mesh, expert_axis=expert_axes, token_axes=tokens,
                num_chunks=max(1, min(chunks, local)), exchange=cfg.exchange))
        if mesh.size > 1 and not any(self.axes.on_mesh(r, names) for r in ("embed", "mlp")):
            rules = flax_spmd.get_logical_axis_rules()
            warnings.warn(
                f"aristax.MoE: the active mesh {dict(mesh.shape)} has no axis for "
                f"axes.expert={self.axes.expert!r} (nor for embed/mlp) under the logical "
                f"axis rules in effect at this call ({list(rules) if rules else 'none'}), "
                f"so every device runs the single-device layer on its tokens with all "
                f"{cfg.num_experts} experts' weights (gathered if they were placed "
                f"split). Split the experts over a mesh axis: MoE(..., axes=MoEAxes("
                f"expert='<axis>')), a logical axis rule ('{self.axes.expert}', '<axis>') "
                f"in effect where the layer is called or traced, or a mesh with an "
                f"{EXPERT_AXIS!r} axis (aristax.parallel.mesh_from_plan)", UserWarning,
                stacklevel=3)
        return functools.partial(one_device_layer, num_chunks=chunks)

    def plan_call_options(self, num_tokens: int) -> dict | None:
        """The ``expert_parallel_moe`` options a call on ``num_tokens`` tokens uses when
        the layer carries out a plan (None without one): the plan's (with
        ``config.exchange`` in place of its exchange, taken when the plan was applied),
        with a set ``config.num_chunks`` in place of its chunk count; the chunk count
        (the plan's is made for its planned batch) is capped at one chunk per local
        token."""
        if self.ep_options is None:
            return None
        cfg = self.config
        mesh = self.mesh if self.mesh is not None else jax.sharding.get_abstract_mesh()
        options = self.ep_options.as_kwargs()
        local = tokens_per_shard(num_tokens, mesh, options["expert_axis"])
        options["num_chunks"] = max(1, min(cfg.num_chunks or options["num_chunks"], local))
        return options

    def update_balance_bias(self, expert_load: jax.Array) -> None:
        """Aux-loss-free balancing step from the last step's ``aux["expert_load"]``
        (int32[E], assignments routed to each expert before drops)."""
        if self.config.bias_update_rate <= 0:
            raise ValueError(
                "update_balance_bias needs MoEConfig.bias_update_rate > 0 (it is 0; a "
                "fixed selection_bias is set directly: layer.router.balance_bias_e[...] = b)"
            )
        bias = self.router.balance_bias_e
        bias[...] = routing_lib.update_balance_bias(
            bias[...], expert_load, self.config.bias_update_rate
        )


def _raise_if_nonfinite(count: jax.Array) -> None:
    """Raise a ``FloatingPointError`` when router logits were NaN/inf: eagerly here;
    under jit from a host callback, so the call fails with JAX's ``JaxRuntimeError``
    carrying its text (``MoEConfig.debug_checks``)."""

    def check(n):
        if int(n) > 0:
            raise FloatingPointError(
                f"{int(n)} token(s) have non-finite router logits (MoEConfig.debug_checks)"
            )

    if isinstance(count, jax.core.Tracer):
        jax.debug.callback(check, count)
    else:
        check(count)


def moe_linen(config: MoEConfig, *, axes: MoEAxes = MoEAxes(), name: str | None = None):
    """The ``MoE`` layer as a Flax Linen module (through ``flax.nnx.bridge``).

    Use inside a Linen model: ``y, aux = moe_linen(cfg)(x, deterministic=not train)``
    with x [..., D] and y [..., D] (as ``MoE``); its parameters live in the "params"
    collection, and ``init`` needs a "params" RNG. Router jitter draws, at every
    ``apply``, from the Linen RNG named "jitter", else "dropout" (``apply(...,
    rngs={"dropout": key})``; without either a jittered call raises), and is off with
    ``deterministic=True``.

    Two more collections hold the layer's state that is not trained by the optimizer:
    "BalanceBias" (float32[E], the selection bias, only where ``config`` has one:
    ``selection_bias`` or ``bias_update_rate`` > 0) and "ExpertLayout" (int32[E], the
    expert held in each slot; ``arange(E)`` in Linen, which has no plans). Give
    ``apply`` every collection ``init`` returned (``model.apply(variables, x)``): an
    ``apply`` without "BalanceBias" where the config has one raises rather than route
    with a zero bias. With ``bias_update_rate`` > 0, update it between steps from the
    layer's ``aux["expert_load"]`` ([E], or [L, E] from ``nn.scan``): ``variables =
    {**variables, "BalanceBias": jax.tree.map(lambda b: aristax.routing.
    update_balance_bias(b, expert_load, rate), variables["BalanceBias"])}``, as
    ``MoE.update_balance_bias`` does in NNX.

    Parameters are ``nn.LogicallyPartitioned`` with ``axes``' names (``MoE``), so the
    Linen recipes work on them: ``nn.get_partition_spec`` (the names as mesh axes) or
    ``nn.logical_to_mesh_sharding`` under logical axis rules, and ``nn.scan`` over
    layers (``metadata_params={nn.PARTITION_NAME: ...}``; ``variable_axes`` naming
    "BalanceBias" and "ExpertLayout" as well as "params") puts the layer axis in front
    of the expert axis.
    """
    return _MoELinen(_bridged_moe, args=(config,), kwargs=FrozenDict(axes=axes),
                     metadata_fn=_linen_box, name=name)


class _MoELinen(bridge.ToLinen):
    """``bridge.ToLinen`` of a ``MoE`` that refuses an ``apply`` missing the selection
    bias's collection (the bridge would build the layer with a zero bias and route
    with it, silently)."""

    def __call__(self, *args, **kwargs):
        config = self.args[0]
        if (not self.is_initializing() and config.holds_selection_bias
                and not self.has_variable("BalanceBias", "router")):
            raise ValueError(
                f"moe_linen {self.name!r}: the variables given to apply have no "
                "'BalanceBias' collection, which holds this layer's selection bias "
                "(MoEConfig.selection_bias / bias_update_rate); pass every collection "
                "init returned (model.apply(variables, x)), and under nn.scan name it in "
                "variable_axes as well as 'params'")
        return super().__call__(*args, **kwargs)


def _bridged_moe(config: MoEConfig, *, rngs: nnx.Rngs, **kwargs) -> MoE:
    """``MoE`` built by ``moe_linen``'s bridge, its stream "default" renamed "params": at
    every ``apply`` the bridge adds a "default" seeded 0 where the Linen RNGs have
    none (for the initialisers, whose values the Linen variables then replace), so
    jitter drawn from it would repeat the same noise at every step instead of raising
    ``jitter_stream``'s error when no "jitter"/"dropout" RNG was given."""
    streams = {name: stream() for name, stream in rngs.items()}
    if "default" in streams:
        streams.setdefault("params", streams.pop("default"))
    return MoE(config, rngs=nnx.Rngs(**streams), **kwargs)


def _linen_box(variable: nnx.Variable):
    """The Linen metadata box of a bridged ``MoE`` variable: ``nn.LogicallyPartitioned``
    with its sharding names where it has them (Flax's default box, ``NNXMeta``, keeps
    the unstacked spec under ``nn.scan``), Flax's default box otherwise."""
    names = variable.get_metadata().get("out_sharding")
    if names is None:
        return bridge.variables.to_linen_var(variable)
    return nn.LogicallyPartitioned(variable.get_value(), names=tuple(names))
