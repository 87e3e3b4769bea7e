"""LysiGroup and LysiAssign (Aristos section 2, Algorithms 1-2; Lysi notes Algorithms 2-3).

``lysi_group`` partitions devices into expert-parallel groups, each holding every
expert, by a Kruskal-like pass over the alpha-beta graph that merges two groups only
when a policy accepts the merge under the cost T(g) of Aristos eqs. 1-4.
``lysi_assign`` spreads experts over the workers of one group, best fit within a
budget proportional to FLOP/s, respecting memory (Aristos Alg. 2, eqs. 5-9).

Decisions where the seeds are vague (each is tested in tests/planner/test_lysi.py):

- **gamma's effective world size** (eq. 1): omega = W, the whole cluster. Every device
  runs the MoE layer on its own micro-batch of b samples, so the number of layer
  executions per iteration, (2+r) L B / (i W b), does not depend on the grouping. The
  grouping changes what one execution costs: the compute term is the group's expert
  FLOPs, sum_x f_x = |g| * tokens_per_device * top_k * flops_per_token (uniform
  routing), over the group's FLOP/s, so it only changes with heterogeneous devices.
  For inference gamma uses 1 pass instead of (2 + r), and T_rho = 0 (eq. 2).
- **edge weights for the sort** (Alg. 1 line 2): w_uv = max over both directions of
  alpha_uv + d * beta_uv, the time to move one worker's whole dispatch buffer d over
  that link (so bandwidth dominates for large buffers and latency for small ones);
  ties broken by (u, v) so the order, and the result, are deterministic.
- **the all-reduce term** (eq. 4): Rabenseifner's 2(n-1)(alpha* + d_ar beta*/n) over
  n = |G|, the current number of groups (a merge lowers it by one, so T_uv uses n-1
  and T_u, T_v use n). alpha*, beta* are the largest off-diagonal alpha and beta of
  the topology (the worst link, a constant, as in the notes' "max over a, b"), and
  d_ar defaults to the bytes of all expert parameters (Workload.allreduce_bytes).
- **infinite costs** (eq. 3), see :func:`merge_accepted`: two infeasible groups always
  merge (a group that cannot hold the experts can only become feasible by merging;
  this is the notes' "infinity always improvable"); with one infeasible side the
  feasible side must not get worse (T_uv <= T_v, strict for pareto), never by
  evaluating 0 * inf or 1 / inf.
- **leftovers**: an infeasible group left after the pass (at most one, since
  infeasible groups always merge) joins the feasible group whose union costs least.
"""

from __future__ import annotations

import bisect
import dataclasses
import math
from typing import Sequence

import networkx as nx
import numpy as np

from aristax.planner.topology import Topology

POLICIES = ("max_min_fair", "pareto")


# --------------------------------------------------------------------- workload
@dataclasses.dataclass(frozen=True)
class Workload:
    """What one MoE layer costs, in the symbols of Aristos eqs. 1-4.

    - num_experts: |X|.
    - tokens_per_device: tokens of one micro-batch on one device (b * sequence length).
    - d_model, d_ff: D and F; top_k: K.
    - bytes_per_element: of the activations sent in the all-to-all.
    - flops_per_token: FLOPs of one expert on one token (f_x per token); default
      6 D F (three D x F GEMMs of a SwiGLU expert, 2 FLOPs per multiply-add).
    - allreduce_bytes: d_ar of eq. 4; default: a device's share of the expert weights,
      3 D F |X| param_bytes / |g| (see :meth:`ar_bytes`).
    - num_layers L, moe_every i, global_batch B, micro_batch b, recompute r: eq. 1.
      global_batch=None means one micro-batch per device per iteration (B = W b).
    - eta: messages per edge per layer execution (eq. 4's eta); 2 = dispatch + combine.
    - training: False gives inference (one pass, T_rho = 0).

    The all-to-all buffer of eq. 4 is d = tokens_per_device * top_k * d_model * bytes.
    """

    num_experts: int
    tokens_per_device: int = 4096
    d_model: int = 1024
    d_ff: int = 4096
    top_k: int = 1
    bytes_per_element: int = 2
    flops_per_token: float | None = None
    allreduce_bytes: float | None = None
    param_bytes: int = 2
    num_layers: int = 24
    moe_every: int = 2
    global_batch: int | None = None
    micro_batch: int = 1
    recompute: float = 0.0
    eta: float = 2.0
    training: bool = True

    def __post_init__(self) -> None:
        for name in ("num_experts", "tokens_per_device", "d_model", "d_ff", "top_k",
                     "bytes_per_element", "param_bytes", "num_layers", "moe_every", "micro_batch"):
            value = getattr(self, name)
            if isinstance(value, bool) or not isinstance(value, (int, np.integer)) or value < 1:
                raise ValueError(f"Workload.{name} must be a positive integer, got {value!r}.")
        if not isinstance(self.training, (bool, np.bool_)):
            raise ValueError(f"Workload.training must be True or False, got {self.training!r}.")
        if not (self.recompute >= 0 and self.eta > 0 and np.isfinite([self.recompute, self.eta]).all()):
            raise ValueError(f"Workload.recompute must be finite and >= 0 and Workload.eta finite "
                             f"and > 0, got recompute={self.recompute!r}, eta={self.eta!r}.")
        if self.global_batch is not None and (not isinstance(self.global_batch, (int, np.integer))
                                              or self.global_batch < 1):
            raise ValueError(f"Workload.global_batch must be a positive integer or None "
                             f"(one micro-batch per device), got {self.global_batch!r}.")
        f, ar = self.flops_per_token, self.allreduce_bytes
        if f is not None and not (np.isfinite(f) and f > 0):
            raise ValueError(f"Workload.flops_per_token must be finite and > 0, or None "
                             f"(6 d_model d_ff), got {f!r}.")
        if ar is not None and not (np.isfinite(ar) and ar >= 0):
            raise ValueError(f"Workload.allreduce_bytes must be finite and >= 0, or None "
                             f"(the device's share of the expert weights), got {ar!r}.")

    @property
    def a2a_bytes(self) -> float:
        """d of eq. 4: bytes one worker dispatches per layer execution."""
        return float(self.tokens_per_device * self.top_k * self.d_model * self.bytes_per_element)

    @property
    def token_flops(self) -> float:
        return float(self.flops_per_token if self.flops_per_token is not None
                     else 6.0 * self.d_model * self.d_ff)

    @property
    def device_expert_flops(self) -> float:
        """Expert FLOPs one device's micro-batch causes: tokens * K * flops_per_token."""
        return self.tokens_per_device * self.top_k * self.token_flops

    def ar_bytes(self, group_size: int) -> float:
        """d_ar of eq. 4 for a device of a group of ``group_size`` devices.

        ``allreduce_bytes`` if given (the paper's constant), else the device's share of
        the expert weights: 3 D F |X| param_bytes / group_size (the experts are spread
        over the group, and each device all-reduces the gradients of its own experts).
        """
        if self.allreduce_bytes is not None:
            return float(self.allreduce_bytes)
        return 3.0 * self.d_model * self.d_ff * self.num_experts * self.param_bytes / group_size

    def gamma(self, world: int) -> float:
        """Aristos eq. 1 with omega = world: (2 + r) L B / (i omega b); 1 pass for inference."""
        passes = (2.0 + self.recompute) if self.training else 1.0
        batch = self.global_batch if self.global_batch is not None else world * self.micro_batch
        return passes * self.num_layers * batch / (self.moe_every * world * self.micro_batch)


# ------------------------------------------------------------------- cost model
def allreduce_time(num_groups: int, group_size: int, topology: Topology, workload: Workload,
                   worst_link: tuple[float, float] | None = None) -> float:
    """T_rho(|G|) of eq. 4: 2(n-1)(alpha* + d_ar beta*/n) for n = num_groups.

    Rabenseifner's all-reduce bound; 0 for inference or n = 1. d_ar is
    ``workload.ar_bytes(group_size)``; ``worst_link`` = (alpha*, beta*) when known.
    """
    if not workload.training or num_groups <= 1:
        return 0.0
    a_star, b_star = worst_link if worst_link is not None else _worst_link(topology)
    n = float(num_groups)
    return 2.0 * (n - 1.0) * (a_star + workload.ar_bytes(group_size) * b_star / n)


def _worst_link(topology: Topology) -> tuple[float, float]:
    """(alpha*, beta*): the largest off-diagonal alpha and beta of the topology."""
    v = topology.num_devices
    if v == 1:
        return 0.0, 0.0
    off = ~np.eye(v, dtype=bool)
    return float(topology.alpha[off].max()), float(topology.beta[off].max())


def local_cost(group: Sequence[int], topology: Topology, workload: Workload) -> float:
    """gamma(W) (pi(g) + max_i C_i) of eq. 4, or inf when sum_j m_j < |X| (eq. 3).

    pi(g) = |g| tokens K f / sum_{j in g} F_j;
    C_i = sum_{j in g, j != i} eta (alpha_ij + d/|g| beta_ij).
    Computed from scratch: the reference the incremental search is tested against.
    """
    g = np.asarray(sorted(group), dtype=np.int64)
    if topology.expert_capacity[g].sum() < workload.num_experts:
        return math.inf
    n = len(g)
    compute = n * workload.device_expert_flops / topology.flops[g].sum()
    a = topology.alpha[np.ix_(g, g)].copy()
    b = topology.beta[np.ix_(g, g)].copy()
    np.fill_diagonal(a, 0.0)
    np.fill_diagonal(b, 0.0)
    comm = workload.eta * float((a.sum(1) + workload.a2a_bytes / n * b.sum(1)).max())
    return workload.gamma(topology.num_devices) * (compute + comm)


def group_cost(group: Sequence[int], num_groups: int, topology: Topology, workload: Workload) -> float:
    """T(g) of Aristos eqs. 3-4 when the partition has ``num_groups`` groups."""
    t = local_cost(group, topology, workload)
    return t if math.isinf(t) else t + allreduce_time(num_groups, len(group), topology, workload)


def merge_accepted(policy: str, t_u: float, t_v: float, t_uv: float) -> bool:
    """Does ``policy`` merge g_u and g_v, given T_u, T_v and T_uv = T(g_u U g_v)?

    - "max_min_fair" (Aristos Proposition 1): T_uv (1/T_u + 1/T_v) <= 2, i.e. the
      relative gains r_u + r_v >= 0.
    - "pareto" (Lysi notes, Alg. 2 line 10): T_uv < T_u and T_uv < T_v.
    Infinite costs, explicitly (never 0 * inf or 1 / inf):
    - both infinite: merge, whatever T_uv (memory can only be gained by merging, and
      Kruskal order makes this the cheapest link; the notes' "infinity always
      improvable").
    - exactly one infinite: merge iff the feasible side does not get worse,
      T_uv <= T_fin (max-min fair) or T_uv < T_fin (pareto). The limit of Prop. 1 as
      T_inf -> inf would be T_uv <= 2 T_fin (the infeasible side's relative gain
      tends to 1), but that gain is not a reason to prefer *this* merge: any merge
      that makes the group feasible earns it. The limit form lets one feasible group
      absorb every infeasible node (Perlmutter 256x4, 256 experts: one 1024-GPU group
      at max_g T = 1.51 s instead of 20-24-GPU groups at 0.097 s; test_lysi.py).
      An infeasible group left at the end joins the cheapest union (lysi_group).
    - T_uv = inf with a feasible side cannot happen (memory only grows); rejected.
    """
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    inf_u, inf_v = math.isinf(t_u), math.isinf(t_v)
    if inf_u and inf_v:
        return True
    if math.isinf(t_uv):
        return False
    if inf_u or inf_v:
        t_fin = t_v if inf_u else t_u
        return t_uv <= t_fin if policy == "max_min_fair" else t_uv < t_fin
    if policy == "max_min_fair":
        return t_uv * (t_u + t_v) <= 2.0 * t_u * t_v  # eq. of Prop. 1 times T_u T_v > 0
    return t_uv < t_u and t_uv < t_v


def merge_accepted_array(policy: str, t_u: np.ndarray, t_v: np.ndarray, t_uv: np.ndarray) -> np.ndarray:
    """Elementwise :func:`merge_accepted` (same explicit infinity cases), for batches."""
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    t_u, t_v, t_uv = (np.asarray(x, dtype=np.float64) for x in (t_u, t_v, t_uv))
    inf_u, inf_v, inf_uv = np.isinf(t_u), np.isinf(t_v), np.isinf(t_uv)
    both = inf_u & inf_v
    one = inf_u ^ inf_v
    fin = ~inf_u & ~inf_v & ~inf_uv
    t_fin = np.where(inf_u, t_v, t_u)
    with np.errstate(invalid="ignore", over="ignore"):
        if policy == "max_min_fair":
            one_ok = t_uv <= t_fin
            fin_ok = t_uv * (t_u + t_v) <= 2.0 * t_u * t_v
        else:
            one_ok = t_uv < t_fin
            fin_ok = (t_uv < t_u) & (t_uv < t_v)
    return both | (one & ~inf_uv & one_ok) | (fin & fin_ok)


def edge_order(topology: Topology, workload: Workload) -> tuple[np.ndarray, np.ndarray, np.ndarray]:
    """Edges (u < v) sorted ascending by w_uv = max(alpha + d beta) over both directions.

    Returns (u[E], v[E], w[E]); ties broken by u then v (deterministic).
    """
    v = topology.num_devices
    w = topology.alpha + workload.a2a_bytes * topology.beta
    w = np.maximum(w, w.T)
    iu, iv = np.triu_indices(v, k=1)
    weights = w[iu, iv]
    order = np.lexsort((iv, iu, weights))
    return iu[order], iv[order], weights[order]


# ------------------------------------------------------------------- LysiGroup
class _Search:
    """Incremental state of LysiGroup, in arrays indexed by group id (< 2V).

    Each device belongs to one live group, so the per-worker sums of eq. 4 live in
    per-device arrays a_dev[i] = sum_{j in g(i)} alpha_ij (b_dev for beta), updated
    on each union; members[gid, :size[gid]] lists a group's devices, so candidate
    unions of equal-size pairs are costed in one stacked numpy expression.
    """

    def __init__(self, topology: Topology, workload: Workload):
        v = topology.num_devices
        self.top, self.wl = topology, workload
        self.alpha = topology.alpha.copy()
        self.beta = topology.beta.copy()
        np.fill_diagonal(self.alpha, 0.0)
        np.fill_diagonal(self.beta, 0.0)
        self.gamma = workload.gamma(v)
        self.d = workload.a2a_bytes
        self.worst = _worst_link(topology)
        self.a_dev = np.zeros(v)
        self.b_dev = np.zeros(v)
        self.members = np.full((2 * v, v), -1, dtype=np.int64)
        self.members[:v, 0] = np.arange(v)
        self.size = np.zeros(2 * v, dtype=np.int64)
        self.size[:v] = 1
        self.cap = np.zeros(2 * v, dtype=np.int64)
        self.cap[:v] = topology.expert_capacity
        self.flops = np.zeros(2 * v)
        self.flops[:v] = topology.flops
        self.local = np.full(2 * v, math.inf)
        self.live: set[int] = set(range(v))
        self.next_id = v
        for i in range(v):
            self.local[i] = self._local(i)

    def group(self, gid: int) -> np.ndarray:
        return self.members[gid, : self.size[gid]]

    def _local(self, gid: int) -> float:
        if self.cap[gid] < self.wl.num_experts:
            return math.inf
        m, n = self.group(gid), int(self.size[gid])
        compute = n * self.wl.device_expert_flops / self.flops[gid]
        comm = self.wl.eta * float((self.a_dev[m] + self.d / n * self.b_dev[m]).max())
        return self.gamma * (compute + comm)

    def total(self, local: np.ndarray, num_groups: int, sizes: np.ndarray) -> np.ndarray:
        """T = local + T_rho(num_groups) per entry; infeasible entries stay inf."""
        ar = np.array([allreduce_time(num_groups, int(s), self.top, self.wl, self.worst)
                       for s in sizes.tolist()]) if len(sizes) else np.zeros(0)
        return local + ar

    def union(self, gu: int, gv: int) -> int:
        """Merge two live groups (updates the per-device sums); returns the new id."""
        mu, mv = self.group(gu), self.group(gv)
        self.a_dev[mu] += self.alpha[mu[:, None], mv].sum(1)
        self.b_dev[mu] += self.beta[mu[:, None], mv].sum(1)
        self.a_dev[mv] += self.alpha[mv[:, None], mu].sum(1)
        self.b_dev[mv] += self.beta[mv[:, None], mu].sum(1)
        new = self.next_id
        self.next_id += 1
        n = len(mu) + len(mv)
        self.members[new, :n] = np.sort(np.concatenate([mu, mv]))
        self.size[new] = n
        self.cap[new] = self.cap[gu] + self.cap[gv]
        self.flops[new] = self.flops[gu] + self.flops[gv]
        self.local[new] = self._local(new)
        self.live -= {gu, gv}
        self.live.add(new)
        return new

    def merged_local(self, lo: np.ndarray, hi: np.ndarray) -> np.ndarray:
        """Local cost of g_lo[k] U g_hi[k] for live pairs; pairs of equal sizes stacked."""
        out = np.full(len(lo), math.inf)
        ok = np.flatnonzero(self.cap[lo] + self.cap[hi] >= self.wl.num_experts)
        if ok.size == 0:
            return out
        su, sv = self.size[lo[ok]], self.size[hi[ok]]
        key = su * (len(self.size) + 1) + sv
        for k in np.unique(key).tolist():
            sel = ok[key == k]
            a, b = lo[sel], hi[sel]
            nu, nv = int(self.size[a[0]]), int(self.size[b[0]])
            mu, mv = self.members[a, :nu], self.members[b, :nv]  # [K, nu], [K, nv]
            d_n = self.d / (nu + nv)
            a_uv = self.alpha[mu[:, :, None], mv[:, None, :]]  # [K, nu, nv]
            b_uv = self.beta[mu[:, :, None], mv[:, None, :]]
            if self.top.symmetric:
                a_vu_sum, b_vu_sum = a_uv.sum(1), b_uv.sum(1)
            else:
                a_vu_sum = self.alpha[mv[:, :, None], mu[:, None, :]].sum(2)
                b_vu_sum = self.beta[mv[:, :, None], mu[:, None, :]].sum(2)
            c_u = self.a_dev[mu] + a_uv.sum(2) + d_n * (self.b_dev[mu] + b_uv.sum(2))
            c_v = self.a_dev[mv] + a_vu_sum + d_n * (self.b_dev[mv] + b_vu_sum)
            comm = self.wl.eta * np.maximum(c_u.max(1), c_v.max(1))
            compute = (nu + nv) * self.wl.device_expert_flops / (self.flops[a] + self.flops[b])
            out[sel] = self.gamma * (compute + comm)
        return out


def _check_group_args(topology: Topology, workload: Workload, policy: str, chunk) -> None:
    if policy not in POLICIES:
        raise ValueError(f"policy must be one of {POLICIES}, got {policy!r}.")
    if not isinstance(chunk, (int, np.integer)) or chunk < 1:
        raise ValueError(f"chunk (edges scanned per batch) must be a positive integer, got {chunk!r}.")
    total_cap = int(topology.expert_capacity.sum())
    if total_cap < workload.num_experts:
        raise ValueError(
            f"the cluster holds {total_cap} experts in total (sum of expert_capacity) but "
            f"workload.num_experts = {workload.num_experts}; add devices or raise expert_capacity."
        )


def _first_accepted(st: _Search, p_lo: np.ndarray, p_hi: np.ndarray, policy: str) -> int:
    """Index k of the first live group pair (p_lo[k], p_hi[k]) whose merge
    :func:`merge_accepted_array` accepts, -1 when none. Pairs are costed in growing
    stacked batches (1, 4, 16, ...): cheap when an early pair merges."""
    n = len(st.live)
    start, batch = 0, 1
    while start < len(p_lo):
        stop = min(start + batch, len(p_lo))
        b_lo, b_hi = p_lo[start:stop], p_hi[start:stop]
        s_u, s_v = st.size[b_lo], st.size[b_hi]
        t_u = st.total(st.local[b_lo], n, s_u)
        t_v = st.total(st.local[b_hi], n, s_v)
        t_uv = st.total(st.merged_local(b_lo, b_hi), n - 1, s_u + s_v)
        ok = np.flatnonzero(merge_accepted_array(policy, t_u, t_v, t_uv))
        if ok.size:
            return start + int(ok[0])
        start, batch = stop, batch * 4
    return -1


def _scan_edges(st: _Search, uf, gid: np.ndarray, eu: np.ndarray, ev: np.ndarray, pos: int,
                end: int, policy: str) -> int:
    """Scans edges [pos, end) of the Kruskal order (device pairs eu[k], ev[k]), skipping
    intra-group edges and repeated group pairs, and merges the groups of the first edge
    accepted (updating ``st``, the union-find ``uf`` and ``gid``, the live group id of
    each device). Returns where the scan resumes: just past that edge, else ``end``."""
    gu, gv = gid[eu[pos:end]], gid[ev[pos:end]]
    idx = np.flatnonzero(gu != gv)
    if idx.size == 0:
        return end
    lo, hi = np.minimum(gu[idx], gv[idx]), np.maximum(gu[idx], gv[idx])
    _, first = np.unique(lo * (2 * len(gid) + 1) + hi, return_index=True)
    first = np.sort(first)
    k = _first_accepted(st, lo[first], hi[first], policy)
    if k < 0:
        return end
    new = st.union(int(lo[first[k]]), int(hi[first[k]]))
    gid[st.group(new)] = new
    edge = pos + int(idx[first[k]])
    uf.union(int(eu[edge]), int(ev[edge]))
    return edge + 1


def _join_infeasible(st: _Search, uf) -> None:
    """Each group left that cannot hold every expert joins the group whose union is
    cheapest (first by smallest device on ties), smallest-device group first."""
    while True:
        bad = sorted((g for g in st.live if math.isinf(st.local[g])), key=lambda g: st.group(g)[0])
        if not bad:
            return
        a = bad[0]
        others = np.array(sorted((g for g in st.live if g != a), key=lambda g: st.group(g)[0]))
        lo, hi = np.minimum(others, a), np.maximum(others, a)
        b = int(others[int(np.argmin(st.merged_local(lo, hi)))])  # argmin: first (smallest device) on ties
        uf.union(int(st.group(a)[0]), int(st.group(b)[0]))
        st.union(a, b)


def lysi_group(
    topology: Topology,
    workload: Workload,
    *,
    policy: str = "max_min_fair",
    chunk: int = 4096,
) -> list[list[int]]:
    """LysiGroup (Aristos Alg. 1; Lysi notes Alg. 2): expert-parallel groups.

    Kruskal over edges sorted by :func:`edge_order`, with networkx's UnionFind; groups
    g_u != g_v merge when :func:`merge_accepted` says so for T of eqs. 3-4
    (:func:`group_cost`). Returns groups as sorted device-id lists, ordered by their
    smallest device; every group holds all experts (sum of expert_capacity >= |X|).

    Speed: per-worker alpha/beta sums are updated incrementally on each union, and
    edges are scanned in numpy chunks that skip intra-group edges and repeated group
    pairs, costing the candidate pairs in growing stacked batches (exactly equivalent
    to the edge-by-edge loop, since nothing changes between two unions).
    Raises ValueError when the whole cluster cannot hold num_experts.
    """
    _check_group_args(topology, workload, policy, chunk)
    st = _Search(topology, workload)
    uf = nx.utils.UnionFind(range(topology.num_devices))
    gid = np.arange(topology.num_devices, dtype=np.int64)  # live group id of each device
    eu, ev, _ = edge_order(topology, workload)
    pos = 0
    while pos < len(eu) and len(st.live) > 1:
        pos = _scan_edges(st, uf, gid, eu, ev, pos, min(pos + chunk, len(eu)), policy)
    _join_infeasible(st, uf)  # an infeasible group left over joins the cheapest union
    result = sorted(sorted(int(x) for x in s) for s in uf.to_sets())
    expected = sorted(st.group(g).tolist() for g in st.live)
    assert result == expected, "union-find and group table disagree"
    return result


def partition_cost(groups: Sequence[Sequence[int]], topology: Topology, workload: Workload) -> float:
    """max_g T(g) over a partition (the objective eq. 2 asks to minimise for every g)."""
    return max(group_cost(g, len(groups), topology, workload) for g in groups)


# ------------------------------------------------------------------ LysiAssign
@dataclasses.dataclass(frozen=True)
class Assignment:
    """Result of :func:`lysi_assign`.

    experts[w]: expert ids on worker w (input worker order); load[w]: sum of their
    costs; makespan = max_w load[w] / flops[w] (eq. 5); lower_bound =
    max(sum f / sum F, max f / max F) (no assignment can beat either).
    """

    experts: tuple[tuple[int, ...], ...]
    load: tuple[float, ...]
    makespan: float
    lower_bound: float

    def owner(self) -> dict[int, int]:
        return {x: w for w, xs in enumerate(self.experts) for x in xs}


def _improve_assignment(owner: np.ndarray, load: np.ndarray, mem: np.ndarray, f: np.ndarray,
                        c: np.ndarray, max_moves: int = 10_000) -> None:
    """Local search after Alg. 2, in place: while some move of one of the bottleneck
    worker's experts to a free slot, or swap with another worker's expert, brings both
    workers it touches below the bottleneck's finish time, apply the best such move.
    Memory is kept (a swap is slot-neutral); each move lowers the sorted vector of
    finish times, so the search ends. owner[X] worker ids; load, mem, f: [W]; c: [X].
    """
    for _ in range(max_moves):
        t = load / f
        h = int(np.argmax(t))
        xs = np.flatnonzero(owner == h)
        ys = np.flatnonzero(owner != h)
        free = np.flatnonzero((mem > 0) & (np.arange(f.size) != h))
        # candidates: (x, y) swaps and (x, worker p) moves; cost given away by h and taken by p
        p = np.concatenate([owner[ys], free])  # [Y + P]
        back = np.concatenate([c[ys], np.zeros(free.size)])  # what p gives to h
        delta = c[xs][:, None] - back[None, :]  # [Xh, Y + P]
        worst = np.maximum((load[h] - delta) / f[h], (load[p][None, :] + delta) / f[p][None, :])
        if worst.size == 0 or worst.min() >= t[h] * (1 - 1e-12):
            return
        i, j = np.unravel_index(np.argmin(worst), worst.shape)
        x, q = xs[i], p[j]
        load[h] -= delta[i, j]
        load[q] += delta[i, j]
        owner[x] = q
        if j < ys.size:
            owner[ys[j]] = h
        else:
            mem[q] -= 1
            mem[h] += 1


def lysi_assign(flops: Sequence[float], capacity: Sequence[int], expert_costs: Sequence[float], *,
                improve: bool = True) -> Assignment:
    """LysiAssign (Aristos Alg. 2; notes Alg. 3): best-fit round robin under memory.

    Shapes: flops[W] FLOP/s, capacity[W] experts that fit, expert_costs[X] FLOPs.
    1. Workers in descending FLOP/s (ties: lower index first); experts kept sorted by
       cost (the "binary search structure").
    2. First round (Alg. 2 lines 4-13): worker j gets budget F_j sum f / sum F (no
       ceiling: costs are real) and repeatedly takes BestFit = the largest remaining
       expert with cost <= remaining budget, while it has memory. **When no expert
       fits the remaining budget, the worker's turn ends** (no overshoot), so after
       the first round every worker is at or under its fair share sum f / sum F.
    3. Wrap-around (line 14): a worker stays in the rotation while it has memory left.
       Each leftover expert (larger than every remaining budget), largest first, goes
       to the worker in the rotation that finishes it earliest, (load_j + f_x) / F_j,
       ties to the earlier worker in the rotation (LPT on uniform machines).
    4. ``improve`` (not in Alg. 2; False gives the paper's result): a local search of
       moves and swaps that lower the makespan (:func:`_improve_assignment`). Alg. 2
       alone can be several times the optimum when memory binds: a fast worker with
       one slot takes a mid-size expert and the largest lands on a slow worker.
    Every expert is assigned exactly once; raises ValueError if sum(capacity) < X.
    """
    f = np.asarray(flops, dtype=np.float64)
    m = np.asarray(capacity)
    c = np.asarray(expert_costs, dtype=np.float64)
    if not (np.issubdtype(m.dtype, np.integer) or np.issubdtype(m.dtype, np.floating)):
        raise ValueError(f"capacity must hold one non-negative integer per worker, got {m!r}.")
    if f.ndim != 1 or f.size == 0 or np.any(~np.isfinite(f)) or np.any(f <= 0):
        raise ValueError("flops must be a non-empty 1-D array of positive FLOP/s, one per worker.")
    if m.shape != f.shape or np.any(m < 0) or np.any(m != np.round(m)):
        raise ValueError(f"capacity must hold one non-negative integer per worker ({f.size}), got {m!r}.")
    if c.ndim != 1 or np.any(~np.isfinite(c)) or np.any(c < 0):
        raise ValueError("expert_costs must be a 1-D array of non-negative finite FLOPs.")
    if int(m.sum()) < c.size:
        raise ValueError(
            f"the workers hold {int(m.sum())} experts (sum of capacity) but there are {c.size}; "
            "add workers or raise capacity."
        )
    workers = sorted(range(f.size), key=lambda j: (-f[j], j))
    mem = m.astype(np.int64).copy()
    load = np.zeros(f.size)
    assigned: list[list[int]] = [[] for _ in range(f.size)]
    # remaining experts sorted by (cost, id): bisect gives BestFit in O(log X)
    pool = sorted((float(c[x]), x) for x in range(c.size))
    total = float(c.sum())
    share = f / f.sum()
    for j in workers:
        budget = share[j] * total
        while mem[j] > 0 and pool:
            k = bisect.bisect_right(pool, (budget, math.inf)) - 1
            if k < 0:
                break  # nothing fits the remaining budget: the turn ends
            cost, x = pool.pop(k)
            assigned[j].append(x)
            load[j] += cost
            budget -= cost
            mem[j] -= 1
    rotation = [j for j in workers if mem[j] > 0]
    for cost, x in reversed(pool):
        j = min(rotation, key=lambda w: ((load[w] + cost) / f[w], rotation.index(w)))
        assigned[j].append(x)
        load[j] += cost
        mem[j] -= 1
        if mem[j] == 0:
            rotation.remove(j)
    owner = np.empty(c.size, dtype=np.int64)
    for j, xs in enumerate(assigned):
        owner[xs] = j
    if improve and c.size:
        _improve_assignment(owner, load, mem, f, c)
        load = np.bincount(owner, weights=c, minlength=f.size)  # exact sums, no drift
    makespan = float((load / f).max())
    lb = max(total / float(f.sum()), (float(c.max()) / float(f.max())) if c.size else 0.0)
    experts = tuple(tuple(np.flatnonzero(owner == j).tolist()) for j in range(f.size))
    return Assignment(experts, tuple(float(x) for x in load), makespan, lb)
