"""Reading a Hugging Face checkpoint directory onto a mesh: `init.from=hf:DIR` for training, `hf:DIR` for readers
(`shardlm generate hf:DIR`, `shardlm.load_model("hf:DIR")`).

Every parameter is assembled from its shards: for each device this process holds, the device's block of the right
safetensors tensor is read through its view (`shardlm.hf.weights`), cast to the parameter dtype and put on that
device before the next block is read (`jax.make_array_from_single_device_arrays`), so beyond what the devices
hold the host needs one shard at a time, and the model is never whole in one place. Everything is checked against
the checkpoint before the first byte is read (keys, shapes, the config), so nothing trains on a half-loaded model.
"""

from __future__ import annotations

import json
import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardlm.errors import ShardlmError
from shardlm.hf.config import hf_dir, is_hf
from shardlm.hf.weights import Checkpoint, parameter_views
from shardlm.sharding.rules import path_str


def check_checkpoint(cfg, mesh) -> None:
    """Raise now if `init.from`'s checkpoint does not fit the model (keys, shapes): before the data, which may
    take minutes to prepare, and before anything is written. Reads the files' headers only."""
    from shardlm.train.state import vocab_sizes

    if not is_hf(cfg.init.from_):
        return
    real, padded = vocab_sizes(cfg, cfg.model.vocab_size, mesh.shape["tensor"])  # set by with_checkpoint_defaults
    parameter_views(cfg.model, real, padded, Checkpoint(hf_dir(cfg.init.from_)))


def import_params(spec: str, cfg, mesh, vocab_size: int, log=None):
    """(graphdef, state) of `cfg`'s model with the weights of the checkpoint `hf:DIR`, placed on `mesh`.
    `vocab_size` is the real vocabulary (the model pads it for the tensor degree)."""
    from shardlm.train.state import abstract_model, vocab_sizes

    directory = hf_dir(spec)
    t0 = time.perf_counter()
    ckpt = Checkpoint(directory)
    real, padded = vocab_sizes(cfg, vocab_size, mesh.shape["tensor"])
    views = parameter_views(cfg.model, real, padded, ckpt)
    graphdef, abstract = abstract_model(cfg, mesh, real)
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))
    arrays, nbytes = [], 0
    for path, leaf in leaves:
        name = path_str(path)
        view = views.pop(name, None)
        if view is None or tuple(view.shape) != tuple(leaf.shape):
            raise ShardlmError(f"internal: no Hugging Face view of shape {leaf.shape} for {name}")
        arrays.append(_assemble(view, leaf))
        nbytes += leaf.size * leaf.dtype.itemsize
    if views:
        raise ShardlmError(f"internal: Hugging Face views without a parameter: {sorted(views)[:3]}")
    state = jax.tree.map(lambda x: x, abstract)
    nnx.replace_by_pure_dict(state, jax.tree_util.tree_unflatten(treedef, arrays))
    if log:
        log(f"imported {len(arrays)} tensors ({nbytes / 2**20:,.1f} MiB) from hf:{directory} in "
            f"{time.perf_counter() - t0:.1f}s, each device reading its own shards")
    return graphdef, state


def _assemble(view, leaf) -> jax.Array:
    """The global array of `leaf`'s shape and sharding, read shard by shard: each distinct block once (devices
    holding the same block, replicated, get copies of it), one block alive at a time."""
    by_block: dict[tuple, list] = {}
    for device, index in leaf.sharding.addressable_devices_indices_map(leaf.shape).items():
        by_block.setdefault(tuple((s.start, s.stop) for s in index), [index]).append(device)
    shards = []
    for index, *devices in by_block.values():
        block = np.asarray(view[index], leaf.dtype)
        shards += [jax.device_put(block, device) for device in devices]
        del block
    return jax.make_array_from_single_device_arrays(leaf.shape, leaf.sharding, shards)


def load_hf_model(spec: str, *, overrides=(), devices=None, require_tokenizer: bool = False):
    """A `shardlm.load.LoadedModel` of the checkpoint `hf:DIR` for readers: the architecture from config.json,
    the weights onto the mesh `overrides` (`mesh.*=...`) describe (default: data parallel over every device),
    the tokenizer from the directory's tokenizer files (None if it has none, unless `require_tokenizer`)."""
    from shardlm.config import load_config
    from shardlm.data.tokenizer import load_hf_dir_tokenizer
    from shardlm.load import LoadedModel
    from shardlm.mesh import mesh_from_config

    bad = [o for o in overrides if not o.split("=", 1)[0].strip().startswith("mesh.")]
    if bad:
        raise ShardlmError(f"{bad[0]}: only mesh.* settings can be given when loading a Hugging Face model")
    cfg = load_config(None, [f"model={spec}", f"init.from={spec}", *overrides])
    try:  # tiktoken's gpt2 (a download, if not cached) only when the tokenizer is needed
        tokenizer = load_hf_dir_tokenizer(hf_dir(spec), tiktoken=require_tokenizer)
    except ShardlmError:
        if require_tokenizer:
            raise
        tokenizer = None  # a model without its tokenizer still computes logits of token ids
    if tokenizer is not None and tokenizer.vocab_size > cfg.model.vocab_size:
        raise ShardlmError(f"hf:{hf_dir(spec)}: its tokenizer has {tokenizer.vocab_size} tokens but config.json's "
                           f"vocab_size is {cfg.model.vocab_size}")
    mesh = mesh_from_config(cfg.mesh, devices)
    graphdef, state = import_params(spec, cfg, mesh, cfg.model.vocab_size)
    return LoadedModel(cfg, mesh, graphdef, state, tokenizer, 0)


def with_checkpoint_defaults(cfg):
    """`cfg` for a run that starts from the checkpoint in `init.from`: the model's vocabulary the checkpoint's
    (when `model.vocab_size` is 0, as in the built-in presets), and `data.tokenizer=auto` the checkpoint's
    tokenizer: its tokenizer.json (`bpe:DIR/tokenizer.json`), or tiktoken's gpt2 for a GPT-2 checkpoint of GPT-2's
    vocabulary. A prepared data directory keeps its own tokenizer if it is that one (gpt2; or the same file,
    checked when it is opened). A resumed run's config has both set already, and reads nothing here."""
    import dataclasses

    from shardlm.data.prepare import META_FILE
    from shardlm.data.tokenizer import TOKENIZER_FILE
    from shardlm.hf.config import read_hf_config

    if not is_hf(cfg.init.from_) or (cfg.model.vocab_size and cfg.data.tokenizer != "auto"):
        return cfg
    directory = hf_dir(cfg.init.from_).resolve()
    model = cfg.model
    if not model.vocab_size:
        model = dataclasses.replace(model, vocab_size=int(read_hf_config(directory).get("vocab_size") or 0))
    tokenizer = cfg.data.tokenizer
    if tokenizer == "auto":
        prepared = Path(cfg.data.path) / META_FILE
        gpt2 = model.family == "gpt" and model.vocab_size == 50257
        if prepared.is_file() and gpt2 and json.loads(prepared.read_text()).get("tokenizer") == "gpt2":
            tokenizer = "gpt2"
        elif (directory / TOKENIZER_FILE).is_file():
            tokenizer = f"bpe:{directory / TOKENIZER_FILE}"
        elif gpt2:
            tokenizer = "gpt2"
        else:
            raise ShardlmError(f"init.from=hf:{directory} holds no {TOKENIZER_FILE} to tokenize the data with; save "
                               "the tokenizer there (tokenizer.save_pretrained), or set data.tokenizer")
    return dataclasses.replace(cfg, model=model, data=dataclasses.replace(cfg.data, tokenizer=tokenizer))
