"""`LinenModel`: a Flax Linen module and its variables as one NNX module, so that shardlm trains, checkpoints and
places Linen models exactly as NNX ones.

Design choices:
- Each variable collection is an attribute of the same name holding the collection's tree, so the NNX state's
  paths are the Linen variables' own (`params/Block_0/mlp/Dense_0/kernel`, `batch_stats/...`): a plan written for
  `shardlm.shard(module, plan, variables=...)` places the wrapped model unchanged, and a checkpoint's keys are the
  variables dict's. (`nnx.bridge.ToNNX` drops the `params/` level, and carries RNG state of its own.)
- `params` are `nnx.Param`s, every other collection (batch statistics, caches) `nnx.BatchStat`s: the forward
  pass applies them as mutable and writes their new values back, as Linen training code does with `mutable=`.
- Randomness is given per call (`rngs={"dropout": key}`), never stored: the trainer derives each step's keys from
  the seed and the step, so a resumed run draws the same masks without saving any RNG state.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from flax import nnx
from flax.core import unfreeze

from shardlm.errors import ShardlmError

PARAMS = "params"


def _is_var(x) -> bool:
    return isinstance(x, nnx.Variable)


class LinenModel(nnx.Module):
    def __init__(self, module, variables: dict):
        self.linen_module = module  # static: a Linen module is a frozen dataclass
        self.linen_collections = tuple(variables)
        for name, tree in variables.items():
            kind = nnx.Param if name == PARAMS else nnx.BatchStat
            setattr(self, name, nnx.data(jax.tree.map(kind, tree)))

    def variables(self) -> dict:
        """The Linen variables dict, as arrays."""
        return {name: jax.tree.map(lambda v: v[...], getattr(self, name), is_leaf=_is_var)
                for name in self.linen_collections}

    def __call__(self, *inputs, rngs: dict | None = None, method=None, **kwargs):
        """`module.apply(variables, *inputs, **kwargs)`, the non-parameter collections mutable and written back.
        `method(module, *inputs, **kwargs)` runs instead of the module's `__call__` (a call adapter)."""
        mutable = [name for name in self.linen_collections if name != PARAMS]
        extra = {"method": method} if method is not None else {}
        if not mutable:
            return self.linen_module.apply(self.variables(), *inputs, rngs=rngs or {}, **extra, **kwargs)
        out, updated = self.linen_module.apply(self.variables(), *inputs, rngs=rngs or {}, mutable=mutable, **extra,
                                               **kwargs)
        for name in mutable:
            if name in updated:
                jax.tree.map(lambda var, new: var.set_value(new), getattr(self, name), updated[name],
                             is_leaf=_is_var)
        return out


def initialised(module, variables, call, seq_len: int, seed: int, spec: str) -> LinenModel:
    """`module` with `variables`, or initialised on a [1, seq_len] token array (through `call(module, tokens)` if
    given: the module's own call may take keyword inputs or a training flag), as a `LinenModel`. A module that
    cannot be called on the tokens alone is a one-line error naming `model.call`."""
    if variables is None:
        tokens = jnp.zeros((1, seq_len), jnp.int32)
        keys = {"params": jax.random.key(seed), "dropout": jax.random.key(seed + 1)}
        try:
            variables = module.init(keys, tokens, **({"method": call} if call is not None else {}))
        except TypeError as e:  # its __call__ wants more than the tokens (a `train` flag, keyword inputs)
            raise ShardlmError(f"model={spec}: initialising {type(module).__name__} on tokens [1, {seq_len}] failed "
                               f"({(str(e).splitlines() or [''])[0]}); a model called with more than its tokens needs "
                               "model.call=NAME, a function call(model, tokens[, train]) in its file") from e
    variables = unfreeze(variables)
    if not isinstance(variables, dict) or PARAMS not in variables:
        raise ShardlmError(f"model={spec}: a Linen model's variables must be the dict module.init returns, with a "
                           "'params' collection")
    return LinenModel(module, variables)
