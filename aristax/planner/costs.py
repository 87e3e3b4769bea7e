"""The cost terms of one group's MoE layer that the planner and its simulator share:
expected dispatch bytes and alpha-beta message times of the all-to-all, expert GEMM
seconds per device, and the forward ops of one MoE block for Lancet.

Aristos eq. 4's terms with the plan's actual placement (see
:mod:`~aristax.planner.simulate`). ``slots[w]`` lists the logical experts in the
slots of the w-th device of ``group`` (global device ids).
"""

from __future__ import annotations

from typing import Sequence

import numpy as np

from aristax.planner import lancet
from aristax.planner.spec import ModelSpec
from aristax.planner.topology import Topology

ATTENTION_FLOPS_PER_TOKEN = 8.0  # x D^2: Q, K, V, O projections, 2 FLOPs per MAC


def dispatch_bytes(slots: Sequence[Sequence[int]], model: ModelSpec) -> np.ndarray:
    """[n, n] expected bytes device i sends device j in one dispatch all-to-all.

    d_ij = T K D bytes * sum_e p_e r_ej / c_e, where r_ej = slots of expert e on j and
    c_e = its slots in the group (tokens split evenly over replicas). Diagonal = local.
    """
    n = len(slots)
    p = model.shares()
    count = np.zeros(model.num_experts)
    on = np.zeros((model.num_experts, n))
    for j, xs in enumerate(slots):
        for x in xs:
            on[x, j] += 1
            count[x] += 1
    if np.any(count == 0):
        raise ValueError("slots must hold every expert at least once.")
    recv_share = (p[:, None] * on / count[:, None]).sum(0)  # [n]
    per_dev = float(model.tokens_per_device * model.top_k * model.d_model * model.bytes_per_element)
    return np.tile(per_dev * recv_share, (n, 1))


def link_times(nbytes: np.ndarray, group: Sequence[int], topology: Topology) -> np.ndarray:
    """[n, n] t_ij = alpha_ij + nbytes_ij beta_ij for nbytes_ij > 0 (0 otherwise, and on
    the diagonal): the alpha-beta time of each message (Aristos Table 1)."""
    g = list(group)
    a, b = topology.alpha[np.ix_(g, g)], topology.beta[np.ix_(g, g)]
    t = np.where(nbytes > 0, a + nbytes * b, 0.0)
    np.fill_diagonal(t, 0.0)
    return t


def dispatch_times(slots, group, topology: Topology, model: ModelSpec) -> np.ndarray:
    """[n, n] seconds per message of the dispatch all-to-all of ``group``."""
    return link_times(dispatch_bytes(slots, model), group, topology)


def expert_compute(slots, group, topology: Topology, model: ModelSpec) -> np.ndarray:
    """[n] seconds of expert GEMMs per device: sum_{e on w} |g| T K p_e / c_e * f / F_w."""
    p = model.shares()
    count = np.zeros(model.num_experts)
    for xs in slots:
        for x in xs:
            count[x] += 1
    rows = len(group) * model.tokens_per_device * model.top_k
    f = model.workload().token_flops
    work = np.array([sum(rows * p[x] / count[x] for x in xs) * f for xs in slots])
    return work / topology.flops[list(group)]


def block_ops(compute: np.ndarray, dispatch: float, combine: float, group, topology: Topology,
              model: ModelSpec) -> list[lancet.Op]:
    """Forward of one MoE block for Lancet 5.1: attention projections (8 D^2 per token),
    gate (2 D E per token), dispatch, experts, combine; compute on the slowest device."""
    f_min = float(topology.flops[list(group)].min())
    t, d = model.tokens_per_device, model.d_model
    return [
        lancet.Op("attention", compute=t * ATTENTION_FLOPS_PER_TOKEN * d * d / f_min),
        lancet.Op("gate", compute=t * 2.0 * d * model.num_experts / f_min,
                  partitionable=model.router_partitionable),
        lancet.Op("dispatch", a2a=dispatch),
        lancet.Op("experts", compute=float(np.max(compute))),
        lancet.Op("combine", a2a=combine),
    ]
