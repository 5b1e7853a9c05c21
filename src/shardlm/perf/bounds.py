"""An analytic lower bound on a strategy's step time, before anything compiles, so that `shardlm plan` can skip
the strategies that cannot win.

`shardlm plan` compiles strategies in the order of their bounds and, once it has an estimate for a strategy that
fits, skips every remaining one whose bound already exceeds it (`Bound.beats`); each skipped strategy is listed
with the reason. Strategies named with `--strategies` are always compiled.

The bound counts only what a strategy cannot avoid, and charges it as cheaply as the hardware allows, so that it
stays below the estimate of the compiled step (`shardlm.perf.timeline`: every kernel at no more than peak, every
collective the compiler emitted, some hidden behind compute). It is the longer of compute and traffic, since
the schedule may hide all of the traffic:
- compute: the model's FLOPs per step (6N + 6LTd per token for shardlm's models: 12LTd of attention with the
  causal half a fused kernel skips taken off) spread over the devices, at peak; with pipeline stages, times the
  iterations over the useful ones (idle stages compute on zeros);
- per device, in the compute dtype, each sent once over the links the cost model charges it to (within a host,
  or a device's share of its host's network between hosts, for a ring laid out as the mesh is), no latency:
  - the weights' storage split (fsdp x context x expert; the experts' own, split over `expert`, over fsdp x
    context): each device's weights gathered once and their gradients reduce-scattered once, (g-1)/g each way;
  - data parallelism: the gradient all-reduce of what a device holds, 2(d-1)/d of it;
  - tensor parallelism: Megatron's four activation all-reduces per layer (two forward, two backward);
  - the context split: attention's key/value all-gather per layer (forward);
  - pipeline stages: a microbatch's activations handed on per iteration, forward and backward;
  - experts: each sparse layer's top-k copies of every token sent to their experts and back, forward and backward
    (the balanced share; the dropless buffer sends more).
A margin (`MARGIN`) absorbs what the formula rounds away (the vocabulary's padding, a bias left out).
"""

from __future__ import annotations

import dataclasses
import math

import numpy as np

from shardlm.perf.costmodel import Hardware
from shardlm.perf.strategies import Strategy

MARGIN = 0.8  # the bound is scaled by this before it is compared: pruning must never drop the winner


@dataclasses.dataclass(frozen=True)
class Bound:
    compute_s: float
    comm_s: float

    @property
    def step_s(self) -> float:
        """The longer of the two: the schedule may hide every collective behind compute."""
        return max(self.compute_s, self.comm_s)

    def beats(self, best_s: float) -> bool:
        """Whether a strategy with this bound could still be faster than an estimate of `best_s`."""
        return MARGIN * self.step_s <= best_s


def lower_bound(cfg, s: Strategy, hw: Hardware, model_flops: float, param_count: int) -> Bound:
    """The bound for `cfg` (shardlm's models; a py: file's model gets its compute only) on strategy `s`, whose
    step costs `model_flops` over all devices, for a model of `param_count` parameters."""
    from shardlm.models.pipeline import microbatch_count  # imports JAX: planning_flags runs before JAX starts

    m, t = cfg.model, cfg.train
    if not m.preset.startswith("py:"):  # causal attention: fused kernels skip the masked half of 12LTd per token
        model_flops -= 6 * m.n_layers * m.seq_len * m.d_model * t.batch_size * m.seq_len
    compute = model_flops / s.devices / hw.peak_flops
    micro = microbatch_count(m.pipeline_microbatches, s.stage)
    iterations = micro * m.pipeline_repeats + s.stage - 1
    if s.stage > 1:
        compute *= iterations / (micro * m.pipeline_repeats)
    if m.preset.startswith("py:"):
        return Bound(compute, 0.0)
    dtype = 2 if m.dtype == "bfloat16" else 4
    experts = (m.n_layers // m.moe_every) * m.moe_experts * 3 * m.d_model * (m.moe_d_ff or m.d_mlp) \
        if m.moe_experts else 0  # split over `expert`, stored over fsdp (x context)
    weights = (param_count - experts) * dtype / (s.tensor * s.stage)  # one device's share, gathered
    expert_weights = experts * dtype / (s.tensor * s.stage * s.expert)
    storage = s.fsdp * s.context * s.expert
    # the experts' `embed` dimension takes fsdp x context when that divides it, else fsdp alone (the rule table)
    expert_storage = ("fsdp", "context") if m.d_model % (s.fsdp * s.context) == 0 else ("fsdp",)
    expert_shards = math.prod(getattr(s, a) for a in expert_storage)
    rows = t.batch_size // t.grad_accum // (s.data * s.fsdp * s.expert)  # sequences per device and microstep
    activation = rows * m.seq_len // s.context * m.d_model * dtype
    layers = m.n_layers // s.stage
    kv = 2 * rows * m.seq_len * (m.n_kv_heads or m.n_heads) // s.tensor * (m.d_model // m.n_heads) * dtype
    seconds = (
        _send(s, hw, ("fsdp", "expert", "context"), 2 * weights)  # gathered once, reduce-scattered once
        + _send(s, hw, expert_storage, 2 * expert_weights)
        + _send(s, hw, ("data",), 2 * (weights / storage + expert_weights / expert_shards))  # twice a gather's share
        + _send(s, hw, ("tensor",), 4 * layers * 2 * activation * t.grad_accum)
        + _send(s, hw, ("context",), layers * kv * t.grad_accum)
    )
    if s.stage > 1:
        seconds += _hand_offs(s, hw, 2 * iterations * activation / micro * t.grad_accum)
    if m.moe_experts and s.expert > 1:  # each sparse layer's tokens to their experts and back, forward and backward
        sparse = m.n_layers // m.moe_every // s.stage
        seconds += _send(s, hw, ("expert",), 4 * sparse * activation * m.moe_top_k * t.grad_accum)
    return Bound(compute, seconds)


def _group(s: Strategy, axes: tuple[str, ...], per_host: int) -> tuple[int, int]:
    """(devices of one host, hosts) in a group of devices along `axes`, the mesh laid out in mesh order (tensor
    innermost) `per_host` consecutive devices to a host, as `shardlm.mesh` and the cost model lay it out."""
    from shardlm.mesh import MESH_AXES

    degrees = [getattr(s, a) for a in MESH_AXES]
    positions = np.arange(s.devices).reshape(degrees)
    index = tuple(slice(None) if a in axes else 0 for a in MESH_AXES)
    hosts = positions[index].reshape(-1) // per_host
    h = len(set(hosts.tolist()))
    return len(hosts) // h, h


def _send(s: Strategy, hw: Hardware, axes: tuple[str, ...], nbytes: float) -> float:
    """Seconds to send (g-1)/g of `nbytes` around a group along `axes` of g devices, as the cost model splits a
    ring between the links within and across hosts."""
    m, h = _group(s, axes, hw.devices_per_node)
    if m * h == 1:
        return 0.0
    within = (m - 1) / m * nbytes / hw.intra_node_bw
    across = (h - 1) / h * nbytes / m / hw.inter_node_bw
    return within + across


def _hand_offs(s: Strategy, hw: Hardware, nbytes: float) -> float:
    """Seconds for a stage to hand `nbytes` to the next: across hosts when a stage spans whole hosts."""
    m, h = _group(s, ("stage",), hw.devices_per_node)
    return nbytes / (hw.inter_node_bw if h > 1 else hw.intra_node_bw)
