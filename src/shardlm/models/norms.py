"""RMSNorm (Llama's, and the per-head QK-norm's). Math only.

Design choices:
- Computes in float32 whatever the compute dtype and returns the input's dtype; the learned scale is read in
  float32 (`param(..., read_in_float32=True)`), as transformers' LlamaRMSNorm multiplies in float32 before
  casting back.
- The scale's logical axis is the normalised dimension's: `embed` for the residual stream, `head_dim` for a
  per-head norm of queries and keys (so it is split wherever head_dim is, which is nowhere in the built-in rules).
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.models.params import param


class RMSNorm(nnx.Module):
    def __init__(self, d: int, eps: float, param_dtype, rngs: nnx.Rngs, axis: str = "embed"):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones_init(), (d,), (axis,), param_dtype, read_in_float32=True)

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        y = x32 * jax.lax.rsqrt(jnp.square(x32).mean(-1, keepdims=True) + self.eps)
        return (y * self.scale[...].astype(jnp.float32)).astype(x.dtype)
