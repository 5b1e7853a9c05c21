"""Sharded creation of the training state (model + AdamW), never materialised whole on one device.

The recipe (Flax lm1b / MaxText): trace the constructor with `nnx.eval_shape` to get shapes and logical axis
names, map the names through the rule table to NamedShardings (checking divisibility), then run the constructor
inside `jax.jit(out_shardings=...)`, so each device computes only its own shard. The optimizer is built inside the
same jit: its moment buffers inherit each parameter's logical names, so AdamW state is sharded exactly like the
parameter it belongs to. Flax's eager sharding is switched off during construction: the rule table, not Flax's
global context, is the one place that decides placement.
"""

import dataclasses
from typing import Any

import jax
import optax
from flax import nnx

from shardlm.config import Config
from shardlm.errors import ShardlmError
from shardlm.models import FAMILIES, padded_vocab_size
from shardlm.models.layers import check_attention
from shardlm.sharding import state_shardings
from shardlm.trees import path_str
from shardlm.units import fmt_bytes


def effective_warmup(cfg: Config) -> int:
    """`train.warmup_steps`, unless it would leave no decay: then a tenth of the run (short test runs)."""
    t = cfg.train
    return t.warmup_steps if t.warmup_steps < t.steps else t.steps // 10


def decays(path, param) -> bool:
    """nanoGPT's rule: weight decay on matrices and embeddings (ndim >= 2), never on biases or norm scales.
    Attention biases are [heads, head_dim], so biases are recognised by name (every one ends in 'bias')."""
    return param.ndim >= 2 and not path_str(path).endswith("bias")


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


def make_optimizer(cfg: Config) -> optax.GradientTransformation:
    t = cfg.train
    decay_mask = lambda params: jax.tree_util.tree_map_with_path(decays, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(make_schedule(cfg), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass
class TrainState:
    """The split form of {"model": a CausalLM, "optimizer": nnx.Optimizer} that the jitted step consumes and returns."""

    graphdef: Any
    state: Any  # nnx.State {"model": ..., "optimizer": ...}, every leaf a sharded jax.Array
    shardings: Any  # matching tree of NamedSharding


def vocab_sizes(cfg: Config, tokenizer_vocab: int, tensor_degree: int) -> tuple[int, int]:
    """(real, padded) vocabulary: `model.vocab_size` if set, else the tokenizer's, padded for the tensor degree."""
    real = cfg.model.vocab_size or tokenizer_vocab
    return real, padded_vocab_size(real, tensor_degree)


def model_factory(cfg: Config, vocab_size: int, tensor_degree: int):
    real, padded = vocab_sizes(cfg, vocab_size, tensor_degree)
    family = FAMILIES[cfg.model.family]
    return lambda rngs: family(cfg.model, real, padded, rngs)


def _builder(cfg: Config, mesh, vocab_size: int):
    """build(params=None): model + AdamW; with `params` (the model's nnx.State) the model holds those values (the
    random initialisation is traced, and dead code for XLA)."""
    build_model = model_factory(cfg, vocab_size, mesh.shape["tensor"])
    tx = make_optimizer(cfg)

    def build(params=None):
        model = build_model(nnx.Rngs(params=cfg.seed))
        if params is not None:
            nnx.update(model, params)
        return {"model": model, "optimizer": nnx.Optimizer(model, tx, wrt=nnx.Param)}

    return build


def check_shardable(cfg: Config, mesh) -> None:
    """Raise if a mesh degree does not divide a parameter dimension: shapes only, no data, no compile. The
    vocabulary is padded to a multiple of the tensor degree, so any vocabulary size gives the same verdict."""
    m, tp = cfg.model, mesh.shape["tensor"]
    cp = mesh.shape.get("context", 1)
    if m.seq_len % cp:
        raise ShardlmError(f"model.seq_len={m.seq_len} is split over mesh.context={cp}, which does not divide it; "
                           f"choose a mesh.context dividing {m.seq_len} or a seq_len that is a multiple of {cp}")
    check_attention(m.attention, cp)
    kv = m.n_kv_heads or m.n_heads
    if kv % tp and not m.n_heads % tp:  # said in the model's terms before the generic per-parameter message
        raise ShardlmError(f"mesh.tensor={tp} must divide the key/value heads (model.n_kv_heads={kv}) as well as "
                           f"the query heads: choose mesh.tensor dividing {kv}, or more kv heads")
    with nnx.use_eager_sharding(False):
        state_shardings(nnx.state(nnx.eval_shape(_builder(cfg, mesh, 257))), mesh)


def check_batch(cfg: Config, mesh) -> None:
    """Raise if the global batch (or each of its `train.grad_accum` microbatches) does not split over data x fsdp,
    or over the processes."""
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    if cfg.train.batch_size % dp:
        raise ShardlmError(
            f"train.batch_size={cfg.train.batch_size} is split over data x fsdp = {dp} devices, which does not "
            f"divide it; use a multiple of {dp}"
        )
    k = cfg.train.grad_accum
    if (cfg.train.batch_size // k) % dp:
        raise ShardlmError(
            f"train.grad_accum={k} microbatches of {cfg.train.batch_size // k} sequences do not split over data x "
            f"fsdp = {dp} devices; use a train.batch_size that is a multiple of {k * dp}, or a smaller grad_accum"
        )
    if cfg.train.batch_size % jax.process_count():
        raise ShardlmError(f"train.batch_size must be a multiple of the {jax.process_count()} processes")


def sequence_split_note(cfg: Config, mesh) -> str | None:
    """What context parallelism does to `cfg` on `mesh`, in a line (None without it): the tokens each device
    holds, and the keys and values each layer all-gathers for attention."""
    cp = mesh.shape.get("context", 1)
    if cp == 1:
        return None
    m = cfg.model
    rows = cfg.train.batch_size // cfg.train.grad_accum // (mesh.shape["data"] * mesh.shape["fsdp"])
    kv_heads = (m.n_kv_heads or m.n_heads) // mesh.shape["tensor"]
    gathered = 2 * rows * m.seq_len * kv_heads * (m.d_model // m.n_heads) * (2 if m.dtype == "bfloat16" else 4)
    return (f"sequence split over context={cp}: each device holds {m.seq_len // cp} of every {m.seq_len} tokens; "
            f"attention all-gathers keys and values over context, {fmt_bytes(gathered)} per layer per device "
            "(reduce-scattered back as gradients)")


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
        shardings = state_shardings(abstract_state, mesh)
    return build, graphdef, _placed(abstract_state, shardings), shardings


def abstract_model(cfg: Config, mesh, vocab_size: int):
    """(graphdef, abstract state with shardings) of the model alone: what readers of a checkpoint restore."""
    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(model_factory(cfg, vocab_size, mesh.shape["tensor"]),
                                                            nnx.Rngs(params=0)))
        shardings = state_shardings(abstract_state, mesh)
    return graphdef, _placed(abstract_state, shardings)


def init_model(cfg: Config, mesh, vocab_size: int):
    """(graphdef, state) of a freshly initialised model alone (no optimizer), each device computing its shards."""
    graphdef, abstract = abstract_model(cfg, mesh, vocab_size)
    build = model_factory(cfg, vocab_size, mesh.shape["tensor"])
    with nnx.use_eager_sharding(False):
        state = jax.jit(lambda: nnx.state(build(nnx.Rngs(params=cfg.seed))),
                        out_shardings=jax.tree.map(lambda a: a.sharding, abstract))()
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
