"""Drop-in replacement for Parallax's `manual_sharding_linen` (seed 003), on current JAX.

    from shardlm.parallax import manual_sharding_linen      # the notebook's own call then works unchanged:
    runner, sharded_params, mesh = manual_sharding_linen.shard_linen_model(model, init_vars, sharding_config)
    # or: from shardlm.parallax import shard_linen_model
"""

from shardlm.parallax import manual_sharding_linen
from shardlm.parallax.manual_sharding_linen import shard_linen_model

__all__ = ["manual_sharding_linen", "shard_linen_model"]
