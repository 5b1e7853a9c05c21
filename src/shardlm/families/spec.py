"""The family record (`Family`) and its registry: what `shardlm.families` exports, kept apart from the built-in
families so that they import it and it imports none of them."""

from __future__ import annotations

import dataclasses
import importlib
from typing import Callable, Mapping

from shardlm.errors import ShardlmError, check_one_of
from shardlm.hf.config import CONFIG_FILE, hf_dir, model_config, read_hf_config
from shardlm.hf.format import HfFormat
from shardlm.models.config import ModelConfig, check_model, head_size


def _accepts(m: ModelConfig) -> None:
    """The check of a family with nothing to refuse beyond the shared checks."""


def grouped_query_attention_params(m: ModelConfig) -> int:
    """The weights of one grouped-query attention layer: q and the output [d, heads x head], k and v [d, kv heads x
    head]."""
    return sum(k * n for k, n in grouped_query_attention_matrices(m, 1))


def grouped_query_attention_matrices(m: ModelConfig, tensor: int) -> list[tuple[int, int]]:
    """One grouped-query attention layer's products per device as (in, out) under a tensor split: q, k and v as
    one, and the output."""
    head, kv = head_size(m), m.n_kv_heads or m.n_heads
    return [(m.d_model, (m.n_heads + 2 * kv) * head // tensor), (m.n_heads * head // tensor, m.d_model)]


@dataclasses.dataclass(frozen=True)
class Family:
    name: str
    # The nnx module, called as Class(model config, vocabulary, padded vocabulary, rngs): the class, or
    # "module:Class" (the built-in families', imported when a model is built)
    model: str | type
    # The weights of a dense MLP, for the FLOP count and the planner's bound: 2 (in, out) or 3 (SwiGLU's gate,
    # up and down)
    mlp_matrices: int
    presets: Mapping[str, dict] = dataclasses.field(default_factory=dict)  # preset name -> ModelConfig fields
    check: Callable[[ModelConfig], None] = _accepts  # what this family cannot compute, each a one-line error
    experts: bool = False  # whether its MLPs can be mixtures of experts (model.moe_experts)
    hf: HfFormat | None = None  # its Hugging Face mapping; None: it neither imports nor exports
    # The tokenizer of a checkpoint saved without tokenizer.json, by its vocabulary size (GPT-2's 50257: gpt2)
    tokenizers: Mapping[int, str] = dataclasses.field(default_factory=dict)
    # The weights one layer's attention multiplies each token by, for the FLOP count and the planner's bound
    attention_params: Callable[[ModelConfig], int] = grouped_query_attention_params
    # ... and as the products one device runs under a tensor split, (in, out) each: the planner's bound
    attention_matrices: Callable[[ModelConfig, int], list[tuple[int, int]]] = grouped_query_attention_matrices


FAMILIES: dict[str, Family] = {}


def register(family: Family) -> Family:
    """Add `family` to the registry (again under its name: replaced); its presets join the others."""
    taken = {p: f.name for f in FAMILIES.values() if f.name != family.name for p in f.presets}
    clash = sorted(set(family.presets) & set(taken))
    if clash:
        raise ShardlmError(f"family {family.name}'s preset {clash[0]!r} is {taken[clash[0]]}'s already; rename it")
    FAMILIES[family.name] = family
    return family


def family_of(m: ModelConfig | str) -> Family:
    """The family of model config `m` (or of that name)."""
    name = m if isinstance(m, str) else m.family
    check_one_of("model.family", name, tuple(FAMILIES))
    return FAMILIES[name]


def check_model_config(m: ModelConfig) -> None:
    """Every check of a model config: the shared ones, then its family's, each a one-line error."""
    check_model(m)
    family = family_of(m)
    if m.moe_experts and not family.experts:
        with_experts = [f.name for f in FAMILIES.values() if f.experts]
        families = (f"{', '.join(with_experts[:-1])} and {with_experts[-1]} families" if len(with_experts) > 1
                    else f"{with_experts[0]} family")
        raise ShardlmError(f"model.moe_experts applies to the {families} (SwiGLU experts), not {family.name}: use a "
                           "preset of one (model=moe-tiny, qwen3-moe-tiny, ...) or drop it")
    family.check(m)


def model_class(m: ModelConfig | str) -> type:
    """The family's nnx module class."""
    model = family_of(m).model
    if not isinstance(model, str):
        return model
    module, name = model.split(":")
    return getattr(importlib.import_module(module), name)


def build_model(m: ModelConfig, vocab: int, padded: int, rngs):
    """The family's nnx module for model config `m`."""
    return model_class(m)(m, vocab, padded, rngs)


def preset_names() -> tuple[str, ...]:
    return tuple(p for f in FAMILIES.values() for p in f.presets)


def model_preset(name: str) -> ModelConfig:
    """A built-in preset of any family. (`hf:DIR`, a Hugging Face checkpoint's architecture, is resolved by
    `from_hf`.)"""
    for family in FAMILIES.values():
        if name in family.presets:
            return ModelConfig(preset=name, family=family.name, **family.presets[name])
    raise ShardlmError(f"unknown model preset '{name}'; choose one of: {', '.join(preset_names())}, or "
                       "hf:DIR (a Hugging Face checkpoint's architecture)")


def hf_format(m: ModelConfig) -> HfFormat:
    """The Hugging Face mapping of `m`'s family, or a one-line error if it has none."""
    family = family_of(m)
    if family.hf is None:
        raise ShardlmError(f"the {family.name} family has no Hugging Face counterpart; read its variables with "
                           "shardlm.load_model(run_dir) instead")
    return family.hf


def from_hf(spec: str) -> ModelConfig:
    """`model=hf:DIR`: that checkpoint's architecture, read by the family whose mapping takes its model_type."""
    directory = hf_dir(spec).resolve()  # one spelling of the path, whatever the working directory
    tree = read_hf_config(directory)
    kind = tree.get("model_type")
    for family in FAMILIES.values():
        if family.hf is not None and kind in family.hf.model_types:
            return model_config(directory, tree, family.hf.fields)
    arch = ", ".join(tree.get("architectures") or []) or "no architectures listed"
    known = [t for f in FAMILIES.values() if f.hf is not None for t in f.hf.model_types]
    raise ShardlmError(f"{directory / CONFIG_FILE}: model_type {kind!r} ({arch}) is not supported; shardlm imports "
                       f"{', '.join(known)} checkpoints")

