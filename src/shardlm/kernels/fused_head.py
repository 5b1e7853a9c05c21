"""The output head and the language-modelling loss fused, per device: its tiling and its custom VJP. The model
(`shardlm.models.head`) says where the operands live under the mesh rules and runs this inside `shard_map`.

The output head and the language-modelling loss in one pass that never holds float32 logits for the whole
vocabulary at once unless they fit: Megatron's vocabulary-parallel cross entropy, in tiles as Liger's fused linear
cross entropy and "Cut Your Losses" (Wijmans et al. 2024) tile it. Math, with the per-device collectives written
out.

Design choices:
- Training's loss is the head and the cross entropy together, `head_loss(x, w, targets)`, under a custom VJP, in
  one of two schedules (`tiling` picks, per device, from the shapes and the platform; `Tiling.describe` says
  which, for `explain` and the compile report):
  - **Gradients in the forward pass** (Liger's): the tokens in blocks, each block against all of the device's
    vocabulary rows. A block's float32 logits give its log-sum-exp, so its softmax minus the one-hot target, the
    loss's gradient with respect to the logits, is known while they are live; the block's input gradient and its
    share of the weight's are multiplied out there and then. The backward pass only scales them by the upstream
    cotangent. Three head matmuls per step, as a plain head has. The working set is the device's whole head in
    the compute dtype (gathered over FSDP's axes once), its float32 gradient, and a block's logits.
  - **Logits recomputed in the backward pass**: the vocabulary in chunks (the outer loop) and the tokens in
    blocks (the inner), keeping per token a running max and sum of exponentials and the target's logit; the
    forward pass saves the input and the log-sum-exp, nothing of size [tokens, vocabulary]; the backward pass
    recomputes each chunk's logits (a fourth head matmul) to multiply out the gradients. A chunk's weight is
    gathered and its gradient reduce-scattered chunk by chunk, so no device ever holds the whole head, for the
    vocabularies whose head does not fit the first schedule's budget (Llama 3's 128,256 rows by 4,096 are 3 GiB
    gathered with their float32 gradient; 2 x 8192 tokens' float32 logits are 7.8 GiB a copy).
  The first wins wherever it fits, unless its blocks are so many that re-reading the head and its float32
  gradient once per block costs more memory traffic than the fourth matmul costs FLOPs (`FLOPS_PER_BYTE`: a GPU
  or TPU does a few hundred FLOPs in the time it moves a byte, a CPU a few). On a CPU, where the head of a
  GPT-2-vocabulary model is most of the step, the fourth matmul made training 1.5x slower.
- Recomputing, each device cuts its own rows of the vocabulary (all of them, or its tensor-parallel block) into
  chunks whose width is a multiple of 128 rows, and its tokens into blocks, so that a tile's float32 logits (a
  block's tokens by a chunk's rows) stay under `CHUNK_BYTES`. The input's float32 gradient [tokens, d] is read
  and written once per chunk, and a chunk's weight gradient [width, d] once per block, so the tiling minimises
  tokens x chunks + blocks x rows, the bytes moved over 8 d. Chunks alone, for the 262,144 tokens a pipeline's
  head sees per device (the 70B plan's), would be 251 chunks of 128 rows: skinny GEMMs, and 8 GiB of input
  gradient added 251 times (1.6 s of an H100's HBM per step). `model.loss_chunks` sets the chunk count instead,
  with one block (1: one tile, gradients in the forward pass). The last chunk starts early enough to end at the
  last row, and its rows an earlier chunk covered are masked: widths stay multiples of 128 whatever the
  vocabulary (Llama 3's 128,256 rows have no such divisor), which the GEMMs want, for at most 127 rows per chunk
  computed twice.
- Per device, inside `shard_map`: the weight (or a chunk of it) is cast to the compute dtype, gathered over the
  mesh axes that store the embedding dimension (FSDP's), used and dropped. Its gradient is computed in float32
  and summed over the devices that hold other tokens, reduce-scattered back into the stored shards in
  `reduce_dtype` (chunk by chunk when recomputing): each row is reduced once, so no more bytes cross than for
  one reduce-scatter of the whole gradient. The input's gradient is summed over the tensor devices once at the
  end (under XLA's automatic partitioning each chunk's partial sum would be all-reduced). Max, sum and target
  logit are combined over the tensor devices once per pass, or per block.
- The weight is read as stored (float32 master weights: `CAST_WHERE_READ` in the mixed-precision policy): the
  tied head reads the token table [vocab, embed], an untied one its own [embed, vocab].
- A 1F1B pipeline (`shardlm.schedules.one_f_one_b`) calls the head once per microbatch, where gathering each weight
  chunk and reducing its gradient would happen once per microbatch too. With `token_copies` the weight arrives as
  one copy per device of the tokens' mesh axes, gathered once by the caller (`sharding.copies_over`), and each
  device's gradient stays its copy's own until the caller's loop has ended and the copies are summed.
- Padded vocabulary rows (past `vocab_size`) get -inf logits: no probability, no gradient (in the forward
  schedule without a vocabulary split they are left out of the matmuls instead).
- On a CPU the forward schedule's blocks are also small enough for their logits to stay in the last-level cache
  (`FORWARD_TILE_BYTES`): the elementwise passes between the matmuls then cost little.
- Gradients computed in the forward pass are the loss's for a cotangent of 1, kept in the input's and the
  weight's dtypes; the backward pass multiplies them by the cotangent (gradient accumulation's and a pipeline's
  loss weights are such cotangents), exact for 1.
- Evaluation and generation keep the plain head (`CausalLM.__call__`): they need logits, or per-token losses.
"""

from __future__ import annotations

from typing import NamedTuple

import jax
import jax.numpy as jnp

from shardlm.accelerator import current
from shardlm.errors import ShardlmError
from shardlm.units import fmt_bytes

CHUNK_BYTES = 128 * 2**20  # recomputing: a tile's float32 logits per device, at most (when a divisor allows)
# Gradients in the forward pass: per device, the head in the compute dtype and its float32 gradient, and a token
# block's float32 logits and their gradient, at most.
FORWARD_BYTES = 2**30
# The FLOPs a device does in the time it moves one byte of its memory: what a head matmul saved is worth in bytes
# re-read. H100 SXM: 989 TFLOP/s (bfloat16, dense) over 3.35 TB/s; TPU v5p: 459 over 2.76; a CPU core: about
# 50 GFLOP/s (float32) over about 10 GB/s.
FLOPS_PER_BYTE = {"cpu": 5, "gpu": 295, "tpu": 166}
# Gradients in the forward pass on a CPU: a block's float32 logits, at most about a last-level cache, so that the
# elementwise passes between the matmuls read them from cache (GPT-2's head for 2,048 tokens on a 2-core EPYC with
# 32 MiB of L3: 1.32 s a step in one block, 1.13 s in 16 blocks of 25 MiB, 1.30 s in 32). An accelerator's fused
# kernels read them once whatever their size, and fewer blocks re-read the head fewer times.
FORWARD_TILE_BYTES = {"cpu": 32 * 2**20}


class Tiling(NamedTuple):
    """How one device runs the head and loss: chunks of `width` vocabulary rows (all of them in the forward
    schedule) by `blocks` token blocks; `in_forward`: gradients in the forward pass (three head matmuls), else
    logits recomputed in the backward pass (four)."""

    width: int
    blocks: int
    in_forward: bool

    def describe(self, rows: int, tokens: int) -> str:
        """The schedule in a line, with its bytes per device (`rows` and `tokens` as given to `tiling`)."""
        tile = tokens // self.blocks * self.width * 4
        cut = f"{self.blocks} block(s) of {tokens // self.blocks:,} tokens"
        if self.in_forward:
            return (f"gradients in the forward pass, three head matmuls: {cut} x all {rows:,} vocabulary rows, "
                    f"{fmt_bytes(tile)} of float32 logits a block")
        chunks = -(-rows // self.width)
        return (f"logits recomputed in the backward pass, four head matmuls: {chunks} chunk(s) of {self.width:,} "
                f"vocabulary rows x {cut}, {fmt_bytes(tile)} of float32 logits a tile")


def chunk_width(rows: int, tokens: int, requested: int = 0) -> int:
    """How many of a device's `rows` of the vocabulary one recomputed chunk holds, for its `tokens`: all of them
    if their float32 logits fit `CHUNK_BYTES`; else the rows over as many chunks as that takes (or `requested`
    chunks), rounded up to a multiple of 128 (the last chunk, which starts early, then recomputes at most 127
    rows per chunk)."""
    if requested:
        if requested > rows:
            raise ShardlmError(f"model.loss_chunks={requested} is more than the {rows} vocabulary rows each device "
                               "holds; choose at most that, or 0 (automatic)")
        n = requested
    else:
        n = -(-tokens * rows * 4 // CHUNK_BYTES)
    if n <= 1:
        return rows
    width = -(-rows // n)
    return min(rows, -(-width // 128) * 128) if not requested else width


def tiling(rows: int, tokens: int, requested: int = 0, budget: int = CHUNK_BYTES, *, d: int = 1,
           compute_bytes: int = 4, forward_budget: int = FORWARD_BYTES, flops_per_byte: float = FLOPS_PER_BYTE["gpu"],
           forward_tile: int | None = None) -> Tiling:
    """The schedule for a device's `rows` of the vocabulary, its `tokens` and the embedding width `d` (see the
    module docstring): `requested` chunks (`chunk_width`) and one block, recomputing (1: one tile, in the
    forward); otherwise gradients in the forward pass if they fit `forward_budget` (in blocks of at most
    `forward_tile` bytes of logits, if given), unless re-reading the head and its gradient once per block costs
    more than the fourth matmul saved (`flops_per_byte`); else recomputing."""
    if requested == 1:
        return Tiling(chunk_width(rows, tokens, 1), 1, True)
    if requested:
        return Tiling(chunk_width(rows, tokens, requested), 1, False)
    recompute = recompute_tiling(rows, tokens, budget)
    blocks = forward_blocks(rows, tokens, d, compute_bytes, forward_budget, forward_tile)
    if blocks is None:
        return recompute
    # Both costs in FLOPs over rows x d: the head matmuls, and the extra bytes each schedule moves at the
    # platform's FLOPs per byte (the head in the compute dtype read twice and its float32 gradient read and
    # written once per block; the input's float32 gradient once per chunk and a chunk's once per block).
    forward = 6 * tokens + flops_per_byte * blocks * (2 * compute_bytes + 8)
    chunks = -(-rows // recompute.width)
    recomputing = 8 * tokens + flops_per_byte * 8 * (tokens * chunks / rows + recompute.blocks)
    return Tiling(rows, blocks, True) if forward <= recomputing else recompute


def forward_blocks(rows: int, tokens: int, d: int, compute_bytes: int, budget: int, tile: int | None = None
                   ) -> int | None:
    """The fewest token blocks (a divisor of `tokens`) with which gradients in the forward pass fit `budget`: the
    head in the compute dtype and its float32 gradient, plus a block's float32 logits and their gradient in the
    compute dtype; and a block's float32 logits fit `tile`, if given and possible. None if even one token a block
    does not fit the budget."""
    room = budget - rows * d * (compute_bytes + 4)
    per_token = rows * (4 + compute_bytes)
    fits = [n for n in divisors(tokens) if tokens // n * per_token <= room]
    if not fits:
        return None
    return next((n for n in fits if tile is None or tokens // n * rows * 4 <= tile), fits[-1])


def recompute_tiling(rows: int, tokens: int, budget: int = CHUNK_BYTES) -> Tiling:
    """Recomputing, (chunk width, token blocks): one tile if the float32 logits fit `budget`; otherwise the tiling
    within it that moves the fewest bytes, tokens x chunks + blocks x rows (in units of 8 d bytes), and of those
    the fewest tiles."""
    if tokens * rows * 4 <= budget:
        return Tiling(rows, 1, False)
    best, splits = None, divisors(tokens)
    for width in sorted({min(w, rows) for w in range(128, rows + 128, 128)}):
        blocks = next((n for n in splits if tokens // n * width * 4 <= budget), None)
        if blocks is None:
            break
        chunks = -(-rows // width)
        key = (tokens * chunks + blocks * rows, chunks * blocks)
        if best is None or key < best[0]:
            best = (key, width, blocks)
    return Tiling(chunk_width(rows, tokens), 1, False) if best is None else Tiling(best[1], best[2], False)


def divisors(n: int) -> list[int]:
    """The divisors of `n`, ascending."""
    small = [k for k in range(1, int(n**0.5) + 1) if n % k == 0]
    return small + [n // k for k in reversed(small) if k * k != n]


class Schedule(NamedTuple):
    """What one device does for a head input of a given shape: its `tiling`, of its `rows` of the vocabulary and
    its `tokens`."""

    tiling: Tiling
    rows: int
    tokens: int

    def describe(self) -> str:
        return self.tiling.describe(self.rows, self.tokens)



def schedule_for(rows: int, tokens: int, d: int, compute_dtype, chunks: int, budget: int, forward_budget: int,
                 flops_per_byte: float | None) -> Schedule:
    """The schedule for a device holding `rows` of the vocabulary and `tokens`, on the platform being compiled
    for."""
    platform = current().platform
    if flops_per_byte is None:
        flops_per_byte = FLOPS_PER_BYTE.get(platform, FLOPS_PER_BYTE["gpu"])
    return Schedule(tiling(rows, tokens, chunks, budget, d=d, compute_bytes=jnp.dtype(compute_dtype).itemsize,
                           forward_budget=forward_budget, flops_per_byte=flops_per_byte,
                           forward_tile=FORWARD_TILE_BYTES.get(platform)), rows, tokens)


class Axes:
    """The mesh axes a device's part of the loss is summed over: those splitting the tokens, the vocabulary, and
    the head's embedding dimension (each a tuple of axes of size > 1)."""

    def __init__(self, token: tuple, vocab: tuple, embed: tuple, other_token: tuple | None = None):
        self.token, self.vocab, self.embed = token, vocab, embed
        # the tokens' axes that do not store the head, over which its gradient is summed (none for token copies)
        self.other_token = tuple(a for a in token if a not in embed) if other_token is None else other_token


class PerDevice:
    """One device's loss and its custom VJP: its tokens x [b, t, d], its shard of the head, its targets [b, t].
    (The custom VJP's functions close over no traced value: each derives what it needs from its arguments.)"""

    def __init__(self, schedule: Schedule, *, tied, vocab_size, compute_dtype, reduce_dtype, n_tokens, axes: Axes,
                 z_loss: bool = False):
        self.z_loss = z_loss  # also the mean of log^2 Z (PaLM's z-loss): the loss is then (cross entropy, z)
        self.width, self.blocks, self.in_forward = schedule.tiling
        self.rows = schedule.rows
        self.tied, self.vocab_size, self.compute_dtype, self.n_tokens, self.axes = (
            tied, vocab_size, compute_dtype, n_tokens, axes)
        self.reduce_dtype = reduce_dtype or compute_dtype  # auto: as any weight's gradient, in the compute dtype
        self.row_axis = 0 if tied else 1
        self.contract, self.dx_contract, self.dw_contract = (
            ("btd,vd->btv", "btv,vd->btd", "btv,btd->vd") if tied else ("btd,dv->btv", "btv,dv->btd", "btv,btd->dv"))

    def loss(self, x, w, targets):
        """The mean cross entropy; with `z_loss`, (it, the mean of log^2 Z)."""

        @jax.custom_vjp
        def loss(x, w, targets):
            return self.forward(x, w, targets)[0]

        def loss_forward(x, w, targets):
            if self.in_forward:
                value, grads = self.forward_with_gradients(x, w, targets)
                return value, (grads, None)
            value, lse = self.forward(x, w, targets)
            return value, (x, w, (targets, lse))

        def loss_backward(saved, g):
            if self.in_forward:  # the gradients for a cotangent of 1 (of each term), scaled
                grads, _ = saved
                g = g if self.z_loss else (g,)
                dx = sum(d.astype(jnp.float32) * gi for (d, _), gi in zip(grads, g))
                dw = sum(d.astype(jnp.float32) * gi for (_, d), gi in zip(grads, g))
                return dx.astype(grads[0][0].dtype), dw.astype(grads[0][1].dtype), None
            x, w, (targets, lse) = saved
            return (*self.backward(x, w, targets, lse, g), None)

        loss.defvjp(loss_forward, loss_backward)
        return loss(x, w, targets)

    # --- the pieces of every pass -----------------------------------------------------------------------------

    def start(self, j):
        """Chunk j's first row: j x width, or earlier for the last chunk, so that it ends at the last row."""
        return jnp.minimum(j * self.width, self.rows - self.width)

    def weight_chunk(self, w, j):
        """Chunk j of the head in the compute dtype, whole over the embedding dimension: [width, d] or [d, width]."""
        c = jax.lax.dynamic_slice_in_dim(w, self.start(j), self.width, axis=self.row_axis).astype(self.compute_dtype)
        return jax.lax.all_gather(c, self.axes.embed, axis=1 - self.row_axis, tiled=True) if self.axes.embed else c

    def chunk_logits(self, x, c, j):
        """Chunk j's float32 logits [b, t, width] (-inf for padded rows and rows an earlier chunk covered) and its
        vocabulary ids [width]."""
        logits = jnp.einsum(self.contract, x, c, preferred_element_type=jnp.float32)
        local = self.start(j) + jnp.arange(self.width)
        ids = local + (jax.lax.axis_index(self.axes.vocab) * self.rows if self.axes.vocab else 0)
        return jnp.where((ids < self.vocab_size) & (local >= j * self.width), logits, -jnp.inf), ids

    def input_share(self, dlogits, c):
        """A tile's share of the input's gradient, [b, t, d] in float32: computed in the compute dtype, as any
        matmul's (XLA:GPU's untuned deviceless compile costs a float32-output GEMM at a tenth of the tensor
        cores' rate), summed in float32."""
        return jnp.einsum(self.dx_contract, dlogits, c).astype(jnp.float32)

    def weight_share(self, x, dlogits):
        """A block's share of the weight's gradient, in float32. In float32 it is computed transposed, x^T times
        the logits' gradient, which XLA:CPU's GEMM reads as laid out (the other order wrote a transposed copy of
        each block's gradient: GPT-2's head 12% slower on a 2-core EPYC); 16-bit operands keep the other order,
        as XLA:CPU's plain dot, which runs the transposed form, takes no 16-bit operands with a float32 result."""
        if jnp.dtype(self.compute_dtype) == jnp.float32:
            transposed = jnp.einsum("btd,btv->dv", x, dlogits, preferred_element_type=jnp.float32)
            return transposed.T if self.tied else transposed
        return jnp.einsum(self.dw_contract, dlogits, x, preferred_element_type=jnp.float32)

    def reduced(self, dc):
        """A chunk's float32 weight gradient, summed over the devices of other tokens in `reduce_dtype` and
        scattered into the stored shard."""
        dc = dc.astype(self.reduce_dtype)
        if self.axes.embed:  # summed over the tokens of the devices sharing the shard, scattered into it
            dc = jax.lax.psum_scatter(dc, self.axes.embed, scatter_dimension=1 - self.row_axis, tiled=True)
        if self.axes.other_token:
            dc = jax.lax.psum(dc, self.axes.other_token)
        return dc

    def weight_zeros(self, d, width=None):
        """A chunk's float32 weight gradient (of `width` rows, default the chunks'), zero, typed as the sum over
        tokens and rows it will hold."""
        width = width or self.width
        return _varying(jnp.zeros((width, d) if self.tied else (d, width), jnp.float32),
                        tuple(dict.fromkeys(self.axes.token + self.axes.vocab)))

    def in_blocks(self, a):
        """[b, t, ...] -> [blocks, 1, b t / blocks, ...]: the tokens' blocks, each a batch of one row."""
        return a.reshape(self.blocks, 1, a.shape[0] * a.shape[1] // self.blocks, *a.shape[2:])

    def over_blocks(self, body, carry, xs):
        """`body` over the token blocks (a scan; with one block, called once)."""
        if self.blocks == 1:
            carry, ys = body(carry, jax.tree.map(lambda a: a[0], xs))
            return carry, jax.tree.map(lambda a: a[None], ys)
        return jax.lax.scan(body, carry, xs)

    def mean(self, per_token_losses):
        """The mean over every device's tokens of the (invariant over vocabulary devices) per-token losses."""
        total = per_token_losses.sum()
        if self.axes.token:
            total = jax.lax.psum(total, self.axes.token)
        return total / self.n_tokens

    def value(self, lse, target_logit):
        """The loss from the per-token log-sum-exp and target logit: the mean cross entropy, and with `z_loss` the
        mean of log^2 Z beside it."""
        ce = self.mean(lse - target_logit)
        return (ce, self.mean(lse * lse)) if self.z_loss else ce

    def dlogits(self, logits, lse, hit, g):
        """The logits' gradient for the loss's cotangent `g` ((g_ce, g_z) with `z_loss`): softmax minus the
        one-hot target times g_ce / tokens, plus 2 log Z softmax times g_z / tokens."""
        p = jnp.exp(logits - lse[..., None])
        if not self.z_loss:
            return (p - hit) * (g / self.n_tokens)
        g_ce, g_z = g
        return ((p - hit) * g_ce + 2 * lse[..., None] * p * g_z) / self.n_tokens

    # --- gradients in the forward pass ------------------------------------------------------------------------

    def forward_with_gradients(self, x, w, targets):
        """(loss, dx, dw) for a cotangent of 1: block by block against all of the device's rows, each block's
        softmax minus its one-hot targets multiplied out while its logits are live.

        Each pass over a block's logits is a pass over memory (on a CPU, where this schedule matters most, the
        elementwise passes cost as much as a matmul), so there are as few as the math allows: the matmul writes
        them; the max and the sum of exponentials read them; the gradient reads and writes them; the two matmuls
        read it. Without a vocabulary split the padding rows are left out of the matmul rather than masked
        (nothing to mask), and the target's logit is gathered rather than selected from a full-width mask."""
        axes, tied = self.axes, self.tied
        real = self.rows if axes.vocab else min(self.rows, self.vocab_size)  # rows that are not padding
        c = self.weight_chunk(w, 0)  # all of the device's rows
        c = c if real == self.rows else (c[:real] if tied else c[:, :real])
        first = jax.lax.axis_index(axes.vocab) * self.rows if axes.vocab else 0  # this device's first row's id

        def block(dc, xs):
            x, targets = xs
            logits = jnp.einsum(self.contract, x, c, preferred_element_type=jnp.float32)
            if axes.vocab:  # the last device's rows past the vocabulary: no probability, no gradient
                logits = jnp.where(first + jnp.arange(real) < self.vocab_size, logits, -jnp.inf)
            m = logits.max(-1)
            if axes.vocab:
                m = jax.lax.pmax(m, axes.vocab)
            base = jnp.where(jnp.isfinite(m), m, 0.0)
            s = jnp.exp(logits - base[..., None]).sum(-1)
            local = targets - first  # the target's row on this device, if it holds it
            held = (local >= 0) & (local < real)
            picked = jnp.take_along_axis(logits, jnp.clip(local, 0, real - 1)[..., None], axis=-1)[..., 0]
            target_logit = jnp.where(held, picked, 0.0)
            if axes.vocab:
                s, target_logit = jax.lax.psum(s, axes.vocab), jax.lax.psum(target_logit, axes.vocab)
            lse = base + jnp.log(s)
            hit = jnp.arange(real) == local[..., None]
            shares = []
            for g in ((1.0, 0.0), (0.0, 1.0)) if self.z_loss else (1.0,):  # each term's, for a cotangent of 1
                dlogits = self.dlogits(logits, lse, hit, g).astype(self.compute_dtype)
                shares.append((self.weight_share(x, dlogits), self.input_share(dlogits, c)))
            dc = tuple(d + share for d, (share, _) in zip(dc, shares))
            return dc, (lse, target_logit, tuple(dx for _, dx in shares))

        terms = 2 if self.z_loss else 1
        dc, (lse, target_logit, dx) = self.over_blocks(block, (self.weight_zeros(x.shape[-1], real),) * terms,
                                                       (self.in_blocks(x), self.in_blocks(targets)))
        grads = []
        for dc_i, dx_i in zip(dc, dx):
            if axes.vocab:
                dx_i = jax.lax.psum(dx_i, axes.vocab)
            if real < self.rows:  # the padding rows' gradient: zero
                dc_i = jnp.pad(dc_i, ((0, self.rows - real), (0, 0)) if tied else ((0, 0), (0, self.rows - real)))
            grads.append((dx_i.reshape(x.shape).astype(x.dtype), self.reduced(dc_i).astype(w.dtype)))
        return self.value(lse, target_logit), tuple(grads)

    # --- logits recomputed in the backward pass ---------------------------------------------------------------

    def forward(self, x, w, targets):
        """(loss, the log-sum-exp per token [blocks, 1, tokens / blocks]) over chunks of rows by blocks of tokens,
        with running max and sum."""
        axes = self.axes

        def chunk(carry, j):
            c = self.weight_chunk(w, j)

            def block(_, xs):
                x, targets, m, s, target_logit = xs
                logits, ids = self.chunk_logits(x, c, j)
                m_new = jnp.maximum(m, logits.max(-1))
                base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a device whose rows are all padding: m = -inf
                s = s * jnp.exp(m - base) + jnp.exp(logits - base[..., None]).sum(-1)
                hit = (ids == targets[..., None]) & jnp.isfinite(logits)
                return None, (m_new, s, target_logit + jnp.where(hit, logits, 0.0).sum(-1))

            return self.over_blocks(block, None, (self.in_blocks(x), self.in_blocks(targets), *carry))[1], None

        zeros = _varying(self.in_blocks(jnp.zeros_like(targets, jnp.float32)), axes.vocab)
        n = -(-self.rows // self.width)
        (m, s, target_logit), _ = jax.lax.scan(chunk, (zeros - jnp.inf, zeros, zeros), jnp.arange(n))
        if axes.vocab:  # the log-sum-exp and the target's logit over every tensor device's rows
            top = jax.lax.pmax(m, axes.vocab)
            s = jax.lax.psum(s * jnp.exp(m - top), axes.vocab)
            m, target_logit = top, jax.lax.psum(target_logit, axes.vocab)
        lse = m + jnp.log(s)
        return self.value(lse, target_logit), lse

    def backward(self, x, w, targets, lse, g):
        """(dx, dw): each chunk's logits again, block by block, turned into softmax minus one-hot times g / tokens."""
        axes, row_axis = self.axes, self.row_axis

        def chunk(carry, j):
            dx, dw = carry
            c = self.weight_chunk(w, j)

            def block(carry, xs):
                dc, dx = carry
                i, x, targets, lse = xs
                logits, ids = self.chunk_logits(x, c, j)
                hit = (ids == targets[..., None]) & jnp.isfinite(logits)
                dlogits = self.dlogits(logits, lse, hit, g).astype(self.compute_dtype)
                # block i's rows of the input's gradient, added to in place in the carry (one fusion: XLA:GPU
                # writes the scatter-add as a dynamic-update-slice of the block it reads). As the inner loop's
                # output they were a new buffer each chunk, copied into the chunks' carry (compiled for 8 H100s,
                # GPT-2 124M's 64 x 1024 tokens per device: 201 MB read and written per chunk, 1.4 ms a step).
                dx = dx.at[i].add(self.input_share(dlogits, c))
                return (dc + jnp.einsum(self.dw_contract, dlogits, x, preferred_element_type=jnp.float32), dx), None

            (dc, dx), _ = self.over_blocks(block, (self.weight_zeros(x.shape[-1]), dx),
                                           (jnp.arange(self.blocks), self.in_blocks(x), self.in_blocks(targets), lse))
            dc = self.reduced(dc)
            # rows an earlier chunk covered have zero gradient here: adding keeps that chunk's
            before = jax.lax.dynamic_slice_in_dim(dw, self.start(j), self.width, axis=row_axis)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, before + dc.astype(dw.dtype), self.start(j), axis=row_axis)
            return (dx, dw), None

        dx = _varying(self.in_blocks(jnp.zeros_like(x, jnp.float32)), axes.vocab)
        n = -(-self.rows // self.width)
        (dx, dw), _ = jax.lax.scan(chunk, (dx, jnp.zeros_like(w)), jnp.arange(n))
        if axes.vocab:
            dx = jax.lax.psum(dx, axes.vocab)
        return dx.reshape(x.shape).astype(x.dtype), dw


def _varying(x: jax.Array, axes: tuple) -> jax.Array:
    """`x` typed as varying over mesh `axes` too (a loop carry that will take values that differ over them)."""
    return jax.lax.pcast(x, axes, to="varying") if axes else x
