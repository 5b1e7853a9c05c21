"""Moving a mixture's rows between token order and an exchange buffer by gathers only, forward and backward. Math.

    to_slots(x [T, D], routes, k) -> [M, D]       slot m holds its assignment's token row (zero if empty)
    from_slots(buf [M, D], weights [T, k], routes) -> [T, D] float32      each token's weighted sum over its k
    permute(x [M, ...], perm, inverse) -> x[perm]

Design choices:
- `Routes` pairs the two directions: for each slot of the buffer, the flat assignment it holds (assignment a is
  token a // k's choice a % k) and whether it holds one; for each assignment, its slot and whether it is in this
  buffer (a dropless exchange's later round, or a capacity's drops, leave assignments out). Each direction is a
  gather by one of them, and each is the other's transpose: the gradient of filling slots from tokens sums, per
  token, its k slots' gradients (a gather by the assignments' slots), and the gradient of summing slots into
  tokens reads, per slot, its token's gradient times its weight (a gather by the slots' assignments).
- Why not let autodiff transpose the gathers: it transposes a gather into a scatter-add into zeros, and XLA hoists
  the zeros out of the scan over layers as loop invariants. Compiled for 8 H100s at `benchmarks/moe.py`'s shape,
  those zero buffers, each [T x k, d_model], stayed allocated for the whole step: 0.5 GiB of an expert-parallel
  step's 7.8 GiB peak. A `jnp.where(keep, rows, 0)` does the same (its zero operand is a broadcast XLA hoists), so
  masks multiply instead.
- Empty slots and absent assignments point at row 0 and are multiplied by zero: finite inputs give exact zeros.
"""

from __future__ import annotations

from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp


class Routes(NamedTuple):
    """Which assignment each buffer slot holds, and which slot each assignment is in (see the docstring)."""

    slot_assignment: jax.Array  # [M] int32: the flat assignment index the slot holds (0 when empty)
    slot_used: jax.Array  # [M] bool
    assignment_slot: jax.Array  # [T * k] int32: the slot holding the assignment (0 when not in this buffer)
    assignment_in: jax.Array  # [T * k] bool


def _mask(rows: jax.Array, keep: jax.Array) -> jax.Array:
    return rows * keep.astype(rows.dtype)[:, None]


@partial(jax.custom_vjp, nondiff_argnums=(0,))
def _to_slots(k: int, x, slot_assignment, slot_used, assignment_slot, assignment_in):
    return _mask(x[slot_assignment // k], slot_used)


def _to_slots_fwd(k, x, slot_assignment, slot_used, assignment_slot, assignment_in):
    return _to_slots(k, x, slot_assignment, slot_used, assignment_slot, assignment_in), (assignment_slot,
                                                                                        assignment_in)


def _to_slots_bwd(k, res, g):
    assignment_slot, assignment_in = res
    per_choice = _mask(g[assignment_slot], assignment_in).reshape(-1, k, g.shape[-1])
    return per_choice.sum(1, dtype=jnp.float32).astype(g.dtype), None, None, None, None


_to_slots.defvjp(_to_slots_fwd, _to_slots_bwd)


def to_slots(x: jax.Array, routes: Routes, k: int) -> jax.Array:
    """[T, D] -> [M, D]: each used slot takes its assignment's token row, the others zero."""
    return _to_slots(k, x, *routes)


@jax.custom_vjp
def _from_slots(buf, weights, slot_assignment, slot_used, assignment_slot, assignment_in):
    t, k = weights.shape
    rows = _mask(buf[assignment_slot], assignment_in).astype(jnp.float32).reshape(t, k, -1)
    return jnp.einsum("nkd,nk->nd", rows, weights)


def _from_slots_fwd(buf, weights, slot_assignment, slot_used, assignment_slot, assignment_in):
    y = _from_slots(buf, weights, slot_assignment, slot_used, assignment_slot, assignment_in)
    return y, (buf, weights, slot_assignment, slot_used, assignment_slot, assignment_in)


def _from_slots_bwd(res, g):
    buf, weights, slot_assignment, slot_used, assignment_slot, assignment_in = res
    t, k = weights.shape
    flat_w = weights.reshape(-1)
    g_buf = g[slot_assignment // k] * (flat_w[slot_assignment] * slot_used)[:, None]
    rows = _mask(buf[assignment_slot], assignment_in).astype(jnp.float32).reshape(t, k, -1)
    g_w = jnp.einsum("nkd,nd->nk", rows, g)
    return g_buf.astype(buf.dtype), g_w, None, None, None, None


_from_slots.defvjp(_from_slots_fwd, _from_slots_bwd)


def from_slots(buf: jax.Array, weights: jax.Array, routes: Routes) -> jax.Array:
    """[M, D] and the routing weights [T, k] -> [T, D] float32: each token's weighted sum of its assignments'
    rows (an assignment not in the buffer adds nothing)."""
    return _from_slots(buf, weights, *routes)


@jax.custom_vjp
def permute(x: jax.Array, perm: jax.Array, inverse: jax.Array) -> jax.Array:
    """x[perm] for a permutation `perm` of x's rows whose inverse is `inverse`; its gradient is a gather too."""
    return x[perm]


def _permute_fwd(x, perm, inverse):
    return x[perm], inverse


def _permute_bwd(inverse, g):
    return g[inverse], None, None


permute.defvjp(_permute_fwd, _permute_bwd)


__all__ = ["Routes", "from_slots", "permute", "to_slots"]
