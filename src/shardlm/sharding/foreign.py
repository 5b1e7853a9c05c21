"""`shard`: apply a plan to a model shardlm did not write, a Flax NNX module or a Flax Linen module + variables.

    sharded = shardlm.shard(model, "megatron", mesh)          # an unannotated nnx.Module (changed in place)
    sharded = shardlm.shard(lambda: MiniGPT(..., rngs=nnx.Rngs(0)), plan, mesh)   # built sharded, never whole
    sharded = shardlm.shard(linen_module, "plans/my.yaml", mesh, variables=init_vars)  # or variables=lambda: ...
    logits = sharded.apply(tokens)                           # jitted forward with the plan's input/output specs
    trainer = sharded.trainer(optax.adamw(1e-3))             # jitted, donated train step; optimizer state
    metrics = trainer.step(batch)                            #   sharded like its parameters from step 0

Both kinds are reduced to the same functional form, (params, rest) trees plus `forward(params, rest, *inputs)`,
so one resolver, one placement and one train step serve both. `params` are the trainable parameters (NNX
`nnx.Param` variables; Linen's "params" collection); `rest` is every other variable (RNG state, batch
statistics), kept whole on every device. The plan is checked against the shapes before anything is placed.
"""

from __future__ import annotations

import dataclasses
import logging
from typing import Any, Callable

import jax
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.sharding.layout import Layout, Leaf, resolve
from shardlm.sharding.plan import Plan
from shardlm.sharding.rules import path_str

log = logging.getLogger("shardlm")


@dataclasses.dataclass
class Sharded:
    """A model placed on a mesh by a plan. `params` / `rest` hold the live sharded arrays."""

    kind: str  # "nnx" or "linen"
    mesh: Any
    plan: Plan
    layout: Layout
    params: Any
    rest: Any
    param_shardings: Any
    rest_shardings: Any
    forward: Callable  # forward(params, rest, *inputs, **static_kwargs) -> outputs
    _module: Any = None  # the user's nnx.Module (kept in sync) or the Linen module
    _graphdef: Any = None
    _applies: dict = dataclasses.field(default_factory=dict)

    # --- what the user holds ------------------------------------------------------------------------------------

    @property
    def model(self):
        """NNX: the module, holding the sharded parameters. Linen: the module (its variables are `.variables`)."""
        return self._module

    @property
    def variables(self) -> dict:
        """Linen: the variables dict, {"params": ..., other collections...}, every leaf sharded."""
        if self.kind != "linen":
            raise ShardlmError("`.variables` is for Linen models; an NNX model's state is `nnx.state(sharded.model)`")
        return {"params": self.params, **self.rest}

    @property
    def specs(self) -> dict[str, Any]:
        return self.layout.specs

    @property
    def input_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.layout.input_spec)

    @property
    def output_sharding(self) -> NamedSharding:
        return NamedSharding(self.mesh, self.layout.output_spec)

    def _set(self, params, rest) -> None:
        """Adopt new arrays (after a donated train step) so the user's module never holds deleted buffers."""
        self.params, self.rest = params, rest
        if self.kind == "nnx":
            from flax import nnx

            nnx.update(self._module, params, rest)

    # --- running ------------------------------------------------------------------------------------------------

    def apply(self, *inputs, **static_kwargs):
        """The model's forward pass, jitted with the plan's input spec on the first input (others whole) and its
        output spec on every output. Keyword arguments are static (e.g. `deterministic=True`, `training=False`)."""
        return self._jitted_apply(len(inputs), tuple(sorted(static_kwargs.items())))(self.params, self.rest, *inputs)

    def _jitted_apply(self, arity: int, static: tuple):
        """One compiled forward per (number of inputs, static keyword arguments)."""
        from shardlm.sharding.rules import replicated

        if (arity, static) not in self._applies:
            kwargs = dict(static)
            in_sh = (self.param_shardings, self.rest_shardings, self.input_sharding)
            in_sh += (replicated(self.mesh),) * (arity - 1)
            self._applies[arity, static] = jax.jit(lambda p, r, *xs: self.forward(p, r, *xs, **kwargs),
                                                   in_shardings=in_sh[: 2 + arity],
                                                   out_shardings=self.output_sharding)
        return self._applies[arity, static]

    def trainer(self, tx, loss_fn: Callable | None = None):
        """A `Trainer` over these parameters: `loss_fn(model, batch) -> scalar`, where `model(*inputs)` is the
        forward pass (the NNX module itself; for Linen, the module applied to the current variables). Default:
        next-token cross entropy on a [batch, seq + 1] token array."""
        from shardlm.train.runner import Trainer

        return Trainer(self, tx, loss_fn)



# --- entry point ------------------------------------------------------------------------------------------------


def shard(model, plan: Plan | str | dict = "dp", mesh=None, *, variables=None) -> Sharded:
    """Place `model`'s parameters on `mesh` (default: the plan's mesh over all devices) as `plan` says.

    `model` is an `nnx.Module` (its variables are replaced by sharded ones, in place), a zero-argument function
    that builds one (built inside `jit`, each device computing only its shards), or a Linen module with
    `variables` (a dict from `module.init`, or a zero-argument function returning one, built sharded likewise).
    """
    plan = Plan.load(plan)
    if mesh is None:
        mesh = plan.make_mesh()
    from flax import linen, nnx

    if isinstance(model, linen.Module):
        if variables is None:
            raise ShardlmError("a Linen module needs its variables: shard(module, plan, mesh, variables=module.init(...))"
                               " or variables=lambda: module.init(...)")
        return _shard_linen(model, variables, plan, mesh)
    if variables is not None:
        raise ShardlmError("variables= is for Linen modules; an NNX module carries its own")
    if isinstance(model, nnx.Module):
        return _shard_nnx(model, None, plan, mesh)
    if callable(model):
        return _shard_nnx(None, model, plan, mesh)
    raise ShardlmError(f"cannot shard a {type(model).__name__}: pass an nnx.Module, a function that builds one, or a "
                       "Linen module with variables=")


def _leaves(tree, is_param: bool) -> list[Leaf]:
    return [Leaf(path_str(p), tuple(x.shape), str(x.dtype), is_param)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def _layout_and_shardings(params, rest, plan, mesh):
    """Resolve (raising on any problem) and return the layout and NamedSharding trees matching params / rest."""
    layout = resolve(plan, _leaves(params, True) + _leaves(rest, False), mesh)
    for note in layout.notes():
        log.warning("shardlm: %s", note)
    specs = layout.specs
    to_sharding = lambda tree: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda p, _: NamedSharding(mesh, specs[path_str(p)]), tree)
    return layout, to_sharding(params), to_sharding(rest)


def _place(tree, shardings):
    # may_alias=False: a later donated train step must never free the caller's own arrays.
    return jax.device_put(tree, shardings, may_alias=False)


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
    layout, p_sh, r_sh = _layout_and_shardings(params, rest, plan, mesh)
    if module is None:
        with nnx.use_eager_sharding(False):
            params, rest = jax.jit(lambda: nnx.split(build(), nnx.Param, ...)[1:], out_shardings=(p_sh, r_sh))()
        module = nnx.merge(graphdef, params, rest)
    else:
        params, rest = _place(params, p_sh), _place(rest, r_sh)
        nnx.update(module, params, rest)

    def forward(params, rest, *inputs, **kwargs):
        return nnx.merge(graphdef, params, rest)(*inputs, **kwargs)

    return Sharded("nnx", mesh, plan, layout, params, rest, p_sh, r_sh, forward, module, graphdef)


def _shard_linen(module, variables, plan, mesh) -> Sharded:
    build = variables if callable(variables) else None
    tree = jax.eval_shape(build) if build else variables
    if not isinstance(tree, dict) or "params" not in tree:
        raise ShardlmError("Linen variables must be the dict module.init returns, with a 'params' collection")
    split = lambda t: ({"params": t["params"]}, {k: v for k, v in t.items() if k != "params"})  # noqa: E731
    params, rest = split(tree)
    layout, p_sh, r_sh = _layout_and_shardings(params, rest, plan, mesh)
    if build:
        params, rest = jax.jit(lambda: split(build()), out_shardings=(p_sh, r_sh))()
    else:
        params, rest = _place(params, p_sh), _place(rest, r_sh)

    def forward(params, rest, *inputs, **kwargs):
        return module.apply({"params": params, **rest}, *inputs, **kwargs)

    return Sharded("linen", mesh, plan, layout, params["params"], rest, p_sh["params"], r_sh, forward, module)
