"""Self-attention: the projections, rotary embeddings, the kernel each pass runs, and the KV cache. Math with
logical axis names; which kernel runs is the kernel registry's (`shardlm.kernels.registry`).

Design choices:
- The kernel for a pass is chosen once per forward pass (`attention_context`), from `model.attention` and what the
  target being compiled for runs (`shardlm.accelerator.current`): a kernel asked for by name where it cannot run
  is a one-line error (the registry's `refusal`), `auto` takes the first kernel that fits. What the kernel reads
  beyond q, k and v (XLA's [T, T] causal mask, the blockwise kernel's positions) is built once and shared by every
  layer. Generation (a prefill, a decode step) takes XLA's attention wherever cuDNN's does not run, so a model
  trained on GPUs generates on any host.
- Where a kernel runs is its `placement`: XLA's and cuDNN's on the whole arrays, keys and values constrained to
  every position (`kv_seq`) and named so that a remat policy can keep them; the blockwise kernel on the arrays as
  they are; a Pallas kernel (splash) on each device's rows and heads inside a `shard_map`, as XLA does not
  partition it. With the sequence split over `context`, the ring (`shardlm.kernels.ring`) runs inside a
  `shard_map` too, each chunk by a kernel that can be a chunk kernel.
- Attention reads keys and values as `kv_seq` (every position) while queries, scores and outputs keep `seq`: when
  the rules split the sequence without a ring, each device attends its own block of queries to all keys, and the
  causal mask, a global [T, T] array split by query rows, masks by global position.
- Keys and values may have fewer heads than queries (grouped-query attention, `kv_heads` dividing `heads`; one
  kv head is multi-query attention). Query head n reads kv head n // (heads / kv_heads), so splitting both head
  dimensions over `tensor` in contiguous blocks keeps every group on one device.
- Decoding keeps a fixed-size KV cache, [batch, kv_heads, seq_len, head_dim] per layer for keys and for values,
  in the compute dtype (`CACHE_AXES`: TP splits it by kv heads and DP/FSDP by batch), stacked over the layers.
  `prefill` fills positions 0..T-1 from a prompt; `decode` feeds one token per row at that row's own position and
  attends to the cache up to it. Rows may sit at different positions (prompts of different lengths).
- The kernels name what their backward pass keeps (the output and the softmax statistics), so that a remat
  policy saves them rather than running the kernel's forward pass again.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.accelerator import current
from shardlm.kernels.registry import (RING, attention_impl, attention_summary as kernel_summary, chunk_kernel,
                                      kernel_named, prefill_kernel, ring_chunk)
from shardlm.kernels.ring import ring_attention
from shardlm.models import remat
from shardlm.models.config import head_size
from shardlm.models.params import param, use
from shardlm.models.norms import RMSNorm
from shardlm.models.precision import Precision, add_bias, compute_dtype
from shardlm.models.rope import apply_rope
from shardlm.models.stack import LAYERS, LayerCache
from shardlm.sharding import active_degree, active_mesh, active_spec, constrain
from shardlm.sharding.rules import as_axes

CACHE_AXES = ("batch", "act_kv_heads", "seq", "head_dim")  # one layer's keys or values
STACKED_CACHE_AXES = (LAYERS, *CACHE_AXES)  # the model's cache, every layer's


class Context(NamedTuple):
    """What a forward pass computes once and every block reads, and the index of the block reading it."""

    impl: str  # a registered kernel's name ("xla", "cudnn", "flash", "splash", ...) or "ring", for this trace
    mask: jax.Array | None  # [1, 1, T, T] causal mask for a kernel that reads one (XLA's); None for the others
    rope: tuple[jax.Array, jax.Array] | None  # (sin, cos) [rows or 1, T, head_dim / 2], rotary families only
    pos: jax.Array | None  # decoding: each row's position [batch]
    positions: jax.Array | None = None  # flash: each row's place in the sequence [T]
    block: int = 512  # flash and ring: queries and keys per block
    zigzag: int = 0  # ring: the context degree whose zigzag layout the rows are in (dropout draws in order)
    chunk: str = "flash"  # ring: each chunk's kernel (one that can be a chunk kernel)
    layer: jax.Array | int = 0  # the block's index: its slice of the stacked KV cache
    segments: jax.Array | None = None  # the rows' documents' ids [batch, T] (`models.documents`); None: one each


def attention_context(requested: str, dtype, head_dim: int, length: int, *, block: int, context: str,
                      decoding: bool, rope, pos, segments=None) -> Context:
    """The attention `Context` of a pass over `length` positions (`decoding`: a prefill or a decode step) with the
    sequence split as the active rules split it: the kernel, and what it reads that every layer shares. With
    `segments` (documents' ids, [batch, T]) every kernel attends within each document. In the ring's zigzag layout
    (`zigzag` set) the caller moves the residual stream, the rotary tables and the ids there."""
    seq_split, documents = active_degree("seq"), segments is not None
    if decoding:
        # A prefill writes the cache in the sequence's order, a decode step attends to it: XLA's attention, or
        # the kernel asked for (or auto's) where it runs on whole arrays and fits, so that a model trained on GPUs
        # generates anywhere. A decode step attends to the cache by its own einsums whatever this says.
        impl = prefill_kernel(requested, dtype, head_dim, length) if seq_split == 1 else "xla"
    else:
        impl = attention_impl(requested, dtype, head_dim, seq_split, length=length, block=block, context=context,
                              documents=documents)
    needs = "" if impl == RING else kernel_named(impl).needs
    mask = causal_mask(length, segments) if pos is None and needs == "mask" else None  # once, for every layer
    positions = jnp.arange(length, dtype=jnp.int32) if needs == "positions" else None
    zigzag, chunk = 0, "flash"
    if impl == RING:
        zigzag, chunk = seq_split, ring_chunk(requested, dtype, head_dim, length, seq_split, documents)
    if documents:
        segments = constrain(segments, "batch", "seq")
    return Context(impl, mask, rope, pos, positions, block, zigzag, chunk, segments=segments)


def attention_summary(m, seq_split: int, documents: bool = False) -> str:
    """Which kernel a training step of model config `m` compiles with, for the target being compiled for, and why
    (a report's line); `documents`: within documents."""
    return kernel_summary(m.attention, compute_dtype(m.dtype), head_size(m), m.seq_len,
                          m.attention_block, seq_split, m.context_attention, documents)


def kernel_takes_documents(m, seq_split: int) -> bool:
    """Whether the kernel a training step of model config `m` runs with the sequence split `seq_split` ways, on
    the target being compiled for, takes documents' ids (in the ring: its chunk kernel): what `data.document_mask=
    auto` asks before masking, so that it never trades the target's fastest kernel for the mask (cuDNN's takes
    none: `shardlm.kernels.attention`)."""
    dtype, hd = compute_dtype(m.dtype), head_size(m)
    impl = attention_impl(m.attention, dtype, hd, seq_split, length=m.seq_len, block=m.attention_block,
                          context=m.context_attention)
    if impl == RING:
        return kernel_named(ring_chunk(m.attention, dtype, hd, m.seq_len, seq_split)).chunk_documents
    return kernel_named(impl).documents


def causal_mask(t: int, segments=None) -> jax.Array:
    """[1, 1, T, T]: query position i sees key positions 0..i; with `segments` [batch, T] (documents' ids),
    [batch, 1, T, T], within its document too. Split by query rows like the queries, so under context parallelism
    each device's rows mask its block by global position."""
    mask = jnp.tril(jnp.ones((t, t), jnp.bool_))[None, None]
    if segments is None:
        return constrain(mask, None, None, "seq", "kv_seq")
    mask = mask & (segments[:, None, :, None] == segments[:, None, None, :])
    return constrain(mask, "batch", None, "seq", "kv_seq")


def _attend_to_cache(q, cache: LayerCache, pos):
    """One query per row, q [batch, 1, heads, head_dim], against cached positions 0..pos[b] -> [batch, 1, heads,
    head_dim]. Written out rather than through `jax.nn.dot_product_attention`: with the cache laid out kv-heads-
    major these einsums need no transposed copy of the cache (XLA:CPU made one per layer per step, 4x the
    attention's cost at batch 8), and a single query gains nothing from a fused kernel. Softmax in float32."""
    b, _, h, d = q.shape
    kv = cache.k.shape[1]
    q = q[:, 0].reshape(b, kv, h // kv, d)  # query head n = kv head n // group, as in dot_product_attention
    scores = jnp.einsum("bkgd,bksd->bkgs", q, cache.k, preferred_element_type=jnp.float32) / math.sqrt(d)
    scores = jnp.where(jnp.arange(cache.k.shape[2]) <= pos[:, None, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache.v.dtype)
    return jnp.einsum("bkgs,bksd->bkgd", probs, cache.v).reshape(b, 1, h, d)


def self_attention(q, k, v, cache: LayerCache | None, ctx: Context):
    """q [batch, T, heads, head_dim], k and v [batch, T, kv_heads, head_dim] -> ([batch, T, heads, head_dim], cache).

    No cache: causal attention over the T positions (training). A cache (stacked over the layers; this block's
    slice is `ctx.layer`) and no `ctx.pos`: a prefill of positions 0..T-1, whose keys and values are written to
    the cache. A cache and `ctx.pos`: one decode step, T = 1 at position pos[b] of row b; its key and value are
    written there and it attends to positions 0..pos[b]. Writes go straight into the stacked cache (in place in
    the donated buffer), never through a copy of the layer's slice.
    """
    if ctx.pos is None:
        # The cache keeps its own layout, whatever the kernel reads.
        y = _context_ring(q, k, v, ctx) if ctx.impl == RING else _attend(q, k, v, ctx)
        if cache is not None:
            t = q.shape[1]
            cache = LayerCache(*(constrain(c.at[ctx.layer, :, :, :t].set(n.transpose(0, 2, 1, 3).astype(c.dtype)),
                                           *STACKED_CACHE_AXES) for c, n in zip(cache, (k, v))))
    else:
        # A scatter of one position per row, in place in the donated cache: O(1) per step, where a select over the
        # whole cache cost ~40% of a step. Sharded over batch, XLA all-gathers only the new rows' k and v
        # ([batch, kv_heads, head_dim] per layer), never the cache.
        rows = jnp.arange(q.shape[0])
        cache = LayerCache(*(constrain(c.at[ctx.layer, rows, :, ctx.pos].set(n[:, 0].astype(c.dtype)),
                                       *STACKED_CACHE_AXES) for c, n in zip(cache, (k, v))))
        y = _attend_to_cache(q, LayerCache(cache.k[ctx.layer], cache.v[ctx.layer]), ctx.pos)
    return constrain(y, "batch", "seq", "act_heads", "head_dim"), cache


def _attend(q, k, v, ctx: Context) -> jax.Array:
    """Causal attention over the whole sequence by the kernel `ctx.impl`, where its `placement` says it runs."""
    kernel = kernel_named(ctx.impl)
    attend = partial(kernel.attend, mask=ctx.mask, positions=ctx.positions, block=ctx.block,
                     interpret=current().platform != "tpu", residual_name=remat.ATTENTION)
    if kernel.placement == "per_device":
        return _per_device(attend, q, k, v, ctx.segments)
    if ctx.segments is not None:
        attend = partial(attend, segments=ctx.segments)
    if kernel.placement == "gathered":
        # Every key and value position, as each query block needs: an all-gather over context when the sequence
        # is split (and a reduce-scatter of their gradients), nothing otherwise. Named once gathered: a policy
        # that keeps them (`kv_gathered`) spares the backward pass their gather.
        k, v = (remat.named(constrain(t, "batch", "kv_seq", "act_kv_heads", "head_dim"), remat.KV_GATHERED)
                for t in (k, v))
    return attend(q, k, v)


def _per_device_specs(mesh, q, k) -> tuple[P, P]:
    """The `shard_map` specs of queries and of keys/values as the active rules split them, without the mesh's
    size-1 axes (which split nothing)."""
    live = lambda spec: P(*(tuple(a for a in as_axes(e) if mesh.shape[a] > 1) or None for e in spec))  # noqa: E731
    return (live(active_spec("batch", "seq", "act_heads", "head_dim", shape=q.shape)),
            live(active_spec("batch", "seq", "act_kv_heads", "head_dim", shape=k.shape)))


def _context_ring(q, k, v, ctx: Context) -> jax.Array:
    """Causal attention with the sequence split over the context axes: `shardlm.kernels.ring` on each device's
    rows (in the zigzag layout), with `ctx.chunk`'s kernel on each chunk, inside a `shard_map` over the whole mesh
    that keeps batch and heads split as the rules split them. (Manual over every axis: a pipeline's `vmap` over
    its stages adds the stage axis to the specs, which must then be manual too.)"""
    mesh = active_mesh()
    q_spec, kv_spec = _per_device_specs(mesh, q, k)
    axes = tuple(a for a in as_axes(active_spec("seq")[0]) if mesh.shape[a] > 1)
    kernel = chunk_kernel(ctx.chunk, block=ctx.block, interpret=current().platform != "tpu")
    run = lambda q, k, v, seg: ring_attention(q, k, v, axis=axes, devices=active_degree("seq"),  # noqa: E731
                                              kernel=kernel, residual_name=remat.ATTENTION, segments=seg)
    # check_vma=False: under the pipeline's vmap the rows vary over the stages, which the check refuses to combine
    # with the ring's unvarying constants; the ring's only collective is a permute, the same either way
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, _rows_spec(q_spec, ctx.segments)),
                         out_specs=q_spec, check_vma=False)(q, k, v, ctx.segments)


def _rows_spec(q_spec: P, segments) -> P | None:
    """The `shard_map` spec of the documents' ids [batch, T] beside queries split by `q_spec`, or None."""
    return None if segments is None else P(*q_spec[:2])


def _per_device(attend, q, k, v, segments=None) -> jax.Array:
    """A kernel XLA does not partition (a Pallas kernel: splash) on each device's rows and heads, inside a
    `shard_map` over the whole mesh; interpreted off a TPU, as in the CPU tests. `segments`: the rows' documents'
    ids, split as the queries' rows."""
    mesh = active_mesh()
    run = lambda q, k, v, seg: attend(q, k, v, segments=seg)  # noqa: E731
    if mesh is None:
        return run(q, k, v, segments)
    q_spec, kv_spec = _per_device_specs(mesh, q, k)
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec, _rows_spec(q_spec, segments)),
                         out_specs=q_spec, check_vma=False)(q, k, v, segments)


class Attention(nnx.Module):
    """Multi-head self-attention with `kv_heads` key/value heads, weights stored per head: [embed, heads,
    head_dim], so splitting heads over a mesh axis is a plain dimension split (Megatron column-parallel for
    q/k/v, row-parallel for the output projection). Rotary embeddings are applied when the context carries them.
    """

    def __init__(self, d: int, heads: int, kv_heads: int, n_layers: int, use_bias: bool, precision: Precision,
                 rngs: nnx.Rngs, *, head_dim: int = 0, qkv_bias: bool = False, qk_norm_eps: float = 0.0):
        """`head_dim` 0: d / heads. `use_bias`: biases on q, k, v and the output (GPT's); `qkv_bias`: on q, k and v
        only (Qwen2's). `qk_norm_eps` > 0: q and k each through a per-head RMSNorm before the rotation (Qwen3's,
        OLMo 2's QK-norm), learned scales of head_dim shared by the heads."""
        hd = head_dim or d // heads
        self.precision, param_dtype = precision, precision.param
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * n_layers))  # GPT-2's residual projection scaling
        self.wq = param(rngs, init, (d, heads, hd), ("embed", "heads", "head_dim"), param_dtype)
        self.wk = param(rngs, init, (d, kv_heads, hd), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wv = param(rngs, init, (d, kv_heads, hd), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wo = param(rngs, out_init, (heads, hd, d), ("heads", "head_dim", "embed"), param_dtype)
        zeros = nnx.initializers.zeros_init()
        bias = lambda shape, names: param(rngs, zeros, shape, names, param_dtype, read_in_float32=True)  # noqa: E731
        in_bias = use_bias or qkv_bias
        self.q_bias = bias((heads, hd), ("heads", "head_dim")) if in_bias else None
        self.k_bias = bias((kv_heads, hd), ("kv_heads", "head_dim")) if in_bias else None
        self.v_bias = bias((kv_heads, hd), ("kv_heads", "head_dim")) if in_bias else None
        self.out_bias = bias((d,), ("embed",)) if use_bias else None
        self.q_norm, self.k_norm = ((RMSNorm(hd, qk_norm_eps, param_dtype, rngs, axis="head_dim"),
                                     RMSNorm(hd, qk_norm_eps, param_dtype, rngs, axis="head_dim"))
                                    if qk_norm_eps else (None, None))

    def __call__(self, x, cache: LayerCache | None, ctx: Context):
        """x [batch, T, embed] -> ([batch, T, embed], cache); see `self_attention` for the cache's three modes."""

        def project(y, b, heads_axis):
            y = add_bias(y, b)
            return remat.named(constrain(y, "batch", "seq", heads_axis, "head_dim"), remat.QKV_PROJ)

        p = self.precision
        q, k, v = p.denses("bte,ehd->bthd", x, [use(w, p.compute) for w in (self.wq, self.wk, self.wv)])
        q = project(q, self.q_bias, "act_heads")
        k = project(k, self.k_bias, "act_kv_heads")
        v = project(v, self.v_bias, "act_kv_heads")
        if self.q_norm is not None:
            q, k = self.q_norm(q), self.k_norm(k)
        if ctx.rope is not None:
            q, k = apply_rope(q, ctx.rope), apply_rope(k, ctx.rope)
        y, cache = self_attention(q, k, v, cache, ctx)
        # [b, t, heads*head_dim] @ [heads*head_dim, embed]: both reshapes are free (row-major), and unlike an einsum
        # over (h, d) this needs no transposed copy of wo when y comes from `_attend_to_cache` (12% of a decode
        # step). heads stays the major half of the merged dimension, so a split over tensor carries over.
        b, t, h, d = y.shape
        wo = use(self.wo, p.compute).reshape(h * d, -1)
        out = add_bias(p.dense("btf,fd->btd", y.reshape(b, t, h * d), wo), self.out_bias)
        return remat.named(out, remat.OUT_PROJ), cache
