"""Lowering for CUDA on a machine without a GPU: ``jax.export(..., platforms=["cuda"])``
for an H100.

JAX 0.10 lowered Pallas Triton kernels for sm_90 when it found no GPU; JAX 0.11 reads
the target from the abstract mesh's ``AbstractDevice`` and refuses without one. Setting
that device here (around the export only: inside it ``jit`` would lower for the GPU)
keeps the lowering tests running on both (``gpu_mesh`` for code in a ``shard_map``).
"""

from __future__ import annotations

import collections
import contextlib
import re

import jax

# Exported Triton calls carry no stable custom-call version; the tests only lower them.
TRITON_CUDA = [jax.export.DisabledSafetyCheck.custom_call("__gpu$xla.gpu.triton")]
H100 = jax.sharding.AbstractDevice(device_kind="NVIDIA H100", num_cores=132, platform="gpu")


@contextlib.contextmanager
def gpu_target(device=H100):
    """The current abstract mesh (its axes kept) with ``device`` as its device."""
    mesh = jax.sharding.get_abstract_mesh()
    with jax.sharding.use_abstract_mesh(mesh.update(abstract_device=device)):
        yield


def gpu_mesh(mesh, device=H100) -> jax.sharding.AbstractMesh:
    """``mesh``'s abstract mesh on ``device``: inside ``shard_map`` the target comes from
    the map's mesh, so a lowering test builds its ``shard_map`` and its input shardings
    on this one."""
    return mesh.abstract_mesh.update(abstract_device=device)


def export_for_cuda(fn, *avals, disabled_checks=()) -> jax.export.Exported:
    """``jax.export.export(fn, platforms=["cuda"], disabled_checks=...)(*avals)``
    lowered for an H100."""
    with gpu_target():
        return jax.export.export(fn, platforms=["cuda"],
                                 disabled_checks=list(disabled_checks))(*avals)


_DOT = re.compile(r"(stablehlo\.dot_general|chlo\.ragged_dot)")
_PRECISION = re.compile(r"precision(?:_config)? = \[\"?(\w+)\"?, \"?(\w+)\"?\]")


def dot_precisions(fn, *args) -> collections.Counter:
    """{(op, (lhs, rhs precision)): count} over the dots of ``jax.jit(fn)(*args)``
    exported for CUDA; the precision is None where the dot has none (JAX's DEFAULT:
    TF32 for float32 on an NVIDIA GPU). The CPU ignores precision, so a test reads it
    here, where a GPU's XLA gets it."""
    avals = jax.tree.map(lambda a: jax.ShapeDtypeStruct(a.shape, a.dtype), args)
    found = collections.Counter()
    for line in export_for_cuda(jax.jit(fn), *avals).mlir_module().splitlines():
        op = _DOT.search(line)
        if op and line.lstrip().startswith("%"):
            precision = _PRECISION.search(line)
            found[op.group(1), precision and precision.groups()] += 1
    return found
