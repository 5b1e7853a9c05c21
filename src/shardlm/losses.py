"""The language-modelling loss, shared by shardlm's trainer and the library `Trainer` for models placed by a plan.

Cross entropy is computed in float32 whatever the logits' dtype, and averaged over every position: a batch is
[batch, seq_len + 1] tokens, the first seq_len the inputs and the last seq_len the targets.
"""

import jax
import jax.numpy as jnp
import optax


def cross_entropy(logits: jax.Array, targets: jax.Array) -> jax.Array:
    """Mean cross entropy of integer `targets` under `logits` [..., vocab], in float32."""
    return optax.softmax_cross_entropy_with_integer_labels(logits.astype(jnp.float32), targets).mean()


def next_token_loss(model, batch: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of a [batch, seq + 1] token array under `model(inputs) -> logits`."""
    return cross_entropy(model(batch[:, :-1]), batch[:, 1:])
