"""Test-wide setup: 8 host CPU devices and strict dtype promotion.

XLA_FLAGS must be set before jax initialises its backends, so this runs at import.
"""

import os

# pytest-xdist workers share a GPU where there is one: no worker may preallocate it
os.environ.setdefault("XLA_PYTHON_CLIENT_PREALLOCATE", "false")
os.environ["XLA_FLAGS"] = (
    os.environ.get("XLA_FLAGS", "") + " --xla_force_host_platform_device_count=8"
).strip()

import jax  # noqa: E402
import pytest  # noqa: E402

jax.config.update("jax_numpy_dtype_promotion", "strict")


def pytest_collection_modifyitems(config, items):
    """Skip tests marked ``gpu`` when no GPU is present; nothing else is skipped."""
    if any(d.platform == "gpu" for d in jax.devices()):
        return
    skip = pytest.mark.skip(reason="needs a CUDA GPU")
    for item in items:
        if "gpu" in item.keywords:
            item.add_marker(skip)


@pytest.fixture
def fused_moe_mlp_calls(monkeypatch):
    """Shapes of x in each call of the Triton ``moe_mlp`` kernel backend (recorded at
    trace time): a test of a layer on ``implementation="triton"`` asserts the fused op
    really served it rather than the unfused fallback."""
    from aristax.pallas_kernels.moe_mlp import triton

    calls = []
    kernel = triton.moe_mlp

    def recording(x, *args, **kwargs):
        calls.append(tuple(x.shape))
        return kernel(x, *args, **kwargs)

    monkeypatch.setattr(triton, "moe_mlp", recording)
    return calls
