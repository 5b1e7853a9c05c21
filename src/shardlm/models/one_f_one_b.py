"""The stacked blocks as a one-forward-one-backward (1F1B) pipeline, the head and loss inside it: each microbatch's
backward pass runs as soon as the last stage has its loss, so a stage holds the activations of at most 2S - 1
microbatches where the GPipe schedule (`shardlm.models.pipeline`) holds all M until its backward pass begins.
Math only.

GPipe is one loop that autodiff differentiates as a whole: its backward pass is a second loop that can only start
when the first has ended, so it keeps what the remat policy saves for every microbatch (a 70B shape at 64
microbatches of 8192 tokens needs 455 GiB per H100 without recomputation, `docs/targets.md`). Megatron's and
NeMo's 1F1B interleave the two. Here the interleaving is written out in one SPMD program, as MaxText's and praxis's
GPipe are:
- Tick t: stage s runs the forward pass of microbatch t - s (as GPipe's iteration t) and the backward pass of
  microbatch t - (2S - 2 - s). The last stage's forward output of microbatch t - S + 1 goes through the head and
  loss (`head`, differentiated on the spot), whose input gradient is that stage's backward input in the same
  tick; every other stage's is what the next stage's backward pass handed back (a roll over the stage dimension,
  one collective-permute, as the forward hand-off). Three scans: S - 1 ticks of forward passes only, M ticks of
  both, S - 1 of backward passes only: (M + S - 1) (F + B) in all, GPipe's time.
- A stage's forward pass is `jax.vjp` of its compute (`pipeline.stage_compute`, checkpointed under the model's
  remat policy, so its residuals are what the policy saves, each layer's input and the stage's input); the
  residuals go into per-stage buffers of 2S - 1 slots (microbatch m in slot m mod (2S - 1)) and come back out in
  its backward pass, where `jax.tree.unflatten` rebuilds the pullback from them. A residual that is one of the
  stage's weights (a matmul's, for its input gradient) is not stored: it is the weight, read again. Constants the
  blocks close over (rotary tables; on XLA's attention path the causal mask) are stored with each microbatch's
  residuals: small next to its activations. Every stage writes and reads its own slot, a `vmap`ped index whose
  stage dimension is split over the stages: no data moves.
- Gradients are accumulated by the loop itself, in float32 (the stage weights' into the carriers' layout,
  `pipeline.stage_weights`, which reduce-scatter them into the stored shards once, after the loop), and handed
  to autodiff through a `custom_vjp` whose forward pass runs the whole schedule: what comes after (the embedding,
  a tied table, the parameter updates) is differentiated as usual.
- Idle ticks (a stage before its first or after its last microbatch) compute on zeros and get zero cotangents, so
  their weight gradients are exact zeros (`pipeline.stage_compute`, as GPipe's).
- Dropout draws what GPipe draws (microbatch m's layer l from the step's key folded with m, then l), so the two
  schedules compute the same loss and gradients, up to float summation order.
- The head runs on every stage's devices, on the last stage's output (GPipe's head after its loop does too): its
  FLOPs are repeated S times, and the stage split of the activations is not held after the loop.
- The blocks' statistics (a mixture of experts' load-balancing loss and expert loads) are summed over the stages
  and microbatches as GPipe sums them, and returned beside the loss. The objective is the loss plus
  `stats_weights[k]` times each statistic k (the train step's: the load-balancing loss times its weight), so each
  stage's backward pass gets that weight as its statistics' cotangent; the `custom_vjp` then hands back the
  objective's gradient whatever cotangent the statistics get, which is right for the objective the caller
  named and for no other.
- One repeat per stage: circular repeats (interleaved 1F1B) are refused by `models.config`.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlm.models.pipeline import (
    IterationRow,
    PER_STAGE_ROW,
    check_pipeline,
    data_replicas,
    from_microbatches,
    microbatch_count,
    on_every_stage,
    on_stages,
    pipeline_schedule,
    shift_to_next,
    stage_compute,
    stage_weights,
    store_at_stage0,
    to_microbatches,
)
from shardlm.models.stack import PER_BATCH, RESIDUAL, Step, add_stats
from shardlm.sharding import constrain


def in_flight(stages: int) -> int:
    """How many microbatches' residuals a stage holds at most: 2S - 1 (stage 0's, from its forward pass of a
    microbatch to its backward pass, 2S - 2 ticks later)."""
    return 2 * stages - 1


def run_1f1b(blocks, n_layers: int, step: Step, x: jax.Array, head, head_params, targets: jax.Array, *, stages: int,
             microbatches: int = 0, dropout_key=None, policy=None, remat_unit: str = "iteration", stored=None,
             prepare_head=lambda p: p, stats: dict | None = None, stats_weights: dict | None = None
             ) -> tuple[jax.Array, dict]:
    """The mean loss of `targets` [batch, T] after x [batch, T, D] (the embedding's output) went through the
    stacked `blocks` on `stages` stages, `microbatches` at a time (0 = one per stage), and then through
    `head(prepare_head(head_params), y, targets) -> mean loss` per microbatch (y [b, T, D], the blocks' output;
    `prepare_head` runs once, before the loop, and its gradient once, after it). `blocks` and `stored` as for
    `pipeline.run_pipeline`; `policy`, `remat_unit` and `stats` (the blocks' statistics' zeros) too. Returns the
    loss and the statistics (summed over the layers and microbatches; `PER_BATCH` ones their mean over the
    microbatches). Differentiable in `x`, `head_params` and the stored blocks: the gradient is that of the loss
    plus `stats_weights[k]` times statistic k (module docstring)."""
    m_count = microbatch_count(microbatches, stages)
    check_pipeline(n_layers, x.shape[0], stages, microbatches, 1)
    replicas, replica_axes = data_replicas(blocks)
    weights, carriers = stage_weights(blocks, blocks if stored is None else stored, stages, 1, replicas,
                                      replica_axes)
    stats = {} if stats is None else stats
    compute = stage_compute(nnx.graphdef(blocks), step, policy, remat_unit, replicas, replica_axes, stats)
    ticks = one_f_one_b_ticks(stages, m_count, n_layers // stages)
    # each microbatch's statistics' share of the objective: a per-batch one is the microbatches' mean
    cotangents = {k: (stats_weights or {}).get(k, 0.0) / (m_count if k in PER_BATCH else 1) for k in stats}
    loss, total = _scheduled_loss(compute, head, prepare_head, ticks, stats, cotangents)(
        weights, carriers, head_params, x, targets, dropout_key)
    return loss, {k: a / m_count if k in PER_BATCH else a for k, a in total.items()}


class Ticks(NamedTuple):
    """The 1F1B schedule as a static table, row t of each array tick t (`one_f_one_b_ticks`)."""

    forward: IterationRow  # per stage: the microbatch whose forward pass it runs (GPipe's iteration t)
    forward_slot: np.ndarray  # [ticks, S]: the residual slot its forward pass writes
    backward_active: np.ndarray  # [ticks, S]: whether it has a microbatch's backward pass to run
    backward_slot: np.ndarray  # [ticks, S]: the slot its backward pass reads
    head_microbatch: np.ndarray  # [ticks]: the microbatch whose loss the head takes (-1: none)
    dx_slot: np.ndarray  # [ticks]: the microbatch whose input gradient stage 0 hands back (-1: none)
    stages: int
    microbatches: int

    def rows(self, start: int, stop: int):
        """Ticks start..stop - 1 as a scan's inputs."""
        cut = lambda a: jnp.asarray(np.asarray(a)[start:stop])  # noqa: E731
        return (IterationRow(*(cut(a) for a in self.forward)), cut(self.forward_slot), cut(self.backward_active),
                cut(self.backward_slot), cut(self.head_microbatch), cut(self.dx_slot))


def one_f_one_b_ticks(stages: int, microbatches: int, layers_per_stage: int) -> Ticks:
    """S stages, M microbatches of K layers: M + 2S - 2 ticks. At tick t stage s runs the forward pass of
    microbatch t - s and the backward pass of microbatch t - (2S - 2 - s), each when there is one."""
    s_count, m = stages, microbatches
    ticks, slots = m + 2 * s_count - 2, in_flight(s_count)
    gpipe = pipeline_schedule(s_count, m, 1, layers_per_stage)  # its M + S - 1 iterations are the forward passes
    pad = lambda a: np.concatenate([a, np.zeros((ticks - len(a), *a.shape[1:]), a.dtype)])  # noqa: E731
    t, s = np.arange(ticks)[:, None], np.arange(s_count)[None, :]
    forward = IterationRow(pad(gpipe.microbatch), pad(gpipe.repeat), pad(gpipe.active), pad(gpipe.first_layer),
                           pad(gpipe.read_slot), np.zeros(ticks, np.int32))
    backward = t - (2 * s_count - 2 - s)
    head = np.arange(ticks) - (s_count - 1)
    dx = np.arange(ticks) - (2 * s_count - 2)
    return Ticks(forward, ((t - s) % slots).astype(np.int32), (backward >= 0) & (backward < m),
                 (backward % slots).astype(np.int32), np.where((head >= 0) & (head < m), head, -1).astype(np.int32),
                 np.where(dx >= 0, dx, -1).astype(np.int32), s_count, m)


def _scheduled_loss(compute, head, prepare_head, ticks: Ticks, stats: dict, cotangents: dict):
    """The function of (weights, carriers, head parameters, x, targets, key) -> (loss, statistics) whose forward
    pass runs the schedule and keeps the gradients it found, and whose backward pass hands them on, scaled by the
    loss's cotangent (module docstring)."""

    def run(*args):
        return _run(compute, head, prepare_head, ticks, stats, cotangents, *args)

    @jax.custom_vjp
    def loss(weights, carriers, head_params, x, targets, key):
        return run(weights, head_params, x, targets, key)[0]

    def forward(weights, carriers, head_params, x, targets, key):
        value, gradients = run(weights, head_params, x, targets, key)
        return value, gradients

    def backward(gradients, g):
        g = g[0]  # the loss's; the statistics' are part of the objective already (module docstring)
        d_weights, d_head, dx = (jax.tree.map(lambda a: (a * g).astype(a.dtype), part) for part in gradients)
        return None, d_weights, d_head, dx, None, None

    loss.defvjp(forward, backward)
    return loss


class _Pullback:
    """How a stage's residuals are stored: the pullback's tree, and for each of its leaves the index of the
    stage weight it is (-1: a residual kept in the buffers). Filled in tracing the forward pass, read in tracing
    the backward pass."""

    treedef = None
    weight_index: list[int] = []


def _run(compute, head, prepare_head, ticks: Ticks, stats_zeros: dict, cotangents: dict, weights, stored_head, x,
         targets, key):
    """((loss, statistics), (the stage weights' float32 gradients, the head's, x's)) by the 1F1B schedule."""
    s_count, m_count, slots = ticks.stages, ticks.microbatches, in_flight(ticks.stages)
    pullback = _Pullback()
    head_params, unprepare = jax.vjp(prepare_head, stored_head)

    def forward_on_stage(w, x_in, row, key, buffers, slot):
        (out, more), vjp = jax.vjp(lambda w, x: compute((w, None), x, row, key), w, x_in)
        leaves, pullback.treedef = jax.tree.flatten(vjp)
        weight_ids = {id(leaf): i for i, leaf in enumerate(jax.tree.leaves(w))}
        pullback.weight_index = [weight_ids.get(id(leaf), -1) for leaf in leaves]
        kept = [leaf for leaf, i in zip(leaves, pullback.weight_index) if i < 0]
        if buffers is None:  # `jax.eval_shape` asks what the buffers hold
            return kept
        return out, more, [jax.lax.dynamic_update_index_in_dim(b, r, slot, 0) for b, r in zip(buffers, kept)]

    def backward_on_stage(w, g_in, active, buffers, slot):
        kept = iter([jax.lax.dynamic_index_in_dim(b, slot, 0, keepdims=False) for b in buffers])
        w_leaves = jax.tree.leaves(w)
        leaves = [w_leaves[i] if i >= 0 else next(kept) for i in pullback.weight_index]
        # the statistics' share of the objective, on the stages with a microbatch to run back (zero elsewhere)
        g_stats = {k: jnp.where(active, cotangents[k], 0.0).astype(z.dtype) * jnp.ones_like(z)
                   for k, z in stats_zeros.items()}
        return jax.tree.unflatten(pullback.treedef, leaves)((g_in, g_stats))

    run_forward = on_every_stage(forward_on_stage, in_axes=(0, 0, PER_STAGE_ROW, None, 0, 0))
    run_backward = on_every_stage(backward_on_stage, in_axes=(0, 0, 0, 0, 0))

    x_mb = to_microbatches(x, m_count)  # [M, b, T, D]
    targets_mb = constrain(targets.reshape(targets.shape[0] // m_count, m_count, -1).swapaxes(0, 1),
                           None, "batch", "seq")
    io = on_stages(jnp.broadcast_to(x_mb, (s_count, *x_mb.shape)), 2)
    out = on_stages(jnp.zeros((s_count, *x_mb.shape[1:]), x.dtype), 1)
    is_stage = lambda i: on_stages(jnp.broadcast_to((jnp.arange(s_count) == i)[:, None, None, None],  # noqa: E731
                                                    out.shape), 1)
    first_stage, last_stage = is_stage(0), is_stage(s_count - 1)
    first_row = IterationRow(*(jnp.asarray(np.asarray(a)[0]) for a in ticks.forward))
    residuals = jax.eval_shape(lambda w, x: run_forward(w, x, first_row, key, None, jnp.zeros(s_count, jnp.int32)),
                               weights, out)
    zeros = lambda a, dtype=None: jnp.zeros(a.shape, dtype or a.dtype)  # noqa: E731
    state = _State(out=out, g=zeros(out), dx=zeros(io),
                   buffers=[jnp.zeros((s_count, slots, *r.shape[1:]), r.dtype) for r in residuals],
                   d_weights=jax.tree.map(lambda a: zeros(a, jnp.float32), weights),
                   d_head=jax.tree.map(lambda a: zeros(a, jnp.float32), head_params), loss=jnp.zeros((), jnp.float32),
                   stats=stats_zeros)

    def tick(state: _State, row, forward: bool, backward: bool) -> _State:
        f_row, f_slot, b_active, b_slot, head_mb, dx_slot = row
        if forward:
            x_in = on_stages(jnp.where(first_stage, io[:, f_row.read_slot], shift_to_next(state.out)), 1)
            out, more, buffers = run_forward(weights, x_in, f_row, key, state.buffers, f_slot)
            state = state._replace(out=on_stages(out, 1), buffers=buffers,
                                   stats=add_stats(state.stats, jax.tree.map(lambda a: a.sum(0), more)))
        if not backward:
            return state
        g_in = on_stages(jnp.roll(state.g, -1, axis=0), 1)  # stage s + 1's input gradient comes back to s
        if forward:  # a steady tick: the last stage's output has its loss and its gradient
            y = constrain(state.out[s_count - 1], *RESIDUAL)
            t_mb = jax.lax.dynamic_index_in_dim(targets_mb, jnp.maximum(head_mb, 0), 0, keepdims=False)
            value, (d_head, dy) = jax.value_and_grad(lambda p, y: head(p, y, t_mb) / m_count, argnums=(0, 1))(
                head_params, y)
            state = state._replace(loss=state.loss + value, d_head=_add(state.d_head, d_head))
            g_in = jnp.where(last_stage, jnp.broadcast_to(dy, g_in.shape).astype(g_in.dtype), g_in)
        g_in = on_stages(jnp.where(b_active[:, None, None, None], g_in, jnp.zeros_like(g_in)), 1)
        d_weights, g = run_backward(weights, g_in, b_active, state.buffers, b_slot)
        g = on_stages(g, 1)
        return state._replace(g=g, d_weights=_add(state.d_weights, d_weights),
                              dx=store_at_stage0(state.dx, g, dx_slot, first_stage))

    phases = ((0, s_count - 1, True, False), (s_count - 1, m_count + s_count - 1, True, True),
              (m_count + s_count - 1, m_count + 2 * s_count - 2, False, True))
    with jax.named_scope("pipeline"):
        for start, stop, forward, backward in phases:
            if stop > start:
                state, _ = jax.lax.scan(lambda c, r, f=forward, b=backward: (tick(c, r, f, b), None), state,
                                        ticks.rows(start, stop))
    (d_head,) = unprepare(jax.tree.map(lambda d, p: d.astype(p.dtype), state.d_head, head_params))
    return (state.loss, state.stats), (state.d_weights, d_head, from_microbatches(state.dx[0]))


class _State(NamedTuple):
    """What the schedule's ticks carry: every stage's last forward output and backward output (its input's
    gradient), stage 0's input gradients [S, M, ...] (only stage 0's slots are read), the residual buffers
    [S, 2S - 1, ...], the float32 gradient sums and the loss."""

    out: jax.Array
    g: jax.Array
    dx: jax.Array
    buffers: list
    d_weights: object
    d_head: object
    loss: jax.Array
    stats: dict


def _add(total, more):
    return jax.tree.map(lambda a, b: a + b.astype(a.dtype), total, more)


__all__ = ["in_flight", "one_f_one_b_ticks", "run_1f1b"]
