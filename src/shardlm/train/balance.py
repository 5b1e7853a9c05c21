"""DeepSeek-V3's auxiliary-loss-free load balancing: after each update, every sparse layer's per-expert router bias
moves by `model.moe_bias_rate` toward balance, up for the experts that received fewer than the layer's mean
assignments in the step, down for those that received more (sign(mean - load), the paper's rule with its
gamma). Outside the gradient: the bias takes none (`shardlm.models.routing.route` stops it), and AdamW leaves a
parameter with zero gradients and no weight decay (its name ends in "bias") where it is. Being a parameter, it is
checkpointed, resumed and exported with the rest.

A step whose update the spike guard skipped (`shardlm.train.spikes`) moves no bias, and its loads count nowhere:
the run after it is the run that never saw its batch.

The loads are the step's, summed over its microbatches and every device's tokens: each sparse block reports its
own row of a [layers, experts] statistic (`shardlm.models.layers.LAYER_LOADS`). A stacked bias ([layers, experts],
a scanned model) takes the rows as they are; a per-layer one (`blocks/3/mlp/router_bias`) its layer's row.
"""

import jax.numpy as jnp
from flax import nnx

BIAS = "router_bias"


def balance_experts(model, loads: jnp.ndarray, rate: float, applied=True) -> None:
    """Move every main-stack router bias of `model` (in place) by `rate` toward balancing `loads` [layers,
    experts] (the model's layers: the stack's layer i is row `model.prefix_layers` + i), where `applied` (a
    traced bool: whether the step's update was applied); else leave each bias exactly as it is."""
    k = getattr(model, "prefix_layers", 0)
    for path, var in nnx.iter_graph(model):
        if not (isinstance(var, nnx.Param) and path and path[-1] == BIAS and path[0] == "blocks"):
            continue
        rows = loads[k + path[1]] if isinstance(path[1], int) else loads[k:].reshape(var.shape)
        step = rate * jnp.sign(rows.mean(-1, keepdims=True) - rows)
        var[...] = jnp.where(applied, (var[...] + step).astype(var.dtype), var[...])
