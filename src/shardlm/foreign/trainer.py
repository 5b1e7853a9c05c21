"""`Trainer`: the train step for a model placed by a plan (`shardlm.shard(...).trainer(tx)`).

The optimizer state is created inside `jit` with output shardings derived from the parameters' own: every
optimizer-state leaf that mirrors a parameter (same path suffix, same shape: AdamW's moments, any optimizer's
per-parameter buffers, however deeply `chain`/`multi_transform`/`MultiSteps` nest them) gets that parameter's
sharding, and everything else (step counters, Adafactor's factored rows and columns) is replicated. So the state
is sharded from step 0 rather than after a first step and a recompile. The step has explicit input and output
shardings and donates parameters and optimizer state: one compile, no copies, no resharding between steps.

Non-parameter state moves on as it would eagerly: an NNX model's RNG counters and batch statistics are carried
out of the step; a Linen model gets a fresh `dropout` key per step (from `seed` and the step number) and its
non-parameter collections (e.g. `batch_stats`) are applied as mutable and kept.
"""

from __future__ import annotations

from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from shardlm.foreign.activations import constrained
from shardlm.foreign.placement import opt_state_shardings
from shardlm.losses import next_token_loss
from shardlm.sharding.rules import replicated
from shardlm.trees import signature


class Trainer:
    def __init__(self, sharded, tx: optax.GradientTransformation, loss_fn: Callable | None = None, seed: int = 0):
        self.sharded, self.tx = sharded, tx
        self.loss_fn = loss_fn or next_token_loss
        self.mesh = sharded.mesh
        params = sharded.params
        self.opt_shardings = opt_state_shardings(jax.eval_shape(tx.init, params), params, sharded.param_shardings,
                                                 self.mesh)
        self.opt_state = jax.jit(tx.init, out_shardings=self.opt_shardings)(params)
        self.seed = seed
        self.steps_done = 0
        self.compiles = 0  # traces of the step (each one a compile): 1 after any number of same-shaped batches
        self._compiled: dict = {}

    def _step_fn(self, graphdef):
        sharded, tx, loss_fn = self.sharded, self.tx, self.loss_fn
        base_key = jax.random.key(self.seed)

        def loss_and_rest(params, rest, batch, step_index):
            if sharded.kind == "nnx":
                from flax import nnx

                # Fresh variables in this trace: NNX refuses to update (RNG counts, batch statistics) variables
                # created outside it.
                model = nnx.merge(graphdef, params, jax.tree.map(lambda x: x, rest))
                with constrained(model, sharded.plan, sharded.mesh):
                    loss = loss_fn(adapted(model), batch)
                return loss, nnx.split(model, nnx.Param, ...)[2]
            updated = dict(rest)
            rngs = {"dropout": jax.random.fold_in(base_key, step_index)}

            def model(*inputs, **kwargs):
                variables = {"params": params, **rest}
                if not rest:
                    return sharded.model.apply(variables, *inputs, rngs=rngs, **kwargs)
                out, new = sharded.model.apply(variables, *inputs, rngs=rngs, mutable=list(rest), **kwargs)
                updated.update(new)
                return out

            with constrained(sharded.model, sharded.plan, sharded.mesh):
                return loss_fn(adapted(model), batch), updated

        def adapted(model):
            """The model through the shard's `call` adapter, if it has one (the NNX module itself otherwise)."""
            return model if sharded.call is None else (lambda *inputs, **kw: sharded.call(model, *inputs, **kw))

        def step(params, opt_state, rest, batch, step_index):
            self.compiles += 1  # runs once per trace
            (loss, rest), grads = jax.value_and_grad(loss_and_rest, has_aux=True)(params, rest, batch, step_index)
            updates, opt_state = tx.update(grads, opt_state, params)
            params = optax.apply_updates(params, updates)
            return params, opt_state, rest, {"loss": loss, "grad_norm": optax.tree.norm(grads)}

        return step

    def _compiled_step(self, graphdef, batch):
        """One jitted step per (module mode, batch structure and shapes); normally exactly one."""
        key = (graphdef, signature(batch))
        if key not in self._compiled:
            s = self.sharded
            state = (s.param_shardings, self.opt_shardings, s.rest_shardings)
            self._compiled[key] = jax.jit(
                self._step_fn(graphdef),
                in_shardings=state + (s.batch_shardings(batch), replicated(self.mesh)),
                out_shardings=state + (replicated(self.mesh),), donate_argnums=(0, 1, 2))
        return self._compiled[key]

    def explanation(self):
        """Where every parameter and optimizer-state leaf lives: `shardlm.explain(trainer)`."""
        return self.sharded.explanation(self.opt_state)

    def step(self, batch) -> dict[str, Any]:
        """One update on `batch` (split over the mesh by the plan's input spec). Returns {"loss", "grad_norm"}
        as device scalars (the loss before the update), without waiting for them."""
        s = self.sharded
        if s.kind == "nnx":
            graphdef, params, rest = s._split()  # the module's current mode (train()/eval()) and state
        else:
            graphdef, params, rest = None, s.params, s.rest
        step_index = jax.device_put(jnp.asarray(self.steps_done, jnp.int32), replicated(self.mesh))
        params, self.opt_state, rest, metrics = self._compiled_step(graphdef, batch)(
            params, self.opt_state, rest, batch, step_index)
        s._set(params, rest)
        self.steps_done += 1
        return metrics
