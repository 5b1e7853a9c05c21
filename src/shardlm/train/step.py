"""The jitted train and eval steps: explicit input/output shardings, donated state, no host round-trip.

A batch is [batch, seq_len + 1] tokens; inputs are the first seq_len, targets the last seq_len. The loss is the
mean next-token cross entropy in float32. Dropout keys are derived from (seed, optimizer step), so a run is a pure
function of its config and resumption needs no RNG state.
"""

import jax
import jax.numpy as jnp
import optax
from flax import nnx

from shardlm.sharding import replicated, use_mesh_rules


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def make_train_step(train_state, mesh, batch_sharding, schedule, seed: int, dropout: bool):
    graphdef = train_state.graphdef
    param_shardings = train_state.shardings["model"]
    base_key = jax.random.key(seed)

    def step(state, batch):
        objects = nnx.merge(graphdef, state)
        model, optimizer = objects["model"], objects["optimizer"]
        step_index = optimizer.step[...]
        dropout_key = jax.random.fold_in(base_key, step_index)

        def loss_fn(model):
            # Built inside the differentiated function: NNX refuses RNG state created at another trace level.
            rngs = nnx.Rngs(dropout=dropout_key) if dropout else None
            logits = model(batch[:, :-1], rngs=rngs)
            with jax.named_scope("loss"):
                return cross_entropy(logits, batch[:, 1:])

        with use_mesh_rules(mesh):
            loss, grads = nnx.value_and_grad(loss_fn)(model)
        # Each gradient sharded like its parameter, before anything reads it: left to propagation, XLA all-reduced
        # FSDP's full gradients (to take the norm of the whole tensor on every device) and sliced them afterwards,
        # twice the traffic of the reduce-scatter this constraint allows (`shardlm plan` counts it from the HLO).
        grads = jax.lax.with_sharding_constraint(grads, param_shardings)
        with jax.named_scope("optimizer"):
            metrics = {"loss": loss, "grad_norm": optax.tree.norm(grads), "lr": schedule(step_index)}
            optimizer.update(model, grads)
        return nnx.state(objects), metrics

    return jax.jit(
        step,
        in_shardings=(train_state.shardings, batch_sharding),
        out_shardings=(train_state.shardings, replicated(mesh)),
        donate_argnums=0,
    )


def make_eval_step(train_state, mesh, batch_sharding, token_bytes):
    """Per batch: the mean loss, and for bits per byte the summed loss (nats) over tokens that spell text and the
    UTF-8 bytes they spell (`token_bytes[id]`, 0 for `<|endoftext|>`): bpb = sum(nats) / (ln 2 * sum(bytes))."""
    graphdef = train_state.graphdef
    token_bytes = jnp.asarray(token_bytes, jnp.int32)

    def step(state, batch):
        model = nnx.merge(graphdef, state)["model"]
        targets = batch[:, 1:]
        with use_mesh_rules(mesh):
            logits = model(batch[:, :-1])
        losses = optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets)
        nbytes = token_bytes[targets]
        return {"loss": losses.mean(), "nats": jnp.sum(jnp.where(nbytes > 0, losses, 0.0)),
                "bytes": jnp.sum(nbytes)}

    return jax.jit(step, in_shardings=(train_state.shardings, batch_sharding), out_shardings=replicated(mesh))


def train_step_for(cfg, train_state, mesh):
    """The jitted train step exactly as `shardlm train` builds it for `cfg` (plan, bench and profile use it)."""
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import make_schedule

    return make_train_step(train_state, mesh, batch_sharding(mesh), make_schedule(cfg), cfg.seed,
                           cfg.model.dropout > 0)


def batch_struct(cfg, mesh) -> jax.ShapeDtypeStruct:
    """Shape, dtype and sharding of one global batch of `cfg`: [batch_size, seq_len + 1] int32."""
    from shardlm.sharding import batch_sharding

    return jax.ShapeDtypeStruct((cfg.train.batch_size, cfg.model.seq_len + 1), jnp.int32,
                                sharding=batch_sharding(mesh))
