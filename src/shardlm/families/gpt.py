"""The GPT-2 family: LayerNorm, learned positions, a GELU MLP (`shardlm.models.gpt`), and its presets. GPT-2 sizes
follow the GPT-2 paper (context 1024, 4x MLP)."""

from shardlm.errors import ShardlmError
from shardlm.families.spec import Family, register
from shardlm.hf.gpt2 import GPT2
from shardlm.models.config import ModelConfig

GPT2_VOCAB = 50257  # GPT-2's BPE vocabulary: a checkpoint of this size without tokenizer.json is GPT-2's

PRESETS = {
    # Trains visibly in a few CPU minutes on the built-in corpus.
    "tiny": dict(n_layers=4, n_heads=4, d_model=128, d_mlp=512, seq_len=128),
    # nanoGPT's Shakespeare scale: minutes on one GPU.
    "small": dict(n_layers=6, n_heads=6, d_model=384, d_mlp=1536, seq_len=256, dropout=0.1),
    "gpt2-small": dict(n_layers=12, n_heads=12, d_model=768, d_mlp=3072, seq_len=1024),  # 124M
    "gpt2-medium": dict(n_layers=24, n_heads=16, d_model=1024, d_mlp=4096, seq_len=1024),  # 350M
    "gpt2-large": dict(n_layers=36, n_heads=20, d_model=1280, d_mlp=5120, seq_len=1024),  # 774M
    "gpt2-xl": dict(n_layers=48, n_heads=25, d_model=1600, d_mlp=6400, seq_len=1024),  # 1.5B
}


def check(m: ModelConfig) -> None:
    if (m.n_kv_heads or m.n_heads) != m.n_heads:
        raise ShardlmError("model.n_kv_heads applies to the llama family; GPT has one kv head per query head: "
                           "drop it, or use model=llama-tiny (or another llama preset)")


GPT = register(Family(name="gpt", model="shardlm.models.gpt:GPT", mlp_matrices=2, presets=PRESETS, check=check,
                      hf=GPT2, tokenizers={GPT2_VOCAB: "gpt2"}))
