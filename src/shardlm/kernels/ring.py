"""Ring attention over the context axis (Liu et al. 2023), with the zigzag layout that balances the causal work
(Llama 3's and torchtitan's context parallelism). Called per device, inside `shard_map` over the context axes.

Design choices:
- Each device holds its queries, keys and values for its part of the sequence. The key/value chunks travel around
  the ring by `ppermute`: at step s a device attends its queries to the chunk that started s devices before it,
  while the next chunk is already on its way (the permute does not depend on the step's compute, so XLA's
  scheduler overlaps the two). N devices take N steps and N - 1 permutes; no device ever holds more than two
  chunks of keys and values, nor any [T / N, T] buffer. The steps between the first and the last are a loop, not
  unrolled: what is traced and compiled is one step, whatever N (a ring of 64 compiles as fast as one of 2).
- Partial results merge by their log-sum-exps (`flash.merge`), in float32, and are cast once at the end.
- The zigzag layout balances the causal work. Contiguous chunks would leave device 0 with one chunk of work and
  device N - 1 with N. Here the sequence is cut into 2N chunks and device i holds chunks i and 2N - 1 - i
  (`zigzag_order`; the model permutes its tokens by it once, before the blocks, and back after them). Then every
  step but the first is half a chunk-pair of work on every device: when the keys come from a device j < i, all of
  device i's queries see the first half of them (chunk j) and none the second (2N - 1 - j); when j > i, only the
  second half of the queries (chunk 2N - 1 - i) sees them, all of them. The first step (its own keys) is causal.
  A `lax.cond` on the device's index picks the case, so no step computes a masked-out block.
- The per-chunk kernel is the platform's fused one, behind one interface (`ChunkKernel`): forward gives the output
  and log-sum-exp of queries against a chunk of keys, causal or all visible; backward gives dq, dk, dv given the
  whole row's output and log-sum-exp. Which kernels can be one, and which a pass takes, is the registry's
  (`kernels.registry`): cuDNN's (`kernels.attention`) on NVIDIA GPUs, splash's (`kernels.splash`)
  on TPUs, the blockwise kernel in plain JAX (`kernels.flash`) on the CPU and wherever neither applies. A chunk may
  be any length for the blockwise kernel (it pads the last of its blocks); splash takes chunks that
  `splash.splash_block` can block (multiples of 128), which the model checks before choosing it.
- The backward pass is a ring of its own (a `custom_vjp`; the fused kernels' derivatives do not see the
  log-sum-exp the merge needs). Every step's probabilities are normalised by the whole row's log-sum-exp, so each
  chunk's dq, dk, dv are exact parts of the whole's, and add up. Keys and values travel the ring again, with their
  float32 dk and dv accumulating as they go; after N steps one more permute brings dk and dv home. The saved
  residuals are q, k, v, the output and the log-sum-exp (named for remat policies), nothing of [T / N, T].
"""

from __future__ import annotations

from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from jax.ad_checkpoint import checkpoint_name

from shardlm.kernels.flash import merge


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


class ChunkKernel(NamedTuple):
    """Attention of queries [b, tq, heads, d] against one chunk of keys and values [b, tk, kv_heads, d].
    forward(q, k, v, causal, q_seg, kv_seg) -> (out float32, lse [b, tq, heads] float32); backward(q, k, v, out,
    lse, d_out, causal, q_seg, kv_seg) -> (dq, dk, dv), where out and lse are the whole row's (every chunk's,
    merged). `causal`: within the chunk (tq == tk, the same positions); else every key is visible to every query.
    `q_seg` [b, tq] and `kv_seg` [b, tk]: documents' ids (a key visible only within its query's document), or
    None."""

    forward: Callable
    backward: Callable


def ring_attention(q, k, v, *, axis, devices: int, kernel: ChunkKernel,
                   residual_name: str | None = None, segments=None):
    """One device's part: q [b, t, heads, d], k and v [b, t, kv_heads, d], its rows in the zigzag layout ->
    out [b, t, heads, d] in q's dtype. `axis` names the mesh axes the sequence is split over (`devices` in all),
    inside `shard_map`. `segments` [b, t]: the rows' documents' ids (in the same layout), which travel the ring
    with the keys and values; None: one document. The output and log-sum-exp the backward pass keeps are named
    `residual_name`."""
    ring = _Ring(axis, devices, kernel, q.shape[1] // 2)

    @jax.custom_vjp
    def attend(q, k, v, segments):
        return ring.forward(q, k, v, segments)[0].astype(q.dtype)

    def attend_forward(q, k, v, segments):
        out, lse = ring.forward(q, k, v, segments)
        out = out.astype(q.dtype)
        if residual_name:
            out, lse = checkpoint_name(out, residual_name), checkpoint_name(lse, residual_name)
        return out, (q, k, v, segments, out, lse)

    def attend_backward(saved, d_out):
        q, k, v, segments, out, lse = saved
        return (*ring.backward(q, k, v, segments, out, lse, d_out), None)

    attend.defvjp(attend_forward, attend_backward)
    return attend(q, k, v, segments)


class _Ring(NamedTuple):
    axis: object
    devices: int
    kernel: ChunkKernel
    half: int  # rows per chunk: a device holds two

    def _pass(self, *xs):
        """Each array to the next device of the ring (None stays None). Keys and values are sent for one step
        ahead, before the kernel of the step at hand, so that nothing orders the permute after it."""
        shift = [(i, (i + 1) % self.devices) for i in range(self.devices)]
        return tuple(None if x is None else jax.lax.ppermute(x, self.axis, shift) for x in xs)

    def _earlier(self, step) -> jax.Array:
        """Whether the keys at this step came from a device before this one (else after it)."""
        me = jax.lax.axis_index(self.axis)
        return (me - step) % self.devices < me

    def forward(self, q, k, v, seg=None):
        c, f32 = self.half, jnp.float32
        part = lambda x, rows: None if x is None else x[:, rows]  # noqa: E731

        def earlier(q, k, v, ks):  # every query sees the first half of the keys
            return self.kernel.forward(q, k[:, :c], v[:, :c], False, seg, part(ks, slice(None, c)))

        def later(q, k, v, ks):  # the second half of the queries sees every key
            o, s = self.kernel.forward(q[:, c:], k, v, False, part(seg, slice(c, None)), ks)
            return (jnp.concatenate([jnp.zeros_like(o), o], 1),
                    jnp.concatenate([jnp.full(s.shape, -jnp.inf, f32), s], 1))

        def attend(step, k, v, ks, out, lse):
            o, s = jax.lax.cond(self._earlier(step), earlier, later, q, k, v, ks)
            return merge(out, lse, o.astype(f32), s)

        def step(i, carry):  # keys and values received, sent on before the kernel runs, which they do not wait on
            (k, v, ks), out, lse = carry
            return self._pass(k, v, ks), *attend(i, k, v, ks, out, lse)

        incoming = self._pass(k, v, seg)
        out, lse = self.kernel.forward(q, k, v, True, seg, seg)
        if self.devices > 1:
            incoming, out, lse = self._steps(step, (incoming, out, lse))
            out, lse = attend(self.devices - 1, *incoming, out, lse)  # the last: nothing to send on
        return out, lse

    def backward(self, q, k, v, seg, out, lse, d_out):
        c, f32 = self.half, jnp.float32
        part = lambda x, rows: None if x is None else x[:, rows]  # noqa: E731

        def earlier(q, k, v, ks, out, lse, d_out):
            dq, dk, dv = (g.astype(f32) for g in self.kernel.backward(
                q, k[:, :c], v[:, :c], out, lse, d_out, False, seg, part(ks, slice(None, c))))
            return dq, *(jnp.concatenate([g, jnp.zeros_like(g)], 1) for g in (dk, dv))

        def later(q, k, v, ks, out, lse, d_out):
            dq, dk, dv = (g.astype(f32) for g in self.kernel.backward(
                q[:, c:], k, v, out[:, c:], lse[:, c:], d_out[:, c:], False, part(seg, slice(c, None)), ks))
            return jnp.concatenate([jnp.zeros_like(dq), dq], 1), dk, dv

        def attend(step, k, v, ks, dq, dk, dv):
            dk, dv = self._pass(dk, dv)  # the received chunk's gradients so far, from the device that had it
            parts = jax.lax.cond(self._earlier(step), earlier, later, q, k, v, ks, out, lse, d_out)
            return dq + parts[0], dk + parts[1], dv + parts[2]

        def step(i, carry):
            (k, v, ks), dq, dk, dv = carry
            return self._pass(k, v, ks), *attend(i, k, v, ks, dq, dk, dv)

        incoming = self._pass(k, v, seg)
        grads = self.kernel.backward(q, k, v, out, lse, d_out, True, seg, seg)
        dq, dk, dv = (g.astype(f32) for g in grads)
        if self.devices > 1:
            incoming, dq, dk, dv = self._steps(step, (incoming, dq, dk, dv))
            dq, dk, dv = attend(self.devices - 1, *incoming, dq, dk, dv)
            dk, dv = self._pass(dk, dv)  # home: the chunk that started on the next device
        return dq.astype(q.dtype), dk.astype(k.dtype), dv.astype(v.dtype)

    def _steps(self, step, carry):
        """Steps 1 .. devices - 2 of the ring as a loop (the last one, which sends nothing on, follows it): the
        program holds one step, whatever the ring's length, so that compiling a ring of 64 costs what one of 2
        does (unrolled, a 64-device context split took 15 s to trace and 43 s to compile for gpt2-small)."""
        if self.devices <= 2:
            return carry
        return jax.lax.fori_loop(1, self.devices - 1, step, carry)
