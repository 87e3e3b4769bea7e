"""aristax's MoE as the MLP of small decoder stacks written the way Flax models are
(issue 31, item 6): token embedding, layers scanned and rematerialised, bfloat16
compute with float32 parameters, router jitter from the ordinary dropout RNG, a
cross-entropy loss, and the model sharded by the user's own recipe on an FSDP/tensor
mesh (NNX) or through logical axis rules (Linen). Each sharded run's loss and
gradients equal the same model's on one device."""

from __future__ import annotations

import flax.linen as nn
import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx
from jax.sharding import AxisType, NamedSharding, PartitionSpec as P

from aristax import MoE, MoEConfig, moe_linen
from aristax.sharding import LOGICAL_AXES, MoEAxes

VOCAB, D, LAYERS = 64, 16, 3
CFG = MoEConfig(num_experts=8, top_k=2, d_model=D, d_ff=32, router_jitter=0.05,
                dtype=jnp.bfloat16, param_dtype=jnp.float32)
TOKENS = jax.random.randint(jax.random.key(7), (8, 6), 0, VOCAB)


@pytest.fixture(autouse=True)
def standard_promotion():
    """Flax's own layers (RMSNorm of bfloat16) need JAX's default type promotion; the
    suite runs under "strict" (conftest), as aristax itself must."""
    with jax.numpy_dtype_promotion("standard"):
        yield


def auto_mesh(shape, names):
    return jax.make_mesh(shape, names, axis_types=(AxisType.Auto,) * len(names))


def relative_error(got, want) -> float:
    got, want = np.asarray(got, np.float64), np.asarray(want, np.float64)
    return float(np.linalg.norm(got - want) / max(np.linalg.norm(want), 1e-30))


def assert_trees_close(got, want, tol=3e-2):
    """Two trees of one structure: every leaf within ``tol`` relative error."""
    for (path, g), w in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want),
                            strict=True):
        assert relative_error(g, w) < tol, (jax.tree_util.keystr(path), relative_error(g, w))


def cross_entropy(logits, tokens):
    return optax.softmax_cross_entropy_with_integer_labels(
        logits[:, :-1].astype(jnp.float32), tokens[:, 1:]).mean()


# ---------------------------------------------------------------------- NNX
class Block(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, axes: MoEAxes):
        self.norm = nnx.RMSNorm(D, dtype=jnp.bfloat16, param_dtype=jnp.float32, rngs=rngs)
        self.moe = MoE(CFG, rngs=rngs, axes=axes)

    def __call__(self, x):
        y, aux = self.moe(self.norm(x))
        return x + y, aux["loss"]


class Decoder(nnx.Module):
    def __init__(self, *, rngs: nnx.Rngs, axes: MoEAxes):
        self.embed = nnx.Embed(VOCAB, D, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                               rngs=rngs)

        @nnx.split_rngs(splits=LAYERS)
        @nnx.vmap(in_axes=(0,), out_axes=0, transform_metadata={nnx.PARTITION_NAME: None})
        def make_blocks(rngs):
            return Block(rngs=rngs, axes=axes)

        self.blocks = make_blocks(rngs)

    def __call__(self, tokens):
        @nnx.scan(in_axes=(nnx.Carry, 0), out_axes=(nnx.Carry, 0),
                  transform_metadata={nnx.PARTITION_NAME: None})
        @nnx.remat
        def step(x, block):
            return block(x)

        x, aux_losses = step(self.embed(tokens), self.blocks)
        return self.embed.attend(x), aux_losses.sum()


def nnx_loss(model, tokens):
    logits, aux_loss = model(tokens)
    return cross_entropy(logits, tokens) + aux_loss


def test_nnx_scanned_remat_decoder_on_an_fsdp_tensor_mesh():
    axes = MoEAxes(expert="fsdp", mlp="tensor")
    mesh = auto_mesh((4, 2), ("fsdp", "tensor"))

    @nnx.jit
    def create():
        model = Decoder(rngs=nnx.Rngs(params=0, dropout=1), axes=axes)
        state = nnx.state(model)
        nnx.update(model, jax.lax.with_sharding_constraint(state, nnx.get_partition_spec(state)))
        return model

    with jax.set_mesh(mesh):
        sharded = create()
        up = sharded.blocks.moe.experts.up_edf[...]
        assert up.shape == (LAYERS, 8, D, 32) and up.dtype == jnp.float32
        assert tuple(up.sharding.spec)[:4] == (None, "fsdp", None, "tensor")
        tokens = jax.device_put(TOKENS, NamedSharding(mesh, P("fsdp")))
        loss, grads = nnx.jit(nnx.value_and_grad(nnx_loss))(sharded, tokens)

    single = Decoder(rngs=nnx.Rngs(params=0, dropout=1), axes=axes)  # same seeds, one device
    want_loss, want_grads = nnx.jit(nnx.value_and_grad(nnx_loss))(single, TOKENS)
    assert np.isfinite(float(loss)) and relative_error(loss, want_loss) < 1e-2
    assert_trees_close(nnx.to_pure_dict(grads), nnx.to_pure_dict(want_grads))


# ---------------------------------------------------------------------- Linen
class LinenBlock(nn.Module):
    @nn.compact
    def __call__(self, x, _):
        h = nn.RMSNorm(dtype=jnp.bfloat16, param_dtype=jnp.float32)(x)
        y, aux = moe_linen(CFG, axes=LOGICAL_AXES, name="moe")(h, deterministic=False)
        return x + y, aux["loss"]


class LinenDecoder(nn.Module):
    @nn.compact
    def __call__(self, tokens):
        embed = nn.Embed(VOCAB, D, dtype=jnp.bfloat16, param_dtype=jnp.float32,
                         embedding_init=nn.with_logical_partitioning(
                             nn.initializers.normal(1.0), ("vocab", "embed")))
        stack = nn.scan(nn.remat(LinenBlock), variable_axes={"params": 0},
                        split_rngs={"params": True, "dropout": True}, length=LAYERS,
                        metadata_params={nn.PARTITION_NAME: "layers"})
        x, aux_losses = stack(name="layers")(embed(tokens), None)
        return embed.attend(x), aux_losses.sum()


RULES = (("batch", "data"), ("expert", "model"), ("layers", None), ("vocab", None),
         ("embed", None), ("mlp", None))


def linen_loss(params, tokens, key):
    logits, aux_loss = LinenDecoder().apply({"params": params}, tokens, rngs={"dropout": key})
    return cross_entropy(logits, tokens) + aux_loss


def test_linen_scanned_remat_decoder_under_logical_axis_rules():
    mesh = auto_mesh((2, 4), ("data", "model"))
    init = lambda: LinenDecoder().init(  # noqa: E731
        {"params": jax.random.key(0), "dropout": jax.random.key(1)}, TOKENS)
    with jax.set_mesh(mesh), nn.logical_axis_rules(RULES):
        abstract = jax.eval_shape(init)
        shardings = nn.logical_to_mesh_sharding(nn.get_partition_spec(abstract), mesh, RULES)
        variables = jax.jit(init, out_shardings=shardings)()
        params = variables["params"]
        up = params["layers"]["moe"]["experts"]["up_edf"]
        assert nn.get_partition_spec(up) == P("layers", "expert", "embed", "mlp")
        assert tuple(up.value.sharding.spec)[:2] == (None, "model")
        tokens = jax.device_put(TOKENS, NamedSharding(mesh, P("data")))
        key = jax.random.key(3)
        loss, grads = jax.jit(jax.value_and_grad(linen_loss))(params, tokens, key)

    plain = jax.tree.map(lambda a: jnp.asarray(np.asarray(a)), nn.unbox(params))
    want_loss, want_grads = jax.jit(jax.value_and_grad(linen_loss))(plain, TOKENS, key)
    assert np.isfinite(float(loss)) and relative_error(loss, want_loss) < 1e-2
    assert_trees_close(nn.unbox(grads), want_grads)
    other_loss = jax.jit(linen_loss)(plain, TOKENS, jax.random.key(4))
    assert float(other_loss) != float(want_loss)  # the dropout key reaches the jitter


def test_a_layer_stack_refuses_logical_params_naming_the_per_layer_recipe():
    """logical_params()/load_logical_params() of an nnx.vmap stack: they compared the
    [L, E] layout with [E] and reported a plan mismatch there was none (a user trial);
    now they name the per-layer map, which round-trips the weights."""
    def stack(seed):
        @nnx.split_rngs(splits=3)
        @nnx.vmap(in_axes=(0,), out_axes=0)
        def make(rngs):
            return MoE(CFG, rngs=rngs)
        return make(nnx.Rngs(seed))

    layers, other = stack(0), stack(1)
    with pytest.raises(ValueError, match=r"a stack of layers \(3,\).*nnx.vmap\(lambda layer: "
                                         r"layer.logical_params\(\)"):
        layers.logical_params()
    with pytest.raises(ValueError, match=r"layer.load_logical_params\(params\).*\(stack, params"):
        other.load_logical_params(layers.params())
    logical = nnx.vmap(lambda layer: layer.logical_params(), in_axes=0, out_axes=0)(layers)
    assert logical.up_edf.shape == (3, CFG.num_experts, CFG.d_model, CFG.d_ff)
    nnx.vmap(lambda layer, p: layer.load_logical_params(p), in_axes=0, out_axes=0)(other,
                                                                                   logical)
    for got, want in zip(jax.tree.leaves(other.params()), jax.tree.leaves(layers.params())):
        np.testing.assert_array_equal(got, want)
