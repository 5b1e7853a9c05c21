"""Sharding: the logical-axis rule table and the code that applies it (the only code that knows the mesh)."""

from shardlm.sharding.rules import (
    LOGICAL_AXIS_RULES,
    batch_sharding,
    check_divisible,
    constrain,
    logical_to_spec,
    replicated,
    state_partition_specs,
    state_shardings,
    use_mesh_rules,
)

__all__ = [
    "LOGICAL_AXIS_RULES",
    "batch_sharding",
    "check_divisible",
    "constrain",
    "logical_to_spec",
    "replicated",
    "state_partition_specs",
    "state_shardings",
    "use_mesh_rules",
]
