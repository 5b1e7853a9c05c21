"""Model size presets. GPT-2 sizes follow the GPT-2 paper (context 1024, 4x MLP)."""

from shardlm.config import ModelConfig
from shardlm.errors import ShardlmError

_PRESETS: dict[str, dict] = {
    # Trains visibly in a few CPU minutes on the built-in corpus.
    "tiny": dict(n_layers=4, n_heads=4, d_model=128, d_mlp=512, seq_len=128),
    # nanoGPT's Shakespeare scale: minutes on one GPU.
    "small": dict(n_layers=6, n_heads=6, d_model=384, d_mlp=1536, seq_len=256, dropout=0.1),
    "gpt2-small": dict(n_layers=12, n_heads=12, d_model=768, d_mlp=3072, seq_len=1024),  # 124M
    "gpt2-medium": dict(n_layers=24, n_heads=16, d_model=1024, d_mlp=4096, seq_len=1024),  # 350M
    "gpt2-large": dict(n_layers=36, n_heads=20, d_model=1280, d_mlp=5120, seq_len=1024),  # 774M
    "gpt2-xl": dict(n_layers=48, n_heads=25, d_model=1600, d_mlp=6400, seq_len=1024),  # 1.5B
}

PRESET_NAMES = tuple(_PRESETS)


def model_preset(name: str) -> ModelConfig:
    if name not in _PRESETS:
        raise ShardlmError(f"unknown model preset '{name}'; choose one of: {', '.join(PRESET_NAMES)}")
    return ModelConfig(preset=name, **_PRESETS[name])
