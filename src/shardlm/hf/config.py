"""config.json, generically: the `hf:DIR` spelling, reading a model directory's config, and writing one through a
family's mapping (`shardlm.hf.format.HfFormat`; the families' own are `shardlm.hf.gpt2` and `shardlm.hf.llama`).

Design choices:
- Which family reads a config.json is the family registry's business (`shardlm.families`): nothing here
  branches on a family or a model_type.
- A setting the model code would compute differently is refused by name (`refuse`) instead of being imported
  into a model that silently computes something else.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.errors import ShardlmError
from shardlm.files import read_mapping
from shardlm.models.config import ModelConfig

CONFIG_FILE = "config.json"
HF_PREFIX = "hf:"


def model_label(spec: str) -> str:
    """A file-name-safe label for `hf:DIR`: 'hf:/ckpt/TinyLlama-1.1B' -> 'hf-TinyLlama-1.1B'."""
    return "hf-" + (hf_dir(spec).resolve().name or "model")


def is_hf(spec: str | Path) -> bool:
    """Whether a model or checkpoint spec names a Hugging Face directory ('hf:DIR')."""
    return str(spec).startswith(HF_PREFIX)


def hf_dir(spec: str) -> Path:
    """'hf:DIR' -> DIR."""
    return Path(spec[len(HF_PREFIX):]).expanduser()


def read_hf_config(directory: str | Path) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardlmError(f"hf:{directory} is not a directory; give a local directory as save_pretrained writes it "
                           "(config.json and *.safetensors); shardlm does not download")
    if not (directory / CONFIG_FILE).is_file():
        raise ShardlmError(f"hf:{directory} holds no {CONFIG_FILE}; give the directory save_pretrained wrote")
    return read_mapping(directory / CONFIG_FILE, "", missing="give the directory save_pretrained wrote",
                        not_mapping="a Hugging Face config.json holds one JSON object")


def refuse(path: Path, key: str, value, why: str) -> ShardlmError:
    return ShardlmError(f"{path / CONFIG_FILE}: {key}={json.dumps(value)} is not supported ({why}); shardlm would "
                        "compute another model")


def round_float(x: float) -> float:
    """x without the last bits a division or product added (0.001 * 3 / 3 reads back 0.001)."""
    return float(f"{x:.12g}")


def model_config(directory: Path, tree: dict, read_fields) -> ModelConfig:
    """`model=hf:DIR`: the ModelConfig of the checkpoint in `directory` (resolved: one spelling of the path, whatever
    the working directory) whose config.json is `tree` (its architecture; `init.from=hf:DIR` also loads the
    weights), its fields read by `read_fields(tree, directory)` (the family's, looked up by `model_type`).
    Missing keys in config.json are one-line errors naming them."""
    try:
        fields = read_fields(tree, directory)
    except KeyError as e:
        raise ShardlmError(f"{directory / CONFIG_FILE} has no {e.args[0]!r}, which a {tree.get('model_type')} "
                           "config needs") from None
    return ModelConfig(preset=f"{HF_PREFIX}{directory}", **fields)


def hf_config(m: ModelConfig, fmt, vocab_size: int, special: dict[str, int | None]) -> dict:
    """config.json for a shardlm model config `m` (vocabulary without its padding) in the family's format `fmt`;
    `special` holds bos_token_id and eos_token_id."""
    common = {"vocab_size": vocab_size, "tie_word_embeddings": m.tie_embeddings, "dtype": "float32",
              "bos_token_id": special.get("bos_token_id"), "eos_token_id": special.get("eos_token_id")}
    return fmt.config(m, common)
