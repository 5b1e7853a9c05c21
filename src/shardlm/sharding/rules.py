"""The one table that maps logical axis names to mesh axes, and everything that applies it.

Model code names the axes of every parameter and of a few activations with logical names (`embed`, `heads`,
`mlp`, `vocab`, `batch`, ...). This module is the only place that knows how those names land on the mesh axes
(data, fsdp, tensor). Because a mesh axis of degree 1 shards nothing, this single table covers every strategy:

- DP (data=N): only `batch` is split; parameters are replicated.
- FSDP / ZeRO-3 (fsdp=N): `batch` is split over fsdp too, and every parameter's `embed` dimension is split over
  fsdp, so parameters, gradients and AdamW moments are all 1/N per device; XLA all-gathers weights per layer.
- Megatron TP (tensor=N): attention heads, the MLP hidden dimension and the vocabulary are split over tensor
  (column-parallel in, row-parallel out, one all-reduce per block half, as in seed 000).
- Hybrids: the product of the above.

Parameters and activations differ in one name: a parameter's `embed` dimension is FSDP-sharded, while the
residual stream's `act_embed` stays whole (its batch dimension is already split over data and fsdp).
"""

import contextlib
import math
import threading
from typing import Any

import jax
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlm.errors import ShardlmError

MeshAxes = str | tuple[str, ...] | None

LOGICAL_AXIS_RULES: dict[str, MeshAxes] = {
    # activations
    "batch": ("data", "fsdp"),
    "seq": None,
    "act_embed": None,
    "act_heads": "tensor",
    "act_mlp": "tensor",
    "act_vocab": "tensor",
    # parameters
    "embed": "fsdp",
    "vocab": "tensor",
    "heads": "tensor",
    "kv_heads": "tensor",
    "head_dim": None,
    "mlp": "tensor",
    "pos": None,
}


def logical_to_spec(names: tuple[str | None, ...], rules: dict[str, MeshAxes] | None = None) -> P:
    """('embed', 'mlp') -> P('fsdp', 'tensor'). Every name must be in the table (None = replicated)."""
    rules = LOGICAL_AXIS_RULES if rules is None else rules
    out = []
    for name in names:
        if name is None:
            out.append(None)
        elif name not in rules:
            raise ShardlmError(
                f"logical axis '{name}' has no rule; add it to the logical axis rules (map it to None to replicate)"
            )
        else:
            out.append(rules[name])
    return P(*out)


def axis_degree(mesh, axes: MeshAxes) -> int:
    if axes is None:
        return 1
    if isinstance(axes, str):
        axes = (axes,)
    return math.prod(mesh.shape[a] for a in axes)


# --- activation constraints -------------------------------------------------------------------------------------
# Model code calls `constrain(x, "batch", "seq", "act_embed")`; outside `use_mesh_rules` it is the identity, so a
# model runs unchanged on one device and in tests that never build a mesh.

_active = threading.local()


@contextlib.contextmanager
def use_mesh_rules(mesh, rules: dict[str, MeshAxes] | None = None):
    """Within this context, `constrain` pins activations to `mesh` through the logical rules."""
    previous = getattr(_active, "value", None)
    _active.value = (mesh, LOGICAL_AXIS_RULES if rules is None else rules)
    try:
        yield
    finally:
        _active.value = previous


def constrain(x: jax.Array, *names: str | None) -> jax.Array:
    active = getattr(_active, "value", None)
    if active is None:
        return x
    mesh, rules = active
    return jax.lax.with_sharding_constraint(x, NamedSharding(mesh, logical_to_spec(names, rules)))


# --- parameter and state shardings ------------------------------------------------------------------------------


def _logical_names(variable: Any) -> tuple[str | None, ...] | None:
    names = getattr(variable, "out_sharding", None)
    if names is None:
        names = variable.get_metadata().get("out_sharding") if hasattr(variable, "get_metadata") else None
    return tuple(names) if names is not None else None


def path_str(path) -> str:
    parts = []
    for k in path:
        key = getattr(k, "key", getattr(k, "name", getattr(k, "idx", k)))
        if key == "value":
            continue
        parts.append(str(key))
    return ".".join(parts)


def state_partition_specs(abstract_state, rules: dict[str, MeshAxes] | None = None):
    """For an `nnx.State` of variables, a matching tree of mesh PartitionSpecs (variables without names: P())."""
    from flax import nnx

    def spec(variable):
        names = _logical_names(variable)
        return variable.replace(logical_to_spec(names, rules) if names is not None else P())

    return jax.tree.map(spec, abstract_state, is_leaf=lambda x: isinstance(x, nnx.Variable))


def state_shardings(abstract_state, mesh, rules: dict[str, MeshAxes] | None = None):
    """NamedShardings for every leaf of an `nnx.State`, after checking every split dimension divides evenly."""
    specs = state_partition_specs(abstract_state, rules)
    check_divisible(abstract_state, specs, mesh)
    return jax.tree.map(lambda s: NamedSharding(mesh, s), specs, is_leaf=lambda x: isinstance(x, P))


def check_divisible(abstract_state, specs, mesh) -> None:
    """JAX may silently replicate a dimension its mesh axis does not divide (jax#26946); fail loudly instead."""
    leaves = jax.tree_util.tree_flatten_with_path(abstract_state)[0]
    spec_leaves = jax.tree.leaves(specs, is_leaf=lambda x: isinstance(x, P))
    for (path, leaf), spec in zip(leaves, spec_leaves, strict=True):
        for dim, (size, axes) in enumerate(zip(leaf.shape, tuple(spec) + (None,) * len(leaf.shape))):
            degree = axis_degree(mesh, axes)
            if size % degree:
                axes_name = axes if isinstance(axes, str) else " x ".join(axes)
                raise ShardlmError(
                    f"parameter {path_str(path)} of shape {tuple(leaf.shape)}: dimension {dim} (size {size}) is "
                    f"split over mesh axis {axes_name} of degree {degree}, which does not divide it; change that "
                    f"degree to a divisor of {size} or resize the model"
                )


def batch_sharding(mesh, rules: dict[str, MeshAxes] | None = None) -> NamedSharding:
    """Sharding of a [batch, seq] token array: batch split over (data, fsdp)."""
    return NamedSharding(mesh, logical_to_spec(("batch", "seq"), rules))


def replicated(mesh) -> NamedSharding:
    return NamedSharding(mesh, P())
