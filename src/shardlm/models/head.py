"""The output head and the language-modelling loss in one pass that never holds float32 logits for the whole
vocabulary: Megatron's vocabulary-parallel cross entropy, chunked over the vocabulary as Liger's fused linear
cross entropy and "Cut Your Losses" (Wijmans et al. 2024) chunk it. Math, with the per-device collectives
written out.

Design choices:
- Training's loss is the head and the cross entropy together, `head_loss(x, w, targets)`, under a custom VJP. The
  forward pass runs over chunks of the vocabulary keeping, per token, a running max and sum of exponentials (the
  log-sum-exp) and the target's logit; it saves the head's input and the log-sum-exp per token, nothing of size
  [tokens, vocabulary]. The backward pass runs over the chunks again: it recomputes each chunk's logits (one more
  head matmul, the price of not keeping them), turns them into the chunk's softmax minus the one-hot target, and
  multiplies out the input's and the weight's gradients. Llama 3.1 8B at 2 x 8192 tokens per device and a 128k
  vocabulary held 7.8 GiB per float32 copy of its logits, and the loss and its gradient about two copies.
- Each device cuts its own rows of the vocabulary (all of them, or its tensor-parallel block) into chunks whose
  width is a multiple of 128 rows, and its tokens into blocks, so that a tile's float32 logits (a block's tokens
  by a chunk's rows) stay under `CHUNK_BYTES` (`tiling`). The chunks are the outer loop, the blocks the inner:
  the input's float32 gradient [tokens, d] is read and written once per chunk, and a chunk's weight gradient
  [width, d] once per block, so the tiling minimises tokens x chunks + blocks x rows, the bytes moved over 8 d.
  Chunks alone, for the 262,144 tokens a pipeline's head sees per device (the 70B plan's), would be 251 chunks of
  128 rows: skinny GEMMs, and 8 GiB of input gradient added 251 times (1.6 s of an H100's HBM per step).
  `model.loss_chunks` sets the chunk count instead, with one block. The last chunk starts early enough to end at
  the last row, and its rows an earlier chunk covered are masked: widths stay multiples of 128 whatever the
  vocabulary (Llama 3's 128,256 rows have no such divisor), which the GEMMs want, for at most 127 rows per chunk
  computed twice.
- Per device, inside `shard_map`: a weight chunk is cast to the compute dtype, gathered over the mesh axes that
  store the embedding dimension (FSDP's), used and dropped. Its gradient is computed in float32 and summed over
  the devices that hold other tokens, reduce-scattered back into the stored shards chunk by chunk, in
  `reduce_dtype`: each chunk is reduced once, so no more bytes cross than for one reduce-scatter of the whole
  gradient, and no device holds the whole head or its gradient. The input's gradient is accumulated on each
  device over the chunks and summed over the tensor devices once at the end (under XLA's automatic partitioning
  each chunk's partial sum would be all-reduced). Max, sum and target logit are combined over the tensor devices
  once per pass.
- The weight is read as stored (float32 master weights: `CAST_WHERE_READ` in the mixed-precision policy): the
  tied head reads the token table [vocab, embed], an untied one its own [embed, vocab].
- A 1F1B pipeline (`shardlm.models.one_f_one_b`) calls the head once per microbatch, where gathering each weight
  chunk and reducing its gradient would happen once per microbatch too. With `token_copies` the weight arrives as
  one copy per device of the tokens' mesh axes, gathered once by the caller (`sharding.copies_over`), and each
  device's gradient stays its copy's own until the caller's loop has ended and the copies are summed.
- Padded vocabulary rows (past `vocab_size`) get -inf logits: no probability, no gradient.
- Evaluation and generation keep the plain head (`CausalLM.__call__`): they need logits, or per-token losses.
"""

from __future__ import annotations

import jax
import jax.numpy as jnp
from jax.sharding import PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.sharding import active_mesh, active_spec, active_storage_spec
from shardlm.sharding.rules import as_axes

CHUNK_BYTES = 128 * 2**20  # a chunk's float32 logits per device, at most (when a divisor of the rows allows)


def chunk_width(rows: int, tokens: int, requested: int = 0) -> int:
    """How many of a device's `rows` of the vocabulary one chunk holds, for its `tokens`: all of them if their
    float32 logits fit `CHUNK_BYTES`; else the rows over as many chunks as that takes (or `requested` chunks),
    rounded up to a multiple of 128 (the last chunk, which starts early, then recomputes at most 127 rows per
    chunk)."""
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


def tiling(rows: int, tokens: int, requested: int = 0, budget: int = CHUNK_BYTES) -> tuple[int, int]:
    """(chunk width, token blocks) for a device's `rows` of the vocabulary and its `tokens` (see the module
    docstring): one tile if the float32 logits fit `budget`; `requested` chunks (`chunk_width`) and one block;
    otherwise the tiling within the budget that moves the fewest bytes, tokens x chunks + blocks x rows (in units
    of 8 d bytes), and of those the fewest tiles. Blocks divide the tokens."""
    if requested:
        return chunk_width(rows, tokens, requested), 1
    if tokens * rows * 4 <= budget:
        return rows, 1
    divisors = [n for n in range(1, tokens + 1) if tokens % n == 0]
    best = None
    for width in sorted({min(w, rows) for w in range(128, rows + 128, 128)}):
        blocks = next((n for n in divisors if tokens // n * width * 4 <= budget), None)
        if blocks is None:
            break
        chunks = -(-rows // width)
        key = (tokens * chunks + blocks * rows, chunks * blocks)
        if best is None or key < best[0]:
            best = (key, width, blocks)
    return (chunk_width(rows, tokens), 1) if best is None else best[1:]


def head_loss(x: jax.Array, w: jax.Array, targets: jax.Array, *, tied: bool, vocab_size: int, compute_dtype,
              reduce_dtype=None, chunks: int = 0, budget: int = CHUNK_BYTES, token_copies: bool = False
              ) -> jax.Array:
    """The mean cross entropy of `targets` [batch, T] under logits x @ head: x [batch, T, embed] (the final norm's
    output, in the compute dtype), `w` the head as stored ([vocab, embed] tied, [embed, vocab] untied). See the
    module docstring. With `token_copies`, `w` is instead one copy per device of the tokens' mesh axes
    ([copies, ...], `sharding.copies_over(w, names, token_axes(x.shape))`), whole over the embedding dimension,
    and each device's gradient stays its own copy's: nothing is gathered or reduced for the weight."""
    names = ("vocab", "embed") if tied else ("embed", "vocab")
    n_tokens = targets.size
    mesh = active_mesh()
    if mesh is None:
        return _per_device(x, w[0] if token_copies else w, targets, tied=tied, vocab_size=vocab_size,
                           compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, chunks=chunks, budget=budget,
                           n_tokens=n_tokens, axes=_Axes((), (), ()))
    x_spec = active_spec("batch", "seq", "act_embed", shape=x.shape)
    w_spec = active_storage_spec(*names, shape=w.shape[1:] if token_copies else w.shape)
    live = lambda entry: tuple(a for a in as_axes(entry) if mesh.shape[a] > 1)  # noqa: E731
    tokens = token_axes(x.shape)
    vocab_entry, embed_entry = (w_spec[0], w_spec[1]) if tied else (w_spec[1], w_spec[0])
    if token_copies:  # each device's own copy, whole over the embedding dimension
        axes = _Axes(tokens, live(vocab_entry), (), other_token=())
        w_spec = P(tokens or None, *((axes.vocab or None, None) if tied else (None, axes.vocab or None)))
    else:
        axes = _Axes(tokens, live(vocab_entry), live(embed_entry))
        missing = set(axes.embed) - set(tokens)
        if missing:  # the weight's gradient is reduce-scattered over its embed axes, which must hold other tokens
            raise ShardlmError(f"the output head's embedding dimension is split over {sorted(missing)}, which do "
                               "not split the batch; the fused loss needs the rule table's embed axes to split "
                               "tokens")
        w_spec = P(*(live(entry) or None for entry in w_spec))
    # size-1 axes split nothing, and would only type the values as varying over them
    x_spec = P(*(live(entry) or None for entry in x_spec))
    t_spec = P(x_spec[0], x_spec[1])

    def run(x, w, t):
        return _per_device(x, w[0] if token_copies else w, t, tied=tied, vocab_size=vocab_size,
                           compute_dtype=compute_dtype, reduce_dtype=reduce_dtype, chunks=chunks, budget=budget,
                           n_tokens=n_tokens, axes=axes)

    return jax.shard_map(run, mesh=mesh, in_specs=(x_spec, w_spec, t_spec), out_specs=P())(x, w, targets)


def token_axes(shape: tuple) -> tuple[str, ...]:
    """The mesh axes (of more than one device) that split the tokens of a head input of `shape` [batch, T, embed]
    under the active rules: those a `token_copies` head's copies are one per device of. () outside them."""
    mesh = active_mesh()
    if mesh is None:
        return ()
    spec = active_spec("batch", "seq", "act_embed", shape=shape)
    return tuple(a for entry in spec[:2] for a in as_axes(entry) if mesh.shape[a] > 1)


class _Axes:
    """The mesh axes a device's part of the loss is summed over: those splitting the tokens, the vocabulary, and
    the head's embedding dimension (each a tuple of axes of size > 1)."""

    def __init__(self, token: tuple, vocab: tuple, embed: tuple, other_token: tuple | None = None):
        self.token, self.vocab, self.embed = token, vocab, embed
        # the tokens' axes that do not store the head, over which its gradient is summed (none for token copies)
        self.other_token = tuple(a for a in token if a not in embed) if other_token is None else other_token


def _per_device(x, w, targets, *, tied, vocab_size, compute_dtype, reduce_dtype, chunks, budget, n_tokens,
                axes: _Axes):
    """One device's loss: its tokens x [b, t, d], its shard of the head, its targets [b, t]. (The custom VJP's
    functions close over no traced value: each derives what it needs from its arguments.)"""
    rows = w.shape[0] if tied else w.shape[1]  # this device's vocabulary rows
    b, t, d = x.shape
    width, blocks = tiling(rows, b * t, chunks, budget)
    n = -(-rows // width)
    row_axis = 0 if tied else 1
    reduce_dtype = reduce_dtype or compute_dtype  # auto: as any weight's gradient, in the compute dtype
    contract, dx_contract, dw_contract = (("btd,vd->btv", "btv,vd->btd", "btv,btd->vd") if tied else
                                          ("btd,dv->btv", "btv,dv->btd", "btv,btd->dv"))

    def start(j):
        """Chunk j's first row: j x width, or earlier for the last chunk, so that it ends at the last row."""
        return jnp.minimum(j * width, rows - width)

    def weight_chunk(w, j):
        """Chunk j of the head in the compute dtype, whole over the embedding dimension: [width, d] or [d, width]."""
        c = jax.lax.dynamic_slice_in_dim(w, start(j), width, axis=row_axis).astype(compute_dtype)
        return jax.lax.all_gather(c, axes.embed, axis=1 - row_axis, tiled=True) if axes.embed else c

    def chunk_logits(x, c, j):
        """Chunk j's float32 logits [b, t, width] (-inf for padded rows and rows an earlier chunk covered) and its
        vocabulary ids [width]."""
        logits = jnp.einsum(contract, x, c, preferred_element_type=jnp.float32)
        local = start(j) + jnp.arange(width)
        ids = local + (jax.lax.axis_index(axes.vocab) * rows if axes.vocab else 0)
        return jnp.where((ids < vocab_size) & (local >= j * width), logits, -jnp.inf), ids

    def in_blocks(a):
        """[b, t, ...] -> [blocks, 1, b t / blocks, ...]: the tokens' blocks, each a batch of one row."""
        return a.reshape(blocks, 1, b * t // blocks, *a.shape[2:])

    def over_blocks(body, carry, xs):
        """`body` over the token blocks (a scan; with one block, called once)."""
        if blocks == 1:
            carry, ys = body(carry, jax.tree.map(lambda a: a[0], xs))
            return carry, jax.tree.map(lambda a: a[None], ys)
        return jax.lax.scan(body, carry, xs)

    def forward(x, w, targets):
        def chunk(carry, j):
            c = weight_chunk(w, j)

            def block(_, xs):
                x, targets, m, s, target_logit = xs
                logits, ids = chunk_logits(x, c, j)
                m_new = jnp.maximum(m, logits.max(-1))
                base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)  # a device whose rows are all padding: m = -inf
                s = s * jnp.exp(m - base) + jnp.exp(logits - base[..., None]).sum(-1)
                hit = (ids == targets[..., None]) & jnp.isfinite(logits)
                return None, (m_new, s, target_logit + jnp.where(hit, logits, 0.0).sum(-1))

            return over_blocks(block, None, (in_blocks(x), in_blocks(targets), *carry))[1], None

        zeros = _varying(in_blocks(jnp.zeros_like(targets, jnp.float32)), axes.vocab)
        (m, s, target_logit), _ = jax.lax.scan(chunk, (zeros - jnp.inf, zeros, zeros), jnp.arange(n))
        if axes.vocab:  # the log-sum-exp and the target's logit over every tensor device's rows
            top = jax.lax.pmax(m, axes.vocab)
            s = jax.lax.psum(s * jnp.exp(m - top), axes.vocab)
            m, target_logit = top, jax.lax.psum(target_logit, axes.vocab)
        lse = m + jnp.log(s)
        total = (lse - target_logit).sum()
        if axes.token:
            total = jax.lax.psum(total, axes.token)
        return total / n_tokens, lse

    @jax.custom_vjp
    def loss(x, w, targets):
        return forward(x, w, targets)[0]

    def loss_forward(x, w, targets):
        value, lse = forward(x, w, targets)
        return value, (x, w, targets, lse)

    def loss_backward(saved, g):
        x, w, targets, lse = saved
        scale = g / n_tokens

        def chunk(carry, j):
            dx, dw = carry
            c = weight_chunk(w, j)

            def block(carry, xs):
                dc, dx = carry
                i, x, targets, lse = xs
                logits, ids = chunk_logits(x, c, j)
                hit = (ids == targets[..., None]) & jnp.isfinite(logits)
                dlogits = ((jnp.exp(logits - lse[..., None]) - hit) * scale).astype(compute_dtype)
                # each tile's share in the compute dtype, as any matmul's (XLA:GPU's untuned deviceless compile
                # costs a float32-output GEMM at a tenth of the tensor cores' rate), summed in float32
                share = jnp.einsum(dx_contract, dlogits, c).astype(jnp.float32)
                # block i's rows of the input's gradient, added to in place in the carry (one fusion: XLA:GPU
                # writes the scatter-add as a dynamic-update-slice of the block it reads). As the inner loop's
                # output they were a new buffer each chunk, copied into the chunks' carry (compiled for 8 H100s,
                # GPT-2 124M's 64 x 1024 tokens per device: 201 MB read and written per chunk, 1.4 ms a step).
                dx = dx.at[i].add(share)
                return (dc + jnp.einsum(dw_contract, dlogits, x, preferred_element_type=jnp.float32), dx), None

            dc_zeros = _varying(jnp.zeros((width, d) if tied else (d, width), jnp.float32),
                                tuple(dict.fromkeys(axes.token + axes.vocab)))  # a sum over tokens and rows
            (dc, dx), _ = over_blocks(block, (dc_zeros, dx),
                                      (jnp.arange(blocks), in_blocks(x), in_blocks(targets), lse))
            dc = dc.astype(reduce_dtype)
            if axes.embed:  # summed over the tokens of the devices sharing the shard, scattered into it
                dc = jax.lax.psum_scatter(dc, axes.embed, scatter_dimension=1 - row_axis, tiled=True)
            if axes.other_token:
                dc = jax.lax.psum(dc, axes.other_token)
            # rows an earlier chunk covered have zero gradient here: adding keeps that chunk's
            before = jax.lax.dynamic_slice_in_dim(dw, start(j), width, axis=row_axis)
            dw = jax.lax.dynamic_update_slice_in_dim(dw, before + dc.astype(dw.dtype), start(j), axis=row_axis)
            return (dx, dw), None

        dx = _varying(in_blocks(jnp.zeros_like(x, jnp.float32)), axes.vocab)
        (dx, dw), _ = jax.lax.scan(chunk, (dx, jnp.zeros_like(w)), jnp.arange(n))
        if axes.vocab:
            dx = jax.lax.psum(dx, axes.vocab)
        return dx.reshape(x.shape).astype(x.dtype), dw, None

    loss.defvjp(loss_forward, loss_backward)
    return loss(x, w, targets)


def _varying(x: jax.Array, axes: tuple) -> jax.Array:
    """`x` typed as varying over mesh `axes` too (a loop carry that will take values that differ over them)."""
    return jax.lax.pcast(x, axes, to="varying") if axes else x
