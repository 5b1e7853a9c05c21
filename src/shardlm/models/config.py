"""A model's architecture and numerics (`ModelConfig`), and the checks a model config must pass on its own.

Design choices:
- One dataclass for every family: the fields a family does not use keep their defaults (GPT ignores
  `n_kv_heads` and `rope_theta`), and `check_model` refuses the combinations a family cannot compute.
- Mesh-dependent checks (does the tensor degree divide the heads?) are not here: they need the mesh, and live
  with the training state (`shardlm.train.state.check_shardable`).
- Importing this module does not import JAX (the CLI reads configs before JAX starts); the dtype, remat and
  attention names are checked against the model code's own tables only when a config is checked.
"""

import dataclasses

from shardlm.errors import ShardlmError, check_in_range, check_one_of, check_positive


@dataclasses.dataclass
class ModelConfig:
    preset: str = "tiny"
    family: str = "gpt"  # "gpt" (GPT-2: LayerNorm, learned positions, GELU) or "llama" (RMSNorm, RoPE, SwiGLU, GQA)
    n_layers: int = 4
    n_heads: int = 4
    # Key/value heads (grouped-query attention; 1 = multi-query). 0 = n_heads. Llama family only.
    n_kv_heads: int = 0
    d_model: int = 128
    d_mlp: int = 512
    seq_len: int = 128
    # 0 = take the tokenizer's vocabulary size. Either way it is padded up (see `padded_vocab_size`).
    vocab_size: int = 0
    dropout: float = 0.0
    tie_embeddings: bool = True
    use_bias: bool = True
    layer_norm_eps: float = 1e-5  # the epsilon of LayerNorm (gpt) or RMSNorm (llama)
    rope_theta: float = 10000.0  # rotary embedding base (llama)
    # Compute dtype of matmuls and activations; norms, softmax and the loss stay float32 whatever it is. auto:
    # bfloat16 on GPUs and TPUs, float32 on a CPU (resolved when the config is loaded: `shardlm.accelerator`).
    dtype: str = "auto"
    param_dtype: str = "float32"  # the master weights (and so the gradients and AdamW moments)
    # Rematerialise each block in the backward pass: none | full | dots_saveable | dots_with_no_batch_dims_saveable
    remat: str = "none"
    # jax.nn.dot_product_attention implementation: auto (cuDNN on NVIDIA GPUs for 16-bit dtypes, else XLA) | xla
    # | cudnn
    attention: str = "auto"
    # A model from a Python file (`model=py:FILE:FUNCTION`) only: how to run it when it is not model(tokens) ->
    # logits, a function NAME in the same file (or py:FILE:NAME) called as call(model, tokens[, train]).
    call: str = ""


FAMILY_NAMES = ("gpt", "llama")


def check_model(m: ModelConfig) -> None:
    """Sizes, family, head layout, dtypes and the remat/attention choices of `m`, each a one-line error."""
    for key in ("n_layers", "n_heads", "d_model", "d_mlp", "seq_len"):
        check_positive(f"model.{key}", getattr(m, key))
    if m.vocab_size < 0:
        raise ShardlmError(f"model.vocab_size must be >= 0 (0 = the tokenizer's), got {m.vocab_size}")
    if m.d_model % m.n_heads:
        raise ShardlmError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; pick a head count dividing it"
        )
    _check_kinds(m)
    check_in_range("model.dropout", m.dropout, 0.0, 1.0)
    check_positive("model.layer_norm_eps", m.layer_norm_eps)


def _check_kinds(m: ModelConfig) -> None:
    """Family, head layout, dtypes and the remat/attention choices."""
    from shardlm.models.layers import ATTENTION_IMPLS, COMPUTE_DTYPES, DTYPES, REMAT_POLICIES

    check_one_of("model.family", m.family, FAMILY_NAMES)
    check_one_of("model.dtype", m.dtype, COMPUTE_DTYPES, " (float16 would need loss scaling: use bfloat16)")
    check_one_of("model.param_dtype", m.param_dtype, DTYPES)
    check_one_of("model.remat", m.remat, REMAT_POLICIES)
    check_one_of("model.attention", m.attention, ATTENTION_IMPLS)
    check_positive("model.rope_theta", m.rope_theta)
    kv = m.n_kv_heads or m.n_heads
    if m.n_kv_heads < 0 or m.n_heads % kv:
        raise ShardlmError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (each kv head "
                           "serves a group of query heads; 1 = multi-query, 0 = one per query head)")
    if m.family == "gpt" and kv != m.n_heads:
        raise ShardlmError("model.n_kv_heads applies to the llama family; GPT has one kv head per query head: "
                           "drop it, or use model=llama-tiny (or another llama preset)")
    if m.family == "llama":
        if m.use_bias:
            raise ShardlmError("the llama family has no biases: set model.use_bias=false (llama presets do)")
        if (m.d_model // m.n_heads) % 2:
            raise ShardlmError(f"rotary embeddings need an even head size, not d_model / n_heads = "
                               f"{m.d_model // m.n_heads}; change model.d_model or model.n_heads")
