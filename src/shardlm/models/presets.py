"""Model size presets. GPT-2 sizes follow the GPT-2 paper (context 1024, 4x MLP). Llama sizes follow the shapes of
published Llama-style models (SwiGLU hidden ~8/3 d_model or more, grouped-query attention, no biases); the counts
are for a 32,000-token vocabulary (Llama 2's), tied, and move by d_model x vocabulary with the tokenizer."""

from shardlm.errors import ShardlmError
from shardlm.models.config import ModelConfig

_LLAMA = dict(family="llama", use_bias=False, tie_embeddings=True)

_PRESETS: dict[str, dict] = {
    # Trains visibly in a few CPU minutes on the built-in corpus.
    "tiny": dict(n_layers=4, n_heads=4, d_model=128, d_mlp=512, seq_len=128),
    # nanoGPT's Shakespeare scale: minutes on one GPU.
    "small": dict(n_layers=6, n_heads=6, d_model=384, d_mlp=1536, seq_len=256, dropout=0.1),
    "gpt2-small": dict(n_layers=12, n_heads=12, d_model=768, d_mlp=3072, seq_len=1024),  # 124M
    "gpt2-medium": dict(n_layers=24, n_heads=16, d_model=1024, d_mlp=4096, seq_len=1024),  # 350M
    "gpt2-large": dict(n_layers=36, n_heads=20, d_model=1280, d_mlp=5120, seq_len=1024),  # 774M
    "gpt2-xl": dict(n_layers=48, n_heads=25, d_model=1600, d_mlp=6400, seq_len=1024),  # 1.5B
    # The same scales as tiny and small, Llama-style, with 2 kv heads.
    "llama-tiny": dict(_LLAMA, n_layers=4, n_heads=4, n_kv_heads=2, d_model=128, d_mlp=384, seq_len=128),
    "llama-small": dict(_LLAMA, n_layers=6, n_heads=6, n_kv_heads=2, d_model=384, d_mlp=1024, seq_len=256),
    # GPT-2 small's and medium's depth and width, Llama-style; 4 kv heads, so tensor degrees 2 and 4 divide them.
    "llama-125m": dict(_LLAMA, n_layers=12, n_heads=12, n_kv_heads=4, d_model=768, d_mlp=3072, seq_len=2048),
    "llama-350m": dict(_LLAMA, n_layers=24, n_heads=16, n_kv_heads=4, d_model=1024, d_mlp=3584, seq_len=2048),
    # Llama 3.2 1B's shape (16 layers, 32 query and 8 kv heads, SwiGLU 8192): 1.04B (1.24B with its 128k vocabulary).
    "llama-1b": dict(_LLAMA, n_layers=16, n_heads=32, n_kv_heads=8, d_model=2048, d_mlp=8192, seq_len=2048,
                     rope_theta=500000.0),
    # Llama 3.1 8B's and Llama 3 70B's shapes, for `plan`, `explain` and `--compile-only` at the sizes users plan
    # for (8.03B and 70.6B with their 128,256-token vocabulary, untied; sequences of 8192; plain rotary embeddings,
    # without Llama 3.1's long-context scaling).
    "llama-3.1-8b": dict(_LLAMA, n_layers=32, n_heads=32, n_kv_heads=8, d_model=4096, d_mlp=14336, seq_len=8192,
                         vocab_size=128256, tie_embeddings=False, rope_theta=500000.0, layer_norm_eps=1e-5),
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

PRESET_NAMES = tuple(_PRESETS)


def model_preset(name: str) -> ModelConfig:
    """A built-in preset. (`hf:DIR`, a Hugging Face checkpoint's architecture, is resolved by the run config.)"""
    if name not in _PRESETS:
        raise ShardlmError(f"unknown model preset '{name}'; choose one of: {', '.join(PRESET_NAMES)}, or "
                           "hf:DIR (a Hugging Face checkpoint's architecture)")
    return ModelConfig(preset=name, **_PRESETS[name])
