"""A model's blocks, in one of two layouts: one module per layer (`nnx.List`, run by a Python loop), or one module
whose parameters are stacked on a leading `layers` axis (run by `jax.lax.scan`, `model.scan_layers`). Math only.

Design choices:
- Scanning traces and compiles one block instead of n_layers of them, so compile time and program size stay flat
  as a model deepens (`benchmarks/compile_depth.py` measures it), and the stacked parameters are what a pipeline
  splits over its stages.
- Both layouts are built from the same per-layer keys (`jax.random.split` of one key; the stack is an `nnx.vmap`
  over them), so layer i starts with the same parameters either way; and both draw dropout masks from the same
  per-layer keys (`layer_rngs`), so a run computes the same thing scanned or not, up to float rounding.
- The stacked axis carries the logical name `layers` (the rule table decides whether a mesh axis splits it). A
  model with circular pipeline repeats R (`model.pipeline_repeats`) stacks its layers as [R, n_layers / R, ...]
  (`repeats`, `layers`), in layer order: layer l is row (l // (n_layers / R), l % (n_layers / R)). Split over S
  stages on its `layers` axis, each stage then holds its n_layers / (S R) layers of every repeat, which a circular
  schedule runs, with no row permutation: the model is the same whatever the stage count, and a checkpoint
  stores the stack in layer order by a plain reshape (`unrepeated_tree`).
- The KV cache is always stacked, [n_layers, batch, kv_heads, seq_len, head_dim], and goes through the blocks
  whole with each block's index: a block writes its new keys and values in place into its slice (a scatter
  into the donated buffer, in the loop as in the scan's carry), so a decode step copies no layer's cache.
- `per_layer_tree` / `stacked_tree` turn pure-dict trees (parameters, and optimizer states that mirror them)
  from one layout into the other, for checkpoints (which store the stacked one) and Hugging Face files (named
  per layer); `unrepeated_tree` / `repeated_tree` reshape a stack with repeats to layer order and back.
"""

from __future__ import annotations

import re
from typing import Callable, NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

LAYERS = "layers"  # the logical name of the stacked axis
REPEATS = "repeats"  # the logical name of a circular pipeline's repeats axis, before `layers`
# The residual stream between a block's halves and between blocks (and stages): its sequence has a name of its own,
# which the rule table splits as every sequence, unless sequence parallelism splits it over tensor too
# (`sharding.sequence_parallel_rules`).
RESIDUAL = ("batch", "res_seq", "act_embed")
BLOCKS = "blocks"  # the attribute (and tree key) holding the blocks


class LayerCache(NamedTuple):
    """Keys and values, [batch, kv_heads, seq_len, head_dim] each for one layer (`CACHE_AXES`), or stacked
    [n_layers, ...] for the model."""

    k: jax.Array
    v: jax.Array


def build_blocks(make_block: Callable[..., nnx.Module], n_layers: int, key: jax.Array, scan: bool,
                 repeats: int = 1):
    """`n_layers` blocks from `make_block(rngs)`, layer i from `nnx.Rngs(params=split(key)[i])`: an `nnx.List`, or
    (`scan`) one block whose parameters are stacked on a leading `layers` axis, in layer order; with `repeats` > 1,
    on [repeats, n_layers / repeats] (`in_repeats`)."""
    keys = jax.random.split(key, n_layers)
    if not scan:  # make_block may take the layer's index too (a model whose layers differ)
        return nnx.List([make_block(nnx.Rngs(params=keys[i]), i) for i in range(n_layers)])
    stack = nnx.vmap(lambda k: make_block(nnx.Rngs(params=k)), in_axes=0, out_axes=0,
                     transform_metadata={nnx.PARTITION_NAME: LAYERS})
    return in_repeats(stack(keys), repeats)


def stacked_repeats(n_layers: int, repeats: int, scan: bool = True) -> int:
    """The repeats a model's stack is held with ([repeats, n_layers / repeats]: `stack.in_repeats`): the circular
    repeats it is configured with, where they divide its layers (an indivisible split is refused by
    `schedules.gpipe.check_pipeline` when a pipeline would run it); 1 for layers one module each."""
    return repeats if scan and repeats > 1 and n_layers % repeats == 0 else 1


def in_repeats(blocks, repeats: int):
    """Stacked `blocks` ([n_layers, ...], layer order) as [repeats, n_layers / repeats, ...], named (`repeats`,
    `layers`, ...): a reshape, row (r, j) holding layer r n_layers / repeats + j. As they are for repeats 1."""
    if repeats <= 1:
        return blocks
    graphdef, state = nnx.split(blocks)

    def reshaped(var):
        a = var[...]
        names = var.get_metadata().get("out_sharding")
        return var.replace(a.reshape(repeats, a.shape[0] // repeats, *a.shape[1:]),
                           **({"out_sharding": (REPEATS, *names)} if names else {}))

    return nnx.merge(graphdef, jax.tree.map(reshaped, state, is_leaf=lambda v: isinstance(v, nnx.Variable)))


def held_repeats(blocks) -> int:
    """R of stacked blocks held as [R, n_layers / R, ...] (`in_repeats`), 1 for a stack in layer order."""
    for _, var in nnx.iter_graph(blocks):
        if isinstance(var, nnx.Variable):
            names = var.get_metadata().get("out_sharding") or ()
            return var.shape[0] if names and names[0] == REPEATS else 1
    return 1


def layer_rngs(key: jax.Array | None, i) -> nnx.Rngs | None:
    """Layer i's dropout stream: the forward pass's key folded with i (None: no dropout)."""
    return None if key is None else nnx.Rngs(dropout=jax.random.fold_in(key, i))


# step(block, x, rngs, cache, i) -> (x, cache, stats): block i on x, with the whole stacked cache (or None); `stats`
# is a dict of arrays the forward pass sums over the layers (a mixture of experts' load-balancing loss and expert
# loads; {} for a dense block)
Step = Callable[[nnx.Module, jax.Array, nnx.Rngs | None, LayerCache | None, jax.Array | int],
                tuple[jax.Array, LayerCache | None, dict]]


def add_stats(total: dict, more: dict) -> dict:
    """Per-layer statistics summed key by key (a key either lacks counts as zero), in key order: a set's order
    changes with each process's string hashing, and with it the program's text (a plan's step cache missed)."""
    return {k: total[k] + more[k] if k in total and k in more else total.get(k, more.get(k))
            for k in sorted({*total, *more})}


PER_BATCH = ("aux_loss",)  # statistics of a batch as a whole (a loss): over parts of a batch, their mean


def combine_parts(stats: dict, axis: int = 0) -> dict:
    """Statistics computed on parts of a batch (stacked on `axis`) as the batch's: counts summed, `PER_BATCH`
    losses averaged."""
    return {k: a.mean(axis) if k in PER_BATCH else a.sum(axis) for k, a in stats.items()}


def run_blocks(blocks, n_layers: int, scan: bool, step: Step, x: jax.Array, *, dropout_key=None,
               cache: LayerCache | None = None, policy=None,
               stats: dict | None = None) -> tuple[jax.Array, LayerCache | None, dict]:
    """x through every block in order (`step` for each, given the block's index), the stacked `cache` passed from
    block to block; returns the output, the cache and the blocks' statistics summed (`stats`: their zeros, the
    structure a block returns). `policy` (training only) rematerialises each block. A stack held with repeats runs
    in layer order too."""
    stats = {} if stats is None else stats
    if scan:
        return _scanned(blocks, n_layers, step, x, dropout_key, cache, policy, stats)
    for i in range(n_layers):
        with jax.named_scope(f"layer{i}"):  # names the layer's ops in profiles and HLO (`shardlm profile`)
            if policy is not None:
                x, more = _remat_block(blocks[i], x, layer_rngs(dropout_key, i), step, i, policy)
            else:
                x, cache, more = step(blocks[i], x, layer_rngs(dropout_key, i), cache, i)
            stats = add_stats(stats, more)
    return x, cache, stats


def _scanned(blocks, n_layers, step, x, dropout_key, cache, policy, stats):
    graphdef, stacked = nnx.split(blocks)
    if held_repeats(blocks) > 1:  # [R, n / R] -> [n], layer order: a circular pipeline's model run unpipelined
        stacked = jax.tree.map(lambda a: a.reshape(-1, *a.shape[2:]), stacked)

    def body(carry, xs):
        x, cache, total = carry
        params, i = xs
        x, cache, more = step(nnx.merge(graphdef, params), x, layer_rngs(dropout_key, i), cache, i)
        return (x, cache, add_stats(total, more)), None

    if policy is not None:  # what the policy does not save is recomputed per layer in the backward pass
        body = jax.checkpoint(body, policy=policy, prevent_cse=False)
    with jax.named_scope(LAYERS):
        (x, cache, stats), _ = jax.lax.scan(body, (x, cache, stats), (stacked, jnp.arange(n_layers)))
    return x, cache, stats


def _remat_block(block, x, rngs, step: Step, i: int, policy):
    """One block's training forward under `nnx.remat`: what `policy` does not save is recomputed in the backward
    pass. Returns (x, stats)."""
    def run(blk, x, rngs):
        x, _, more = step(blk, x, rngs, None, i)
        return x, more

    return nnx.remat(run, policy=policy)(block, x, rngs)


def layer_index(i: int, n_layers: int, repeats: int) -> tuple[int, ...]:
    """Where layer i sits in stacked blocks: (i,) in layer order, (r, j) in a stack held with repeats."""
    if repeats <= 1:
        return (i,)
    per = n_layers // repeats
    return (i // per, i % per)


def unstacked(model):
    """`model` (a `CausalLM` whose blocks are scanned) with its blocks as one module per layer, each parameter
    row i of the stacked one (a slice on each device: no gather), for decoding: a decode step is bound by reading
    the weights, and a scan's per-layer slicing of them made XLA:CPU's decoding 1.6x slower than a loop's."""
    if not model.scan_layers:
        return model
    graphdef, stacked = nnx.split(model.blocks)
    repeats = held_repeats(model.blocks)

    def row(a, i):
        for k in layer_index(i, model.n_layers, repeats):
            a = stack_row(a, k)
        return a

    def layer(i):
        block = nnx.merge(graphdef, jax.tree.map(lambda a: row(a, i), stacked))
        for _, var in nnx.iter_graph(block):  # the stacked axes' names go with them
            if isinstance(var, nnx.Variable) and (names := var.get_metadata().get("out_sharding")):
                stacked_axes = 2 if names[0] == REPEATS else 1 if names[0] == LAYERS else 0
                var.set_metadata(out_sharding=tuple(names[stacked_axes:]))
        return block

    model.blocks = nnx.List([layer(i) for i in range(model.n_layers)])
    model.scan_layers = False
    return model


def stack_row(a, i):
    """Row i of a stacked array, or of an abstract one (shape and sharding only: a compile for a target)."""
    if isinstance(a, jax.ShapeDtypeStruct):
        from jax.sharding import NamedSharding, PartitionSpec

        sharding = a.sharding
        if isinstance(sharding, NamedSharding):
            sharding = NamedSharding(sharding.mesh, PartitionSpec(*sharding.spec[1:]))
        return jax.ShapeDtypeStruct(a.shape[1:], a.dtype, sharding=sharding)
    return a[i]


# --- the two layouts of a parameter tree ------------------------------------------------------------------------

_LAYER_PATH = re.compile(rf"{BLOCKS}/(\d+)/(.+)")


def is_stacked_block(path: str) -> bool:
    """Whether a parameter path ('blocks/attn/wq', not 'blocks/0/attn/wq') is one of stacked blocks."""
    parts = path.split("/")
    return len(parts) > 1 and parts[0] == BLOCKS and not parts[1].isdigit()


def split_layer_path(path: str) -> tuple[int, str] | None:
    """'blocks/3/attn/wq' -> (3, 'blocks/attn/wq'): a per-layer parameter path's layer and its stacked path."""
    m = _LAYER_PATH.fullmatch(path)
    return (int(m.group(1)), f"{BLOCKS}/{m.group(2)}") if m else None


def is_per_layer(tree) -> bool:
    """Whether a pure-dict tree holds its blocks one per layer ({"blocks": {0: ..., 1: ...}})."""
    found = _find_blocks(tree)
    return bool(found) and all(isinstance(k, int) for k in found[0])


def layers_alike(tree) -> bool:
    """Whether every per-layer `blocks` subtree of a pure-dict tree holds layers of one structure and shapes, so
    that they stack (a mixture of experts in every other layer, `model.moe_every`, does not)."""
    for blocks in _find_blocks(tree):
        shapes = [jax.tree.map(jnp.shape, blocks[i]) for i in sorted(blocks)]
        if any(jax.tree.structure(t) != jax.tree.structure(shapes[0]) or t != shapes[0] for t in shapes[1:]):
            return False
    return True


def _find_blocks(tree) -> list[dict]:
    """Every `blocks` subtree of a pure-dict tree (a model's, and each optimizer-state copy of it)."""
    if not isinstance(tree, dict):
        return []
    out = []
    for key, value in tree.items():
        if key == BLOCKS and isinstance(value, dict):
            out.append(value)
        else:
            out += _find_blocks(value)
    return out


def _map_blocks(tree, per_layer: bool, fn):
    """A pure-dict tree with `fn` applied to each `blocks` subtree in one layout (`per_layer`: {0: ..., 1: ...};
    else stacked), everything else as it was."""
    if not isinstance(tree, dict):
        return tree

    def in_layout(value) -> bool:
        return isinstance(value, dict) and bool(value) and all(isinstance(k, int) for k in value) == per_layer

    return {key: fn(value) if key == BLOCKS and in_layout(value) else _map_blocks(value, per_layer, fn)
            for key, value in tree.items()}


def stacked_tree(tree, stack=jnp.stack):
    """A pure-dict tree with each per-layer `blocks` subtree ({0: t0, 1: t1, ...}) stacked into one ([n, ...]
    leaves). `stack(list_of_leaves)` does the stacking (default jnp.stack; an abstract version for shapes)."""
    def stacked(blocks):
        layers = [blocks[i] for i in range(len(blocks))]
        return jax.tree.map(lambda *leaves: stack(list(leaves)), *layers)

    return _map_blocks(tree, True, stacked)


def per_layer_tree(tree, n_layers: int, take=lambda leaf, i: leaf[i]):
    """The inverse of `stacked_tree`: each stacked `blocks` subtree split into {0: ..., n_layers - 1: ...}.
    `take(leaf, i)` takes layer i of a stacked leaf."""
    return _map_blocks(tree, False, lambda blocks: {i: jax.tree.map(lambda leaf, i=i: take(leaf, i), blocks)
                                                    for i in range(n_layers)})


def unrepeated_tree(tree, reshape=lambda leaf, shape: leaf.reshape(shape)):
    """A pure-dict tree whose stacked `blocks` leaves held with repeats ([R, n / R, ...]) are in layer order
    ([n, ...]), as checkpoints store them: a reshape. `reshape(leaf, shape)` does it (an abstract one for shapes)."""
    return _map_blocks(tree, False, lambda blocks: jax.tree.map(
        lambda leaf: reshape(leaf, (leaf.shape[0] * leaf.shape[1], *leaf.shape[2:])), blocks))


def repeated_tree(tree, repeats: int):
    """The inverse of `unrepeated_tree`: stacked `blocks` leaves [n, ...] as [repeats, n / repeats, ...]."""
    return _map_blocks(tree, False, lambda blocks: jax.tree.map(
        lambda leaf: leaf.reshape(repeats, leaf.shape[0] // repeats, *leaf.shape[1:]), blocks))
