"""A shardlm parameter as an index map over a Hugging Face tensor: the views the families' mappings compose.

Design choices:
- Each parameter is a *view* of a Hugging Face tensor (`Tensor`), composed of a few index maps: a transpose
  (torch's Linear stores [out, in], shardlm [in, out]), a split of one dimension into (heads, head_dim), a window
  (GPT-2's fused q/k/v `c_attn` holds three parameters side by side; a context shorter than `n_positions` keeps
  the first rows of `wpe`), zero padding (the vocabulary is padded for sharding), and a stack of per-layer or
  per-expert tensors on a new leading axis.
- A view answers `view[index]` for the index of one device's shard by reading only the block of the file that
  shard needs (safetensors slices are memory-mapped reads).
- numpy only: a family's mapping (`shardlm.hf.gpt2`, `shardlm.hf.llama`) imports this without JAX or Flax.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import numpy as np


def _bounds(index: tuple, shape: tuple[int, ...]) -> list[tuple[int, int]]:
    out = []
    for s, n in zip(tuple(index) + (slice(None),) * (len(shape) - len(index)), shape):
        start, stop, step = s.indices(n)
        if step != 1:
            raise ValueError("shards are contiguous blocks")
        out.append((start, stop))
    return out


def _replace(seq, dim: int, *values, width: int = 1):
    """`seq` (a shape tuple or a bounds list) with its `width` entries from `dim` replaced by `values`."""
    return seq[:dim] + type(seq)(values) + seq[dim + width:]


class View:
    shape: tuple[int, ...]

    def block(self, bounds: list[tuple[int, int]]) -> np.ndarray:
        raise NotImplementedError

    def __getitem__(self, index) -> np.ndarray:
        return self.block(_bounds(index if isinstance(index, tuple) else (index,), self.shape))


@dataclasses.dataclass
class Tensor(View):
    """A Hugging Face tensor, read block by block from its (memory-mapped) safetensors file."""

    name: str
    shape: tuple[int, ...]
    reader: Callable[[str, tuple], np.ndarray] | None = None  # (name, slices) -> array, set by `Checkpoint`

    def block(self, bounds):
        return self.reader(self.name, tuple(slice(a, b) for a, b in bounds))


@dataclasses.dataclass
class Transposed(View):
    """A 2-D tensor's transpose; with `axes`, its dimensions permuted as `np.transpose` would (the last two of
    fused experts [E, out, in] swapped: (0, 2, 1))."""

    inner: View
    axes: tuple[int, ...] | None = None

    def _axes(self):
        return self.axes or tuple(range(len(self.inner.shape)))[::-1]

    @property
    def shape(self):
        return tuple(self.inner.shape[a] for a in self._axes())

    def block(self, bounds):
        axes = self._axes()
        inner = [None] * len(axes)
        for out, a in enumerate(axes):
            inner[a] = bounds[out]
        return self.inner.block(inner).transpose(axes)


@dataclasses.dataclass
class Split(View):
    """Dimension `dim` of `inner` (size a*b) seen as two, (a, b), row-major: (heads, head_dim) from heads*head_dim."""

    inner: View
    dim: int
    parts: tuple[int, int]

    @property
    def shape(self):
        return _replace(self.inner.shape, self.dim, *self.parts)

    def block(self, bounds):
        (a0, a1), (b0, b1) = bounds[self.dim], bounds[self.dim + 1]
        b = self.parts[1]
        outer = _replace(bounds, self.dim, (a0 * b, a1 * b), width=2)
        x = self.inner.block(outer)
        x = x.reshape(_replace(x.shape, self.dim, a1 - a0, b))
        return np.take(x, range(b0, b1), axis=self.dim + 1)


@dataclasses.dataclass
class Window(View):
    """`length` entries of dimension `dim` from `offset`: one of GPT-2's fused q/k/v, or the first positions."""

    inner: View
    dim: int
    offset: int
    length: int

    @property
    def shape(self):
        return _replace(self.inner.shape, self.dim, self.length)

    def block(self, bounds):
        a, b = bounds[self.dim]
        return self.inner.block(_replace(bounds, self.dim, (a + self.offset, b + self.offset)))


@dataclasses.dataclass
class Stacked(View):
    """Per-layer views of one parameter, stacked on a new leading axis: a scanned model's [n_layers, ...] (or a
    layer's experts, [E, ...], from per-expert tensors). A block reads only the rows it spans."""

    layers: tuple[View, ...]

    @property
    def shape(self):
        return (len(self.layers), *self.layers[0].shape)

    def block(self, bounds):
        (a, b), rest = bounds[0], bounds[1:]
        return np.stack([self.layers[i].block(rest) for i in range(a, b)])


@dataclasses.dataclass
class Padded(View):
    """Dimension `dim` extended to `size` with zeros: the padded vocabulary rows, which are masked out of logits."""

    inner: View
    dim: int
    size: int

    @property
    def shape(self):
        return _replace(self.inner.shape, self.dim, self.size)

    def block(self, bounds):
        a, b = bounds[self.dim]
        real = self.inner.shape[self.dim]
        if a >= real:  # a shard of padding only (the caller casts it to the parameter's dtype)
            return np.zeros([hi - lo for lo, hi in bounds], np.float32)
        x = self.inner.block(_replace(bounds, self.dim, (a, min(b, real))))
        if b <= real:
            return x
        pad = [(0, 0)] * x.ndim
        pad[self.dim] = (0, b - real)
        return np.pad(x, pad)


@dataclasses.dataclass
class Permuted(View):
    """Dimension `dim` read in the order `order` (entry i is the inner tensor's entry order[i]): DeepSeek's rotary
    features stored as interleaved pairs, read in the "rotate half" order shardlm rotates. The whole extent of
    `dim` is read for any block of it (a rotary part is a few dozen entries)."""

    inner: View
    dim: int
    order: tuple[int, ...]

    @property
    def shape(self):
        return self.inner.shape

    def block(self, bounds):
        a, b = bounds[self.dim]
        whole = self.inner.block(_replace(bounds, self.dim, (0, self.inner.shape[self.dim])))
        return np.take(whole, np.asarray(self.order[a:b]), axis=self.dim)


@dataclasses.dataclass
class Initialised(View):
    """A tensor the checkpoint does not hold (DeepSeek's multi-token prediction module, which transformers neither
    computes nor saves), as shardlm initialises its kind: `value` everywhere (a norm's ones, a bias's zeros), or
    normal(0, `std`) from `seed` (a matrix)."""

    shape: tuple[int, ...]
    std: float = 0.0
    value: float = 0.0
    seed: int = 0

    def block(self, bounds):
        if not self.std:
            return np.full([b - a for a, b in bounds], self.value, np.float32)
        whole = np.random.default_rng(self.seed).normal(0.0, self.std, self.shape).astype(np.float32)
        return whole[tuple(slice(a, b) for a, b in bounds)]
