"""Mixed precision as one policy (`Precision`), built once from the model config and applied at two places: to a
model's parameter tree once per forward pass (`compute_view`), and in every projection (`Precision.dense`). Math
with logical axis names; the pins are `shardlm.sharding`'s.

The policy has three dtypes and a matmul mode: the weights are stored in `model.param_dtype` (float32 master
weights, so the gradients and AdamW's moments are float32 too), computed with in `model.dtype` (bfloat16 on GPUs
and TPUs), and their gradients summed across devices in `model.grad_reduce_dtype` (auto: the compute dtype;
`matmul`); the blocks' projections multiply in the compute dtype or in FP8 (`model.matmul_dtype=fp8`, e4m3
operands and e5m2 gradients with per-tensor current scaling: `shardlm.kernels.fp8`). Every projection of every
family goes through `Precision.dense` (attention's, the MLPs', a mixture's shared expert), so each choice reaches
every one of them.

Design choices:
- `compute_view(module)` is the module with every parameter replaced by its compute copy (`sharding.compute_copy`):
  cast to the compute dtype and pinned to the sharding it is used with, its gradient pinned to the sharding it is
  stored with. The modules then use their weights as they find them. Before, each module cast at each use: the
  cast and its pin were spread over `layers.use` (which pinned on one path and returned early on others), the
  pipeline's own cast of the stage weights and `READ_IN_FLOAT32` metadata, and inside the scan over layers the
  cast's output became a stacked residual, a bfloat16 copy of every block weight kept for the backward pass.
- Parameters marked `READ_IN_FLOAT32` (norm scales and biases, a router, biases) keep float32 copies: norms and
  routing compute in float32, and a bias added in float32 has its gradient (a sum over every token of the batch)
  summed in float32.
- Tables that are looked up (the token and position embeddings) are not copied: the lookup reads the stored float32
  table where it lies (`sharding.sharded_lookup`) and casts the rows, so the table's gradient, a scatter-add of
  every token's rows, is summed in float32 (a frequent token adds up ~10^4 terms in a batch); the tied output head
  casts the table chunk by chunk as it multiplies (`shardlm.losses`).
- Under a training state sharded over the data-parallel replicas (`sharding.zero_rules`), the compute copies are
  where the weights are gathered over `data`: once per step, in the compute dtype; their gradients are
  reduce-scattered back over `data`.
- A loop over microbatches (`train.grad_accum`) differentiates weights cast once before it (`cast_once`), not
  cast by every microbatch: the compute copies then only pin them.
- Gradients summed over the parts of a step (the train step's microbatches, 1F1B's ticks) are summed in one
  float32 accumulator (`gradient_zeros`, `add_gradients`); a loop autodiff differentiates (GPipe's) sums a
  weight's gradient through a float32 carrier (`sharding.gradient_carrier`), autodiff's own sum then float32.
- Where gradients are summed across devices: XLA reduces a weight gradient's partial sums (over the devices
  that split the tokens) where the matmul producing it does, in its output dtype. `matmul` produces the weight's
  gradient in `grad_reduce_dtype` when that is not the compute dtype, so the choice reaches every such sum.
"""

from __future__ import annotations

import dataclasses
from typing import Any

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.accelerator import DTYPE_NAMES, resolve_dtype
from shardlm.kernels.fp8 import fp8_einsum, fp8_einsums
from shardlm.kernels.gradients import with_gradient
from shardlm.models.config import FP8
from shardlm.sharding import compute_copy

DTYPES = {name: getattr(jnp, name) for name in DTYPE_NAMES}  # jnp.float32, jnp.bfloat16

# Metadata keys of a parameter. READ_IN_FLOAT32: its compute copy stays float32 (norms, routers, biases).
# CAST_WHERE_READ: it has no compute copy; its reader casts and pins what it reads (a table looked up, a head
# multiplied chunk by chunk).
READ_IN_FLOAT32 = "read_in_float32"
CAST_WHERE_READ = "cast_where_read"


def compute_dtype(name: str):
    """The jnp dtype a block computes in for `model.dtype` (auto resolved for the accelerator compiled for)."""
    return DTYPES[resolve_dtype(name)]


def reduce_dtype(name: str):
    """The jnp dtype of `model.grad_reduce_dtype` (None for auto: each gradient in the dtype it is computed in)."""
    return None if name == "auto" else DTYPES[name]


@dataclasses.dataclass(frozen=True)
class Precision:
    """What a model stores, computes and sums its gradients in, and how its projections multiply."""

    param: Any  # the weights' stored dtype (model.param_dtype)
    compute: Any  # the blocks' compute dtype (model.dtype, auto resolved)
    reduce: Any = None  # the weights' gradients' dtype (model.grad_reduce_dtype; None: each in its compute dtype)
    fp8: bool = False  # the blocks' projections in float8 (model.matmul_dtype=fp8)

    @classmethod
    def of(cls, m) -> Precision:
        """The policy of model config `m`."""
        return cls(DTYPES[m.param_dtype], compute_dtype(m.dtype), reduce_dtype(m.grad_reduce_dtype),
                   m.matmul_dtype == FP8)

    def dense(self, spec: str, x: jax.Array, w: jax.Array) -> jax.Array:
        """A projection, `einsum(spec, x, w)` on the weight's compute copy, as the policy says (`matmul`)."""
        return matmul(spec, x, w, self.reduce, self.fp8)

    def denses(self, spec: str, x: jax.Array, ws) -> list[jax.Array]:
        """Several projections of one input (`matmuls`): x quantized once for all of them in FP8."""
        return matmuls(spec, x, ws, self.reduce, self.fp8)


def read_dtype(variable: nnx.Variable, compute_dtype):
    """The dtype a block reads `variable` in: float32 when it is marked `READ_IN_FLOAT32`, else `compute_dtype`."""
    return jnp.float32 if variable.get_metadata().get(READ_IN_FLOAT32) else compute_dtype


def _has_compute_copy(var: nnx.Variable) -> bool:
    meta = var.get_metadata()
    return (not meta.get(CAST_WHERE_READ) and meta.get("out_sharding") is not None
            and jnp.issubdtype(var[...].dtype, jnp.floating))


def _each_param(fn, params):
    return jax.tree.map(fn, params, is_leaf=lambda v: isinstance(v, nnx.Variable))


def compute_view(module: nnx.Module, compute_dtype, reduce_dtype=None) -> nnx.Module:
    """A copy of `module` whose parameters are their compute copies (see the module docstring); its other
    variables are shared."""
    graphdef, params, rest = nnx.split(module, nnx.Param, ...)

    def copy(var):
        if not _has_compute_copy(var):
            return var
        names = tuple(var.get_metadata()["out_sharding"])
        return var.replace(compute_copy(var[...], names, read_dtype(var, compute_dtype), reduce_dtype))

    return nnx.merge(graphdef, _each_param(copy, params), rest)


def cast_once(params, compute_dtype, reduce_dtype=None):
    """`params` (a model's `nnx.Param` state) with every weight that has a compute copy already in the dtype the
    copy reads it in, each cast where the weight lies: what a loop over microbatches differentiates
    (`train.step.accumulated_grads`), so that the cast runs once per step, not once per microbatch. XLA leaves a
    loop-invariant cast inside the loop (hoisted, its output would be a new buffer as large as the weights):
    each microbatch then read every float32 weight and wrote a bfloat16 copy, 6 bytes a weight (compiled for 8
    H100s, the step of Grok-1's 2-layer shape at 512 microbatches took 30.21 s by `shardlm plan`'s estimate with
    the cast in the loop, 29.19 s with it here). `compute_view` then finds the weights in their compute dtype
    and only pins them. The gradients are the same numbers: each arrives in the compute dtype, as its compute
    copy's did, and the caller sums them in float32. Unless `reduce_dtype` is wider than the compute dtype: a
    weight's gradient is then reduced in `reduce_dtype`, and a compute-dtype weight would round it back before
    the sum, so `params` are returned as they are."""
    if reduce_dtype is not None and jnp.dtype(reduce_dtype) != jnp.dtype(compute_dtype):
        return params

    def cast(var):
        if not _has_compute_copy(var):
            return var
        return var.replace(var[...].astype(read_dtype(var, compute_dtype)))

    return _each_param(cast, params)


def matmul(spec: str, x: jax.Array, w: jax.Array, reduce_dtype=None, fp8: bool = False) -> jax.Array:
    """`jnp.einsum(spec, x, w)` ("bte,ehd->bthd": x's indices, the weight's, the output's), in the operands' dtype.
    With a `reduce_dtype` other than it, the weight's gradient is produced in `reduce_dtype`: XLA sums a
    gradient's partial sums over the devices that split the tokens (data-parallel replicas, FSDP) where the
    matmul that produces it does, in its output dtype, so this is the dtype of that sum. `fp8`: the operands in
    float8 with per-tensor current scaling (`shardlm.kernels.fp8`, `model.matmul_dtype=fp8`)."""
    if fp8:
        return fp8_einsum(spec, x, w, grad_dtype=reduce_dtype)
    if reduce_dtype is None or jnp.dtype(reduce_dtype) == jnp.dtype(w.dtype):
        return jnp.einsum(spec, x, w)
    operands, out = spec.split("->")
    x_spec, w_spec = operands.split(",")

    def gradient(saved, g):
        x, w = saved
        dx = jnp.einsum(f"{out},{w_spec}->{x_spec}", g, w)
        dw = jnp.einsum(f"{x_spec},{out}->{w_spec}", x, g, preferred_element_type=reduce_dtype)
        return dx, dw.astype(w.dtype)

    return with_gradient(lambda x, w: jnp.einsum(spec, x, w), gradient, x, w)


def matmuls(spec: str, x: jax.Array, ws, reduce_dtype=None, fp8: bool = False) -> list[jax.Array]:
    """`matmul(spec, x, w, ...)` for each weight of `ws` (the query, key and value projections; a gated MLP's gate
    and up). In FP8, x is quantized once for all of them (`shardlm.kernels.fp8.fp8_einsums`); in the compute
    dtype they are separate products, which XLA schedules as it likes."""
    if fp8:
        return list(fp8_einsums(spec, x, ws, grad_dtype=reduce_dtype))
    return [matmul(spec, x, w, reduce_dtype) for w in ws]


def gradient_zeros(tree):
    """A running sum of gradients shaped like `tree`, in float32: the one accumulator every loop over parts of a
    step sums its gradients in (`add_gradients`: the train step's microbatches, 1F1B's ticks), whatever the
    weights' dtype. (A loop that autodiff differentiates, GPipe's, sums a weight's gradient through a float32
    carrier instead: `sharding.gradient_carrier`.)"""
    return jax.tree.map(lambda a: jnp.zeros(a.shape, jnp.float32), tree)


def add_gradients(total, more):
    """`total` (a `gradient_zeros` sum) + `more`, each gradient added in the sum's dtype."""
    return jax.tree.map(lambda s, g: s + g.astype(s.dtype), total, more)


def add_bias(y: jax.Array, bias: nnx.Param | None) -> jax.Array:
    """y + bias, added in float32 and returned in y's dtype: the bias's gradient, a sum over every token of the
    batch, is then summed in float32."""
    if bias is None:
        return y
    return (y.astype(jnp.float32) + bias[...].astype(jnp.float32)).astype(y.dtype)
