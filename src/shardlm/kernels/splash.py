"""Splash attention (JAX's Pallas TPU kernel, `jax.experimental.pallas.ops.tpu.splash_attention`) for causal
self-attention on TPUs: blocks of queries against blocks of keys in TPU vector memory, the causal mask's empty
blocks skipped from a mask table built at trace time, never [T, T] in HBM. MaxText's TPU attention.

Design choices:
- Called per device (the caller's `shard_map`): a Pallas kernel is not partitioned by XLA. q [b, T, heads, d], k
  and v [b, T, kv_heads, d]; the kernel takes heads-major [heads, T, d] per sequence and is `vmap`ped over the
  batch. Grouped-query heads are the kernel's own (query head n reads kv head n // (heads / kv_heads), as
  `jax.nn.dot_product_attention` reads them). The kernel does not scale: q is multiplied by 1/sqrt(d) first.
- Blocks of `block_size(T, block)` queries and keys (the largest divisor of T up to `block`), for the forward and
  both backward kernels; XLA:TPU wants multiples of 128, which `attention_impl` checks before picking splash.
- The kernel's residuals (its output and log-sum-exp) are named `residual_name`, so that a remat policy saving the
  attention output keeps them instead of running the forward kernel again in the backward pass.
- Off a TPU (the CPU tests) the same kernel runs in Pallas's interpret mode: the same blocking and code path,
  slowly.
"""

from __future__ import annotations

import math

import jax

from shardlm.kernels.flash import block_size


def splash_attention(q, k, v, *, block: int = 512, interpret: bool = False, residual_name: str | None = None):
    """Causal attention of one device's rows: q [b, T, heads, d], k and v [b, T, kv_heads, d] -> [b, T, heads, d]."""
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    _, t, heads, d = q.shape
    size = block_size(t, block)
    sizes = kernels.BlockSizes(block_q=size, block_kv=size, block_kv_compute=size, block_q_dkv=size,
                               block_kv_dkv=size, block_kv_dkv_compute=size, block_q_dq=size, block_kv_dq=size)
    mask = masks.MultiHeadMask([masks.CausalMask((t, t)) for _ in range(heads)])
    kernel = kernels.make_splash_mha(mask, block_sizes=sizes, head_shards=1, q_seq_shards=1, interpret=interpret,
                                     residual_checkpoint_name=residual_name)
    heads_major = lambda x: x.transpose(0, 2, 1, 3)  # noqa: E731
    out = jax.vmap(kernel)(heads_major(q * (1.0 / math.sqrt(d))), heads_major(k), heads_major(v))
    return heads_major(out)
