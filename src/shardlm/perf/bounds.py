"""An analytic lower bound on a strategy's step time, before anything compiles, so that `shardlm plan` can skip
the strategies that cannot win.

`shardlm plan` compiles strategies in the order of their bounds and, once it has an estimate for a strategy that
fits, skips every remaining one whose bound already exceeds it (`Bound.beats`); each skipped strategy is listed
with the reason. Strategies named with `--strategies` are always compiled.

The bound counts only what a strategy cannot avoid, and charges it as cheaply as the hardware allows, so that it
stays below the estimate of the compiled step (`shardlm.perf.timeline`: every kernel at the rate its kind and
shape reach, every collective the compiler emitted, some hidden behind compute). It is the longer of compute and
traffic where the compiler's collectives are asynchronous (XLA:GPU, XLA:TPU: the schedule may hide all of the
traffic), their sum where they block (XLA:CPU, whose timeline adds them):
- compute: the model's matmuls per device at the rates the hardware's efficiency table gives the largest shapes
  they could take (`matmul_seconds`: the rate of a [1024, 768] x [768, 2304] product is not the peak's, and a
  64-way ring's attention is thousands of small products), the rest of the model's FLOPs (6N + 6LTd per token:
  12LTd of attention with the causal half a fused kernel skips taken off) at peak; with pipeline stages, times
  the iterations over the useful ones (idle stages compute on zeros). A plan scales it by what the strategies
  it has compiled show of the rest of a step's kernels (`Calibration`);
- per device, in the compute dtype, each sent once over the links the cost model charges it to (within a host,
  or a device's share of its host's network between hosts, for a ring laid out as the mesh is), no latency but
  the ring's:
  - the weights' storage split (fsdp x context x expert; the experts' own, split over `expert`, over fsdp x
    context): each device's weights gathered once and their gradients reduce-scattered once, (g-1)/g each way;
  - data parallelism: the gradient all-reduce of what a device holds, 2(d-1)/d of it;
  - tensor parallelism: Megatron's four activation all-reduces per layer (two forward, two backward);
  - the context split: attention's keys and values sent around the ring once per layer (forward), and the
    latency of each of the ring's hand-offs, 3c - 2 per layer (`_ring_latency`);
  - pipeline stages: a microbatch's activations handed on per iteration, forward and backward;
  - experts: each sparse layer's top-k copies of every token sent to their experts and back, forward and backward
    (the balanced share; the dropless buffer sends more).
A margin (`MARGIN`) absorbs what the formula rounds away (the vocabulary's padding, a bias left out).
"""

from __future__ import annotations

import dataclasses
import itertools
import math

import numpy as np

from shardlm.families import family_of
from shardlm.models.config import head_size, sparse_layer_count, value_size
from shardlm.perf.costmodel import Hardware
from shardlm.perf.strategies import Strategy

MARGIN = 0.8  # the bound is scaled by this before it is compared: pruning must never drop the winner


@dataclasses.dataclass(frozen=True)
class Bound:
    compute_s: float
    comm_s: float
    overlap: bool = True  # whether the compiler may hide collectives behind compute

    @property
    def step_s(self) -> float:
        """The longer of the two where the schedule may hide every collective behind compute, else their sum."""
        return max(self.compute_s, self.comm_s) if self.overlap else self.compute_s + self.comm_s

    def beats(self, best_s: float) -> bool:
        """Whether a strategy with this bound could still be faster than an estimate of `best_s`."""
        return MARGIN * self.step_s <= best_s


class Calibration:
    """The bound's known error on this plan's compiler, learnt as strategies compile: the least ratio yet of a
    compiled step's kernel time (`Estimate.compute_s`) to its bound's compute. The analytic compute counts the
    model's matmuls only, where a compiled step also runs its norms, activations, softmax, optimizer and the
    copies its compiler adds, all at the rates their shapes reach; every compiled strategy so far took at least
    `factor` times its bound, and the rest are held to the same (the margin, `MARGIN`, still applies). The
    strategies compile in the order of their bounds, so the ratio is learnt on the likeliest winners, whose
    kernels are the largest and so the nearest their bound (on gpt2-small at 64 devices: 2.5x for the leaders,
    up to 7x for a 64-way ring's small products)."""

    def __init__(self):
        self.factor = 1.0
        self._seen = False

    def learn(self, bound: Bound, compute_s: float) -> None:
        """One compiled strategy's bound and the kernel time of its compiled step."""
        if bound.compute_s <= 0:
            return
        ratio = max(compute_s / bound.compute_s, 1.0)
        self.factor = ratio if not self._seen else min(self.factor, ratio)
        self._seen = True

    def applied(self, bound: Bound) -> Bound:
        """`bound` with its compute scaled by what the compiled steps showed."""
        return dataclasses.replace(bound, compute_s=bound.compute_s * self.factor)


def lower_bound(cfg, s: Strategy, hw: Hardware, model_flops: float, param_count: int, *,
                padded_vocab: int = 0, platform: str = "") -> Bound:
    """The bound for `cfg` (shardlm's models; a py: file's model gets its compute only) on strategy `s`, whose
    step costs `model_flops` over all devices, for a model of `param_count` parameters. With `padded_vocab` (the
    vocabulary as the model pads it for `s.tensor`), the model's matmuls are charged at the rates the hardware's
    table gives their shapes (`matmul_seconds`), else at peak. `platform`: what the step is compiled for, when
    known: XLA:CPU's collectives block (its step is compute plus traffic, nothing hidden) and it has no fused
    attention kernel; any other (or "") may hide every collective and fuse attention."""
    from shardlm.schedules.gpipe import microbatch_count  # imports JAX: planning_flags runs before JAX starts

    m, t = cfg.model, cfg.train
    if not m.preset.startswith("py:"):  # causal attention: fused kernels skip the masked half of its FLOPs
        model_flops -= 3 * m.n_layers * m.seq_len * m.n_heads * (head_size(m) + value_size(m)) \
            * t.batch_size * m.seq_len
    per_device = model_flops / s.devices
    compute = per_device / hw.peak_flops
    if padded_vocab and not m.preset.startswith("py:"):
        seconds, flops = matmul_seconds(cfg, s, hw, padded_vocab, fused_attention=platform != "cpu")
        compute = seconds + max(per_device - flops, 0.0) / hw.peak_flops  # the rest (experts, norms) at peak
    micro = microbatch_count(m.pipeline_microbatches, s.stage)
    iterations = micro * m.pipeline_repeats + s.stage - 1
    if s.stage > 1:
        compute *= iterations / (micro * m.pipeline_repeats)
    if m.preset.startswith("py:"):
        return Bound(compute, 0.0, platform != "cpu")
    dtype = 2 if m.dtype == "bfloat16" else 4
    experts = sparse_layer_count(m) * m.moe_experts * 3 * m.d_model * (m.moe_d_ff or m.d_mlp) \
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
    kv = 2 * rows * m.seq_len * (m.n_kv_heads or m.n_heads) // s.tensor * head_size(m) * dtype
    seconds = (
        _send(s, hw, ("fsdp", "expert", "context"), 2 * weights)  # gathered once, reduce-scattered once
        + _send(s, hw, expert_storage, 2 * expert_weights)
        + _send(s, hw, ("data",), 2 * (weights / storage + expert_weights / expert_shards))  # twice a gather's share
        + _send(s, hw, ("tensor",), 4 * layers * 2 * activation * t.grad_accum)
        + _send(s, hw, ("context",), layers * kv * t.grad_accum)
        + _ring_latency(s, hw, layers * t.grad_accum)
    )
    if s.stage > 1:
        seconds += _hand_offs(s, hw, 2 * iterations * activation / micro * t.grad_accum)
    if m.moe_experts and s.expert > 1:  # each sparse layer's tokens to their experts and back, forward and backward
        sparse = sparse_layer_count(m) // s.stage
        seconds += _send(s, hw, ("expert",), 4 * sparse * activation * m.moe_top_k * t.grad_accum)
    return Bound(compute, seconds, platform != "cpu")


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


def _ring_latency(s: Strategy, hw: Hardware, layers: int) -> float:
    """The latency of the ring's hand-offs on the context axis over `layers` layers, where the hardware's table does
    not measure permutes (the cost model then charges each its latency): a ring of c devices hands keys and
    values on c - 1 times forward, and c - 1 times backward beside c hand-offs of their gradients, counted here as
    if each pair travelled as one."""
    if s.context == 1 or hw.rates().collective_bytes_per_s("collective-permute", 2, 1) is not None:
        return 0.0
    return layers * (3 * s.context - 2) * hw.latency_s


def _hand_offs(s: Strategy, hw: Hardware, nbytes: float) -> float:
    """Seconds for a stage to hand `nbytes` to the next: across hosts when a stage spans whole hosts."""
    m, h = _group(s, ("stage",), hw.devices_per_node)
    return nbytes / (hw.inter_node_bw if h > 1 else hw.intra_node_bw)


def matmul_seconds(cfg, s: Strategy, hw: Hardware, padded_vocab: int, *, fused_attention: bool = True
                   ) -> tuple[float, float]:
    """(seconds, FLOPs) per device of the matmuls every step of `cfg` on `s` runs, forward and backward: the
    blocks' projections and MLP (the dense ones: a mixture's experts are left to the caller's peak), attention's
    two products over the causal half, and the output head. Each is charged at the rate the hardware's table
    gives (`perf.rates`) the largest shape it could take on `s`, so that no compiled kernel is faster:
    - rows: a device's sequences, not cut by microbatches or gradient accumulation (a larger M is never slower);
    - the projections as if merged (q, k and v in one, the gate and up in one), as XLA:GPU's dot merger may;
    - attention as `context` steps (a ring's; one without a context split), each two products forward and four
      backward of half a [T / context]^2 block per head and row, each charged at the rate of a whole block (a
      ring's chunks and a blockwise kernel's blocks are no larger) laid whichever way is fastest, or, where a
      fused kernel may run (`fused_attention`), its rate at that length if faster: small products are slow by
      their count, not their FLOPs;
    - in the compute dtype's column, or FP8's (twice bf16's rate) where the bound's hardware is FP8's.
    The three products of a weight (forward, the input's gradient, the weight's) have their own shapes."""
    m, t = cfg.model, cfg.train
    rates = hw.rates()
    fp8 = bool(hw.fp8_peak_flops) and hw.peak_flops >= hw.fp8_peak_flops  # held against the FP8 peak
    column = "f8e4m3" if fp8 else "f32" if m.dtype == "float32" else "bf16"
    rows = max(t.batch_size // (s.data * s.fsdp * s.expert), 1)
    tokens = rows * m.seq_len // s.context
    head_dim = head_size(m)
    inputs = family_of(m).mlp_matrices - 1  # the MLP's input projections (SwiGLU's gate and up), as one product
    dense = m.n_layers - sparse_layer_count(m)
    per_layer = family_of(m).attention_matrices(m, s.tensor)
    mlp = [(m.d_model, inputs * m.d_mlp // s.tensor), (m.d_mlp // s.tensor, m.d_model)]
    layers = m.n_layers // s.stage
    weights = ([(k, n, layers) for k, n in per_layer] + [(k, n, dense // s.stage) for k, n in mlp]
               + [(m.d_model, padded_vocab // s.tensor, 1)])
    seconds = flops = 0.0
    for k, n, times in weights:
        product = 2 * tokens * k * n
        for b, mm, nn, kk in ((1, tokens, n, k), (1, tokens, k, n), (1, k, n, tokens)):
            seconds += times * product / rates.gemm_flops_per_s(column, b, mm, nn, kk)
        flops += times * 3 * product
    # attention over the causal half, as `context` steps of a ring (one step without a context split), each step
    # half a [T / context]^2 block of work: two products forward (q k^T, p v), four backward
    chunk, heads = m.seq_len // s.context, rows * m.n_heads // s.tensor
    step = 2 * heads * chunk * (chunk // 2) * head_dim
    gemm_rate = max(rates.gemm_flops_per_s(column, heads, *dims) for dims in itertools.permutations(
        (chunk, chunk, head_dim)))  # whichever way round the compiler lays the product, the fastest
    for products, backward in ((2, False), (4, True)):
        rate = max(gemm_rate, rates.attention_flops_per_s(chunk, head_dim, backward) if fused_attention else 0)
        seconds += layers * s.context * products * step / rate
    flops += layers * s.context * 6 * step
    return seconds, flops
