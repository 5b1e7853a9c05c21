"""The jitted train and eval steps: explicit input/output shardings, donated state, no host round-trip.

A batch is [batch, seq_len + 1] tokens; inputs are the first seq_len, targets the last seq_len. The loss is the
mean next-token cross entropy in float32. With `train.grad_accum=K` the step runs the batch as K microbatches
in a scan and averages their gradients (`accumulated_grads`); evaluation runs the whole batch at once. Dropout
keys are derived from (seed, optimizer step), so a run is a pure function of its config and resumption needs no
RNG state. The model's forward pass is its source's (`train.source`): shardlm's own model under the rule table, or
a model from the user's file under its plan's constraints; the step around it is the same. A mixture of experts'
load-balancing loss joins the objective (times `model.moe_aux_loss_weight`); the logged `loss` stays the cross
entropy, and the step also logs `aux_loss` and the experts' loads.
"""

from functools import partial

import jax
import jax.numpy as jnp
import optax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.accelerator import SEQUENCE_PARALLEL_GPU_OPTIONS, current
from shardlm.errors import ShardlmError
from shardlm.models.layers import LAYER_LOADS
from shardlm.models.precision import add_gradients, gradient_zeros
from shardlm.sharding import replicated, use_mesh_rules
from shardlm.train.balance import balance_experts
from shardlm.train.source import model_source
from shardlm.train.spikes import guard_metrics


# The tests' hook: a function of the optimizer's step index (0 for step 1) giving a factor for that step's loss
# (a spike on demand, `shardlm.train.spikes`), set before a step is built; None in every run.
LOSS_HOOK = None


def make_train_step(train_state, mesh, batch_sharding, schedule, seed: int, loss_of, grad_accum: int = 1,
                    loss_weights: dict | None = None, name: str = "step", compiler_options: dict | None = None,
                    cast_once=None, bias_rate: float = 0.0, separator: int | None = None):
    """The jitted train step. `loss_of(model, batch, mesh, key=...) -> (loss, stats)` is the model's training loss
    as its source computes it (`train.source`): the forward pass with its dropout and activation constraints, the
    next-token cross entropy (shardlm's models fuse it with the head), and a mixture of experts' statistics
    (`model_metrics`). The statistics named in `loss_weights` join the objective times their weights (a
    mixture's load-balancing loss `aux_loss`, multi-token prediction's `mtp_loss`). The logged `loss` is the
    cross entropy alone. With `bias_rate`, the routers' balancing biases move after the update from the step's
    per-layer loads (`shardlm.train.balance`). `name` (an identifier) names the jitted function, and so the program and the op_name
    of every instruction XLA compiles of it ("jit(step)/..."): a plan names each strategy's step, so that what XLA
    logs about an instruction says which step it is in (`shardlm.perf.xla_log`). `compiler_options`: XLA options
    this step compiles with, over the process's (`step_compiler_options`). `cast_once(model, params)`: the
    parameters as the microbatches of `grad_accum` differentiate them (the source's, `train.source`; default:
    as they are). `separator`: the documents' separator token, for attention within each document of a row
    (`loss_of` takes it; None: across them)."""
    graphdef = train_state.graphdef
    documents = {} if separator is None else {"separator": separator}
    param_shardings = nnx.filter_state(train_state.shardings["model"], nnx.Param)  # what gradients are taken of
    base_key = jax.random.key(seed)

    def loss_fn(model, tokens, key, scale=None):
        # Keys and RNG streams are made inside the differentiated function: NNX refuses RNG state created at
        # another trace level.
        loss, stats = loss_of(model, tokens, mesh, key=key, **documents)
        if scale is not None:  # the tests' spike (`LOSS_HOOK`)
            loss = loss * scale
        with jax.named_scope("loss"):
            objective = loss + sum(w * stats[k] for k, w in (loss_weights or {}).items() if k in stats)
        loads = {LAYER_LOADS: stats[LAYER_LOADS]} if bias_rate and LAYER_LOADS in stats else {}
        return objective, {"loss": loss, "objective": objective, **model_metrics(stats, loss_weights), **loads}

    def step(state, batch):
        objects = nnx.merge(graphdef, state)
        model, optimizer = objects["model"], objects["optimizer"]
        step_index = optimizer.step[...]
        dropout_key = jax.random.fold_in(base_key, step_index)

        hooked = partial(loss_fn, scale=LOSS_HOOK(step_index)) if LOSS_HOOK else loss_fn
        with use_mesh_rules(mesh):
            if grad_accum == 1:
                (_, metrics), grads = nnx.value_and_grad(hooked, has_aux=True)(model, batch, dropout_key)
            else:
                metrics, grads = accumulated_grads(hooked, model, batch, dropout_key, grad_accum, param_shardings,
                                                   batch_sharding, cast_once)
        # Each gradient sharded like its parameter, before anything reads it: left to propagation, XLA all-reduced
        # FSDP's full gradients (to take the norm of the whole tensor on every device) and sliced them afterwards,
        # twice the traffic of the reduce-scatter this constraint allows (`shardlm plan` counts it from the HLO).
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        with jax.named_scope("optimizer"):
            metrics = {**metrics, "grad_norm": optax.tree.norm(grads), "lr": schedule(step_index)}
            # the spike guard (`shardlm.train.spikes`) reads the loss and the norm before clipping
            optimizer.update(model, grads, loss=metrics["loss"], grad_norm=metrics["grad_norm"])
            metrics.update(guard_metrics(nnx.as_pure(optimizer.opt_state)))
        if LAYER_LOADS in metrics:
            # Only an applied update moves the balancing biases: a step the guard skipped leaves the run as the
            # run that never saw its batch, the biases (and so the next routing) included. The guard's streak of
            # skips is 0 exactly after an applied update.
            applied = metrics["skip_streak"] == 0 if "skip_streak" in metrics else True
            with jax.named_scope("balance"):
                balance_experts(model, metrics.pop(LAYER_LOADS), bias_rate, applied)
        return nnx.state(objects), metrics

    step.__name__ = step.__qualname__ = name
    return jax.jit(
        step,
        in_shardings=(train_state.shardings, batch_sharding),
        out_shardings=(train_state.shardings, replicated(mesh)),
        donate_argnums=0,
        compiler_options=compiler_options or None,
    )


def step_compiler_options(cfg, platform: str | None = None) -> dict:
    """The XLA options `cfg`'s train step compiles with on `platform` (default: the one being compiled for)
    beyond the platform's own (`accelerator.GPU_COMPILER_OPTIONS`): none, except on GPUs under sequence
    parallelism (`accelerator.SEQUENCE_PARALLEL_GPU_OPTIONS`)."""
    platform = platform or current().platform
    return dict(SEQUENCE_PARALLEL_GPU_OPTIONS) if cfg.mesh.sequence_parallel and platform == "gpu" else {}


def model_metrics(stats: dict, loss_weights: dict | None = None) -> dict:
    """What a training step logs of the model's statistics, each term either weighted as it enters the objective
    or named as unweighted: the z-loss as it joins the objective (`z_loss`: train.z_loss x the mean of log^2 Z)
    beside its unweighted statistic (`log_z_squared`); multi-token prediction's cross entropy (`mtp_loss`,
    unweighted: a loss per token like `loss`, times model.mtp_loss_weight in the objective); a mixture of experts'
    load-balancing loss (`aux_loss`, unweighted: per sparse layer, 1.0 when perfectly balanced; times
    model.moe_aux_loss_weight in the objective), its busiest and idlest expert's load over the mean load (1.0 each
    when balanced; summed over the sparse layers), the share of its assignments dropped past the exchange's
    capacity (`model.moe_capacity_factor`; 0 when dropless), and the share a dropless exchange sent in rounds
    after its first (`model.moe_dropless=rounds`); nothing for a dense model."""
    extra = {"mtp_loss": stats["mtp_loss"]} if "mtp_loss" in stats else {}
    if "z_loss" in stats:
        extra.update(z_loss=(loss_weights or {}).get("z_loss", 0.0) * stats["z_loss"], log_z_squared=stats["z_loss"])
    if "expert_tokens" not in stats:
        return extra
    tokens = stats["expert_tokens"]
    mean = jnp.maximum(tokens.mean(), 1.0)
    return {"aux_loss": stats["aux_loss"], "expert_load_max": tokens.max() / mean,
            "expert_load_min": tokens.min() / mean,
            "moe_dropped": stats.get("moe_dropped", 0.0) / jnp.maximum(tokens.sum(), 1.0),
            "moe_overflow": stats.get("moe_overflow", 0.0) / jnp.maximum(tokens.sum(), 1.0), **extra}


def accumulated_grads(loss_fn, model, batch, key, k: int, param_shardings, batch_sharding, cast_once=None):
    """(metrics, mean gradient) over `k` equal microbatches of `batch`, run one after another in a `lax.scan`,
    so only one microbatch's activations are alive at a time. `loss_fn(model, tokens, key)` returns (objective,
    metrics); the metrics returned are the microbatches' means. Equal sizes make the mean of the microbatch
    means the full batch's mean: without dropout, the same update as one pass over the whole batch, up to float
    summation order (with dropout, each microbatch draws its own masks; a mixture of experts' load-balancing loss
    is each microbatch's own).

    Microbatch i is rows i, i + k, i + 2k, ...: each device's contiguous block of the batch (its data x fsdp
    shard) holds the same number of rows of every microbatch, so splitting needs no communication. Each
    microbatch's dropout key is the step's key folded with i. The running sum is kept sharded like the
    parameters, so under FSDP every microbatch's gradient is reduce-scattered into it. The model's other variables
    (a user's model's batch statistics, RNG streams) go from microbatch to microbatch in the scan's carry, and the
    model holds the last microbatch's when this returns, as after one pass over the whole batch.

    The microbatches differentiate `cast_once(model, params)` (the parameters cast to the dtype they are computed
    in, where they lie, once for all the microbatches) and their gradients are summed in float32, then cast to
    the parameters' own dtype.
    """
    graphdef, stored, rest = nnx.split(model, nnx.Param, ...)
    params = jax.lax.with_sharding_constraint(cast_once(model, stored), param_shardings) if cast_once else stored
    rows, width = batch.shape
    micro = batch.reshape(rows // k, k, width).swapaxes(0, 1)  # [k, rows / k, width]
    rows = batch_sharding.spec[0]  # each microbatch's rows split as the batch's, each row whole
    micro = jax.lax.with_sharding_constraint(micro, NamedSharding(batch_sharding.mesh, P(None, rows, None)))

    def micro_loss(p, rest, tokens, key):
        # Fresh copies of the other variables in this trace: a model's RNG streams are reseeded and its statistics
        # updated inside it, and NNX refuses to write variables created at another trace level.
        model = nnx.merge(graphdef, p, jax.tree.map(lambda x: x, rest))
        objective, metrics = loss_fn(model, tokens, key)
        return objective, (nnx.split(model, nnx.Param, ...)[2], metrics)

    def micro_step(carry, xs):
        grad_sum, metric_sum, rest = carry
        tokens, i = xs
        (_, (rest, metrics)), grads = jax.value_and_grad(micro_loss, has_aux=True)(params, rest, tokens,
                                                                                  jax.random.fold_in(key, i))
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        return (add_gradients(grad_sum, grads),
                jax.tree.map(jnp.add, metric_sum, metrics), rest), None

    # The running sum is float32 even for bfloat16 parameters, and is cast back once at the end.
    zeros = jax.lax.with_sharding_constraint(gradient_zeros(params), param_shardings)
    metric_zeros = jax.tree.map(lambda a: jnp.zeros(a.shape, a.dtype),
                                jax.eval_shape(lambda: micro_loss(params, rest, micro[0], key)[1][1]))
    (grad_sum, metric_sum, rest), _ = jax.lax.scan(micro_step, (zeros, metric_zeros, rest), (micro, jnp.arange(k)))
    nnx.update(model, rest)
    return jax.tree.map(lambda m: m / k, metric_sum), jax.tree.map(lambda g, p: (g / k).astype(p.dtype), grad_sum,
                                                                  stored)


def make_eval_step(train_state, mesh, batch_sharding, token_bytes, forward, separator: int | None = None):
    """Per batch: the mean loss, and for bits per byte the summed loss (nats) over tokens that spell text and the
    UTF-8 bytes they spell (`token_bytes[id]`, 0 for `<|endoftext|>`): bpb = sum(nats) / (ln 2 * sum(bytes)).
    `forward(model, tokens, mesh, train=False[, separator=])` -> (logits, statistics), the model's forward pass
    in evaluation mode. `separator`: as for `make_train_step`: a step that trains within documents is evaluated
    within them (and with positions restarting at each, where they do), over the same tokens."""
    graphdef = train_state.graphdef
    token_bytes = jnp.asarray(token_bytes, jnp.int32)
    documents = {} if separator is None else {"separator": separator}

    def step(state, batch):
        model = nnx.merge(graphdef, state)["model"]
        targets = batch[:, 1:]
        with use_mesh_rules(mesh):
            out = forward(model, batch[:, :-1], mesh, train=False, **documents)[0]
        losses = optax.softmax_cross_entropy_with_integer_labels(out.astype(jnp.float32), targets)
        nbytes = token_bytes[targets]
        return {"loss": losses.mean(), "nats": jnp.sum(jnp.where(nbytes > 0, losses, 0.0)),
                "bytes": jnp.sum(nbytes)}

    return jax.jit(step, in_shardings=(train_state.shardings, batch_sharding), out_shardings=replicated(mesh))


# The separator a step compiled for its cost alone (a plan, a benchmark on synthetic tokens) is given where it
# attends within documents: any id compiles the same program.
COST_ONLY_SEPARATOR = 0


def documents_separator(cfg, mesh, separator: int | None) -> int | None:
    """The separator `cfg`'s steps on `mesh` attend within documents by: `separator` where they do
    (`train.source.within_documents`), None where they do not. A step that masks documents and is given no
    separator is an error, not token 0 taken silently for one."""
    if not model_source(cfg).documents(mesh):
        return None
    if separator is None:
        raise ShardlmError("this step attends within documents (data.document_mask, or document_positions) and was "
                           "given no separator: pass the tokenizer's (separator=tokenizer.eot_id), or "
                           "COST_ONLY_SEPARATOR for a step compiled for its cost alone")
    return separator


def train_step_for(cfg, train_state, mesh, name: str = "step", separator: int | None = None):
    """The jitted train step exactly as `shardlm train` builds it for `cfg` (plan, bench and profile use it), its
    function called `name` (`make_train_step`). `separator`: the tokenizer's document separator, required where the
    step attends within documents (`documents_separator`)."""
    from shardlm.train.optimizers import make_schedule

    source = model_source(cfg)
    return make_train_step(train_state, mesh, source.batch_sharding(mesh), make_schedule(cfg), cfg.seed,
                           source.loss, cfg.train.grad_accum, source.loss_weights, name,
                           step_compiler_options(cfg), source.cast_once, source.bias_rate,
                           documents_separator(cfg, mesh, separator))


def eval_step_for(cfg, train_state, mesh, token_bytes, separator: int | None = None):
    """The jitted evaluation step exactly as `shardlm train` builds it for `cfg`: within documents where its train
    step is (`separator` as for `train_step_for`)."""
    source = model_source(cfg)
    return make_eval_step(train_state, mesh, source.batch_sharding(mesh), token_bytes, source.forward,
                          documents_separator(cfg, mesh, separator))


def batch_struct(cfg, mesh) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of one global batch of `cfg`: [batch_size, seq_len + 1] int32."""
    return jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                sharding=model_source(cfg).batch_sharding(mesh))
