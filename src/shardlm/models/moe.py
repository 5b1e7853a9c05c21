"""A mixture-of-experts (MoE) sparse MLP for the Llama family: SwiGLU experts, top-k routing, dropless dispatch,
expert parallelism over the `expert` mesh axis. Math only, with logical axis names.

Design choices:
- Routing is float32 whatever the compute dtype: logits = x @ router (the router is stored and used in float32),
  softmax over the experts, top-k, and for k > 1 the k weights renormalised to sum to one (Mixtral's). With k = 1
  the weight is the raw probability (Switch Transformer's): renormalised it would be 1.0 for every token, and the
  router would learn only from the load-balancing loss, never from the language model's. The load-balancing
  loss is Switch Transformer's, E * sum_e f_e * P_e, with f_e the share of the N * k assignments that went to
  expert e and P_e the mean router probability of e: perfectly balanced routing gives exactly 1.0 for any k.
  N is the global batch's token count: under a mesh, per-device counts and probability sums are `psum`med over
  the mesh axes that split tokens before dividing, so the sharded layer reports the same number as one device.
- Dropless: no capacity factor, no token is ever dropped. The N * k assignments are sorted by expert (stable
  argsort), the token rows gathered in that order, and each SwiGLU matrix is one grouped matmul over the sorted
  rows with group sizes = tokens per expert (an expert with no tokens is a group of size 0, which contributes
  nothing and receives an exactly zero gradient). The results are un-sorted, weighted and summed over k.
- The grouped matmul's kernel (`shardlm.kernels.grouped`, `model.moe_kernel`): auto picks a Pallas Triton kernel
  on NVIDIA GPUs and Megablox on TPUs (work proportional to the routed rows), XLA's `ragged_dot` on the CPU
  (which XLA:CPU and XLA:GPU lower densely, every row by every local expert). The GPU being compiled for decides
  (`shardlm.accelerator.current`), so a compile for an H100 from a CPU host picks what a run on one would; off
  their platform the kernels run in Pallas's interpret mode (the CPU tests).
- Without an active mesh, the layer is that local computation. With one (`shardlm.sharding.active_mesh()`),
  routing and dispatch run per device inside `jax.shard_map` over the whole mesh: x enters split by the active
  rules for ("batch", "seq", "act_embed"), the router replicated, the experts split over the axes the rules give
  `experts` and `mlp` (`expert_axes`: the built-in table's P("expert", None, "tensor"), down P("expert", "tensor",
  None)). No mesh axis is named here. Entering the shard_map all-gathers the FSDP split of the expert weights once
  per call, as FSDP gathers any weight for its use.
- Expert parallelism (EP = mesh.shape["expert"] > 1): each expert device holds E / EP experts, expert e on
  device e // (E / EP). Every device routes its own T tokens, then sends each assignment to the device holding
  its expert with `jax.lax.all_to_all` over `expert`, and the results come back by the same exchange
  (`model.moe_exchange=ragged` sends only the rows in use with `ragged_all_to_all` on GPUs and TPUs,
  `shardlm.kernels.exchange`; not the default, see `exchange_kind`). The send buffer is [EP, C, D], sorted by
  destination then expert and zero-padded, and the [EP, E / EP] per-(destination, local expert) counts travel
  alongside. A receiver regroups the EP x C rows by local expert (padding rows last, outside every group: zero
  rows that produce zero and receive no weight gradient), runs the ragged matmuls with its local experts, and
  un-does each permutation on the way back. The exchange [EP, C, ...] -> [EP, C, ...] (block i to device i, block
  j received from device j) is its own inverse, so the same function sends and returns.
- Dropless needs no buffer of the worst case (`model.moe_dropless=rounds`, the default). Top-k picks k distinct
  experts per token, of which at most min(k, E / EP) live on one device, so one source may send one destination
  up to T x min(k, E / EP) rows: a buffer that size (`moe_dropless=buffer`) receives T x min(EP x k, E) rows,
  min(EP, E / k) times the balanced share T x k, and the experts' activations over it, which the backward pass
  keeps, grow as much (3.7x the dense step's peak compiled for 8 H100s at `benchmarks/moe.py`'s shape, where
  rounds are 1.6x). In rounds, the first exchange carries up to the balanced share, C = ceil(T x k / EP) rows per
  pair, and what routing sends past it goes in later rounds of C / 8 rows (`round_sizes`), as many as the busiest
  pair of devices needs (the same count on every device, a `pmax`): a `while` loop whose count is known only
  once routing is. The first round is differentiated as any layer (its activations kept by the remat policy);
  the later ones by a `custom_vjp` that keeps nothing of them and runs each round again under `jax.vjp` in the
  backward pass. Under balanced routing the overflow is a few rows per pair, one small round; the share of
  assignments that travelled in later rounds is logged (`moe_overflow`). The cost model counts the loop's body
  once: a step's estimate carries one later round's exchanges and passes, and the grouped matmuls T x k rows in
  all (each assignment is computed once, in whichever round).
- Capacity (`capacity_factor` > 0, GShard's and Switch's, for the exchange): each device sends each expert device
  at most C = ceil(factor x T x k / EP) rows (its balanced share times the factor) in one exchange, and no later
  rounds. Within a destination's block the assignments are in expert order, then token order;
  those past C are dropped: they are not sent, their output is zero (the token keeps its residual and its other
  experts), and their count (`MoeStats.dropped`) is logged. Without an expert split nothing is exchanged and the
  layer stays dropless.
- Expert devices are data-parallel for everything else: the rule table splits "batch" over (data, fsdp,
  expert), so EP needs the batch split over `expert` too (said by name otherwise: replicated tokens would come
  back from the exchange typed as differing per expert device).
- Tensor parallelism inside experts: d_ff is split over `tensor` (column-parallel gate/up, row-parallel down).
  Tokens are replicated over `tensor`, so every tensor device routes and dispatches identically and the down
  projection's partial sums are `psum`med over `tensor`. The psum comes after the combine, on [T, D] rather
  than on the [EP * C, D] expert outputs: every step between is linear (exchange, gather, weighted sum), so it
  is the same sum over min(EP, E / k) * k times fewer rows.
- The optional shared expert (DeepSeek's) is a dense SwiGLU applied to every token and added to the routed
  output; it stays outside the shard_map, sharded by the ordinary rules like the dense Llama MLP.
"""

import math
from functools import partial
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.accelerator import current
from shardlm.errors import ShardlmError
from shardlm.kernels.exchange import exchange, ragged_exchange
from shardlm.kernels.grouped import grouped_matmul
from shardlm.kernels.rows import Routes, from_slots, permute, to_slots
from shardlm.models import remat
from shardlm.models.params import param, use
from shardlm.models.precision import Precision
from shardlm.models.routing import Routing, route
from shardlm.sharding import active_mesh, active_spec, constrain
from shardlm.sharding.rules import as_axes


class MoeStats(NamedTuple):
    """What a call reports besides its output, all for the global batch."""

    aux_loss: jax.Array  # scalar float32, 1.0 when perfectly balanced
    expert_tokens: jax.Array  # [num_experts] float32: token-assignments routed to each expert
    dropped: jax.Array  # scalar float32: assignments past the exchange's capacity, dropped (0 when dropless)
    overflow: jax.Array  # scalar float32: assignments that travelled in a dropless exchange's later rounds


# --- routing and the load-balancing loss -------------------------------------------------------------------------


def expert_counts(experts: jax.Array, num_experts: int) -> jax.Array:
    """[num_experts] float32: how many of the assignments in `experts` (any shape) went to each expert."""
    return jnp.bincount(experts.reshape(-1), length=num_experts).astype(jnp.float32)


def aux_from_sums(counts: jax.Array, prob_sums: jax.Array, n_tokens: int, top_k: int) -> jax.Array:
    """E * sum_e f_e * P_e from the assignment counts and the probability sums over `n_tokens` tokens."""
    f = counts / (n_tokens * top_k)
    p = prob_sums / n_tokens
    return counts.shape[0] * jnp.sum(f * p)


def load_balancing_loss(probs: jax.Array, experts: jax.Array, num_experts: int) -> jax.Array:
    """Switch-style auxiliary loss of one (unsharded) batch: probs [N, E], experts [N, k]."""
    n, k = experts.shape
    return aux_from_sums(expert_counts(experts, num_experts), probs.sum(0), n, k)


# --- the dropless expert computation -----------------------------------------------------------------------------


def inverse_permutation(order: jax.Array) -> jax.Array:
    """inv with inv[order[i]] = i: a gather by it undoes a gather by `order` (cheaper than a second argsort)."""
    return jnp.zeros_like(order).at[order].set(jnp.arange(order.shape[0], dtype=order.dtype))


def sort_by_expert(experts: jax.Array, num_experts: int) -> tuple[jax.Array, jax.Array]:
    """experts [N, k] -> (order [N * k]: flat assignment indices grouped by expert, group sizes [E] int32).
    Stable, so each expert's tokens keep their order."""
    flat = experts.reshape(-1)
    return jnp.argsort(flat, stable=True), jnp.bincount(flat, length=num_experts).astype(jnp.int32)


def exchange_kind(requested: str) -> str:
    """How routed rows travel for `model.moe_exchange=requested`: auto is the fixed all-to-all. The ragged one sends
    fewer bytes but is slower by both compilers' schedules (compiled for 8 H100s at `benchmarks/moe.py`'s shape,
    shardlm's estimate: expert 4 x fsdp 2 88.2 ms fixed against 95.5 ms ragged, whose 13.6 ms of exchange run
    exposed where 7.8 of the fixed one's 30.2 ms do; expert 8 88.4 against 86.6 ms; under a capacity of 1.25
    58.8 against 62.7 ms; on a v5p-8 159.6 against 158.8 and 131.7 against 133.5 ms), with 0.85-1.05 GiB more
    per device, and XLA:GPU's scheduler gives no estimate for it."""
    return "all_to_all" if requested == "auto" else requested


def grouped_kernel(requested: str) -> str:
    """The grouped matmul's kernel for `model.moe_kernel=requested` on the platform being compiled for."""
    if requested != "auto":
        return requested
    return {"gpu": "triton", "tpu": "megablox"}.get(current().platform, "xla")


def experts_ragged(rows: jax.Array, w_gate: jax.Array, w_up: jax.Array, w_down: jax.Array,
                   group_sizes: jax.Array, kernel: str = "xla", expected_rows: int | None = None) -> jax.Array:
    """SwiGLU of rows [M, D] grouped by expert (group g: the next group_sizes[g] rows) with that expert's
    weights [G, D, F], [G, D, F], [G, F, D] -> [M, D]. Rows past the groups come out zero. `kernel`: the grouped
    matmul's (`grouped_kernel`); `expected_rows`: how many of the M rows routing is expected to fill (the cost
    model's; default all)."""
    home = {"triton": "gpu", "megablox": "tpu"}.get(kernel)  # where a Pallas kernel compiles; interpreted elsewhere
    interpret = home is not None and current().platform != home
    matmul = partial(grouped_matmul, group_sizes=group_sizes, kernel=kernel, interpret=interpret,
                     expected_rows=expected_rows)
    gate, up = (remat.named(matmul(rows, w), remat.MLP_HIDDEN) for w in (w_gate, w_up))
    return matmul(jax.nn.silu(gate) * up, w_down)


def sorted_routes(order: jax.Array) -> Routes:
    """Every assignment in a buffer of its own, in expert-sorted order: slot i holds assignment order[i]."""
    everywhere = jnp.ones(order.shape, bool)
    return Routes(order, everywhere, inverse_permutation(order), everywhere)


def dropless_local(x_flat, weights, experts, w_gate, w_up, w_down, kernel: str = "xla") -> jax.Array:
    """Every expert on this device: x_flat [N, D] with its routing -> [N, D]."""
    order, sizes = sort_by_expert(experts, w_gate.shape[0])
    routes = sorted_routes(order)
    rows = remat.named(to_slots(x_flat, routes, weights.shape[1]), remat.MOE_DISPATCH)
    out = experts_ragged(rows, w_gate, w_up, w_down, sizes, kernel)
    return from_slots(remat.named(out, remat.MOE_OUT), weights, routes).astype(x_flat.dtype)


# --- expert parallelism: dispatch over the expert axis ----------------------------------------------------------


class Dispatch(NamedTuple):
    """Where this device's assignments go, in expert-sorted order."""

    order: jax.Array  # [A] flat assignment indices sorted by expert (so by destination, then local expert)
    dest: jax.Array  # [A] the expert device of each sorted assignment
    slot: jax.Array  # [A] its row within the block sent to that device
    counts: jax.Array  # [EP, E / EP] int32: assignments per (destination, local expert)
    inverse: jax.Array  # [A] where each flat assignment is in the sorted order (`inverse_permutation(order)`)


def plan_dispatch(experts: jax.Array, num_experts: int, ep: int) -> Dispatch:
    """Expert e lives on device e // (E / EP) as its local expert e % (E / EP)."""
    local = num_experts // ep
    order, sizes = sort_by_expert(experts, num_experts)
    counts = sizes.reshape(ep, local)
    dest_sizes = counts.sum(1)
    dest_start = jnp.cumsum(dest_sizes) - dest_sizes
    dest = experts.reshape(-1)[order] // local
    slot = jnp.arange(order.shape[0], dtype=jnp.int32) - dest_start[dest]
    return Dispatch(order, dest, slot, counts, inverse_permutation(order))


def window_routes(plan: Dispatch, lo, size: int) -> Routes:
    """The buffer [EP x size] of one exchange round: block d holds the rows [lo, lo + size) of what this device
    sends device d, which are consecutive in the sorted order (by destination, then local expert)."""
    dest_sizes = plan.counts.sum(1)
    row = lo + jnp.arange(size, dtype=jnp.int32)
    used = row[None, :] < dest_sizes[:, None]  # [EP, size]
    at = jnp.where(used, (jnp.cumsum(dest_sizes) - dest_sizes)[:, None] + row[None, :], 0)
    inside = (plan.slot >= lo) & (plan.slot < lo + size)  # [A], sorted order
    slot = jnp.where(inside, plan.dest * size + plan.slot - lo, 0)
    return Routes(plan.order[at].reshape(-1), used.reshape(-1), slot[plan.inverse], inside[plan.inverse])


def window_counts(counts: jax.Array, lo, size: int) -> jax.Array:
    """[EP, E / EP] assignments per (destination, local expert) -> how many of them are among rows [lo, lo + size)
    of their destination's block (the block holds its local experts' rows in order)."""
    start = jnp.cumsum(counts, axis=1) - counts
    return jnp.clip(jnp.minimum(start + counts, lo + size) - jnp.maximum(start, lo), 0).astype(counts.dtype)


def regroup(recv_counts: jax.Array, capacity: int) -> tuple[jax.Array, jax.Array]:
    """The received rows [EP * capacity] (source s's block holds its rows for local expert 0, then 1, ..., then
    padding) -> (order grouping them by local expert, padding last; group sizes [E / EP] int32)."""
    ends = jnp.cumsum(recv_counts, axis=1)  # [EP, E / EP]: where each local expert's rows end in each block
    row = jnp.arange(capacity)
    local_expert = (row[None, :, None] >= ends[:, None, :]).sum(-1)  # [EP, capacity]; E / EP marks padding
    return jnp.argsort(local_expert.reshape(-1), stable=True), recv_counts.sum(0).astype(jnp.int32)


def experts_remote(sent: jax.Array, counts: jax.Array, w_gate, w_up, w_down, axis: str, kernel: str = "xla",
                   expected_rows: int | None = None, ragged: bool = False) -> jax.Array:
    """The receiving side: send buffer [EP, C, D] and its counts -> the results in the same layout, back home.
    `ragged` sends only each block's rows in use, both ways (`shardlm.kernels.exchange`)."""
    ep, capacity, d = sent.shape
    recv_counts = exchange(counts, axis)
    sizes_out, sizes_in = counts.sum(1), recv_counts.sum(1)  # rows sent to, and received from, each device

    def send(blocks, sizes, received):
        if not ragged:
            return exchange(blocks, axis)
        return ragged_exchange(blocks, sizes, received, axis, expected_rows=expected_rows,
                               emulate=current().platform == "cpu")

    received = send(sent, sizes_out, sizes_in)
    order, sizes = regroup(recv_counts, capacity)
    inverse = inverse_permutation(order)
    rows = remat.named(permute(received.reshape(ep * capacity, d), order, inverse), remat.MOE_DISPATCH)
    out = experts_ragged(rows, w_gate, w_up, w_down, sizes, kernel, expected_rows)
    back = permute(out, inverse, order).reshape(ep, capacity, d)
    return remat.named(send(back, sizes_in, sizes_out), remat.MOE_OUT)


def exchange_capacity(t: int, k: int, num_experts: int, ep: int, capacity_factor: float = 0.0) -> int:
    """Rows one device sends one expert device: the most it can (dropless: T x min(k, E / EP), see the
    docstring), or with a capacity factor its balanced share T x k / EP times the factor, if that is fewer."""
    dropless = t * min(k, num_experts // ep)
    return dropless if capacity_factor <= 0 else min(dropless, max(1, math.ceil(capacity_factor * t * k / ep)))


LATER_ROUND_SHARE = 8  # a later round carries 1 / 8 of the first round's rows: what overflows is a small share


def round_sizes(t: int, k: int, num_experts: int, ep: int) -> tuple[int, int]:
    """Rows per pair of devices in a dropless exchange's first round (the balanced share T x k / EP) and in each
    later round (an eighth of it), each at most the worst case (`exchange_capacity`)."""
    first = exchange_capacity(t, k, num_experts, ep, 1.0)
    return first, max(1, min(math.ceil(first / LATER_ROUND_SHARE), exchange_capacity(t, k, num_experts, ep) - first))


class Exchange(NamedTuple):
    """How an expert-parallel layer's rows travel: over which axis, to which kernel, by which collective."""

    axis: str
    kernel: str = "xla"
    ragged: bool = False


def exchange_round(x_flat, weights, w_gate, w_up, w_down, plan: Dispatch, lo, size: int, how: Exchange,
                   expected_rows: int | None = None) -> jax.Array:
    """The assignments among rows [lo, lo + size) of each destination's block: sent, run by their experts and
    brought back -> [T, D] float32, each token's weighted outputs summed (the other assignments add nothing)."""
    ep, routes = plan.counts.shape[0], window_routes(plan, lo, size)
    sent = to_slots(x_flat, routes, weights.shape[1]).reshape(ep, size, x_flat.shape[1])
    back = experts_remote(sent, window_counts(plan.counts, lo, size), w_gate, w_up, w_down, how.axis, how.kernel,
                          expected_rows=expected_rows, ragged=how.ragged)
    return from_slots(back.reshape(ep * size, -1), weights, routes)


@partial(jax.custom_vjp, nondiff_argnums=(0, 1, 2))
def later_rounds(first: int, size: int, how: Exchange, x_flat, weights, w_gate, w_up, w_down, plan: Dispatch,
                 rounds) -> jax.Array:
    """The rows past each block's `first` in `rounds` exchanges of `size` rows -> [T, D] float32. A `while` loop
    (its count is known only when routing is), differentiated by a second one that runs each round again under
    `jax.vjp`: nothing of a round is kept for the backward pass (see the docstring)."""
    return _later_rounds_forward(first, size, how, x_flat, weights, w_gate, w_up, w_down, plan, rounds)


def _later_round(first, size, how, plan, r):
    """Later round r (from 0) as a function of (x_flat, weights, w_gate, w_up, w_down). For the cost model its
    grouped matmuls expect no rows: each assignment is computed once in all the rounds, and balanced routing (the
    cost model's expectation, as for the first round) fills the first; a later round still costs its exchanges
    and its passes over the buffers."""
    return lambda *primals: exchange_round(*primals, plan, first + r * size, size, how, expected_rows=0)


def _zeros_like_in_place(x: jax.Array) -> jax.Array:
    """Zeros shaped as `x`, computed from it (x * 0, which XLA does not fold for floats) rather than broadcast:
    XLA hoists a broadcast zero out of the scan over layers as a loop invariant and keeps it for the whole step,
    then copies it into each loop that sums into it (one weight's gradient, 28 MiB a buffer at
    `benchmarks/moe.py`'s shape). Exact for finite x, as the sums' starts are."""
    return x * jnp.zeros((), x.dtype)


def _later_rounds_forward(first, size, how, x_flat, weights, w_gate, w_up, w_down, plan, rounds):
    primals = (x_flat, weights, w_gate, w_up, w_down)
    return jax.lax.fori_loop(0, rounds, lambda r, y: y + _later_round(first, size, how, plan, r)(*primals),
                             _zeros_like_in_place(x_flat.astype(jnp.float32)))


def _later_rounds_fwd(first, size, how, x_flat, weights, w_gate, w_up, w_down, plan, rounds):
    y = _later_rounds_forward(first, size, how, x_flat, weights, w_gate, w_up, w_down, plan, rounds)
    return y, (x_flat, weights, w_gate, w_up, w_down, plan, rounds)


def _later_rounds_bwd(first, size, how, residuals, dy):
    *primals, plan, rounds = residuals

    def add_round(r, sums):
        grads = jax.vjp(_later_round(first, size, how, plan, r), *primals)[1](dy)
        return tuple(s + g for s, g in zip(sums, grads))

    sums = jax.lax.fori_loop(0, rounds, add_round, tuple(_zeros_like_in_place(p) for p in primals))
    return (*sums, None, None)


later_rounds.defvjp(_later_rounds_fwd, _later_rounds_bwd)


def expert_parallel(x_flat, weights, experts, w_gate, w_up, w_down, *, num_experts: int, ep: int, how: Exchange,
                    capacity_factor: float = 0.0, rounds: bool = True,
                    sync_axes: tuple[str, ...] = ()) -> tuple[jax.Array, jax.Array, jax.Array]:
    """This device's tokens x_flat [T, D], its local experts' weights [E / EP, ...] -> ([T, D], this device's
    dropped assignments, and those that travelled in later rounds). Dropless (`capacity_factor` 0) in `rounds` (a
    first of the balanced share, then as many small ones as the busiest pair of devices needs, the same count on
    every device of `sync_axes`), or in one exchange of the worst case; else one exchange of the capacity."""
    t, k = weights.shape
    plan = plan_dispatch(experts, num_experts, ep)
    worst = exchange_capacity(t, k, num_experts, ep)
    if capacity_factor > 0 or not rounds:
        size = exchange_capacity(t, k, num_experts, ep, capacity_factor)
        # balanced routing fills T * k of the EP * C rows received (the cost model's expectation)
        y = exchange_round(x_flat, weights, w_gate, w_up, w_down, plan, 0, size, how,
                           expected_rows=min(t * k, ep * size))
        dropped = plan.counts.sum() - window_counts(plan.counts, 0, size).sum()
        return y.astype(x_flat.dtype), dropped.astype(jnp.float32), jnp.float32(0.0)
    first, later = round_sizes(t, k, num_experts, ep)
    y = exchange_round(x_flat, weights, w_gate, w_up, w_down, plan, 0, first, how, expected_rows=min(t * k, ep * first))
    if first >= worst:  # the balanced share is the worst case: one round carries everything
        return y.astype(x_flat.dtype), jnp.float32(0.0), jnp.float32(0.0)
    busiest = plan.counts.sum(1).max()  # the most rows this device sends one device
    n = jnp.maximum(busiest - first + later - 1, 0) // later
    n = jax.lax.pmax(n, sync_axes) if sync_axes else n
    y = y + later_rounds(first, later, how, x_flat, weights, w_gate, w_up, w_down, plan, n)
    overflow = plan.counts.sum() - window_counts(plan.counts, 0, first).sum()
    return y.astype(x_flat.dtype), jnp.float32(0.0), overflow.astype(jnp.float32)


# --- the layer, without and with a mesh --------------------------------------------------------------------------


def global_stats(probs, experts, num_experts: int, n_tokens: int, token_axes: tuple[str, ...],
                 dropped: jax.Array | float = 0.0, overflow: jax.Array | float = 0.0) -> MoeStats:
    """The stats of the global batch of `n_tokens` tokens, from this device's share split over `token_axes`."""
    counts, prob_sums = expert_counts(experts, num_experts), probs.sum(0)
    dropped, overflow = jnp.float32(dropped), jnp.float32(overflow)
    if token_axes:
        counts, prob_sums, dropped, overflow = jax.lax.psum((counts, prob_sums, dropped, overflow), token_axes)
    return MoeStats(aux_from_sums(counts, prob_sums, n_tokens, experts.shape[1]), counts, dropped, overflow)


def moe_local(x, router, w_gate, w_up, w_down, routing: Routing, kernel: str = "xla"
              ) -> tuple[jax.Array, MoeStats]:
    """The routed experts on one device: x [B, S, D] -> ([B, S, D], stats). `router` is (weights, bias or None)."""
    b, s, d = x.shape
    x_flat = x.reshape(b * s, d)
    weights, experts, probs = route(x_flat, router[0], routing, router[1])
    y = dropless_local(x_flat, weights, experts, w_gate, w_up, w_down, kernel)
    return y.reshape(b, s, d), global_stats(probs, experts, w_gate.shape[0], b * s, ())


def expert_axes(mesh, w_gate: jax.Array) -> tuple[str | None, str | None]:
    """The mesh axes the active rules compute the experts' `experts` and `mlp` dimensions over (the expert split and
    the tensor split of their hidden size), each None where the mesh splits nothing over it (a size-1 axis in a
    spec would only make shard_map type values as differing over it)."""
    spec = active_spec("experts", "embed", "mlp", shape=w_gate.shape)

    def one(entry) -> str | None:
        live = [a for a in as_axes(entry) if mesh.shape[a] > 1]
        if len(live) > 1:
            raise ShardlmError(f"the rule table splits a mixture's experts over {live}; the exchange runs over one "
                               "mesh axis: map `experts` (and `mlp`) to one axis each")
        return live[0] if live else None

    return one(spec[0]), one(spec[2])


def check_expert_parallel(mesh, num_experts: int, d_ff: int, token_axes: tuple[str, ...], ep_axis: str | None,
                          tp_axis: str | None) -> None:
    ep, tp = mesh.shape[ep_axis] if ep_axis else 1, mesh.shape[tp_axis] if tp_axis else 1
    if num_experts % ep:
        raise ShardlmError(f"{num_experts} experts (model.moe_experts) cannot be split over mesh.expert={ep}; "
                           "choose an expert degree that divides the number of experts")
    if d_ff % tp:
        raise ShardlmError(f"the experts' hidden size {d_ff} (model.moe_d_ff, or model.d_mlp when 0) cannot be "
                           f"split over mesh.tensor={tp}; choose a tensor degree that divides it")
    if ep > 1 and ep_axis not in token_axes:
        raise ShardlmError(f"expert parallelism (mesh.expert={ep}) needs the batch split over the expert devices "
                           "too: make the batch rows divisible by mesh.data x mesh.fsdp x mesh.expert")


def moe_sharded(mesh, x, router, w_gate, w_up, w_down, routing: Routing, kernel: str = "xla",
                capacity_factor: float = 0.0, exchange_kind: str = "all_to_all",
                dropless: str = "rounds") -> tuple[jax.Array, MoeStats]:
    """The routed experts per device inside `jax.shard_map` over the whole active mesh (see the docstring)."""
    x_spec = active_spec("batch", "seq", "act_embed", shape=x.shape)
    token_axes = as_axes(x_spec[0]) + as_axes(x_spec[1])
    num_experts, d_ff = w_gate.shape[0], w_gate.shape[2]
    ep_axis, tp_axis = expert_axes(mesh, w_gate)
    check_expert_parallel(mesh, num_experts, d_ff, token_axes, ep_axis, tp_axis)
    n_tokens = x.shape[0] * x.shape[1]  # global shape: the whole batch

    def per_device(x, router, w_gate, w_up, w_down):
        b, s, d = x.shape
        x_flat = x.reshape(b * s, d)
        weights, experts, probs = route(x_flat, router[0], routing, router[1])
        dropped = overflow = 0.0
        if ep_axis is None:
            y = dropless_local(x_flat, weights, experts, w_gate, w_up, w_down, kernel)
        else:
            y, dropped, overflow = expert_parallel(
                x_flat, weights, experts, w_gate, w_up, w_down, num_experts=num_experts, ep=mesh.shape[ep_axis],
                how=Exchange(ep_axis, kernel, exchange_kind == "ragged"), capacity_factor=capacity_factor,
                rounds=dropless == "rounds", sync_axes=token_axes)
        if tp_axis is not None:  # the down projection's partial sums over d_ff (after the linear combine)
            y = jax.lax.psum(y, tp_axis)
        return y.reshape(b, s, d), global_stats(probs, experts, num_experts, n_tokens, token_axes, dropped,
                                                overflow)

    w_in, w_out = P(ep_axis, None, tp_axis), P(ep_axis, tp_axis, None)
    # check_vma=False: a Pallas kernel's outputs carry no varying-axes type, which the check needs (as for splash),
    # and under a pipeline's vmap the rows vary over the stages, which it refuses to combine with values that do not
    # (as for the ring). Unchecked, the transpose divides each output's gradient by the devices it is replicated
    # over and sums each input's over the devices it is replicated over: the same gradients.
    return jax.shard_map(per_device, mesh=mesh, in_specs=(x_spec, P(), w_in, w_in, w_out),
                         out_specs=(x_spec, MoeStats(P(), P(), P(), P())), check_vma=False)(
        x, router, w_gate, w_up, w_down)


class MoeMLP(nnx.Module):
    """A sparse SwiGLU MLP: each token goes to `top_k` of `num_experts` experts, plus an optional dense shared
    expert. Returns (y, MoeStats); the caller adds `aux_loss` (times its coefficient) to the training loss."""

    def __init__(self, d_model: int, d_ff: int, num_experts: int, top_k: int, *, shared_expert: bool,
                 n_layers: int, precision: Precision, rngs: nnx.Rngs, kernel: str = "auto",
                 capacity_factor: float = 0.0, exchange: str = "auto", dropless: str = "rounds",
                 routing: Routing | None = None):
        """`routing` (default: top_k by softmax, renormalised) overrides `top_k`. Under sigmoid routing the layer
        holds DeepSeek's per-expert bias (`router_bias`, float32, zero at the start): it moves which experts are
        chosen, takes no gradient, and is moved toward balance between steps by the trainer
        (`balance_experts`)."""
        routing = routing or Routing(top_k)
        if not 1 <= routing.top_k <= num_experts:
            raise ShardlmError(f"top_k={routing.top_k} must be between 1 and the number of experts ({num_experts})")
        self.precision, self.kernel, self.capacity_factor = precision, kernel, capacity_factor
        self.routing = routing
        param_dtype = precision.param
        self.exchange, self.dropless = exchange, dropless
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * n_layers))  # GPT-2's residual scaling, as SwiGLU
        self.router = param(rngs, init, (d_model, num_experts), ("embed", None), jnp.float32, read_in_float32=True)
        self.router_bias = (param(rngs, nnx.initializers.zeros_init(), (num_experts,), (None,), jnp.float32,
                                  read_in_float32=True) if routing.score == "sigmoid" else None)
        e, d, f = num_experts, d_model, d_ff
        self.w_gate = param(rngs, init, (e, d, f), ("experts", "embed", "mlp"), param_dtype)
        self.w_up = param(rngs, init, (e, d, f), ("experts", "embed", "mlp"), param_dtype)
        self.w_down = param(rngs, out_init, (e, f, d), ("experts", "mlp", "embed"), param_dtype)
        if shared_expert:
            self.shared_gate = param(rngs, init, (d, f), ("embed", "mlp"), param_dtype)
            self.shared_up = param(rngs, init, (d, f), ("embed", "mlp"), param_dtype)
            self.shared_down = param(rngs, out_init, (f, d), ("mlp", "embed"), param_dtype)
        else:
            self.shared_gate = self.shared_up = self.shared_down = None

    def __call__(self, x: jax.Array) -> tuple[jax.Array, MoeStats]:
        """x [batch, seq, d_model] -> (y [batch, seq, d_model] in x.dtype, stats of the global batch)."""
        router = (self.router[...].astype(jnp.float32),
                  None if self.router_bias is None else self.router_bias[...].astype(jnp.float32))
        experts = tuple(use(w, self.precision.compute) for w in (self.w_gate, self.w_up, self.w_down))
        xc = x.astype(self.precision.compute)
        mesh, kernel = active_mesh(), grouped_kernel(self.kernel)
        if mesh is None:
            y, stats = moe_local(xc, router, *experts, self.routing, kernel)
        else:
            y, stats = moe_sharded(mesh, xc, router, *experts, self.routing, kernel, self.capacity_factor,
                                   exchange_kind(self.exchange), self.dropless)
        if self.shared_gate is not None:
            y = y + self._shared(xc)
        return y.astype(x.dtype), stats

    def _shared(self, x: jax.Array) -> jax.Array:
        """The dense shared expert, sharded by the rules like the dense Llama MLP, its projections by the policy."""
        p = self.precision
        gate, up = p.denses("btd,df->btf", x, [use(w, p.compute) for w in (self.shared_gate, self.shared_up)])
        h = jax.nn.silu(gate) * up
        return p.dense("btf,fd->btd", constrain(h, "batch", "seq", "act_mlp"), use(self.shared_down, p.compute))
