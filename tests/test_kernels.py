"""The attention kernels below the models (`shardlm.kernels`), against XLA's attention on the same inputs: ring
attention over 2, 4 and 8 simulated devices in the zigzag layout with each per-chunk kernel the ring can run here
(the blockwise kernel in plain JAX, and Pallas's splash kernel interpreted, the TPU's), forward and gradient, and
the zigzag permutation's round trip."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from jax.sharding import Mesh
from jax.sharding import PartitionSpec as P

from shardlm.kernels.attention import xla_attention
from shardlm.kernels.ring import chunk_kernel, from_zigzag, ring_attention, to_zigzag, zigzag_order


def _inputs(length: int, heads: int = 4, kv_heads: int = 2, head_dim: int = 64):
    """Queries, grouped-query keys and values, and a cotangent, float32 [2, length, heads, head_dim]."""
    ks = jax.random.split(jax.random.key(0), 4)
    q, w = (jax.random.normal(key, (2, length, heads, head_dim)) for key in (ks[0], ks[3]))
    k, v = (jax.random.normal(key, (2, length, kv_heads, head_dim)) for key in ks[1:3])
    return q, k, v, w


@pytest.mark.parametrize("kernel, devices, length", [("flash", 2, 64), ("flash", 4, 128), ("flash", 8, 256),
                                                     ("splash", 2, 512)])
def test_ring_attention_matches_xla_attention_forward_and_backward(kernel, devices, length):
    """Blocks of 16 for the blockwise kernel (several per chunk), 128 for splash (its lane width: 2 per chunk)."""
    q, k, v, w = _inputs(length)
    mask = jnp.tril(jnp.ones((length, length), bool))[None, None]
    mesh = Mesh(np.array(jax.devices()[:devices]), ("context",))
    chunk = chunk_kernel(kernel, block=128 if kernel == "splash" else 16, interpret=True)
    per_device = jax.shard_map(lambda q, k, v: ring_attention(q, k, v, axis=("context",), devices=devices,
                                                              kernel=chunk),
                               mesh=mesh, in_specs=(P(None, "context"),) * 3, out_specs=P(None, "context"),
                               check_vma=False)

    def ring(q, k, v):
        zig = lambda x: to_zigzag(x, devices)  # noqa: E731
        return (from_zigzag(per_device(zig(q), zig(k), zig(v)), devices) * w).sum()

    want, want_grads = jax.value_and_grad(lambda q, k, v: (xla_attention(q, k, v, mask) * w).sum(),
                                          argnums=(0, 1, 2))(q, k, v)
    got, got_grads = jax.jit(jax.value_and_grad(ring, argnums=(0, 1, 2)))(q, k, v)
    assert abs(float(got - want)) <= 1e-5 * abs(float(want))
    for name, a, b in zip("qkv", want_grads, got_grads):
        assert float(jnp.abs(a - b).max()) <= 1e-5 * float(jnp.abs(a).max()), name


def test_the_zigzag_layout_is_a_permutation_and_round_trips():
    x = jnp.arange(2 * 48 * 3).reshape(2, 48, 3)
    for devices in (1, 2, 4, 8):
        order = zigzag_order(48, devices)
        assert sorted(order.tolist()) == list(range(48))
        np.testing.assert_array_equal(to_zigzag(x, devices), x[:, order])
        np.testing.assert_array_equal(from_zigzag(to_zigzag(x, devices), devices), x)
    # device i holds chunks i and 2N - 1 - i of 2N: with 4 devices of 12 rows, device 1 holds 6..11 and 36..41
    assert zigzag_order(48, 4)[12:24].tolist() == list(range(6, 12)) + list(range(36, 42))
