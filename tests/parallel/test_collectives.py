"""The exchanges (all-to-all strategies) and the ragged_all_to_all arguments, against a NumPy model of
``jax.lax.ragged_all_to_all``'s documented semantics."""

from __future__ import annotations

import functools

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import AxisType, PartitionSpec as P

from aristax.parallel import (
    EXCHANGES, default_exchange, exchange, ragged_all_to_all_emulated, ragged_args)

W = 4


def np_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes):
    """The pseudocode of the jax docstring, for all devices at once (leading axis = device).

    Device s sends operand[s][in_off[s][i] : +send[s][i]] to device i // (N/W); device
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
    return jax.make_mesh((W,), ("expert",), axis_types=(AxisType.Auto,),
                         devices=jax.devices()[:W])


def per_device(fn, *args):
    """Run fn on W devices; args and results have a leading device axis."""
    wrapped = jax.shard_map(
        lambda *a: jax.tree.map(lambda v: v[None], fn(*(v[0] for v in a))),
        mesh=mesh(), in_specs=P("expert"), out_specs=P("expert"))
    return jax.jit(wrapped)(*args)


def test_emulated_matches_docstring_example():
    # The example of the jax docstring, axis of size 2, embedded in W=4 (idle devices).
    operand = np.array([[1, 2, 2], [3, 4, 0], [0, 0, 0], [0, 0, 0]], np.float32)
    z = np.zeros(W, np.int32)
    in_off = np.array([[0, 1, 0, 0], [0, 1, 0, 0], z, z], np.int32)
    send = np.array([[1, 2, 0, 0], [1, 1, 0, 0], z, z], np.int32)
    out_off = np.array([[0, 0, 0, 0], [1, 2, 0, 0], z, z], np.int32)
    recv = np.array([[1, 1, 0, 0], [2, 1, 0, 0], z, z], np.int32)
    output = np.zeros((W, 4), np.float32)
    fn = functools.partial(ragged_all_to_all_emulated, axis_name="expert")
    got = per_device(fn, operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got)[:2], [[1, 3, 0, 0], [2, 2, 4, 0]])
    want = np_ragged_all_to_all(operand, output, in_off, send, out_off, recv)
    np.testing.assert_array_equal(np.asarray(got), want)


def random_layout(seed, N=20, B=4):
    """Per device: rows [N, 2], blocks per destination (sizes <= B) at increasing offsets."""
    rng = np.random.default_rng(seed)
    sizes = rng.integers(0, B + 1, size=(W, W)).astype(np.int32)
    gaps = rng.integers(0, 2, size=(W, W))
    offsets = np.cumsum(sizes + gaps, axis=1) - sizes  # a gap of 0 or 1 row before each block
    assert (offsets[:, -1] + sizes[:, -1] <= N).all()
    rows = rng.normal(size=(W, N, 2)).astype(np.float32)
    return rows, offsets.astype(np.int32), sizes, B


@pytest.mark.parametrize("seed", [0, 1, 2])
def test_ragged_args_follow_documented_semantics(seed):
    rows, offsets, sizes, B = random_layout(seed)
    fwd = per_device(functools.partial(ragged_args, axis_name="expert", buffer_size=B),
                     jnp.asarray(offsets), jnp.asarray(sizes))
    fwd = [np.asarray(a) for a in fwd]
    recv = np_ragged_all_to_all(rows, np.zeros((W, W * B, 2), np.float32), *fwd)
    padded = per_device(functools.partial(exchange, axis_name="expert", buffer_size=B,
                                          exchange="padded"), rows, offsets, sizes)
    np.testing.assert_array_equal(recv, np.asarray(padded))
    # The receiver holds source s's block at s*B, exactly the sender's rows.
    for d in range(W):
        for s in range(W):
            n = sizes[s, d]
            np.testing.assert_array_equal(recv[d, s * B: s * B + n],
                                          rows[s, offsets[s, d]: offsets[s, d] + n])
    rev = per_device(functools.partial(ragged_args, axis_name="expert", buffer_size=B,
                                       reverse=True), jnp.asarray(offsets), jnp.asarray(sizes))
    back = np_ragged_all_to_all(recv, np.zeros_like(rows), *[np.asarray(a) for a in rev])
    sent = np.zeros(rows.shape[:2], bool)
    for s in range(W):
        for d in range(W):
            sent[s, offsets[s, d]: offsets[s, d] + sizes[s, d]] = True
    np.testing.assert_array_equal(back, np.where(sent[..., None], rows, 0))


@pytest.mark.parametrize("strategy", ["padded", "ragged_emulated"])
def test_exchange_round_trip_and_gradient(strategy):
    rows, offsets, sizes, B = random_layout(3)
    N = rows.shape[1]
    exchange_kw = dict(axis_name="expert", buffer_size=B, exchange=strategy)

    def there_and_back(x, off, size):
        recv = exchange(x, off, size, **exchange_kw)
        return exchange(recv * 2.0, off, size, reverse=True, num_rows=N, **exchange_kw)

    back = per_device(there_and_back, rows, offsets, sizes)
    sent = np.zeros(rows.shape[:2], bool)
    for s in range(W):
        for d in range(W):
            sent[s, offsets[s, d]: offsets[s, d] + sizes[s, d]] = True
    np.testing.assert_allclose(np.asarray(back), np.where(sent[..., None], 2 * rows, 0))
    grad = jax.grad(lambda x: jnp.sum(per_device(there_and_back, x, offsets, sizes)))(rows)
    np.testing.assert_allclose(np.asarray(grad), np.where(sent[..., None], 2.0, 0.0) + 0 * rows)


def test_exchange_choice():
    assert default_exchange("cpu") == "padded"
    assert default_exchange("gpu") == "ragged"
    assert default_exchange("tpu") == "ragged"
    assert set(EXCHANGES) >= {"padded", "ragged"}
    with pytest.raises(ValueError, match="exchange='nccl' is invalid"):
        per_device(functools.partial(exchange, axis_name="expert", buffer_size=1,
                                     exchange="nccl"),
                   np.zeros((W, 2, 1), np.float32), np.zeros((W, W), np.int32),
                   np.zeros((W, W), np.int32))
