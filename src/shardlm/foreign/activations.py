"""Activation constraints from a plan, for a model shardlm did not write: the outputs of chosen modules, and the
logical names the model's own code already uses, pinned to mesh axes while the step is traced.

    activations:                                   # outputs of these modules' __call__, by module path
      - ["blocks/*/fc1", [batch, null, tensor]]    # the MLP's hidden activations split over tensor
      - ["blocks/*", [batch, null, null]]          # every block's output whole over tensor
    logical:                                       # names the model gives flax.linen.with_logical_constraint
      embed: null
      mlp: tensor

Without constraints XLA propagates the weights' shardings into the activations as it sees fit, and for an
unannotated model it may choose something other than Megatron's pattern (gathering a weight instead of reducing an
activation, or splitting the residual stream). These pin the choice.

Design choices:
- Module paths are `nnx.iter_modules`' ("blocks/0/mlp") and, for Linen, the module's own path ("Block_0/mlp",
  without the collection name that parameter paths start with). Patterns are the same globs as parameter rules;
  the first rule matching a module applies. Every rule must match a module of the model, checked when the model
  is placed, so a typo is an error as in parameter rules.
- NNX has no method interceptor: for the duration of one trace, each matched module's class is swapped for a
  subclass whose `__call__` constrains the output, and the module is marked with the index of its rule (a static
  attribute), both undone afterwards (the module the trace merged is the only one touched, and its graph
  definition is unchanged once the trace is done). Class and mark are part of the module's graph definition, so
  they survive NNX's lifted transforms (`nnx.remat`, `nnx.scan`, `nnx.vmap` split a module and merge a new one
  inside). Linen's `nn.intercept_methods` does the same for Linen modules. Only `__call__` is intercepted. A
  module reachable by two paths (a shared, tied module) is matched by its first path.
- A spec's entries are those of parameter rules: mesh axes, lists of them, or shardlm's logical names (`batch` is
  data x fsdp). Output leaves with fewer dimensions than the spec are left alone; a split that does not divide a
  dimension is a one-line error naming the module, its output shape and the rule.
- `logical:` becomes Flax's logical axis rules (`flax.linen.logical_axis_rules`) during the trace, with the mesh
  as the abstract mesh in context, so `nn.with_logical_constraint(x, ("batch", "length", "embed"))` in the user's
  code resolves to the plan's axes (it is a no-op without a mesh, which is how such models run on one device).
"""

from __future__ import annotations

import contextlib
import threading
from typing import Any

import jax
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.foreign.layout import resolve_entries
from shardlm.foreign.plan import Plan, Rule, matches
from shardlm.sharding.rules import as_axes, axis_degree

_swapped: dict[type, type] = {}  # a module class -> its constraining subclass (one per class, made once)
_active = threading.local()  # the trace in progress: its plan and mesh
MARK = "_shardlm_activation_rule"  # on a matched NNX module during a trace: (its path, its rule's index)


def has_constraints(plan: Plan) -> bool:
    return bool(plan.activations or plan.logical)


def nnx_module_paths(model) -> dict[str, Any]:
    """'/'-joined path -> module, for every submodule of an NNX module (the root is '')."""
    from flax import nnx

    return {"/".join(map(str, path)): module for path, module in nnx.iter_modules(model)}


def check_rules_match(plan: Plan, paths) -> None:
    """Every activation rule matches at least one module path (the model's modules, from `*_module_paths`)."""
    paths = [p for p in paths if p]
    for i, rule in enumerate(plan.activations):
        if not any(matches(rule, p) for p in paths):
            example = paths[len(paths) // 2] if paths else "(the model has no submodules)"
            raise ShardlmError(f"{plan.name}: activation rule {i + 1} '{rule.pattern}' matches no module of the "
                               f"model; module paths look like '{example}': fix the pattern or delete the rule")


def _rule_for(plan: Plan, path: str) -> Rule | None:
    return next((r for r in plan.activations if matches(r, path)), None)


def _constrain(out, path: str, rule: Rule, mesh, plan_name: str):
    """`out` (any tree of arrays) with the rule's spec on every leaf of at least the spec's rank."""

    def one(x):
        if not hasattr(x, "shape") or len(x.shape) < len(rule.spec):
            return x
        where = f"{plan_name}: activation rule '{rule.pattern}' on the output of {path or 'the model'}"
        spec = resolve_entries(rule.spec, x.shape, mesh, where)
        for dim, entry in enumerate(spec):
            degree = axis_degree(mesh, entry)
            if x.shape[dim] % degree:
                raise ShardlmError(f"{where}, of shape {tuple(x.shape)}: dimension {dim} (size {x.shape[dim]}) is "
                                   f"split {degree} ways over {' x '.join(as_axes(entry))}, which does not divide "
                                   "it; change the rule's spec or the mesh")
        return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, spec))

    return jax.tree.map(one, out)


def _constraining(cls: type) -> type:
    """A subclass of the NNX module class `cls` whose `__call__` constrains its output by the rule its instance is
    marked with (`MARK`), under the active trace's plan and mesh."""
    if cls not in _swapped:
        def __call__(self, *args, **kwargs):
            out = super(sub, self).__call__(*args, **kwargs)
            path, index = getattr(self, MARK)
            plan, mesh = _active.plan, _active.mesh
            return _constrain(out, path, plan.activations[index], mesh, plan.name)

        sub = type(cls)(cls.__name__, (cls,), {"__call__": __call__, "__module__": cls.__module__,
                                                "__qualname__": cls.__qualname__})
        _swapped[cls] = sub
    return _swapped[cls]


def _logical_rules(plan: Plan, mesh) -> tuple:
    """`plan.logical` as Flax's (name, mesh axes) rules, logical names of shardlm's table resolved for `mesh`."""
    out = []
    for name, entry in plan.logical.items():
        if entry is None:
            out.append((name, None))
            continue
        spec = resolve_entries((entry,), None, mesh, f"{plan.name}: logical name '{name}'")
        out.append((name, spec[0]))
    return tuple(out)


@contextlib.contextmanager
def constrained(model, plan: Plan, mesh):
    """While tracing `model` (an NNX module, a `LinenModel`, or a Linen module) inside this context, the plan's
    activation constraints apply. A no-op for a plan without them."""
    if not has_constraints(plan):
        yield
        return
    from flax import linen

    from shardlm.foreign.linen import LinenModel

    with contextlib.ExitStack() as stack:
        if plan.logical:
            stack.enter_context(linen.logical_axis_rules(_logical_rules(plan, mesh)))
            stack.enter_context(jax.sharding.use_abstract_mesh(mesh.abstract_mesh))
        if plan.activations:
            if isinstance(model, (LinenModel, linen.Module)):
                stack.enter_context(_linen_intercepted(plan, mesh))
            else:
                stack.enter_context(_nnx_swapped(model, plan, mesh))
        yield


@contextlib.contextmanager
def _nnx_swapped(model, plan: Plan, mesh):
    paths = nnx_module_paths(model)
    check_rules_match(plan, paths)
    hits = []
    for path, module in paths.items():
        index = next((i for i, rule in enumerate(plan.activations) if matches(rule, path)), None)
        if index is not None:
            hits.append((module, path, index))
    previous = getattr(_active, "plan", None), getattr(_active, "mesh", None)
    _active.plan, _active.mesh = plan, mesh
    originals = []
    try:
        for module, path, index in hits:
            originals.append((module, type(module)))
            object.__setattr__(module, "__class__", _constraining(type(module)))
            object.__setattr__(module, MARK, (path, index))
        yield
    finally:
        for module, cls in originals:
            object.__setattr__(module, "__class__", cls)
            object.__delattr__(module, MARK)
        _active.plan, _active.mesh = previous


@contextlib.contextmanager
def _linen_intercepted(plan: Plan, mesh):
    from flax import linen

    seen: list[str] = []

    def intercept(next_fun, args, kwargs, context):
        out = next_fun(*args, **kwargs)
        if context.method_name != "__call__":
            return out
        path = "/".join(context.module.path)
        seen.append(path)
        rule = _rule_for(plan, path) if path else None
        return out if rule is None else _constrain(out, path, rule, mesh, plan.name)

    with linen.intercept_methods(intercept):
        yield
    check_rules_match(plan, seen)  # a Linen model's modules are known once it has run
