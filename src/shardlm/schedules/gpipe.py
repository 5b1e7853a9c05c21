"""The GPipe schedule (`model.pipeline_schedule=gpipe`): the stacked blocks split into pipeline stages, an SPMD
circular GPipe timetable scanned inside one jitted step, and the pieces the other schedules share.

Layer l of the scanned stack (`shardlm.models.stack`) belongs to stage l // K (K = n_layers / stages layers each):
the stack's leading `layers` axis is what the rule table splits over the `stage` mesh axis, so each stage's
devices hold their K rows and no more. The batch is cut into M microbatches; at iteration t stage s runs its K
layers on microbatch t - s, then every stage hands its output to the next (`jnp.roll` over the stage-sharded
dimension, which XLA compiles to one collective-permute). After M + S - 1 iterations every microbatch has passed
every stage; the (S - 1) / (M + S - 1) of stage-iterations with nothing to do are the bubble.

Design choices, after MaxText's `layers/pipeline.py` and praxis's `LayerwiseShardablePipelined`:
- The schedule is a static table (`pipeline_schedule`: per iteration and stage the microbatch, the repeat,
  whether the stage is active and its first layer; per iteration stage 0's read and write slots), computed in
  NumPy and scanned over. An iteration is named steps: the hand-off (`shift_to_next`), the iteration's inputs
  (`_iteration_inputs`: stage 0 stores what came back and reads its next microbatch), the stage's weights for
  its repeat (`_weights_of_repeat`), and the stages' compute (`_per_stage`).
- One program, not S: the stages are a `vmap` over the stage dimension with `spmd_axis_name` set to the mesh axes
  `layers` maps to, so every activation constraint inside a block keeps its stage split, and the tensor, context,
  data and fsdp splits inside a stage are the blocks' own.
- Circular repeats (R > 1): stage s runs its layers R times per microbatch, one group of K = n_layers / (S R)
  per repeat, and the last stage's output wraps around to stage 0 (the same roll). Stage 0 keeps the microbatches
  in a buffer (`io`, [S, M, ...] stage-sharded: only stage 0's slot is read) where the wrapped-around outputs wait
  until their next repeat and the last repeat's become the result; M >= S keeps a slot from being overwritten
  before it is read. The bubble shrinks to (S - 1) / (M R + S - 1). The model holds its stack as [R, S K, ...]
  in layer order (`stack.in_repeats`), split over the stages on its second axis, so each stage holds its K layers
  of every repeat; the per-stage weights [S, R, K, ...] are a reshape and a swap of two axes, one of them of a
  single row per device (no data moves). A repeat's K layers
  (few: n_layers / (S R)) are unrolled rather than scanned: its weights are a traced slice of [R, K, ...], which
  a scan over K slices again, copying every layer's weights a second time in each iteration (compiled for 64
  H100s, the validation table's 70B at S 4, R 5, K 4 moves 1.3 s less through HBM per step: 6.1 -> 4.8 s). Reading
  each layer in one slice of [R, K, ...] instead is worse (7.9 s): a scan sums the gradient of a weight it closes
  over at the weight's full size in every iteration.
- Bubbles must not poison gradients: an idle stage computes on whatever its input holds (zeros, a stale
  microbatch, or NaN), and although its output is never used, NaN times a zero cotangent is NaN in its weight
  gradient. Its input is replaced by zeros (`jnp.where`, whose gradient to the discarded branch is exactly zero),
  so an idle stage's weight gradients are exact zeros: praxis masks the weights with `stop_gradient` for the same
  reason; masking the input costs an activation-sized select instead of a weight-sized one per iteration.
- FSDP inside a pipeline gathers each stage's weights once per step, before the loop, in the compute dtype, and
  reduce-scatters their gradient once after it: gathered inside the loop, they would be gathered again for every
  microbatch. A weight used whole by every device of a batch split would still have its gradient reduced in every
  iteration (XLA reduces the partial sums of a replicated value where they arise), so the stage's compute is also
  a `vmap` over the F data-parallel replicas (the mesh axes that split the batch), each with its own copy of the
  weights ([S, F, R, K, ...], split over the stages and the replicas: one whole copy per device), and each copy's
  gradient is its device's own partial sum until the copies are summed after the loop.
- A mixture's experts stay split over `expert` inside the loop (the rule table computes `experts` where they are
  stored: `sharding.axes_in_use`), so `expert` is not one of the F replicas: it stays a split of each replica's
  rows, and the stage's dense weights are used whole by every expert device of a replica, their gradients
  reduced over `expert` in every iteration. The experts' own are their devices' own, as outside a pipeline.
- Remat checkpoints the iteration's stage compute as a whole under the model's policy (`shardlm.models.remat`;
  every training step has one, `none` included, so the stage's slice of its weights, indexed by a traced repeat,
  is never kept per iteration): the step keeps one input per stage and iteration and what the policy names (and,
  under a policy that names anything, each layer's input: `remat.policy(block_inputs=True)`), and the backward
  pass recomputes the rest of a stage's K layers at once, holding their activations together. With many layers
  per stage and long sequences that is the step's peak (compiled for 64 H100s, a 70B shape's pp8 x fsdp8 step
  peaks at 89.6 GiB, 10 layers a stage at 4096 tokens), so `remat_unit="layer"` (`model.pipeline_remat=layer`)
  also checkpoints each layer inside the stage: one more forward pass of recomputation (XLA:GPU's FLOPs +19%),
  one layer's activations at a time (the same step peaks at 66.7 GiB). Checkpointing the layers alone, without
  the iteration, would keep every iteration's slice of the stage's weights for the backward pass (hundreds of
  GiB): both or the iteration only. The microbatch bookkeeping around it is linear and saves nothing.
- Dropout: layer l of microbatch m draws from the step's key folded with m, then (with F > 1) the replica f, then l.
- Mixed precision: the stage weights are the blocks' compute copies (`shardlm.models.precision`: bfloat16 where
  the blocks compute in it, float32 for the norms and biases), gathered once before the loop. The weights are a
  constant of the loop, so their gradient is summed over its M R + S - 1 iterations: each weight reaches the
  stored one through a float32 carrier (`sharding.gradient_carrier`), so that sum is float32 where the
  bfloat16 copy's own would be bfloat16 (a float32 accumulator of the gathered weights' size, where gathering
  float32 weights would also double the gathered copy: 8.0 GiB of bfloat16 per device in the 70B plan's pp8 x
  fsdp4 x tp2).
"""

from __future__ import annotations

import contextlib
import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlm.errors import ShardlmError
from shardlm.models import remat
from shardlm.kernels.gradients import with_gradient
from shardlm.models.stack import LAYERS, PER_BATCH, REPEATS, RESIDUAL, Step, add_stats, combine_parts
from shardlm.schedules.spec import PipelineSettings, Schedule, register_schedule
from shardlm.sharding import (
    active_axes,
    active_mesh,
    active_rules,
    axes_in_use,
    constrain,
    gathered_for,
    gradient_carrier,
    replicas_of,
    rules_without,
    use_mesh_rules,
)


def microbatch_count(setting: int, stages: int) -> int:
    """M for `model.pipeline_microbatches=setting` on `stages` stages: the setting, 0 meaning one per stage; 1
    without a pipeline."""
    return (setting or stages) if stages > 1 else 1


def check_pipeline(n_layers: int, batch: int, stages: int, microbatches: int, repeats: int) -> None:
    """One-line errors for a schedule that cannot run: layers not divisible by S R, M not a multiple of S, or a
    batch (per gradient-accumulation step) that does not split into M microbatches. `microbatches` is the
    setting: 0 means one per stage."""
    m = microbatch_count(microbatches, stages)
    setting = f"model.pipeline_microbatches={microbatches}" + ("" if microbatches else f", one per stage: {m}")
    if n_layers % (stages * repeats):
        raise ShardlmError(
            f"model.n_layers={n_layers} does not split into mesh.stage={stages} stages x "
            f"model.pipeline_repeats={repeats} repeats; choose degrees whose product divides {n_layers}")
    if m % stages:
        raise ShardlmError(
            f"{setting} is not a multiple of mesh.stage={stages}; use "
            f"{stages}, {2 * stages}, ... (0 = one per stage)")
    if batch % m:
        raise ShardlmError(
            f"a batch of {batch} sequences (train.batch_size / train.grad_accum) does not split into {m} "
            f"microbatches ({setting}); choose a batch size, accumulation or microbatch count that divides it")


def bubble_fraction(stages: int, microbatches: int, repeats: int = 1) -> float:
    """The share of stage-iterations with nothing to do: (S - 1) / (M R + S - 1)."""
    return (stages - 1) / (microbatches * repeats + stages - 1)


def run_pipeline(blocks, n_layers: int, step: Step, x: jax.Array, *, stages: int, microbatches: int = 0,
                 repeats: int = 1, dropout_key=None, policy=None, remat_unit: str = "iteration", stored=None,
                 idle_input: float = 0.0, stats: dict | None = None) -> tuple[jax.Array, dict]:
    """x [batch, T, D] through the stacked `blocks` split over `stages` (held as [R, S K] with `repeats` > 1),
    `microbatches` at a time (0 = one per stage). `blocks` hold the weights as the blocks use them (their compute
    copies, `shardlm.models.precision`) and `stored` as they are stored (default: `blocks`): the gradients flow to
    the stored ones, summed over the iterations in their dtype. `idle_input` fills the stages' inputs before the
    first microbatch reaches them (a test sets NaN: the gradients must not see it). `policy` rematerialises each
    iteration's stage compute, and with `remat_unit="layer"` each layer inside it too. Returns the output and
    the blocks' statistics (`stats`: their zeros) summed over the layers and over the microbatches, except
    `aux_loss`, a per-batch quantity, which is their mean."""
    m_count = microbatch_count(microbatches, stages)
    check_pipeline(n_layers, x.shape[0], stages, microbatches, repeats)
    schedule = pipeline_schedule(stages, m_count, repeats, n_layers // (stages * repeats))
    replicas, replica_axes = data_replicas(blocks)
    weights = stage_weights(blocks, blocks if stored is None else stored, stages, repeats, replicas, replica_axes)
    one_iteration = _per_stage(nnx.graphdef(blocks), step, policy, remat_unit, replicas, replica_axes,
                               {} if stats is None else stats)

    x_mb = to_microbatches(x, m_count)  # [M, b, T, D]
    io = on_stages(jnp.broadcast_to(x_mb, (stages, *x_mb.shape)), 2)
    out = on_stages(jnp.full((stages, *x_mb.shape[1:]), idle_input, x.dtype), 1)
    first_stage = stage_mask(0, out.shape)  # made once, at the activations' full shape

    def iteration(carry, row: IterationRow):
        out, io, total = carry
        x_in, io = _iteration_inputs(shift_to_next(out), io, row, first_stage)
        out, more = one_iteration(weights, x_in, row, dropout_key)
        return (on_stages(out, 1), io, add_stats(total, jax.tree.map(lambda a: a.sum(0), more))), None

    with jax.named_scope("pipeline"):
        (out, io, total), _ = jax.lax.scan(iteration, (out, io, {} if stats is None else stats), schedule.rows())
        io = store_at_stage0(io, shift_to_next(out), schedule.write_slot[-1], first_stage)
    # summed over the microbatches, parts of the batch: a per-batch loss is their mean
    total = {k: a / schedule.microbatches if k in PER_BATCH else a for k, a in total.items()}
    # stage 0's slots hold the results: sent to every stage once, for the head
    return from_microbatches(io[0]), total


class IterationRow(NamedTuple):
    """One iteration of the schedule, as the scan reads it: per stage [S] (or, inside the vmap over the stages,
    that stage's scalar) what it runs, and for stage 0's buffer which slot it reads and which it writes."""

    microbatch: jax.Array  # int32: the microbatch the stage runs (0 when idle)
    repeat: jax.Array  # int32: the repeat, which K of the stage's layers (0 when idle)
    active: jax.Array  # bool: whether the stage has a microbatch (idle stages compute on zeros)
    first_layer: jax.Array  # int32: the model's index of the first of those K layers (dropout keys)
    read_slot: jax.Array  # int32 scalar: the slot of `io` stage 0 reads its input from
    write_slot: jax.Array  # int32 scalar: the slot the last stage's previous output goes to (-1: none yet)


class Timetable(NamedTuple):
    """The circular GPipe schedule as a static table: row t of each array is iteration t (`pipeline_schedule`)."""

    stages: int
    microbatches: int
    repeats: int
    layers_per_stage: int  # K: each stage's layers per repeat
    microbatch: np.ndarray  # [iterations, S]
    repeat: np.ndarray  # [iterations, S]
    active: np.ndarray  # [iterations, S]
    first_layer: np.ndarray  # [iterations, S]
    read_slot: np.ndarray  # [iterations]
    write_slot: np.ndarray  # [iterations + 1]: the last entry is the store after the loop

    @property
    def iterations(self) -> int:
        return len(self.read_slot)

    def rows(self) -> IterationRow:
        """The table as the scan's inputs (the trailing store is not an iteration's)."""
        return IterationRow(*(jnp.asarray(a) for a in (self.microbatch, self.repeat, self.active, self.first_layer,
                                                        self.read_slot, self.write_slot[:-1])))


def pipeline_schedule(stages: int, microbatches: int, repeats: int, layers_per_stage: int) -> Timetable:
    """S stages, M microbatches, R repeats of K layers: M R + S - 1 iterations. At iteration t stage s runs the
    (t - s)-th of the M R microbatch-repeats (repeat (t - s) // M of microbatch (t - s) mod M) when there is one,
    and is idle otherwise. Stage 0 reads microbatch t mod M from its buffer's slot of that number, which holds the
    input for repeat 0 and then what the last stage returned; the last stage's output of iteration t - 1
    (microbatch-repeat t - S) is stored in its slot at iteration t."""
    s_count, m, r, k = stages, microbatches, repeats, layers_per_stage
    iterations = m * r + s_count - 1
    t, s = np.arange(iterations)[:, None], np.arange(s_count)[None, :]
    done = t - s  # how many microbatch-repeats stage s has finished before iteration t
    active = (done >= 0) & (done < m * r)
    microbatch = np.where(active, done % m, 0).astype(np.int32)
    repeat = np.where(active, done // m, 0).astype(np.int32)
    first_layer = (repeat * s_count * k + s * k).astype(np.int32)
    returned = np.arange(iterations + 1) - s_count  # the microbatch-repeat arriving back at stage 0 at t
    write_slot = np.where(returned >= 0, returned % m, -1).astype(np.int32)
    return Timetable(s_count, m, r, k, microbatch, repeat, active, first_layer,
                    (np.arange(iterations) % m).astype(np.int32), write_slot)


def shift_to_next(out):
    """The hand-off: stage s receives stage s - 1's output, stage 0 the last stage's (a roll over the
    stage-sharded dimension, which XLA compiles to one collective-permute)."""
    return on_stages(jnp.roll(out, 1, axis=0), 1)


def _iteration_inputs(arrived, io, row: IterationRow, first_stage):
    """(every stage's input, the buffer): stage 0 first stores what the last stage returned, then reads its next
    microbatch from its slot; the other stages take what arrived."""
    io = store_at_stage0(io, arrived, row.write_slot, first_stage)
    return on_stages(jnp.where(first_stage, io[:, row.read_slot], arrived), 1), io


def store_at_stage0(io, arrived, write_slot, first_stage):
    """Stage 0's slot `write_slot` of `io` takes `arrived` (the last stage's output: the input of its next repeat,
    or after the last one the result); nothing when the slot is -1. Every stage writes the same slot of its own
    part of `io` (a select keeps the others' as they were), so nothing is indexed along the stage dimension: XLA
    partitions that by gathering the whole buffer over the stages, every iteration."""
    slot = jnp.maximum(write_slot, 0)
    keep = io[:, slot]
    # a scalar predicate (select_n keeps it scalar: `where` would broadcast it, a mask per iteration)
    returned = jax.lax.select_n(write_slot >= 0, keep, jnp.where(first_stage, arrived, keep))
    return on_stages(io.at[:, slot].set(returned), 2)


def data_replicas(blocks) -> tuple[int, tuple[str, ...]]:
    """(how many data-parallel replicas the batch is split into, the mesh axes that split it): 1 and () outside a
    mesh or without a batch split. An axis that also splits a weight as it is used (a mixture's experts over
    `expert`) is not a replica axis: a copy of the weight cannot be whole on each of its devices. It stays a split
    of the rows inside each replica."""
    mesh = active_mesh()
    if mesh is None:
        return 1, ()
    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    weights = jax.tree.leaves(nnx.state(blocks), is_leaf=is_var)
    kept = set().union(*(axes_in_use(_names(v), v.shape) for v in weights))
    axes = tuple(a for a in active_axes("batch") if mesh.shape[a] > 1 and a not in kept)
    return math.prod(mesh.shape[a] for a in axes), axes


def _per_stage(graphdef, step: Step, policy, remat_unit: str, replicas: int, replica_axes, stats_zeros):
    """One iteration: the function of (weights [S, R, K, ...], or [S, F, R, K, ...] with F > 1 replicas, inputs
    [S, b, T, D], the schedule's row, key) that runs every stage's K layers on its microbatch: a `vmap` over the
    stages (`on_every_stage`) of `stage_compute`."""
    return on_every_stage(stage_compute(graphdef, step, policy, remat_unit, replicas, replica_axes, stats_zeros))


PER_STAGE_ROW = IterationRow(0, 0, 0, 0, None, None)  # a row's per-stage entries; the slots are stage 0's business


def on_every_stage(fn, in_axes=(0, 0, PER_STAGE_ROW, None)):
    """`fn` of one stage's arguments, run on every stage at once: a `vmap` over the stage dimension whose
    `spmd_axis_name` is the mesh axes `layers` maps to, so that what a block pins inside keeps its stage split."""
    return jax.vmap(fn, in_axes=in_axes, spmd_axis_name=active_axes(LAYERS))


def stage_compute(graphdef, step: Step, policy, remat_unit: str, replicas: int, replica_axes, stats_zeros):
    """One stage's compute, the function of (its weights [R, K, ...] or [F, R, K, ...], its input [b, T, D], its
    entries of the schedule's row, key) -> (output, statistics): its K layers of the row's repeat on its
    microbatch, checkpointed under `policy`, and with F > 1 replicas a `vmap` over them (each its rows of the
    microbatch, with its own copy of the weights: see `stage_weights`). Weights given as (weights, carriers) take
    their gradient through the carriers; given as (weights, None), their own."""
    mesh, rules = active_mesh(), active_rules()
    # inside the vmap over replicas the batch's mesh axes split the vmapped dimension: no other may take them
    inner_rules = None if rules is None else rules_without(replica_axes, rules)

    def compute(w, x_in, row: IterationRow, key, f):
        """One stage's K layers of its repeat on its microbatch (replica f's rows), or on zeros when idle."""
        x_in = jnp.where(row.active, x_in, jnp.zeros_like(x_in))
        layer_key = None if key is None else jax.random.fold_in(key, row.microbatch)
        if layer_key is not None and replicas > 1:
            layer_key = jax.random.fold_in(layer_key, f)
        rows = _weights_of_repeat(w, row.repeat)

        def layer(carry, xs):
            x, total = carry
            params, k = xs
            index = row.first_layer + k
            rngs = None if layer_key is None else nnx.Rngs(dropout=jax.random.fold_in(layer_key, index))
            x, _, more = step(nnx.merge(graphdef, params), x, rngs, None, index)
            return (x, add_stats(total, more)), None

        if policy is not None and remat_unit == "layer":
            layer = jax.checkpoint(layer, policy=policy, prevent_cse=False)
        with use_mesh_rules(mesh, inner_rules) if mesh is not None else contextlib.nullcontext():
            (out, total), _ = jax.lax.scan(layer, (x_in, stats_zeros), (rows, jnp.arange(_layers(rows))),
                                           unroll=_repeats(w) > 1)  # circular: unrolled (module docstring)
        return out, jax.tree.map(lambda a: jnp.where(row.active, a, jnp.zeros_like(a)), total)  # idle: not counted

    if policy is not None:  # with remat_unit "layer", the layers inside are rematerialised too
        compute = jax.checkpoint(compute, policy=policy, prevent_cse=False)
    if replicas == 1:
        return lambda w, x, row, key: compute(w, x, row, key, 0)
    per_replica = jax.vmap(compute, in_axes=(0, 0, None, None, 0), spmd_axis_name=replica_axes)

    def per_stage_replica(w, x_in, row, key):
        b = x_in.shape[0]
        x_f = x_in.reshape(replicas, b // replicas, *x_in.shape[1:])  # each device's rows: no data moves
        out, more = per_replica(w, x_f, row, key, jnp.arange(replicas))
        return out.reshape(x_in.shape), combine_parts(more)  # the replicas' rows are parts of the batch

    return per_stage_replica


def _weights_of_repeat(w, repeat):
    """A stage's weights for one repeat, [K, ...] of its [R, K, ...], each reaching the stored weight's gradient
    through its carrier (`stage_weights`), or, without carriers, its own."""
    weights, carriers = w
    used = jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), weights)
    return used if carriers is None else jax.tree.map(
        _with_gradient_into, used,
        jax.tree.map(lambda a: jax.lax.dynamic_index_in_dim(a, repeat, 0, keepdims=False), carriers))


def _repeats(w) -> int:
    """R, the repeats of a stage's weights (the leading dimension of their [R, K, ...])."""
    return jax.tree.leaves(w[0])[0].shape[0]


def _layers(rows) -> int:
    """K, the layers of a stage's repeat (the leading dimension of its weights)."""
    return jax.tree.leaves(rows)[0].shape[0]


def stage_weights(blocks, stored, stages: int, repeats: int, replicas: int, replica_axes):
    """(weights, carriers): the stack's parameters as [S, R, K, ...] (a reshape of the rows each stage already holds:
    [S R K] in layer order without repeats, [R, S K] with them), their compute copies gathered over FSDP once for
    the whole step, not once per microbatch, and for each a float32 gradient carrier (`sharding.gradient_carrier`)
    through which its gradient reaches the stored weight: the weights themselves are read without a gradient, so the
    loop sums each weight's gradient over its iterations in float32 (M R + S - 1 of them) where a bfloat16 weight's
    own would be summed in bfloat16. With F > 1 data-parallel replicas, both as [S, F, R, K, ...]: each device's own
    copy (`sharding.replicas_of`), whose gradient it accumulates over every microbatch before the copies' gradients
    are reduce-scattered, once, after the loop."""
    def staged(var):
        a, names = var[...], _names(var)
        staged_names = (LAYERS, None, None, *names[2 if names[0] == REPEATS else 1:])
        if names[0] == REPEATS:  # [R, S K, ...] -> [R, S, K, ...] -> [S, R, K, ...]
            return a.reshape(repeats, stages, a.shape[1] // stages, *a.shape[2:]).swapaxes(0, 1), staged_names
        return a.reshape(stages, repeats, a.shape[0] // (stages * repeats), *a.shape[1:]), staged_names

    def weight(var):
        a, names = staged(var)
        a = jax.lax.stop_gradient(a)  # the gradient goes through the carrier
        return gathered_for(a, names) if replicas == 1 else replicas_of(a, names, replicas, replica_axes)

    def carrier(var):
        return gradient_carrier(*staged(var), replicas, replica_axes)

    is_var = lambda v: isinstance(v, nnx.Variable)  # noqa: E731
    return (jax.tree.map(weight, nnx.state(blocks), is_leaf=is_var),
            jax.tree.map(carrier, nnx.state(stored), is_leaf=is_var))


def _names(var) -> tuple:
    """A stacked weight's logical names (the stack's `layers` first)."""
    return tuple(var.get_metadata().get("out_sharding") or (LAYERS,) + (None,) * (len(var.shape) - 1))


def _with_gradient_into(weight, carrier):
    """`weight`, whose gradient goes to `carrier` instead, cast to the carrier's dtype (`stage_weights`)."""
    dtype = carrier.dtype
    return with_gradient(lambda weight, carrier: weight, lambda _, g: (None, g.astype(dtype)), weight, carrier,
                         saves_inputs=False)


def on_stages(a, lead: int):
    """Pin an array whose first axis is the stage's (then `lead` - 1 unsplit axes) and whose rest is a residual
    stream."""
    return constrain(a, LAYERS, *(None,) * (lead - 1), *RESIDUAL)


def stage_mask(stage: int, shape: tuple) -> jax.Array:
    """True at stage `stage`'s entries of an array of `shape` [S, ...] laid out over the stages, made once at its full
    shape: a `where` inside a loop would broadcast it every iteration, and the backward pass keep each copy."""
    return on_stages(jnp.broadcast_to((jnp.arange(shape[0]) == stage).reshape(-1, *(1,) * (len(shape) - 1)),
                                      shape), 1)


def to_microbatches(x, m: int, names: tuple = RESIDUAL):
    """[B, T, D] -> [M, B / M, T, D] (or, with its logical `names`, any [B, ...]), microbatch i holding rows i,
    M + i, 2M + i, ...: each microbatch spans every batch shard (a row-major split would put a microbatch on a few
    devices)."""
    b = x.shape[0] // m
    return constrain(x.reshape(b, m, *x.shape[1:]).swapaxes(0, 1), None, *names)


def from_microbatches(x_mb):
    """The inverse of `to_microbatches`."""
    m, b = x_mb.shape[:2]
    return constrain(x_mb.swapaxes(0, 1).reshape(m * b, *x_mb.shape[2:]), *RESIDUAL)


def stage_layers(n_layers: int, stages: int, repeats: int = 1) -> list[list[int]]:
    """Which layers each stage holds: [[0, 1], [2, 3]] for 4 layers on 2 stages; with circular repeats, its K of
    every repeat, [[0, 2], [1, 3]] for 4 layers on 2 stages of 2 repeats."""
    k = n_layers // (stages * repeats)
    return [[r * stages * k + s * k + i for r in range(repeats) for i in range(k)] for s in range(stages)]


def layer_ranges(layers: list[int]) -> str:
    """[0, 1, 2, 5, 6] -> '0-2, 5-6'."""
    out, start = [], None
    for i, layer in enumerate(layers):
        if start is None:
            start = layer
        if i + 1 == len(layers) or layers[i + 1] != layer + 1:
            out.append(str(start) if start == layer else f"{start}-{layer}")
            start = None
    return ", ".join(out)


__all__ = ["IterationRow", "PER_STAGE_ROW", "bubble_fraction", "check_pipeline", "data_replicas",
           "from_microbatches", "layer_ranges", "microbatch_count", "on_every_stage", "on_stages",
           "pipeline_schedule", "run_pipeline", "shift_to_next", "stage_compute", "stage_layers",
           "stage_mask", "stage_weights", "store_at_stage0", "to_microbatches"]


# --- the schedule: a model's pass with its blocks pipelined ------------------------------------------------------

def pipelined(model, tokens, rngs, settings: PipelineSettings, head: bool = True):
    """(logits, or with `head=False` the final norm's output; the blocks' statistics) of `model`'s pass with its
    blocks run by `run_pipeline`: the embedding and the head outside the pipeline, computed by every stage's
    devices for their rows. The blocks run on their compute copies, their gradients reaching the stored ones."""
    view = model.compute_view()
    x, ctx, key = view.enter(tokens, rngs)
    x, _ = view.run_prefix(x, ctx, key)  # layers held before the stack (dense ones), outside the stages
    x, stats = run_pipeline(view.blocks, view.n_layers, view.block_step(ctx), x, stages=settings.stages,
                            microbatches=settings.microbatches, repeats=settings.repeats, dropout_key=key,
                            policy=remat.policy(view.remat, view.remat_offload, block_inputs=True),
                            remat_unit=settings.remat_unit(view), stored=model.blocks, stats=view.stats_zeros())
    return view.finish(x, ctx, None, head), stats


def gpipe_loss(model, tokens, targets, rngs, settings: PipelineSettings):
    x, stats = pipelined(model, tokens, rngs, settings, head=False)
    return model.head_loss(x, targets), model.mean_aux(stats)


def gpipe_forward(model, tokens, rngs, settings: PipelineSettings):
    logits, stats = pipelined(model, tokens, rngs, settings)
    return logits, model.mean_aux(stats)


def _holds(stages: int, microbatches: int, repeats: int, n_layers: int) -> str:
    return f"GPipe: each stage holds all {microbatches} microbatches' activations until the backward pass"


GPIPE = register_schedule(Schedule("gpipe", loss=gpipe_loss, forward=gpipe_forward, holds=_holds))
