"""Reading a Hugging Face checkpoint's safetensors straight into sharded arrays: the parameters of a model whose
abstract state (shapes, dtypes and target shardings) the caller gives.

Every parameter is assembled from its shards: for each device this process holds, the device's block of the right
safetensors tensor is read through its view (`shardlm.hf.weights`), cast to the parameter dtype and put on that
device before the next block is read (`jax.make_array_from_single_device_arrays`), so beyond what the devices
hold the host needs one shard at a time, and the model is never whole in one place. Every tensor is checked
against the checkpoint before the first byte is read (keys, shapes), so nothing trains on a half-loaded model.

This module knows nothing of runs or training: `shardlm.train.init_from` (a run's `init.from=hf:DIR`) and
`shardlm.load` (readers of `hf:DIR`) build the abstract model and call `read_params`.
"""

from __future__ import annotations

import time
from pathlib import Path

import jax
import numpy as np
from flax import nnx

from shardlm.errors import ShardlmError
from shardlm.hf.config import read_hf_config
from shardlm.hf.format import HfFormat
from shardlm.hf.weights import Checkpoint, View, parameter_views, stacked_views
from shardlm.models.config import ModelConfig
from shardlm.trees import path_str


def check_checkpoint(directory: Path, model: ModelConfig, fmt: HfFormat, vocab: int, padded: int) -> None:
    """Raise if the checkpoint in `directory` does not fit `model` in its family's format `fmt` (keys, shapes, what
    the family's mapping refuses: a context beyond Mixtral's sliding window, ...). Reads config.json and the
    files' headers only."""
    _views(directory, model, fmt, vocab, padded)


def _views(directory: Path, model: ModelConfig, fmt: HfFormat, vocab: int, padded: int) -> dict[str, View]:
    tree = read_hf_config(directory)
    fmt.check_import(model, tree, Path(directory))
    return parameter_views(model, fmt, vocab, padded, Checkpoint(directory), tree)


def read_params(directory: Path, model: ModelConfig, fmt: HfFormat, vocab: int, padded: int, abstract, log=None,
                repeats: int = 1):
    """`abstract` (an nnx.State of ShapeDtypeStructs carrying their target shardings) filled with the weights of the
    checkpoint in `directory` (in its family's format `fmt`), each device reading its own shards. `vocab` is the
    real vocabulary, `padded` the model's padded one; `repeats` > 1: stacked blocks held as [repeats, n_layers /
    repeats]."""
    t0 = time.perf_counter()
    leaves, treedef = jax.tree_util.tree_flatten_with_path(nnx.to_pure_dict(abstract))
    views = stacked_views(_views(directory, model, fmt, vocab, padded),  # a scanned model's too
                          [path_str(path) for path, _ in leaves], repeats)
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
    return state


def _assemble(view: View, leaf) -> jax.Array:
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
