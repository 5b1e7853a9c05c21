"""The stacked blocks as a one-forward-one-backward (1F1B) pipeline, the head and loss inside it: each microbatch's
backward pass runs as soon as the last stage has its loss, so a stage holds the activations of at most 2S - 1
microbatches where the GPipe schedule (`shardlm.schedules.gpipe`) holds all M until its backward pass begins.
Math only.

GPipe is one loop that autodiff differentiates as a whole: its backward pass is a second loop that can only start
when the first has ended, so it keeps what the remat policy saves for every microbatch (a 70B shape at 64
microbatches of 8192 tokens needs 455 GiB per H100 without recomputation, `docs/targets.md`). Megatron's and
NeMo's 1F1B interleave the two. Here the interleaving is written out in one SPMD program, as MaxText's and praxis's
GPipe are:
- Tick t: stage s runs the forward pass of microbatch t - s (as GPipe's iteration t) and the backward pass of
  microbatch t - (2S - 2 - s) (without circular repeats; with them, below). The last stage's forward output of
  microbatch t - S + 1 goes through the head and loss (`head`, differentiated on the spot), whose input gradient
  is that stage's backward input in the same tick; every other stage's is what the next stage's backward pass
  handed back (a roll over the stage dimension, one collective-permute, as the forward hand-off). Three scans:
  S - 1 ticks of forward passes only, M ticks of both, S - 1 of backward passes only: (M + S - 1) (F + B) in
  all, GPipe's time.
- A stage's forward pass is `jax.vjp` of its compute (`pipeline.stage_compute`, checkpointed under the model's
  remat policy, so its residuals are what the policy saves, each layer's input and the stage's input); the
  residuals go into per-stage buffers of 2S - 1 slots (microbatch m in slot m mod (2S - 1); with fewer
  microbatches, one each and a spare that idle ticks write) and come back out in
  its backward pass, where `jax.tree.unflatten` rebuilds the pullback from them. A residual that is one of the
  stage's weights (a matmul's, for its input gradient) is not stored: it is the weight, read again. Constants the
  blocks close over (rotary tables; on XLA's attention path the causal mask) are stored with each microbatch's
  residuals: small next to its activations. Every stage writes and reads its own slot, a `vmap`ped index whose
  stage dimension is split over the stages: no data moves.
- Gradients are accumulated by the loop itself, in float32 (the stage weights' into the carriers' layout,
  `pipeline.stage_weights`, which reduce-scatter them into the stored shards once, after the loop), and handed
  to autodiff through a `custom_vjp` whose forward pass runs the whole schedule: what comes after (the embedding,
  a tied table, the parameter updates) is differentiated as usual.
- Idle ticks (a stage before its first or after its last microbatch) compute forward on zeros
  (`pipeline.stage_compute`, as GPipe's) and run a pullback backward with zero cotangents on residuals that are
  finite (a real unit's, or the buffers' zeros), so their weight gradients are exact zeros.
- Dropout draws what GPipe draws (microbatch m's layer l from the step's key folded with m, then l), so the two
  schedules compute the same loss and gradients, up to float summation order.
- The head runs on every stage's devices, on the last stage's output (GPipe's head after its loop does too): its
  FLOPs are repeated S times, and the stage split of the activations is not held after the loop.
- The loss is only ever wanted with its gradient (a training step's objective), so even a call that does not
  differentiate it runs every backward pass.
- The blocks' statistics (a mixture of experts' load-balancing loss and expert loads) are summed over the stages
  and microbatches as GPipe sums them, and returned beside the loss. The objective is the loss plus
  `stats_weights[k]` times each statistic k (the train step's: the load-balancing loss times its weight), so each
  stage's backward pass gets that weight as its statistics' cotangent; the `custom_vjp` then hands back the
  objective's gradient whatever cotangent the statistics get, which is right for the objective the caller
  named and for no other.
- Circular repeats (the stack held as [R, S K]: `stack.in_repeats`) make it Megatron's interleaved 1F1B: the units
  (a microbatch through one repeat's K layers) go in groups of S microbatches through each repeat in turn
  (`one_f_one_b_ticks`), a stage holds at most 2 S R - 1 units (about 2 S microbatches' worth through all its R K
  layers, as without repeats), and the bubble shrinks to (S - 1) / (M R + S - 1), as circular GPipe's does. The
  forward pass differentiates the unit's repeat's weights, sliced out before `jax.vjp`, and the backward pass adds
  their gradient into that repeat's rows of the sums. The head runs only in the ticks that end a microbatch's last
  repeat: the steady ticks come in runs of S with the head and (R - 1) S without (`Ticks.steady_runs`), each run
  its own scan, so that no tick computes a head it discards (a `cond` would run only the branch taken, but a cost
  model that cannot know which charges the larger).
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlm.errors import ShardlmError
from shardlm.kernels.ring import from_zigzag
from shardlm.models import remat
from shardlm.models.head import token_axes
from shardlm.models.precision import add_gradients, gradient_zeros
from shardlm.models.stack import PER_BATCH, RESIDUAL, Step, add_stats
from shardlm.schedules.gpipe import (
    IterationRow,
    PER_STAGE_ROW,
    check_pipeline,
    data_replicas,
    from_microbatches,
    gpipe_forward,
    microbatch_count,
    on_every_stage,
    on_stages,
    shift_to_next,
    stage_compute,
    stage_mask,
    stage_weights,
    store_at_stage0,
    to_microbatches,
)
from shardlm.schedules.spec import PipelineSettings, Schedule, register_schedule
from shardlm.sharding import constrain, copies_over


def in_flight(stages: int, repeats: int = 1) -> int:
    """How many forward passes' residuals a stage holds at most (each a microbatch through K = n_layers / (S R)
    of its layers): 2 S R - 1, stage 0's for its first repeat, from its forward pass to its backward pass,
    2 S R - 2 ticks later. 2S - 1 microbatches without circular repeats."""
    return 2 * stages * repeats - 1


def run_1f1b(blocks, n_layers: int, step: Step, x: jax.Array, head, head_params, targets: jax.Array, *, stages: int,
             microbatches: int = 0, dropout_key=None, policy=None, remat_unit: str = "iteration", stored=None,
             prepare_head=lambda p: p, stats: dict | None = None, stats_weights: dict | None = None,
             repeats: int = 1) -> tuple[jax.Array, dict]:
    """The mean loss of `targets` [batch, T] after x [batch, T, D] (the embedding's output) went through the
    stacked `blocks` on `stages` stages (held as [R, S K] with `repeats` > 1),
    `microbatches` at a time (0 = one per stage), and then through
    `head(prepare_head(head_params), y, targets) -> mean loss` per microbatch (y [b, T, D], the blocks' output;
    `prepare_head` runs once, before the loop, and its gradient once, after it). `blocks` and `stored` as for
    `pipeline.run_pipeline`; `policy`, `remat_unit` and `stats` (the blocks' statistics' zeros) too. Returns the
    loss and the statistics (summed over the layers and microbatches; `PER_BATCH` ones their mean over the
    microbatches). Differentiable in `x`, `head_params` and the stored blocks: the gradient is that of the loss
    plus `stats_weights[k]` times statistic k (module docstring)."""
    m_count = microbatch_count(microbatches, stages)
    check_pipeline(n_layers, x.shape[0], stages, microbatches, repeats)
    replicas, replica_axes = data_replicas(blocks)
    weights, carriers = stage_weights(blocks, blocks if stored is None else stored, stages, repeats, replicas,
                                      replica_axes)
    stats = {} if stats is None else stats
    compute = stage_compute(nnx.graphdef(blocks), step, policy, remat_unit, replicas, replica_axes, stats)
    compute = _one_repeat(compute)
    ticks = one_f_one_b_ticks(stages, m_count, n_layers // (stages * repeats), repeats)
    # each microbatch's statistics' share of the objective: a per-batch one is the microbatches' mean
    cotangents = {k: (stats_weights or {}).get(k, 0.0) / (m_count if k in PER_BATCH else 1) for k in stats}
    repeat_axis = 1 if replicas > 1 else 0  # of a stage's weights: [R, K, ...] or [F, R, K, ...]
    loss, total = _scheduled_loss(compute, head, prepare_head, ticks, stats, cotangents, repeat_axis)(
        weights, carriers, head_params, x, targets, dropout_key)
    return loss, {k: a / m_count if k in PER_BATCH else a for k, a in total.items()}


class Ticks(NamedTuple):
    """The 1F1B schedule as a static table, row t of each array tick t (`one_f_one_b_ticks`). A unit is one
    microbatch through one repeat's K layers of a stage."""

    forward: IterationRow  # per stage: the unit whose forward pass it runs; read_slot: the microbatch stage 0 reads
    forward_slot: np.ndarray  # [ticks, S]: the residual slot its forward pass writes
    reads_batch: np.ndarray  # [ticks]: whether stage 0 starts a microbatch (repeat 0: reads it from the batch)
    backward_active: np.ndarray  # [ticks, S]: whether it has a unit's backward pass to run
    backward_repeat: np.ndarray  # [ticks, S]: that unit's repeat (which K of the stage's layers)
    backward_slot: np.ndarray  # [ticks, S]: the slot its backward pass reads
    head_microbatch: np.ndarray  # [ticks]: the microbatch whose loss the head takes (-1: none)
    dx_slot: np.ndarray  # [ticks]: the microbatch whose input gradient stage 0 hands back (-1: none)
    stages: int
    microbatches: int
    repeats: int
    slots: int  # the residual buffers' slots: one per unit in flight (and with few units a spare for idle passes)

    @property
    def phases(self) -> tuple[tuple[int, int, bool, bool], ...]:
        """(first tick, end, forward passes?, backward passes?): S R - 1 ticks of forward passes only, then both
        until the last forward pass, then backward passes only."""
        s_r, last_forward = self.stages * self.repeats, self.microbatches * self.repeats + self.stages - 1
        return ((0, s_r - 1, True, False), (s_r - 1, last_forward, True, True),
                (last_forward, len(self.dx_slot), False, True))

    def steady_runs(self) -> list[tuple[int, int, bool]]:
        """The steady phase as runs of (first tick, end, whether the head runs): S ticks whose last stage ends a
        microbatch's last repeat, then (R - 1) S that do not and S that do, M / S - 1 times over. One run with the
        head throughout without circular repeats. (Every tick of a run is alike, so that no tick computes a head
        it does not use.)"""
        start, end = self.phases[1][:2]
        if self.repeats == 1:
            return [(start, end, True)]
        s, s_r = self.stages, self.stages * self.repeats
        runs, t = [(start, start + s, True)], start + s
        while t < end:
            runs += [(t, t + s_r - s, False), (t + s_r - s, t + s_r, True)]
            t += s_r
        assert t == end
        return runs

    def rows(self, start: int, stop: int):
        """Ticks start..stop - 1 as a scan's inputs."""
        cut = lambda a: jnp.asarray(np.asarray(a)[start:stop])  # noqa: E731
        return (IterationRow(*(cut(a) for a in self.forward)), cut(self.forward_slot), cut(self.reads_batch),
                cut(self.backward_active), cut(self.backward_repeat), cut(self.backward_slot),
                cut(self.head_microbatch), cut(self.dx_slot))


def one_f_one_b_ticks(stages: int, microbatches: int, layers_per_stage: int, repeats: int = 1) -> Ticks:
    """S stages, M microbatches, R repeats of K layers: M R + S R + S - 2 ticks. The units are taken in groups of
    S microbatches, each group through every repeat in turn (Megatron's interleaved order): forward unit u is
    microbatch g S + j of repeat r for u = g S R + r S + j, and stage s runs it at tick u + s, where the last
    stage's output of its repeat r reaches stage 0 just in time for repeat r + 1. Backward units go through the
    repeats the other way (r = R - 1 - (v mod S R) // S), backward unit v at stage s at tick v + S R - 1 +
    (S - 1 - s): the last stage runs a microbatch's last repeat backward in the tick its forward pass ended,
    and stage 0's output gradient of repeat r reaches the last stage just in time for repeat r - 1. With R = 1:
    stage s runs microbatch t - s forward and t - (2S - 2 - s) backward."""
    s_count, m, r_count, k = stages, microbatches, repeats, layers_per_stage
    s_r, units = s_count * r_count, microbatches * repeats
    live = min(units, in_flight(stages, repeats))  # with few microbatches, fewer than 2 S R - 1 are ever in flight
    ticks = units + s_r + s_count - 2
    t, s = np.arange(ticks)[:, None], np.arange(s_count)[None, :]

    def unit(u, backward: bool):
        """(microbatch, repeat, its forward unit's index) of unit index u."""
        g, rem = np.divmod(np.clip(u, 0, units - 1), s_r)
        j, r = rem % s_count, rem // s_count
        r = r_count - 1 - r if backward else r
        return g * s_count + j, r, g * s_r + r * s_count + j

    u = t - s
    f_active = (u >= 0) & (u < units)
    f_mb, f_repeat, _ = (np.where(f_active, a, 0).astype(np.int32) for a in unit(u, False))
    v = t - (s_r - 1) - (s_count - 1 - s)
    b_active = (v >= 0) & (v < units)
    b_mb, b_repeat, b_unit = (np.where(b_active, a, 0).astype(np.int32) for a in unit(v, True))
    forward = IterationRow(f_mb, f_repeat, f_active, ((f_repeat * s_count + s) * k).astype(np.int32),
                           f_mb[:, 0].copy(), np.zeros(ticks, np.int32))
    head = np.where(f_active[:, -1] & (f_repeat[:, -1] == r_count - 1), f_mb[:, -1], -1).astype(np.int32)
    dx = np.where(b_active[:, 0] & (b_repeat[:, 0] == 0), b_mb[:, 0], -1).astype(np.int32)
    # A unit's slot is its index mod the units in flight: a unit lives at most 2 S R - 2 ticks, one per unit the
    # stage starts, so no live one is overwritten, and an idle forward pass's index writes a slot that is free.
    # With fewer units than that, an idle pass's could be live: it writes a spare slot instead.
    spare = live < in_flight(stages, repeats)
    forward_slot = np.where(f_active | (not spare), u % live, live).astype(np.int32)
    return Ticks(forward, forward_slot, f_active[:, 0] & (f_repeat[:, 0] == 0), b_active, b_repeat,
                 (b_unit % live).astype(np.int32), head, dx, s_count, m, r_count, live + spare)


def _one_repeat(compute):
    """`compute` (`pipeline.stage_compute`) of (weights [R, K, ...] or [F, R, K, ...], x, row, key) as a function
    of the row's repeat's weights alone ([1, K, ...] or [F, 1, K, ...], `_repeat_of`): what a forward pass
    differentiates, so that its residuals hold that repeat's weights, which it does not store."""
    def on_repeat(w, x, row, key):
        return compute((w, None), x, row._replace(repeat=jnp.zeros_like(row.repeat)), key)

    return on_repeat


def _repeat_of(w, repeat, axis: int):
    """One repeat's weights of a stage's [..., R, K, ...], keeping the repeat axis (`axis`) at 1."""
    return jax.tree.map(lambda a: jax.lax.dynamic_slice_in_dim(a, repeat, 1, axis), w)


def _scheduled_loss(compute, head, prepare_head, ticks: Ticks, stats: dict, cotangents: dict, repeat_axis: int):
    """The function of (weights, carriers, head parameters, x, targets, key) -> (loss, statistics) whose forward
    pass runs the schedule and keeps the gradients it found, and whose backward pass hands them on, scaled by the
    loss's cotangent (module docstring)."""

    def run(*args):
        return _run(compute, head, prepare_head, ticks, stats, cotangents, repeat_axis, *args)

    @jax.custom_vjp
    def loss(weights, carriers, head_params, x, targets, key):
        return run(weights, head_params, x, targets, key)[0]

    def forward(weights, carriers, head_params, x, targets, key):
        value, (d_weights, d_head, dx) = run(weights, head_params, x, targets, key)
        # each stage weight's float32 sum in its carrier's dtype: the stored weight's
        return value, (jax.tree.map(lambda d, c: d.astype(c.dtype), d_weights, carriers), d_head, dx)

    def backward(gradients, g):
        g = g[0]  # the loss's; the statistics' are part of the objective already (module docstring)
        d_weights, d_head, dx = (jax.tree.map(lambda a: (a * g).astype(a.dtype), part) for part in gradients)
        return None, d_weights, d_head, dx, None, None

    loss.defvjp(forward, backward)
    return loss


class _Pullback:
    """How a stage's residuals are stored: the pullback's tree, and for each of its leaves the index of the
    stage weight it is (-1: a residual kept in the buffers). Filled in tracing the forward pass, read in tracing
    the backward pass (every trace of the forward pass finds the same)."""

    def __init__(self):
        self.treedef, self.weight_index = None, []


def _run(compute, head, prepare_head, ticks: Ticks, stats_zeros: dict, cotangents: dict, axis: int, weights,
         stored_head, x, targets, key):
    """((loss, statistics), (the stage weights' float32 gradients, the head's, x's)) by the 1F1B schedule."""
    s_count, m_count, slots = ticks.stages, ticks.microbatches, ticks.slots
    head_params, unprepare = jax.vjp(prepare_head, stored_head)
    run_forward, run_backward = _stage_passes(compute, axis, stats_zeros, cotangents)

    x_mb = to_microbatches(x, m_count)  # [M, b, T, D]
    targets_mb = to_microbatches(targets, m_count, ("batch", "seq"))
    io = on_stages(jnp.broadcast_to(x_mb, (s_count, *x_mb.shape)), 2)
    out = on_stages(jnp.zeros((s_count, *x_mb.shape[1:]), x.dtype), 1)
    first_stage, last_stage = stage_mask(0, out.shape), stage_mask(s_count - 1, out.shape)
    first_row = IterationRow(*(jnp.asarray(np.asarray(a)[0]) for a in ticks.forward))
    residuals = jax.eval_shape(lambda w, x: run_forward(w, x, first_row, key, None, jnp.zeros(s_count, jnp.int32)),
                               weights, out)
    zeros = lambda a, dtype=None: jnp.zeros(a.shape, dtype or a.dtype)  # noqa: E731
    state = _State(out=out, g=zeros(out), dx=zeros(io),
                   buffers=[jnp.zeros((s_count, slots, *r.shape[1:]), r.dtype) for r in residuals],
                   d_weights=gradient_zeros(weights), d_head=gradient_zeros(head_params),
                   loss=jnp.zeros((), jnp.float32),
                   stats=stats_zeros)

    def tick(state: _State, row, forward: bool, backward: bool, with_head: bool = False) -> _State:
        f_row, f_slot, reads_batch, b_active, b_repeat, b_slot, head_mb, dx_slot = row
        if forward:  # stage 0 starts a microbatch from the batch, or takes the last stage's output for a repeat
            x_in = on_stages(jnp.where(first_stage & reads_batch, io[:, f_row.read_slot], shift_to_next(state.out)),
                             1)
            out, more, buffers = run_forward(weights, x_in, f_row, key, state.buffers, f_slot)
            state = state._replace(out=on_stages(out, 1), buffers=buffers,
                                   stats=add_stats(state.stats, jax.tree.map(lambda a: a.sum(0), more)))
        if not backward:
            return state
        g_in = on_stages(jnp.roll(state.g, -1, axis=0), 1)  # stage s + 1's input gradient comes back to s
        if with_head:  # the last stage's output ends a microbatch's last repeat: its loss and its gradient
            t_mb = jax.lax.dynamic_index_in_dim(targets_mb, head_mb, 0, keepdims=False)
            value, (d_head, dy) = jax.value_and_grad(lambda p, y: head(p, y, t_mb) / m_count, argnums=(0, 1))(
                head_params, constrain(state.out[s_count - 1], *RESIDUAL))
            state = state._replace(loss=state.loss + value, d_head=add_gradients(state.d_head, d_head))
            g_in = jnp.where(last_stage, jnp.broadcast_to(dy, g_in.shape).astype(g_in.dtype), g_in)
        g_in = on_stages(jnp.where(b_active[:, None, None, None], g_in, jnp.zeros_like(g_in)), 1)
        d_weights, g = run_backward(weights, g_in, b_active, b_repeat, state.buffers, b_slot, state.d_weights)
        g = on_stages(g, 1)
        return state._replace(g=g, d_weights=d_weights, dx=store_at_stage0(state.dx, g, dx_slot, first_stage))

    with jax.named_scope("pipeline"):
        state = _play(ticks, state, tick)
    (d_head,) = unprepare(jax.tree.map(lambda d, p: d.astype(p.dtype), state.d_head, head_params))
    return (state.loss, state.stats), (state.d_weights, d_head, from_microbatches(state.dx[0]))


def _stage_passes(compute, axis: int, stats_zeros: dict, cotangents: dict):
    """(forward, backward), each run on every stage at once: a unit's forward pass (`compute` of its repeat's
    weights), its residuals written into the stage's slot of the buffers, and a unit's backward pass, its
    pullback rebuilt from the residuals in the stage's slot and its weights' gradient added into the repeat's rows
    of the float32 sums (`axis`: the repeat axis of a stage's weights)."""
    pullback = _Pullback()

    def forward_on_stage(w, x_in, row, key, buffers, slot):
        w = _repeat_of(w, row.repeat, axis)
        (out, more), vjp = jax.vjp(lambda w, x: compute(w, x, row, key), w, x_in)
        leaves, pullback.treedef = jax.tree.flatten(vjp)
        weight_ids = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(w))}
        pullback.weight_index = [weight_ids.get(id(leaf), -1) for leaf in leaves]
        kept = [leaf for leaf, i in zip(leaves, pullback.weight_index) if i < 0]
        if buffers is None:  # `jax.eval_shape` asks what the buffers hold
            return kept
        return out, more, [jax.lax.dynamic_update_index_in_dim(b, r, slot, 0) for b, r in zip(buffers, kept)]

    def backward_on_stage(w, g_in, active, repeat, buffers, slot, d_weights):
        kept = iter([jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in buffers])
        w_leaves = jax.tree.leaves(_repeat_of(w, repeat, axis))
        leaves = [w_leaves[i] if i >= 0 else next(kept) for i in pullback.weight_index]
        # the statistics' share of the objective, on the stages with a microbatch to run back (zero elsewhere)
        g_stats = {k: jnp.where(active, cotangents[k], 0.0).astype(z.dtype) * jnp.ones_like(z)
                   for k, z in stats_zeros.items()}
        dw, dx = jax.tree.unflatten(pullback.treedef, leaves)((g_in, g_stats))
        d_weights = jax.tree.map(lambda d, g: jax.lax.dynamic_update_slice_in_dim(
            d, add_gradients(jax.lax.dynamic_slice_in_dim(d, repeat, 1, axis), g), repeat, axis), d_weights, dw)
        return d_weights, dx

    return (on_every_stage(forward_on_stage, in_axes=(0, 0, PER_STAGE_ROW, None, 0, 0)),
            on_every_stage(backward_on_stage, in_axes=(0, 0, 0, 0, 0, 0, 0)))


def _play(ticks: Ticks, state, tick):
    """`tick(state, row, forward, backward, with_head)` over the schedule: a scan over the warm-up's ticks, over
    each run of the steady phase (with circular repeats, one scan over the groups of two runs, whose body traces
    them once) and over the cool-down's."""
    def run(state, rows, forward: bool, backward: bool, with_head: bool = False):
        return jax.lax.scan(lambda c, r: (tick(c, r, forward, backward, with_head), None), state, rows)[0]

    def group(state, rows):
        """A group of S R steady ticks under circular repeats: (R - 1) S without the head, then S with it."""
        return run(run(state, rows[0], True, True), rows[1], True, True, True), None

    def stacked(runs):
        return jax.tree.map(lambda *a: jnp.stack(a), *(ticks.rows(*r[:2]) for r in runs))

    state = run(state, ticks.rows(*ticks.phases[0][:2]), True, False)
    first, *rest = ticks.steady_runs()
    state = run(state, ticks.rows(*first[:2]), True, True, True)
    if rest:
        state = jax.lax.scan(group, state, (stacked(rest[0::2]), stacked(rest[1::2])))[0]
    if ticks.phases[2][1] > ticks.phases[2][0]:
        state = run(state, ticks.rows(*ticks.phases[2][:2]), False, True)
    return state


class _State(NamedTuple):
    """What the schedule's ticks carry: every stage's last forward output and backward output (its input's
    gradient), stage 0's input gradients [S, M, ...] (only stage 0's slots are read), the residual buffers
    [S, slots, ...], the float32 gradient sums, the loss and the blocks' statistics."""

    out: jax.Array
    g: jax.Array
    dx: jax.Array
    buffers: list
    d_weights: object
    d_head: object
    loss: jax.Array
    stats: dict


__all__ = ["in_flight", "one_f_one_b_ticks", "run_1f1b"]


# --- the schedule: the model's training loss with its head inside the pipeline -----------------------------------

def one_f_one_b_loss(model, tokens, targets, rngs, settings: PipelineSettings):
    """The training loss with the head inside a 1F1B pipeline: the embedding first, then `run_1f1b`, whose head per
    microbatch is the final norm (its compute copy) and the fused head and loss on the stored weight, one copy per
    device of a microbatch's tokens. Its gradient is the training objective's: with a mixture of experts, the
    load-balancing loss (the mean over the sparse layers) joins it times `model.moe_aux_loss_weight`, as in the
    train step."""
    head_weight = model.head_weight()
    view = model.compute_view()
    x, ctx, key = view.enter(tokens, rngs)
    x, _ = view.run_prefix(x, ctx, key)  # layers held before the stack (dense ones), outside the stages
    norm_graph, norm_state = nnx.split(view.ln_f)
    names = ("vocab", "embed") if view.lm_head is None else ("embed", "vocab")
    rows = tokens.shape[0] // microbatch_count(settings.microbatches, settings.stages)
    copies = token_axes((rows, *x.shape[1:]))  # a copy of the head per device of a microbatch's tokens

    def head(params, y, t):
        if ctx.zigzag:
            y = constrain(from_zigzag(y, ctx.zigzag), "batch", "seq", "act_embed")
        norm = nnx.merge(norm_graph, params[0])
        y = nnx.remat(lambda ln, y: ln(y), policy=jax.checkpoint_policies.nothing_saveable)(norm, y)
        return view.head_loss(y, t, params[1], token_copies=True)

    stats = view.stats_zeros()
    weights = {"aux_loss": settings.aux_loss_weight / view.sparse_layers()} if stats else {}
    loss, stats = run_1f1b(view.blocks, view.n_layers, view.block_step(ctx), x, head, (norm_state, head_weight),
                           targets, stages=settings.stages, microbatches=settings.microbatches, dropout_key=key,
                           policy=remat.policy(view.remat, view.remat_offload, block_inputs=True),
                           remat_unit=settings.remat_unit(view), stored=model.blocks,
                           prepare_head=lambda p: (p[0], copies_over(p[1], names, copies)), stats=stats,
                           stats_weights=weights, repeats=settings.repeats)
    return loss, view.mean_aux(stats)


def _holds(stages: int, microbatches: int, repeats: int, n_layers: int) -> str:
    units = min(microbatches * repeats, in_flight(stages, repeats))  # a microbatch through one repeat's layers
    return (f"1F1B: each stage holds at most {units} microbatches' activations"
            + (f" through {n_layers // (stages * repeats)} of its layers (interleaved)" if repeats > 1 else ""))


def _check(m) -> None:
    if m.remat_offload:
        raise ShardlmError(f"model.pipeline_schedule=1f1b keeps each microbatch's saved activations in device "
                           f"buffers and cannot offload them (model.remat_offload={m.remat_offload}); drop "
                           "model.remat_offload, or use model.pipeline_schedule=gpipe")


# Evaluation has no backward pass to interleave: GPipe's forward
ONE_F_ONE_B = register_schedule(Schedule("1f1b", loss=one_f_one_b_loss, forward=gpipe_forward, holds=_holds,
                                         head_per_microbatch=True, check=_check))
