"""Cluster topology: the alpha-beta cost graph the planner works on.

A :class:`Topology` over V devices holds

- ``alpha[V, V]``: per-message latency from device i to device j, in seconds
  (Aristos Table 1, alpha_ij; the diagonal is ignored by every cost model),
- ``beta[V, V]``: inverse bandwidth from i to j, in seconds per byte
  (Aristos Table 1, beta_ij), so sending ``n`` bytes costs ``alpha + n * beta``,
- ``flops[V]``: achieved FLOP/s of each device (Aristos F_j),
- ``expert_capacity[V]``: how many experts fit in each device's memory (Aristos m_j),
- ``node[V]`` (optional): an integer host id per device, used for hierarchical
  replication and for printing.

Presets (each cites where its numbers come from): :func:`perlmutter`,
:func:`dgx_h100`, :func:`heterogeneous_mix`. ``Topology.load`` / ``save`` read and
write JSON or YAML (by file suffix); a YAML/JSON file may also name a preset,
``{"preset": "perlmutter", "nodes": 4}`` (:func:`preset` builds one by name and checks
its arguments). Presets refuse more than ``MAX_DEVICES`` devices before allocating
their [V, V] matrices.
"""

from __future__ import annotations

import dataclasses
import difflib
import inspect
import json
import typing
from pathlib import Path
from typing import Any

import numpy as np
import yaml

MB = 1e6  # the Aristos alpha-beta numbers are quoted per (decimal) megabyte
# The most devices a preset builds: alpha and beta are [V, V] float64 matrices (and
# the planner makes more of that size), 128 MiB each at 4096 devices.
MAX_DEVICES = 4096


def check_num_devices(num_devices: int, what: str, fix: str) -> None:
    """ValueError unless ``0 < num_devices <= MAX_DEVICES``, before any [V, V] matrix is
    allocated; ``what`` names the topology asked for, ``fix`` says how to shrink it."""
    if num_devices > MAX_DEVICES:
        gib = 2 * num_devices ** 2 * 8 / 2 ** 30
        raise ValueError(f"{what} has {num_devices:,} devices, more than the planner's limit of "
                         f"{MAX_DEVICES} (its [V, V] alpha and beta matrices alone would take "
                         f"{gib:,.1f} GiB): {fix}.")


def check_int(what: str, **counts: Any) -> None:
    """ValueError unless every count is an integer (not a bool, a float or a string)."""
    for name, value in counts.items():
        if isinstance(value, bool) or not isinstance(value, (int, np.integer)):
            raise ValueError(f"{what}: {name} must be an integer, got {value!r} "
                             f"({type(value).__name__}).")


def _array(name: str, value: Any, dtype) -> np.ndarray:
    """``np.array(value, dtype)``, or a ValueError naming the field."""
    try:
        return np.array(value, dtype=dtype, copy=True)
    except (ValueError, TypeError) as err:
        shape = "a [V, V] matrix" if name in ("alpha", "beta") else "one number per device"
        raise ValueError(f"{name} must hold numbers ({err}); give {shape}.") from None


def _as_float_array(name: str, value: Any, ndim: int) -> np.ndarray:
    arr = _array(name, value, np.float64)
    if arr.ndim != ndim:
        raise ValueError(
            f"{name} must be a {ndim}-D array, got shape {arr.shape}; "
            f"pass {'a [V, V] matrix' if ndim == 2 else 'one value per device'}."
        )
    if not np.all(np.isfinite(arr)):
        raise ValueError(f"{name} must be finite; replace inf/nan entries by measured values.")
    if np.any(arr < 0):
        raise ValueError(f"{name} must be non-negative; found {arr.min()!r}.")
    arr.setflags(write=False)
    return arr


@dataclasses.dataclass(frozen=True, eq=False)
class Topology:
    """Alpha-beta cost graph of V devices (Aristos section 2.1, Table 1).

    Shapes: alpha[V,V] s, beta[V,V] s/byte, flops[V] FLOP/s, expert_capacity[V] experts,
    node[V] host ids (optional). Validation: square, matching lengths, non-negative,
    finite, symmetric unless ``symmetric=False``, at least one device, positive FLOP/s.
    """

    alpha: np.ndarray
    beta: np.ndarray
    flops: np.ndarray
    expert_capacity: np.ndarray
    node: np.ndarray | None = None
    name: str = "custom"
    symmetric: bool = True

    def __post_init__(self) -> None:
        alpha = _as_float_array("alpha", self.alpha, 2)
        beta = _as_float_array("beta", self.beta, 2)
        flops = _as_float_array("flops", self.flops, 1)
        v = alpha.shape[0]
        if v == 0:
            raise ValueError("alpha is empty; a topology needs at least one device.")
        if alpha.shape != (v, v):
            raise ValueError(f"alpha must be square [V, V], got {alpha.shape}.")
        if beta.shape != (v, v):
            raise ValueError(f"beta must have the shape of alpha {(v, v)}, got {beta.shape}.")
        if flops.shape != (v,):
            raise ValueError(f"flops must have length V={v} (one per device), got {flops.shape}.")
        if np.any(flops <= 0):
            raise ValueError("flops must be positive (achieved FLOP/s of each device).")
        cap = _array("expert_capacity", self.expert_capacity, np.float64)
        if cap.ndim != 1 or cap.shape[0] != v:
            raise ValueError(
                f"expert_capacity must have length V={v} (experts per device), got shape {cap.shape}."
            )
        if not np.all(np.isfinite(cap)) or np.any(cap != np.round(cap)) or np.any(cap < 0):
            raise ValueError("expert_capacity must hold non-negative integers (experts that fit).")
        cap = cap.astype(np.int64)
        cap.setflags(write=False)
        if self.symmetric:
            for field, m in (("alpha", alpha), ("beta", beta)):
                if not np.allclose(m, m.T, rtol=1e-9, atol=0.0):
                    raise ValueError(
                        f"{field} is not symmetric; symmetrize it or pass symmetric=False."
                    )
        if not isinstance(self.symmetric, (bool, np.bool_)):
            raise ValueError(f"symmetric must be true or false, got {self.symmetric!r} "
                             f"({type(self.symmetric).__name__}).")
        node = self.node
        if node is not None:
            ids = _array("node", node, np.float64)
            if not np.all(np.isfinite(ids)) or np.any(ids != np.round(ids)):
                raise ValueError(f"node must hold integer host ids, got {ids.tolist()[:8]}.")
            node = ids.astype(np.int64)
            if node.shape != (v,):
                raise ValueError(f"node must have length V={v} (one host id per device), got {node.shape}.")
            node.setflags(write=False)
        object.__setattr__(self, "alpha", alpha)
        object.__setattr__(self, "beta", beta)
        object.__setattr__(self, "flops", flops)
        object.__setattr__(self, "expert_capacity", cap)
        object.__setattr__(self, "node", node)

    # ------------------------------------------------------------------ basics
    @property
    def num_devices(self) -> int:
        return int(self.alpha.shape[0])

    @property
    def host_ids(self) -> np.ndarray:
        """int64[V]: ``node``, or every device on host 0 where it is not given."""
        return self.node if self.node is not None else np.zeros(self.num_devices, np.int64)

    def p2p_time(self, nbytes: float) -> np.ndarray:
        """[V, V] time to send ``nbytes`` between each pair: alpha + nbytes * beta (zero diagonal)."""
        t = self.alpha + float(nbytes) * self.beta
        t = t.copy()
        np.fill_diagonal(t, 0.0)
        return t

    def __eq__(self, other: object) -> bool:
        if not isinstance(other, Topology):
            return NotImplemented
        same_node = (self.node is None and other.node is None) or (
            self.node is not None and other.node is not None and np.array_equal(self.node, other.node)
        )
        return (
            self.name == other.name
            and self.symmetric == other.symmetric
            and same_node
            and np.array_equal(self.alpha, other.alpha)
            and np.array_equal(self.beta, other.beta)
            and np.array_equal(self.flops, other.flops)
            and np.array_equal(self.expert_capacity, other.expert_capacity)
        )

    # ------------------------------------------------------------ (de)serialise
    def to_dict(self) -> dict[str, Any]:
        d: dict[str, Any] = {
            "name": self.name,
            "symmetric": self.symmetric,
            "alpha": self.alpha.tolist(),
            "beta": self.beta.tolist(),
            "flops": self.flops.tolist(),
            "expert_capacity": self.expert_capacity.tolist(),
        }
        if self.node is not None:
            d["node"] = self.node.tolist()
        return d

    @classmethod
    def from_dict(cls, d: dict[str, Any]) -> "Topology":
        """Build from ``to_dict`` output, or from ``{"preset": name, **kwargs}``."""
        d = dict(d)
        if "preset" in d:
            return preset(str(d.pop("preset")), **d)
        known = {f.name for f in dataclasses.fields(cls)}
        unknown = set(d) - known
        if unknown:
            raise ValueError(f"unknown topology keys {sorted(unknown)}; allowed: {sorted(known)}.")
        missing = {"alpha", "beta", "flops", "expert_capacity"} - set(d)
        if missing:
            raise ValueError(f"topology is missing {sorted(missing)}; give them or name a preset.")
        return cls(**d)

    def save(self, path: str | Path) -> None:
        """Write JSON (``.json``) or YAML (``.yaml``/``.yml``)."""
        path = Path(path)
        if path.suffix in (".yaml", ".yml"):
            path.write_text(yaml.safe_dump(self.to_dict(), sort_keys=False))
        elif path.suffix == ".json":
            path.write_text(json.dumps(self.to_dict()))
        else:
            raise ValueError(f"path {str(path)!r} must end in .json, .yaml or .yml.")

    @classmethod
    def load(cls, path: str | Path) -> "Topology":
        """Read JSON (``.json``) or YAML (``.yaml``/``.yml``); a syntax error, or a field
        that is not valid, raises ValueError naming the file (and the line)."""
        path = Path(path)
        data = _parse(path)
        if not isinstance(data, dict):
            raise ValueError(f"{path} must hold a mapping (topology fields or a preset), "
                             "e.g. {preset: perlmutter, nodes: 4}.")
        try:
            return cls.from_dict(data)
        except ValueError as err:
            raise ValueError(f"{path}: {err}") from None


def _parse(path: Path) -> Any:
    """The data of a JSON or YAML file; ValueError naming the file and the line of a
    syntax error."""
    if path.suffix not in (".json", ".yaml", ".yml"):
        raise ValueError(f"path {str(path)!r} must end in .json, .yaml or .yml.")
    try:
        text = path.read_text()
    except UnicodeDecodeError:
        raise ValueError(f"{path} is not a text file: give a YAML or JSON topology.") from None
    if path.suffix == ".json":
        try:
            return json.loads(text)
        except json.JSONDecodeError as err:
            raise ValueError(f"{path}: invalid JSON at line {err.lineno}, column {err.colno}: "
                             f"{err.msg}; fix the syntax.") from None
    try:
        return yaml.safe_load(text)
    except yaml.YAMLError as err:
        mark = getattr(err, "problem_mark", None)
        where = f" at line {mark.line + 1}, column {mark.column + 1}" if mark else ""
        problem = getattr(err, "problem", None) or str(err)
        raise ValueError(f"{path}: invalid YAML{where}: {problem}; fix the syntax.") from None


# ---------------------------------------------------------------------- presets
def two_level(
    nodes: int,
    gpus_per_node: int,
    *,
    intra_alpha: float,
    intra_beta: float,
    inter_alpha: float,
    inter_beta: float,
    flops: float,
    expert_capacity: int,
    name: str,
) -> Topology:
    """Devices in ``nodes`` hosts of ``gpus_per_node``; one (alpha, beta) inside a host, one across."""
    check_int(name, nodes=nodes, gpus_per_node=gpus_per_node)
    if nodes < 1 or gpus_per_node < 1:
        raise ValueError(f"{name}: nodes and gpus_per_node must be >= 1, got {nodes}, "
                         f"{gpus_per_node}; give at least one node, e.g. perlmutter:4.")
    check_num_devices(nodes * gpus_per_node, f"{name} ({nodes:,} nodes of {gpus_per_node})",
                      f"give at most {MAX_DEVICES // gpus_per_node} nodes")
    node = np.repeat(np.arange(nodes), gpus_per_node)
    same = node[:, None] == node[None, :]
    alpha = np.where(same, intra_alpha, inter_alpha)
    beta = np.where(same, intra_beta, inter_beta)
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, 0.0)
    v = nodes * gpus_per_node
    return Topology(
        alpha=alpha,
        beta=beta,
        flops=np.full(v, float(flops)),
        expert_capacity=np.full(v, int(expert_capacity)),
        node=node,
        name=name,
    )


def perlmutter(nodes: int = 4, *, expert_capacity: int = 32, flops: float = 150e12) -> Topology:
    """NERSC Perlmutter GPU nodes: 4 A100 per node (Aristos section 3.1).

    alpha/beta as measured with NCCL-tests/NVSHMEM in the Aristos work: inside a node
    (NVLink 3.0) alpha = 9 us, beta = 0.014 ms/MB; across nodes (one 25 GB/s NIC per
    GPU, Slingshot) alpha = 30 us, beta = 0.054 ms/MB (MB = 1e6 bytes).
    ``expert_capacity=32``: the Aristos memory assessment for GPT-3 350M MoE on an
    A100 80 GB (16 on a 40 GB card). ``flops=150e12``: about half of the A100's
    312 TFLOP/s dense BF16 peak, a typical achieved rate for MoE GEMMs.
    """
    return two_level(
        nodes,
        4,
        intra_alpha=9e-6,
        intra_beta=0.014e-3 / MB,
        inter_alpha=30e-6,
        inter_beta=0.054e-3 / MB,
        flops=flops,
        expert_capacity=expert_capacity,
        name=f"perlmutter-{nodes}x4",
    )


def dgx_h100(nodes: int = 1, *, expert_capacity: int = 64, flops: float = 600e12) -> Topology:
    """DGX H100: 8 H100 SXM per node over NVLink 4 / NVSwitch, 8x400 Gb/s InfiniBand NDR across.

    Numbers picked (and why):
    - inside a node alpha = 3 us, beta = 1 / 360 GB/s: NVLink 4 gives 450 GB/s per
      direction per GPU; NCCL all-to-all bus bandwidth on DGX H100 reaches about 80% of
      it, and NVSwitch latency is about a third of Perlmutter's measured 9 us NVLink 3.
    - across nodes alpha = 10 us, beta = 1 / 45 GB/s: one 400 Gb/s (50 GB/s) ConnectX-7
      per GPU at about 90% efficiency; latency a third of Perlmutter's 30 us Slingshot
      number, as for RDMA over a single IB switch level.
    - flops = 600e12: about 60% of the 989 TFLOP/s dense BF16 peak.
    - expert_capacity = 64: an 80 GB card, twice the Aristos A100 number at equal
      memory because FP8/BF16 optimizer sharding is assumed; pass your own.
    """
    return two_level(
        nodes,
        8,
        intra_alpha=3e-6,
        intra_beta=1.0 / 360e9,
        inter_alpha=10e-6,
        inter_beta=1.0 / 45e9,
        flops=flops,
        expert_capacity=expert_capacity,
        name=f"dgx_h100-{nodes}x8",
    )


def heterogeneous_mix(h100_nodes: int = 1, a100_nodes: int = 2) -> Topology:
    """One cluster mixing :func:`dgx_h100` and :func:`perlmutter` nodes.

    Inside each node the preset's own numbers apply; any pair of different nodes uses
    the slower of the two inter-node links (alpha 30 us, beta 0.054 ms/MB, the
    Perlmutter numbers), since traffic between the two kinds crosses the slower NIC.
    FLOP/s and expert capacity are per device, from the presets.
    """
    check_int("heterogeneous_mix", h100_nodes=h100_nodes, a100_nodes=a100_nodes)
    if h100_nodes < 0 or a100_nodes < 0 or h100_nodes + a100_nodes == 0:
        raise ValueError(f"heterogeneous_mix: h100_nodes and a100_nodes must be >= 0 and not "
                         f"both 0, got {h100_nodes}, {a100_nodes}; e.g. heterogeneous_mix:1,2.")
    check_num_devices(8 * h100_nodes + 4 * a100_nodes,
                      f"heterogeneous_mix ({h100_nodes:,} nodes of 8, {a100_nodes:,} of 4)",
                      "give fewer nodes")
    parts = []
    if h100_nodes:
        parts.append(dgx_h100(h100_nodes))
    if a100_nodes:
        parts.append(perlmutter(a100_nodes))
    sizes = [p.num_devices for p in parts]
    v = sum(sizes)
    alpha = np.full((v, v), 30e-6)
    beta = np.full((v, v), 0.054e-3 / MB)
    node = np.empty(v, dtype=np.int64)
    start, node_offset = 0, 0
    for p, s in zip(parts, sizes):
        sl = slice(start, start + s)
        alpha[sl, sl] = np.maximum(p.alpha, 0.0)
        beta[sl, sl] = p.beta
        node[sl] = p.node + node_offset
        node_offset += int(p.node.max()) + 1
        start += s
    # different nodes inside one preset keep the preset's inter-node numbers; across
    # presets the slower link wins (already the fill value above).
    np.fill_diagonal(alpha, 0.0)
    np.fill_diagonal(beta, 0.0)
    return Topology(
        alpha=alpha,
        beta=beta,
        flops=np.concatenate([p.flops for p in parts]),
        expert_capacity=np.concatenate([p.expert_capacity for p in parts]),
        node=node,
        name=f"mix-h100x{h100_nodes}-a100x{a100_nodes}",
    )


PRESETS = {"perlmutter": perlmutter, "dgx_h100": dgx_h100, "heterogeneous_mix": heterogeneous_mix}


def uniform(num_devices: int, *, alpha: float = 1e-5, beta: float = 1e-11, flops: float = 1e14,
            expert_capacity: int = 8) -> Topology:
    """Single-level topology (every pair alike); handy for tests and examples."""
    check_int("uniform", num_devices=num_devices)
    if num_devices < 1:
        raise ValueError(f"uniform: num_devices must be >= 1, got {num_devices}; e.g. uniform:8.")
    check_num_devices(num_devices, "uniform", f"give at most {MAX_DEVICES} devices")
    a = np.full((num_devices, num_devices), alpha)
    b = np.full((num_devices, num_devices), beta)
    np.fill_diagonal(a, 0.0)
    np.fill_diagonal(b, 0.0)
    return Topology(a, b, np.full(num_devices, flops), np.full(num_devices, expert_capacity),
                    node=np.zeros(num_devices, dtype=np.int64), name=f"uniform-{num_devices}")


PRESETS["uniform"] = uniform


def preset(name: str, *args: Any, **kwargs: Any) -> Topology:
    """The preset ``name`` of ``PRESETS`` built with ``args`` / ``kwargs``: a ValueError
    (not a TypeError) names the preset, its parameters and the fix for an unknown name,
    a wrong number of arguments or an argument of the wrong type."""
    if name not in PRESETS:
        close = difflib.get_close_matches(name, PRESETS, n=1)
        hint = f"did you mean {close[0]!r}? " if close else ""
        raise ValueError(f"unknown preset {name!r}; {hint}use one of {sorted(PRESETS)}.")
    signature = inspect.signature(PRESETS[name])
    types = typing.get_type_hints(PRESETS[name])
    first_keyword = next((p for p in signature.parameters.values()
                          if p.kind is p.KEYWORD_ONLY), None)
    params = ", ".join(("*, " if p.kind is p.KEYWORD_ONLY and p is first_keyword else "")
                       + (p.name if p.default is p.empty else f"{p.name}={p.default:g}")
                       for p in signature.parameters.values())
    try:
        bound = signature.bind(*args, **kwargs)
    except TypeError as err:
        raise ValueError(f"preset {name!r}: {err}; its parameters are {params}.") from None
    for key, value in bound.arguments.items():
        kind = types.get(key)
        ok = isinstance(value, (int, float) if kind is float else int)
        if kind in (int, float) and (isinstance(value, bool) or not ok):
            raise ValueError(f"preset {name!r}: {key}={value!r} must be a number "
                             f"({kind.__name__}); its parameters are {params}.")
    return PRESETS[name](*args, **kwargs)
