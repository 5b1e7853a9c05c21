"""The attention kernels by name: one record each (`AttentionKernel`), and the choice among them for a pass.

Design choices:
- A kernel is registered once, with everything the rest of shardlm asks of it: when it can run on the target being
  compiled for (`refusal`, a one-line error's text) and when `model.attention=auto` should pick it (`fits`); its
  call on the whole batch (`attend`) and where that call runs (`placement`); its use as the ring's per-chunk
  kernel under context parallelism (`chunk`); the line `explain` and `plan` print for it; and the names by which
  the FLOP counter (`shardlm.flops`) and the HLO cost model (`shardlm.perf.kernels`) recognise its calls. The model
  (`shardlm.models.attention`), the config check, the FLOP counter and the cost model read this table; adding a
  kernel is one `register_attention(...)` (tests/test_kernel_registry.py adds one from a test file alone).
- `auto` takes the first registered kernel that fits, in order: cuDNN's fused kernel (NVIDIA GPUs), splash
  (TPUs), the blockwise kernel for sequences longer than a block, XLA's. A ring's chunks take the first
  chunk kernel that fits, the blockwise kernel being the one that always does. The accelerator is the one being
  compiled for (`shardlm.accelerator.current`), so a compile for an H100 from a CPU host picks what a run on the
  H100 would.
- Like the kernels themselves, this knows nothing of meshes or configs: it is handed dtypes, sizes and names.
"""

from __future__ import annotations

import dataclasses
from functools import partial
from typing import Callable, Mapping

import jax.numpy as jnp

from shardlm.accelerator import current
from shardlm.errors import ShardlmError
from shardlm.kernels.attention import (cudnn_attention, cudnn_available, cudnn_chunk_backward, cudnn_chunk_forward,
                                       xla_attention)
from shardlm.kernels.flash import blockwise_attention, chunk_backward, chunk_forward
from shardlm.kernels.ring import ChunkKernel
from shardlm.kernels.splash import (splash_attention, splash_block, splash_chunk_available, splash_chunk_backward,
                                    splash_chunk_forward)

AUTO = "auto"
RING = "ring"  # not a kernel: the context split's ring, each chunk run by a kernel that can be a chunk kernel


def _always(*_args) -> bool:
    return True


def _no_refusal(*_args) -> str:
    return ""


@dataclasses.dataclass(frozen=True)
class AttentionKernel:
    name: str  # `model.attention`'s value
    description: str  # "cuDNN's fused kernel", as reports name it
    # attend(q, k, v, *, mask, positions, block, interpret, residual_name, segments) -> out: causal attention of q
    # [batch, T, heads, head_dim] over k and v [batch, T, kv_heads, head_dim], what the backward pass keeps named
    # `residual_name`; `mask` is the causal mask ([1, 1, T, T], or [batch, 1, T, T] within documents: for
    # `needs="mask"`), `positions` each row's place in the sequence (`needs="positions"`), `segments` the rows'
    # documents' ids [batch, T] or None
    attend: Callable
    # Where `attend` runs: "gathered" (on the whole arrays, keys and values first constrained to every position and
    # named for the remat policies), "global" (on the whole arrays as they are), "per_device" (on each device's rows
    # and heads inside the model's `shard_map`: a Pallas kernel is not partitioned by XLA)
    placement: str
    # (dtype, head_dim, length, block) -> whether `auto` may pick it on the target being compiled for
    fits: Callable[..., bool]
    # (dtype, head_dim, length, block) -> why it cannot run as asked for by name ("" = it can), a one-line error
    refusal: Callable[..., str] = _no_refusal
    needs: str = ""  # what `attend` reads beyond q, k and v, computed once per pass: "mask", "positions" or ""
    # Whether `attend` takes documents' ids (`segments` [batch, T]: attention within each document packed in a
    # row), and whether its chunk kernel does; a kernel that does not is not picked for a pass with them
    # The ring's per-chunk kernel: (block, interpret) -> ChunkKernel; None: it cannot be one
    chunk: Callable[..., ChunkKernel] | None = None
    documents: bool = True
    chunk_documents: bool = True
    chunk_available: Callable[[], bool] = _always  # whether this JAX has the internals the chunk kernel calls
    # (dtype, head_dim, chunk, length, seq_split) -> why it cannot run a ring's chunks as asked for by name
    chunk_refusal: Callable[..., str] = _no_refusal
    # (requested, length, block) -> why it was picked, the end of `explain`'s and `plan`'s line about attention
    summary: Callable[..., str] = lambda requested, length, block: ""
    # How the FLOP counter and the cost model recognise its calls: JAX primitives with the passes of attention's
    # matmuls each runs (cuDNN's forward 1, backward 2), names of its Pallas calls in a jaxpr, custom-call targets
    # and kernel names in the optimised HLO.
    primitives: Mapping[str, int] = dataclasses.field(default_factory=dict)
    pallas_names: tuple[str, ...] = ()
    hlo_targets: tuple[str, ...] = ()
    hlo_names: tuple[str, ...] = ()


ATTENTION_KERNELS: dict[str, AttentionKernel] = {}


def register_attention(kernel: AttentionKernel) -> AttentionKernel:
    """Add `kernel` to the table, last in `auto`'s order (again under its name: replaced where it stood)."""
    ATTENTION_KERNELS[kernel.name] = kernel
    return kernel


def attention_choices() -> tuple[str, ...]:
    """`model.attention`'s values."""
    return (AUTO, *ATTENTION_KERNELS)


def kernel_named(name: str) -> AttentionKernel:
    return ATTENTION_KERNELS[name]


# --- the choice for a pass ---------------------------------------------------------------------------------------

def uses_ring(requested: str, context: str) -> bool:
    """Whether a sequence split over devices runs ring attention (else XLA's over all-gathered keys and values)."""
    chunked = requested == AUTO or ATTENTION_KERNELS[requested].chunk is not None
    return context == "ring" and chunked


def check_attention(requested: str, seq_split: int, context: str = "ring") -> None:
    """cuDNN's fused kernel refuses a sequence split over devices unless the ring hands it one chunk at a time:
    said when the mesh is known (before compiling) and again when the model is traced under the rules."""
    if requested == "cudnn" and seq_split > 1 and context != "ring":
        raise ShardlmError(f"model.attention=cudnn cannot take a sequence split {seq_split} ways over mesh.context "
                           "with model.context_attention=all_gather (cuDNN's fused kernel refuses sequence "
                           "sharding); use model.context_attention=ring, or model.attention=auto or xla")


def attention_impl(requested: str, dtype, head_dim: int, seq_split: int = 1, *, length: int = 0,
                   block: int = 512, context: str = "ring", documents: bool = False) -> str:
    """The kernel for a training or evaluation pass over `length` positions: with the sequence split over devices,
    the ring (`context="ring"`, for a kernel that can run its chunks) or XLA's attention over all-gathered keys
    and values; else the kernel asked for, after its `refusal`, or `auto`'s (the first registered that fits).
    `documents`: the pass attends within documents (every kernel registered here takes their ids)."""
    check_attention(requested, seq_split, context)
    if seq_split > 1:
        return RING if uses_ring(requested, context) else "xla"
    if requested != AUTO:
        refusal = ATTENTION_KERNELS[requested].refusal(dtype, head_dim, length, block)
        if refusal:
            raise ShardlmError(refusal)
        if documents and not ATTENTION_KERNELS[requested].documents:
            raise ShardlmError(f"model.attention={requested} cannot attend within documents; use "
                               "model.attention=auto, or data.document_mask=false")
        return requested
    return next(k.name for k in ATTENTION_KERNELS.values()
                if k.fits(dtype, head_dim, length, block) and (k.documents or not documents))


def prefill_kernel(requested: str, dtype, head_dim: int, length: int) -> str:
    """The kernel a prefill of `length` positions runs: the one asked for (auto: the first) among the kernels that
    run on whole arrays with every key gathered, where it fits; else XLA's, which runs anywhere."""
    asked = ATTENTION_KERNELS.values() if requested == AUTO else [ATTENTION_KERNELS[requested]]
    return next((k.name for k in asked if k.placement == "gathered" and k.fits(dtype, head_dim, length, 0)), "xla")


def ring_chunk(requested: str, dtype, head_dim: int, length: int, seq_split: int, documents: bool = False) -> str:
    """The ring's per-chunk kernel for a sequence of `length` split `seq_split` ways: each chunk is length /
    (2 seq_split) positions. "auto": the first registered chunk kernel that fits a chunk (and, with `documents`,
    takes their ids); one asked for by name is that one, after its refusals."""
    chunk = length // (2 * seq_split)
    if requested != AUTO:
        kernel = ATTENTION_KERNELS[requested]
        refusal = kernel.chunk_refusal(dtype, head_dim, chunk, length, seq_split)
        if refusal:
            raise ShardlmError(refusal)
        if documents and not kernel.chunk_documents:
            raise ShardlmError(f"model.attention={requested} cannot run the ring's chunks within documents (its "
                               "kernel takes no documents' ids there); use model.attention=auto, or "
                               "data.document_mask=false")
        if not kernel.chunk_available():
            raise ShardlmError(f"model.attention={requested} in the ring needs JAX internals this JAX does not have "
                               f"({kernel.description}'s rules under their 0.10 names); use "
                               "model.attention=auto or flash")
        return requested
    # block 0: a chunk is never too short for a kernel that blocks it (the blockwise kernel always fits)
    return next(k.name for k in ATTENTION_KERNELS.values()
                if k.chunk is not None and k.fits(dtype, head_dim, chunk, 0) and k.chunk_available()
                and (k.chunk_documents or not documents))


def chunk_kernel(name: str, *, block: int = 512, interpret: bool = False) -> ChunkKernel:
    """The ring's per-chunk kernel called `name`; where this JAX lacks what it calls, the blockwise kernel stands
    in."""
    kernel = ATTENTION_KERNELS[name]
    if not kernel.chunk_available():
        kernel = ATTENTION_KERNELS["flash"]
    return kernel.chunk(block, interpret)


def attention_summary(requested: str, dtype, head_dim: int, length: int, block: int, seq_split: int,
                      context: str, documents: bool = False) -> str:
    """Which kernel a training step compiles with, for the target being compiled for, and why (a report's line)."""
    impl = attention_impl(requested, dtype, head_dim, seq_split, length=length, block=block, context=context,
                          documents=documents)
    if impl == RING:
        chunk = ring_chunk(requested, dtype, head_dim, length, seq_split, documents)
        return (f"ring over context={seq_split} (zigzag layout), {ATTENTION_KERNELS[chunk].description} on each "
                "chunk of keys: never [T, T]")
    if seq_split > 1:
        return (f"XLA's, over keys and values all-gathered over context={seq_split}: [T/{seq_split}, T] scores per "
                "head (" + ("model.context_attention=all_gather)" if context != "ring" else
                            f"model.attention={requested})"))
    return ATTENTION_KERNELS[impl].summary(requested, length, block)


# --- the built-in kernels ------------------------------------------------------------------------------------------

def _cudnn_refusal(dtype, head_dim: int = 0, length: int = 0, _block: int = 0) -> str:
    """Why cuDNN's fused kernel cannot run on the accelerator being compiled for (a CPU host compiling for H100s
    passes) with `dtype` inputs, heads of `head_dim` and `length` positions (0: not known here), as a one-line
    error's text, or "". It takes what JAX's cuDNN attention takes: an NVIDIA GPU of compute capability 8.0 or
    newer, 16-bit inputs, head sizes that are multiples of 8 up to 128 (256 from Hopper on), and, training, an even
    length (JAX passes the kernel an empty bias, and refuses odd lengths with a bias). Unchecked, a CPU host was
    cuDNN's own traceback ("cuDNN is not detected"), float32 a KeyError from inside JAX, and an odd length JAX's
    NotImplementedError."""
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


def _cudnn_fits(dtype, head_dim: int, length: int = 0, _block: int = 0) -> bool:
    """cuDNN's fused kernel takes it, on a GPU whose compute capability is known."""
    return not _cudnn_refusal(dtype, head_dim, length) and current().compute_capability is not None


def _splash_fits(_dtype, head_dim: int, length: int, _block: int = 0) -> bool:
    """A TPU, a length splash can block (a multiple of 128, its lane width: `splash_block`), head_dim 64 or 128."""
    return current().platform == "tpu" and splash_block(length) > 0 and head_dim in (64, 128)


def _splash_refusal(_dtype, _head_dim: int, length: int, block: int) -> str:
    if splash_block(length, block):
        return ""
    return (f"model.attention=splash needs a sequence that is a multiple of 128 positions (the TPU kernel's lane "
            f"width), got {length}; use model.attention=auto or a multiple of 128")


def _splash_chunk_refusal(_dtype, _head_dim: int, chunk: int, length: int, seq_split: int) -> str:
    if splash_block(chunk):
        return ""
    return (f"model.attention=splash in the ring needs chunks of a multiple of 128 positions, got {length} / (2 x "
            f"context {seq_split}) = {chunk}; use model.attention=auto, or a seq_len that is a multiple of "
            f"{256 * seq_split}")


def _flash_summary(requested: str, length: int, block: int) -> str:
    why = "model.attention=flash" if requested == "flash" else (
        f"{length} positions, more than model.attention_block={block}")
    return f"the blockwise kernel, never [T, T] ({why})"


def _xla_summary(requested: str, length: int, block: int) -> str:
    why = f"model.attention={requested}" if requested != AUTO else (
        f"{length} positions, at most model.attention_block={block}")
    return f"XLA's, [T, T] scores per head ({why})"


register_attention(AttentionKernel(
    name="cudnn", description="cuDNN's fused kernel", placement="gathered", fits=_cudnn_fits, refusal=_cudnn_refusal,
    attend=lambda q, k, v, *, residual_name, **_: cudnn_attention(q, k, v, residual_name=residual_name),
    chunk=lambda block, interpret: ChunkKernel(cudnn_chunk_forward, cudnn_chunk_backward),
    chunk_available=cudnn_available, documents=False, chunk_documents=False,  # (`kernels.attention`: why)
    chunk_refusal=lambda dtype, head_dim, chunk, length, seq_split: _cudnn_refusal(dtype, head_dim, chunk),
    summary=lambda requested, length, block: "cuDNN's fused kernel (an NVIDIA GPU, 16-bit inputs)",
    primitives={"dot_product_attention_fwd_wrapper": 1, "dot_product_attention_fwd": 1,
                "dot_product_attention_bwd_wrapper": 2, "dot_product_attention_bwd": 2},
    hlo_targets=("__cudnn$fmha",)))
register_attention(AttentionKernel(
    name="splash", description="Pallas splash attention", placement="per_device", fits=_splash_fits,
    refusal=_splash_refusal,
    attend=lambda q, k, v, *, block, interpret, residual_name, segments=None, **_: splash_attention(
        q, k, v, block=block, interpret=interpret, residual_name=residual_name, segments=segments),
    chunk=lambda block, interpret: ChunkKernel(partial(splash_chunk_forward, block=block, interpret=interpret),
                                               partial(splash_chunk_backward, block=block, interpret=interpret)),
    chunk_available=splash_chunk_available, chunk_refusal=_splash_chunk_refusal,
    summary=lambda requested, length, block: "Pallas splash attention (a TPU" + (
        ")" if requested == AUTO else "; model.attention=splash)"),
    pallas_names=("splash",), hlo_names=("splash",)))
register_attention(AttentionKernel(
    name="flash", description="the blockwise kernel", placement="global", needs="positions",
    fits=lambda dtype, head_dim, length, block: length > block,
    attend=lambda q, k, v, *, positions, block, residual_name, segments=None, **_: blockwise_attention(
        q, k, v, positions, positions, block_q=block, block_k=block, residual_name=residual_name, q_seg=segments,
        kv_seg=segments),
    chunk=lambda block, interpret: ChunkKernel(partial(chunk_forward, block=block),
                                               partial(chunk_backward, block=block)),
    summary=_flash_summary, hlo_names=("flash",)))
register_attention(AttentionKernel(
    name="xla", description="XLA's attention", placement="gathered", needs="mask", fits=_always,
    attend=lambda q, k, v, *, mask, residual_name, **_: xla_attention(q, k, v, mask, residual_name=residual_name),
    summary=_xla_summary))
