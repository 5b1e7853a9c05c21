"""`shard`: apply a plan to a model shardlm did not write, a Flax NNX module or a Flax Linen module + variables.

    sharded = shardlm.shard(model, "megatron", mesh)          # an unannotated nnx.Module (changed in place)
    sharded = shardlm.shard(lambda: MiniGPT(..., rngs=nnx.Rngs(0)), plan, mesh)   # built sharded, never whole
    sharded = shardlm.shard(linen_module, "plans/my.yaml", mesh, variables=init_vars)  # or variables=lambda: ...
    logits = sharded.apply(tokens)                           # jitted forward with the plan's input/output specs
    logits = sharded.apply(tokens, attention_mask=mask)      # array keyword arguments are traced inputs
    trainer = sharded.trainer(optax.adamw(1e-3))             # jitted, donated train step; optimizer state
    metrics = trainer.step(batch)                            #   sharded like its parameters from step 0

    # A model whose call is not `model(tokens) -> logits` (keyword-only inputs, an output object): an adapter
    hf = shardlm.shard(flax_gpt2.module, "fsdp", variables={"params": flax_gpt2.params},
                       call=lambda model, tokens, **kw: model(input_ids=tokens, deterministic=True, **kw).logits)

Both kinds are reduced to the same functional form, (params, rest) trees plus a forward function, so one
resolver, one placement and one train step serve both. `params` are the trainable parameters (NNX `nnx.Param`
variables; Linen's "params" collection); `rest` is every other variable (RNG state, batch statistics), kept whole
on every device. For NNX the module itself is the single source of truth: `params`, `rest` and the module's
mode (`model.eval()` / `model.train()`) are read from it at each call. The plan is checked against the shapes
before anything is placed.

`call(model, *inputs, **kwargs)`, when given, is how the model is run, by `apply` and by the trainer's loss
(`model` is the NNX module, or for Linen a function applying the module to the current variables): it adapts a
model that takes keyword-only inputs or returns an output object to `inputs -> logits`. Keyword arguments of
`apply` that hold arrays are traced inputs (an attention mask), split like the first input when their leading
dimension is its batch; other keyword arguments are static (`deterministic=True`) and key the compile cache.
"""

from __future__ import annotations

import dataclasses
from typing import Any, Callable

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.explanation import Explanation, explain_trees
from shardlm.foreign.activations import check_rules_match, constrained, nnx_module_paths
from shardlm.foreign.layout import Layout
from shardlm.foreign.placement import check_auto_mesh, place, resolve_layout, tree_shardings
from shardlm.foreign.plan import Plan
from shardlm.sharding.rules import as_axes, axis_degree, replicated
from shardlm.trees import path_str, signature

@dataclasses.dataclass
class Sharded:
    """A model placed on a mesh by a plan."""

    kind: str  # "nnx" or "linen"
    mesh: Any
    plan: Plan
    layout: Layout
    param_shardings: Any
    rest_shardings: Any
    _module: Any  # the user's nnx.Module (kept in sync) or the Linen module
    _params: Any = None  # Linen only: NNX state lives in the module
    _rest: Any = None
    _applies: dict = dataclasses.field(default_factory=dict)
    call: Callable | None = None  # call(model, *inputs, **kwargs) -> outputs; None: model(*inputs, **kwargs)

    # --- what the user holds ------------------------------------------------------------------------------------

    @property
    def model(self):
        """NNX: the module, holding the sharded parameters. Linen: the module (its variables are `.variables`)."""
        return self._module

    @property
    def params(self):
        """The sharded parameter tree: NNX `nnx.Param` state, or Linen's "params" collection."""
        return self._split()[1] if self.kind == "nnx" else self._params

    @property
    def rest(self):
        """Every other variable (NNX RNG state and batch statistics, Linen's other collections)."""
        return self._split()[2] if self.kind == "nnx" else self._rest

    @property
    def variables(self) -> dict:
        """Linen: the variables dict, {"params": ..., other collections...}, every leaf sharded."""
        if self.kind != "linen":
            raise ShardlmError("`.variables` is for Linen models; an NNX model's state is `nnx.state(sharded.model)`")
        return {"params": self._params, **self._rest}

    @property
    def specs(self) -> dict[str, Any]:
        return self.layout.specs

    def _split(self):
        from flax import nnx

        return nnx.split(self._module, nnx.Param, ...)

    def set_state(self, params, rest) -> None:
        """Adopt new arrays (after a donated train step) so the user's module never holds deleted buffers."""
        if self.kind == "nnx":
            from flax import nnx

            nnx.update(self._module, params, rest)
        else:
            self._params, self._rest = params, rest

    # --- input and output placement -----------------------------------------------------------------------------

    def io_shardings(self, tree, spec, what: str):
        """The plan's input (or output) spec on every leaf of `tree` with at least that many dimensions (a scalar
        or a short leaf is kept whole), after checking that each split dimension divides evenly."""
        mesh = self.mesh

        def one(path, leaf):
            shape = np.shape(leaf)
            if len(shape) < len(spec):
                return replicated(mesh)
            for dim, entry in enumerate(spec):
                axes, degree = as_axes(entry), axis_degree(mesh, entry)
                if degree > 1 and shape[dim] % degree:
                    name = f"{what} {path_str(path)}" if path else what
                    raise ShardlmError(
                        f"{name} of shape {tuple(shape)}: dimension {dim} (size {shape[dim]}) is split "
                        f"{degree} ways over {' x '.join(axes)} by the plan's {what} spec {spec}; make it a multiple "
                        f"of {degree} (e.g. the batch size), or change the plan's {what}"
                    )
            return NamedSharding(mesh, spec)

        return jax.tree_util.tree_map_with_path(one, tree)

    def batch_shardings(self, batch):
        return self.io_shardings(batch, self.layout.input_spec, "inputs")

    # --- running ------------------------------------------------------------------------------------------------

    def run(self, model, *inputs, **kwargs):
        """`model` run on the inputs, through the `call` adapter if there is one."""
        return self.call(model, *inputs, **kwargs) if self.call is not None else model(*inputs, **kwargs)

    def forward(self, graphdef, params, rest, *inputs, **kwargs):
        """The pure forward pass (no state written back), with the plan's activation constraints."""
        if self.kind == "nnx":
            from flax import nnx

            model = nnx.merge(graphdef, params, rest)
            with constrained(model, self.plan, self.mesh):
                return self.run(model, *inputs, **kwargs)
        variables = {"params": params, **rest}
        with constrained(self._module, self.plan, self.mesh):
            return self.run(lambda *xs, **kw: self._module.apply(variables, *xs, **kw), *inputs, **kwargs)

    def apply(self, *inputs, **kwargs):
        """The model's forward pass, jitted with the plan's input spec on the first input (other inputs whole)
        and its output spec on every output leaf of enough rank. Keyword arguments holding arrays are traced (and
        split like the first input when their leading dimension is its batch); the others are static (e.g.
        `deterministic=True`). Nothing is written back: RNG counters and batch statistics stay as they were."""
        if not inputs:
            raise ShardlmError("apply() takes the model's input as its first positional argument (it gets the "
                               "plan's input spec); for a model called with keyword inputs, give shard() a call "
                               "adapter, e.g. call=lambda m, tokens, **kw: m(input_ids=tokens, **kw)")
        if self.kind == "nnx":
            graphdef, params, rest = self._split()  # the module's current mode and state
        else:
            graphdef, params, rest = None, self._params, self._rest
        arrays = {k: v for k, v in kwargs.items() if _holds_arrays(v)}
        static = {k: v for k, v in kwargs.items() if k not in arrays}
        for k, v in static.items():
            try:
                hash(v)
            except TypeError:
                raise ShardlmError(f"apply(..., {k}=...): a {type(v).__name__} is neither an array (traced) nor "
                                   "hashable (static); pass an array, or a tuple instead of a list") from None
        key = (graphdef, tuple(sorted(static.items())), signature(inputs), signature(arrays))
        if key not in self._applies:
            fn = lambda p, r, kw, *xs: self.forward(graphdef, p, r, *xs, **static, **kw)  # noqa: E731
            batch = np.shape(jax.tree.leaves(inputs[0])[0])[:1] if inputs and jax.tree.leaves(inputs[0]) else ()
            in_sh = (self.param_shardings, self.rest_shardings, self._kwarg_shardings(arrays, batch),
                     self.io_shardings(inputs[0], self.layout.input_spec, "inputs"))
            in_sh += tuple(jax.tree.map(lambda _: replicated(self.mesh), x) for x in inputs[1:])
            out = jax.eval_shape(fn, params, rest, arrays, *inputs)
            self._applies[key] = jax.jit(fn, in_shardings=in_sh[: 3 + len(inputs)],
                                         out_shardings=self.io_shardings(out, self.layout.output_spec, "outputs"))
        return self._applies[key](params, rest, arrays, *inputs)

    def _kwarg_shardings(self, arrays: dict, batch: tuple):
        """An array keyword argument whose leading dimension is the batch's is split like the first input; the
        rest are whole on every device."""
        def one(path, leaf):
            if batch and np.shape(leaf)[:1] == batch:
                return self.io_shardings(leaf, self.layout.input_spec, f"keyword argument {path_str(path)}")
            return replicated(self.mesh)

        return jax.tree_util.tree_map_with_path(one, arrays)

    def trainer(self, tx, loss_fn=None, *, seed: int = 0, keep: int = 3):
        """A `Trainer` over these parameters. `loss_fn(model, batch) -> scalar`, where `model(*inputs)` is the
        forward pass (the NNX module itself; for Linen, the module applied to the current variables, with a fresh
        dropout key each step and its non-parameter collections updated; with a `call` adapter, the model run
        through it). Default: next-token cross entropy on a [batch, seq + 1] token array. `keep`: how many of
        its newest checkpoints `trainer.save(dir)` keeps in a directory."""
        from shardlm.foreign.trainer import Trainer

        return Trainer(self, tx, loss_fn, seed=seed, keep=keep)

    def explanation(self, opt_state=None) -> Explanation:
        """Where every parameter (and optimizer-state leaf, given `opt_state`) lives: `shardlm.explain(sharded)`."""
        tree = {"params": self.params} if self.kind == "linen" else self.params  # paths as the plan saw them
        placed_by = {p.path: p.placed_by for p in self.layout.placements}
        return explain_trees(tree, opt_state, self.mesh, placed_by, self.layout.notes())


# --- entry point ------------------------------------------------------------------------------------------------


def shard(model, plan: Plan | str | dict = "dp", mesh=None, *, variables=None, call: Callable | None = None,
          strict: bool | None = None) -> Sharded:
    """Place `model`'s parameters on `mesh` (default: the plan's mesh over all devices) as `plan` says.

    `model` is an `nnx.Module` (its variables are replaced by sharded ones, in place), a zero-argument function
    that builds one (built inside `jit`, each device computing only its shards), or a Linen module with
    `variables` (a dict from `module.init`, or a zero-argument function returning one, built sharded likewise).
    `call(model, *inputs, **kwargs)` adapts a model that is not `model(tokens) -> logits` (see the module
    docstring). `strict=True` (or the plan's `strict: true`) makes the megatron preset's warnings errors.
    """
    plan = Plan.load(plan)
    if strict is not None:
        plan = dataclasses.replace(plan, strict=strict)
    if mesh is None:
        mesh = plan.make_mesh()
    check_auto_mesh(mesh)
    from flax import linen, nnx

    _refuse_wrappers(model)
    if isinstance(model, linen.Module):
        if variables is None:
            raise ShardlmError("a Linen module needs its variables: shard(module, plan, mesh, variables=module.init(...))"
                               " or variables=lambda: module.init(...)")
        sharded = _shard_linen(model, variables, plan, mesh)
    elif variables is not None:
        raise ShardlmError("variables= is for Linen modules; an NNX module carries its own")
    elif isinstance(model, nnx.Module):
        sharded = _shard_nnx(model, None, plan, mesh)
    elif callable(model):
        sharded = _shard_nnx(None, model, plan, mesh)
    else:
        raise ShardlmError(f"cannot shard a {type(model).__name__}: pass an nnx.Module, a function that builds one, "
                           "or a Linen module with variables=")
    return dataclasses.replace(sharded, call=call)


def _refuse_wrappers(model) -> None:
    """A Hugging Face Flax model (transformers 4.x's FlaxPreTrainedModel) wraps a Linen module (`.module`) and its
    parameters (`.params`); shard() takes those two, and its call needs an adapter (keyword inputs, an output
    object). Said in one line rather than failing inside the model."""
    from flax import linen

    if isinstance(getattr(model, "module", None), linen.Module) and hasattr(model, "params"):
        raise ShardlmError(
            f"a {type(model).__name__} is a wrapper around a Linen module and its parameters: shard those, e.g. "
            "shardlm.shard(hf.module, plan, variables={'params': hf.params}, call=lambda m, tokens, **kw: "
            "m(input_ids=tokens, deterministic=True, **kw).logits)")


def _holds_arrays(value) -> bool:
    leaves = jax.tree.leaves(value)
    return bool(leaves) and all(isinstance(x, (jax.Array, np.ndarray)) for x in leaves)


def _shardings(params, rest, plan, mesh):
    """The layout (raising on any problem, its notes logged) and the NamedSharding trees of params and rest."""
    layout = resolve_layout(params, rest, plan, mesh)
    return layout, tree_shardings(params, layout, mesh), tree_shardings(rest, layout, mesh)


def _shard_nnx(module, build, plan, mesh) -> Sharded:
    from flax import nnx

    if module is None:
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(build)
        if not isinstance(abstract, nnx.Module):
            raise ShardlmError(f"the function passed to shard() returned a {type(abstract).__name__}, not an nnx.Module")
        graphdef, params, rest = nnx.split(abstract, nnx.Param, ...)
    else:
        graphdef, params, rest = nnx.split(module, nnx.Param, ...)
    layout, p_sh, r_sh = _shardings(params, rest, plan, mesh)
    check_rules_match(plan, nnx_module_paths(abstract if module is None else module))
    if module is None:
        with nnx.use_eager_sharding(False):
            params, rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:], out_shardings=(p_sh, r_sh))()
        module = nnx.merge(graphdef, params, rest)
    else:
        nnx.update(module, place(params, p_sh), place(rest, r_sh))
    return Sharded("nnx", mesh, plan, layout, p_sh, r_sh, module)


def _shard_linen(module, variables, plan, mesh) -> Sharded:
    from flax.core import unfreeze

    build = variables if callable(variables) else None
    tree = jax.eval_shape(build) if build else variables
    tree = unfreeze(tree)  # older Flax returned FrozenDicts
    if not isinstance(tree, dict) or "params" not in tree:
        raise ShardlmError("Linen variables must be the dict module.init returns, with a 'params' collection")
    split = lambda t: ({"params": unfreeze(t)["params"]},  # noqa: E731
                       {k: v for k, v in unfreeze(t).items() if k != "params"})
    params, rest = split(tree)
    layout, p_sh, r_sh = _shardings(params, rest, plan, mesh)
    if build:
        params, rest = jax.jit(lambda: split(build()), out_shardings=(p_sh, r_sh))()
    else:
        params, rest = place(params, p_sh), place(rest, r_sh)
    return Sharded("linen", mesh, plan, layout, p_sh["params"], r_sh, module, params["params"], rest)
