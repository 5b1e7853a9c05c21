"""Hugging Face safetensors <-> shardlm parameters: which tensor is which, in which layout, read slice by slice.

Import: each shardlm parameter is a *view* of a Hugging Face tensor (`Tensor`), composed of a few index maps: a
transpose (torch's Linear stores [out, in], shardlm [in, out]), a split of one dimension into (heads, head_dim),
a window (GPT-2's fused q/k/v `c_attn` holds three parameters side by side; a context shorter than `n_positions`
keeps the first rows of `wpe`), zero padding (the vocabulary is padded for sharding), and a stack of per-layer or
per-expert tensors on a new leading axis (Mixtral's experts, one tensor each in its checkpoints). A view answers
`view[index]` for the index of one device's shard by reading just the block of the file that shard needs
(safetensors slices are memory-mapped reads), so `jax.make_array_from_callback` assembles every parameter
straight into its sharding: each process reads only what its devices hold, and the whole model never sits in one
host's memory or on one device.

Export goes the other way on whole tensors, one at a time (`hf_tensors`): each is gathered from the mesh, turned
into Hugging Face's layout and handed over before the next is made, so a host holds one tensor (and the output
shard being filled), never the whole model.

Rotary embeddings need no permutation: Hugging Face stores Llama's q/k projections for the "rotate half" form,
which is the one shardlm computes (`shardlm.models.layers.apply_rope`).
"""

from __future__ import annotations

import dataclasses
import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.models.stack import split_layer_path

SAFETENSORS_FILE = "model.safetensors"
INDEX_FILE = "model.safetensors.index.json"
# Buffers some checkpoints carry that are not parameters (old GPT-2 attention masks, old Llama rotary tables).
IGNORED_SUFFIXES = (".attn.bias", ".attn.masked_bias", ".rotary_emb.inv_freq")


# --- views: a shardlm parameter as an index map over a Hugging Face tensor ---------------------------------------

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


def stacked_views(views: dict[str, View], wanted, order: tuple[int, ...] | None = None) -> dict[str, View]:
    """`views` (per-layer paths) with the per-layer views of every stacked parameter in `wanted` (paths such as
    'blocks/attn/wq') replaced by one `Stacked` view, whose row p is layer `order[p]` (default: layer p)."""
    out = dict(views)
    for path in wanted:
        if path in out:
            continue
        layers = sorted((hit[0], p) for p in views if (hit := split_layer_path(p)) and hit[1] == path)
        if layers:
            per_layer = [out.pop(p) for _, p in layers]
            out[path] = Stacked(tuple(per_layer[i] for i in (order or range(len(per_layer)))))
    return out


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


# --- which tensor is which -------------------------------------------------------------------------------------

def _gpt2_views(m, vocab: int, padded: int, prefix: str, T) -> dict[str, View]:
    d, h, hd, f = m.d_model, m.n_heads, m.d_model // m.n_heads, m.d_mlp
    views = {"wte": Padded(T(f"{prefix}wte.weight", (vocab, d)), 0, padded),
             "wpe": Window(T(f"{prefix}wpe.weight", None), 0, 0, m.seq_len),
             "ln_f/scale": T(f"{prefix}ln_f.weight", (d,)), "ln_f/bias": T(f"{prefix}ln_f.bias", (d,))}
    for i in range(m.n_layers):
        p, o = f"{prefix}h.{i}.", f"blocks/{i}/"
        qkv, qkv_bias = T(f"{p}attn.c_attn.weight", (d, 3 * d)), T(f"{p}attn.c_attn.bias", (3 * d,))
        for k, name in enumerate(("q", "k", "v")):
            views[f"{o}attn/w{name}"] = Split(Window(qkv, 1, k * d, d), 1, (h, hd))
            views[f"{o}attn/{name}_bias"] = Split(Window(qkv_bias, 0, k * d, d), 0, (h, hd))
        views[f"{o}attn/wo"] = Split(T(f"{p}attn.c_proj.weight", (d, d)), 0, (h, hd))
        views[f"{o}attn/out_bias"] = T(f"{p}attn.c_proj.bias", (d,))
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            views[f"{o}{ours}/scale"] = T(f"{p}{theirs}.weight", (d,))
            views[f"{o}{ours}/bias"] = T(f"{p}{theirs}.bias", (d,))
        views[f"{o}mlp/w_in"] = T(f"{p}mlp.c_fc.weight", (d, f))  # GPT-2's Conv1D stores [in, out], as shardlm
        views[f"{o}mlp/in_bias"] = T(f"{p}mlp.c_fc.bias", (f,))
        views[f"{o}mlp/w_out"] = T(f"{p}mlp.c_proj.weight", (f, d))
        views[f"{o}mlp/out_bias"] = T(f"{p}mlp.c_proj.bias", (d,))
    if not m.tie_embeddings:
        views["lm_head"] = Padded(Transposed(T("lm_head.weight", (vocab, d))), 1, padded)
    return views


def _llama_views(m, vocab: int, padded: int, prefix: str, T, names: set[str] = frozenset()) -> dict[str, View]:
    d, h, f = m.d_model, m.n_heads, m.d_mlp
    hd, kv = d // h, m.n_kv_heads or h
    views = {"wte": Padded(T(f"{prefix}embed_tokens.weight", (vocab, d)), 0, padded),
             "ln_f/scale": T(f"{prefix}norm.weight", (d,))}
    for i in range(m.n_layers):
        p, o = f"{prefix}layers.{i}.", f"blocks/{i}/"
        views[f"{o}attn/wq"] = Split(Transposed(T(f"{p}self_attn.q_proj.weight", (h * hd, d))), 1, (h, hd))
        views[f"{o}attn/wk"] = Split(Transposed(T(f"{p}self_attn.k_proj.weight", (kv * hd, d))), 1, (kv, hd))
        views[f"{o}attn/wv"] = Split(Transposed(T(f"{p}self_attn.v_proj.weight", (kv * hd, d))), 1, (kv, hd))
        views[f"{o}attn/wo"] = Split(Transposed(T(f"{p}self_attn.o_proj.weight", (d, h * hd))), 0, (h, hd))
        views[f"{o}ln1/scale"] = T(f"{p}input_layernorm.weight", (d,))
        views[f"{o}ln2/scale"] = T(f"{p}post_attention_layernorm.weight", (d,))
        if m.moe_experts and (i + 1) % m.moe_every == 0:
            views.update(_mixtral_views(m, p, f"{o}mlp/", T, names))
            continue
        views[f"{o}mlp/w_gate"] = Transposed(T(f"{p}mlp.gate_proj.weight", (f, d)))
        views[f"{o}mlp/w_up"] = Transposed(T(f"{p}mlp.up_proj.weight", (f, d)))
        views[f"{o}mlp/w_down"] = Transposed(T(f"{p}mlp.down_proj.weight", (d, f)))
    if not m.tie_embeddings:
        views["lm_head"] = Padded(Transposed(T("lm_head.weight", (vocab, d))), 1, padded)
    return views


def _mixtral_views(m, p: str, o: str, T, names: set[str]) -> dict[str, View]:
    """One sparse layer's MLP (`shardlm.models.moe.MoeMLP`) from Mixtral's tensors (prefix `p`, 'model.layers.3.'),
    in either layout transformers reads:
    - per expert, as the published checkpoints and transformers' `save_pretrained` write them:
      `block_sparse_moe.gate.weight` [E, d] and `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate and up
      [f, d], down [d, f]), each expert's tensor its own file entry; stacked by a view on the experts axis, so a
      device holding experts 2-3 reads experts 2 and 3 only;
    - fused, as transformers 5 holds them in memory: `mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2f, d]
      (gate rows first, then up) and `mlp.experts.down_proj` [E, d, f].
    (`mlp.` also stands for `block_sparse_moe.` in the first, as transformers renames one to the other.)"""
    d, e, f = m.d_model, m.moe_experts, m.moe_d_ff or m.d_mlp
    moe = f"{p}block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else f"{p}mlp."
    views = {f"{o}router": Transposed(T(f"{moe}gate.weight", (e, d)))}
    if f"{p}mlp.experts.gate_up_proj" in names:
        gate_up = T(f"{p}mlp.experts.gate_up_proj", (e, 2 * f, d))
        views[f"{o}w_gate"] = Transposed(Window(gate_up, 1, 0, f), (0, 2, 1))
        views[f"{o}w_up"] = Transposed(Window(gate_up, 1, f, f), (0, 2, 1))
        views[f"{o}w_down"] = Transposed(T(f"{p}mlp.experts.down_proj", (e, d, f)), (0, 2, 1))
        return views
    for ours, theirs, shape in (("w_gate", "w1", (f, d)), ("w_up", "w3", (f, d)), ("w_down", "w2", (d, f))):
        views[f"{o}{ours}"] = Stacked(tuple(Transposed(T(f"{moe}experts.{x}.{theirs}.weight", shape))
                                            for x in range(e)))
    return views


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


def parameter_views(m, vocab: int, padded: int, ckpt: Checkpoint) -> dict[str, View]:
    """{shardlm parameter path ('blocks/0/attn/wq'): view} for the model config `m`, every tensor checked against
    the checkpoint: a missing or unused key, or a shape that differs, is a one-line error naming it."""
    names = ckpt.names()
    if m.family == "gpt":
        if not m.use_bias:
            raise ShardlmError(f"hf:{ckpt.directory} is a GPT-2 checkpoint, whose layers have biases; drop "
                               "model.use_bias=false")
        prefix = "transformer." if "transformer.wte.weight" in names else ""
        build = _gpt2_views
    else:
        if m.moe_experts and m.moe_shared_expert:
            raise ShardlmError(f"hf:{ckpt.directory}: Mixtral checkpoints have no shared expert; drop "
                               "model.moe_shared_expert=true")
        prefix = "model."

        def build(*args):
            return _llama_views(*args, names)
    tensors: dict[str, Tensor] = {}

    def T(name, shape):
        if name not in tensors:
            tensors[name] = Tensor(name, shape, ckpt.read)
        return tensors[name]

    views = build(m, vocab, padded, prefix, T)
    where = ckpt.directory
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
    tied_copy = {"lm_head.weight"} if m.tie_embeddings else set()  # a tied head saved twice: the table's copy
    extra = sorted(n for n in names - set(tensors) - tied_copy if not n.endswith(IGNORED_SUFFIXES))
    if extra:
        raise ShardlmError(f"hf:{where} has {len(extra)} tensor(s) a {m.family} model does not use, e.g. "
                           f"{extra[0]!r}; the checkpoint is not a plain {m.family} model")
    return views


# --- export: shardlm parameters as Hugging Face tensors ----------------------------------------------------------

def hf_tensors(m, vocab: int, get: Callable[..., np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """(name, array) for every tensor of the Hugging Face model, in order, made one at a time from whole shardlm
    parameters `get(path)` (`get(path, e)`: expert e's slice of an experts parameter, so that one expert's
    tensor is gathered at a time): the pad rows dropped, a tied head written once (as the embedding). A mixture
    of experts is written as Mixtral's per-expert tensors (`hf_config` refuses what Mixtral cannot hold)."""
    d = m.d_model
    if m.family == "gpt":
        yield "transformer.wte.weight", get("wte")[:vocab]
        yield "transformer.wpe.weight", get("wpe")
        for i in range(m.n_layers):
            p, o = f"transformer.h.{i}.", f"blocks/{i}/"
            for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
                yield f"{p}{theirs}.weight", get(f"{o}{ours}/scale")
                yield f"{p}{theirs}.bias", get(f"{o}{ours}/bias")
            yield f"{p}attn.c_attn.weight", np.concatenate([get(f"{o}attn/w{x}").reshape(d, d) for x in "qkv"], 1)
            yield f"{p}attn.c_attn.bias", np.concatenate([get(f"{o}attn/{x}_bias").reshape(d) for x in "qkv"])
            yield f"{p}attn.c_proj.weight", get(f"{o}attn/wo").reshape(d, d)
            yield f"{p}attn.c_proj.bias", get(f"{o}attn/out_bias")
            yield f"{p}mlp.c_fc.weight", get(f"{o}mlp/w_in")
            yield f"{p}mlp.c_fc.bias", get(f"{o}mlp/in_bias")
            yield f"{p}mlp.c_proj.weight", get(f"{o}mlp/w_out")
            yield f"{p}mlp.c_proj.bias", get(f"{o}mlp/out_bias")
        yield "transformer.ln_f.weight", get("ln_f/scale")
        yield "transformer.ln_f.bias", get("ln_f/bias")
    else:
        yield "model.embed_tokens.weight", get("wte")[:vocab]
        for i in range(m.n_layers):
            p, o = f"model.layers.{i}.", f"blocks/{i}/"
            yield f"{p}input_layernorm.weight", get(f"{o}ln1/scale")
            yield f"{p}post_attention_layernorm.weight", get(f"{o}ln2/scale")
            for x in "qkv":
                w = get(f"{o}attn/w{x}")  # [d, heads, head_dim]
                yield f"{p}self_attn.{x}_proj.weight", w.reshape(d, -1).T
            yield f"{p}self_attn.o_proj.weight", get(f"{o}attn/wo").reshape(d, d).T
            if m.moe_experts:  # Mixtral (every layer sparse), per expert as save_pretrained writes it
                moe = f"{p}block_sparse_moe."
                yield f"{moe}gate.weight", get(f"{o}mlp/router").T
                for e in range(m.moe_experts):  # one expert at a time
                    yield f"{moe}experts.{e}.w1.weight", get(f"{o}mlp/w_gate", e).T
                    yield f"{moe}experts.{e}.w2.weight", get(f"{o}mlp/w_down", e).T
                    yield f"{moe}experts.{e}.w3.weight", get(f"{o}mlp/w_up", e).T
                continue
            yield f"{p}mlp.gate_proj.weight", get(f"{o}mlp/w_gate").T
            yield f"{p}mlp.up_proj.weight", get(f"{o}mlp/w_up").T
            yield f"{p}mlp.down_proj.weight", get(f"{o}mlp/w_down").T
        yield "model.norm.weight", get("ln_f/scale")
    if not m.tie_embeddings:
        yield "lm_head.weight", get("lm_head")[:, :vocab].T
