"""Splash attention (JAX's Pallas TPU kernel, `jax.experimental.pallas.ops.tpu.splash_attention`) for causal
self-attention on TPUs: blocks of queries against blocks of keys in TPU vector memory, the causal mask's empty
blocks skipped from a mask table built at trace time, never [T, T] in HBM. MaxText's TPU attention.

Design choices:
- Called per device (the caller's `shard_map`): a Pallas kernel is not partitioned by XLA. q [b, T, heads, d], k
  and v [b, T, kv_heads, d]; the kernel takes heads-major [heads, T, d] per sequence and is `vmap`ped over the
  batch. Grouped-query heads are the kernel's own (query head n reads kv head n // (heads / kv_heads), as
  `jax.nn.dot_product_attention` reads them). The kernel does not scale: q is multiplied by 1/sqrt(d) first.
- Blocks of `splash_block(T, block)` queries and keys, for the forward and both backward kernels: the largest
  multiple of 128 (the TPU's lane width, which the kernel requires of every block) that divides T and is at most
  max(128, block), `model.attention_block`. Any T that is a multiple of 128 has one (128 itself); no other T has
  any, and the model's gates (`models.layers.attention_impl`, `ring_chunk`) ask this same function before picking
  splash for a sequence or a ring's chunk. (The largest divisor of T up to `block`, as the blockwise kernel once
  chose, is 320 for T = 640 or 1280, which the kernel refuses.)
- The kernel's residuals (its output and log-sum-exp) are named `residual_name`, so that a remat policy saving the
  attention output keeps them instead of running the forward kernel again in the backward pass.
- Documents packed in a sequence: their ids are the kernel's `SegmentIds`, per sequence. Its block skipping is by
  the static (causal) mask only: a block wholly across documents is computed and masked.
- Off a TPU (the CPU tests) the same kernel runs in Pallas's interpret mode: the same blocking and code path,
  slowly.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp

LANES = 128  # the TPU's vector lanes: every splash block is a multiple of them


def splash_block(length: int, most: int = 512) -> int:
    """Splash's block for `length` positions: the largest multiple of `LANES` (128) that divides `length` and is
    at most max(128, `most`); 0 when `length` is not a positive multiple of 128 (splash cannot take it)."""
    if length <= 0 or length % LANES:
        return 0
    lanes = length // LANES
    return LANES * max(n for n in range(1, max(1, most // LANES) + 1) if lanes % n == 0)


def _modules():
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_kernel as kernels
    from jax.experimental.pallas.ops.tpu.splash_attention import splash_attention_mask as masks

    return kernels, masks


def _kernel(tq: int, tk: int, heads: int, causal: bool, block: int, interpret: bool, **options):
    """The splash kernel for one sequence's heads: q [tq] rows against k [tk], causal (tq == tk) or every key
    visible, blocks of `splash_block(tq, block)` queries and `splash_block(tk, block)` keys, for the forward and
    both backward kernels."""
    kernels, masks = _modules()
    bq, bk = splash_block(tq, block), splash_block(tk, block)
    if not bq or not bk:
        raise ValueError(f"splash attention takes multiples of {LANES} positions, not {tq} queries and {tk} keys")
    sizes = kernels.BlockSizes(block_q=bq, block_kv=bk, block_kv_compute=bk, block_q_dkv=bq, block_kv_dkv=bk,
                               block_kv_dkv_compute=bk, block_q_dq=bq, block_kv_dq=bk)
    mask = masks.CausalMask((tq, tk)) if causal else masks.FullMask((tq, tk))
    return kernels.make_splash_mha(masks.MultiHeadMask([mask] * heads), block_sizes=sizes, head_shards=1,
                                   q_seq_shards=1, interpret=interpret, **options)


def _heads_major(x):
    """[b, T, heads, d] <-> [b, heads, T, d] (the kernel's layout per sequence)."""
    return x.transpose(0, 2, 1, 3)


def _segment_ids(q_seg, kv_seg):
    """Documents' ids of a batch ([b, tq], [b, tk]) as the kernel takes them, or None."""
    return None if q_seg is None else _modules()[0].SegmentIds(q=q_seg, kv=kv_seg)


def splash_attention(q, k, v, *, block: int = 512, interpret: bool = False, residual_name: str | None = None,
                     segments=None):
    """Causal attention of one device's rows: q [b, T, heads, d], k and v [b, T, kv_heads, d] -> [b, T, heads, d];
    within documents where `segments` [b, T] gives their ids (the kernel's `SegmentIds`)."""
    _, t, heads, d = q.shape
    kernel = _kernel(t, t, heads, True, block, interpret, residual_checkpoint_name=residual_name)
    out = jax.vmap(kernel)(_heads_major(q * (1.0 / math.sqrt(d))), _heads_major(k), _heads_major(v),
                           _segment_ids(segments, segments))
    return _heads_major(out)


def splash_chunk_available() -> bool:
    """Whether this JAX has splash's backward rule under the name the ring's per-chunk use calls (a JAX
    internal)."""
    try:
        return hasattr(_modules()[0], "_splash_attention_bwd")
    except ImportError:
        return False


def splash_chunk_forward(q, k, v, causal: bool, q_seg=None, kv_seg=None, *, block: int = 512,
                         interpret: bool = False):
    """Splash as the ring's per-chunk kernel (`shardlm.kernels.ring`), forward: q [b, tq, heads, d] against k, v
    [b, tk, kv_heads, d] -> (out float32, lse [b, tq, heads] float32), the kernel's own residuals."""
    _, tq, heads, d = q.shape
    kernel = _kernel(tq, k.shape[1], heads, causal, block, interpret, save_residuals=True)
    out, (lse,) = jax.vmap(kernel)(_heads_major(q * (1.0 / math.sqrt(d))), _heads_major(k), _heads_major(v),
                                   _segment_ids(q_seg, kv_seg))
    return _heads_major(out).astype(jnp.float32), lse.transpose(0, 2, 1)


def splash_chunk_backward(q, k, v, out, lse, d_out, causal: bool, q_seg=None, kv_seg=None, *, block: int = 512,
                          interpret: bool = False):
    """Splash's backward kernels given the whole row's output and log-sum-exp (see `kernels.flash.chunk_backward`)
    -> (dq, dk, dv). The kernel's own backward rule (`_splash_attention_bwd`, a JAX internal) called with those
    residuals in place of the chunk's."""
    kernels, _ = _modules()
    _, tq, heads, d = q.shape
    scale = 1.0 / math.sqrt(d)
    kernel = _kernel(tq, k.shape[1], heads, causal, block, interpret)
    options = kernel.kwargs
    infos = [_collapsed(info) for info in (kernel.dq_mask_info, kernel.dkv_mask_info)]

    def one_sequence(q, k, v, segment_ids, out, lse, d_out):
        saved = (q, k, v, segment_ids, None, out, lse, *infos)
        grads = kernels._splash_attention_bwd(
            False, options["mask_value"], options["is_mqa"], options["block_sizes"], None,
            options["mask_function"], options["attn_logits_soft_cap"], interpret, saved, d_out)
        return grads[3:6]

    dq, dk, dv = jax.vmap(one_sequence)(_heads_major(q * scale), _heads_major(k), _heads_major(v),
                                        _segment_ids(q_seg, kv_seg), _heads_major(out.astype(q.dtype)),
                                        lse.transpose(0, 2, 1),
                                        _heads_major(d_out.astype(q.dtype)))
    return _heads_major(dq) * scale, _heads_major(dk), _heads_major(dv)


def _collapsed(info):
    """A mask table as `splash_attention_kernel._splash_attention` hands it to the kernels: partial mask blocks
    [n, block_q, block_kv]."""
    if info is None or info.partial_mask_blocks is None:
        return info
    return info._replace(partial_mask_blocks=info.partial_mask_blocks.reshape(
        -1, *info.partial_mask_blocks.shape[-2:]))
