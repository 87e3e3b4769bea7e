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
pick its expert-parallel axis.
"""

from __future__ import annotations

import dataclasses
from collections.abc import Callable, Sequence

import jax
from flax import nnx
from flax.core import spmd as flax_spmd

EXPERT_AXIS = "expert"
DATA_AXIS = "data"
ROLES = ("expert", "embed", "mlp")

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
        for field in ("expert", "embed", "mlp", "batch"):
            value = getattr(self, field)
            if isinstance(value, list):
                value = tuple(value)
                object.__setattr__(self, field, value)  # hashable, as a static attribute
            if not (value is None or isinstance(value, str | tuple)) or not all(
                    isinstance(n, str) and n for n in as_names(value)):
                raise ValueError(f"MoEAxes.{field}={value!r}: give None, an axis name or a "
                                 "tuple of axis names")
        used = [n for role in ROLES for n in as_names(getattr(self, role))]
        if len(used) != len(set(used)):
            raise ValueError(
                f"MoEAxes(expert={self.expert!r}, embed={self.embed!r}, mlp={self.mlp!r}) "
                "names one axis for two dimensions of a weight; a mesh axis can split "
                "each weight once: give each role its own axis (or None)")

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


def sharded_param(
    field: str,
    init: Callable[..., jax.Array],
    rngs: nnx.Rngs,
    shape: tuple[int, ...],
    dtype,
    axes: MoEAxes,
) -> nnx.Param:
    """An ``nnx.Param`` for ``MoEParams`` field ``field``, initialised by ``init`` and
    annotated with ``axes.param_spec(field)``.

    The annotation is metadata only (no eager placement), so a module builds the same
    way on one device or under a mesh; ``nnx.get_partition_spec`` reads it back.
    """
    spec = axes.param_spec(field)
    if len(spec) != len(shape):
        raise ValueError(f"PARAM_DIMS[{field!r}]={PARAM_DIMS[field]} does not match shape "
                         f"{shape}")
    value = nnx.with_partitioning(init, spec)(rngs.params(), shape, dtype)
    return nnx.Param(value, eager_sharding=False)


def param_partition_specs(module: nnx.Module) -> dict:
    """Nested dict (module attribute paths) of the ``PartitionSpec`` of every parameter."""
    return nnx.to_pure_dict(nnx.get_partition_spec(nnx.state(module, nnx.Param)))
