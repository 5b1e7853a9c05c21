"""The optimizers by name (`train.optimizer`): AdamW, Muon, Lion and Adafactor, each optax's own, behind one
learning-rate schedule, one weight-decay rule and one gradient clip.

Design choices:
- One table (`OPTIMIZERS`): a name, its optax transformation built from the train config, and the one line reports
  say about it. `make_optimizer` wraps the choice in the gradient clip and the spike guard
  (`shardlm.train.spikes`), whatever the name.
- One schedule (linear warmup, cosine decay to `lr * min_lr_ratio`) and one `train.lr` for every optimizer. Muon
  runs with optax's `consistent_rms=0.2` (Moonlight, Liu et al. 2025): each orthogonalised update is scaled to
  the root-mean-square AdamW's updates have, so AdamW's learning rate and weight decay carry over unchanged, and
  the matrices and the AdamW-trained rest share them. (Keller Jordan's Muon instead scales by sqrt(max(1, fan_out
  / fan_in)) and needs its own rate, about 0.02.)
- Muon takes the hidden matrices only. The embedding and the output head (any weight with a `vocab` or `pos`
  axis), norm scales and biases (one axis of their own), and the routers of a mixture of experts (whose
  balancing bias must move by the router alone) take AdamW, as every Muon recipe does. The matrix of a weight is
  read from its logical axis names: `layers`, `repeats` and `experts` are batch axes (each layer's, each
  expert's matrix is orthogonalised on its own); a weight whose last axis is `embed` (an output projection) is
  [everything else, embed], any other [first axis, everything else] (q/k/v as [embed, heads x head_dim], the
  latent up-projections as [latent, heads x head_dim]). A model from a py: file has no axis names: Muon refuses
  it, in one line.
- The rest takes exactly the AdamW `train.optimizer=adamw` runs (plain, the same decay mask): the two halves are
  partitioned here (`muon_and_adamw`), not left to `optax.contrib.muon`'s own AdamW branch, which takes no decay
  mask and shares Muon's Nesterov setting. Muon's own momentum is Nesterov by default, as in the recipes whose
  rates it borrows (`train.muon_nesterov`).
- Muon under FSDP and tensor parallelism: Newton-Schulz needs whole matrices, so each matrix is orthogonalised
  by the devices that own it whole (`muon_owners`), as torchtitan's and Megatron's layer-wise Muon do.
- The weight decay rule is nanoGPT's (`decays`): matrices and embeddings decay, biases and norm scales do not,
  for every optimizer; Adafactor and Lion take it as their mask too.
"""

from __future__ import annotations

import dataclasses
from typing import Callable

import jax
import optax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.config import OPTIMIZERS as OPTIMIZER_NAMES
from shardlm.config import Config
from shardlm.errors import ShardlmError
from shardlm.models.stack import LAYERS, REPEATS, is_stacked_block
from shardlm.sharding import owner_spec
from shardlm.sharding.exchange import exchange, exchange_back, exchange_plan
from shardlm.train.source import model_source
from shardlm.train.spikes import guard_spikes
from shardlm.trees import path_str

MUON_MOMENTUM = 0.95  # Muon's momentum, every recipe's (Nesterov unless train.muon_nesterov=false)
MUON_RMS = 0.2  # Muon's updates scaled to AdamW's root-mean-square (Moonlight's `consistent_rms`)
BATCH_AXES = (REPEATS, LAYERS, "experts")  # a weight's axes that hold separate matrices
ADAMW_AXES = ("vocab", "pos")  # a weight with one of these is an embedding or the output head: AdamW under Muon


def effective_warmup(cfg: Config) -> int:
    """`train.warmup_steps`, unless it would leave no decay: then a tenth of the run (short test runs)."""
    t = cfg.train
    return t.warmup_steps if t.warmup_steps < t.steps else t.steps // 10


def decays(path, param, stacked_axes: int = 0) -> bool:
    """nanoGPT's rule: weight decay on matrices and embeddings (ndim >= 2), never on biases or norm scales.
    Attention biases are [heads, head_dim], so biases are recognised by name (every one ends in 'bias'). A
    scanned model's blocks carry `stacked_axes` leading axes over the layers, which are not the weight's own."""
    name = path_str(path)
    own = param.ndim - (stacked_axes if is_stacked_block(name) else 0)
    return own >= 2 and not name.endswith("bias")


def make_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup then cosine decay to lr * min_lr_ratio at the last step.

    Indexed by the optimizer's update count, which is 0 for step 1; shifting by one makes step 1 use
    lr / warmup_steps (not 0, a wasted step) and the last step end exactly at the floor.
    """
    t = cfg.train
    warmup = effective_warmup(cfg)
    base = optax.warmup_cosine_decay_schedule(
        init_value=0.0,
        peak_value=t.lr,
        warmup_steps=warmup,
        decay_steps=max(t.steps, warmup + 1),
        end_value=t.lr * t.min_lr_ratio,
    )
    return lambda count: base(count + 1)


# --- Muon's matrices -------------------------------------------------------------------------------------------

def muon_dimensions(names: tuple | None, path: str) -> optax.contrib.MuonDimensionNumbers | None:
    """How Muon reads a weight with logical axis `names` as matrices (its reduction and output axes; the rest are
    batch axes), or None: the weight takes AdamW (an embedding or head, a norm scale, a bias, a router)."""
    if names is None or path.endswith("bias") or "router" in path.rsplit("/", 1)[-1]:
        return None
    if any(n in ADAMW_AXES for n in names):
        return None
    own = [i for i, n in enumerate(names) if n not in BATCH_AXES]
    if len(own) < 2:
        return None
    if names[own[-1]] == "embed":
        return optax.contrib.MuonDimensionNumbers(reduction_axis=tuple(own[:-1]), output_axis=(own[-1],))
    return optax.contrib.MuonDimensionNumbers(reduction_axis=(own[0],), output_axis=tuple(own[1:]))


def muon_plan(params) -> dict[str, tuple]:
    """Each parameter's path -> (its Muon dimension numbers or None for AdamW, its logical names, its shape), read
    off `params` (a model, or its state of parameters)."""
    params = params if isinstance(params, nnx.State) else nnx.state(params, nnx.Param)
    is_var = lambda x: isinstance(x, nnx.Variable)  # noqa: E731
    plan = {}
    for path, var in jax.tree_util.tree_flatten_with_path(params, is_leaf=is_var)[0]:
        if not is_var(var) or not isinstance(var, nnx.Param):
            continue
        names = var.get_metadata().get("out_sharding")
        names = tuple(names) if names is not None else None
        plan[path_str(path)] = (muon_dimensions(names, path_str(path)), names, tuple(var.shape))
    return plan


def muon_owners(params, mesh, stored: dict[str, P] | None = None) -> dict[str, P]:
    """Each Muon-trained weight's path -> the layout (a spec over `mesh`) it is orthogonalised in
    (`sharding.owner_spec`): whole matrices, each layer's (each expert's) on the devices that own it. `stored`
    (path -> spec, as the weights are stored): the owners are chosen along the axes that already split them.

    Why: Newton-Schulz multiplies whole matrices (X X^T, five times). Left to XLA on the weights' FSDP x TP
    layout, each iteration's matmuls became partial products and gathers: 167 collectives in the optimizer of a
    2-layer Llama's step on fsdp 2 x tensor 2. Here, inside the update (`per_owner`), a gradient, its momentum and
    its weight move once into their owners' layout, the iterations run locally, and the update and the momentum
    move back once. A stack's layers split over as many devices as divide their number (the tensor devices too);
    what they cannot split over (a weight outside the stack, a mesh larger than the layers) is copied, each copy
    computing the same matrix. Between steps the momentum is stored as its weight is (1/N of it per device), so
    Muon holds half AdamW's state. The result is the one device's, up to the order of float sums
    (tests/test_optimizers.py)."""
    stored = stored or {}
    return {path: owner_spec(names, shape, mesh, BATCH_AXES, stored.get(path))
            for path, (dims, names, shape) in muon_plan(params).items() if dims is not None}


def _leaf_spec(path: str, specs: dict[str, P], default=P()):
    """The entry of `specs` for the parameter whose path ends `path` (an update's, a moment's), or `default` (a
    counter's: P())."""
    parts = path.split("/")
    return next((specs[tail] for tail in ("/".join(parts[i:]) for i in range(len(parts))) if tail in specs), default)


def per_owner(tx: optax.GradientTransformation, stored: dict[str, P], owners: dict[str, P], mesh
              ) -> optax.GradientTransformation:
    """`tx` run on each device's blocks, inside a `shard_map` over the whole mesh. Every update, parameter and
    state leaf of a parameter enters and leaves as the parameter is stored (`stored`: its path -> spec; counters
    replicated). Those of a parameter in `owners` (its path -> the layout `tx` must see it in: Muon's matrices,
    whole, `muon_owners`) move to that layout inside, by an explicit exchange (`sharding.exchange`), and back.
    Elementwise optimizers (AdamW on the embedding, norms, biases) run on their shards; Muon's iterations on the
    whole matrices their devices own, with no collective inside.

    Why an explicit exchange: given the owners' layout as the `shard_map`'s own (its in_specs), XLA had to move
    each gradient and momentum from [layers, embed/fsdp, mlp/tensor] to [layers/(fsdp x tensor), embed, mlp]
    itself, found no collective for moving two mesh axes at once, and replicated the tensor on every device
    ("Involuntary full rematerialization"): Llama 3.1 8B's Muon step on 8 H100s (fsdp 4 x tensor 2) held 65.55
    GiB per device against AdamW's 38.93, and gathered 185 GiB per step against 14. Here the mesh axes that split
    a matrix's own dimensions move onto its layers by one all-to-all over them all (`exchange.exchange`: 7/8 of a
    device's share on the wire over fsdp 4 x tensor 2), so every byte moves once: per step, a gradient, its
    momentum and its weight (for the decay) move in, the update and the momentum move out. Now 35.68 GiB, the
    gathers AdamW's, and 16.25 GiB of all-to-alls (five times the matrices' 3.25 GiB per device). Where the layers
    cannot take an axis (2 layers over 4 devices), the matrices are gathered along it and each copy computes the
    same update. That costs the iterations' compute n times over, but it puts half the bytes on the busiest link
    that one owner per matrix would: that owner must receive n-1 shares and send n-1 back. It also happens only
    when a model has fewer layers than devices, which means small matrices."""
    def update(updates, state, params=None):
        def specs_of(tree):
            return jax.tree_util.tree_map_with_path(lambda p, _: _leaf_spec(path_str(p), stored), tree)

        def moves_of(tree):  # each leaf's exchange to its owners' layout: () for a leaf that stays as it is stored
            def plan(path, x):
                name = path_str(path)
                owner = _leaf_spec(name, owners, None)
                if owner is None or not getattr(x, "ndim", 0):
                    return ()
                return exchange_plan(_leaf_spec(name, stored), owner, x.ndim, mesh)[0]
            return jax.tree_util.tree_map_with_path(plan, tree)

        moves = [moves_of(tree) for tree in (updates, state, params)]

        def there(tree, leaf_moves):
            return jax.tree.map(lambda x, m: exchange(x, m, mesh), tree, leaf_moves)

        def back(tree, leaf_moves):
            return jax.tree.map(lambda x, m: exchange_back(x, m, mesh), tree, leaf_moves)

        def local(u, s, p):
            new_u, new_s = tx.update(there(u, moves[0]), there(s, moves[1]), there(p, moves[2]))
            return back(new_u, moves[0]), back(new_s, moves[1])

        run = jax.shard_map(local, mesh=mesh,
                            in_specs=(specs_of(updates), specs_of(state), specs_of(params)),
                            out_specs=(specs_of(updates), specs_of(state)), check_vma=False)
        return run(updates, state, params)

    return optax.GradientTransformation(tx.init, update)


def _muon(cfg: Config, schedule, decay_mask, model, mesh, param_specs) -> optax.GradientTransformation:
    plan = {} if model is None else muon_plan(model)
    if not any(dims is not None for dims, _, _ in plan.values()):
        raise ShardlmError("train.optimizer=muon found no matrix it can orthogonalise: a model from a py: file has "
                           "no logical axis names to tell its hidden matrices from its embedding and head; use "
                           "train.optimizer=adamw, lion or adafactor")
    tx = muon_and_adamw(cfg, schedule, decay_mask, lambda path: plan[path][0])
    if mesh is None:
        return tx
    return per_owner(tx, param_specs, muon_owners(model, mesh, param_specs), mesh)


def muon_and_adamw(cfg: Config, schedule, decay_mask, dimensions) -> optax.GradientTransformation:
    """Muon on the weights `dimensions(path)` reads as matrices, and on every other weight the AdamW that
    `train.optimizer=adamw` runs: plain (not Nesterov), with the same decay mask.

    Why not `optax.contrib.muon` alone: its AdamW half takes no decay mask (every norm scale, bias and router
    bias would decay) and shares Muon's `nesterov`. So the two halves are partitioned here, each optax's own:
    `optax.contrib.muon` on the matrices (its AdamW branch then holds nothing) and `optax.adamw` on the rest."""
    t = cfg.train

    def labels(params):
        return jax.tree_util.tree_map_with_path(
            lambda p, _: "adamw" if dimensions(path_str(p)) is None else "muon", params)

    def dims(params):  # the Muon half's weights (the rest are optax's MaskedNode here, with no leaves)
        return jax.tree_util.tree_map_with_path(lambda p, _: dimensions(path_str(p)), params)

    return optax.partition({
        "muon": optax.contrib.muon(schedule, beta=MUON_MOMENTUM, nesterov=t.muon_nesterov,
                                   weight_decay=t.weight_decay, weight_decay_mask=decay_mask,
                                   muon_weight_dimension_numbers=dims, consistent_rms=MUON_RMS),
        "adamw": adamw(cfg, schedule, decay_mask),
    }, labels)


def adamw(cfg: Config, schedule, decay_mask) -> optax.GradientTransformation:
    """`train.optimizer=adamw`: optax's AdamW with the train config's betas and decay, decay masked by `decays`."""
    t = cfg.train
    return optax.adamw(schedule, b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask)


# --- the table ---------------------------------------------------------------------------------------------------

@dataclasses.dataclass(frozen=True)
class Optimizer:
    name: str
    # (cfg, schedule, decay mask, model or None, mesh or None, the parameters' specs by path) -> the optax
    # transformation (no clip, no guard)
    build: Callable[..., optax.GradientTransformation]
    summary: str  # what reports say of it: its state per parameter


OPTIMIZERS: dict[str, Optimizer] = {o.name: o for o in (
    Optimizer("adamw", lambda cfg, schedule, mask, model, mesh, specs: adamw(cfg, schedule, mask),
        "AdamW (two moments per parameter)"),
    Optimizer("muon", _muon, "Muon on the hidden matrices (one momentum each), AdamW on the rest"),
    Optimizer("lion", lambda cfg, schedule, mask, model, mesh, specs: optax.lion(
        schedule, b1=cfg.train.beta1, b2=cfg.train.beta2, weight_decay=cfg.train.weight_decay, mask=mask),
        "Lion (one moment per parameter)"),
    Optimizer("adafactor", lambda cfg, schedule, mask, model, mesh, specs: optax.adafactor(
        schedule, weight_decay_rate=cfg.train.weight_decay or None, weight_decay_mask=mask,
        multiply_by_parameter_scale=False),
        "Adafactor (factored second moments: a row and a column per matrix)"),
)}


assert tuple(OPTIMIZERS) == OPTIMIZER_NAMES, "train.optimizer's values (config.OPTIMIZERS) are this table's"


def optimizer_summary(cfg: Config) -> str:
    """What reports say of `cfg`'s optimizer."""
    return OPTIMIZERS[cfg.train.optimizer].summary


def make_optimizer(cfg: Config, model=None, mesh=None, param_specs: dict[str, P] | None = None
                   ) -> optax.GradientTransformation:
    """The clip, `train.optimizer` on the schedule and decay rule, and the spike guard around them. `model`: the
    model it will update (Muon reads its axis names); `mesh` and `param_specs` (each parameter's path -> its spec,
    as it is stored): where it runs (Muon places its matrices for Newton-Schulz), None on one device."""
    t, stacked_axes = cfg.train, model_source(cfg).stacked_axes
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(  # noqa: E731
        lambda path, p: decays(path, p, stacked_axes), params)
    inner = optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        OPTIMIZERS[t.optimizer].build(cfg, make_schedule(cfg), decay_mask, model, mesh, param_specs or {}),
    )
    return guard_spikes(inner, t) if t.skip_spikes else inner
