"""Where the fused output head and loss (`shardlm.kernels.fused_head`) runs: its operands' layout under the active
mesh rules, the axes each device's part is summed over, and the `shard_map` that runs it per device. The math, its
tiling and its custom VJP are the kernel's; its design is told there.

Design choices:
- Per device, inside `shard_map`: the weight (or a chunk of it) is gathered over the mesh axes that store the
  embedding dimension (FSDP's), used and dropped; its gradient is reduce-scattered back into the stored shards.
  The weight's embedding axes must split the tokens too, or its gradient could not be reduce-scattered over them:
  a one-line error says so.
- A 1F1B pipeline (`shardlm.schedules.one_f_one_b`) calls the head once per microbatch. With `token_copies` the
  weight arrives as one copy per device of the tokens' mesh axes, gathered once by the caller
  (`sharding.copies_over`), and each device's gradient stays its copy's own until the caller's loop has ended.
- `recording` collects the schedule of every head traced in a block, for the compile report.
- Evaluation and generation keep the plain head (`CausalLM.__call__`): they need logits, or per-token losses.
"""

from __future__ import annotations

import math
from typing import NamedTuple

import jax
from jax.sharding import PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.kernels.fused_head import CHUNK_BYTES, FORWARD_BYTES, Axes, PerDevice, Schedule, schedule_for
from shardlm.sharding import active_mesh, active_spec, active_storage_spec
from shardlm.sharding.rules import as_axes


def head_loss(x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool, vocab_size: int, compute_dtype,
              reduce_dtype=None, chunks: int = 0, budget: int = CHUNK_BYTES, forward_budget: int = FORWARD_BYTES,
              flops_per_byte: float | None = None, token_copies: bool = False, z_loss: bool = False):
    """The mean cross entropy of `targets` [batch, T] under logits x @ head: x [batch, T, embed] (the final norm's
    output, in the compute dtype), `w` the head as stored ([vocab, embed] tied, [embed, vocab] untied). See the
    module docstring. With `token_copies`, `w` is instead one copy per device of the tokens' mesh axes
    ([copies, ...], `sharding.copies_over(w, names, token_axes(x.shape))`), whole over the embedding dimension,
    and each device's gradient stays its copy's own: nothing is gathered or reduced for the weight. The budgets
    and `flops_per_byte` (default: the platform's) choose the schedule (`tiling`). With `z_loss`: (the mean cross
    entropy, the mean of log^2 Z), each differentiable."""
    layout = _layout(x.shape, w.shape, tied=tied, token_copies=token_copies)
    schedule = _schedule(layout, compute_dtype, chunks, budget, forward_budget, flops_per_byte)
    for record in _RECORDS:
        record.append(schedule)
    head = PerDevice(schedule, tied=tied, vocab_size=vocab_size, compute_dtype=compute_dtype,
                      reduce_dtype=reduce_dtype, n_tokens=targets.size, axes=layout.axes, z_loss=z_loss)
    run = lambda x, w, t: head.loss(x, w[0] if token_copies else w, t)  # noqa: E731
    if layout.mesh is None:
        return run(x, w, targets)
    return jax.shard_map(run, mesh=layout.mesh, in_specs=layout.specs, out_specs=(P(), P()) if z_loss else P())(
        x, w, targets)


def plan(x_shape: tuple, w_shape: tuple, *, tied: bool, compute_dtype, chunks: int = 0, budget: int = CHUNK_BYTES,
         forward_budget: int = FORWARD_BYTES, flops_per_byte: float | None = None, token_copies: bool = False
         ) -> Schedule:
    """The schedule `head_loss` runs for these shapes under the active mesh rules, on the platform being compiled
    for (what `explain` and the compile report say)."""
    layout = _layout(x_shape, w_shape, tied=tied, token_copies=token_copies)
    return _schedule(layout, compute_dtype, chunks, budget, forward_budget, flops_per_byte)


def _schedule(layout: _Layout, compute_dtype, chunks: int, budget: int, forward_budget: int,
              flops_per_byte: float | None) -> Schedule:
    """The schedule for what each device holds under `layout`, on the platform being compiled for."""
    rows, tokens, d = layout.per_device
    return schedule_for(rows, tokens, d, compute_dtype, chunks, budget, forward_budget, flops_per_byte)


_RECORDS: list[list[Schedule]] = []


class recording:
    """`with recording() as traced:` collects the `Schedule` of every `head_loss` traced in the block (the compile
    report says which schedule its step compiled with)."""

    def __enter__(self) -> list[Schedule]:
        self.traced: list[Schedule] = []
        _RECORDS.append(self.traced)
        return self.traced

    def __exit__(self, *exc) -> None:
        _RECORDS.remove(self.traced)


def token_axes(shape: tuple) -> tuple[str, ...]:
    """The mesh axes (of more than one device) that split the tokens of a head input of `shape` [batch, T, embed]
    under the active rules: those a `token_copies` head's copies are one per device of. () outside them."""
    mesh = active_mesh()
    if mesh is None:
        return ()
    spec = active_spec("batch", "seq", "act_embed", shape=shape)
    return tuple(a for entry in spec[:2] for a in as_axes(entry) if mesh.shape[a] > 1)


class _Layout(NamedTuple):
    mesh: object  # None outside a mesh
    specs: tuple  # x's, w's and the targets' partition specs, inside the mesh
    axes: Axes
    per_device: tuple[int, int, int]  # a device's vocabulary rows, tokens and embedding width (whole)


def _layout(x_shape: tuple, w_shape: tuple, *, tied: bool, token_copies: bool) -> _Layout:
    """Where the head's operands live under the active rules, and so what each device holds and sums over."""
    mesh = active_mesh()
    w_shape = w_shape[1:] if token_copies else w_shape
    vocab_dim, d = (w_shape[0], w_shape[1]) if tied else (w_shape[1], w_shape[0])
    tokens = x_shape[0] * x_shape[1]
    if mesh is None:
        return _Layout(None, (), Axes((), (), ()), (vocab_dim, tokens, d))
    names = ("vocab", "embed") if tied else ("embed", "vocab")
    x_spec = active_spec("batch", "seq", "act_embed", shape=x_shape)
    w_spec = active_storage_spec(*names, shape=w_shape)
    live = lambda entry: tuple(a for a in as_axes(entry) if mesh.shape[a] > 1)  # noqa: E731
    size = lambda axes: math.prod(mesh.shape[a] for a in axes)  # noqa: E731
    token = token_axes(x_shape)
    vocab_entry, embed_entry = (w_spec[0], w_spec[1]) if tied else (w_spec[1], w_spec[0])
    if token_copies:  # each device's own copy, whole over the embedding dimension
        axes = Axes(token, live(vocab_entry), (), other_token=())
        w_spec = P(token or None, *((axes.vocab or None, None) if tied else (None, axes.vocab or None)))
    else:
        axes = Axes(token, live(vocab_entry), live(embed_entry))
        missing = set(axes.embed) - set(token)
        if missing:  # the weight's gradient is reduce-scattered over its embed axes, which must hold other tokens
            raise ShardlmError(f"the output head's embedding dimension is split over {sorted(missing)}, which do "
                               "not split the batch; the fused loss needs the rule table's embed axes to split "
                               "tokens")
        w_spec = P(*(live(entry) or None for entry in w_spec))
    # size-1 axes split nothing, and would only type the values as varying over them
    x_spec = P(*(live(entry) or None for entry in x_spec))
    return _Layout(mesh, (x_spec, w_spec, P(x_spec[0], x_spec[1])), axes,
                   (vocab_dim // size(axes.vocab), tokens // size(token), d))
