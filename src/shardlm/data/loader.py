"""Grain pipeline from a 1-D token array to sharded global batches.

Design choices:
- The token stream is cut into non-overlapping windows of seq_len + 1 tokens (inputs and shifted targets).
- Grain's `MapDataset` gives random access to the shuffled, repeated stream of windows (reshuffled each epoch):
  batch i is windows [i * batch_size, (i + 1) * batch_size), a pure function of (seed, i). That makes runs
  reproducible and resumption exact without saving iterator state.
- Each process materialises only its own rows of the global batch and `jax.make_array_from_process_local_data`
  assembles the global array, so the same code runs on one host or many.
"""

import grain
import jax
import numpy as np

from shardlm.errors import ShardlmError


class TokenWindows:
    """Random-access source: window i is tokens[i*seq_len : i*seq_len + seq_len + 1]."""

    def __init__(self, tokens: np.ndarray, seq_len: int):
        self.tokens = tokens
        self.seq_len = seq_len

    def __len__(self) -> int:
        return max(0, (len(self.tokens) - 1) // self.seq_len)

    def __getitem__(self, i: int) -> np.ndarray:
        start = i * self.seq_len
        return self.tokens[start : start + self.seq_len + 1]


class BatchLoader:
    """Global batches of shape [batch_size, seq_len + 1]; `get(i)` returns batch i as a sharded jax.Array."""

    def __init__(self, tokens: np.ndarray, seq_len: int, batch_size: int, sharding, *, seed: int, shuffle: bool,
                 name: str = "training", hint: str = "use more text"):
        source = TokenWindows(np.asarray(tokens, np.int32), seq_len)
        if len(source) < batch_size:
            raise ShardlmError(
                f"the {name} split holds {len(source)} windows of {seq_len + 1} tokens, fewer than one batch of "
                f"{batch_size}; {hint}, or use a smaller train.batch_size or model.seq_len"
            )
        ds = grain.MapDataset.source(source)
        if shuffle:
            ds = ds.shuffle(seed=seed)  # reshuffled each epoch by repeat()
        self.windows_per_epoch = len(source)
        # Window j of the run's stream; batch i is windows [i * batch_size, (i + 1) * batch_size).
        self.windows = ds.repeat()
        self.sharding = sharding
        self.batch_size = batch_size
        # The rows of the global batch this process reads (all of them on a single host).
        n_proc, pid = jax.process_count(), jax.process_index()
        per_proc = batch_size // n_proc
        self.rows = range(pid * per_proc, (pid + 1) * per_proc)

    def get(self, index: int) -> jax.Array:
        local = np.stack([self.windows[index * self.batch_size + r] for r in self.rows])
        return jax.make_array_from_process_local_data(self.sharding, local, (self.batch_size, local.shape[1]))
