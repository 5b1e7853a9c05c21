"""The DeepSeek family (DeepSeek-V3's architecture, `shardlm.models.deepseek`): multi-head latent attention, the
first layers dense and the rest fine-grained experts beside a shared one, sigmoid routing limited to groups of
experts with the auxiliary-loss-free balancing bias, and multi-token prediction; mapped to Hugging Face's
`DeepseekV3ForCausalLM` (`shardlm.hf.deepseek`). Its FLOP formula's attention part is latent attention's
(`attention_params`)."""

from shardlm.errors import ShardlmError
from shardlm.families.spec import Family, register
from shardlm.hf.deepseek import DEEPSEEK as DEEPSEEK_HF
from shardlm.models.config import ModelConfig

_DEEPSEEK = dict(use_bias=False, moe_router="sigmoid", moe_shared_expert=True, moe_norm_topk=True,
                 layer_norm_eps=1e-6, tie_embeddings=False)

PRESETS = {
    # DeepSeek-V3's kinds at llama-tiny's scale: 1 dense layer then 3 of 8 routed experts (4 groups of 2, 2
    # groups kept, top 2) beside a shared one, latents of 32 (keys and values) and 48 (queries), heads of 32
    # plain and 16 rotary features, one MTP module, the balancing bias moving 1e-3 a step.
    "deepseek-tiny": dict(_DEEPSEEK, n_layers=4, n_heads=4, d_model=128, d_mlp=384, seq_len=128, moe_experts=8,
                          moe_top_k=2, moe_d_ff=64, moe_groups=4, moe_group_top_k=2, moe_routed_scale=2.5,
                          moe_first_dense=1, moe_bias_rate=1e-3, moe_aux_loss_weight=0.0, mla_kv_rank=32,
                          mla_q_rank=48, mla_rope_dim=16, mla_nope_dim=32, mla_v_dim=32, mtp_depth=1,
                          tie_embeddings=True),
    # DeepSeek-V3 as released (671B parameters, 37B active per token, with its 129,280-token vocabulary and one
    # MTP module of 11.5B): 61 layers (3 dense, SwiGLU 18432) of 128 heads over 7168, 256 routed experts of 2048
    # in 8 groups (4 kept, top 8, weights x 2.5) and one shared, latents of 512 and 1536, heads of 128 + 64 and
    # values of 128; YaRN (factor 40 over 4096 positions, mscale 1); sequences of 4096 as pretrained; the bias
    # rate and sequence-wise balance weight of its pretraining (1e-3, 1e-4 here batch-wise).
    "deepseek-v3": dict(_DEEPSEEK, n_layers=61, n_heads=128, d_model=7168, d_mlp=18432, seq_len=4096,
                        vocab_size=129280, moe_experts=256, moe_top_k=8, moe_d_ff=2048, moe_groups=8,
                        moe_group_top_k=4, moe_routed_scale=2.5, moe_first_dense=3, moe_bias_rate=1e-3,
                        moe_aux_loss_weight=1e-4, mla_kv_rank=512, mla_q_rank=1536, mla_rope_dim=64,
                        mla_nope_dim=128, mla_v_dim=128, mtp_depth=1, rope_scaling="yarn", rope_factor=40.0,
                        rope_original_context=4096, rope_mscale=1.0, rope_mscale_all_dim=1.0),
}


def check(m: ModelConfig) -> None:
    if m.mla_kv_rank <= 0:
        raise ShardlmError("the deepseek family computes latent attention: set model.mla_kv_rank > 0 (deepseek "
                           "presets do)")
    if m.use_bias or m.qkv_bias or m.qk_norm or m.head_dim:
        raise ShardlmError("the deepseek family's latent attention has no biases, q/k norms or model.head_dim (its "
                           "heads are model.mla_nope_dim + model.mla_rope_dim): drop them")
    if m.n_kv_heads not in (0, m.n_heads):
        raise ShardlmError("the deepseek family's latent attention expands keys and values for every head: drop "
                           "model.n_kv_heads")
    if m.mla_rope_dim % 2 or min(m.mla_rope_dim, m.mla_nope_dim, m.mla_v_dim, m.mla_q_rank) < 0:
        raise ShardlmError(f"model.mla_rope_dim={m.mla_rope_dim} must be even (rotary pairs) and the MLA sizes >= 0")
    if m.mla_v_dim > m.mla_nope_dim + m.mla_rope_dim:  # values are padded to the query/key head, never the reverse
        raise ShardlmError(f"model.mla_v_dim={m.mla_v_dim} is wider than the query/key head (model.mla_nope_dim + "
                           f"model.mla_rope_dim = {m.mla_nope_dim + m.mla_rope_dim}), which the attention kernels take "
                           "as their one head size; choose mla_v_dim <= it (DeepSeek-V3: 128 <= 192)")
    if m.mtp_depth < 0 or m.mtp_loss_weight < 0:
        raise ShardlmError("model.mtp_depth and model.mtp_loss_weight must be >= 0")


def attention_params(m: ModelConfig) -> int:
    """Latent attention's weights per layer: the query's (through its latent, or not), the key/value latent and
    rotary key, their expansion per head, and the output."""
    qk, h, d = m.mla_nope_dim + m.mla_rope_dim, m.n_heads, m.d_model
    query = (d * m.mla_q_rank + m.mla_q_rank * h * qk) if m.mla_q_rank else d * h * qk
    return query + d * (m.mla_kv_rank + m.mla_rope_dim) + m.mla_kv_rank * h * (m.mla_nope_dim + m.mla_v_dim) \
        + h * m.mla_v_dim * d


def attention_matrices(m: ModelConfig, tensor: int) -> list[tuple[int, int]]:
    """Latent attention's products per device under a tensor split: the latents (replicated over tensor), their
    expansion for the device's heads, and the output."""
    h, qk = m.n_heads // tensor, m.mla_nope_dim + m.mla_rope_dim
    query = [(m.d_model, m.mla_q_rank), (m.mla_q_rank, h * qk)] if m.mla_q_rank else [(m.d_model, h * qk)]
    return [*query, (m.d_model, m.mla_kv_rank + m.mla_rope_dim), (m.mla_kv_rank, h * (m.mla_nope_dim + m.mla_v_dim)),
            (h * m.mla_v_dim, m.d_model)]


DEEPSEEK = register(Family(name="deepseek", model="shardlm.models.deepseek:DeepSeek", mlp_matrices=3,
                           presets=PRESETS, check=check, experts=True, hf=DEEPSEEK_HF,
                           attention_params=attention_params, attention_matrices=attention_matrices))
