"""From a resolved plan to NamedShardings: of a model's variables, of its optimizer state, of a whole train state;
and placing arrays on them.

Used by `shard()` (the library) and by the trainer for a model from the user's file (`shardlm.train.source`), so a
plan places a model the same way in both.

Design choices:
- Parameters go where the plan's layout says; every other variable (RNG state, batch statistics) is whole on
  every device.
- An optimizer-state leaf whose path ends with a parameter's path and whose shape is that parameter's gets that
  parameter's sharding; the rest (step counters, Adafactor's factored rows and columns) is replicated. Matching by
  path and shape needs no knowledge of how an optimizer nests its state (optax.tree_map_params fails on
  multi_transform's MaskedNodes and on Adafactor), and works for optax's raw state and `nnx.Optimizer`'s alike.
"""

from __future__ import annotations

import logging

import jax
import numpy as np
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.foreign.layout import Layout, Leaf, resolve
from shardlm.foreign.plan import Plan
from shardlm.sharding.rules import replicated
from shardlm.trees import dtype_name, path_str

log = logging.getLogger("shardlm")


def leaves(tree, is_param: bool) -> list[Leaf]:
    return [Leaf(path_str(p), tuple(np.shape(x)), dtype_name(x), is_param)
            for p, x in jax.tree_util.tree_flatten_with_path(tree)[0]]


def resolve_layout(params, rest, plan: Plan, mesh, *, warn: bool = True) -> Layout:
    """The plan resolved against the parameters' and other variables' shapes (raising on any problem); its notes
    (large replicated parameters, what the megatron preset could not do) are logged unless `warn` is False."""
    layout = resolve(plan, leaves(params, True) + leaves(rest, False), mesh)
    if warn:
        for note in layout.notes():
            log.warning("shardlm: %s", note)
    return layout


def tree_shardings(tree, layout: Layout, mesh, prefix: str = ""):
    """A NamedSharding per leaf of `tree`, by its path (after `prefix`) in the layout."""
    specs = layout.specs
    return jax.tree_util.tree_map_with_path(lambda p, _: NamedSharding(mesh, specs[prefix + path_str(p)]), tree)


def opt_state_shardings(abstract_opt_state, params, param_shardings, mesh):
    """Each optimizer-state leaf whose path ends with a parameter's path and whose shape is that parameter's gets
    the parameter's sharding; the rest is replicated."""
    by_path = {path_str(p): (np.shape(x), s) for (p, x), s in
               zip(jax.tree_util.tree_flatten_with_path(params)[0], jax.tree.leaves(param_shardings), strict=True)}

    def pick(path, leaf):
        parts = path_str(path).split("/")
        for start in range(len(parts)):
            match = by_path.get("/".join(parts[start:]))
            if match is not None and match[0] == np.shape(leaf):
                return match[1]
        return replicated(mesh)

    return jax.tree_util.tree_map_with_path(pick, abstract_opt_state)


def place(tree, shardings):
    """Copies of the caller's arrays on the mesh, never sharing a buffer with them: a train step donates its
    inputs, which must not free arrays the caller still holds. (`device_put(may_alias=False)` alone is not enough:
    replicating a one-device array onto a mesh can keep its buffer as the first device's shard.)"""
    import jax.numpy as jnp

    placed = jax.device_put(tree, shardings, may_alias=False)

    def buffers(x):
        return {s.data.unsafe_buffer_pointer() for s in getattr(x, "addressable_shards", ())}

    def fresh(src, dst, sharding):
        return jax.jit(jnp.copy, out_shardings=sharding)(dst) if buffers(src) & buffers(dst) else dst

    return jax.tree.map(fresh, tree, placed, shardings)


def check_auto_mesh(mesh) -> None:
    """Unannotated models need Auto axes: on Explicit ones (jax.make_mesh's default since JAX 0.9) a row-parallel
    weight fails to trace ("Contracting dimensions are sharded")."""
    from jax.sharding import AxisType

    explicit = [name for name, t in zip(mesh.axis_names, mesh.axis_types) if t != AxisType.Auto]
    if explicit:
        raise ShardlmError(
            f"mesh axes {', '.join(explicit)} are not AxisType.Auto (jax.make_mesh makes Explicit axes); build the "
            "mesh with shardlm.make_mesh / shardlm.make_named_mesh, or pass axis_types=(AxisType.Auto,) * n"
        )
