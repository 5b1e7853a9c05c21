"""Models: pure math with logical axis names.

`config` holds `ModelConfig` (architecture and numerics) and its checks; `presets` the built-in sizes; `layers`
what the families share (attention with GQA, RoPE and a KV cache, mixed precision, remat, the forward pass);
`gpt` and `llama` the two families. Nothing here names a mesh axis: `shardlm.sharding` maps the logical names.

Importing the package does not import JAX: `GPT`, `Llama`, `CausalLM`, `FAMILIES` and `padded_vocab_size` load on
first use, so the run config (which owns a `ModelConfig`) can be read before JAX starts.
"""

_LAZY = {"GPT": "shardlm.models.gpt", "Llama": "shardlm.models.llama", "CausalLM": "shardlm.models.layers",
         "padded_vocab_size": "shardlm.models.layers"}

__all__ = ["FAMILIES", *sorted(_LAZY)]


def __getattr__(name: str):
    import importlib

    if name == "FAMILIES":  # family name -> model class
        from shardlm.models.gpt import GPT
        from shardlm.models.llama import Llama

        return {"gpt": GPT, "llama": Llama}
    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlm.models' has no attribute {name!r}")
