"""Aurora: all-to-all transmission order, GPU assignment and model colocation.

Li et al., "Optimizing Mixture-of-Experts Inference Time Combining Model Deployment
and Communication Scheduling" (the Aurora paper in ../shared/seeds):

- :func:`lower_bound` - Thm 4.2 / 5.2: the all-to-all cannot finish before the GPU
  with the most traffic (sent or received, over its bandwidth) is done.
- :func:`schedule_all_to_all` - the transmission order of Thm 4.2's proof: pad the
  traffic matrix to equal row/column sums (Appx. A step 1), then split it into
  contention-free rounds (partial permutations) by a Birkhoff-von Neumann
  decomposition with Hopcroft-Karp matchings (SciPy); the makespan equals
  :func:`lower_bound` for uniform bandwidth. ``max_rounds`` gives a bounded-rounds
  variant (non-preemptive, one round per colour of the traffic's bipartite graph).
- :func:`assign_experts` - Thm 5.1: most-loaded expert on the fastest GPU.
- :func:`colocate` - section 6.2 (Case I Thm 6.2 closed form, Case II bottleneck
  matching by binary search + Hopcroft-Karp) and section 7.2 (heterogeneous GPUs:
  two decoupled bottleneck matchings).
- :func:`inference_time` - one layer's time on the paper's timelines from traffic
  matrices and a placement; dispatches to :func:`inference_time_exclusive` (eq. 1-3)
  and :func:`inference_time_colocated` (Table 2, eq. 4).

Traffic matrices are [n, n] with d_ij = bytes (or tokens) GPU i sends to GPU j; the
diagonal is local and ignored (footnote 1 of section 4.2).

Heterogeneous bandwidth (Thm 5.2): with per-GPU bandwidth B_i a message i -> j runs at
min(B_i, B_j) (Appx. B eq. 14), so the schedule decomposes t_ij = d_ij / min(B_i, B_j)
and its makespan is max(row/column sums of t), which equals Thm 5.2's
max(sum_j d_ij / B_i, sum_i d_ij / B_j) when bandwidths are equal but can exceed it
otherwise: a GPU with B = 2 sending 1 unit to each of two B = 1 GPUs has Thm 5.2
bound 1, yet one-peer-at-a-time rounds need 2 (tested). The bound is only reached if
a fast sender may split its bandwidth over several receivers at once.
"""

from __future__ import annotations

import dataclasses
import itertools
from typing import Sequence

import numpy as np
from scipy.sparse import csr_array
from scipy.sparse.csgraph import maximum_bipartite_matching

_REL_TOL = 1e-12


# ------------------------------------------------------------------ validation
def _traffic(traffic, name: str = "traffic") -> np.ndarray:
    d = np.array(traffic, dtype=np.float64, copy=True)
    if d.ndim != 2 or d.shape[0] != d.shape[1]:
        raise ValueError(f"{name} must be a square [n, n] matrix, got shape {d.shape}.")
    if not np.all(np.isfinite(d)) or np.any(d < 0):
        raise ValueError(f"{name} must hold finite non-negative amounts.")
    np.fill_diagonal(d, 0.0)  # local traffic does not cross the network
    return d


def _bandwidth(bandwidth, n: int, name: str = "bandwidth") -> np.ndarray:
    if bandwidth is None:
        return np.ones(n)
    b = np.asarray(bandwidth, dtype=np.float64)
    if b.ndim == 0:
        b = np.full(n, float(b))
    if b.shape != (n,) or not np.all(np.isfinite(b)) or np.any(b <= 0):
        raise ValueError(f"{name} must be a positive scalar or one value per GPU ({n}).")
    return b


def _all_equal(u, v) -> bool:
    """u == v up to float rounding, whatever the units (no absolute tolerance)."""
    return bool(np.allclose(u, v, rtol=1e-12, atol=0.0))


def _time_matrix(d: np.ndarray, b: np.ndarray) -> np.ndarray:
    """t_ij = d_ij / min(B_i, B_j) (Appx. B eq. 14)."""
    return d / np.minimum(b[:, None], b[None, :])


# ----------------------------------------------------------------- lower bound
def lower_bound(traffic, bandwidth=None) -> float:
    """Minimum all-to-all time, Aurora Thm 4.2 / 5.2.

    traffic[n, n] (diagonal ignored); bandwidth None (= 1), a scalar B, or [n] per GPU.
    Returns max(max_i sum_j d_ij / B_i, max_j sum_i d_ij / B_j).
    """
    d = _traffic(traffic)
    b = _bandwidth(bandwidth, d.shape[0])
    if d.size == 0:
        return 0.0
    return float(max((d.sum(1) / b).max(), (d.sum(0) / b).max()))


# -------------------------------------------------------------------- schedule
@dataclasses.dataclass(frozen=True)
class Round:
    """One contention-free step: ``sends`` = ((src, dst, amount), ...), each src and
    each dst at most once; ``duration`` = its longest message time."""

    sends: tuple[tuple[int, int, float], ...]
    duration: float


@dataclasses.dataclass(frozen=True)
class Schedule:
    """All-to-all transmission order: rounds run one after another."""

    rounds: tuple[Round, ...]
    lower_bound: float

    @property
    def makespan(self) -> float:
        return float(sum(r.duration for r in self.rounds))

    @property
    def num_rounds(self) -> int:
        return len(self.rounds)

    def delivered(self, n: int) -> np.ndarray:
        """[n, n] amount sent per pair over all rounds (for checking)."""
        out = np.zeros((n, n))
        for r in self.rounds:
            for i, j, a in r.sends:
                out[i, j] += a
        return out

    def to_dict(self) -> dict:
        return {"lower_bound": self.lower_bound,
                "rounds": [{"duration": r.duration, "sends": [list(s) for s in r.sends]} for r in self.rounds]}

    @classmethod
    def from_dict(cls, d: dict) -> "Schedule":
        rounds = tuple(Round(tuple((int(i), int(j), float(a)) for i, j, a in r["sends"]), float(r["duration"]))
                       for r in d["rounds"])
        return cls(rounds, float(d["lower_bound"]))


def pad_to_doubly_balanced(t: np.ndarray) -> np.ndarray:
    """Aurora Appx. A step 1: D' = D + X, X >= 0, every row and column sum = b_max.

    X is filled greedily (north-west corner over the row and column deficits, whose
    totals are equal), which exhibits the non-negative X that the paper's Farkas
    argument only shows to exist. X may use the diagonal (it is artificial traffic).
    """
    n = t.shape[0]
    b_max = max(t.sum(1).max(), t.sum(0).max()) if n else 0.0
    row = b_max - t.sum(1)
    col = b_max - t.sum(0)
    x = np.zeros_like(t)
    i = j = 0
    while i < n and j < n:
        amount = min(row[i], col[j])
        x[i, j] += amount
        row[i] -= amount
        col[j] -= amount
        if row[i] <= col[j]:
            i += 1
        else:
            j += 1
    return t + x


def _perfect_matching(support: np.ndarray) -> dict[int, int] | None:
    """A perfect matching row -> column of the bipartite graph whose edges are the
    True entries of the square ``support`` (Hopcroft-Karp, SciPy's sparse graph
    routines), or None when it has none."""
    cols = maximum_bipartite_matching(csr_array(support), perm_type="column")
    return None if (cols < 0).any() else dict(enumerate(cols.tolist()))


def _bvn_rounds(t: np.ndarray, limit: int | None = None) -> list[Round] | None:
    """Birkhoff-von Neumann on the padded matrix; rounds carry only real traffic (times).
    None as soon as it takes more than ``limit`` rounds (None: no limit)."""
    n = t.shape[0]
    b_max = max(t.sum(1).max(), t.sum(0).max())
    tol = _REL_TOL * b_max * max(n, 1)
    dp = pad_to_doubly_balanced(t)
    real = t.copy()
    rounds = []
    while True:
        dp[dp <= tol] = 0.0
        if not dp.any():
            break
        perm = _perfect_matching(dp > 0)
        if perm is None:  # only float dust can be left (König: equal line sums)
            break
        rows = np.arange(n)
        cols = np.array([perm[i] for i in range(n)])
        delta = float(dp[rows, cols].min())
        dp[rows, cols] -= delta  # the argmin entry becomes exactly 0
        np.maximum(dp, 0.0, out=dp)
        sends = []
        for i, j in zip(rows.tolist(), cols.tolist()):
            amount = min(delta, real[i, j])
            if real[i, j] - amount <= tol:
                amount = real[i, j]  # snap: no float dust left behind
            if amount > tol and i != j:
                sends.append((i, j, amount))
                real[i, j] -= amount
        if sends:
            rounds.append(Round(tuple(sends), max(a for _, _, a in sends)))
            if limit is not None and len(rounds) > limit:
                return None
    # float dust that lost its matching: deliver it in extra greedy rounds
    leftover = [(i, j, real[i, j]) for i, j in zip(*np.nonzero(real > 0))]
    while leftover:
        used_s, used_r, sends, rest = set(), set(), [], []
        for i, j, a in leftover:
            if i in used_s or j in used_r:
                rest.append((i, j, a))
            else:
                used_s.add(i), used_r.add(j), sends.append((int(i), int(j), float(a)))
        rounds.append(Round(tuple(sends), max(a for _, _, a in sends)))
        leftover = rest
    return rounds


def _coloured_rounds(t: np.ndarray, max_rounds: int) -> list[Round]:
    """Non-preemptive rounds: one per colour of a Delta-edge-colouring of the support.

    Delta = the most peers one GPU talks to. The 0/1 support is padded to a
    Delta-regular integer matrix and peeled by Delta perfect matchings (the integer
    Birkhoff-von Neumann / Koenig edge-colouring argument), so every message is sent
    whole in exactly one round.
    """
    n = t.shape[0]
    s = (t > 0).astype(np.int64)
    delta = int(max(s.sum(1).max(), s.sum(0).max())) if n else 0
    if delta > max_rounds:
        raise ValueError(
            f"max_rounds={max_rounds} is below {delta}, the most peers one GPU sends to or "
            f"receives from; allow at least {delta} rounds."
        )
    m = pad_to_doubly_balanced(s.astype(np.float64)).round().astype(np.int64)
    pending = s.astype(bool)
    rounds = []
    for _ in range(delta):
        perm = _perfect_matching(m > 0)
        assert perm is not None
        sends = []
        for i, j in perm.items():
            m[i, j] -= 1
            if pending[i, j]:
                pending[i, j] = False
                sends.append((i, j, float(t[i, j])))
        if sends:
            rounds.append(Round(tuple(sends), max(a for _, _, a in sends)))
    assert not pending.any()
    return rounds


def schedule_all_to_all(traffic, bandwidth=None, *, max_rounds: int | None = None) -> Schedule:
    """Contention-free transmission order for one all-to-all (Aurora Thm 4.2, Alg. 1).

    traffic[n, n]: amount i sends to j (diagonal ignored); bandwidth: None, scalar or
    [n] (then message i->j runs at min(B_i, B_j), Appx. B). Each round is a partial
    permutation (every GPU sends to at most one GPU and receives from at most one);
    round amounts are in the units of ``traffic`` and durations in time.

    - default: Birkhoff-von Neumann on the padded matrix; makespan == lower_bound
      (uniform bandwidth), at most n^2 - 2n + 2 rounds; messages may be split.
    - ``max_rounds``: if the optimal decomposition needs more rounds, fall back to the
      non-preemptive colouring schedule with Delta <= n - 1 rounds (Delta = most
      peers of one GPU); its makespan can exceed the bound. ValueError below Delta.
    """
    d = _traffic(traffic)
    n = d.shape[0]
    b = _bandwidth(bandwidth, n)
    if max_rounds is not None and (isinstance(max_rounds, bool) or not isinstance(
            max_rounds, (int, np.integer)) or max_rounds < 1):
        raise ValueError(f"max_rounds must be an integer >= 1 or None, got {max_rounds!r}.")
    lb = lower_bound(d, b)
    if n == 0 or not d.any():
        return Schedule((), lb)
    t = _time_matrix(d, b)
    scale = np.minimum(b[:, None], b[None, :])
    rounds = _bvn_rounds(t, max_rounds)
    if rounds is None or (max_rounds is not None and len(rounds) > max_rounds):
        rounds = _coloured_rounds(t, max_rounds)
    rounds = [Round(tuple((i, j, a * float(scale[i, j])) for i, j, a in r.sends), r.duration) for r in rounds]
    return Schedule(tuple(rounds), lb)


def num_rounds(traffic, bandwidth=None) -> int:
    """Rounds of the optimal (Birkhoff-von Neumann) schedule."""
    return schedule_all_to_all(traffic, bandwidth).num_rounds


# ------------------------------------------------------------- GPU assignment
def assign_experts(expert_load: Sequence[float], gpu_speed: Sequence[float]) -> np.ndarray:
    """Aurora Thm 5.1: experts by load descending onto GPUs by speed descending.

    expert_load[n], gpu_speed[n] -> gpu_of_expert[n] (a permutation). Ties keep the
    lower index first.
    """
    load = np.asarray(expert_load, dtype=np.float64)
    speed = np.asarray(gpu_speed, dtype=np.float64)
    if load.ndim != 1 or speed.shape != load.shape:
        raise ValueError(f"expert_load and gpu_speed must be 1-D of equal length, got {load.shape}, {speed.shape}.")
    if not (np.all(np.isfinite(speed)) and np.all(np.isfinite(load))) or np.any(speed <= 0) or np.any(load < 0):
        raise ValueError("gpu_speed must be finite and positive, expert_load finite and non-negative.")
    experts = np.argsort(-load, kind="stable")
    gpus = np.argsort(-speed, kind="stable")
    out = np.empty(len(load), dtype=np.int64)
    out[experts] = gpus
    return out


# ------------------------------------------------------------------ colocation
@dataclasses.dataclass(frozen=True)
class Colocation:
    """Expert b_partner[i] of model b shares a GPU with expert i of model a, on GPU gpu[i].

    ``bottleneck`` is the objective the method minimised: max over GPUs of the
    aggregated send/receive traffic (homogeneous, Aurora eq. 6) or of the pair's time
    on its GPU (heterogeneous, section 7.2). ``method`` is "case1", "case2" or "hetero".
    """

    b_partner: tuple[int, ...]
    gpu: tuple[int, ...]
    bottleneck: float
    method: str


def _send_recv(model, name: str) -> np.ndarray:
    d = _traffic(model, name)
    return np.stack([d.sum(1), d.sum(0)], axis=1)  # [n, 2]: (a_i, a_{n+i})


def pair_weights(model_a, model_b) -> np.ndarray:
    """w[i, j] = max(a_i + b_j, a_{n+i} + b_{n+j}) (Aurora eq. 6, Case II edge weights)."""
    a, b = _send_recv(model_a, "model_a"), _send_recv(model_b, "model_b")
    if a.shape != b.shape:
        raise ValueError(f"model_a and model_b must have the same number of experts, got {len(a)} and {len(b)}.")
    return np.maximum(a[:, None, 0] + b[None, :, 0], a[:, None, 1] + b[None, :, 1])


def bottleneck_matching(weights: np.ndarray) -> tuple[np.ndarray, float]:
    """Perfect matching of rows to columns minimising the largest weight.

    Binary search over the sorted distinct weights for the smallest threshold whose
    edge subgraph has a perfect matching (Hopcroft-Karp), Aurora section 6.2.
    Returns (col_of_row[n], bottleneck).
    """
    w = np.asarray(weights, dtype=np.float64)
    n = w.shape[0]
    if w.shape != (n, n):
        raise ValueError(f"weights must be square, got {w.shape}.")
    if n == 0:
        return np.zeros(0, dtype=np.int64), 0.0
    values = np.unique(w)
    lo, hi = 0, len(values) - 1
    best = None
    while lo <= hi:
        mid = (lo + hi) // 2
        perm = _perfect_matching(w <= values[mid])
        if perm is not None:
            best, hi = (perm, values[mid]), mid - 1
        else:
            lo = mid + 1
    perm, value = best
    return np.array([perm[i] for i in range(n)], dtype=np.int64), float(value)


def _check_compute_per_unit(value) -> None:
    if not (np.isscalar(value) and np.isfinite(value) and value >= 0):
        raise ValueError(f"compute_per_unit={value!r} must be a finite number >= 0 (compute "
                         "time per unit of received traffic).")


def _pair_time(weights: np.ndarray, recv: np.ndarray, speed: np.ndarray, compute_per_unit: float) -> np.ndarray:
    """[pairs, gpus] time of a colocated pair on each GPU: (traffic + c * received) / speed."""
    return (weights[:, None] + compute_per_unit * recv[:, None]) / speed[None, :]


def colocate(model_a, model_b, gpu_speed=None, *, compute_per_unit: float = 1.0) -> Colocation:
    """Colocate each expert of model a with one of model b, one pair per GPU.

    model_a, model_b: first all-to-all traffic matrices [n, n] of the two models
    (expert i on GPU i before colocation). Homogeneous (gpu_speed None or all equal):
    minimise max over GPUs of the aggregated traffic h (Aurora eq. 6, optimal by
    Thm 6.1): Case I (every GPU sends what it receives, in both models) sorts a
    ascending against b descending (Thm 6.2); Case II is a bottleneck matching.
    Heterogeneous (gpu_speed[n]): section 7.2's decoupled heuristic - first the
    Case II colocation, then a bottleneck matching of pairs to GPUs with weight
    (h_pair + compute_per_unit * received_pair) / speed_gpu (speed scales both the
    network and compute, footnote 2 of section 5.1). NP-hard in general (section 7.1).
    """
    a, b = _send_recv(model_a, "model_a"), _send_recv(model_b, "model_b")
    _check_compute_per_unit(compute_per_unit)
    w = pair_weights(model_a, model_b)
    n = len(a)
    speed = None if gpu_speed is None else _bandwidth(gpu_speed, n, "gpu_speed")
    homogeneous = speed is None or _all_equal(speed, speed[:1])
    case1 = _all_equal(a[:, 0], a[:, 1]) and _all_equal(b[:, 0], b[:, 1])
    if case1:
        ia = np.argsort(a[:, 0], kind="stable")
        ib = np.argsort(-b[:, 0], kind="stable")
        partner = np.empty(n, dtype=np.int64)
        partner[ia] = ib
        value = float(w[np.arange(n), partner].max()) if n else 0.0
        method = "case1"
    else:
        partner, value = bottleneck_matching(w)
        method = "case2"
    if homogeneous:
        return Colocation(tuple(partner.tolist()), tuple(range(n)), value, method)
    recv = a[:, 1] + b[partner, 1]
    cost = _pair_time(w[np.arange(n), partner], recv, speed, compute_per_unit)
    gpu, value = bottleneck_matching(cost)
    return Colocation(tuple(partner.tolist()), tuple(gpu.tolist()), value, "hetero")


def colocation_cost(model_a, model_b, partner, gpu, gpu_speed, *, compute_per_unit: float = 1.0) -> float:
    """Objective of :func:`colocate` for a given pairing and GPU assignment."""
    a, b = _send_recv(model_a, "model_a"), _send_recv(model_b, "model_b")
    _check_compute_per_unit(compute_per_unit)
    w = pair_weights(model_a, model_b)
    partner, gpu = np.asarray(partner), np.asarray(gpu)
    n = len(a)
    h = w[np.arange(n), partner]
    if gpu_speed is None:
        return float(h.max())
    speed = _bandwidth(gpu_speed, n, "gpu_speed")
    recv = a[:, 1] + b[partner, 1]
    return float(((h + compute_per_unit * recv) / speed[gpu]).max())


def brute_force_colocation(model_a, model_b, gpu_speed=None, *, compute_per_unit: float = 1.0) -> float:
    """Exact optimum by enumeration (n <= 7 homogeneous, n <= 6 heterogeneous); for tests."""
    a, b = _send_recv(model_a, "model_a"), _send_recv(model_b, "model_b")
    w = pair_weights(model_a, model_b)
    n = len(a)
    perms = np.array(list(itertools.permutations(range(n))), dtype=np.int64).reshape(-1, n)
    rows = np.arange(n)
    speed = None if gpu_speed is None else _bandwidth(gpu_speed, n, "gpu_speed")
    if speed is None or _all_equal(speed, speed[:1]):
        return float(w[rows, perms].max(1).min())
    best = np.inf
    for p in perms:
        h = w[rows, p] + compute_per_unit * (a[:, 1] + b[p, 1])  # [n] pair totals
        cost = h[:, None] / speed[None, :]  # [pair, gpu]
        best = min(best, float(cost[rows, perms].max(1).min()))
    return float(best)


# ------------------------------------------------------------------ timelines
def inference_time_exclusive(traffic, gate, ffn, agg, bandwidth=None) -> float:
    """Aurora eq. 3: |G| + max|N_i| + max|F_i| + max|C_i| + |A| for one layer.

    traffic[n, n] is the first all-to-all D_N; the second is its transpose (section
    2.2), and both run on the optimal schedule (lower_bound). gate, ffn, agg: [n]
    computation times per GPU (scalars broadcast).
    """
    d = _traffic(traffic)
    n = d.shape[0]
    g, f, a = (np.broadcast_to(np.asarray(x, dtype=np.float64), (n,)) for x in (gate, ffn, agg))
    return float(g.max() + lower_bound(d, bandwidth) + f.max() + lower_bound(d.T, bandwidth) + a.max())


def inference_time_colocated(comm_a: float, comm_ab: float, comm_ca: float, comm_cb: float,
                             gate=(0.0, 0.0), ffn=(0.0, 0.0), agg=(0.0, 0.0)) -> float:
    """Aurora Table 2 / eq. 4: one layer of two colocated models a and b.

    comm_a = |N^a|; comm_ab = |N^a + N^b| (aggregated first all-to-alls, e.g. the
    lower bound of the combined traffic); comm_ca, comm_cb = |C^a|, |C^b|. gate/ffn/agg
    = (model a, model b) maxima over GPUs. Returns E_{A^b} + |G^a|.
    """
    (ga, gb), (fa, fb), (aa, ab) = gate, ffn, agg
    e_fa = max(gb, comm_a) + fa
    e_nb = max(gb, comm_ab)
    e_fb = max(e_fa, e_nb) + fb
    e_ca = max(e_fa, e_nb) + comm_ca
    e_aa = max(e_fb, e_ca) + aa
    e_cb = max(e_fb, e_ca) + comm_cb
    e_ab = max(e_aa, e_cb) + ab
    return float(e_ab + ga)


def _compute_max(x, name: str) -> float:
    v = np.asarray(x, dtype=np.float64)
    if v.ndim > 1 or not np.all(np.isfinite(v)) or np.any(v < 0):
        raise ValueError(f"{name} must be a non-negative scalar or one time per GPU.")
    return float(v.max()) if v.size else 0.0


def _permutation(p, n: int, name: str) -> np.ndarray:
    p = np.asarray(p, dtype=np.int64).ravel()
    if p.shape != (n,) or sorted(p.tolist()) != list(range(n)):
        raise ValueError(f"{name} must be a permutation of range({n}), got {p.tolist()}.")
    return p


def inference_time(traffic, gate=0.0, ffn=0.0, agg=0.0, bandwidth=None, *,
                   gpu_of_expert=None, colocated_with=None, colocation=None,
                   gate_b=0.0, ffn_b=0.0, agg_b=0.0) -> float:
    """One MoE layer's inference time on Aurora's timelines (eq. 1-3, Table 2 / eq. 4).

    traffic[n, n]: model a's first all-to-all D_N in expert coordinates (row and column
    i belong to the GPU that hosts expert i, as in :func:`colocate`); the second
    all-to-all is its transpose (section 2.2). Both run on the optimal order, i.e. take
    :func:`lower_bound` (Thm 4.2 / 5.2). gate, ffn, agg: computation times of model a,
    a scalar or one per GPU for the placement being timed; only their maxima enter.
    bandwidth: None (= 1), a scalar, or [n] per GPU (GPU index).

    - Exclusive (``colocated_with`` None): eq. 3, |G| + |N| + max F + |C| + |A|, via
      :func:`inference_time_exclusive`. ``gpu_of_expert[n]`` (e.g. from
      :func:`assign_experts`) puts expert i on GPU gpu_of_expert[i], so its traffic
      runs at bandwidth[gpu_of_expert[i]]; default identity.
    - Colocated (``colocated_with`` = model b's D_N [n, n]): Table 2, via
      :func:`inference_time_colocated`. ``colocation`` is a :class:`Colocation` (from
      :func:`colocate`: expert b_partner[i] of b joins expert i of a on GPU gpu[i]) or a
      bare b_partner sequence (GPU i); default identity. Model b's traffic is moved with
      its experts (rows and columns permuted by b_partner), the terms are
      |N^a|, |N^a + N^b| (aggregated matrix), |C^a|, |C^b| at the pairs' bandwidths.
      gate_b, ffn_b, agg_b: model b's computation times.
    """
    d = _traffic(traffic)
    n = d.shape[0]
    b = _bandwidth(bandwidth, n)
    if colocated_with is None:
        if colocation is not None or any(np.any(np.asarray(x) != 0) for x in (gate_b, ffn_b, agg_b)):
            raise ValueError("colocation and gate_b/ffn_b/agg_b need colocated_with (model b's traffic).")
        if gpu_of_expert is not None:
            b = b[_permutation(gpu_of_expert, n, "gpu_of_expert")]
        return inference_time_exclusive(d, _compute_max(gate, "gate"), _compute_max(ffn, "ffn"),
                                         _compute_max(agg, "agg"), b)
    if gpu_of_expert is not None:
        raise ValueError("with colocated_with, give the GPU of each pair as colocation.gpu, not gpu_of_expert.")
    db = _traffic(colocated_with, "colocated_with")
    if db.shape != d.shape:
        raise ValueError(f"colocated_with must have the shape of traffic {d.shape}, got {db.shape}.")
    if colocation is None:
        partner, gpu = np.arange(n), np.arange(n)
    elif isinstance(colocation, Colocation):
        partner = _permutation(colocation.b_partner, n, "colocation.b_partner")
        gpu = _permutation(colocation.gpu, n, "colocation.gpu")
    else:
        partner, gpu = _permutation(colocation, n, "colocation"), np.arange(n)
    bs = b[gpu]  # bandwidth of the GPU hosting pair i
    db = db[np.ix_(partner, partner)]  # model b's traffic in pair coordinates
    return inference_time_colocated(
        lower_bound(d, bs), lower_bound(d + db, bs), lower_bound(d.T, bs), lower_bound(db.T, bs),
        gate=(_compute_max(gate, "gate"), _compute_max(gate_b, "gate_b")),
        ffn=(_compute_max(ffn, "ffn"), _compute_max(ffn_b, "ffn_b")),
        agg=(_compute_max(agg, "agg"), _compute_max(agg_b, "agg_b")))
