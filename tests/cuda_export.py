"""Lowering for CUDA on a machine without a GPU: ``jax.export(..., platforms=["cuda"])``
for an H100.

JAX 0.10 lowered Pallas Triton kernels for sm_90 when it found no GPU; JAX 0.11 reads
the target from the abstract mesh's ``AbstractDevice`` and refuses without one. Setting
that device here (around the export only: inside it ``jit`` would lower for the GPU)
keeps the lowering tests running on both (``gpu_mesh`` for code in a ``shard_map``).

``dot_precisions`` reads the precision that a GPU would get for each matrix product
(the CPU ignores it). ``MOSAIC_INTERPRET`` is how the Mosaic GPU kernel tests run them.
"""

from __future__ import annotations

import collections
import contextlib
from typing import NamedTuple

import jax
import jax.extend

# Mosaic GPU kernels run in interpret mode with the race detector on the CPU, compiled
# on a GPU (the same values checked; the interpreter, which calls JAX from callbacks on
# the default device, is for the CPU).
MOSAIC_INTERPRET = jax.default_backend() == "cpu"
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
    lowered for an H100, with every Pallas Triton kernel's module verified
    (``verified_triton_modules``)."""
    with gpu_target(), verified_triton_modules():
        return jax.export.export(fn, platforms=["cuda"],
                                 disabled_checks=list(disabled_checks))(*avals)


@contextlib.contextmanager
def verified_triton_modules():
    """Run MLIR's verifier on each Triton module that Pallas lowers here.

    JAX serialises a Triton kernel's module unverified; the GPU's compiler verifies
    it when it parses it, so a kernel that lowers here can still fail to compile
    there (jax 0.10/0.11 lower a Python scalar in a scalar ``jnp.where`` with the
    predicate's type, i1: a loop bound ``jnp.where(p, n, 0)`` failed "scf.for ...
    have same type" on an H200). This fails the lowering here instead (JAX's
    private lowering function, wrapped for the duration)."""
    from jax._src.pallas.triton import lowering

    lower = lowering.lower_jaxpr_to_triton_module

    def lower_and_verify(*args, **kwargs):
        result = lower(*args, **kwargs)
        try:
            result.module.operation.verify()
        except Exception as err:  # MLIRError; its text names the op and the source line
            raise AssertionError(f"a Triton module does not verify: {err}") from err
        return result

    lowering.lower_jaxpr_to_triton_module = lower_and_verify
    try:
        yield
    finally:
        lowering.lower_jaxpr_to_triton_module = lower




class Product(NamedTuple):
    """A matrix product in a jaxpr: its primitive, whether it is inside a Pallas
    kernel, its (lhs, rhs) precision names (None: JAX's DEFAULT, TF32 for float32 on an
    NVIDIA GPU) and the sizes of the lhs dimensions it contracts."""

    primitive: str
    in_kernel: bool
    precision: tuple[str, str] | None
    contracting: tuple[int, ...]


def dot_precisions(fn, *args) -> collections.Counter:
    """{Product: count} over the matrix products of ``jax.make_jaxpr(fn)(*args)``,
    nested jaxprs and Pallas kernels included. The CPU ignores precision, so a test
    reads it here: XLA and Triton get it from these products."""
    found = collections.Counter()

    def walk(jaxpr, in_kernel):
        for eqn in jaxpr.eqns:
            params = eqn.params
            if eqn.primitive.name in ("dot_general", "ragged_dot_general"):
                dims = (params["dimension_numbers"] if "dimension_numbers" in params
                        else params["ragged_dot_dimension_numbers"].dot_dimension_numbers)
                shape = eqn.invars[0].aval.shape
                precision = params["precision"]
                found[Product(eqn.primitive.name, in_kernel,
                              precision and tuple(str(p) for p in precision),
                              tuple(shape[d] for d in dims[0][0]))] += 1
            inner = in_kernel or eqn.primitive.name == "pallas_call"
            for param in params.values():
                for sub in param if isinstance(param, (tuple, list)) else (param,):
                    if isinstance(sub, jax.extend.core.ClosedJaxpr):
                        walk(sub.jaxpr, inner)
                    elif isinstance(sub, jax.extend.core.Jaxpr):
                        walk(sub, inner)

    walk(jax.make_jaxpr(fn)(*args).jaxpr, False)
    return found
