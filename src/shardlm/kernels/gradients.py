"""A value whose gradient is written out: the one mechanism behind every place shardlm sets what a gradient is
(its dtype, its sharding, where it goes) rather than taking autodiff's transpose.

Design choices:
- `with_gradient(value, gradient, *args)` is `value(*args)` under a `jax.custom_vjp` whose backward pass is
  `gradient(saved, g)`, one cotangent per argument (None: zero). The callers are short: a projection whose weight
  gradient is produced in `model.grad_reduce_dtype` (`models.precision.matmul`), the output head whose gradient
  flows back in the compute dtype (`models.layers.float32_logits`), a pin whose gradient has a sharding of its
  own (`sharding.constrain_with_gradient`), a float32 carrier for a weight read in 16 bits inside a loop
  (`sharding.gradient_carrier`, `schedules.gpipe`).
- `saves_inputs=False` keeps nothing for the backward pass (`saved` is None): a pin or a carrier must not keep
  its activation alive until the backward pass.
- Kernels with real custom derivatives (attention's, the fused head's, the ring's, the grouped matmuls') keep
  their own `custom_vjp`s beside their math.
"""

from __future__ import annotations

from typing import Callable

import jax


def with_gradient(value: Callable, gradient: Callable, *args, saves_inputs: bool = True):
    """`value(*args)`, whose gradient with respect to `args` is `gradient(args or None, g)` (a tuple, one per
    argument) in place of autodiff's."""

    @jax.custom_vjp
    def wrapped(*xs):
        return value(*xs)

    def forward(*xs):
        return value(*xs), (xs if saves_inputs else None)

    def backward(saved, g):
        return tuple(gradient(saved, g))

    wrapped.defvjp(forward, backward)
    return wrapped(*args)
