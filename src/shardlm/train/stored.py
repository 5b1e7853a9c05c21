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
- A model with circular pipeline repeats holds its stack as [R, n_layers / R] in layer order
  (`models.stack.in_repeats`); checkpoints store [n_layers] by a reshape, as every other stack, so they restore
  onto any number of stages and repeats. Checkpoints written when a circular pipeline permuted the stack's rows
  stored layer order too: they restore the same way.
- A model from a py: file is stored as it is held: its structure is its own.
"""

import jax
from flax import nnx
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.checkpoint import RunCheckpoints
from shardlm.models.stack import (
    is_per_layer,
    layers_alike,
    per_layer_tree,
    repeated_tree,
    stack_row,
    stacked_tree,
    unrepeated_tree,
)


def _blocks_in(tree) -> dict | None:
    return tree.get("blocks") if isinstance(tree, dict) else None


def _stored_per_layer(reader: RunCheckpoints, step: int) -> bool:
    blocks = _blocks_in(reader.stored_tree(step))
    return isinstance(blocks, dict) and bool(blocks) and all(str(k).isdigit() for k in blocks)


def save_state(ckpts: RunCheckpoints, step: int, state, position: int, meta: dict, stacks_blocks: bool,
               repeats: int = 1) -> None:
    """Start saving the nnx.State {"model", "optimizer"}: with `stacks_blocks` (shardlm's models), per-layer
    blocks stacked first, and a stack held with `repeats` > 1 ([R, n / R]) in layer order ([n])."""
    pure = nnx.to_pure_dict(state)
    if stacks_blocks and is_per_layer(pure["model"]) and layers_alike(pure["model"]):
        pure = jax.jit(stacked_tree)(pure)
    elif stacks_blocks and repeats > 1:
        pure = _unrepeated(pure)
    ckpts.save_trees(step, pure["model"], pure["optimizer"], position, meta)


@jax.jit
def _unrepeated(tree):
    """`unrepeated_tree` compiled once (a lambda jitted at each save would compile at each save)."""
    return unrepeated_tree(tree)


def restore_state(reader: RunCheckpoints, step: int, abstract_state, *, optimizer: bool = True,
                  stacks_blocks: bool = True, repeats: int = 1):
    """The state at `step` in `abstract_state`'s layout and shardings (the nnx.State {"model", "optimizer"}, or the
    model's alone when `optimizer` is False), whichever layout the checkpoint stored its blocks in. `repeats` > 1:
    the held stack is [repeats, n_layers / repeats] (`models.stack.in_repeats`), stored as [n_layers]."""
    target = nnx.to_pure_dict(abstract_state)
    held_per_layer = stacks_blocks and is_per_layer(target["model"] if optimizer else target)
    stored_per_layer = stacks_blocks and _stored_per_layer(reader, step)
    convert = held_per_layer != stored_per_layer
    reshape = stacks_blocks and repeats > 1 and not held_per_layer
    stacked_as_stored = unrepeated_tree(target, _abstract_reshape) if reshape else target
    stored = ((_as_stacked(stacked_as_stored) if held_per_layer else _as_per_layer(stacked_as_stored)) if convert
              else stacked_as_stored)
    params, opt = reader.restore_trees(step, stored["model"] if optimizer else stored,
                                       stored["optimizer"] if optimizer else None)
    arrays = {"model": params, "optimizer": opt} if optimizer else params
    if convert or reshape:
        shardings = jax.tree.map(lambda t: t.sharding, target)
        n_layers = _n_layers(target) if convert and held_per_layer else 0  # (stacking needs no count)

        def change(t):
            if convert:
                t = per_layer_tree(t, n_layers) if held_per_layer else stacked_tree(t)
            return repeated_tree(t, repeats) if reshape else t

        arrays = jax.jit(change, out_shardings=shardings)(arrays)
    state = jax.tree.map(lambda x: x, abstract_state)  # a fresh tree of the same Variables, filled below
    nnx.replace_by_pure_dict(state, arrays)
    return state


def _n_layers(per_layer) -> int:
    model = per_layer["model"] if "model" in per_layer else per_layer
    return len(_blocks_in(model))


def _abstract_reshape(leaf, shape):
    """An abstract stack held with repeats ([R, n / R, ...]) as stored ([n, ...]): read with its leading axis whole
    (each device reads every layer of its shard, and the reshape back places them)."""
    return jax.ShapeDtypeStruct(shape, leaf.dtype,
                                sharding=NamedSharding(leaf.sharding.mesh, P(None, *leaf.sharding.spec[2:])))


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
