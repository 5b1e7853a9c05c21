"""Models: pure math with logical axis names. `presets` holds the size presets; `layers` what families share."""

from shardlm.models.gpt import GPT
from shardlm.models.layers import CausalLM, padded_vocab_size
from shardlm.models.llama import Llama

FAMILIES: dict[str, type[CausalLM]] = {"gpt": GPT, "llama": Llama}

__all__ = ["FAMILIES", "GPT", "CausalLM", "Llama", "padded_vocab_size"]
