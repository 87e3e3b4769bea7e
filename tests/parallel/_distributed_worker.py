"""One process of test_distributed's 2-process run (not collected by pytest).

argv: inputs.npz output.npy. Environment: ARISTAX_COORDINATOR/NUM_PROCESSES/PROCESS_ID,
XLA_FLAGS with 4 host devices, JAX_PLATFORMS=cpu.
"""

import sys

import jax

jax.config.update("jax_cpu_collectives_implementation", "gloo")

from aristax.parallel.distributed import initialize_distributed  # noqa: E402

assert initialize_distributed() is not None, "no distributed settings in the environment"

import numpy as np  # noqa: E402
from jax.experimental import multihost_utils  # noqa: E402
from jax.sharding import NamedSharding, PartitionSpec as P  # noqa: E402

from aristax import MoEConfig, MoEParams  # noqa: E402
from aristax.parallel import expert_parallel_moe  # noqa: E402

data = np.load(sys.argv[1])
cfg = MoEConfig(num_experts=8, top_k=2, d_model=data["x"].shape[1], d_ff=data["up"].shape[2])
assert jax.device_count() == 8 and jax.local_device_count() == 4, jax.devices()
mesh = jax.make_mesh((2, 4), ("data", "expert"))


def put(a, spec):
    return jax.make_array_from_callback(a.shape, NamedSharding(mesh, spec), lambda i: a[i])


x = put(data["x"], P(("data", "expert"), None))
params = MoEParams(router_de=put(data["router"], P()), up_edf=put(data["up"], P("expert")),
                   gate_edf=put(data["gate"], P("expert")),
                   down_efd=put(data["down"], P("expert")))
y, aux = jax.jit(lambda x, p: expert_parallel_moe(x, p, cfg, mesh, num_chunks=2))(x, params)
y = multihost_utils.process_allgather(y, tiled=True)
if jax.process_index() == 0:
    np.save(sys.argv[2], np.asarray(y))
print("worker", jax.process_index(), "done", flush=True)
