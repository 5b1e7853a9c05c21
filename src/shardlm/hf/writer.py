"""Writing a Hugging Face model directory: safetensors shards, their index, config.json, generation_config.json and
the tokenizer files, atomically.

Design choices:
- Streamed: tensors are added one at a time to the shard being filled; a full shard (above `max_shard_bytes`) is
  written and dropped, so the writer holds one shard, never the model. Shards are named as `save_pretrained`
  names them once their number is known: one `model.safetensors`, or `model-0000i-of-0000n.safetensors` and
  `model.safetensors.index.json`.
- Atomic: everything is written into a hidden sibling of the output directory (`shardlm.atomic`) and renamed into
  place by `finish`; `abort` removes it, so a failure leaves the output directory as it was.
- Several processes may take part (each gathering tensors); only the one constructed with `write=True` touches
  the disk, the others keep the bookkeeping so that every process returns the same summary.
"""

from __future__ import annotations

import json
import os
import shutil
from pathlib import Path

import numpy as np

from shardlm.atomic import partial_sibling, swap_into_place
from shardlm.hf.weights import INDEX_FILE, SAFETENSORS_FILE

DEFAULT_MAX_SHARD_BYTES = 5 * 10**9  # transformers' save_pretrained default, "5GB"


class ModelDirWriter:
    def __init__(self, out: Path, *, max_shard_bytes: float = DEFAULT_MAX_SHARD_BYTES, write: bool = True):
        self.out, self.tmp, self.write, self.max_shard_bytes = Path(out), partial_sibling(Path(out)), write, \
            max_shard_bytes
        self.shards: list[tuple[str | None, list[str]]] = []  # (temporary file name, its tensors)
        self.shard: dict[str, np.ndarray | None] = {}
        self.shard_bytes = self.total = 0
        if write:
            self.out.parent.mkdir(parents=True, exist_ok=True)
            shutil.rmtree(self.tmp, ignore_errors=True)
            self.tmp.mkdir()

    def add(self, name: str, array: np.ndarray) -> None:
        """One tensor (contiguous, in its final dtype), appended to the shard being filled."""
        if self.shard and self.shard_bytes + array.nbytes > self.max_shard_bytes:
            self._flush()
        self.shard[name] = array if self.write else None
        self.shard_bytes += array.nbytes
        self.total += array.nbytes

    def _flush(self) -> None:
        from safetensors.numpy import save_file

        if self.shard and self.write:
            name = f"shard-{len(self.shards):05d}.safetensors"
            save_file(self.shard, str(self.tmp / name), metadata={"format": "pt"})
            self.shards.append((name, list(self.shard)))
        elif self.shard:
            self.shards.append((None, list(self.shard)))
        self.shard, self.shard_bytes = {}, 0

    def finish(self, config: dict, generation_config: dict, extra_files: dict[str, str]) -> int:
        """Write the last shard, the index, the configs and `extra_files` ({name: text}: the tokenizer), then put
        the directory in place. Returns the number of safetensors files."""
        self._flush()
        if not self.write:
            return len(self.shards)
        weight_map: dict[str, str] = {}
        files = self._name_shards(weight_map)
        if len(files) > 1:
            (self.tmp / INDEX_FILE).write_text(json.dumps({"metadata": {"total_size": self.total},
                                                           "weight_map": weight_map}, indent=2) + "\n")
        (self.tmp / "config.json").write_text(json.dumps(config, indent=2) + "\n")
        (self.tmp / "generation_config.json").write_text(json.dumps(generation_config, indent=2) + "\n")
        for name, text in extra_files.items():
            (self.tmp / name).write_text(text, encoding="utf-8")
        mode = 0o666 & ~_umask()  # safetensors writes its files private; give them the others' permissions
        for f in self.tmp.iterdir():
            f.chmod(mode)
        swap_into_place(self.tmp, self.out)
        return len(files)

    def abort(self) -> None:
        if self.write:
            shutil.rmtree(self.tmp, ignore_errors=True)

    def _name_shards(self, weight_map: dict) -> list[str]:
        """Rename the shards as transformers names them, now that their number is known."""
        if len(self.shards) == 1:
            os.rename(self.tmp / self.shards[0][0], self.tmp / SAFETENSORS_FILE)
            return [SAFETENSORS_FILE]
        files = []
        for i, (name, tensors) in enumerate(self.shards, 1):
            final = f"model-{i:05d}-of-{len(self.shards):05d}.safetensors"
            os.rename(self.tmp / name, self.tmp / final)
            weight_map.update({t: final for t in tensors})
            files.append(final)
        return files


def _umask() -> int:
    mask = os.umask(0)
    os.umask(mask)
    return mask
