"""Sharded creation of the training state (model + optimizer), never materialised whole on one device.

The recipe (Flax lm1b / MaxText): trace the constructor with `nnx.eval_shape` to get shapes and logical axis
names, map the names through the rule table to NamedShardings (checking divisibility), then run the constructor
inside `jax.jit(out_shardings=...)`, so each device computes only its own shard. The optimizer is built inside the
same jit: its moment buffers inherit each parameter's logical names, so an optimizer's state is sharded exactly like
the parameter it belongs to (`shardlm.train.optimizers` builds the optimizer `train.optimizer` names). Flax's eager sharding is switched off during construction: the rule table, not Flax's
global context, is the one place that decides placement.
"""

import dataclasses
import math
from typing import Any

import jax
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.config import Config, check_expert_degree
from shardlm.errors import ShardlmError
from shardlm.foreign.modules import is_py
from shardlm.schedules.gpipe import microbatch_count
from shardlm.sharding import state_partition_specs
from shardlm.sharding.rules import as_axes, axis_degree
from shardlm.trees import path_str
from shardlm.train.optimizers import make_optimizer
from shardlm.train.source import model_source


@dataclasses.dataclass
class TrainState:
    """The split form of {"model": a CausalLM, "optimizer": nnx.Optimizer} that the jitted step consumes and returns."""

    graphdef: Any
    state: Any  # nnx.State {"model": ..., "optimizer": ...}, every leaf a sharded jax.Array
    shardings: Any  # matching tree of NamedSharding


def vocab_sizes(cfg: Config, tokenizer_vocab: int, tensor_degree: int) -> tuple[int, int]:
    """(real, padded) vocabulary: `model.vocab_size` if set, else the tokenizer's; shardlm's models pad it for the
    tensor degree."""
    return model_source(cfg).vocab_sizes(tokenizer_vocab, tensor_degree)


def _param_specs(cfg: Config, model, mesh) -> dict:
    """Each parameter's path -> its spec as the training state stores it, for an optimizer that runs per device
    (Muon's: `optimizers.per_owner`); {} for the others."""
    if cfg.train.optimizer != "muon" or is_py(cfg.model.preset):
        return {}
    specs = state_partition_specs(nnx.state(model, nnx.Param), mesh, model_source(cfg).storage_rules(mesh))
    return {path_str(p): s for p, s in jax.tree_util.tree_flatten_with_path(
        specs, is_leaf=lambda x: isinstance(x, P))[0]}


def _builder(cfg: Config, mesh, vocab_size: int):
    """build(params=None): model + optimizer; with `params` (the model's nnx.State) the model holds those values
    (the random initialisation is traced, and dead code for XLA)."""
    source = model_source(cfg)
    build_model = source.factory(vocab_size, mesh.shape["tensor"])

    def build(params=None):
        model = build_model()
        if params is not None:
            nnx.update(model, params)
        tx = make_optimizer(cfg, model, mesh, _param_specs(cfg, model, mesh))
        return {"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)}

    return build


def check_shardable(cfg: Config, mesh, vocab_size: int | None = None) -> None:
    """Raise if the model cannot be placed on `mesh` (a degree that does not divide a dimension, a plan that does
    not match the model): shapes only, no data, no compile. shardlm's models pad the vocabulary for the tensor
    degree, so any vocabulary gives the verdict before the data is read; a model from a py: file is checked for
    its real vocabulary (`vocab_size`, or `model.vocab_size`), and without one only in what does not depend on it."""
    check_expert_degree(cfg.model, mesh.shape.get("expert", 1))  # in the experts' terms, before a parameter's
    source = model_source(cfg)
    source.check(mesh, vocab_size)
    vocab = vocab_size or source.placeholder_vocab
    if vocab is not None:
        with nnx.use_eager_sharding(False):
            source.state_shardings(nnx.state(nnx.eval_shape(_builder(cfg, mesh, vocab))), mesh)


def batch_split(cfg: Config, mesh) -> tuple[int, str]:
    """The devices a batch's rows are split over (data x fsdp, or what a plan's `inputs` say), and their axes."""
    rows = model_source(cfg).batch_sharding(mesh).spec[0]
    return axis_degree(mesh, rows), " x ".join(as_axes(rows)) or "no axis"


def batch_unit(cfg: Config, mesh) -> int:
    """The smallest batch a forward pass of `cfg` takes on `mesh` (what an evaluation batch is a multiple of): a
    row per device the batch is split over, times the pipeline's microbatches, and a multiple of the processes."""
    dp, _ = batch_split(cfg, mesh)
    unit = dp * microbatch_count(cfg.model.pipeline_microbatches, mesh.shape.get("stage", 1))
    return math.lcm(unit, jax.process_count())


def check_batch(cfg: Config, mesh) -> None:
    """Raise if the global batch (or each of its `train.grad_accum` microbatches) does not split over data x fsdp,
    or over the processes. An expert degree that cannot split the model's experts is said first, in their terms:
    the expert axis splits the batch too, and a batch it does not divide is not the problem to fix."""
    check_expert_degree(cfg.model, mesh.shape.get("expert", 1))
    dp, axes = batch_split(cfg, mesh)
    if cfg.train.batch_size % dp:
        raise ShardlmError(
            f"train.batch_size={cfg.train.batch_size} is split over {axes} = {dp} devices, which does not "
            f"divide it; use a multiple of {dp}"
        )
    k = cfg.train.grad_accum
    if (cfg.train.batch_size // k) % dp:
        raise ShardlmError(
            f"train.grad_accum={k} microbatches of {cfg.train.batch_size // k} sequences do not split over {axes} "
            f"= {dp} devices; use a train.batch_size that is a multiple of {k * dp}, or a smaller grad_accum"
        )
    stages = mesh.shape.get("stage", 1)
    m = microbatch_count(cfg.model.pipeline_microbatches, stages)
    if m > 1 and (cfg.train.batch_size // k) % (dp * m):
        raise ShardlmError(
            f"the pipeline cuts each batch of {cfg.train.batch_size // k} sequences into {m} microbatches "
            f"(model.pipeline_microbatches) over {axes} = {dp} devices: use a train.batch_size that is a multiple of "
            f"{k * dp * m}, or fewer microbatches")
    if cfg.train.batch_size % jax.process_count():
        raise ShardlmError(f"train.batch_size must be a multiple of the {jax.process_count()} processes")


def split_notes(cfg: Config, mesh) -> list[str]:
    """What context parallelism and pipeline stages do to `cfg` on `mesh`, a line each: the tokens each device
    holds and the keys and values each layer all-gathers; which layers each stage holds, the bubble and the
    hand-offs (shardlm's models; a model from a py: file's attention is its own and it has no stages)."""
    return model_source(cfg).split_notes(mesh)


def _placed(abstract_state, shardings):
    """Each abstract leaf with its target sharding: a target a checkpoint can be read straight into."""
    return jax.tree.map(lambda a, s: jax.ShapeDtypeStruct(a.shape, a.dtype, sharding=s), abstract_state, shardings)


def abstract_train_state(cfg: Config, mesh, vocab_size: int):
    """(build, graphdef, abstract state, shardings): shapes and placements only, nothing computed. The abstract
    state's leaves carry their target sharding, so a checkpoint can be read straight into it."""
    build = _builder(cfg, mesh, vocab_size)
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
        # Raises before any compile if a degree does not divide a dimension (model parameters come first).
        shardings = model_source(cfg).state_shardings(abstract_state, mesh)
    return build, graphdef, _placed(abstract_state, shardings), shardings


def abstract_model(cfg: Config, mesh, vocab_size: int):
    """(graphdef, abstract state with shardings) of the model alone: what readers of a checkpoint restore."""
    source = model_source(cfg)
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(source.factory(vocab_size, mesh.shape["tensor"])))
        shardings = source.model_shardings(abstract_state, mesh)
    return graphdef, _placed(abstract_state, shardings)


def init_model(cfg: Config, mesh, vocab_size: int):
    """(graphdef, state) of a freshly initialised model alone (no optimizer), each device computing its shards."""
    graphdef, abstract = abstract_model(cfg, mesh, vocab_size)
    build = model_source(cfg).factory(vocab_size, mesh.shape["tensor"])
    with nnx.use_eager_sharding(False):
        state = jax.jit(lambda: nnx.state(build()), out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()
    return graphdef, state


def compile_init(cfg: Config, mesh, vocab_size: int):
    """(graphdef, compiled init, shardings): the init computes each device's shards of model + AdamW state."""
    build, graphdef, _, shardings = abstract_train_state(cfg, mesh, vocab_size)
    with nnx.use_eager_sharding(False):
        init = jax.jit(lambda: nnx.state(build()), out_shardings=shardings).lower().compile()
    return graphdef, init, shardings


def create_train_state(cfg: Config, mesh, vocab_size: int) -> TrainState:
    graphdef, init, shardings = compile_init(cfg, mesh, vocab_size)
    return TrainState(graphdef, init(), shardings)


def train_state_with(cfg: Config, mesh, vocab_size: int, params) -> TrainState:
    """The train state of a model holding `params` (its nnx.State, already placed on the mesh, e.g. imported from
    a Hugging Face checkpoint) and a fresh optimizer, built inside one jit: the moments are sharded like their
    parameters from the start, and `params` are donated (no second copy)."""
    build, graphdef, _, shardings = abstract_train_state(cfg, mesh, vocab_size)
    with nnx.use_eager_sharding(False):
        state = jax.jit(lambda p: nnx.state(build(p)), in_shardings=(shardings["model"],), out_shardings=shardings,
                        donate_argnums=0)(params)
    return TrainState(graphdef, state, shardings)
