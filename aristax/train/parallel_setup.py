"""From a config to devices, a plan and a mesh: topology -> ``make_plan`` -> mesh.

Also the process-level set-up that must run before JAX starts its backend: the
number of simulated CPU devices and the multi-process runtime.
"""

from __future__ import annotations

import dataclasses
import os
from pathlib import Path

import jax
import numpy as np
from jax.sharding import NamedSharding, PartitionSpec as P

from aristax.parallel import initialize_distributed, mesh_from_plan, resolve_distributed
from aristax.planner import ModelSpec, make_plan
from aristax.planner.topology import PRESETS, Topology, uniform
from aristax.train.config import TrainConfig
from aristax.train.launch import DEVICE_COUNT_FLAG, without_device_count


def start_processes(cfg: TrainConfig) -> None:
    """Before any JAX computation: simulated CPU devices (``parallel.devices``, split
    over the processes, in place of a device count XLA_FLAGS holds) and, when
    ARISTAX_*/JAX_*/SLURM settings say so, the multi-process runtime with gloo CPU
    collectives.

    Raises:
      ValueError: the devices do not split over the processes, or JAX's CPU backend
        started before this (in this process) with another device count.
    """
    settings = resolve_distributed(os.environ)
    num_processes = 1 if settings is None else settings["num_processes"]
    devices = cfg.parallel.devices
    per_process = 0
    if devices and os.environ.get("JAX_PLATFORMS", "cpu") in ("cpu", ""):
        if devices % num_processes:
            raise ValueError(f"parallel.devices={devices} is not divisible by the "
                             f"{num_processes} processes")
        per_process = devices // num_processes
        flags = without_device_count(os.environ).get("XLA_FLAGS", "")
        os.environ["XLA_FLAGS"] = f"{flags} {DEVICE_COUNT_FLAG}={per_process}".strip()
    if num_processes > 1:
        jax.config.update("jax_cpu_collectives_implementation", "gloo")
    initialize_distributed()
    if per_process and jax.default_backend() == "cpu" and (
            jax.local_device_count() != per_process):
        raise ValueError(f"parallel.devices={devices} needs {per_process} CPU devices per "
                         f"process, but JAX started with {jax.local_device_count()} before "
                         f"aristax could set them: run in a fresh process, or set "
                         f"parallel.devices={jax.local_device_count() * num_processes} "
                         f"(or 0: as found)")


def make_topology(name: str, num_devices: int, expert_capacity: int = 0) -> Topology:
    """"uniform", a node-count preset of ``aristax.planner.topology.PRESETS``
    ("perlmutter", "dgx_h100") with as many nodes as the devices fill, or a topology
    JSON file (``Topology.save``). ``expert_capacity`` > 0 replaces the topology's
    experts per device on every device (a file's too)."""
    capacity = {"expert_capacity": expert_capacity} if expert_capacity else {}
    if name == "uniform":
        return uniform(num_devices, **capacity)
    if name in ("perlmutter", "dgx_h100"):
        per_node = PRESETS[name](1).num_devices
        if num_devices % per_node:
            raise ValueError(f"parallel.topology={name!r} has {per_node} devices per node; "
                             f"{num_devices} devices are not whole nodes")
        return PRESETS[name](num_devices // per_node, **capacity)
    if Path(name).is_file():
        topology = Topology.load(name)
        if not expert_capacity:
            return topology
        return dataclasses.replace(topology, expert_capacity=np.full(
            topology.num_devices, expert_capacity, np.int64))
    raise ValueError(f"parallel.topology={name!r} is not 'uniform', 'perlmutter', 'dgx_h100' "
                     "or a topology JSON file")


def plan_and_mesh(cfg: TrainConfig, devices):
    """(plan, mesh) for expert parallelism over ``devices``, or (None, None) on one
    device or with ``parallel.expert_parallel=false``. The mesh is ``mesh_from_plan``'s
    (Auto axes, as the README's recipe): jit propagates the model's shardings and the
    MoE layer constrains its own."""
    if not cfg.parallel.expert_parallel or len(devices) == 1:
        return None, None
    m = cfg.model
    topology = make_topology(cfg.parallel.topology, len(devices), cfg.parallel.expert_capacity)
    if topology.num_devices != len(devices):
        raise ValueError(f"parallel.topology={cfg.parallel.topology!r} has "
                         f"{topology.num_devices} devices but {len(devices)} are present")
    tokens = cfg.data.batch_size * m.seq_len // len(devices)
    spec = ModelSpec(num_experts=m.num_experts, top_k=m.top_k, d_model=m.d_model, d_ff=m.d_ff,
                     tokens_per_device=max(tokens, 1), num_layers=m.num_layers, moe_every=1,
                     bytes_per_element=np.dtype(m.dtype).itemsize)
    W = cfg.parallel.group_size
    groups = None
    if W:
        if len(devices) % W:
            raise ValueError(f"parallel.group_size={W} does not divide {len(devices)} devices")
        groups = [list(range(i, i + W)) for i in range(0, len(devices), W)]
    p = cfg.parallel
    try:
        plan = make_plan(topology, spec, groups=groups, equal_groups=True)
    except ValueError as err:
        fix = ("set parallel.expert_parallel=false to run without one"
               if jax.process_count() == 1 else
               f"{jax.process_count()} processes train only through one: change the settings "
               "above or the number of devices")
        raise ValueError(
            f"no expert-parallel plan for model.num_experts={m.num_experts} on "
            f"{len(devices)} devices with parallel.topology={p.topology!r}, "
            f"parallel.expert_capacity={p.expert_capacity}, parallel.group_size={W} "
            f"({fix}): {err}") from None
    mesh = mesh_from_plan(plan, devices, topology=topology)
    if p.exchange == "hierarchical" and "node" not in mesh.axis_names:
        raise ValueError(f"parallel.exchange='hierarchical' exchanges within then between "
                         f"nodes, and the plan's groups lie on one node (mesh "
                         f"{dict(mesh.shape)}): leave parallel.exchange unset, or use a "
                         f"topology whose groups span nodes")
    return plan, mesh


def batch_sharding(mesh) -> NamedSharding | None:
    """Tokens: the batch dimension split over every mesh axis."""
    return None if mesh is None else NamedSharding(mesh, P(tuple(mesh.axis_names), None))


