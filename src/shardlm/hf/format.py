"""What a model family is in Hugging Face's terms (`HfFormat`): one record a family hands to the converters.

Design choices:
- The converters (`config`, `weights`, `importer`) are generic: reading config.json, opening safetensors,
  checking every tensor's name and shape, assembling shards. What differs by family is a record of five
  functions and the `model_type`s it reads, written beside the family's tensor names (`shardlm.hf.gpt2`,
  `shardlm.hf.llama`) and registered with the family (`shardlm.families`); nothing in hf/ branches on a family.
- Refusals are the mapping's: a setting the model would compute differently is a one-line error naming the key,
  never an import into a model that silently computes something else.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.hf.views import View


def _accepts(*_args) -> None:
    """The check of a family that has nothing to refuse."""


@dataclasses.dataclass(frozen=True)
class HfFormat:
    """A family's Hugging Face mapping."""

    model_types: tuple[str, ...]  # config.json `model_type`s read as this family
    # (config.json, its directory) -> ModelConfig fields; refuses what the family computes differently
    fields: Callable[[dict, Path], dict]
    # (model config, the keys every family writes) -> config.json
    config: Callable[..., dict]
    # (model config, vocabulary, padded vocabulary, T(name, shape) -> Tensor, the checkpoint's tensor names, its
    # config.json (how its tensors are laid out: DeepSeek's interleaved rotary rows)) -> {parameter path
    # ('blocks/0/attn/wq'): view}
    views: Callable[..., dict[str, View]]
    # (model config, vocabulary, get(path[, expert]) -> array) -> (name, array) for every tensor, in order
    tensors: Callable[..., Iterator[tuple[str, np.ndarray]]]
    # (model config, where) -> None: raises if the model has no counterpart this mapping writes
    exportable: Callable[..., None] = _accepts
    # (model config, the checkpoint's config.json, its directory) -> None: the overrides against the checkpoint
    check_import: Callable[..., None] = _accepts
