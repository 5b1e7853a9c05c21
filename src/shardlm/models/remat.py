"""What a block keeps for its backward pass: its named activations, and the policies (`model.remat`,
`model.remat_offload`) that choose among them. Math only.

Design choices:
- Every tensor of a block that its backward pass needs from a matmul (or from an exchange between devices)
  carries a name (`jax.ad_checkpoint.checkpoint_name`): the q, k and v projections, the attention kernel's output
  (and its softmax statistics, named inside the kernel: `shardlm.kernels.attention`), the output projection, the
  MLP's hidden pre-activations, a mixture's routed rows and its experts' outputs. The block's input is named too,
  so that it can be offloaded, and keys and values once gathered over the context devices.
- Every policy is a `jax.checkpoint` policy over those names, and every block runs under one, `none` included:
  `none` saves the named matmul outputs and recomputes the elementwise work from them in the backward pass (the
  norms' float32 upcasts, GELU's and SwiGLU's intermediates, rotary embeddings, dropout masks, the weights' casts
  to the compute dtype). Left to autodiff, a bfloat16 GPT block kept 89 bytes per token x d_model (compiled by
  XLA:GPU for H100s): three float32 tensors per LayerNorm, six [T, 4d] tensors for GELU-tanh, the attention
  output twice and a bfloat16 copy of every weight, each a stacked [layers, ...] output of the scan that XLA can
  neither fuse nor recompute away. Under a sequence split, `none` does not keep keys and values as gathered
  (`kv_gathered`): the backward pass gathers them again, so that a device's memory falls as 1/context.
  Nor does it keep a mixture's rows as its experts received them (`moe_dispatch`): the backward pass exchanges
  them again (one more all-to-all of the first round's buffer per sparse layer), as a dense MLP recomputes its
  input from the residual stream. Compiled for 8 H100s at `benchmarks/moe.py`'s shape, keeping them held 0.25
  GiB more of an expert-parallel step's peak (7.25 against 7.00 GiB, 1.53x against 1.48x the dense step's) to
  save 0.8 ms of its 57 ms.
- `full` saves nothing but the block's input; `save_attention` the attention half's matmul outputs (the MLP is
  recomputed); `save_qkv_proj` the q, k, v projections alone (MaxText's names); `save:NAME,NAME` any subset.
  `dots_saveable` and `dots_with_no_batch_dims_saveable` are JAX's own policies over every dot (under XLA's
  attention that includes the [T, T] scores: a fused kernel's are not dots).
- `model.remat_offload=NAME,...` keeps those names in pinned host memory instead of the device's (JAX's
  `save_and_offload_only_these_names`): saved, whatever `model.remat` says of them, and brought back for the
  backward pass. The compilers place them in host memory space; XLA:CPU runs it.
"""

from __future__ import annotations

import jax
from jax.ad_checkpoint import checkpoint_name

from shardlm.errors import ShardlmError
from shardlm.mesh import unresolved

BLOCK_INPUT = "block_input"  # the residual stream entering a block
QKV_PROJ = "qkv_proj"  # the q, k and v projections (before rotary embeddings)
KV_GATHERED = "kv_gathered"  # k and v as attention reads them: every position, gathered over the context devices
#                              when the sequence is split (the same as k and v otherwise)
ATTENTION = "attention_out"  # the attention kernel's output, the output projection's input (and a fused kernel's
#                              softmax statistics)
OUT_PROJ = "out_proj"  # the attention's output projection: its residual branch
MLP_HIDDEN = "mlp_hidden"  # the MLP's hidden pre-activations (GPT: x W_in + b; SwiGLU: the gate and up projections)
MLP_OUT = "mlp_out"  # the MLP's output: its residual branch
MOE_DISPATCH = "moe_dispatch"  # a mixture's rows as its experts receive them (after any exchange between devices)
MOE_OUT = "moe_out"  # the experts' outputs, back with their tokens' devices (before the weighted sum)
NAMES = (BLOCK_INPUT, QKV_PROJ, KV_GATHERED, ATTENTION, OUT_PROJ, MLP_HIDDEN, MLP_OUT, MOE_DISPATCH, MOE_OUT)

# what each named policy saves on the device
PRESETS = {
    "none": (QKV_PROJ, ATTENTION, OUT_PROJ, MLP_HIDDEN, MOE_OUT),  # every matmul output the backward pass needs
    #                             and a mixture's outputs back home; its rows as received are exchanged again
    "full": (),  # only the block's input
    "save_attention": (QKV_PROJ, ATTENTION, OUT_PROJ),
    "save_qkv_proj": (QKV_PROJ,),
}
JAX_POLICIES = ("dots_saveable", "dots_with_no_batch_dims_saveable")
CUSTOM = "save:"
CHOICES = (*PRESETS, *JAX_POLICIES, f"{CUSTOM}NAME,NAME")


def named(x: jax.Array, name: str) -> jax.Array:
    """`x`, named for the remat policies (the identity outside a `jax.checkpoint`)."""
    return checkpoint_name(x, name)


def _names(text: str, key: str) -> tuple[str, ...]:
    names = tuple(n.strip() for n in text.split(",") if n.strip())
    unknown = [n for n in names if n not in NAMES]
    if unknown:
        raise ShardlmError(f"{key}: unknown activation name {unknown[0]!r}; the named activations are "
                           f"{', '.join(NAMES)}")
    return names


def saved_names(remat: str) -> tuple[str, ...] | None:
    """The names `remat` saves on the device, or None for a JAX policy over dots (which names nothing)."""
    if remat in PRESETS:
        return PRESETS[remat]
    if remat in JAX_POLICIES:
        return None
    if remat == "auto":  # `models.config.AUTO_REMAT` (which imports this module to check policies)
        raise unresolved("model.remat=auto", "model.remat=full")
    if remat.startswith(CUSTOM):
        return _names(remat[len(CUSTOM):], "model.remat")
    raise ShardlmError(f"model.remat={remat!r} is not a remat policy; choose one of {', '.join(CHOICES)} (names: "
                       f"{', '.join(NAMES)}), or auto (the planner's choice)")


def check_policy(remat: str, offload: str) -> None:
    """One-line errors for a policy that does not parse, or an offload a JAX dots policy cannot take."""
    device = saved_names(remat)
    if _names(offload, "model.remat_offload") and device is None:
        raise ShardlmError(f"model.remat_offload names activations, which model.remat={remat} does not (it saves "
                           "dots): use none, full, save_attention, save_qkv_proj or save:NAME,... with it")


def keeps_block_inputs(remat: str, offload: str = "") -> bool:
    """Whether `policy(remat, offload, block_inputs=True)` keeps the blocks' inputs (on the device or the host):
    every policy but `full` without an offloaded block input."""
    return saved_names(remat) != () or BLOCK_INPUT in _names(offload, "model.remat_offload")


def policy(remat: str, offload: str = "", block_inputs: bool = False):
    """The `jax.checkpoint` policy of `model.remat` and `model.remat_offload`. With `block_inputs`, a policy that
    keeps anything of a block on the device (every one but `full`) keeps the blocks' inputs too
    (`keeps_block_inputs`): a pipeline checkpoints a stage's layers together, and without them its backward pass
    would recompute the chain of layers from the stage's input, matmuls the policy did not name included (the
    MLP's down projection, every layer). A scan over the layers keeps them anyway, as
    the inputs of its iterations."""
    check_policy(remat, offload)
    device = saved_names(remat)
    if device is None:
        dots = getattr(jax.checkpoint_policies, remat)
        return jax.checkpoint_policies.save_from_both_policies(
            dots, jax.checkpoint_policies.save_only_these_names(BLOCK_INPUT)) if block_inputs else dots
    host = _names(offload, "model.remat_offload")
    if block_inputs and device and BLOCK_INPUT not in host:
        device = (*device, BLOCK_INPUT)
    if not host:
        return jax.checkpoint_policies.save_only_these_names(*device)
    return jax.checkpoint_policies.save_and_offload_only_these_names(
        names_which_can_be_saved=[n for n in device if n not in host], names_which_can_be_offloaded=list(host),
        offload_src="device", offload_dst="pinned_host")
