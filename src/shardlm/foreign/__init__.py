"""Models shardlm did not write (unannotated Flax NNX modules, Flax Linen modules and their variables), placed on a
mesh by a plan and trained with a jitted, donated step.

`plan` is the plan format (files, dicts, the dp / fsdp / megatron presets, path globs); `layout` resolves a plan
against the parameters' shapes and the mesh, with every check; `shard` places a model (`shardlm.shard`, `Sharded`,
its jitted `apply`); `trainer` is the train step for such a model (`Sharded.trainer`, `Trainer`). Plans may name
the logical axes of shardlm's rule table (`shardlm.sharding.rules`), which is why this package sits above it.
"""
