"""exchange backends and the ragged_all_to_all arguments, against a NumPy model of
``jax.lax.ragged_all_to_all``'s documented semantics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from aristax.parallel import (
    EXCHANGE_BACKENDS, default_backend, exchange, ragged_all_to_all_emulated, ragged_args)

G = 4


def np_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The pseudocode of the jax docstring, for all devices at once (leading axis = device).

    Device s sends operand[s][in_off[s][i] : +send[s][i]] to device i // (N/G); device
    d writes the slice received from source s at out_off[s][j] on d (j the index of d
    in s's lists), with size recv_sizes[d][s].
    """
    G_, N = np.asarray(send_sizes).shape
    per = N // G_
    result = np.array(output, copy=True)
    for s in range(G_):
        for i in range(N):
            d = i // per
            data = operand[s][input_offsets[s][i]: input_offsets[s][i] + send_sizes[s][i]]
            j = s * per + i % per
            assert len(data) == recv_sizes[d][j], "send and recv sizes disagree"
            result[d][output_offsets[s][i]: output_offsets[s][i] + len(data)] = data
    return result


def mesh():
    return jax.make_mesh((G,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:G])


def per_device(fn, *args):
    """Run fn on G devices; args and results have a leading device axis."""
    wrapped = jax.shard_map(
        lambda *a: jax.tree.map(lambda v: v[None], fn(*(v[0] for v in a))),
        mesh=mesh(), in_specs=P("expert"), out_specs=P("expert"))
    return jax.jit(wrapped)(*args)


def test_emulated_matches_docstring_example():
    # The example of the jax docstring, axis of size 2, embedded in G=4 (idle devices).
    operand = np.array([[1, 2, 2], [3, 4, 0], [0, 0, 0], [0, 0, 0]], np.float32)
    z = np.zeros(G, np.int32)
    in_off = np.array([[0, 1, 0, 0], [0, 1, 0, 0], z, z], np.int32)
    send = np.array([[1, 2, 0, 0], [1, 1, 0, 0], z, z], np.int32)
    out_off = np.array([[0, 0, 0, 0], [1, 2, 0, 0], z, z], np.int32)
    recv = np.array([[1, 1, 0, 0], [2, 1, 0, 0], z, z], np.int32)
    output = np.zeros((G, 4), np.float32)
    fn = functools.partial(ragged_all_to_all_emulated, axis_name="expert")
    got = per_device(fn, operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got)[:2], [[1, 3, 0, 0], [2, 2, 4, 0]])
    want = np_ragged_all_to_all(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)


def random_layout(seed, N=20, B=4):
    """Per device: rows [N, 2], blocks per destination (sizes <= B) at increasing offsets."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, B + 1, size=(G, G)).astype(np.int32)
    gaps = rng.integers(0, 2, size=(G, G))
    offsets = np.cumsum(sizes + gaps, axis=1) - sizes  # a gap of 0 or 1 row before each block
    assert (offsets[:, -1] + sizes[:, -1] <= N).all()
    rows = rng.normal(size=(G, N, 2)).astype(np.float32)
    return rows, offsets.astype(np.int32), sizes, B


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_args_follow_documented_semantics(seed):
    rows, offsets, sizes, B = random_layout(seed)
    fwd = per_device(functools.partial(ragged_args, axis_name="expert", buffer_size=B),
                     jnp.asarray(offsets), jnp.asarray(sizes))
    fwd = [np.asarray(a) for a in fwd]
    recv = np_ragged_all_to_all(rows, np.zeros((G, G * B, 2), np.float32), *fwd)
    padded = per_device(functools.partial(exchange, axis_name="expert", buffer_size=B,
                                          backend="padded"), rows, offsets, sizes)
    np.testing.assert_array_equal(recv, np.asarray(padded))
    # The receiver holds source s's block at s*B, exactly the sender's rows.
    for d in range(G):
        for s in range(G):
            n = sizes[s, d]
            np.testing.assert_array_equal(recv[d, s * B: s * B + n],
                                          rows[s, offsets[s, d]: offsets[s, d] + n])
    rev = per_device(functools.partial(ragged_args, axis_name="expert", buffer_size=B,
                                       reverse=True), jnp.asarray(offsets), jnp.asarray(sizes))
    back = np_ragged_all_to_all(recv, np.zeros_like(rows), *[np.asarray(a) for a in rev])
    sent = np.zeros(rows.shape[:2], bool)
    for s in range(G):
        for d in range(G):
            sent[s, offsets[s, d]: offsets[s, d] + sizes[s, d]] = True
    np.testing.assert_array_equal(back, np.where(sent[..., None], rows, 0))


@pytest.mark.parametrize("backend", ["padded", "ragged_emulated"])
def test_exchange_round_trip_and_gradient(backend):
    rows, offsets, sizes, B = random_layout(3)
    N = rows.shape[1]
    trip = dict(axis_name="expert", buffer_size=B, backend=backend)

    def there_and_back(x, off, size):
        recv = exchange(x, off, size, **trip)
        return exchange(recv * 2.0, off, size, reverse=True, num_rows=N, **trip)

    back = per_device(there_and_back, rows, offsets, sizes)
    sent = np.zeros(rows.shape[:2], bool)
    for s in range(G):
        for d in range(G):
            sent[s, offsets[s, d]: offsets[s, d] + sizes[s, d]] = True
    np.testing.assert_allclose(np.asarray(back), np.where(sent[..., None], 2 * rows, 0))
    grad = jax.grad(lambda x: jnp.sum(per_device(there_and_back, x, offsets, sizes)))(rows)
    np.testing.assert_allclose(np.asarray(grad), np.where(sent[..., None], 2.0, 0.0) + 0 * rows)


def test_backend_choice():
    assert default_backend("cpu") == "padded"
    assert default_backend("gpu") == "ragged"
    assert default_backend("tpu") == "ragged"
    assert set(EXCHANGE_BACKENDS) >= {"padded", "ragged"}
    with pytest.raises(ValueError, match="backend='nccl' is invalid"):
        per_device(functools.partial(exchange, axis_name="expert", buffer_size=1,
                                     backend="nccl"),
                   np.zeros((G, 2, 1), np.float32), np.zeros((G, G), np.int32),
                   np.zeros((G, G), np.int32))
