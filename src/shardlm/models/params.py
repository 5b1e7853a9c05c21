"""Parameters with logical axis names, and the dtypes a model stores and computes in.

Design choices:
- Parameters are stored in `param_dtype` (float32 master weights) and cast to the compute `dtype` where they are
  used. The cast comes before any FSDP all-gather XLA inserts at the use, so bfloat16 runs gather half the bytes.
  Gradients flow back through the cast, so they and the AdamW moments stay in `param_dtype`.
- A parameter's metadata says how its compute copy is made (`shardlm.models.precision`): kept in float32 (norms,
  routers, biases) or none at all, its reader casting what it reads (the embedding and head tables).
- The dtypes themselves are the precision policy's (`shardlm.models.precision`); their names are the accelerator
  layer's (`shardlm.accelerator.DTYPE_NAMES`), so a config is checked without importing the model code.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.models.precision import CAST_WHERE_READ, READ_IN_FLOAT32
from shardlm.sharding import constrain

VOCAB_MULTIPLE = 64  # GPT-2's 50257 -> 50304, the usual choice; also keeps matmuls aligned.


def padded_vocab_size(vocab_size: int, tensor_degree: int = 1) -> int:
    multiple = math.lcm(VOCAB_MULTIPLE, tensor_degree)
    return -(-vocab_size // multiple) * multiple


def param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str | None, ...], dtype, *,
          read_in_float32: bool = False, cast_where_read: bool = False) -> nnx.Param:
    """A parameter with logical axis `names`. `read_in_float32`: its compute copy stays float32 (norms, routers,
    biases); `cast_where_read`: it has no compute copy, its reader casts what it reads (`shardlm.models.precision`)."""
    value = nnx.with_partitioning(init, names)(rngs.params(), shape, dtype)
    meta = {READ_IN_FLOAT32: read_in_float32, CAST_WHERE_READ: cast_where_read}
    return nnx.Param(value, **{k: True for k, v in meta.items() if v})


def use(p: nnx.Param, dtype) -> jax.Array:
    """A parameter's value in the compute dtype. Under the model's compute view (`precision.compute_view`) it is in
    it already and is returned as it is. Read without one (the output head outside training's fused loss, a module
    called on its own), it is cast where each shard lies (pinned to the parameter's own sharding), so that XLA
    gathers FSDP shards in the compute dtype (bfloat16: half the bytes of gathering float32)."""
    x = p[...]
    if x.dtype == jnp.dtype(dtype):
        return x
    names = p.get_metadata()["out_sharding"]
    # Inside the scan over stacked blocks a parameter is one layer's slice and keeps the stack's names: the
    # leading ones (`layers`) name axes the slice does not have.
    return constrain(x.astype(dtype), *names[len(names) - x.ndim:])
