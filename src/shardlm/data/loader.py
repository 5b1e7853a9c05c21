"""Grain pipeline from a (memory-mapped) token array to sharded global batches.

Design choices:
- The token stream is cut into windows of seq_len + 1 tokens (inputs and shifted targets) that start every seq_len
  tokens. Documents are packed back to back with `<|endoftext|>` between them (see `prepare`): no padding, no
  token wasted.
- Window order is a Grain `MapDataset`: a global shuffle from the seed (Grain's index shuffle: O(1) memory, random
  access), reshuffled each epoch by `repeat()`. Window j of the run's stream is a pure function of (seed, j), so
  the global batch sequence does not depend on the number of processes.
- Sharding by JAX process (the idea of Grain's `ShardByJaxProcess`): a process reads only the rows of each
  global batch that its devices hold under the batch sharding (`process_rows`; rows [p*B/P, (p+1)*B/P) for
  process p on a process-major mesh). In Grain terms the stream is grouped into blocks of that many windows and
  the process takes every (B/rows)-th block from its own; `jax.make_array_from_process_local_data` then
  assembles the global `jax.Array`.
- The iterator is a Grain `DatasetIterator` with background prefetch threads. Its position is one number, the
  index of the next global batch (`position`, `seek`): the same in every process and for any process count,
  since batch i is a pure function of (seed, i). A checkpoint stores that number, so a run saved by 2 processes
  resumes on 1 or 4 at exactly the next batch, and a resumed run sees exactly the batches the uninterrupted run
  would have. `get(i)` reads batch i directly (eval uses the first few batches of the unshuffled validation
  split).
"""

import grain
import jax
import numpy as np

from shardlm.data.mixture import scheduled, shuffled_windows
from shardlm.errors import ShardlmError


class TokenWindows:
    """Random-access source: window i is tokens[i*seq_len : i*seq_len + seq_len + 1], as int32."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return np.asarray(self.tokens[start : start + self.seq_len + 1], np.int32)


class BatchIterator:
    """Yields global batches as sharded jax.Arrays; its state is Grain's (a JSON-able dict)."""

    def __init__(self, loader: "BatchLoader", prefetch: int):
        options = grain.ReadOptions(num_threads=2 if prefetch else 0, prefetch_buffer_size=prefetch)
        self.loader = loader
        self._it = loader.local.to_iter_dataset(options).__iter__()

    def __iter__(self):
        return self

    def __next__(self) -> jax.Array:
        return self.loader.to_global(next(self._it))

    @property
    def position(self) -> int:
        """The index of the next global batch this iterator yields."""
        return int(self._it.get_state()["next_index"])

    def seek(self, position: int) -> None:
        """Continue at global batch `position` (a checkpoint's `position`)."""
        self._it.set_state({**self._it.get_state(), "next_index": int(position)})

    def get_state(self) -> dict:
        return self._it.get_state()

    def set_state(self, state: dict) -> None:
        self._it.set_state(state)


def process_rows(sharding, batch_size: int, row_len: int) -> range:
    """The rows of a [batch_size, row_len] global batch that this process's devices hold (a contiguous range)."""
    held = set()
    for index in sharding.addressable_devices_indices_map((batch_size, row_len)).values():
        held.update(range(*index[0].indices(batch_size)))
    rows = range(min(held), max(held) + 1)
    if len(held) != len(rows) or batch_size % len(rows) or rows.start % len(rows):
        raise ShardlmError(f"this process holds rows {sorted(held)[:4]}... of the global batch, not one aligned "
                           "block; order the mesh devices by process (jax.make_mesh does)")
    return rows


class BatchLoader:
    """Global batches of shape [batch_size, seq_len + 1], as jax.Arrays with `sharding`. `rows` (default: from the
    sharding) are the rows of each global batch this process reads. `tokens` is one source's token array, or a
    mixture's: a list of arrays with their `weights` (`shardlm.data.mixture`), each source shuffled from its own
    seed (seed + its index) and repeated, the streams interleaved by the weights; or by a `schedule` of weights
    that change along the stream ([(first window, weights)], `mixture.scheduled`)."""

    def __init__(self, tokens: np.ndarray | list[np.ndarray], seq_len: int, batch_size: int, sharding, *, seed: int,
                 shuffle: bool, name: str = "training", hint: str = "use more text", rows: range | None = None,
                 weights: list[float] | None = None, names: list[str] | None = None,
                 schedule: list[tuple[int, list[float]]] | None = None):
        parts = tokens if isinstance(tokens, list) else [tokens]
        sources = [TokenWindows(t, seq_len) for t in parts]
        schedule = schedule or [(0, weights or [1.0] * len(sources))]
        if len(sources) == 1 and len(sources[0]) < batch_size:
            raise ShardlmError(
                f"the {name} split holds {len(sources[0])} windows of {seq_len + 1} tokens, fewer than one batch of "
                f"{batch_size}; {hint}, or use a smaller train.batch_size or model.seq_len"
            )
        for i, (source, label) in enumerate(zip(sources, names or [])):
            if len(source) == 0 and any(w[i] > 0 for _, w in schedule):
                raise ShardlmError(f"source {label}'s {name} split holds no window of {seq_len + 1} tokens; give it "
                                   "more text, or a weight of 0")
        rows = process_rows(sharding, batch_size, seq_len + 1) if rows is None else rows
        self.windows_per_epoch = len(sources[0])
        self.windows_per_source_epoch = [len(s) for s in sources]
        # window j of the run's stream
        self.windows = scheduled([shuffled_windows(s, seed + i, shuffle) if len(s) else None  # never read: weight 0
                                  for i, s in enumerate(sources)], schedule)
        # Batch i of this process = its rows of global batch i = stream windows [i*B + rows.start, i*B + rows.stop).
        n_blocks = batch_size // len(rows)
        self.local = self.windows.batch(len(rows))[rows.start // len(rows) :: n_blocks]
        self.sharding = sharding
        self.batch_size = batch_size

    def to_global(self, local: np.ndarray) -> jax.Array:
        return jax.make_array_from_process_local_data(self.sharding, local, (self.batch_size, local.shape[1]))

    def get(self, index: int) -> jax.Array:
        return self.to_global(self.local[index])

    def iterator(self, prefetch: int = 4) -> BatchIterator:
        return BatchIterator(self, prefetch)
