"""A train state as a run's checkpoints store it, and back: the stored form does not depend on how the blocks are
laid out in memory (`model.scan_layers`), so a checkpoint written either way restores either way, onto any mesh.

Design choices:
- shardlm's own models store their blocks stacked on a leading layers axis (`shardlm.models.stack`), as a scanned
  model holds them: saving a scanned state converts nothing, and a stacked array splits over a pipeline's stages
  as it is. A per-layer state is stacked for the save (in one jit, its output sharded like the layers plus a whole
  leading axis) and split back on restore. Layers that differ (dense and sparse layers mixed, `model.moe_every`)
  cannot stack, and are stored per layer, as held; such a model is per layer wherever it is restored.
- Restoring reads each array in the stored layout straight into the sharding the in-memory layout implies (the
  same spec, with or without the leading layers axis), then converts in one jit whose outputs are the target's
  shardings; no array is gathered whole. Checkpoints written before blocks were stored stacked (per layer on
  disk) are recognised from their metadata and restore the same way.
- A circular pipeline (`model.pipeline_repeats` > 1 on several stages) holds the stack's rows in its own order,
  so that each stage's rows are its layers; checkpoints store them in layer order, so they restore onto any
  number of stages (the rows move between stages once, as they are read).
- A model from a py: file is stored as it is held: its structure is its own.
"""

import functools

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.checkpoint import RunCheckpoints
from shardlm.models.stack import (
    is_per_layer,
    layers_alike,
    per_layer_tree,
    permuted_blocks,
    rows_of_layers,
    stack_row,
    stacked_tree,
)


def _blocks_in(tree) -> dict | None:
    return tree.get("blocks") if isinstance(tree, dict) else None


def _stored_per_layer(reader: RunCheckpoints, step: int) -> bool:
    blocks = _blocks_in(reader.stored_tree(step))
    return isinstance(blocks, dict) and bool(blocks) and all(str(k).isdigit() for k in blocks)


def save_state(ckpts: RunCheckpoints, step: int, state, position: int, meta: dict, stacks_blocks: bool,
               order: tuple[int, ...] | None = None) -> None:
    """Start saving the nnx.State {"model", "optimizer"}: with `stacks_blocks` (shardlm's models), per-layer
    blocks stacked first, and a stack held in a circular pipeline's `order` (row p holds layer order[p]) put in
    layer order."""
    pure = nnx.to_pure_dict(state)
    if stacks_blocks and is_per_layer(pure["model"]) and layers_alike(pure["model"]):
        pure = jax.jit(stacked_tree)(pure)
    elif stacks_blocks and order is not None:
        pure = _permuted(pure, tuple(rows_of_layers(order)))
    ckpts.save_trees(step, pure["model"], pure["optimizer"], position, meta)


@functools.partial(jax.jit, static_argnums=1)
def _permuted(tree, rows: tuple[int, ...]):
    """`permuted_blocks` compiled once per row order (a lambda jitted at each save would compile at each save)."""
    return permuted_blocks(tree, rows)


def restore_state(reader: RunCheckpoints, step: int, abstract_state, *, optimizer: bool = True,
                  stacks_blocks: bool = True, order: tuple[int, ...] | None = None):
    """The state at `step` in `abstract_state`'s layout and shardings (the nnx.State {"model", "optimizer"}, or the
    model's alone when `optimizer` is False), whichever layout the checkpoint stored its blocks in. `order`: the
    layer each row of the held stack holds (a circular pipeline's; None: row i is layer i)."""
    target = nnx.to_pure_dict(abstract_state)
    held_per_layer = stacks_blocks and is_per_layer(target["model"] if optimizer else target)
    stored_per_layer = stacks_blocks and _stored_per_layer(reader, step)
    convert = held_per_layer != stored_per_layer
    stored = (_as_stacked(target) if held_per_layer else _as_per_layer(target)) if convert else target
    params, opt = reader.restore_trees(step, stored["model"] if optimizer else stored,
                                       stored["optimizer"] if optimizer else None)
    arrays = {"model": params, "optimizer": opt} if optimizer else params
    reorder = stacks_blocks and order is not None and not held_per_layer
    if convert or reorder:
        shardings = jax.tree.map(lambda t: t.sharding, target)
        n_layers = _n_layers(target) if convert and held_per_layer else 0  # (stacking needs no count)

        def change(t):
            if convert:
                t = per_layer_tree(t, n_layers) if held_per_layer else stacked_tree(t)
            return permuted_blocks(t, order) if reorder else t

        arrays = jax.jit(change, out_shardings=shardings)(arrays)
    state = jax.tree.map(lambda x: x, abstract_state)  # a fresh tree of the same Variables, filled below
    nnx.replace_by_pure_dict(state, arrays)
    return state


def _n_layers(per_layer) -> int:
    model = per_layer["model"] if "model" in per_layer else per_layer
    return len(_blocks_in(model))


def _as_stacked(target):
    """The stacked form of a per-layer target: leaves [n, ...], sharded like a layer with the leading axis whole."""
    def stack(leaves):
        first = leaves[0]
        sharding = NamedSharding(first.sharding.mesh, P(None, *first.sharding.spec))
        return jax.ShapeDtypeStruct((len(leaves), *first.shape), first.dtype, sharding=sharding)

    return stacked_tree(target, stack)


def _as_per_layer(target):
    """The per-layer form of a stacked target: one leaf per layer, sharded like the stack without its first axis."""
    n_layers = jax.tree.leaves(_blocks_in(target["model"] if "model" in target else target))[0].shape[0]
    return per_layer_tree(target, n_layers, stack_row)
