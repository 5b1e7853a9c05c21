"""What every model family shares: parameters with logical axis names, mixed precision, self-attention with a KV
cache, rematerialisation, and the decoder-only forward pass (embed -> blocks -> final norm -> logits). Math only.

Design choices:
- Parameters are stored in `param_dtype` (float32 master weights) and cast to the compute `dtype` where they are
  used. The cast comes before any FSDP all-gather XLA inserts at the use, so bfloat16 runs gather half the bytes.
  Gradients flow back through the cast, so they and the AdamW moments stay in `param_dtype`.
- Norms, softmax and the output logits are computed in float32 whatever the compute dtype: norms upcast their
  input, attention's logits and softmax are float32 inside `jax.nn.dot_product_attention`, and the head
  accumulates in float32 (`preferred_element_type`), so the loss never sees bfloat16 logits.
- Attention goes through `jax.nn.dot_product_attention`. Its default implementation is XLA's on every backend;
  `attention="auto"` asks for cuDNN's fused kernel on NVIDIA GPUs (Ampere or newer) when the inputs are 16-bit
  (the only dtypes it takes) and the head size suits it. The XLA path gets a causal mask built once per forward
  pass and shared by every layer; the cuDNN kernel is told `is_causal` and builds none.
- Attention reads keys and values as `kv_seq` (every position) while queries, scores and outputs keep `seq`:
  when the sharding rules split the sequence (context parallelism), each device attends its own block of
  queries to all keys, and the causal mask, a global [T, T] array split by query rows, masks by global position.
  Every device computes the same amount (its query block against every key), so the causal work is balanced
  without reordering the sequence. cuDNN's fused kernel refuses a split sequence, so "auto" picks XLA's then.
- Keys and values may have fewer heads than queries (grouped-query attention, `kv_heads` dividing `heads`; one
  kv head is multi-query attention). Query head n reads kv head n // (heads / kv_heads), so splitting both head
  dimensions over `tensor` in contiguous blocks keeps every group on one device.
- Decoding keeps a fixed-size KV cache, [batch, kv_heads, seq_len, head_dim] per layer for keys and for values,
  in the compute dtype (`CACHE_AXES`: TP splits it by kv heads and DP/FSDP by batch). `prefill` fills positions
  0..T-1 from a prompt; `decode` feeds one token per row at that row's own position and attends to the cache up
  to it. Rows may sit at different positions (prompts of different lengths).
- Every block trains under a remat policy over its named activations (`shardlm.models.remat`), `model.remat=none`
  included: "none" saves the matmul outputs the backward pass needs and recomputes the elementwise work from them;
  "full" saves only the block's input; the others save subsets, or offload them to host memory.
- The attention kernels (`shardlm.kernels.attention`, `.flash`, `.splash`, `.ring`) name what their backward pass
  keeps (the output and the softmax statistics), so that a policy saves them rather than running the kernel's
  forward pass again.
- A kernel asked for by name where it cannot run is a one-line error, said for the accelerator being compiled for
  (`shardlm.accelerator.current`): cuDNN's off an NVIDIA GPU of compute capability 8.0+, with float32 inputs, a
  head size it does not take or an odd length (`check_cudnn`, the same rule `auto` asks before picking it), splash
  at a length that is not a multiple of 128 (`kernels.splash.splash_block`: the one rule of splash's blocks, which
  its gates here ask too). Generation (a prefill, a decode step) takes XLA's attention wherever cuDNN's does not
  run, so a model trained on GPUs generates on any host.
- The blocks are one module per layer or one scanned stack (`model.scan_layers`, `shardlm.models.stack`); the
  KV cache is stacked over the layers either way.
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.accelerator import current, resolve_dtype
from shardlm.errors import ShardlmError
from shardlm.kernels.attention import cudnn_attention, xla_attention
from shardlm.kernels.flash import blockwise_attention
from shardlm.kernels.ring import (CHUNK_KERNEL_NAMES, chunk_kernel, chunk_kernel_available, from_zigzag,
                                  ring_attention, to_zigzag)
from shardlm.kernels.splash import splash_attention, splash_block
from shardlm.models import remat
from shardlm.models.head import head_loss, token_axes
from shardlm.models.one_f_one_b import run_1f1b
from shardlm.models.pipeline import microbatch_count, row_order, run_pipeline
from shardlm.models.precision import CAST_WHERE_READ, READ_IN_FLOAT32, add_bias, compute_view, matmul, matmuls
from shardlm.models.stack import LAYERS, RESIDUAL, LayerCache, build_blocks, layer_rngs, run_blocks
from shardlm.sharding import (active_degree, active_mesh, active_spec, constrain, constrain_with_gradient,
                              copies_over, sharded_lookup)
from shardlm.sharding.rules import as_axes

VOCAB_MULTIPLE = 64  # GPT-2's 50257 -> 50304, the usual choice; also keeps matmuls aligned.
CACHE_AXES = ("batch", "act_kv_heads", "seq", "head_dim")  # one layer's keys or values
STACKED_CACHE_AXES = (LAYERS, *CACHE_AXES)  # the model's cache, every layer's
DTYPES = {"float32": jnp.float32, "bfloat16": jnp.bfloat16}
COMPUTE_DTYPES = ("auto", *DTYPES)  # auto: bfloat16 on GPUs and TPUs, float32 on a CPU (`shardlm.accelerator`)
ATTENTION_IMPLS = ("auto", "xla", "cudnn", "flash", "splash")


def compute_dtype(name: str):
    """The jnp dtype a block computes in for `model.dtype` (auto resolved for the accelerator compiled for)."""
    return DTYPES[resolve_dtype(name)]


def reduce_dtype(name: str):
    """The jnp dtype of `model.grad_reduce_dtype` (None for auto: each gradient in the dtype it is computed in)."""
    return None if name == "auto" else DTYPES[name]


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


class Context(NamedTuple):
    """What a forward pass computes once and every block reads, and the index of the block reading it."""

    impl: str  # "xla", "cudnn", "flash", "splash" or "ring", resolved for this trace
    mask: jax.Array | None  # [1, 1, T, T] causal mask for the XLA attention path; None for the others and decoding
    rope: tuple[jax.Array, jax.Array] | None  # (sin, cos) [rows or 1, T, head_dim / 2], rotary families only
    pos: jax.Array | None  # decoding: each row's position [batch]
    positions: jax.Array | None = None  # flash: each row's place in the sequence [T]
    block: int = 512  # flash and ring: queries and keys per block
    zigzag: int = 0  # ring: the context degree whose zigzag layout the rows are in (dropout draws in order)
    chunk: str = "flash"  # ring: each chunk's kernel ("cudnn", "splash" or "flash")
    layer: jax.Array | int = 0  # the block's index: its slice of the stacked KV cache


def check_attention(requested: str, seq_split: int, context: str = "ring") -> None:
    """cuDNN's fused kernel refuses a sequence split over devices unless the ring hands it one chunk at a time:
    said when the mesh is known (before compiling) and again when the model is traced under the rules."""
    if requested == "cudnn" and seq_split > 1 and context != "ring":
        raise ShardlmError(f"model.attention=cudnn cannot take a sequence split {seq_split} ways over mesh.context "
                           "with model.context_attention=all_gather (cuDNN's fused kernel refuses sequence "
                           "sharding); use model.context_attention=ring, or model.attention=auto or xla")


def attention_impl(requested: str, dtype, head_dim: int, seq_split: int = 1, *, length: int = 0,
                   block: int = 512, context: str = "ring") -> str:
    """The kernel for a training or evaluation pass over `length` positions. A sequence split over devices: the
    ring (`context="ring"`, for "auto" and "flash") or XLA's attention over all-gathered keys and values. Else
    "auto" is cuDNN's fused kernel where it applies (`_cudnn_refusal`: NVIDIA GPUs of compute capability 8.0 or
    newer, 16-bit inputs, head_dim a multiple of 8 up to 128 or 256, an even length), the blockwise kernel for sequences longer than a `block`, XLA's attention
    for shorter ones (whose [T, T] is small and which XLA fuses). The GPU is the one being compiled for
    (`shardlm.accelerator.current`), so a compile for an H100 from a CPU host picks what a run on the H100 would."""
    check_attention(requested, seq_split, context)
    if seq_split > 1:
        return "ring" if uses_ring(requested, context) else "xla"
    if requested == "splash" and not splash_block(length, block):
        raise ShardlmError(f"model.attention=splash needs a sequence that is a multiple of 128 positions (the TPU "
                           f"kernel's lane width), got {length}; use model.attention=auto or a multiple of 128")
    if requested == "cudnn":
        check_cudnn(dtype, head_dim, length)
    if requested != "auto":
        return requested
    if _cudnn_applies(dtype, head_dim, length):
        return "cudnn"
    if _splash_applies(length, head_dim):
        return "splash"
    return "flash" if length > block else "xla"


def check_cudnn(dtype, head_dim: int = 0, length: int = 0) -> None:
    """`model.attention=cudnn` where cuDNN's fused kernel cannot run, a one-line error (`_cudnn_refusal`).
    Unchecked, a CPU host was cuDNN's own traceback ("cuDNN is not detected"), float32 a KeyError from inside JAX,
    and an odd length JAX's NotImplementedError."""
    refusal = _cudnn_refusal(dtype, head_dim, length)
    if refusal:
        raise ShardlmError(refusal)


def _cudnn_refusal(dtype, head_dim: int = 0, length: int = 0) -> str:
    """Why cuDNN's fused kernel cannot run on the accelerator being compiled for (`shardlm.accelerator.current`: a
    CPU host compiling for H100s passes) with `dtype` inputs, heads of `head_dim` and `length` positions (0: not
    known here), as a one-line error's text, or "". It takes what JAX's cuDNN attention takes: an NVIDIA GPU of
    compute capability 8.0 or newer, 16-bit inputs, head sizes that are multiples of 8 up to 128 (256 from
    Hopper on), and, training, an even length (JAX passes the kernel an empty bias, and refuses odd lengths with a
    bias)."""
    target = current()
    if target.platform != "gpu" or (target.compute_capability or 8.0) < 8.0:
        where = "cpu" if target.platform == "cpu" else target.device_kind + (
            f" (compute capability {target.compute_capability})" if target.compute_capability else "")
        return (f"model.attention=cudnn needs an NVIDIA GPU of compute capability 8.0 or newer, and this run is on "
                f"{where}; use model.attention=auto or xla")
    if jnp.dtype(dtype) not in (jnp.dtype(jnp.bfloat16), jnp.dtype(jnp.float16)):
        return (f"model.attention=cudnn takes 16-bit inputs only, and model.dtype is {jnp.dtype(dtype).name}; use "
                "model.dtype=bfloat16, or model.attention=auto or xla")
    most = 256 if (target.compute_capability or 0.0) >= 9.0 else 128
    if head_dim and (head_dim % 8 or head_dim > most):
        return (f"model.attention=cudnn takes head sizes that are multiples of 8 up to {most} on "
                f"{target.device_kind}, and d_model / n_heads is {head_dim}; change model.n_heads or model.d_model, "
                "or use model.attention=auto or xla")
    if length % 2:
        return (f"model.attention=cudnn takes an even number of positions (JAX's cuDNN attention refuses an odd "
                f"one in training), and this pass has {length}; use an even model.seq_len, or model.attention=auto "
                "or xla")
    return ""


def _cudnn_applies(dtype, head_dim: int, length: int = 0) -> bool:
    """cuDNN's fused kernel takes it (`_cudnn_refusal`), on a GPU whose compute capability is known."""
    return not _cudnn_refusal(dtype, head_dim, length) and current().compute_capability is not None


def _splash_applies(length: int, head_dim: int) -> bool:
    """Splash takes it: a TPU, a length splash can block (a multiple of 128, its lane width: `splash_block`),
    head_dim 64 or 128."""
    return current().platform == "tpu" and splash_block(length) > 0 and head_dim in (64, 128)


def ring_chunk(requested: str, dtype, head_dim: int, length: int, seq_split: int) -> str:
    """The ring's per-chunk kernel (`kernels.ring.chunk_kernel`) for a sequence of `length` split `seq_split` ways:
    each chunk is length / (2 seq_split) positions. "auto": cuDNN's where it applies, splash on a TPU, the
    blockwise kernel elsewhere; a kernel asked for by name is that one."""
    chunk = length // (2 * seq_split)
    if requested == "splash" and not splash_block(chunk):
        raise ShardlmError(f"model.attention=splash in the ring needs chunks of a multiple of 128 positions, got "
                           f"{length} / (2 x context {seq_split}) = {chunk}; use model.attention=auto, or a "
                           f"seq_len that is a multiple of {256 * seq_split}")
    if requested == "cudnn":
        check_cudnn(dtype, head_dim, chunk)
    if requested in ("cudnn", "splash") and not chunk_kernel_available(requested):
        raise ShardlmError(f"model.attention={requested} in the ring needs JAX internals this JAX does not have "
                           f"({CHUNK_KERNEL_NAMES[requested]}'s rules under their 0.10 names); use "
                           "model.attention=auto or flash")
    if requested in ("cudnn", "splash", "flash"):
        return requested
    if _cudnn_applies(dtype, head_dim, chunk) and chunk_kernel_available("cudnn"):
        return "cudnn"
    return "splash" if _splash_applies(chunk, head_dim) and chunk_kernel_available("splash") else "flash"


def uses_ring(requested: str, context: str) -> bool:
    """Whether a sequence split over devices runs ring attention (else XLA's over all-gathered keys and values)."""
    return context == "ring" and requested in ("auto", "flash", "splash", "cudnn")


def attention_summary(m, seq_split: int) -> str:
    """Which kernel a training step of model config `m` compiles with, for the target being compiled for, and why
    (a report's line)."""
    dtype = DTYPES[resolve_dtype(m.dtype)]
    impl = attention_impl(m.attention, dtype, m.d_model // m.n_heads, seq_split, length=m.seq_len,
                          block=m.attention_block, context=m.context_attention)
    if impl == "ring":
        chunk = ring_chunk(m.attention, dtype, m.d_model // m.n_heads, m.seq_len, seq_split)
        return (f"ring over context={seq_split} (zigzag layout), {CHUNK_KERNEL_NAMES[chunk]} on each chunk of keys: "
                "never [T, T]")
    if impl == "cudnn":
        return "cuDNN's fused kernel (an NVIDIA GPU, 16-bit inputs)"
    if impl == "splash":
        return "Pallas splash attention (a TPU" + (")" if m.attention == "auto" else "; model.attention=splash)")
    if impl == "flash":
        why = "model.attention=flash" if m.attention == "flash" else (
            f"{m.seq_len} positions, more than model.attention_block={m.attention_block}")
        return f"the blockwise kernel, never [T, T] ({why})"
    if seq_split > 1:
        return (f"XLA's, over keys and values all-gathered over context={seq_split}: [T/{seq_split}, T] scores per "
                "head (" + ("model.context_attention=all_gather)" if m.context_attention != "ring" else
                            f"model.attention={m.attention})"))
    why = f"model.attention={m.attention}" if m.attention != "auto" else (
        f"{m.seq_len} positions, at most model.attention_block={m.attention_block}")
    return f"XLA's, [T, T] scores per head ({why})"


def causal_mask(t: int) -> jax.Array:
    """[1, 1, T, T]: query position i sees key positions 0..i. Split by query rows like the queries, so under
    context parallelism each device's rows mask its block by global position."""
    return constrain(jnp.tril(jnp.ones((t, t), jnp.bool_))[None, None], None, None, "seq", "kv_seq")


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
        # Every key and value position, as each query block needs: an all-gather over context when the sequence
        # is split (and a reduce-scatter of their gradients), nothing otherwise. The cache keeps its own layout.
        # Named once gathered: a policy that keeps them (`kv_gathered`) spares the backward pass their gather.
        if ctx.impl == "ring":
            y = _context_ring(q, k, v, ctx)
        elif ctx.impl == "splash":
            y = _per_device_splash(q, k, v, ctx.block)
        elif ctx.impl == "flash":
            y = blockwise_attention(q, k, v, ctx.positions, ctx.positions, block_q=ctx.block, block_k=ctx.block,
                                    residual_name=remat.ATTENTION)
        else:
            k_all, v_all = (remat.named(constrain(t, "batch", "kv_seq", "act_kv_heads", "head_dim"),
                                        remat.KV_GATHERED) for t in (k, v))
            if ctx.impl == "cudnn":
                y = cudnn_attention(q, k_all, v_all, residual_name=remat.ATTENTION)
            else:
                y = xla_attention(q, k_all, v_all, ctx.mask, residual_name=remat.ATTENTION)
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
    run = lambda q, k, v: ring_attention(q, k, v, axis=axes, devices=active_degree("seq"),  # noqa: E731
                                         kernel=kernel, residual_name=remat.ATTENTION)
    # check_vma=False: under the pipeline's vmap the rows vary over the stages, which the check refuses to combine
    # with the ring's unvarying constants; the ring's only collective is a permute, the same either way
    return jax.shard_map(run, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v)


def _per_device_splash(q, k, v, block: int) -> jax.Array:
    """Splash attention (`shardlm.kernels.splash`) on each device's rows and heads, inside a `shard_map` over the
    whole mesh (a Pallas kernel is not partitioned by XLA); interpreted off a TPU, as in the CPU tests."""
    mesh = active_mesh()
    attend = lambda q, k, v: splash_attention(q, k, v, block=block, interpret=current().platform != "tpu",  # noqa: E731
                                              residual_name=remat.ATTENTION)
    if mesh is None:
        return attend(q, k, v)
    q_spec, kv_spec = _per_device_specs(mesh, q, k)
    return jax.shard_map(attend, mesh=mesh, in_specs=(q_spec, kv_spec, kv_spec), out_specs=q_spec,
                         check_vma=False)(q, k, v)


def rope_tables(positions: jax.Array, head_dim: int, theta: float) -> tuple[jax.Array, jax.Array]:
    """(sin, cos) [rows, T, head_dim / 2] for integer positions [rows, T], in float32."""
    freqs = theta ** (-jnp.arange(0, head_dim, 2, dtype=jnp.float32) / head_dim)
    angles = positions.astype(jnp.float32)[..., None] * freqs
    return jnp.sin(angles), jnp.cos(angles)


def apply_rope(x: jax.Array, rope: tuple[jax.Array, jax.Array]) -> jax.Array:
    """Rotary position embedding of x [batch, T, heads, head_dim], rotating the pairs (i, i + head_dim / 2) (the
    "rotate half" layout of GPT-NeoX and Hugging Face Llama), in float32."""
    sin, cos = (t[:, :, None, :] for t in rope)
    x1, x2 = jnp.split(x.astype(jnp.float32), 2, axis=-1)
    return jnp.concatenate([x1 * cos - x2 * sin, x2 * cos + x1 * sin], axis=-1).astype(x.dtype)


class Attention(nnx.Module):
    """Multi-head self-attention with `kv_heads` key/value heads, weights stored per head: [embed, heads,
    head_dim], so splitting heads over a mesh axis is a plain dimension split (Megatron column-parallel for
    q/k/v, row-parallel for the output projection). Rotary embeddings are applied when the context carries them.
    """

    def __init__(self, d: int, heads: int, kv_heads: int, n_layers: int, use_bias: bool, dtype, param_dtype,
                 rngs: nnx.Rngs, reduce_dtype=None, fp8: bool = False):
        hd = d // heads
        self.dtype, self.reduce_dtype, self.fp8 = dtype, reduce_dtype, fp8
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * n_layers))  # GPT-2's residual projection scaling
        self.wq = param(rngs, init, (d, heads, hd), ("embed", "heads", "head_dim"), param_dtype)
        self.wk = param(rngs, init, (d, kv_heads, hd), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wv = param(rngs, init, (d, kv_heads, hd), ("embed", "kv_heads", "head_dim"), param_dtype)
        self.wo = param(rngs, out_init, (heads, hd, d), ("heads", "head_dim", "embed"), param_dtype)
        zeros = nnx.initializers.zeros_init()
        if use_bias:
            bias = lambda shape, names: param(rngs, zeros, shape, names, param_dtype, read_in_float32=True)  # noqa: E731
            self.q_bias = bias((heads, hd), ("heads", "head_dim"))
            self.k_bias = bias((kv_heads, hd), ("kv_heads", "head_dim"))
            self.v_bias = bias((kv_heads, hd), ("kv_heads", "head_dim"))
            self.out_bias = bias((d,), ("embed",))
        else:
            self.q_bias = self.k_bias = self.v_bias = self.out_bias = None

    def __call__(self, x, cache: LayerCache | None, ctx: Context):
        """x [batch, T, embed] -> ([batch, T, embed], cache); see `self_attention` for the cache's three modes."""

        def project(y, b, heads_axis):
            y = add_bias(y, b)
            return remat.named(constrain(y, "batch", "seq", heads_axis, "head_dim"), remat.QKV_PROJ)

        q, k, v = matmuls("bte,ehd->bthd", x, [use(w, self.dtype) for w in (self.wq, self.wk, self.wv)],
                          self.reduce_dtype, self.fp8)
        q = project(q, self.q_bias, "act_heads")
        k = project(k, self.k_bias, "act_kv_heads")
        v = project(v, self.v_bias, "act_kv_heads")
        if ctx.rope is not None:
            q, k = apply_rope(q, ctx.rope), apply_rope(k, ctx.rope)
        y, cache = self_attention(q, k, v, cache, ctx)
        # [b, t, heads*head_dim] @ [heads*head_dim, embed]: both reshapes are free (row-major), and unlike an einsum
        # over (h, d) this needs no transposed copy of wo when y comes from `_attend_to_cache` (12% of a decode
        # step). heads stays the major half of the merged dimension, so a split over tensor carries over.
        b, t, h, d = y.shape
        wo = use(self.wo, self.dtype).reshape(h * d, -1)
        out = add_bias(matmul("btf,fd->btd", y.reshape(b, t, h * d), wo, self.reduce_dtype, self.fp8), self.out_bias)
        return remat.named(out, remat.OUT_PROJ), cache


def _projections_input(y: jax.Array) -> jax.Array:
    """A norm's output as the projections after it read it. The norm runs as the residual stream is split; under
    sequence parallelism its output is then gathered over the sequence once for all of them (q, k and v; the gate
    and up projections), and their gradients' partial sums, added, are reduce-scattered straight back to the
    residual stream's split (`sharding.constrain_with_gradient`). Left to propagation with the sequence split over
    context too, XLA gathered the input once per projection where it recomputed them, and again for every
    weight's gradient (compiled for 64 H100s, the 70B row of docs/targets.md gathered each norm output of the
    backward pass 5 times). Without sequence parallelism both splits are the same."""
    return constrain_with_gradient(constrain(y, *RESIDUAL), ("batch", "seq", "act_embed"), RESIDUAL)


def _residual_branch(y: jax.Array) -> jax.Array:
    """A row-parallel projection's output (attention's output projection, the MLP's down projection) as the
    residual stream receives it: its partial sums reduce-scattered into the stream's split, and its gradient
    gathered over the sequence once, where both of the projection's transposes read it (the input's gradient and
    the weight's); left to propagation, XLA gathered it once for each, over different groups."""
    return constrain_with_gradient(y, RESIDUAL, ("batch", "seq", "act_embed"))


class PreNormBlock(nnx.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)), with dropout on both residual branches. A family's block builds
    `ln1`, `attn`, `ln2`, `mlp` and `dropout`, and sets `sparse` when its MLP is a mixture of experts (which
    returns its statistics with its output: `shardlm.models.moe`)."""

    sparse = False

    def __call__(self, x, rngs: nnx.Rngs | None, cache: LayerCache | None, ctx: Context):
        """-> (x, cache, stats): `stats` {"aux_loss", "expert_tokens", "moe_dropped", "moe_overflow"} for a sparse
        block, {} for a dense one."""
        x = remat.named(x, remat.BLOCK_INPUT)
        a, cache = self.attn(_projections_input(self.ln1(x)), cache, ctx)
        x = x + self._dropout(_residual_branch(a), rngs, ctx)
        x = constrain(x, *RESIDUAL)
        h, stats = self.mlp(_projections_input(self.ln2(x))), {}
        if self.sparse:
            h, moe = h
            stats = {"aux_loss": moe.aux_loss, "expert_tokens": moe.expert_tokens, "moe_dropped": moe.dropped,
                     "moe_overflow": moe.overflow}
        h = remat.named(_residual_branch(h), remat.MLP_OUT)
        x = x + self._dropout(h, rngs, ctx)
        return constrain(x, *RESIDUAL), cache, stats

    def _dropout(self, x, rngs, ctx: Context):
        """Dropout on a residual branch. In the ring's zigzag layout the mask is drawn in the sequence's own order
        (and the branch moved there and back for it), so that it is the mask any other mesh draws."""
        if rngs is None or not ctx.zigzag or not self.dropout.rate:
            return self.dropout(x, deterministic=rngs is None, rngs=rngs)
        # In the sequence's order the branch stays split over context (contiguous shares), and so does the mask:
        # each device draws its share of the bits. Unpinned, XLA gathered the whole sequence to every context
        # device and drew the whole mask on each (dp2 x cp4 on 8 CPU devices: four times the bits).
        in_order = constrain(from_zigzag(x, ctx.zigzag), *RESIDUAL)
        return to_zigzag(constrain(self.dropout(in_order, rngs=rngs), *RESIDUAL), ctx.zigzag)


class CausalLM(nnx.Module):
    """The decoder-only forward pass every family shares. A family provides `_embed(tokens, rngs, pos)` (tokens to
    the residual stream, from `_token_rows`, and rotary tables if it uses them), `blocks` (`PreNormBlock`s, built by
    `shardlm.models.stack.build_blocks`), the final norm `ln_f`, the token table `wte` and, untied, `lm_head`, and
    sets `vocab_size` (the tokenizer's; the tables have `padded_vocab` rows), `context` (seq_len), `dtype`
    (compute), `attention` (the requested implementation), `remat` and `remat_offload` (`shardlm.models.remat`), and
    builds its blocks with `_stack_blocks`.

    With the stacked blocks split over pipeline stages (the rule table maps `layers` to the `stage` mesh axis), a
    training or evaluation pass runs them as a pipeline (`shardlm.models.pipeline`); the embedding and the head
    stay outside it, except that a 1F1B schedule's training loss runs the head inside (`loss`). Decoding runs them
    one after another.
    """

    def _stack_blocks(self, cfg, make_block, rngs: nnx.Rngs, stages: int = 1):
        """The blocks (`make_block(rngs)` per layer) and what running them needs: their number and layout, the head
        shape of the KV cache, and the pipeline's settings for a mesh of `stages` pipeline stages (a circular
        schedule holds the stack's rows in its own order: `layer_order`, None when row i is layer i)."""
        self.n_layers, self.scan_layers = cfg.n_layers, cfg.scan_layers
        self.kv_heads, self.head_dim = cfg.n_kv_heads or cfg.n_heads, cfg.d_model // cfg.n_heads
        self.stages, self.microbatches, self.repeats = stages, cfg.pipeline_microbatches, cfg.pipeline_repeats
        self.pipeline_remat, self.pipeline_schedule = cfg.pipeline_remat, cfg.pipeline_schedule
        self.aux_loss_weight = cfg.moe_aux_loss_weight if cfg.moe_experts else 0.0  # a 1F1B pipeline's objective
        self.reduce_dtype, self.loss_chunks = reduce_dtype(cfg.grad_reduce_dtype), cfg.loss_chunks
        self.context_attention, self.attention_block = cfg.context_attention, cfg.attention_block
        self.layer_order = row_order(cfg.n_layers, stages, cfg.pipeline_repeats)
        self.blocks = build_blocks(make_block, cfg.n_layers, rngs.params(), cfg.scan_layers, self.layer_order)

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None, *, at: jax.Array | None = None
                 ) -> jax.Array:
        """tokens [batch, seq] int32 -> logits [batch, seq, padded_vocab] float32. `rngs` enables dropout. With
        `at` [batch], only the logits at position at[b] of each row: [batch, 1, padded_vocab] (the output head is
        most of a small model's FLOPs, and all the positions' logits of a long batch are gigabytes)."""
        return self._forward(tokens, rngs, at=at)[0]

    def with_stats(self, tokens: jax.Array, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """(logits, the blocks' statistics): a mixture of experts' {"aux_loss" (its load-balancing loss, the mean
        over the sparse layers), "expert_tokens" ([experts]: token-assignments each expert received, summed over
        them)}; {} for a dense model. What a training step reads."""
        logits, _, stats = self._forward(tokens, rngs)
        return logits, self._mean_aux(stats)

    def init_cache(self, batch: int) -> LayerCache:
        """An empty KV cache for `batch` rows and the whole context, stacked over the layers, in the compute dtype
        (shard it with `STACKED_CACHE_AXES`)."""
        shape = (self.n_layers, batch, self.kv_heads, self.context, self.head_dim)
        return LayerCache(jnp.zeros(shape, self.dtype), jnp.zeros(shape, self.dtype))

    def prefill(self, tokens: jax.Array, cache: LayerCache, *, at: jax.Array | None = None
                ) -> tuple[jax.Array, LayerCache]:
        """tokens [batch, T] at positions 0..T-1 -> (logits [batch, T, padded_vocab], cache holding them); with
        `at` [batch], only each row's logits at position at[b] ([batch, 1, padded_vocab])."""
        return self._forward(tokens, None, cache, at=at)[:2]

    def decode(self, tokens: jax.Array, pos: jax.Array, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """tokens [batch, 1], row b at position pos[b] (< seq_len) -> (logits [batch, 1, padded_vocab], cache)."""
        return self._forward(tokens, None, cache, pos)[:2]

    def _stats_zeros(self) -> dict:
        """The structure the blocks' statistics take, zero: a mixture of experts' (see `with_stats`), or {}."""
        if not getattr(self, "moe_experts", 0):
            return {}
        return {"aux_loss": jnp.zeros((), jnp.float32), "expert_tokens": jnp.zeros((self.moe_experts,), jnp.float32),
                "moe_dropped": jnp.zeros((), jnp.float32), "moe_overflow": jnp.zeros((), jnp.float32)}

    def _forward(self, tokens, rngs, cache=None, pos=None, at=None, head=True):
        """(logits, cache, stats); with `head=False`, the final norm's output [batch, T, d_model] instead of the
        logits (what `loss` multiplies out chunk by chunk). The modules run on their weights' compute copies
        (`shardlm.models.precision`)."""
        view = compute_view(self, self.dtype, self.reduce_dtype)
        return view._run(tokens, rngs, cache, pos, at, head, stored_blocks=self.blocks)

    def loss(self, tokens: jax.Array, targets: jax.Array, rngs: nnx.Rngs | None = None) -> tuple[jax.Array, dict]:
        """(mean cross entropy of `targets` [batch, T] after `tokens` [batch, T], the blocks' statistics as
        `with_stats` gives them): the head and the loss fused and chunked over the vocabulary
        (`shardlm.models.head`), float32 logits never held for the whole vocabulary. What a training step
        minimises. On pipeline stages under `model.pipeline_schedule=1f1b`, the head and loss run inside the
        pipeline, each microbatch's as it leaves the last stage (`shardlm.models.one_f_one_b`)."""
        tied = self.lm_head is None
        head_weight = (self.wte if tied else self.lm_head)[...]
        if self.pipeline_schedule == "1f1b" and active_degree(LAYERS) > 1:
            view = compute_view(self, self.dtype, self.reduce_dtype)
            return view._one_f_one_b_loss(tokens, targets, rngs, head_weight, tied, stored_blocks=self.blocks)
        x, _, stats = self._forward(tokens, rngs, head=False)
        return self._head_loss(x, head_weight, targets, tied), self._mean_aux(stats)

    def _head_loss(self, x, head_weight, targets, tied: bool, token_copies: bool = False) -> jax.Array:
        with jax.named_scope("loss"):  # the output head's matmuls with it
            return head_loss(x, head_weight, targets, tied=tied, vocab_size=self.vocab_size,
                             compute_dtype=self.dtype, reduce_dtype=self.reduce_dtype, chunks=self.loss_chunks,
                             token_copies=token_copies)

    def _one_f_one_b_loss(self, tokens, targets, rngs, head_weight, tied: bool, stored_blocks
                          ) -> tuple[jax.Array, dict]:
        """`loss` with the head inside a 1F1B pipeline: the embedding here, then `run_1f1b`, whose head per
        microbatch is the final norm (its compute copy) and the fused head and loss on the stored weight. Its
        gradient is the training objective's: with a mixture of experts, the load-balancing loss (the mean over
        the sparse layers, `_mean_aux`) joins it times `model.moe_aux_loss_weight`, as in the train step."""
        self._check_stages()
        x, ctx, key = self._enter(tokens, rngs, None, None)
        step = lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=i))  # noqa: E731
        norm_graph, norm_state = nnx.split(self.ln_f)
        names = ("vocab", "embed") if tied else ("embed", "vocab")
        rows = tokens.shape[0] // microbatch_count(self.microbatches, self.stages)
        copies = token_axes((rows, *x.shape[1:]))  # a copy of the head per device of a microbatch's tokens

        def head(params, y, t):
            if ctx.zigzag:
                y = constrain(from_zigzag(y, ctx.zigzag), "batch", "seq", "act_embed")
            norm = nnx.merge(norm_graph, params[0])
            y = nnx.remat(lambda ln, y: ln(y), policy=jax.checkpoint_policies.nothing_saveable)(norm, y)
            return self._head_loss(y, params[1], t, tied, token_copies=True)

        stats = self._stats_zeros()
        weights = {"aux_loss": self.aux_loss_weight / (self.n_layers // self.moe_every)} if stats else {}
        loss, stats = run_1f1b(self.blocks, self.n_layers, step, x, head, (norm_state, head_weight), targets,
                               stages=self.stages, microbatches=self.microbatches, dropout_key=key,
                               policy=remat.policy(self.remat, self.remat_offload, block_inputs=True),
                               remat_unit=self._pipeline_remat_unit(), stored=stored_blocks,
                               prepare_head=lambda p: (p[0], copies_over(p[1], names, copies)), stats=stats,
                               stats_weights=weights, repeats=self.repeats)
        return loss, self._mean_aux(stats)

    def _pipeline_remat_unit(self) -> str:
        # Where the policy keeps each layer's input, checkpointing the layers inside the iteration too costs no
        # recomputation, and spares the backward pass the recomputed elementwise work of all K layers at once
        return "layer" if remat.keeps_block_inputs(self.remat, self.remat_offload) else self.pipeline_remat

    def _check_stages(self) -> None:
        stages = active_degree(LAYERS)
        if stages != self.stages:
            raise ShardlmError(f"the model was built for {self.stages} pipeline stage(s) but runs on "
                               f"{stages}: build it for the mesh it runs on")

    def _mean_aux(self, stats: dict) -> dict:
        if "aux_loss" in stats:  # a mean over the sparse layers, so that balanced routing reads 1.0
            stats = {**stats, "aux_loss": stats["aux_loss"] / (self.n_layers // self.moe_every)}
        return stats

    def _token_rows(self, tokens):
        """The token table's rows for `tokens` in the compute dtype, looked up where the table lies
        (`sharding.sharded_lookup`) and cast as they are read: the table's gradient is a scatter-add into its own
        float32 shards."""
        return sharded_lookup(self.wte[...], tokens, tuple(self.wte.get_metadata()["out_sharding"]), self.dtype)

    def _enter(self, tokens, rngs, cache, pos):
        """(the embedding's output in the blocks' layout, the blocks' attention `Context`, the pass's dropout key):
        what every pass does before the blocks."""
        seq_split, length = active_degree("seq"), tokens.shape[1]
        if cache is not None or pos is not None:
            # A prefill writes the cache in the sequence's order, a decode step attends to it: XLA's attention, or
            # cuDNN's where it was asked for (or is auto's) and runs, so that a model trained on GPUs generates
            # anywhere. A decode step attends to the cache by its own einsums whatever this says.
            wants = self.attention in ("cudnn", "auto") and _cudnn_applies(self.dtype, self.head_dim, length)
            impl = "cudnn" if wants and seq_split == 1 else "xla"
        else:
            impl = attention_impl(self.attention, self.dtype, self.head_dim, seq_split, length=length,
                                  block=self.attention_block, context=self.context_attention)
        # One dropout key for the pass: layer i draws from it folded with i, the embedding with n_layers
        # (`stack.layer_rngs`), whichever layout the blocks are in.
        key = rngs.dropout() if rngs is not None else None
        with jax.named_scope("embed"):
            x, rope = self._embed(tokens, layer_rngs(key, self.n_layers), pos)
            x = constrain(x, "batch", "seq", "act_embed")
        mask = causal_mask(length) if pos is None and impl == "xla" else None  # once, for every layer
        positions, zigzag, chunk = None, 0, "flash"
        if impl == "ring":  # the blocks run in the zigzag layout (`shardlm.kernels.ring`), the rest in order
            zigzag = seq_split
            x = constrain(to_zigzag(x, zigzag), "batch", "seq", "act_embed")
            rope = None if rope is None else tuple(to_zigzag(t, zigzag) for t in rope)
            chunk = ring_chunk(self.attention, self.dtype, self.head_dim, length, seq_split)
        elif impl == "flash":
            positions = jnp.arange(length, dtype=jnp.int32)
        return x, Context(impl, mask, rope, pos, positions, self.attention_block, zigzag, chunk), key

    def _run(self, tokens, rngs, cache, pos, at, head, stored_blocks=None):
        x, ctx, key = self._enter(tokens, rngs, cache, pos)
        zigzag = ctx.zigzag
        policy = remat.policy(self.remat, self.remat_offload) if cache is None else None
        step = lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=i))  # noqa: E731
        stages = active_degree(LAYERS)
        if cache is None and stages > 1:
            self._check_stages()
            x, stats = run_pipeline(self.blocks, self.n_layers, step, x, stages=stages,
                                    microbatches=self.microbatches, repeats=self.repeats, dropout_key=key,
                                    policy=remat.policy(self.remat, self.remat_offload, block_inputs=True),
                                    remat_unit=self._pipeline_remat_unit(), stored=stored_blocks,
                                    stats=self._stats_zeros())
        else:
            x, cache, stats = run_blocks(self.blocks, self.n_layers, self.scan_layers, step, x, dropout_key=key,
                                         cache=cache, policy=policy, order=self.layer_order,
                                         stats=self._stats_zeros())
        if zigzag:
            x = constrain(from_zigzag(x, zigzag), "batch", "seq", "act_embed")
        if at is not None:  # one position per row reaches the head
            x = jnp.take_along_axis(x, at[:, None, None], axis=1)
        with jax.named_scope("head"):
            # the final norm's float32 work is recomputed in the backward pass, as the blocks' is
            x = nnx.remat(lambda ln, x: ln(x), policy=jax.checkpoint_policies.nothing_saveable)(self.ln_f, x)
            if not head:
                return x, cache, stats
            if self.lm_head is None:  # tied: contract with the table as stored; a `wte.T` operand made XLA:CPU
                logits = float32_logits("bte,ve->btv", x, use(self.wte, self.dtype))  # copy it every call
            else:
                logits = float32_logits("bte,ev->btv", x, use(self.lm_head, self.dtype))
            logits = constrain(logits, "batch", "seq", "act_vocab")
            if self.padded_vocab != self.vocab_size:  # padded rows never receive probability mass
                logits = jnp.where(jnp.arange(self.padded_vocab) < self.vocab_size, logits, -jnp.inf)
        return logits, cache, stats


def float32_logits(contraction: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The output head: `einsum(contraction, x, w)` accumulated and returned in float32 (the loss never sees
    bfloat16 logits), whose gradient flows back in the compute dtype. Left to autodiff, the float32 cotangent of
    the logits would make both backward matmuls float32 (XLA:GPU compiled them so, at half the tensor cores'
    bfloat16 rate): it is cast to `x`'s dtype first, as the forward matmul's inputs are."""

    @jax.custom_vjp
    def head(x, w):
        return jnp.einsum(contraction, x, w, preferred_element_type=jnp.float32)

    def forward(x, w):
        return head(x, w), (x, w)

    def backward(saved, g):
        x, w = saved
        g = g.astype(x.dtype)
        # Each operand's matmul transposed on its own: `jax.vjp` would also recompute the forward matmul, dead
        # code that XLA drops but that a count of the program's matmuls (`flops.jaxpr_matmul_flops`) would not.
        (dx,) = jax.linear_transpose(lambda a: jnp.einsum(contraction, a, w), x)(g)
        (dw,) = jax.linear_transpose(lambda b: jnp.einsum(contraction, x, b), w)(g)
        return dx, dw

    head.defvjp(forward, backward)
    return head(x, w)
