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

`save(dir)` and `restore(dir)` use the checkpoints of a run directory (`shardlm.checkpoint`): `dir/checkpoints/
<step>/` with the model's variables (the same tree a `shardlm train` run of the model saves: an NNX module's state
by path, a Linen model's variables dict), the optimizer state, the step and a meta item; written asynchronously
and atomically (an interrupted save is never read), and read back into this trainer's shardings, which may be
another mesh's or another plan's. Restoring the step a save was made at continues exactly where it left off: the
parameters, optimizer state, RNG counters and statistics, and the step count (a Linen model's dropout keys) all
come back.
"""

from __future__ import annotations

from pathlib import Path
from typing import Any, Callable

import jax
import jax.numpy as jnp
import optax

from shardlm.errors import ShardlmError
from shardlm.foreign.activations import constrained
from shardlm.foreign.placement import opt_state_shardings
from shardlm.losses import next_token_loss
from shardlm.sharding.rules import replicated
from shardlm.trees import signature


class Trainer:
    def __init__(self, sharded, tx: optax.GradientTransformation, loss_fn: Callable | None = None, seed: int = 0,
                 keep: int = 3):
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
        self._keep = keep  # checkpoints kept per directory
        self._writers: dict = {}  # directory -> its checkpoint manager, kept open while saves are written

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

    # --- checkpoints -------------------------------------------------------------------------------------------

    def _variables(self) -> dict:
        """The model's variables as one tree of arrays: an NNX module's whole state (parameters, RNG streams,
        statistics) by path, or a Linen model's variables dict."""
        s = self.sharded
        if s.kind == "nnx":
            from flax import nnx

            return nnx.to_pure_dict(nnx.state(s.model))
        return {"params": s.params, **s.rest}

    def _manager(self, directory):
        from shardlm.checkpoint import RunCheckpoints

        key = str(Path(directory).absolute())
        if key not in self._writers:
            self._writers[key] = RunCheckpoints(directory, keep=self._keep)
        return self._writers[key]

    def save(self, directory, *, wait: bool = False) -> int:
        """Start saving the state after `steps_done` steps as `directory/checkpoints/<steps_done>/` (the newest
        `keep` of the trainer's saves are kept); returns the step. The arrays are copied off the devices before
        this returns, so training goes on while the files are written; `wait=True` (or `wait()`) blocks until they
        are. Every process of a multi-process run calls it."""
        import orbax.checkpoint

        import shardlm

        s, step = self.sharded, self.steps_done
        meta = {"step": step, "trainer": {"kind": s.kind, "plan": s.plan.name, "seed": self.seed},
                "mesh": dict(self.mesh.shape), "processes": jax.process_count(),
                "versions": {"shardlm": shardlm.__version__, "jax": jax.__version__,
                             "orbax": orbax.checkpoint.__version__}}
        manager = self._manager(directory)
        if step in manager.steps():
            raise ShardlmError(f"{manager.directory / str(step)} exists already: this trainer saved (or restored) step "
                               f"{step}; save again after more steps, or into another directory")
        manager.save_trees(step, self._variables(), {"opt_state": self.opt_state}, step, meta)
        if wait:
            manager.wait()
        return step

    def wait(self) -> None:
        """Block until every save this trainer started is on disk (a failed write raises here)."""
        for manager in self._writers.values():
            manager.wait()

    def restore(self, directory, step: int | None = None) -> int:
        """Continue from the checkpoint at `step` (default: the newest complete one) in `directory`, reading each
        array straight into this trainer's shardings; returns the step. The model must have the variables that
        were saved (any mesh, any plan)."""
        from shardlm.checkpoint import CheckpointError, RunCheckpoints, checkpoint_dir

        self.wait()
        reader = RunCheckpoints(directory, read_only=True)
        try:
            steps = reader.steps()
            if not steps:
                raise ShardlmError(f"{checkpoint_dir(directory)} holds no complete checkpoint; save one with "
                                   "trainer.save(directory)")
            step = steps[-1] if step is None else step
            if step not in steps:
                raise ShardlmError(f"{checkpoint_dir(directory)} has no checkpoint at step {step}; it has steps "
                                   f"{', '.join(map(str, steps))}")
            try:
                reader.read_meta(step, "trainer")
                target = lambda tree: jax.tree.map(  # noqa: E731
                    lambda x: jax.ShapeDtypeStruct(x.shape, x.dtype, sharding=x.sharding), tree)
                variables, opt = reader.restore_trees(step, target(self._variables()),
                                                      {"opt_state": target(self.opt_state)})
                position = reader.read_position(step)
            except CheckpointError as e:
                raise ShardlmError(f"{e} in {checkpoint_dir(directory)}; restore it into a trainer of the model "
                                   "that saved it") from None
        finally:
            reader.close()
        self._adopt(variables)
        self.opt_state, self.steps_done = opt["opt_state"], position
        return step

    def _adopt(self, variables: dict) -> None:
        s = self.sharded
        if s.kind == "nnx":
            from flax import nnx

            state = nnx.state(s.model)
            nnx.replace_by_pure_dict(state, variables)
            nnx.update(s.model, state)
        else:
            s.set_state(variables["params"], {k: v for k, v in variables.items() if k != "params"})

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
        s.set_state(params, rest)
        self.steps_done += 1
        return metrics
