"""Models: pure math with logical axis names. `presets` holds the size presets."""

from shardlm.models.gpt import GPT, padded_vocab_size

__all__ = ["GPT", "padded_vocab_size"]
