"""Causal self-attention kernels: XLA's (any backend) and cuDNN's fused flash attention (NVIDIA GPUs).

Design choices:
- One signature, q [batch, T, heads, head_dim] and k, v [batch, S, kv_heads, head_dim] -> [batch, T, heads,
  head_dim]; grouped-query heads are read as `jax.nn.dot_product_attention` reads them (query head n uses kv head
  n // (heads / kv_heads)).
- What the backward pass keeps is named (`residual_name`), so that a `jax.checkpoint` policy can save it instead of
  running the kernel's forward pass again. cuDNN's kernel is a `custom_vjp` inside JAX whose residuals (the output
  and the softmax statistics, log-sum-exp per query and head) no policy can name: under any policy its forward
  kernel ran a second time in the backward pass. `cudnn_attention` is the same kernel pair (JAX's forward and
  backward rules, called as JAX calls them) under a `custom_vjp` of its own that names the two, so a policy that
  saves `residual_name` keeps 2 bytes per token x d_model (and 4 per token and head of statistics) and the
  backward pass runs cuDNN's backward kernel alone. The rules are JAX internals (`jax._src.cudnn`); a JAX without
  them gets the public `jax.nn.dot_product_attention`, whose forward then runs again.
- Documents packed in a row (`data.document_mask`): JAX 0.10's cuDNN attention takes them only in its packed
  layout, lengths and offsets for a static maximum M of documents per row, and its softmax statistics are then
  [rows x M, heads, T]: room for the T documents a row can hold is a [T, T] buffer per layer (compiled for H100s,
  4x what a GPT layer keeps at 1,024 positions), and a smaller M cannot mask a row with more documents exactly.
  So cuDNN's kernel takes no documents' ids (the registry's `documents=False`): `auto` then keeps it and
  attends across documents, and a run that asks for document masks on a GPU gets the blockwise kernel.
- XLA's attention is plain jnp: its backward needs the probabilities, which a policy that saves only named
  tensors recomputes from q and k (one more QK^T per head, as a flash kernel's backward pass does) instead of
  keeping [T, T] per head.
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name


def xla_attention(q, k, v, mask=None, *, residual_name: str | None = None):
    """XLA's attention with a boolean `mask` ([1, 1, T, S] or broadcastable; None: no mask): softmax in float32.
    The output is named `residual_name` (the next matmul's input)."""
    y = jax.nn.dot_product_attention(q, k, v, mask=mask, implementation="xla")
    return checkpoint_name(y, residual_name) if residual_name else y


def _cudnn_rules():
    """JAX's cuDNN attention internals: (module, its forward rule, its backward rule), or None if this JAX does not
    have them under those names."""
    try:
        from jax._src.cudnn import fused_attention_stablehlo as fa

        return fa, fa._dot_product_attention_fwd_rule, fa._dot_product_attention_bwd_rule
    except (ImportError, AttributeError):
        return None


def _cudnn_static(fa, q, causal: bool = True) -> tuple:
    """The kernel's static arguments: (scale, seed, dropout rate, (has bias, has bias gradient), mask, layout,
    sliding window, cuDNN version, return_residual), as `jax._src.cudnn.fused_attention_stablehlo.
    dot_product_attention` passes them."""
    mask = fa.MaskType.CAUSAL if causal else fa.MaskType.NO_MASK
    return (1.0 / math.sqrt(q.shape[-1]), 0, 0.0, (False, False), mask, fa._normalize_layout("BTNH").value, None,
            fa.check_cudnn_version(), False)


def _unused(dtype) -> tuple:
    """The kernel's unused operands (bias, sequence lengths, offsets, page tables), made in each trace."""
    return (jnp.zeros(0, dtype),) * 7


def cudnn_attention(q, k, v, *, residual_name: str | None = None):
    """cuDNN's fused causal attention, its output and softmax statistics named `residual_name`."""
    rules = _cudnn_rules()
    if rules is None or residual_name is None:
        return jax.nn.dot_product_attention(q, k, v, is_causal=True, implementation="cudnn")
    fa, fwd_rule, bwd_rule = rules
    static = _cudnn_static(fa, q)

    @jax.custom_vjp
    def attend(q, k, v):
        return fwd_rule(q, k, v, *_unused(q.dtype), *static)[0]

    def forward(q, k, v):
        out, res = fwd_rule(q, k, v, *_unused(q.dtype), *static)
        stats, out = checkpoint_name(res[-2], residual_name), checkpoint_name(out, residual_name)
        return out, (q, k, v, stats, out)

    def backward(saved, g):
        q, k, v, stats, out = saved
        grads = bwd_rule(*static, (q, k, v, *_unused(q.dtype), stats, out), g)
        return tuple(grads[:3])

    attend.defvjp(forward, backward)
    return attend(q, k, v)


def cudnn_available() -> bool:
    """Whether this JAX has the cuDNN kernel's rules that the ring's per-chunk use needs."""
    return _cudnn_rules() is not None


def cudnn_chunk_forward(q, k, v, causal: bool, q_seg=None, kv_seg=None):
    """cuDNN's kernel as the ring's per-chunk kernel (`shardlm.kernels.ring`), forward: q [b, tq, heads, d]
    against k, v [b, tk, kv_heads, d], causal or every key visible -> (out float32, lse [b, tq, heads] float32).
    cuDNN's softmax statistics are the log-sum-exp per query and head ([b, heads, tq]). No documents' ids
    (`shardlm.kernels.registry` hands it none)."""
    assert q_seg is None, "cuDNN's kernel takes no documents' ids here"
    fa, fwd_rule, _ = _cudnn_rules()
    out, res = fwd_rule(q, k, v, *_unused(q.dtype), *_cudnn_static(fa, q, causal))
    return out.astype(jnp.float32), res[-2].transpose(0, 2, 1)


def cudnn_chunk_backward(q, k, v, out, lse, d_out, causal: bool, q_seg=None, kv_seg=None):
    """cuDNN's backward kernel given the whole row's output and log-sum-exp (see `kernels.flash.chunk_backward`)
    -> (dq, dk, dv)."""
    fa, _, bwd_rule = _cudnn_rules()
    saved = (q, k, v, *_unused(q.dtype), lse.transpose(0, 2, 1), out.astype(q.dtype))
    return tuple(bwd_rule(*_cudnn_static(fa, q, causal), saved, d_out.astype(q.dtype))[:3])
