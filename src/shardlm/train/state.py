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
from shardlm.models.gpt import GPT, padded_vocab_size
from shardlm.sharding import check_divisible, state_partition_specs, state_shardings


def make_schedule(cfg: Config) -> optax.Schedule:
    """Linear warmup then cosine decay to lr * min_lr_ratio at the last step.

    Indexed by the optimizer's update count, which is 0 for step 1; shifting by one makes step 1 use
    lr / warmup_steps (not 0, a wasted step) and the last step end exactly at the floor.
    """
    t = cfg.train
    warmup = min(t.warmup_steps, t.steps)
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
    # nanoGPT convention: decay matrices and embeddings (ndim >= 2), never biases or LayerNorm scales.
    decay_mask = lambda params: jax.tree.map(lambda p: p.ndim >= 2, params)  # noqa: E731
    return optax.chain(
        optax.clip_by_global_norm(t.grad_clip) if t.grad_clip > 0 else optax.identity(),
        optax.adamw(make_schedule(cfg), b1=t.beta1, b2=t.beta2, weight_decay=t.weight_decay, mask=decay_mask),
    )


@dataclasses.dataclass
class TrainState:
    """The split form of (model, optimizer) that the jitted step consumes and returns."""

    graphdef: Any
    state: Any  # nnx.State of (model, optimizer), every leaf a sharded jax.Array
    shardings: Any  # matching tree of NamedSharding

    def merge(self):
        return nnx.merge(self.graphdef, self.state)


def vocab_sizes(cfg: Config, tokenizer_vocab: int, tensor_degree: int) -> tuple[int, int]:
    """(real, padded) vocabulary: `model.vocab_size` if set, else the tokenizer's, padded for the tensor degree."""
    real = cfg.model.vocab_size or tokenizer_vocab
    return real, padded_vocab_size(real, tensor_degree)


def model_factory(cfg: Config, vocab_size: int, tensor_degree: int):
    real, padded = vocab_sizes(cfg, vocab_size, tensor_degree)
    return lambda rngs: GPT(cfg.model, real, padded, rngs)


def create_train_state(cfg: Config, mesh, vocab_size: int) -> TrainState:
    build_model = model_factory(cfg, vocab_size, mesh.shape["tensor"])
    tx = make_optimizer(cfg)

    def build():
        model = build_model(nnx.Rngs(params=cfg.seed))
        return model, nnx.Optimizer(model, tx, wrt=nnx.Param)

    with nnx.use_eager_sharding(False):
        graphdef, abstract_state = nnx.split(nnx.eval_shape(build))
        # Both raise before any compile if a degree does not divide a dimension; the model's own state first, so
        # the message names the parameter (blocks.0.attn.wq), not its optimizer moment.
        check_divisible(abstract_state[0], state_partition_specs(abstract_state[0]), mesh)
        shardings = state_shardings(abstract_state, mesh)

        def init():
            return nnx.state(build())

        state = jax.jit(init, out_shardings=shardings)()
    return TrainState(graphdef, state, shardings)
