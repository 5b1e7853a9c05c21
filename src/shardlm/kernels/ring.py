"""Ring attention over the context axis (Liu et al. 2023), with the zigzag layout that balances the causal work
(Llama 3's and torchtitan's context parallelism). Called per device, inside `shard_map` over the context axes.

Design choices:
- Each device holds its queries, keys and values for its part of the sequence. The key/value chunks travel around
  the ring by `ppermute`: at step s a device attends its queries to the chunk that started s devices before it,
  while the next chunk is already on its way (the permute does not depend on the step's compute, so XLA's
  scheduler overlaps the two). N devices take N steps and N - 1 permutes; no device ever holds more than two
  chunks of keys and values, nor any [T / N, T] buffer.
- Partial results merge by their log-sum-exps (`flash.merge`), in float32, and are cast once at the end.
- The per-chunk kernel is causal by position (`flash.blockwise_attention`), so a chunk wholly after the queries
  costs nothing, and the layout decides the balance. Contiguous chunks would leave device 0 with one chunk of
  work and device N - 1 with N. In the zigzag layout the sequence is cut into 2N chunks and device i holds chunks
  i and 2N - 1 - i: every device then has the same work at every step. `zigzag_order` is that permutation of the
  positions; the model permutes its tokens by it once, before the blocks, and back after them.
- The backward pass is the forward's transpose: JAX differentiates the ring, so the cotangents of keys and values
  travel the ring the other way, and each step's kernel runs its own backward pass (flash's, recomputing the
  probabilities). Under a remat policy that keeps none of it, the ring runs again in the backward pass.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
import numpy as np

from shardlm.kernels.flash import BLOCK, blockwise_attention, merge


def zigzag_order(length: int, devices: int) -> np.ndarray:
    """Positions 0..length-1 in the zigzag layout for `devices` devices: device i's contiguous share of the result
    is the sequence's chunks i and 2 * devices - 1 - i of 2 * devices."""
    if length % (2 * devices):
        raise ValueError(f"a sequence of {length} does not cut into {2 * devices} equal chunks")
    chunks = np.arange(length).reshape(2 * devices, -1)
    return np.concatenate([np.concatenate([chunks[i], chunks[2 * devices - 1 - i]]) for i in range(devices)])


def to_zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """`x` with its `axis` (the sequence) in the zigzag order (`zigzag_order`), by reshapes, a flip and a
    transpose (which XLA partitions as an all-to-all) rather than a gather."""
    shape = x.shape
    halves = x.reshape(*shape[:axis], 2, devices, shape[axis] // (2 * devices), *shape[axis + 1:])
    first, second = jnp.take(halves, 0, axis), jnp.flip(jnp.take(halves, 1, axis), axis)
    return jnp.stack([first, second], axis + 1).reshape(shape)


def from_zigzag(x: jax.Array, devices: int, axis: int = 1) -> jax.Array:
    """The inverse of `to_zigzag`: the sequence back in its own order."""
    shape = x.shape
    pairs = x.reshape(*shape[:axis], devices, 2, shape[axis] // (2 * devices), *shape[axis + 1:])
    first, second = jnp.take(pairs, 0, axis + 1), jnp.flip(jnp.take(pairs, 1, axis + 1), axis)
    return jnp.stack([first, second], axis).reshape(shape)


def ring_attention(q, k, v, q_pos, kv_pos, *, axis, devices: int, block: int = BLOCK):
    """One device's part: q [b, t, heads, d], k and v [b, t, kv_heads, d], their positions in the whole sequence
    [t] -> (out [b, t, heads, d] float32, lse [b, t, heads]). `axis` names the mesh axes the sequence is split
    over (`devices` in all), inside `shard_map`."""
    shift = [(i, (i + 1) % devices) for i in range(devices)]
    out = lse = None
    for step in range(devices):
        o, s = blockwise_attention(q, k, v, q_pos, kv_pos, block_q=block, block_k=block)
        out, lse = (o, s) if out is None else merge(out, lse, o, s)
        if step < devices - 1:
            k, v, kv_pos = (jax.lax.ppermute(t, axis, shift) for t in (k, v, kv_pos))
    return out, lse
