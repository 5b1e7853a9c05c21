"""Moving an array between two layouts by explicit collectives, inside a `shard_map`: each mesh axis moves from the
dimension it splits to the one it should split by an all-to-all, is gathered where it should split nothing, and is
sliced out locally where it should split a dimension it did not.

Why: left to XLA's SPMD partitioner at a `shard_map`'s boundary, a reshard that moves several mesh axes at once (a
weight's [layers, embed/fsdp, mlp/tensor] to whole matrices with the layers split over fsdp x tensor, the layout
Muon's Newton-Schulz iterations need) is one it has no collective for: it replicates the whole tensor on every
device and slices the target out of it ("[SPMD] Involuntary full rematerialization"), which for Llama 3.1 8B
put the whole 7 GiB stacked MLP weight on every device. Moved one axis at a time, every step is a collective
whose bytes are the array's share per device: an all-to-all sends (n-1)/n of it, a gather receives n times it,
a slice moves nothing.

Design choices:
- A layout is a spec's axes per dimension, major first. An axis leaves a dimension only as its minor-most (the
  blocks of the axes before it stay contiguous) and joins one only as its new minor-most, so the plan removes
  axes from the end of a dimension's tuple and appends them to the end of another's. The order of the target's
  axes within a dimension is the plan's own choice (`exchange_plan` returns it): every order gives whole
  matrices, and the order in which axes leave their dimensions is the one whose every step is an all-to-all.
- The way back is the way there reversed, each step inverted (an all-to-all the other way, a gather as a slice,
  a slice as a gather), so an array goes back exactly to the layout it came from.
- An axis the target leaves unsplit makes copies: the devices along it hold the same block and compute the same
  result (a gather there; the slice on the way back moves nothing).
"""

from __future__ import annotations

import dataclasses
import math

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

ALL_TO_ALL, GATHER, SLICE = "all-to-all", "all-gather", "slice"


@dataclasses.dataclass(frozen=True)
class Move:
    """One step of an exchange over mesh axis `axis`: an all-to-all from dimension `dim` (which it leaves) to `to`
    (which it joins), a gather of `dim` over it, or a slice of `dim` over it (no collective)."""

    kind: str
    axis: str
    dim: int
    to: int | None = None

    def inverse(self) -> "Move":
        if self.kind == ALL_TO_ALL:
            return Move(ALL_TO_ALL, self.axis, self.to, self.dim)
        return Move(SLICE if self.kind == GATHER else GATHER, self.axis, self.dim)


def _axes(entry) -> list[str]:
    return [] if entry is None else [entry] if isinstance(entry, str) else list(entry)


def _layout(spec: P, ndim: int, mesh) -> list[list[str]]:
    """`spec` as one list of mesh axes per dimension, leaving out axes of size 1 (they split nothing)."""
    entries = tuple(spec) + (None,) * (ndim - len(spec))
    return [[a for a in _axes(e) if mesh.shape[a] > 1] for e in entries[:ndim]]


def _spec(layout: list[list[str]]) -> P:
    return P(*(None if not axes else axes[0] if len(axes) == 1 else tuple(axes) for axes in layout))


def exchange_plan(source: P, target: P, ndim: int, mesh) -> tuple[tuple[Move, ...], P]:
    """The moves that take an array of `ndim` dimensions laid out by `source` to one whose dimensions are split
    over `target`'s axes (each dimension over the same set), and the layout they end in: `target` with the axes of
    each dimension in the order the moves leave them. All-to-alls wherever an axis can go straight from the
    dimension it splits to one it should; the rest gathered, then sliced where the target splits by them."""
    cur, want = _layout(source, ndim, mesh), [set(axes) for axes in _layout(target, ndim, mesh)]
    moves: list[Move] = []

    def fits(d: int) -> bool:  # dimension d is split by target axes only: an axis may join it
        return set(cur[d]) <= want[d]

    while misplaced := [d for d in range(ndim) if not fits(d)]:
        # an axis that can go straight where it belongs (minor-most where it is, wanted by a dimension that takes
        # it), else the minor-most axis of a misplaced dimension, gathered
        direct = [(d, to) for d in misplaced for to in range(ndim)
                  if to != d and cur[d][-1] in want[to] and fits(to)]
        if direct:
            d, to = direct[0]
            axis = cur[d].pop()
            cur[to].append(axis)
            moves.append(Move(ALL_TO_ALL, axis, d, to))
        else:
            d = misplaced[0]
            moves.append(Move(GATHER, cur[d].pop(), d))
    for d in range(ndim):
        for axis in sorted(want[d] - set(cur[d]), key=mesh.axis_names.index):
            cur[d].append(axis)
            moves.append(Move(SLICE, axis, d))
    return tuple(moves), _spec(cur)


def _groups(moves: tuple[Move, ...]) -> list[tuple[Move, ...]]:
    """`moves` in runs: consecutive all-to-alls into one dimension are one run (one collective), the rest alone."""
    out: list[tuple[Move, ...]] = []
    for m in moves:
        if out and m.kind == ALL_TO_ALL and out[-1][0].kind == ALL_TO_ALL and out[-1][0].to == m.to:
            out[-1] += (m,)
        else:
            out.append((m,))
    return out


def _all_to_all(x: jax.Array, run: tuple[Move, ...], mesh, back: bool = False) -> jax.Array:
    """The all-to-alls of `run` (each axis from its dimension into `run`'s one destination, appended in order) as
    one collective over all their axes, or (`back`) its inverse. A device's block is laid out locally so that one
    all-to-all over the axes together does them all: the destination dimension split into a leading dimension of
    one chunk per device of the group (the axes' linear index, the first major, as the destination takes them),
    and what arrives, one block per source device, put back into the source dimensions, each as its axes split it
    (the axis that left a dimension first was its minor-most)."""
    to, k = run[0].to, len(run)
    axes = tuple(m.axis for m in run)
    sizes = [mesh.shape[a] for a in axes]
    n = math.prod(sizes)
    ndim = x.ndim
    # the order of the group's axes and the array's dimensions once the arrived blocks are in place: each source
    # dimension preceded by the axes that split it, major first
    order = []
    for d in range(ndim):
        order += [i for i in reversed(range(k)) if run[i].dim == d] + [k + d]
    if not back:
        x = x.reshape(x.shape[:to] + (n, x.shape[to] // n) + x.shape[to + 1:])
        x = jnp.moveaxis(x, to, 0)
        x = jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
        x = x.reshape(tuple(sizes) + x.shape[1:]).transpose(order)
        merged, at = [], 0
        for d in range(ndim):  # each dimension's axis blocks and its own rest, one dimension again
            span = 1 + sum(1 for m in run if m.dim == d)
            merged.append(math.prod(x.shape[at:at + span]))
            at += span
        return x.reshape(merged)
    # back: split each source dimension into its axes' blocks and the rest, gather them at the front, one chunk
    # per device of the group, and send each its own
    whole = list(x.shape)
    split = []
    for d in range(ndim):
        factors = [sizes[i] for i in reversed(range(k)) if run[i].dim == d]
        split += factors + [whole[d] // math.prod(factors)]
    x = x.reshape(split).transpose([order.index(j) for j in range(len(order))])
    x = x.reshape((n,) + x.shape[k:])
    x = jax.lax.all_to_all(x, axes, 0, 0, tiled=True)
    x = jnp.moveaxis(x, 0, to)
    return x.reshape(x.shape[:to] + (x.shape[to] * x.shape[to + 1],) + x.shape[to + 2:])


def _one(x: jax.Array, m: Move, mesh) -> jax.Array:
    if m.kind == GATHER:
        return jax.lax.all_gather(x, m.axis, axis=m.dim, tiled=True)
    size = x.shape[m.dim] // mesh.shape[m.axis]
    return jax.lax.dynamic_slice_in_dim(x, jax.lax.axis_index(m.axis) * size, size, axis=m.dim)


def exchange(x: jax.Array, moves: tuple[Move, ...], mesh) -> jax.Array:
    """Apply `moves` to `x`, a device's block inside a `shard_map` over `mesh`: consecutive all-to-alls into one
    dimension as one collective over their axes (the bytes of one all-to-all, (n-1)/n of the block on the wire,
    where one per axis would send each its own share: 3/4 + 1/2 of it over fsdp 4 then tensor 2, 7/8 in one)."""
    for run in _groups(moves):
        x = _all_to_all(x, run, mesh) if run[0].kind == ALL_TO_ALL else _one(x, run[0], mesh)
    return x


def exchange_back(x: jax.Array, moves: tuple[Move, ...], mesh) -> jax.Array:
    """Undo `moves`: `x` back to the layout they started from."""
    for run in reversed(_groups(moves)):
        x = _all_to_all(x, run, mesh, back=True) if run[0].kind == ALL_TO_ALL else _one(x, run[0].inverse(), mesh)
    return x


def exchange_bytes(moves: tuple[Move, ...], block_bytes: int, mesh) -> dict[str, int]:
    """Bytes per device each kind of collective moves for `moves` on a block of `block_bytes`, as
    `shardlm.perf.hlo` counts them (an all-to-all's operand, a gather's result)."""
    out: dict[str, int] = {}
    for run in _groups(moves):
        m = run[0]
        if m.kind == ALL_TO_ALL:
            out[ALL_TO_ALL] = out.get(ALL_TO_ALL, 0) + block_bytes
        elif m.kind == GATHER:
            block_bytes *= mesh.shape[m.axis]
            out[GATHER] = out.get(GATHER, 0) + block_bytes
        else:
            block_bytes //= mesh.shape[m.axis]
    return out
