"""Models: pure math with logical axis names.

`config` holds `ModelConfig` (architecture and numerics) and the checks every family shares; `params` parameters
with logical axis names and their dtypes; `attention` self-attention (GQA, RoPE, the kernel a pass runs, the KV
cache); `layers` the pre-norm block and the decoder-only forward pass; `gpt`, `llama` and `moe` the families'
own math. Which families exist, with their presets, checks and Hugging Face mappings, is `shardlm.families`'
registry. Nothing here names a mesh axis: `shardlm.sharding` maps the logical names.

Importing the package does not import JAX: `GPT`, `Llama`, `CausalLM` and `padded_vocab_size` load on first use, so
the run config (which owns a `ModelConfig`) can be read before the model code is imported.
"""

_LAZY = {"GPT": "shardlm.models.gpt", "Llama": "shardlm.models.llama", "CausalLM": "shardlm.models.layers",
         "padded_vocab_size": "shardlm.models.params"}

__all__ = sorted(_LAZY)


def __getattr__(name: str):
    import importlib

    if name in _LAZY:
        return getattr(importlib.import_module(_LAZY[name]), name)
    raise AttributeError(f"module 'shardlm.models' has no attribute {name!r}")
