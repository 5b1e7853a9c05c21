"""Hugging Face safetensors <-> shardlm parameters, generically: a checkpoint on disk, read slice by slice, and every
tensor a family's mapping names checked against it.

Import: each shardlm parameter is a view of a Hugging Face tensor (`shardlm.hf.views`), built by the family's
mapping (`HfFormat.views`). A view answers `view[index]` for the index of one device's shard by reading just the
block of the file that shard needs (safetensors slices are memory-mapped reads), so `jax.make_array_from_callback`
assembles every parameter straight into its sharding: each process reads only what its devices hold, and the
whole model never sits in one host's memory or on one device.

Export goes the other way on whole tensors, one at a time (`hf_tensors`): each is gathered from the mesh, turned
into Hugging Face's layout by the family's mapping and handed over before the next is made, so a host holds one
tensor (and the output shard being filled), never the whole model.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.hf.format import HfFormat
from shardlm.hf.views import Stacked, Tensor, View
from shardlm.models.stack import split_layer_path

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that are not parameters (old GPT-2 attention masks, old Llama rotary tables).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


def stacked_views(views: dict[str, View], wanted, repeats: int = 1) -> dict[str, View]:
    """`views` (per-layer paths) with the per-layer views of every stacked parameter in `wanted` (paths such as
    'blocks/attn/wq') replaced by one `Stacked` view in layer order: [n_layers, ...], or with `repeats` > 1
    [repeats, n_layers / repeats, ...] (a stack of stacks)."""
    out = dict(views)
    for path in wanted:
        if path in out:
            continue
        layers = sorted((hit[0], p) for p in views if (hit := split_layer_path(p)) and hit[1] == path)
        if layers:
            per_layer = [out.pop(p) for _, p in layers]
            per = len(per_layer) // repeats
            out[path] = (Stacked(tuple(per_layer)) if repeats <= 1 else
                         Stacked(tuple(Stacked(tuple(per_layer[r * per:(r + 1) * per])) for r in range(repeats))))
    return out


# --- a checkpoint on disk ----------------------------------------------------------------------------------------

class Checkpoint:
    """The safetensors file(s) of a Hugging Face model directory: one `model.safetensors`, or the shards that
    `model.safetensors.index.json` lists. Files are opened once and read by slices (memory-mapped)."""

    def __init__(self, directory: Path):
        from safetensors import safe_open

        self.directory = Path(directory)
        index = self.directory / INDEX_FILE
        if index.is_file():
            try:
                weight_map = json.loads(index.read_text())["weight_map"]
            except (json.JSONDecodeError, KeyError, TypeError) as e:
                raise ShardlmError(f"{index} is not a safetensors index (no weight_map: {e})") from None
            files = sorted(set(weight_map.values()))
        elif (self.directory / SAFETENSORS_FILE).is_file():
            files, weight_map = [SAFETENSORS_FILE], None
        else:
            bins = [p.name for p in self.directory.glob("*.bin")]
            raise ShardlmError(f"hf:{self.directory} holds no {SAFETENSORS_FILE} or {INDEX_FILE}"
                               + (f" (only PyTorch pickles: {', '.join(bins[:2])}; save it again with "
                                  "safe_serialization=True)" if bins else ""))
        self.handles = {}
        for name in files:
            try:
                self.handles[name] = safe_open(str(self.directory / name), framework="np")
            except Exception as e:  # noqa: BLE001 - a missing or damaged file
                raise ShardlmError(f"{self.directory / name} cannot be read as safetensors ({e})") from None
        self.file_of = weight_map or {k: files[0] for k in self.handles[files[0]].keys()}
        missing_files = {f for f in self.file_of.values() if f not in self.handles}
        if missing_files:
            raise ShardlmError(f"{index} lists {sorted(missing_files)[0]}, which is not in {self.directory}")

    def names(self) -> set[str]:
        return set(self.file_of)

    def shape(self, name: str) -> tuple[int, ...]:
        return tuple(self.handles[self.file_of[name]].get_slice(name).get_shape())

    def read(self, name: str, index: tuple) -> np.ndarray:
        return self.handles[self.file_of[name]].get_slice(name)[index]


def parameter_views(m, fmt: HfFormat, vocab: int, padded: int, ckpt: Checkpoint, config: dict) -> dict[str, View]:
    """{shardlm parameter path ('blocks/0/attn/wq'): view} for the model config `m` in the family's format `fmt`
    (the checkpoint's config.json `config` saying how its tensors are laid out),
    every tensor checked against the checkpoint: a missing or unused key, or a shape that differs, is a one-line
    error naming it."""
    names = ckpt.names()
    tensors: dict[str, Tensor] = {}

    def T(name, shape):
        if name not in tensors:
            tensors[name] = Tensor(name, shape, ckpt.read)
        return tensors[name]

    views = fmt.views(m, vocab, padded, T, names, config)
    _check_shapes(m, tensors, ckpt)
    tied_copy = {"lm_head.weight"} if m.tie_embeddings else set()  # a tied head saved twice: the table's copy
    extra = sorted(n for n in names - set(tensors) - tied_copy if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ShardlmError(f"hf:{ckpt.directory} has {len(extra)} tensor(s) a {m.family} model does not use, e.g. "
                           f"{extra[0]!r}; the checkpoint is not a plain {m.family} model")
    return views


def _check_shapes(m, tensors: dict[str, Tensor], ckpt: Checkpoint) -> None:
    """Every tensor the mapping named is in the checkpoint with the shape the model needs."""
    names, where = ckpt.names(), ckpt.directory
    for name, t in tensors.items():
        if name not in names:
            raise ShardlmError(f"hf:{where} has no tensor {name!r}, which a {m.family} model with these settings "
                               "needs; the checkpoint does not match its config.json")
        actual = ckpt.shape(name)
        if t.shape is None:  # GPT-2's position table: any number of rows at least the context
            t.shape = actual
            if len(actual) != 2 or actual[1] != m.d_model or actual[0] < m.seq_len:
                raise ShardlmError(f"hf:{where}: {name} has shape {list(actual)}; model.seq_len={m.seq_len} needs "
                                   f"at least {m.seq_len} positions of {m.d_model}: lower model.seq_len")
        elif actual != t.shape:
            raise ShardlmError(f"hf:{where}: {name} has shape {list(actual)}, but the model needs {list(t.shape)}; "
                               "the checkpoint does not match its config.json (or a model.* override)")


# --- export: shardlm parameters as Hugging Face tensors ----------------------------------------------------------

def hf_tensors(m, fmt: HfFormat, vocab: int, get: Callable[..., np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of the Hugging Face model in the family's format `fmt`, in order, made one at
    a time from whole shardlm parameters `get(path)` (`get(path, e)`: expert e's slice of an experts parameter, so
    that one expert's tensor is gathered at a time): the pad rows dropped, a tied head written once (as the
    embedding)."""
    fmt.exportable(m, "the model")
    yield from fmt.tensors(m, vocab, get)
