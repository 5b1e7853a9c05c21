"""Where a new run's parameters come from when `init.from=hf:DIR` names a Hugging Face checkpoint.

Three steps of `shardlm train`, in the order it takes them:
- `with_checkpoint_defaults`: the config completed from the checkpoint (its vocabulary, its tokenizer), before
  anything else reads the config;
- `check_checkpoint`: the checkpoint's tensors checked against the model (keys, shapes; headers only), before the
  data, which may take minutes to prepare, and before anything is written;
- `import_params`: the weights read straight into the mesh's shardings (`shardlm.hf.importer`).
A resumed run reads none of this: its checkpoint holds the weights and its config.yaml the resolved settings.
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path

from shardlm.config import Config
from shardlm.data.prepare import META_FILE
from shardlm.data.tokenizer import TOKENIZER_FILE
from shardlm.errors import ShardlmError
from shardlm.hf import importer
from shardlm.families import family_of, from_hf, hf_format
from shardlm.hf.config import hf_dir, is_hf, read_hf_config
from shardlm.train.source import model_source
from shardlm.train.state import abstract_model, abstract_train_state, vocab_sizes

def with_checkpoint_defaults(cfg: Config) -> Config:
    """`cfg` for a run that starts from the checkpoint in `init.from`: the model's vocabulary the checkpoint's
    (when `model.vocab_size` is 0, as in the built-in presets), and `data.tokenizer=auto` the checkpoint's
    tokenizer: its tokenizer.json (`bpe:DIR/tokenizer.json`), or the family's tokenizer for its vocabulary size
    (`Family.tokenizers`: tiktoken's gpt2 for a GPT-2 checkpoint of GPT-2's vocabulary). A prepared data directory
    keeps its own tokenizer if it is that one (gpt2; or the same file, checked when it is opened). A resumed run's
    config has both set already, and reads nothing here."""
    if not is_hf(cfg.init.from_) or (cfg.model.vocab_size and cfg.data.tokenizer != "auto"):
        return cfg
    directory = hf_dir(cfg.init.from_).resolve()
    model = cfg.model
    if not model.vocab_size:
        model = dataclasses.replace(model, vocab_size=int(read_hf_config(directory).get("vocab_size") or 0))
    tokenizer = cfg.data.tokenizer
    if tokenizer == "auto":
        tokenizer = _checkpoint_tokenizer(directory, model, Path(cfg.data.path) / META_FILE)
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))


def _checkpoint_tokenizer(directory: Path, model, prepared_meta: Path) -> str:
    known = family_of(model).tokenizers.get(model.vocab_size)  # the family's own for this vocabulary, if any
    if prepared_meta.is_file() and known and json.loads(prepared_meta.read_text()).get("tokenizer") == known:
        return known
    if (directory / TOKENIZER_FILE).is_file():
        return f"bpe:{directory / TOKENIZER_FILE}"
    if known:
        return known
    raise ShardlmError(f"init.from=hf:{directory} holds no {TOKENIZER_FILE} to tokenize the data with; save "
                       "the tokenizer there (tokenizer.save_pretrained), or set data.tokenizer")


def check_checkpoint(cfg: Config, mesh) -> None:
    """Raise now if `init.from`'s checkpoint does not fit the model (keys, shapes): before the data, which may
    take minutes to prepare, and before anything is written. Reads the files' headers only."""
    if not is_hf(cfg.init.from_):
        return
    real, padded = vocab_sizes(cfg, cfg.model.vocab_size, mesh.shape["tensor"])  # set by with_checkpoint_defaults
    try:
        importer.check_checkpoint(hf_dir(cfg.init.from_), cfg.model, hf_format(cfg.model), real, padded)
    except ShardlmError as e:
        changed = _changed_architecture(cfg)
        if not changed:
            raise
        raise ShardlmError(f"{e}: the run's model is not the checkpoint's, it sets {changed}; drop those model "
                           "settings (init.from brings the checkpoint's architecture)") from None


def _changed_architecture(cfg: Config) -> str:
    """The run's model settings that make tensors of other shapes than `init.from`'s config.json says (a preset
    or an override beside init.from), as "model.n_layers=2 (the checkpoint's 24), ...", or ""."""
    own = from_hf(cfg.init.from_)
    return ", ".join(f"model.{f}={getattr(cfg.model, f)} (the checkpoint's {getattr(own, f)})" for f in SHAPING
                     if getattr(cfg.model, f) != getattr(own, f))


# The model settings that decide which tensors a checkpoint holds and their shapes.
SHAPING = ("family", "n_layers", "n_heads", "n_kv_heads", "d_model", "d_mlp", "use_bias", "tie_embeddings",
           "head_dim", "qkv_bias", "qk_norm", "moe_experts", "moe_d_ff", "moe_every", "moe_first_dense",
           "moe_shared_expert", "moe_router", "mla_kv_rank", "mla_q_rank", "mla_rope_dim", "mla_nope_dim",
           "mla_v_dim", "mtp_depth")


def import_params(spec: str, cfg: Config, mesh, vocab_size: int, log=None):
    """(graphdef, state) of `cfg`'s model with the weights of the checkpoint `hf:DIR`, placed on `mesh` as the
    training state stores them (split over `data` too where the state is: `train.shard_optimizer_over_data`), so
    that `train_state_with` takes them as they are. `vocab_size` is the real vocabulary (the model pads it for the
    tensor degree)."""
    real, padded = vocab_sizes(cfg, vocab_size, mesh.shape["tensor"])
    graphdef, _ = abstract_model(cfg, mesh, real)
    abstract = abstract_train_state(cfg, mesh, vocab_size)[2]["model"]
    return graphdef, importer.read_params(hf_dir(spec), cfg.model, hf_format(cfg.model), real, padded, abstract, log,
                                          model_source(cfg).stack_repeats)
