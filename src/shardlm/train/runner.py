"""`Trainer`: the train step for a model placed by a plan (`shardlm.shard(...).trainer(tx)`).

The optimizer state is created inside `jit` with output shardings derived from the parameters' own
(`optax.tree_map_params`: every moment buffer gets its parameter's sharding, counters are replicated), so it is
sharded from step 0 rather than after a first step and a recompile. The step has explicit input and output
shardings and donates parameters and optimizer state: one compile, no copies, no resharding between steps.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import optax
from jax.sharding import NamedSharding

from shardlm.sharding.rules import replicated
from shardlm.train.step import cross_entropy


def next_token_loss(model: Callable, batch: jax.Array) -> jax.Array:
    """Mean next-token cross entropy of a [batch, seq + 1] token array, in float32."""
    return cross_entropy(model(batch[:, :-1]), batch[:, 1:])


class Trainer:
    def __init__(self, sharded, tx: optax.GradientTransformation, loss_fn: Callable | None = None):
        self.sharded, self.tx = sharded, tx
        self.loss_fn = loss_fn or next_token_loss
        mesh = sharded.mesh
        is_sharding = lambda x: isinstance(x, NamedSharding)  # noqa: E731
        self.opt_shardings = optax.tree_map_params(
            tx, lambda _, sharding: sharding, jax.eval_shape(tx.init, sharded.params), sharded.param_shardings,
            transform_non_params=lambda _: replicated(mesh), is_leaf=is_sharding)
        self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(sharded.params)
        shardings = (sharded.param_shardings, self.opt_shardings, sharded.rest_shardings)
        self._step = jax.jit(self._step_fn(), in_shardings=shardings + (sharded.input_sharding,),
                             out_shardings=shardings + (replicated(mesh),), donate_argnums=(0, 1, 2))
        self.steps_done = 0

    def _step_fn(self):
        sharded, tx, loss_fn = self.sharded, self.tx, self.loss_fn

        def loss_and_rest(params, rest, batch):
            if sharded.kind == "nnx":
                from flax import nnx

                model = nnx.merge(sharded._graphdef, params, rest)
                loss = loss_fn(model, batch)
                return loss, nnx.split(model, nnx.Param, ...)[2]  # RNG counters etc. move on, as in eager NNX
            model = lambda *inputs, **kwargs: sharded.forward(params, rest, *inputs, **kwargs)  # noqa: E731
            return loss_fn(model, batch), rest

        def step(params, opt_state, rest, batch):
            (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(params, rest, batch)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, rest, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

        return step

    def step(self, batch) -> dict[str, Any]:
        """One update on `batch` (split over the mesh by the plan's input spec). Returns {"loss", "grad_norm"}
        as device scalars (the loss before the update), without waiting for them."""
        s = self.sharded
        params, self.opt_state, rest, metrics = self._step(s.params, self.opt_state, s.rest, batch)
        s._set(params, rest)
        self.steps_done += 1
        return metrics

    @property
    def compiles(self) -> int:
        """How many times the step has been compiled (1 after any number of steps with same-shaped batches)."""
        return self._step._cache_size()
