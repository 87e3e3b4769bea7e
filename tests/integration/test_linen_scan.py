"""``moe_linen`` inside ``nn.scan`` over layers: the stacked weights' partition specs
get the layer axis in front (issue 31 F), and the scanned stack equals the layers
applied one by one."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import PartitionSpec as P

from aristax import MoEConfig, moe_linen

CFG = MoEConfig(num_experts=4, top_k=2, d_model=8, d_ff=16)


class Layer(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        y, aux = moe_linen(CFG, name="moe")(x)
        return x + y, aux["loss"]


@pytest.mark.parametrize("layer_axis", [None, "layers"])
def test_scanned_stack_specs_and_values(layer_axis):
    stack = nn.scan(Layer, variable_axes={"params": 0}, split_rngs={"params": True},
                    length=3, metadata_params={nn.PARTITION_NAME: layer_axis})
    x = jax.random.normal(jax.random.key(1), (2, 5, 8))
    variables = stack().init(jax.random.key(0), x, None)
    specs = nn.get_partition_spec(variables)["params"]["moe"]
    for name in ("gate_edf", "up_edf", "down_efd"):
        assert specs["experts"][name] == P(layer_axis, "expert", None, None), specs
    assert specs["router"]["weight_de"] == P(layer_axis, None, None)
    y, losses = stack().apply(variables, x, None)
    stacked = nn.unbox(variables)["params"]["moe"]
    h = x
    for i in range(3):  # the same layers one by one, each on its slice of the stack
        layer = {"params": {"moe": jax.tree.map(lambda a: a[i], stacked)}}
        h, loss = Layer().apply(layer, h, None)
        np.testing.assert_allclose(losses[i], loss, rtol=1e-5)
    np.testing.assert_allclose(y, h, rtol=1e-5, atol=1e-6)
    assert jnp.isfinite(y).all()
