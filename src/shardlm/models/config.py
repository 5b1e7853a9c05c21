"""A model's architecture and numerics (`ModelConfig`), and the checks every model config must pass on its own.

Design choices:
- One dataclass for every family: the fields a family does not use keep their defaults (GPT ignores
  `n_kv_heads` and `rope_theta`). `check_model` holds the checks every family shares; what a family cannot
  compute is its own check, in its record (`shardlm.families`), which runs after these.
- Mesh-dependent checks (does the tensor degree divide the heads?) are not here: they need the mesh, and live
  with the training state (`shardlm.train.state.check_shardable`).
- The names a check reads (dtypes, attention kernels, grouped-matmul kernels, exchanges, remat policies) live
  below the models (`shardlm.accelerator`, `shardlm.kernels`, `shardlm.models.remat`), so this module imports
  no model code and no model code is imported to check a config.
"""

import dataclasses

from shardlm.accelerator import COMPUTE_DTYPES, DTYPE_NAMES
from shardlm.errors import ShardlmError, check_in_range, check_one_of, check_positive
from shardlm.kernels.exchange import EXCHANGES
from shardlm.kernels.grouped import KERNELS as GROUPED_KERNELS
from shardlm.kernels.registry import attention_choices
from shardlm.models.remat import check_policy
from shardlm.models.rope import SCALINGS as ROPE_SCALINGS
from shardlm.models.routing import ROUTER_SCORES


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
    # Rotary scaling for long contexts (`shardlm.models.rope`): none | llama3 (Llama 3.1-3.3's: low frequencies
    # divided by rope_factor, high ones kept, the band between low_freq_factor and high_freq_factor smoothed) |
    # yarn (Qwen's and DeepSeek's: beta_fast / beta_slow bound the ramp; the tables scaled by YaRN's attention
    # factor, or by mscale / mscale_all_dim's ratio where both are set). rope_original_context: the context the
    # model was pretrained at (original_max_position_embeddings).
    rope_scaling: str = "none"
    rope_factor: float = 1.0
    rope_original_context: int = 0
    rope_low_freq_factor: float = 1.0
    rope_high_freq_factor: float = 4.0
    rope_beta_fast: float = 32.0
    rope_beta_slow: float = 1.0
    rope_mscale: float = 0.0
    rope_mscale_all_dim: float = 0.0
    # The attention heads' size (0 = d_model / n_heads; Qwen3's is 128 whatever its width), biases on q, k and v
    # only (Qwen2's; model.use_bias is GPT's, on every projection and norm), and a per-head RMSNorm on q and k
    # before the rotation (QK-norm: Qwen3's, OLMo 2's; qk_norm in the GPT family too, after its projections).
    head_dim: int = 0
    qkv_bias: bool = False
    qk_norm: bool = False
    # Compute dtype of matmuls and activations; norms, softmax and the loss stay float32 whatever it is. auto:
    # bfloat16 on GPUs and TPUs, float32 on a CPU (resolved when the config is loaded: `shardlm.accelerator`).
    dtype: str = "auto"
    param_dtype: str = "float32"  # the master weights (and so the gradients and AdamW moments)
    # The dtype the weights' gradients are produced in, and so summed across the devices that split the tokens
    # (data-parallel replicas, FSDP): auto (the compute dtype: bfloat16 on GPUs and TPUs) or float32 (twice the
    # bytes; Megatron's and torchtitan's choice). (`models.precision`)
    grad_reduce_dtype: str = "auto"
    # The blocks' projection and MLP matmuls: auto (in the compute dtype) or fp8 (e4m3 operands, e5m2 gradients,
    # per-tensor current scaling, float32 accumulation: `shardlm.kernels.fp8`; H100-class GPUs, emulated on a CPU).
    # The embedding, the output head, attention, norms and the loss stay in the compute dtype or float32.
    matmul_dtype: str = "auto"
    # What each block keeps for the backward pass (`shardlm.models.remat`): none (every matmul output it needs,
    # elementwise work recomputed) | full (the block's input) | save_attention | save_qkv_proj | save:NAME,NAME |
    # dots_saveable | dots_with_no_batch_dims_saveable | auto (the cheapest that fits, chosen by the planner when
    # a run starts and recorded in its config.yaml: `shardlm.perf.auto`)
    remat: str = "none"
    # Named activations kept in pinned host memory instead of on the device (comma-separated: block_input,
    # qkv_proj, attention_out, out_proj, mlp_hidden, mlp_out)
    remat_offload: str = ""
    # The blocks' parameters stacked on a leading `layers` axis and run with a scan (one block compiled, whatever
    # the depth), or one module per layer. Checkpoints are the same either way.
    scan_layers: bool = True
    # Pipeline stages (mesh.stage > 1) only: microbatches per step (per gradient-accumulation step), a multiple of
    # the stages (0 = one per stage), and circular repeats: each stage holds n_layers / (stages x repeats) layers
    # per repeat, and a microbatch passes every stage `repeats` times (the bubble shrinks by as much).
    pipeline_microbatches: int = 0
    pipeline_repeats: int = 1
    # What `remat` rematerialises in a pipeline: each iteration's stage compute as a whole (iteration), or that and
    # each layer inside it as well (layer: one more forward pass recomputed, one layer's activations alive at a
    # time instead of a stage's).
    pipeline_remat: str = "iteration"
    # The order of a pipeline's forward and backward passes: gpipe (every microbatch's forward pass, then every
    # backward pass: the saved activations of all of them at once) or 1f1b (each microbatch's backward pass as
    # soon as it has its loss: about 2 x stages microbatches' activations; interleaved under circular repeats)
    pipeline_schedule: str = "gpipe"
    # A mixture of experts (llama family): the MLP of every `moe_every`-th layer (layers moe_every - 1,
    # 2 moe_every - 1, ...) is `moe_experts` SwiGLU experts of hidden size `moe_d_ff` (0 = d_mlp), each token routed
    # to `moe_top_k` of them (dropless), plus a dense shared expert with `moe_shared_expert`. 0 experts = dense.
    moe_experts: int = 0
    moe_top_k: int = 2
    moe_every: int = 1
    moe_d_ff: int = 0
    moe_shared_expert: bool = False
    # With top_k > 1: the k routing weights renormalised to sum to one (Mixtral's; Qwen3-MoE's norm_topk_prob), or
    # the raw softmax probabilities (false)
    moe_norm_topk: bool = True
    # The router (`shardlm.models.moe.Routing`): softmax, or sigmoid (DeepSeek-V3's: each expert scored on its own,
    # with a per-expert bias that moves the choice toward balance, by moe_bias_rate per step, without an
    # auxiliary loss); node-limited routing over moe_groups groups of experts, each token choosing among its
    # moe_group_top_k best; the chosen weights times moe_routed_scale. The first moe_first_dense layers are dense.
    moe_router: str = "softmax"
    moe_groups: int = 1
    moe_group_top_k: int = 1
    moe_routed_scale: float = 1.0
    moe_bias_rate: float = 0.0
    moe_first_dense: int = 0
    # Multi-head latent attention (DeepSeek-V2/V3; mla_kv_rank > 0): keys and values from a latent of mla_kv_rank
    # per token (what generation caches, with the mla_rope_dim rotary key shared by the heads), queries through a
    # latent of mla_q_rank (0: a plain projection); each head's query and key are mla_nope_dim plain features and
    # mla_rope_dim rotated ones, its value mla_v_dim. DeepSeek family.
    mla_kv_rank: int = 0
    mla_q_rank: int = 0
    mla_rope_dim: int = 64
    mla_nope_dim: int = 128
    mla_v_dim: int = 128
    # Multi-token prediction (DeepSeek-V3): mtp_depth extra modules, module k predicting the token k + 1 ahead of
    # the next from the previous module's hidden state and that token's embedding; their mean loss joins the
    # objective times mtp_loss_weight. Training only: generation runs the main model. DeepSeek family.
    mtp_depth: int = 0
    mtp_loss_weight: float = 0.3
    # 0 = dropless. > 0: under expert parallelism each device sends each expert device at most
    # ceil(moe_capacity_factor x T x k / mesh.expert) of its T tokens' k assignments (its balanced share, times
    # the factor), which bounds the exchange buffer (dropless: T x min(k, experts per device) rows per pair);
    # assignments past it are dropped (the token keeps its residual and its other experts), counted and logged.
    # Without an expert split there is no exchange and nothing is dropped.
    moe_capacity_factor: float = 0.0
    # How a dropless exchange between expert devices is sized: rounds (a first round of the balanced share, then
    # as many rounds of an eighth of it as the busiest pair of devices needs; the activations of the balanced
    # share) | buffer (one exchange of the worst case, T x min(k, experts per device) rows per pair).
    moe_dropless: str = "rounds"
    # The experts' grouped matmuls (`shardlm.kernels.grouped`): auto (a Pallas Triton kernel on NVIDIA GPUs,
    # Megablox on TPUs, XLA's ragged_dot elsewhere) | xla | triton | megablox. XLA's ragged_dot multiplies every row
    # by every expert off TPUs; the kernels only by its own.
    moe_kernel: str = "auto"
    # How the routed rows travel between expert devices (`shardlm.kernels.exchange`): auto (= all_to_all, which
    # the compilers' schedules overlap better) | all_to_all (a fixed buffer, padding included) | ragged (only the
    # rows in use, `ragged_all_to_all`; XLA:CPU lacks the collective, so on the CPU an emulation of it runs).
    moe_exchange: str = "auto"
    # The load-balancing loss's weight in the training loss (Switch Transformer's; 1.0 when perfectly balanced).
    moe_aux_loss_weight: float = 0.01
    # The training loss's head runs over the vocabulary in this many chunks per device, its logits recomputed in
    # the backward pass (1: one tile, its gradients taken in the forward pass; 0 = automatic: in the forward pass
    # where the head fits a GiB per device, else recomputed in tiles under 128 MiB; `shardlm.models.head`)
    loss_chunks: int = 0
    # Attention's kernel: auto (cuDNN on NVIDIA GPUs for 16-bit dtypes, Pallas splash on TPUs; elsewhere XLA's for
    # sequences up to attention_block, the blockwise kernel beyond) | xla | cudnn | flash (`shardlm.kernels.flash`,
    # never [T, T]) | splash (`shardlm.kernels.splash`)
    attention: str = "auto"
    # With the sequence split over mesh.context: ring (keys and values travel the ring, zigzag layout,
    # `shardlm.kernels.ring`) | all_gather (every device gathers every key and value; XLA's attention)
    context_attention: str = "ring"
    # Queries and keys per block of the blockwise kernel (flash and the ring's), at most
    attention_block: int = 512
    # A model from a Python file (`model=py:FILE:FUNCTION`) only: how to run it when it is not model(tokens) ->
    # logits, a function NAME in the same file (or py:FILE:NAME) called as call(model, tokens[, train]).
    call: str = ""


def is_sparse_layer(m: ModelConfig, layer: int) -> bool:
    """Whether `layer`'s MLP is a mixture of experts: past the first `moe_first_dense`, every `moe_every`-th."""
    return m.moe_experts > 0 and layer >= m.moe_first_dense and (layer + 1) % m.moe_every == 0


def stack_layer_count(m: ModelConfig) -> int:
    """The layers of the model's stack (what scans and splits over pipeline stages): all but the dense first
    `moe_first_dense` of a mixture, which are held before it (`CausalLM.prefix`)."""
    return m.n_layers - (m.moe_first_dense if m.moe_experts else 0)


def sparse_layer_count(m: ModelConfig) -> int:
    return sum(is_sparse_layer(m, i) for i in range(m.n_layers))


def head_size(m: ModelConfig) -> int:
    """The attention heads' size as the kernels see it: model.head_dim, or d_model / n_heads; latent attention's
    queries and keys, its plain and rotary parts (values are narrower and padded to it: `shardlm.models.mla`)."""
    if m.mla_kv_rank:
        return m.mla_nope_dim + m.mla_rope_dim
    return m.head_dim or m.d_model // m.n_heads


def value_size(m: ModelConfig) -> int:
    """The values' head size: latent attention's `mla_v_dim`, else the heads' size."""
    return m.mla_v_dim if m.mla_kv_rank else head_size(m)


AUTO_REMAT = "auto"  # model.remat=auto: the planner's choice
FP8 = "fp8"  # model.matmul_dtype's float8 mode (`shardlm.models.precision.Precision`)
MATMUL_DTYPES = ("auto", FP8)  # model.matmul_dtype


def check_model(m: ModelConfig) -> None:
    """Sizes, family, head layout, dtypes and the remat/attention choices of `m`, each a one-line error."""
    for key in ("n_layers", "n_heads", "d_model", "d_mlp", "seq_len"):
        check_positive(f"model.{key}", getattr(m, key))
    if m.seq_len < 2:  # one token attends to nothing, and leaves no room for a prompt and a generated token
        raise ShardlmError(f"model.seq_len={m.seq_len} leaves no context to attend over and no room to generate; "
                           "use model.seq_len >= 2")
    if m.vocab_size < 0:
        raise ShardlmError(f"model.vocab_size must be >= 0 (0 = the tokenizer's), got {m.vocab_size}")
    if m.head_dim < 0:
        raise ShardlmError(f"model.head_dim must be >= 0 (0 = d_model / n_heads), got {m.head_dim}")
    if m.d_model % m.n_heads and not m.head_dim:
        raise ShardlmError(
            f"model.d_model={m.d_model} is not divisible by model.n_heads={m.n_heads}; pick a head count dividing it"
        )
    _check_kinds(m)
    check_in_range("model.dropout", m.dropout, 0.0, 1.0)
    check_in_range("model.moe_capacity_factor", m.moe_capacity_factor, 0.0, float("inf"))
    check_positive("model.layer_norm_eps", m.layer_norm_eps)
    check_positive("model.pipeline_repeats", m.pipeline_repeats)
    check_one_of("model.pipeline_remat", m.pipeline_remat, ("iteration", "layer"))
    if m.pipeline_remat == "layer" and m.remat == "none":
        raise ShardlmError("model.pipeline_remat=layer rematerialises each layer inside the rematerialised pipeline "
                           "iteration, and model.remat=none keeps every matmul output, so there is nothing to "
                           "rematerialise: set model.remat (full, or "
                           "another policy) too")
    _check_moe(m)
    if m.pipeline_microbatches < 0:
        raise ShardlmError(f"model.pipeline_microbatches must be >= 0 (0 = one per stage), got "
                           f"{m.pipeline_microbatches}")


def _check_moe(m: ModelConfig) -> None:
    """The mixture of experts' fields, each a one-line error."""
    if m.moe_experts == 0:
        return
    if m.moe_experts < 2 or not 1 <= m.moe_top_k <= m.moe_experts:
        raise ShardlmError(f"model.moe_experts={m.moe_experts} and model.moe_top_k={m.moe_top_k}: a mixture needs at "
                           "least 2 experts and 1 <= top_k <= experts")
    check_positive("model.moe_every", m.moe_every)
    if m.n_layers % m.moe_every:
        raise ShardlmError(f"model.moe_every={m.moe_every} does not divide model.n_layers={m.n_layers}: every "
                           f"{m.moe_every}-th layer is sparse; choose a divisor of {m.n_layers}")
    if m.moe_every > 1 and m.scan_layers:
        raise ShardlmError(f"model.moe_every={m.moe_every} mixes dense and sparse layers, which a scan over one "
                           "stacked block cannot run: set model.scan_layers=false (or model.moe_every=1)")
    if not 0 <= m.moe_first_dense < m.n_layers:
        raise ShardlmError(f"model.moe_first_dense={m.moe_first_dense} must leave a sparse layer: 0 <= it < "
                           f"model.n_layers={m.n_layers}")
    _check_routing(m)
    if m.moe_d_ff < 0 or m.moe_aux_loss_weight < 0:
        raise ShardlmError("model.moe_d_ff and model.moe_aux_loss_weight must be >= 0")


def _check_routing(m: ModelConfig) -> None:
    check_one_of("model.moe_router", m.moe_router, ROUTER_SCORES)
    if m.moe_groups < 1 or m.moe_experts % m.moe_groups or not 1 <= m.moe_group_top_k <= m.moe_groups:
        raise ShardlmError(f"model.moe_groups={m.moe_groups} must divide model.moe_experts={m.moe_experts}, and "
                           f"1 <= model.moe_group_top_k={m.moe_group_top_k} <= the groups")
    if m.moe_top_k > m.moe_group_top_k * (m.moe_experts // m.moe_groups):
        raise ShardlmError(f"model.moe_top_k={m.moe_top_k} experts cannot be chosen from model.moe_group_top_k="
                           f"{m.moe_group_top_k} groups of {m.moe_experts // m.moe_groups}; raise the groups kept")
    if m.moe_bias_rate < 0 or m.moe_routed_scale <= 0:
        raise ShardlmError("model.moe_bias_rate must be >= 0 and model.moe_routed_scale > 0")
    if m.moe_bias_rate and m.moe_router != "sigmoid":
        raise ShardlmError(f"model.moe_bias_rate={m.moe_bias_rate} moves the sigmoid router's per-expert bias "
                           "(DeepSeek-V3's balancing); set model.moe_router=sigmoid, or model.moe_bias_rate=0")


def _check_rope_scaling(m: ModelConfig) -> None:
    """The rotary scaling's name and numbers, each a one-line error."""
    check_one_of("model.rope_scaling", m.rope_scaling, ROPE_SCALINGS)
    if m.rope_scaling == "none":
        return
    if m.rope_factor < 1 or m.rope_original_context < 1:
        raise ShardlmError(f"model.rope_scaling={m.rope_scaling} needs model.rope_factor >= 1 and "
                           f"model.rope_original_context >= 1 (the pretraining context), got {m.rope_factor} and "
                           f"{m.rope_original_context}")
    if m.rope_scaling == "llama3" and not 0 < m.rope_low_freq_factor < m.rope_high_freq_factor:
        raise ShardlmError(f"model.rope_scaling=llama3 needs 0 < model.rope_low_freq_factor < "
                           f"model.rope_high_freq_factor, got {m.rope_low_freq_factor} and {m.rope_high_freq_factor}")
    if m.rope_scaling == "yarn" and not 0 < m.rope_beta_slow <= m.rope_beta_fast:
        raise ShardlmError(f"model.rope_scaling=yarn needs 0 < model.rope_beta_slow <= model.rope_beta_fast, got "
                           f"{m.rope_beta_slow} and {m.rope_beta_fast}")


def _check_kinds(m: ModelConfig) -> None:
    """Head layout, dtypes and the remat/attention choices."""
    check_one_of("model.dtype", m.dtype, COMPUTE_DTYPES, " (float16 would need loss scaling: use bfloat16)")
    check_one_of("model.param_dtype", m.param_dtype, DTYPE_NAMES)
    check_one_of("model.grad_reduce_dtype", m.grad_reduce_dtype, ("auto", *DTYPE_NAMES))
    check_one_of("model.matmul_dtype", m.matmul_dtype, MATMUL_DTYPES)
    if m.loss_chunks < 0:
        raise ShardlmError(f"model.loss_chunks must be >= 0 (0 = automatic), got {m.loss_chunks}")
    if m.remat == AUTO_REMAT:  # resolved by the planner before any model is built (`shardlm.perf.auto`)
        if m.remat_offload:
            raise ShardlmError(f"model.remat=auto chooses among policies that keep activations on the device, and "
                               f"model.remat_offload={m.remat_offload} offloads some: name a policy, or drop the "
                               "offload")
    else:
        check_policy(m.remat, m.remat_offload)
    check_one_of("model.attention", m.attention, attention_choices())
    check_one_of("model.context_attention", m.context_attention, ("ring", "all_gather"))
    check_one_of("model.moe_kernel", m.moe_kernel, ("auto",) + GROUPED_KERNELS)
    check_one_of("model.moe_exchange", m.moe_exchange, ("auto",) + EXCHANGES)
    check_one_of("model.moe_dropless", m.moe_dropless, ("rounds", "buffer"))
    check_positive("model.attention_block", m.attention_block)
    check_positive("model.rope_theta", m.rope_theta)
    _check_rope_scaling(m)
    kv = m.n_kv_heads or m.n_heads
    if m.n_kv_heads < 0 or m.n_heads % kv:
        raise ShardlmError(f"model.n_kv_heads={m.n_kv_heads} must divide model.n_heads={m.n_heads} (each kv head "
                           "serves a group of query heads; 1 = multi-query, 0 = one per query head)")
