"""Multi-process start-up: ``initialize_distributed`` around ``jax.distributed.initialize``.

Where the arguments come from, first match wins, per argument:
  1. explicit arguments of ``initialize_distributed``;
  2. aristax variables: ARISTAX_COORDINATOR ("host:port"), ARISTAX_NUM_PROCESSES,
     ARISTAX_PROCESS_ID, ARISTAX_LOCAL_DEVICE_IDS ("0,1,2");
  3. JAX's own: JAX_COORDINATOR_ADDRESS, JAX_NUM_PROCESSES, JAX_PROCESS_ID;
  4. SLURM (inside ``srun``: SLURM_NTASKS and SLURM_PROCID set): num_processes =
     SLURM_NTASKS, process_id = SLURM_PROCID, coordinator = first host of
     SLURM_STEP_NODELIST (else SLURM_JOB_NODELIST) on port ARISTAX_COORDINATOR_PORT,
     else 12000 + SLURM_JOB_ID % 1000 (so concurrent jobs on one node differ), else
     12345.
Nothing set at all: a single process, ``initialize_distributed`` does nothing. Some
but not all of (coordinator, num_processes, process_id): ``ValueError`` naming what
is missing. ``resolve_distributed`` is the pure part (env dict in, arguments out).
"""

from __future__ import annotations

import os
import re
from collections.abc import Mapping, Sequence
from typing import Any

DEFAULT_PORT = 12345
_KEYS = ("coordinator_address", "num_processes", "process_id")
_ENV = {
    "aristax": ("ARISTAX_COORDINATOR", "ARISTAX_NUM_PROCESSES", "ARISTAX_PROCESS_ID"),
    "jax": ("JAX_COORDINATOR_ADDRESS", "JAX_NUM_PROCESSES", "JAX_PROCESS_ID"),
}


def first_slurm_host(nodelist: str) -> str:
    """The first host of a SLURM node list: "gpu[003-005,9],cpu1" -> "gpu003"."""
    nodelist = nodelist.strip()
    m = re.match(r"([^,\[]+)(?:\[([^\]]+)\])?", nodelist)
    if not m or not m.group(1):
        raise ValueError(f"SLURM node list {nodelist!r} has no host name")
    prefix, ranges = m.group(1), m.group(2)
    if ranges is None:
        return prefix
    return prefix + ranges.split(",")[0].split("-")[0]


def _int(name: str, value: Any) -> int:
    try:
        out = int(value)
    except (TypeError, ValueError):
        raise ValueError(f"{name}={value!r} must be an integer") from None
    return out


def _slurm(env: Mapping[str, str]) -> dict[str, Any]:
    if "SLURM_NTASKS" not in env or "SLURM_PROCID" not in env:
        return {}
    nodelist = env.get("SLURM_STEP_NODELIST") or env.get("SLURM_JOB_NODELIST")
    out: dict[str, Any] = {"num_processes": env["SLURM_NTASKS"],
                           "process_id": env["SLURM_PROCID"]}
    if nodelist:
        if "ARISTAX_COORDINATOR_PORT" in env:
            port = _int("ARISTAX_COORDINATOR_PORT", env["ARISTAX_COORDINATOR_PORT"])
        elif "SLURM_JOB_ID" in env:
            port = 12000 + _int("SLURM_JOB_ID", env["SLURM_JOB_ID"]) % 1000
        else:
            port = DEFAULT_PORT
        out["coordinator_address"] = f"{first_slurm_host(nodelist)}:{port}"
    return out


def resolve_distributed(
    env: Mapping[str, str],
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> dict[str, Any] | None:
    """Arguments for ``jax.distributed.initialize``, or None for a single process.

    Args:
      env: the environment (``os.environ``).
      coordinator_address, num_processes, process_id, local_device_ids: explicit
        values; each wins over the environment.
    Returns:
      None when nothing is set (or num_processes == 1 with no coordinator), else a
      dict with coordinator_address (str "host:port"), num_processes, process_id
      (ints) and, when given, local_device_ids (list of ints).
    Raises:
      ValueError: partial settings, non-integers, or process_id outside
      [0, num_processes).
    """
    explicit = dict(zip(_KEYS, (coordinator_address, num_processes, process_id)))
    sources = [{k: v for k, v in explicit.items() if v is not None}]
    for names in _ENV.values():
        sources.append({k: env[n] for k, n in zip(_KEYS, names) if n in env and env[n] != ""})
    sources.append(_slurm(env))
    args: dict[str, Any] = {}
    for key in _KEYS:
        for source in sources:
            if key in source:
                args[key] = source[key]
                break
    ids = local_device_ids
    if ids is None and env.get("ARISTAX_LOCAL_DEVICE_IDS"):
        ids = [_int("ARISTAX_LOCAL_DEVICE_IDS", v)
               for v in env["ARISTAX_LOCAL_DEVICE_IDS"].split(",")]
    if not args or (set(args) == {"num_processes"} and _int("num_processes",
                                                            args["num_processes"]) == 1):
        return None
    missing = [k for k in _KEYS if k not in args]
    if missing:
        raise ValueError(
            f"distributed settings are incomplete: {sorted(args)} set but {missing} missing; "
            "pass them to initialize_distributed(...) or set ARISTAX_COORDINATOR "
            "(host:port), ARISTAX_NUM_PROCESSES and ARISTAX_PROCESS_ID")
    args["num_processes"] = _int("num_processes", args["num_processes"])
    args["process_id"] = _int("process_id", args["process_id"])
    if not 0 <= args["process_id"] < args["num_processes"]:
        raise ValueError(f"process_id={args['process_id']} must be in [0, num_processes="
                         f"{args['num_processes']})")
    if ":" not in str(args["coordinator_address"]):
        raise ValueError(f"coordinator_address={args['coordinator_address']!r} needs a port: "
                         "use 'host:port'")
    if ids is not None:
        args["local_device_ids"] = [int(i) for i in ids]
    return args


def initialize_distributed(
    coordinator_address: str | None = None,
    num_processes: int | None = None,
    process_id: int | None = None,
    local_device_ids: Sequence[int] | None = None,
) -> dict[str, Any] | None:
    """Start JAX's multi-process runtime from arguments, aristax/JAX env vars or SLURM.

    Call once per process, before any other JAX call. For CPU collectives across
    processes set ``jax.config.update("jax_cpu_collectives_implementation", "gloo")``
    first. Returns the arguments used, or None (single process: nothing done).
    """
    args = resolve_distributed(os.environ, coordinator_address, num_processes, process_id,
                               local_device_ids)
    if args is not None:
        import jax

        jax.distributed.initialize(**args)
    return args
