"""Planner: deterministic host code (NumPy + networkx) that turns a cluster topology
into expert-parallel groups, expert placements and all-to-all schedules before jit.

Public names: Topology (presets perlmutter, dgx_h100, heterogeneous_mix, and uniform,
two_level for custom clusters), Workload, lysi_group, lysi_assign, replicate_experts,
aurora (module), lancet (module), ModelSpec, Plan, make_plan, baseline_groups,
simulate, SimResult.
"""

from aristax.planner import aurora, lancet
from aristax.planner.lysi import Assignment, Workload, lysi_assign, lysi_group
from aristax.planner.plan import ModelSpec, Plan, baseline_groups, make_plan
from aristax.planner.simulate import SimResult, simulate
from aristax.planner.replication import Replication, replicate_experts
from aristax.planner.topology import (Topology, dgx_h100, heterogeneous_mix, perlmutter,
                                      two_level, uniform)

__all__ = [
    "Assignment",
    "ModelSpec",
    "Plan",
    "SimResult",
    "baseline_groups",
    "make_plan",
    "simulate",
    "Replication",
    "Topology",
    "Workload",
    "aurora",
    "lancet",
    "dgx_h100",
    "heterogeneous_mix",
    "lysi_assign",
    "lysi_group",
    "perlmutter",
    "replicate_experts",
    "two_level",
    "uniform",
]
