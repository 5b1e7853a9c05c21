"""Exchanging a mixture's routed rows between expert devices: the fixed-size all-to-all, and the ragged one that
sends only the rows in use. Called per device, inside the caller's `shard_map`.

    exchange(blocks [EP, C, ...], axis)                             block i to device i of `axis`
    ragged_exchange(blocks [EP, C, D], sizes [EP], received [EP], axis, expected_rows)

Design choices:
- The same layout both ways: block i of the send buffer goes to device i, and lands in block j of its receive
  buffer when it comes from device j, rows past a block's size zero. The caller's regrouping and its way back do
  not change with the exchange; only what crosses the links does. The ragged form sends block i's first
  sizes[i] rows (`jax.lax.ragged_all_to_all`, offsets i x C on both sides), where the fixed form sends all C: a
  dropless buffer holds min(EP, E / k) times the rows balanced routing fills, so the links carry that much less.
- XLA:CPU has no `ragged-all-to-all` (its thunk emitter refuses the opcode), so on the CPU `ragged_exchange` runs
  `emulated_ragged_all_to_all`: the primitive's semantics (offsets, sizes, each sender's output offsets) built
  from a fixed all-to-all, gathers and a scatter. The CPU tests run the ragged path through it; the target
  compiles use the primitive.
- The cost model cannot read from the program how many rows a ragged exchange sends: the buffer is the worst
  case. The call carries the rows its caller expects (`ROUTED_SCOPE`) as a frontend attribute, which XLA keeps on
  the collective where it drops the op's name, and `shardlm.perf.hlo` reads it to charge that share of the
  buffer's bytes, as it reads the grouped matmuls' expected rows (`shardlm.kernels.grouped`).
"""

from __future__ import annotations

import re

import jax
import jax.numpy as jnp
from jax.experimental.xla_metadata import set_xla_metadata

EXCHANGES = ("all_to_all", "ragged")  # `model.moe_exchange`'s choices besides auto
ROUTED_SCOPE = "ragged_exchange_routed_{routed}_of_{rows}"  # the rows the caller expects to send, of the buffer's


def routed_share(name: str) -> float | None:
    """From an instruction's attributes (its frontend attributes, or its op name's scopes), the share of a ragged
    exchange's buffer its caller expects to send; None outside one (`ROUTED_SCOPE`)."""
    m = re.search(r"ragged_exchange_routed_(\d+)_of_(\d+)", name)
    return min(1.0, int(m.group(1)) / int(m.group(2))) if m else None


def exchange(blocks: jax.Array, axis: str) -> jax.Array:
    """[EP, ...] -> [EP, ...]: block i goes to device i of `axis`; block j of the result came from device j.
    Its own inverse: exchanging the received blocks returns each to where it came from."""
    return jax.lax.all_to_all(blocks, axis, 0, 0, tiled=True)


def ragged_exchange(blocks: jax.Array, sizes: jax.Array, received: jax.Array, axis: str, *,
                    expected_rows: int | None = None, emulate: bool = False) -> jax.Array:
    """`exchange`, sending only the first sizes[i] rows of block i [EP, C, D] (`received` [EP]: the rows coming
    from each device, its sizes for this one), the rest of the result zero. `expected_rows` (of EP x C) names the
    call for the cost model; `emulate` runs it without the primitive (the CPU)."""
    ep, capacity = blocks.shape[:2]
    flat = blocks.reshape(ep * capacity, *blocks.shape[2:])
    offsets = jnp.arange(ep, dtype=jnp.int32) * capacity  # block i at i x C, in the send and receive buffers
    mine = jnp.full((ep,), jax.lax.axis_index(axis) * capacity, jnp.int32)  # where my block lands on each device
    run = emulated_ragged_all_to_all if emulate else jax.lax.ragged_all_to_all
    scope = ROUTED_SCOPE.format(routed=ep * capacity if expected_rows is None else expected_rows,
                                rows=ep * capacity)
    with jax.named_scope(scope), set_xla_metadata(shardlm_routed=scope):
        out = run(flat, jnp.zeros_like(flat), offsets, sizes.astype(jnp.int32), mine, received.astype(jnp.int32),
                  axis_name=axis)
    return out.reshape(blocks.shape)


def emulated_ragged_all_to_all(operand, output, input_offsets, send_sizes, output_offsets, recv_sizes, *,
                               axis_name: str) -> jax.Array:
    """`jax.lax.ragged_all_to_all`'s semantics from a fixed all-to-all: rows input_offsets[i] ..
    + send_sizes[i] of `operand` go to device i, which writes them into its `output` from output_offsets[i] (an
    offset in the receiver's buffer, chosen by the sender); recv_sizes[j] rows arrive from device j. Each peer's
    rows travel in a block as long as the operand, so this moves more than the primitive would."""
    ep, length = send_sizes.shape[0], operand.shape[0]
    rows = jnp.arange(length, dtype=jnp.int32)
    take = input_offsets[:, None] + rows[None, :]  # [EP, length]: operand rows for each peer
    blocks = jnp.where((rows[None, :] < send_sizes[:, None])[..., None],
                       operand[jnp.clip(take, 0, length - 1)], jnp.zeros((), operand.dtype))
    arrived = jax.lax.all_to_all(blocks, axis_name, 0, 0, tiled=True)  # block j from device j
    at = jax.lax.all_to_all(output_offsets, axis_name, 0, 0, tiled=True)  # where device j put its rows for me
    place = jnp.where(rows[None, :] < recv_sizes[:, None], at[:, None] + rows[None, :], output.shape[0])
    return output.at[place.reshape(-1)].set(arrived.reshape(ep * length, *operand.shape[1:]), mode="drop")


__all__ = ["EXCHANGES", "ROUTED_SCOPE", "emulated_ragged_all_to_all", "exchange", "ragged_exchange", "routed_share"]
