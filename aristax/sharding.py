"""Which mesh axes the MoE layer's arrays are split over, in one place.

Every parameter's dimensions have roles (``PARAM_DIMS``, keyed by ``MoEParams``
field): "expert" (E), "embed" (D), "mlp" (F, or the shared experts' Fs), or None
(never split: the router's E). ``MoEAxes`` names, for each role, the axis it is split
over -- a mesh axis, or a logical axis name that the Flax logical axis rules in effect
(``nnx.logical_axis_rules`` / ``nn.logical_axis_rules``; one store) map to mesh axes --
and, in ``batch``, the token axes. The default splits the experts over "expert" and
the tokens over "data" (the axes of ``aristax.parallel.mesh_from_plan``) and
replicates the rest.

The names are written into each parameter's sharding metadata (``sharded_param``,
through ``nnx.with_partitioning``, whose key has changed names across Flax versions),
so ``nnx.get_partition_spec`` (under the user's rules, if any) gives the layer's
specs; the layer resolves the same names on the active mesh (``MoEAxes.on_mesh``) to
pick its expert-parallel axis. ``DecoderAxes`` does the same for every weight of the
decoders of ``aristax.models`` (``DECODER_PARAM_DIMS``: vocab, embed, heads, kv_heads,
mlp), passing its expert, embed, mlp and batch names on to their MoE blocks.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd

EXPERT_AXIS = "expert"
DATA_AXIS = "data"

AxisNames = str | tuple[str, ...] | None

PARAM_DIMS: dict[str, tuple[str | None, ...]] = {
    "router_de": ("embed", None),
    "gate_edf": ("expert", "embed", "mlp"),
    "up_edf": ("expert", "embed", "mlp"),
    "down_efd": ("expert", "mlp", "embed"),
    "shared_gate_df": ("embed", "mlp"),
    "shared_up_df": ("embed", "mlp"),
    "shared_down_fd": ("mlp", "embed"),
    "router_bias_e": (None,),
    "gate_bias_ef": ("expert", "mlp"),
    "up_bias_ef": ("expert", "mlp"),
    "down_bias_ed": ("expert", "embed"),
    "shared_expert_gate_d": ("embed",),
}
# The fields indexed by expert (first dimension E, or a plan's slots): stored per
# expert, laid out and split with the experts.
EXPERT_FIELDS = tuple(name for name, dims in PARAM_DIMS.items() if dims[0] == "expert")


def as_names(names: AxisNames) -> tuple[str, ...]:
    """``names`` (None, a name or a tuple of names) as a tuple."""
    if names is None:
        return ()
    return (names,) if isinstance(names, str) else tuple(names)


def _check_axes(axes, fields: Sequence[str], weights: dict[str, tuple]) -> None:
    """Validate ``axes``' ``fields`` (None, a name or a tuple of names; a list becomes
    a tuple, so the dataclass stays hashable) and refuse a weight of ``weights`` (name
    -> the roles of its dimensions) that would be split twice over one axis."""
    kind = type(axes).__name__
    for field in fields:
        value = getattr(axes, field)
        if isinstance(value, list):
            value = tuple(value)
            object.__setattr__(axes, field, value)
        if not (value is None or isinstance(value, str | tuple)) or not all(
                isinstance(n, str) and n for n in as_names(value)):
            raise ValueError(f"{kind}.{field}={value!r}: give None, an axis name or a "
                             "tuple of axis names")
        if len(set(as_names(value))) != len(as_names(value)):
            raise ValueError(f"{kind}.{field}={value!r} names an axis twice; name each "
                             "axis once")
    for weight, dims in weights.items():
        roles = [r for r in dims if r is not None]
        used = [n for r in roles for n in as_names(getattr(axes, r))]
        if len(used) != len(set(used)):
            named = ", ".join(f"{r}={getattr(axes, r)!r}" for r in roles)
            raise ValueError(
                f"{kind}({named}) names one axis for two dimensions of the weight {weight} "
                f"{tuple(dims)}; a mesh axis can split each weight once: give each of "
                "these roles its own axis (or None)")


@dataclasses.dataclass(frozen=True)
class MoEAxes:
    """The axes a ``MoE`` layer splits its arrays over: each field None (replicated), a
    name, or a tuple of names taken together; a name is a mesh axis, or a logical
    axis that the Flax logical axis rules in effect map to mesh axes.

    Attributes:
      expert: E of the expert weights [E, D, F] / [E, F, D]; the layer runs expert
        parallel over it when the active mesh has it (default "expert").
      embed: D of every weight (e.g. an FSDP axis; default None).
      mlp: F and Fs, the expert and shared hidden dimensions (e.g. a tensor axis;
        default None).
      batch: the tokens' axes besides ``expert`` (default "data").

    ``MoEAxes(expert="fsdp")`` fits a ("fsdp", "tensor") mesh with experts split over
    "fsdp"; ``LOGICAL_AXES`` names the roles for logical axis rules such as
    ``[("expert", "fsdp"), ("embed", None), ("mlp", "tensor"), ("batch", "fsdp")]``.
    A mesh axis splits a weight once, so expert, embed and mlp name distinct axes.
    """

    expert: AxisNames = EXPERT_AXIS
    embed: AxisNames = None
    mlp: AxisNames = None
    batch: AxisNames = DATA_AXIS

    def __post_init__(self):
        _check_axes(self, ("expert", "embed", "mlp", "batch"), PARAM_DIMS)

    def param_spec(self, field: str) -> tuple[AxisNames, ...]:
        """The sharding names of ``MoEParams`` field ``field`` (``PARAM_DIMS``)."""
        return tuple(None if role is None else getattr(self, role) for role in PARAM_DIMS[field])

    def on_mesh(self, role: str, mesh_axes: Sequence[str]) -> tuple[str, ...]:
        """The mesh axes of ``mesh_axes`` that ``role`` ("expert", "embed", "mlp",
        "batch") stands for now: each name through the Flax logical axis rules in
        effect (its first rule), else itself; names the mesh lacks dropped."""
        rules: dict[str, AxisNames] = {}
        for logical, physical in flax_spmd.get_logical_axis_rules() or ():
            rules.setdefault(logical, physical)
        axes = [a for name in as_names(getattr(self, role))
                for a in as_names(rules.get(name, name))]
        return tuple(dict.fromkeys(a for a in axes if a in mesh_axes))


LOGICAL_AXES = MoEAxes(expert="expert", embed="embed", mlp="mlp", batch="batch")


# The decoder's weights outside its MoE blocks (``aristax.models.decoder``), by
# attribute name: the roles of their dimensions, as ``PARAM_DIMS`` gives the MoE's.
DECODER_PARAM_DIMS: dict[str, tuple[str | None, ...]] = {
    "embed_vd": ("vocab", "embed"),
    "lm_head_dv": ("embed", "vocab"),
    "norm_d": ("embed",),  # the layer and final RMSNorm weights
    "head_norm": (None,),  # Qwen3's per-head q/k RMSNorm weights [Dh]
    "q_dn": ("embed", "heads"),
    "k_dm": ("embed", "kv_heads"),
    "v_dm": ("embed", "kv_heads"),
    "o_nd": ("heads", "embed"),
    "q_bias_n": ("heads",),
    "k_bias_m": ("kv_heads",),
    "v_bias_m": ("kv_heads",),
    "o_bias_d": ("embed",),
    "gate_df": ("embed", "mlp"),  # a dense layer's MLP
    "up_df": ("embed", "mlp"),
    "down_fd": ("mlp", "embed"),
}


@dataclasses.dataclass(frozen=True)
class DecoderAxes:
    """The axes a decoder of ``aristax.models`` (``Mixtral``, ``Qwen3Moe``) splits its
    weights over, written into every parameter's sharding metadata as ``MoEAxes``
    does for the MoE blocks: each field None (replicated), a name, or a tuple of
    names taken together; a name is a mesh axis, or a logical axis that the Flax
    logical axis rules map to mesh axes.

    Attributes:
      vocab: V of the token embedding [V, D] and the LM head [D, V].
      embed: D of every weight (an FSDP axis), the MoE blocks' included.
      heads: H*Dh of the query and output projections [D, H*Dh] / [H*Dh, D].
      kv_heads: G*Dh of the key and value projections [D, G*Dh].
      mlp: F of the dense MLPs and of the experts.
      expert: E of the expert weights (default "expert"; see ``MoEAxes``).
      batch: the MoE blocks' token axes besides ``expert`` (default "data").

    The default replicates every weight but the experts, split over "expert" as a
    plain ``MoE``'s are. ``DecoderAxes(embed="fsdp", heads="tensor",
    kv_heads="tensor", mlp="tensor", vocab="tensor", expert=None)`` is FSDP with
    Megatron-style tensor parallelism on a ("fsdp", "tensor") mesh;
    ``LOGICAL_DECODER_AXES`` names each role for Flax logical axis rules. Roles that
    meet in one weight (``DECODER_PARAM_DIMS``, ``PARAM_DIMS``) name distinct axes.
    """

    vocab: AxisNames = None
    embed: AxisNames = None
    heads: AxisNames = None
    kv_heads: AxisNames = None
    mlp: AxisNames = None
    expert: AxisNames = EXPERT_AXIS
    batch: AxisNames = DATA_AXIS

    def __post_init__(self):
        _check_axes(self, [f.name for f in dataclasses.fields(self)],
                    {**DECODER_PARAM_DIMS, **PARAM_DIMS})

    def moe(self) -> MoEAxes:
        """The ``MoEAxes`` of the decoder's MoE blocks."""
        return MoEAxes(expert=self.expert, embed=self.embed, mlp=self.mlp, batch=self.batch)

    def param(self, name: str, value: jax.Array) -> nnx.Param:
        """An ``nnx.Param`` of ``value`` annotated with the names of the roles that
        ``DECODER_PARAM_DIMS[name]`` gives its dimensions."""
        return annotated_param(value, tuple(None if r is None else getattr(self, r)
                                            for r in DECODER_PARAM_DIMS[name]))


LOGICAL_DECODER_AXES = DecoderAxes(**{f.name: f.name for f in dataclasses.fields(DecoderAxes)})


def annotated_param(value: jax.Array, names: tuple[AxisNames, ...]) -> nnx.Param:
    """An ``nnx.Param`` of ``value`` with sharding metadata ``names`` (one entry per
    dimension). Metadata only, no eager placement: a module builds the same way on
    one device or under a mesh; ``nnx.get_partition_spec`` reads it back."""
    if len(names) != value.ndim:
        raise ValueError(f"sharding names {names} do not match shape {value.shape}")
    return nnx.Param(nnx.with_partitioning(lambda: value, names)(), eager_sharding=False)


def sharded_param(
    field: str,
    init: Callable[..., jax.Array],
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    dtype,
    axes: MoEAxes,
) -> nnx.Param:
    """An ``nnx.Param`` for ``MoEParams`` field ``field``, initialised by ``init`` and
    annotated with ``axes.param_spec(field)`` (``annotated_param``)."""
    return annotated_param(init(rngs.params(), shape, dtype), axes.param_spec(field))


def param_partition_specs(module: nnx.Module) -> dict:
    """Nested dict (module attribute paths) of the ``PartitionSpec`` of every parameter."""
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
