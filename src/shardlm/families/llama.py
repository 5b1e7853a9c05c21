"""The Llama family: RMSNorm, rotary embeddings, grouped-query attention, SwiGLU, and mixtures of experts
(`shardlm.models.llama`), and its presets. Sizes follow the shapes of published Llama-style models (SwiGLU
hidden ~8/3 d_model or more, grouped-query attention, no biases); the counts are for a 32,000-token vocabulary
(Llama 2's), tied, and move by d_model x vocabulary with the tokenizer."""

from shardlm.errors import ShardlmError
from shardlm.families.spec import Family, register
from shardlm.hf.llama import LLAMA as LLAMA_HF
from shardlm.models.config import ModelConfig, head_size

_LLAMA = dict(use_bias=False, tie_embeddings=True)
_LLAMA3_ROPE = dict(rope_scaling="llama3", rope_original_context=8192, rope_low_freq_factor=1.0,
                    rope_high_freq_factor=4.0)

PRESETS = {
    # The same scales as tiny and small, Llama-style, with 2 kv heads.
    "llama-tiny": dict(_LLAMA, n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_mlp=384, seq_len=128),
    "llama-small": dict(_LLAMA, n_layers=6, n_heads=6, n_kv_heads=2, d_model=384, d_mlp=1024, seq_len=256),
    # GPT-2 small's and medium's depth and width, Llama-style; 4 kv heads, so tensor degrees 2 and 4 divide them.
    "llama-125m": dict(_LLAMA, n_layers=12, n_heads=12, n_kv_heads=4, d_model=768, d_mlp=3072, seq_len=2048),
    "llama-350m": dict(_LLAMA, n_layers=24, n_heads=16, n_kv_heads=4, d_model=1024, d_mlp=3584, seq_len=2048),
    # Llama 3.2 1B's shape (16 layers, 32 query and 8 kv heads, SwiGLU 8192): 1.04B (1.24B with its 128k vocabulary).
    "llama-1b": dict(_LLAMA, n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048, d_mlp=8192, seq_len=2048,
                     rope_theta=500000.0),
    # Llama 3.1 8B and Llama 3.2 1B as published (8.03B and 1.24B with their 128,256-token vocabulary, the 8B untied
    # and the 1B tied; Llama 3.1's long-context rotary scaling, `llama3` with factor 8 and 32 over 8192 pretraining
    # positions), and Llama 3 70B's shape; sequences of 8192.
    "llama-3.1-8b": dict(_LLAMA, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_mlp=14336, seq_len=8192,
                         vocab_size=128256, tie_embeddings=False, rope_theta=500000.0, layer_norm_eps=1e-5,
                         **_LLAMA3_ROPE, rope_factor=8.0),
    "llama-3.2-1b": dict(_LLAMA, n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048, d_mlp=8192, seq_len=8192,
                         vocab_size=128256, tie_embeddings=True, rope_theta=500000.0, layer_norm_eps=1e-5,
                         **_LLAMA3_ROPE, rope_factor=32.0),
    "llama-3-70b": dict(_LLAMA, n_layers=80, n_heads=64, n_kv_heads=8, d_model=8192, d_mlp=28672, seq_len=8192,
                        vocab_size=128256, tie_embeddings=False, rope_theta=500000.0, layer_norm_eps=1e-5),
    # Mixtures of experts (SwiGLU experts, top-2 routing, dropless): llama-tiny's shape with 8 experts per layer,
    # and Mixtral 8x7B's (46.7B parameters, 12.9B active per token, untied; sequences of 4096 here, of its 32k).
    "moe-tiny": dict(_LLAMA, n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_mlp=256, seq_len=128,
                     moe_experts=8, moe_top_k=2),
    "mixtral-8x7b": dict(_LLAMA, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_mlp=14336, seq_len=4096,
                         vocab_size=32000, tie_embeddings=False, rope_theta=1e6, layer_norm_eps=1e-5,
                         moe_experts=8, moe_top_k=2),
}


def check(m: ModelConfig) -> None:
    if m.use_bias:
        raise ShardlmError("the llama family has no biases: set model.use_bias=false (llama presets do)")
    if head_size(m) % 2:
        raise ShardlmError(f"rotary embeddings need an even head size, not {head_size(m)}; change model.head_dim, "
                           "or model.d_model or model.n_heads")


LLAMA = register(Family(name="llama", model="shardlm.models.llama:Llama", mlp_matrices=3, presets=PRESETS,
                        check=check, experts=True, hf=LLAMA_HF))
