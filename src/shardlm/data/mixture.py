"""Data mixtures: several sources, each with a weight, read as one stream of training windows.

    data:
      sources:
        - {name: plays, path: shakespeare, weight: 0.7}
        - {name: notes, path: my_notes.txt, weight: 0.3}

Design choices:
- `data.sources` is a list of {path, weight, name}; `data.path` is the one-source case and stays the default. A
  source's `path` is whatever `data.path` takes (a prepared directory, a text file or folder, the built-in corpus);
  its `name` (default: the path's stem) labels its metrics. A weight of 0 takes a source out of the training
  stream (it is still evaluated: a held-out domain); weights need not sum to 1 (they are normalised).
- The stream: each source's windows shuffled from the seed and repeated (each epoch reshuffled), exactly as one
  source's are, then interleaved by Grain's `MapDataset.mix` with the weights. Grain's mix is deterministic, not
  sampled: of the first k windows of the stream, source i gives its share of k to within one window. So window j
  is a pure function of (seed, j) as for one source, and everything built on that holds unchanged: the position is
  one number, each process reads only its rows, a resumed run sees exactly the uninterrupted run's batches.
- A source too small for its share repeats with a new shuffle (its epochs are counted from the stream's indices,
  `epochs_seen`), as one source does.
- Evaluation: each source's validation split on its own (loss and bits per byte per source); the mixture's eval
  loss is their weighted mean, the loss the training mixture's next window is expected to have.
"""

from __future__ import annotations

import dataclasses
from pathlib import Path

import grain
import numpy as np

from shardlm.errors import ShardlmError


@dataclasses.dataclass(frozen=True)
class Source:
    name: str
    path: str
    weight: float


def parse_sources(raw: list, path: str) -> list[Source]:
    """`data.sources` checked (each entry {path, weight[, name]}, weights >= 0 and not all 0, names unique), or the
    one source `data.path` names when the list is empty."""
    if not raw:
        return [Source(_default_name(path), path, 1.0)]
    if not isinstance(raw, list):
        raise ShardlmError(f"data.sources must be a list of {{path, weight, name}}, got {raw!r}")
    out = []
    for i, entry in enumerate(raw):
        if not isinstance(entry, dict) or not isinstance(entry.get("path"), str) or not entry["path"]:
            raise ShardlmError(f"data.sources[{i}] must be {{path: ..., weight: ...}} with a path, got {entry!r}")
        unknown = set(entry) - {"path", "weight", "name"}
        if unknown:
            raise ShardlmError(f"data.sources[{i}] has unknown keys {sorted(unknown)}; a source takes path, weight "
                               "and name")
        weight = entry.get("weight", 1.0)
        if isinstance(weight, bool) or not isinstance(weight, (int, float)) or not np.isfinite(weight) or weight < 0:
            raise ShardlmError(f"data.sources[{i}] ({entry['path']}) has weight {weight!r}; a weight is a number >= 0 "
                               "(0 removes the source)")
        name = str(entry.get("name") or _default_name(entry["path"]))
        out.append(Source(name, entry["path"], float(weight)))
    names = [s.name for s in out]
    if len(set(names)) != len(names):
        twice = sorted({n for n in names if names.count(n) > 1})
        raise ShardlmError(f"data.sources names {twice} more than one source; give each a distinct name")
    if sum(s.weight for s in out) <= 0:
        raise ShardlmError("data.sources' weights sum to 0, so nothing would be read; give at least one source a "
                           "weight above 0")
    return out


def _default_name(path: str) -> str:
    p = Path(path.rstrip("/"))
    return p.stem or p.name or path


def shuffled_windows(source, seed: int, shuffle: bool) -> grain.MapDataset:
    """Windows of one source (a random-access source of windows), shuffled from `seed` and repeated without end,
    each epoch reshuffled: window j of its stream."""
    windows = grain.MapDataset.source(source)
    if shuffle:
        windows = windows.shuffle(seed=seed)
    return windows.repeat()


def mixed(streams: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    """The streams interleaved by `weights` (Grain's deterministic mix); a single stream as it is, so that one
    source reads exactly as before mixtures existed."""
    if len(streams) == 1:
        return streams[0]
    return grain.MapDataset.mix(streams, weights)


# The length of an endless index stream (Grain's MapDatasets have a length; mixing takes the shortest).
_ENDLESS = 2**62


def _selection(weights: list[float]) -> grain.MapDataset:
    """(source, its window) of each window of a stream mixed by `weights`, sources of weight 0 left out: the same
    interleaving as `mixed`, over index streams, so it reads no tokens."""
    active = [i for i, w in enumerate(weights) if w > 0]
    indices = [grain.MapDataset.range(_ENDLESS).map(lambda m, i=i: (i, m)) for i in active]
    return indices[0] if len(indices) == 1 else grain.MapDataset.mix(indices, [weights[i] for i in active])


def scheduled(streams: list[grain.MapDataset], schedule: list[tuple[int, list[float]]]) -> grain.MapDataset:
    """The streams mixed by weights that change along the stream (annealing): `schedule` is [(first window,
    weights per stream)], the first at window 0. From each change on the windows follow the new weights, and
    each source continues its own stream where the earlier segments left it (no window repeated or skipped before
    its epoch ends). One segment is `mixed` itself, so a run whose weights never changed reads as before."""
    if len(schedule) == 1:
        weights = schedule[0][1]
        active = [i for i, w in enumerate(weights) if w > 0]
        return mixed([streams[i] for i in active], [weights[i] for i in active])
    segments = []  # (first window, selection, each stream's windows read before it)
    read = [0] * len(streams)
    for k, (start, weights) in enumerate(schedule):
        segments.append((start, _selection(weights), list(read)))
        if k + 1 < len(schedule):
            read = [a + b for a, b in zip(read, _counts(weights, schedule[k + 1][0] - start, len(streams)))]
    starts = [start for start, _, _ in segments]

    def window(j: int):
        k = int(np.searchsorted(starts, j, side="right")) - 1
        start, selection, before = segments[k]
        i, m = selection[j - start]
        return streams[i][before[i] + m]

    return grain.MapDataset.range(_ENDLESS).map(window)


def _counts(weights: list[float], n_windows: int, n_streams: int) -> list[int]:
    """How many of the first `n_windows` windows of a stream mixed by `weights` each stream gives: the index in its
    own stream of its first window at or after `n_windows` (a few lookups, about total / weight for the lightest
    source, whatever `n_windows` is)."""
    counts = [0] * n_streams
    selection = _selection(weights)
    pending, j = {i for i, w in enumerate(weights) if w > 0}, n_windows
    while pending:
        i, m = selection[j]
        if i in pending:
            counts[i] = m
            pending.discard(i)
        j += 1
    return counts


def windows_per_source(schedule: list[tuple[int, list[float]]], n_windows: int) -> list[int]:
    """How many of the stream's first `n_windows` windows each source gives, under a `schedule` of weights
    ([(first window, weights)]; fixed weights are [(0, weights)])."""
    counts = [0] * len(schedule[0][1])
    for k, (start, w) in enumerate(schedule):
        if start >= n_windows:
            break
        end = min(n_windows, schedule[k + 1][0]) if k + 1 < len(schedule) else n_windows
        counts = [a + b for a, b in zip(counts, _counts(w, end - start, len(counts)))]
    return counts
