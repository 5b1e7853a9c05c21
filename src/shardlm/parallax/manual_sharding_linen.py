"""`shard_linen_model(model, params, sharding_config)`: seed 003's entry point, kept, and done right.

Same signature, same return values `(runner, sharded_params, mesh)`, same nested-dict config (`mesh_axes`, `in`,
`out`, `parameters` holding a PartitionSpec per parameter) and the same "Sharded param ... with ..." log line
per parameter. What changed underneath (the published version used `pjit`, `with mesh:` and whatever mesh
`jax.make_mesh` gives, which is Explicit-mode since JAX 0.9 and rejects row-parallel weights):

- the config becomes a shardlm plan with one anchored rule per parameter, so it is validated before anything is
  placed: a key naming no parameter (a typo) is an error naming it; a parameter with no spec is an error listing
  it (the original warned and left it on one device) unless the config says `"unmatched": "replicate"`; a
  dimension the mesh axis does not divide is an error naming the parameter, shape, axis and degree;
- keys may be globs (`"SelfAttentionBlock_*"`), so one entry can cover every layer;
- every parameter is placed on the mesh, so `optax` state created from the returned params (e.g.
  `TrainState.create`) is sharded exactly like them from step 0;
- the mesh is `AxisType.Auto` over all devices, split as evenly as possible over `mesh_axes` with earlier axes
  taking the larger share (8 devices over ("data", "model") -> 4 x 2), or the config's optional `mesh_shape`;
- the runner is `jax.jit` with the config's `in` / `out` shardings as NamedShardings on that mesh.
"""

from __future__ import annotations

import jax
from flax import traverse_util
from jax.sharding import NamedSharding

from shardlm.errors import ShardlmError
from shardlm.foreign.plan import Plan
from shardlm.foreign.shard import shard
from shardlm.mesh import balanced_degrees, make_named_mesh

CONFIG_KEYS = {"mesh_axes", "mesh_shape", "in", "out", "parameters", "unmatched"}


def shard_linen_model(model, params, sharding_config, mesh=None):
    """Shard a Linen `model`'s variables `params` as `sharding_config` says.

    Returns `(runner, sharded_params, mesh)`: `runner(params, x)` is `model.apply` jitted with the config's
    input and output specs; `sharded_params` has the structure of `params`, every leaf placed on `mesh`.
    """
    unknown = set(sharding_config) - CONFIG_KEYS
    if unknown:
        raise ShardlmError(f"sharding_config has unknown key(s) {', '.join(sorted(unknown))}; "
                           f"it takes {', '.join(sorted(CONFIG_KEYS))}")
    axes = sharding_config.get("mesh_axes") or ()
    axes = (axes,) if isinstance(axes, str) else tuple(axes)
    if len(set(axes)) != len(axes):
        raise ShardlmError(f"mesh_axes {axes} names an axis twice; give each mesh axis once")
    if mesh is None:
        if not axes:
            raise ShardlmError('sharding_config needs "mesh_axes", e.g. ("data", "model")')
        shape = sharding_config.get("mesh_shape") or balanced_degrees(jax.device_count(), len(axes))
        if len(shape) != len(axes):
            raise ShardlmError(f"mesh_shape {tuple(shape)} has {len(shape)} entries for {len(axes)} mesh_axes {axes}")
        mesh = make_named_mesh(dict(zip(axes, shape)))
    elif axes and tuple(mesh.axis_names) != axes:
        raise ShardlmError(f"the mesh's axes {tuple(mesh.axis_names)} are not the config's mesh_axes {axes}")

    flat_specs = traverse_util.flatten_dict(sharding_config.get("parameters") or {})
    plan = Plan.from_dict({
        "rules": [["/" + "/".join(map(str, key)), spec] for key, spec in flat_specs.items()],
        "inputs": sharding_config.get("in"),
        "outputs": sharding_config.get("out"),
        "unmatched": sharding_config.get("unmatched", "error"),
    }, name="sharding_config")
    sharded = shard(model, plan, mesh, variables=params)
    # In the caller's key order (JAX returns dicts sorted), so the log reads in the model's creation order.
    placed = traverse_util.flatten_dict(sharded.variables)
    sharded_params = traverse_util.unflatten_dict({k: placed[k] for k in traverse_util.flatten_dict(params)})

    placements = {p.path: p for p in sharded.layout.placements}
    for key in traverse_util.flatten_dict(sharded_params):
        placement = placements["/".join(map(str, key))]
        if not placement.is_param:
            print(f"Replicated variable {key} (not a parameter)")
        elif placement.rule is not None:
            spec = placement.rule.spec  # as the config gave it, like the seed's log
            print(f"Sharded param {key} with {_seed_repr(spec) if isinstance(spec, tuple) else placement.spec}")
        else:
            print(f"[WARN] No sharding spec for param {key}, replicating it on every device")

    shardings = jax.tree.map(lambda a: a.sharding, sharded_params)
    spec = lambda s: NamedSharding(mesh, s)  # noqa: E731
    runner = jax.jit(lambda p, x: model.apply(p, x), in_shardings=(shardings, spec(sharded.layout.input_spec)),
                     out_shardings=spec(sharded.layout.output_spec))
    return runner, sharded_params, mesh


def _seed_repr(spec) -> str:
    """A config spec in the seed's log format: JAX printed PartitionSpec('data', 'model') before it switched to
    P('data', 'model'). Entries are None, an axis name, or a tuple of axis names."""
    entries = [repr(e) if e is None or isinstance(e, str) else repr(e[0]) if len(e) == 1 else repr(tuple(e))
               for e in spec]
    return "PartitionSpec(" + ", ".join(entries) + ("," if len(entries) == 1 else "") + ")"
