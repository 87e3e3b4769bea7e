"""Measure a cluster's alpha-beta :class:`~aristax.planner.Topology` with JAX.

``measure_topology(devices)`` times ``jax.lax.ppermute`` between pairs of devices at
two (or more) message sizes and fits, per pair, the alpha-beta model of Aristos
Table 1: ``t_ij(n) = alpha_ij + n * beta_ij`` (seconds, n in bytes).

How a pair is timed (``method``):

- ``"pairs"`` (default): one jitted ``shard_map`` over a 1-D mesh of all V devices per
  unordered pair (i, j), whose body ppermutes a ``uint8[n]`` buffer along
  ``[(i, j), (j, i)]`` (both directions at once, as in an all-to-all round); every
  other device sends nothing. V (V - 1) / 2 programs per size: exact per pair.
- ``"rounds"``: a round-robin 1-factorization (circle method): V - 1 rounds (V for odd
  V, one device idle per round), each ppermuting V/2 disjoint pairs at once. Only
  O(V) programs, but one program's time is its slowest pair, so every pair of a round
  gets the round's time (an upper bound; shared links such as a host NIC are
  contended as in a real all-to-all round). Use it for large V.

Each program chains ``inner`` ppermutes in a ``fori_loop`` (the buffer swaps back
and forth), is compiled and run once to warm up, then timed ``repeats`` times with
``block_until_ready``; the time per ppermute is the *minimum* over repeats divided by
``inner`` (interference only ever adds time). Launch overhead of one program is thus
spread over ``inner`` hops; what remains is part of alpha, as it is for real
collectives. Nothing here assumes CPU: the same code runs on GPUs and TPUs.

With several processes (``jax.distributed``) every process runs the same programs in
the same order, and process 0's timings are broadcast so that all processes build the
same Topology (and hence the same Plan).
"""

from __future__ import annotations

import time
from collections.abc import Callable, Sequence

import jax
import jax.numpy as jnp
import numpy as np
from jax.sharding import Mesh, NamedSharding, PartitionSpec as P

from aristax.planner.topology import Topology

LINK_AXIS = "link"
# Experts per device when ``expert_capacity`` is not given: memory is then no
# constraint for any model with up to this many experts per device.
DEFAULT_EXPERT_CAPACITY = 1024
# (n, chain) of the FLOP/s probe: ``chain`` dependent [n, n] @ [n, n] products in one
# program. On a CPU one 1024^3 product takes tens of milliseconds; on a GPU a 512^3 one
# takes about a microsecond, less than launching it, so there they are larger and chained.
MATMUL_PROBE = {"cpu": (1024, 1)}
ACCELERATOR_MATMUL_PROBE = (4096, 8)

Pair = tuple[int, int]


# ---------------------------------------------------------------- pure helpers
def fit_alpha_beta(sizes: Sequence[float], times) -> tuple[np.ndarray, np.ndarray]:
    """Least-squares fit of t = alpha + beta * bytes, clamped to alpha, beta >= 0.

    Args:
      sizes: [S] message sizes in bytes, S >= 2, not all equal.
      times: [..., S] seconds per message; the last axis matches ``sizes``.
    Returns:
      (alpha[...], beta[...]) in seconds and seconds per byte. With S = 2 the line
      goes through both points. Clamping (noise can give a negative slope or
      intercept): beta < 0 -> beta = 0 and alpha = mean(times) (best constant);
      alpha < 0 -> alpha = 0 and beta = sum(s t) / sum(s^2) (best line through 0).
    Raises:
      ValueError: fewer than two distinct sizes, negative sizes, shape mismatch, or
        non-finite / negative times.
    """
    s = np.asarray(sizes, dtype=np.float64)
    t = np.asarray(times, dtype=np.float64)
    if s.ndim != 1 or s.size < 2 or np.ptp(s) == 0 or np.any(s < 0):
        raise ValueError(f"sizes must be >= 2 non-negative byte counts, not all equal; got {s.tolist()}.")
    if t.ndim < 1 or t.shape[-1] != s.size:
        raise ValueError(f"times must have shape [..., {s.size}] (one time per size), got {t.shape}.")
    if not np.all(np.isfinite(t)) or np.any(t < 0):
        raise ValueError("times must be finite and non-negative seconds.")
    ds = s - s.mean()
    beta = (t - t.mean(-1, keepdims=True)) @ ds / (ds @ ds)
    alpha = t.mean(-1) - beta * s.mean()
    flat = beta < 0
    beta = np.where(flat, 0.0, beta)
    alpha = np.where(flat, t.mean(-1), alpha)
    through_zero = alpha < 0
    alpha = np.where(through_zero, 0.0, alpha)
    beta = np.where(through_zero, (t @ s) / (s @ s), beta)
    return alpha, beta


def round_robin_pairs(num_devices: int) -> list[list[Pair]]:
    """1-factorization of the complete graph K_V (circle method).

    Returns rounds; each round lists disjoint pairs (i, j) with i < j, and every
    unordered pair appears in exactly one round: V - 1 rounds of V/2 pairs for even
    V, V rounds of (V - 1)/2 pairs for odd V (one device idle per round).
    """
    if num_devices < 1:
        raise ValueError(f"num_devices must be >= 1, got {num_devices}.")
    n = num_devices + (num_devices % 2)  # a phantom device V for odd V (its partner idles)
    ring = list(range(1, n))
    rounds = []
    for _ in range(n - 1):
        people = [0] + ring
        pairs = [(people[k], people[n - 1 - k]) for k in range(n // 2)]
        rounds.append([(min(a, b), max(a, b)) for a, b in pairs if max(a, b) < num_devices])
        ring = ring[-1:] + ring[:-1]
    return [r for r in rounds if r]


def all_pairs(num_devices: int) -> list[list[Pair]]:
    """One probe per unordered pair (i < j), lexicographic."""
    return [[(i, j)] for i in range(num_devices) for j in range(i + 1, num_devices)]


def pair_matrix(probes: Sequence[Sequence[Pair]], probe_times, num_devices: int) -> np.ndarray:
    """[V, V, S] symmetric times from per-probe times [P, S]; diagonal 0.

    Every pair of probe p gets ``probe_times[p]``; a pair never probed raises.
    """
    pt = np.asarray(probe_times, dtype=np.float64)
    out = np.full((num_devices, num_devices, pt.shape[-1]), np.nan)
    for pairs, t in zip(probes, pt):
        for i, j in pairs:
            out[i, j] = out[j, i] = t
    out[np.arange(num_devices), np.arange(num_devices)] = 0.0
    if np.isnan(out).any():
        raise ValueError("probes do not cover every pair of devices.")
    return out


def min_time(fn: Callable[[], object], repeats: int) -> float:
    """Minimum wall time in seconds of ``fn()`` (blocked until ready) over ``repeats``,
    after one untimed warm-up call (compilation)."""
    jax.block_until_ready(fn())
    best = np.inf
    for _ in range(repeats):
        t0 = time.perf_counter()
        jax.block_until_ready(fn())
        best = min(best, time.perf_counter() - t0)
    return float(best)


# ------------------------------------------------------------------- measuring
def _ppermute_program(mesh: Mesh, pairs: Sequence[Pair], inner: int):
    perm = [p for i, j in pairs for p in ((i, j), (j, i))]

    def body(x):  # x: uint8[1, n] on each device
        return jax.lax.fori_loop(0, inner, lambda _, y: jax.lax.ppermute(y, LINK_AXIS, perm), x)

    return jax.jit(jax.shard_map(body, mesh=mesh, in_specs=P(LINK_AXIS), out_specs=P(LINK_AXIS)))


def _buffer(mesh: Mesh, nbytes: int) -> jax.Array:
    """uint8[V, nbytes], row d on device d (works across processes)."""
    v = mesh.devices.size
    sharding = NamedSharding(mesh, P(LINK_AXIS))
    return jax.make_array_from_callback(
        (v, nbytes), sharding, lambda idx: np.ones((1, nbytes), np.uint8)[:, idx[1]])


def _link_times(devices, sizes, probes, repeats: int, inner: int) -> np.ndarray:
    """[P, S] seconds per ppermute of each probe at each size."""
    mesh = Mesh(np.asarray(devices, dtype=object), (LINK_AXIS,))
    out = np.zeros((len(probes), len(sizes)))
    for s, nbytes in enumerate(sizes):
        x = _buffer(mesh, int(nbytes))
        for p, pairs in enumerate(probes):
            f = _ppermute_program(mesh, pairs, inner)
            out[p, s] = min_time(lambda: f(x), repeats) / inner
    return out


def matmul_flops(device, dtype=jnp.float32, repeats: int = 3) -> float:
    """Achieved FLOP/s of ``device`` on [n, n] @ [n, n] products of ``dtype`` (2 n^3
    FLOPs each), ``chain`` dependent ones per program (``MATMUL_PROBE`` by platform,
    else ``ACCELERATOR_MATMUL_PROBE``); the best of ``repeats`` programs. The products
    run at JAX's matmul precision, as the model's do."""
    n, chain = MATMUL_PROBE.get(device.platform, ACCELERATOR_MATMUL_PROBE)
    a = jax.device_put(jnp.ones((n, n), dtype), device)
    b = jax.device_put(jnp.full((n, n), 1.0 / n, dtype), device)  # a @ b = a: no overflow
    program = jax.jit(lambda a, b: jax.lax.fori_loop(0, chain, lambda _, y: y @ b, a))
    return chain * 2.0 * n**3 / max(min_time(lambda: program(a, b), repeats), 1e-12)


def _device_flops(devices, repeats: int) -> np.ndarray:
    """[V] float32 ``matmul_flops`` of each of this process's devices; 0 for other
    processes' devices (see :func:`_gather`)."""
    return np.asarray([matmul_flops(dev, repeats=repeats)
                       if dev.process_index == jax.process_index() else 0.0
                       for dev in devices])


def _agree(x: np.ndarray) -> np.ndarray:
    """Process 0's value on every process (identity with one process)."""
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.broadcast_one_to_all(x))


def _gather(x: np.ndarray) -> np.ndarray:
    """Sum over processes of per-process arrays that are zero outside their own devices."""
    if jax.process_count() == 1:
        return x
    from jax.experimental import multihost_utils

    return np.asarray(multihost_utils.process_allgather(x)).sum(0)


def _per_device(name: str, value, v: int, dtype) -> np.ndarray:
    arr = np.asarray(value, dtype=dtype)
    if arr.ndim == 0:
        arr = np.full(v, arr, dtype=dtype)
    if arr.shape != (v,):
        raise ValueError(f"{name} must be a scalar or one value per device ({v}), got shape {arr.shape}.")
    return arr


def measure_topology(
    devices: Sequence[jax.Device] | None = None,
    *,
    sizes: Sequence[int] = (2**12, 2**20),
    repeats: int = 5,
    flops=None,
    expert_capacity=None,
    method: str = "pairs",
    inner: int = 4,
    name: str = "measured",
) -> Topology:
    """Measure alpha[V,V], beta[V,V], flops[V] of ``devices`` (see the module doc).

    Args:
      devices: the V devices, in the planner's device order (default
        ``jax.devices()``); plan indices refer to positions in this list.
      sizes: [S] message sizes in bytes per device (S >= 2 distinct, each >= 1).
      repeats: timed runs per program (the minimum is kept), >= 1.
      flops: None (measure a float32 matmul rate per device, :func:`matmul_flops`), a
        scalar, or [V] FLOP/s.
      expert_capacity: None (:data:`DEFAULT_EXPERT_CAPACITY`, memory unconstrained),
        a scalar, or [V] experts per device.
      method: "pairs" (exact per pair) or "rounds" (1-factorization, O(V) programs).
      inner: ppermutes chained per program (amortises launch overhead), >= 1.
    Returns:
      Topology with alpha, beta from :func:`fit_alpha_beta` (symmetric: both
      directions are timed together; diagonal 0) and ``node[d] =
      devices[d].process_index``.
    """
    devices = list(jax.devices() if devices is None else devices)
    v = len(devices)
    if v == 0:
        raise ValueError("devices is empty; pass at least one device (default jax.devices()).")
    sizes = [int(s) for s in sizes]
    if len(set(sizes)) < 2 or min(sizes) < 1:
        raise ValueError(f"sizes must hold >= 2 distinct byte counts >= 1, got {sizes}; e.g. (4096, 1 << 20).")
    if repeats < 1 or inner < 1:
        raise ValueError(f"repeats ({repeats}) and inner ({inner}) must be >= 1.")
    if method not in ("pairs", "rounds"):
        raise ValueError(f"method must be 'pairs' or 'rounds', got {method!r}.")
    if flops is not None:
        flops = _per_device("flops", flops, v, np.float64)
    cap = DEFAULT_EXPERT_CAPACITY if expert_capacity is None else expert_capacity
    cap = _per_device("expert_capacity", cap, v, np.int64)
    if v > 1:
        probes = all_pairs(v) if method == "pairs" else round_robin_pairs(v)
        times = _agree(_link_times(devices, sizes, probes, repeats, inner))
        alpha, beta = fit_alpha_beta(sizes, pair_matrix(probes, times, v))
    else:
        alpha = beta = np.zeros((1, 1))
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, 0.0)
    if flops is None:
        flops = _gather(_device_flops(devices, repeats))
    node = np.asarray([d.process_index for d in devices], dtype=np.int64)
    return Topology(alpha=alpha, beta=beta, flops=flops, expert_capacity=cap, node=node,
                    name=f"{name}-{v}x{devices[0].platform}")
