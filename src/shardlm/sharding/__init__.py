"""Sharding: the logical-axis rule table and the code that applies it to shardlm's own models and their activations.

`rules` is the one place that maps logical axis names (`embed`, `heads`, `batch`, ...) onto the mesh axes; it also
holds the activation constraints model code calls (`constrain`), the parameter and state shardings derived from
the names, and the divisibility checks. Plans for models shardlm did not write are `shardlm.foreign`; where arrays
ended up is `shardlm.explanation`.
"""

from shardlm.sharding.rules import (
    LOGICAL_AXIS_RULES,
    active_axes,
    active_mesh,
    active_rules,
    active_spec,
    active_storage_spec,
    active_degree,
    axes_in_use,
    batch_sharding,
    check_divisible,
    compute_copy,
    constrain,
    constrain_with_gradient,
    copies_over,
    gathered_for,
    generation_rules,
    gradient_carrier,
    logical_to_spec,
    owner_spec,
    replicas_of,
    replicated,
    rules_without,
    sequence_parallel_rules,
    sharded_lookup,
    state_partition_specs,
    state_shardings,
    use_mesh_rules,
    zero_rules,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "active_axes",
    "active_mesh",
    "active_rules",
    "active_spec",
    "active_storage_spec",
    "active_degree",
    "axes_in_use",
    "batch_sharding",
    "check_divisible",
    "compute_copy",
    "constrain",
    "constrain_with_gradient",
    "copies_over",
    "gathered_for",
    "generation_rules",
    "gradient_carrier",
    "logical_to_spec",
    "owner_spec",
    "replicas_of",
    "replicated",
    "rules_without",
    "sequence_parallel_rules",
    "sharded_lookup",
    "state_partition_specs",
    "state_shardings",
    "use_mesh_rules",
    "zero_rules",
]
