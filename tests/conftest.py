"""Test-wide setup: 8 host CPU devices (machine code unoptimised without a GPU), strict
dtype promotion, full float32 products.

XLA_FLAGS must be set before jax initialises its backends, so this runs at import.
"""

import collections
import glob
import os

# pytest-xdist workers share a GPU where there is one: no worker may preallocate it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
# On a machine without a GPU: LLVM at -O0, and XLA:CPU's elemental fusion emitters
# instead of its newer MLIR ones. The tests check values of small programs, and
# compiling them is most of their CPU time: -O0 took a fifth off (gpu_check's dry run
# 124 s -> 98 s), the emitters half of what remained for small programs (12 test-sized
# MoE gradients compiled in 4.5 s against 9.5; tests/test_moe.py with the HF
# conformance tests 87-95 s against 149-170, 2-core VM, alternating). IEEE semantics
# hold either way. A GPU machine keeps XLA's defaults (they would reach its GPU too).
CPU_ONLY_FLAGS = ("" if glob.glob("/dev/nvidia[0-9]*") else
                  " --xla_backend_optimization_level=0 --xla_cpu_use_fusion_emitters=false")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
    + CPU_ONLY_FLAGS
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")
# The references are float32 products compared at float32 tolerances: on a GPU JAX's
# default would run them in TF32 (the CPU computes float32 whatever this says).
jax.config.update("jax_default_matmul_precision", "highest")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no GPU is present, and tests marked
    ``cpu_backend`` when one is (they need the CPU as JAX's default backend: its 8 host
    devices, or the Mosaic GPU interpreter, which runs JAX from callbacks on the
    default device); nothing else is skipped."""
    gpu = any(d.platform == "gpu" for d in jax.devices())
    marker, reason = (("cpu_backend", "needs the CPU as JAX's default backend")
                      if gpu else ("gpu", "needs a CUDA GPU"))
    for item in items:
        if marker in item.keywords:
            item.add_marker(pytest.mark.skip(reason=reason))


@pytest.fixture
def kernel_calls(monkeypatch):
    """{backend: [op, ...]}: each call of a kernel backend that served (recorded at trace
    time; a backend that refuses raises before it is recorded). A layer test on
    ``implementation=...`` asserts the kernels it meant really ran, not a fallback."""
    from aristax.pallas_kernels.moe_mlp import api as moe_mlp_api
    from aristax.pallas_kernels.permute import api as permute_api
    from aristax.pallas_kernels.ragged_dot import api as ragged_dot_api
    from aristax.pallas_kernels.route import api as route_api

    calls = collections.defaultdict(list)

    def recording(backend, op, fn):
        def call(*args, **kwargs):
            out = fn(*args, **kwargs)
            calls[backend].append(op)
            return out

        return call

    for api, op, fn_name in ((permute_api, "permute", "permute"),
                             (permute_api, "combine", "combine"), (route_api, "route", "route"),
                             (ragged_dot_api, "ragged_dot", "gmm")):
        for name, module in api.BACKENDS.items():
            monkeypatch.setattr(module, fn_name, recording(name, op, getattr(module, fn_name)))
    for name, module in moe_mlp_api.BACKENDS.items():
        if name != "reference":  # the reference is not a fused kernel
            # a backend with a backward of its own ("xla") runs its ``forward``
            fn_name = "forward" if hasattr(module, "backward") else "moe_mlp"
            monkeypatch.setattr(module, fn_name, recording(name, "moe_mlp",
                                                           getattr(module, fn_name)))
    return calls
