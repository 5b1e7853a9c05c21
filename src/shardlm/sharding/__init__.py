"""Sharding: the logical-axis rule table and the code that applies it (the only code that knows the mesh)."""

from shardlm.sharding.rules import (
    LOGICAL_AXIS_RULES,
    active_degree,
    batch_sharding,
    check_divisible,
    constrain,
    logical_to_spec,
    replicated,
    state_partition_specs,
    state_shardings,
    use_mesh_rules,
    without_sequence_split,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "active_degree",
    "batch_sharding",
    "check_divisible",
    "constrain",
    "logical_to_spec",
    "replicated",
    "state_partition_specs",
    "state_shardings",
    "use_mesh_rules",
    "without_sequence_split",
]
