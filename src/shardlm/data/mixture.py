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
  source's are, then interleaved by `Interleave`, not by Grain's `MapDataset.mix`: Grain turns the weights into
  integers (the smallest scaled to 100, the rest truncated), so its shares drift from the weights without bound
  ([1, 1.0099] mixes 0.5/0.5: about 500 windows off in 200,000).
- `Interleave` splits the sources in two groups, each group in two again, down to single sources (a binary tree),
  and gives each split's windows to its first group by a Sturmian (Beatty) sequence: of a group's first m windows,
  floor(m q + 1/2) go to the first subgroup, q its share of the group's weight, in exact integer arithmetic from
  the float weights. At every prefix of the stream a two-way split is within half a window of its share, so a
  source is within 1/2 (1 + q_1 + q_1 q_2 + ...) windows of its weight's share, the q_i its share of each group
  above it: under one window for up to four sources whatever the weights (two levels: 1/2 + q/2 < 1). For more,
  of every tree the one with the smallest such bound is taken (`worst_deviation` says it; below one window for
  most weights). The sequential rules that keep every prefix within a window for any weights of any number of
  sources (Tijdeman's) cannot be entered at window j without replaying the stream, and random access is what the
  rest of the design stands on; a smooth weighted round-robin is sequential too, and strays past a window as
  well (1.2 windows for some weights of seven sources).
- The interleave is random access: window j of the stream (its source and its index in that source's stream) is
  a few integer operations per tree level, and so is each source's count of the first n windows (`counts`). So
  window j is a pure function of (seed, j) as for one source, and everything built on that holds unchanged: the
  position is one number, each process reads only its rows, a resumed run sees exactly the uninterrupted run's
  batches, and a source's epochs are counted without reading the stream.
- Every stream is `ENDLESS` windows long (one source's repeated for that many windows' worth of epochs), not
  Grain's `sys.maxsize`: Grain computes a batched length in floating point, and a batch of one row of a
  `sys.maxsize` stream overflowed an index (`train.batch_size=1`, or a process holding one row).
- A source too small for its share repeats with a new shuffle (its epochs are counted from the stream's indices,
  `epochs_seen`), as one source does.
- Evaluation: each source's validation split on its own (loss and bits per byte per source); the mixture's eval
  loss is their weighted mean, the loss the training mixture's next window is expected to have.
"""

from __future__ import annotations

import dataclasses
import functools
import itertools
import math
from fractions import Fraction
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


# The length of every stream (Grain's MapDatasets have a length); far beyond any run, and its batched length
# (computed by Grain in floating point) still fits an index.
ENDLESS = 2**62


def shuffled_windows(source, seed: int, shuffle: bool) -> grain.MapDataset:
    """Windows of one source (a random-access source of windows), shuffled from `seed` and repeated, each epoch
    reshuffled, for `ENDLESS` windows: window j of its stream."""
    windows = grain.MapDataset.source(source)
    if shuffle:
        windows = windows.shuffle(seed=seed)
    return windows.repeat(max(1, ENDLESS // max(1, len(source))))


class Interleave:
    """The interleave of a stream mixed by `weights` (floats >= 0, not all 0; a source of weight 0 gives nothing):
    `self[j]` = (source, index in that source's stream) of window j, `counts(n)` = each source's windows among the
    first n. A binary tree over the sources whose splits are Sturmian sequences (see the module docstring)."""

    def __init__(self, weights: list[float]):
        self.n_sources = len(weights)
        self.tree = _tree_for(tuple(float(w) for w in weights))

    def __getitem__(self, j: int) -> tuple[int, int]:
        node = self.tree
        while isinstance(node, _Split):
            before, after = node.first_count(j), node.first_count(j + 1)
            node, j = (node.first, before) if after > before else (node.second, j - before)
        return node.source, j

    def counts(self, n: int) -> list[int]:
        out = [0] * self.n_sources
        pending = [(self.tree, n)]
        while pending:
            node, m = pending.pop()
            if isinstance(node, _Split):
                first = node.first_count(m)
                pending += [(node.first, first), (node.second, m - first)]
            else:
                out[node.source] = m
        return out

    def worst_deviation(self) -> float:
        """The most any source's count of any prefix can differ from its share of it, in windows (the tree's
        bound: see the module docstring)."""
        return _bound(self.tree)


@dataclasses.dataclass(frozen=True)
class _Leaf:
    source: int
    weight: int  # exact, on a common scale
    share: float  # of the whole stream


@dataclasses.dataclass(frozen=True)
class _Split:
    first: "_Leaf | _Split"
    second: "_Leaf | _Split"
    weight: int
    share: float

    def first_count(self, m: int) -> int:
        """How many of this group's first m windows go to `first`: floor(m q + 1/2), q = first's share of the
        group, in integers."""
        return (2 * m * self.first.weight + self.weight) // (2 * self.weight)


def _integer_weights(weights: list[float]) -> list[int]:
    """The float weights as integers in the same exact ratios (a float is a dyadic fraction)."""
    fractions = [Fraction(w) for w in weights]
    scale = math.lcm(*(f.denominator for f in fractions))
    return [int(f * scale) for f in fractions]


def _join(a, b) -> _Split:
    return _Split(a, b, a.weight + b.weight, a.share + b.share)


def _trees(leaves: list[_Leaf]):
    """Every binary tree over `leaves` (the first leaf always in the first group, so each tree comes once)."""
    if len(leaves) == 1:
        yield leaves[0]
        return
    first, rest = leaves[0], leaves[1:]
    for size in range(len(rest)):
        for chosen in itertools.combinations(range(len(rest)), size):
            group = [first] + [rest[i] for i in chosen]
            others = [leaf for i, leaf in enumerate(rest) if i not in chosen]
            for a in _trees(group):
                for b in _trees(others):
                    yield _join(a, b)


def _balanced(leaves: list[_Leaf]):
    """A tree of groups of near-equal weight (each source, heaviest first, to the lighter group)."""
    if len(leaves) == 1:
        return leaves[0]
    groups: tuple[list, list] = ([], [])
    for leaf in sorted(leaves, key=lambda x: -x.share):
        min(groups, key=lambda g: sum(x.share for x in g)).append(leaf)
    return _join(_balanced(groups[0]), _balanced(groups[1]))


def _huffman(leaves: list[_Leaf]):
    """Huffman's tree: the two lightest joined, again and again."""
    nodes = sorted(leaves, key=lambda x: x.share)
    while len(nodes) > 1:
        a, b = nodes.pop(0), nodes.pop(0)
        nodes.append(_join(a, b))
        nodes.sort(key=lambda x: x.share)
    return nodes[0]


def _bound(tree) -> float:
    """max over sources of 1/2 sum of its share of each group it is in, below the root (itself included)."""
    worst, pending = 0.0, [(tree, ())]
    while pending:
        node, groups = pending.pop()
        if isinstance(node, _Split):
            inner = groups if node is tree else (*groups, node.share)
            pending += [(node.first, inner), (node.second, inner)]
        else:
            worst = max(worst, 0.5 * sum(node.share / g for g in (node.share, *groups)) if node is not tree else 0.0)
    return worst


@functools.lru_cache(maxsize=64)
def _tree_for(weights: tuple[float, ...]):
    """The interleave's tree for `weights` (built once per set of weights: the search takes up to a few tenths of
    a second)."""
    active = [i for i, w in enumerate(weights) if w > 0]
    if not active:
        raise ValueError("an interleave needs a weight above 0")
    total = sum(weights[i] for i in active)
    exact = _integer_weights([weights[i] for i in active])
    return _best_tree([(i, e, weights[i] / total) for i, e in zip(active, exact)])


_EXHAUSTIVE_UP_TO = 7  # sources: 10,395 trees, a few tenths of a second


def _best_tree(sources: list[tuple[int, int, float]]):
    """Of the trees over `sources` ((index, exact weight, share)), the one with the smallest bound: every tree for
    up to `_EXHAUSTIVE_UP_TO` sources, else the better of a balanced tree and Huffman's. The first found wins a
    tie, so the tree is a pure function of the weights."""
    leaves = [_Leaf(i, w, s) for i, w, s in sources]
    candidates = _trees(leaves) if len(leaves) <= _EXHAUSTIVE_UP_TO else iter((_balanced(leaves), _huffman(leaves)))
    best, best_bound = None, math.inf
    for tree in candidates:
        bound = _bound(tree)
        if bound < best_bound:
            best, best_bound = tree, bound
    return best


def mixed(streams: list[grain.MapDataset], weights: list[float]) -> grain.MapDataset:
    """The streams interleaved by `weights` (`Interleave`); a single stream as it is, so that one source reads
    exactly as before mixtures existed."""
    if len(streams) == 1:
        return streams[0]
    interleave = Interleave(weights)

    def window(j: int):
        i, m = interleave[j]
        return streams[i][m]

    return grain.MapDataset.range(ENDLESS).map(window)


def scheduled(streams: list[grain.MapDataset], schedule: list[tuple[int, list[float]]]) -> grain.MapDataset:
    """The streams mixed by weights that change along the stream (annealing): `schedule` is [(first window,
    weights per stream)], the first at window 0. From each change on the windows follow the new weights, and
    each source continues its own stream where the earlier segments left it (no window repeated or skipped before
    its epoch ends). One segment is `mixed` itself, so a run whose weights never changed reads as before."""
    if len(schedule) == 1:
        weights = schedule[0][1]
        active = [i for i, w in enumerate(weights) if w > 0]
        return mixed([streams[i] for i in active], [weights[i] for i in active])
    segments = []  # (first window, interleave, each stream's windows read before it)
    read = [0] * len(streams)
    for k, (start, weights) in enumerate(schedule):
        interleave = Interleave(weights)
        segments.append((start, interleave, list(read)))
        if k + 1 < len(schedule):
            read = [a + b for a, b in zip(read, interleave.counts(schedule[k + 1][0] - start))]
    starts = [start for start, _, _ in segments]

    def window(j: int):
        k = int(np.searchsorted(starts, j, side="right")) - 1
        start, interleave, before = segments[k]
        i, m = interleave[j - start]
        return streams[i][before[i] + m]

    return grain.MapDataset.range(ENDLESS).map(window)


def windows_per_source(schedule: list[tuple[int, list[float]]], n_windows: int) -> list[int]:
    """How many of the stream's first `n_windows` windows each source gives, under a `schedule` of weights
    ([(first window, weights)]; fixed weights are [(0, weights)])."""
    counts = [0] * len(schedule[0][1])
    for k, (start, w) in enumerate(schedule):
        if start >= n_windows:
            break
        end = min(n_windows, schedule[k + 1][0]) if k + 1 < len(schedule) else n_windows
        counts = [a + b for a, b in zip(counts, Interleave(w).counts(end - start))]
    return counts
