"""Causal attention in blocks, in plain JAX, that never holds a [T, T] score matrix: the flash-attention algorithm
(Dao et al. 2022) written with `lax` loops, for the backends without a fused kernel (XLA:CPU; XLA:GPU and XLA:TPU
inside the context ring until their own kernels take over) and as the ring's per-chunk kernel.

Design choices:
- Documents packed in one sequence (`model.document_mask`): with each row's document ids (`q_seg`, `kv_seg`, [b,
  T]) a key is visible only within its query's document too, and a block whose rows' ids do not overlap is
  skipped like a block above the diagonal (ids only grow along a stretch of the sequence, so a document's blocks
  are a band around the diagonal).
- Causality is by position, not by index: `q_pos` [tq] and `kv_pos` [tk] give each row's place in the whole
  sequence, and key j is visible to query i when kv_pos[j] <= q_pos[i]. One kernel then serves a whole sequence
  (positions 0..T-1), a context-parallel device's chunk against another device's chunk, and the zigzag layout
  (`shardlm.kernels.ring`), where a device's rows are two separate stretches of the sequence.
- Blocks of queries against blocks of keys: the forward pass keeps, per query, a running max, sum of exponentials
  and weighted sum of values (the online softmax), in float32; it saves q, k, v, the output and the log-sum-exp
  per query and head, nothing of size [T, T]. A block with no visible key (above the diagonal) is skipped with
  `lax.cond`, so the causal half costs nothing.
- Any length, in ceil(T / block) blocks (`blocking`): T rows are cut into n = ceil(T / block) blocks of
  ceil(T / n) rows, rounded up to a multiple of 8 (at most `block`), and the rows past T are padding: a padded key
  sits at a position after every query (no query sees it), a padded query before every key (it sees none: output
  0, and its rows are dropped, so its gradient is zero). Shrinking the block to a divisor of T instead, as this
  kernel once did, cuts a prime length into blocks of 1 row (T = 1031 took 17-19x the time of 1024, measured).
  Balanced blocks rather than full ones keep the padding under 8 rows per block (1031 in blocks of 512 would be
  1536 rows; balanced, 3 blocks of 344: 1032). 8 rows are a float32 tile's sublanes on a TPU (the row granularity
  XLA:TPU lays a block out in, whatever its size), and any length that is a multiple of 8 per block (1024, 4096,
  640, ...) needs no padding.
- The output of a chunk (`chunk_forward`) is float32 with its log-sum-exp: partial results over different keys (the
  ring's steps) merge exactly by their log-sum-exps (`merge`) before the one cast to the compute dtype. A row that
  sees no key has log-sum-exp -inf and output 0, and merges as nothing. A whole sequence's (`blockwise_attention`)
  has nothing to merge and is cast at once.
- The backward pass (a `custom_vjp`) recomputes each block's probabilities from q, k and the saved log-sum-exp, as
  flash attention's does; the log-sum-exp's own cotangent (from a merge) enters through D = rowsum(dO * O) - dlse.
  Matmul operands are in the inputs' dtype with float32 accumulation, as a fused kernel's.
- What `blockwise_attention`'s backward pass keeps of the forward pass, the output (in the inputs' dtype) and the
  log-sum-exp, is named `residual_name`, as the fused kernels' residuals are (`shardlm.kernels.attention`): a remat
  policy that saves that name keeps them, and the backward pass runs no second forward pass (unnamed, every named
  policy, `none` included, recomputed them: the forward's matmuls twice per step).
- Grouped-query heads as `jax.nn.dot_product_attention` reads them: query head n uses kv head n // (heads / kv_heads).
"""

from __future__ import annotations

import math

import jax
import jax.numpy as jnp
from jax.ad_checkpoint import checkpoint_name

BLOCK = 512  # rows of queries and of keys per block, at most
ROWS = 8  # a block's rows are a multiple of this (unless the block is less): see the module docstring
_NO_KEY = jnp.iinfo(jnp.int32).min  # a padded query's position: before every key
_NO_QUERY = jnp.iinfo(jnp.int32).max  # a padded key's position: after every query


def blocking(length: int, most: int) -> tuple[int, int]:
    """(rows per block, blocks) for `length` rows in blocks of at most `most`: n = ceil(length / most) blocks of
    ceil(length / n) rows rounded up to a multiple of `ROWS` (capped at `most`); n x rows >= length, and the rows
    past `length`, fewer than ROWS x n, are padding."""
    count = -(-length // most)
    rows = -(-length // count)
    return min(most, -(-rows // ROWS) * ROWS), count


def blockwise_attention(q, k, v, q_pos, kv_pos, *, block_q: int = BLOCK, block_k: int = BLOCK,
                        residual_name: str | None = None, q_seg=None, kv_seg=None):
    """q [b, tq, heads, d], k and v [b, tk, kv_heads, d], q_pos [tq] and kv_pos [tk] int32 -> out [b, tq, heads, d]
    in q's dtype. Causal by position, and with `q_seg` [b, tq] and `kv_seg` [b, tk] (documents' ids) within a
    document; blocks of at most `block_q` queries and `block_k` keys (`blocking`). The output and log-sum-exp the
    backward pass keeps are named `residual_name`."""
    # Positions are usually constants (the same for every layer). Under a differentiated loop (the scanned layers)
    # JAX hoists whatever depends on constants alone out of it as residuals: every block's causal mask, and the
    # scores it selects, [T, T] in all (1.5 GiB at 8,192 positions, measured). Tying the positions to q through a
    # barrier makes them a value of the iteration, so nothing of the kernel is hoisted.
    q, q_pos, kv_pos, segs = jax.lax.optimization_barrier((q, q_pos, kv_pos, _segments(q_seg, kv_seg)))

    @jax.custom_vjp
    def attend(q, k, v, q_pos, kv_pos, segs):
        return _forward(q, k, v, q_pos, kv_pos, block_q, block_k, segs)[0].astype(q.dtype)

    def attend_forward(q, k, v, q_pos, kv_pos, segs):
        out, lse = _forward(q, k, v, q_pos, kv_pos, block_q, block_k, segs)
        out = out.astype(q.dtype)
        if residual_name:
            out, lse = checkpoint_name(out, residual_name), checkpoint_name(lse, residual_name)
        return out, (q, k, v, q_pos, kv_pos, segs, out, lse)

    def attend_backward(saved, d_out):
        q, k, v, q_pos, kv_pos, segs, out, lse = saved
        d_lse = jnp.zeros(lse.shape, jnp.float32)
        dq, dk, dv = _backward(q, k, v, q_pos, kv_pos, out, lse, d_out, d_lse, block_q, block_k, segs)
        return dq, dk, dv, None, None, jax.tree.map(lambda _: None, segs)

    attend.defvjp(attend_forward, attend_backward)
    return attend(q, k, v, q_pos, kv_pos, segs)


def chunk_forward(q, k, v, causal: bool, q_seg=None, kv_seg=None, *, block: int = BLOCK):
    """The ring's per-chunk kernel, forward: q [b, tq, heads, d] against k, v [b, tk, kv_heads, d], causal within
    the chunk (tq == tk) or every key visible, within a document where `q_seg` [b, tq] and `kv_seg` [b, tk] give
    documents' ids -> (out float32, lse [b, tq, heads] float32)."""
    q, q_pos, kv_pos = _chunk_positions(q, k, causal)
    return _forward(q, k, v, q_pos, kv_pos, block, block, _segments(q_seg, kv_seg))


def _segments(q_seg, kv_seg):
    """(q_seg, kv_seg), or None without documents."""
    return None if q_seg is None else (q_seg, kv_seg)


def chunk_backward(q, k, v, out, lse, d_out, causal: bool, q_seg=None, kv_seg=None, *, block: int = BLOCK):
    """The ring's per-chunk kernel, backward, given the whole row's output and log-sum-exp (over every chunk of
    keys, not this one's alone: then each chunk's probabilities are already normalised, and dq, dk, dv of the
    chunks add up to the whole attention's) -> (dq, dk, dv) in the inputs' dtype."""
    q, q_pos, kv_pos = _chunk_positions(q, k, causal)
    return _backward(q, k, v, q_pos, kv_pos, out, lse, d_out, jnp.zeros(lse.shape, jnp.float32), block, block,
                     _segments(q_seg, kv_seg))


def _chunk_positions(q, k, causal: bool):
    """Positions that make a chunk causal (the same positions for queries and keys) or wholly visible (every query
    after every key), tied to q by a barrier (see `blockwise_attention`)."""
    kv_pos = jnp.arange(k.shape[1], dtype=jnp.int32)
    q_pos = kv_pos if causal else jnp.full(q.shape[1], k.shape[1], jnp.int32)
    return jax.lax.optimization_barrier((q, q_pos, kv_pos))


def merge(out_a, lse_a, out_b, lse_b):
    """Two partial attentions of the same queries over disjoint keys -> the attention over both (float32)."""
    lse = jnp.logaddexp(lse_a, lse_b)
    safe = jnp.where(jnp.isfinite(lse), lse, 0.0)
    wa, wb = jnp.exp(lse_a - safe)[..., None], jnp.exp(lse_b - safe)[..., None]
    return out_a * wa + out_b * wb, lse


def _varying_like(x, *refs):
    """`x` typed as varying over every mesh axis any of `refs` varies over (inside `shard_map`: a loop carry that
    will take their values; outside, `x` as it is)."""
    axes = tuple(sorted(set().union(*(_varying_axes(r) for r in refs))))
    return jax.lax.pcast(x, axes, to="varying") if axes else x


def _varying_axes(x) -> frozenset:
    """The mesh axes `x` varies over inside `shard_map` (JAX 0.10's `manual_axis_type.varying`; `vma` before)."""
    aval = jax.typeof(x)
    mat = getattr(aval, "manual_axis_type", None)
    return frozenset(mat.varying) if mat is not None else frozenset(getattr(aval, "vma", ()))


def _padded(x, rows: int, value=0, axis: int = 1):
    """`x` with its `axis` padded to `rows` with `value` (as it is when it has them)."""
    extra = rows - x.shape[axis]
    if not extra:
        return x
    widths = [(0, 0)] * x.ndim
    widths[axis] = (0, extra)
    return jnp.pad(x, widths, constant_values=value)


def _blocked(q, k, v, q_pos, kv_pos, block_q, block_k, segs=None):
    """The inputs padded to whole blocks (`blocking`), and the blocks' rows: (q, k, v, q_pos, kv_pos, segs, bq,
    bk); `segs` (q_seg, kv_seg) or None."""
    bq, nq = blocking(q.shape[1], block_q)
    bk, nk = blocking(k.shape[1], block_k)
    q, q_pos = _padded(q, bq * nq), _padded(q_pos, bq * nq, _NO_KEY, 0)
    k, v, kv_pos = _padded(k, bk * nk), _padded(v, bk * nk), _padded(kv_pos, bk * nk, _NO_QUERY, 0)
    if segs is not None:  # (a padded row is excluded by its position already)
        segs = (_padded(segs[0], bq * nq), _padded(segs[1], bk * nk))
    return q, k, v, q_pos, kv_pos, segs, bq, bk


def _segment_blocks(segs, bq, bk):
    """Documents' ids per block, blocks first: ([nq, b, bq], [nk, b, bk]), or (None, None)."""
    if segs is None:
        return None, None
    q_seg, kv_seg = segs
    b = q_seg.shape[0]
    return (q_seg.reshape(b, -1, bq).swapaxes(0, 1), kv_seg.reshape(b, -1, bk).swapaxes(0, 1))


def _split(q, k, v, bq, bk):
    """Blocks first: q [nq, b, bq, kv_heads, group, d], k and v [nk, b, bk, kv_heads, d]."""
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    qb = q.reshape(b, tq // bq, bq, kvh, h // kvh, d).swapaxes(0, 1)
    kb, vb = (t.reshape(b, tk // bk, bk, kvh, d).swapaxes(0, 1) for t in (k, v))
    return qb, kb, vb


def _scores(qi, kj, qp, kp, qs=None, ks=None):
    """A block's float32 scores [b, kv_heads, group, bq, bk], -inf where the key is not visible: after the query,
    or (with documents' ids `qs` [b, bq], `ks` [b, bk]) in another document."""
    s = jnp.einsum("bqkgd,bskd->bkgqs", qi, kj, preferred_element_type=jnp.float32) / math.sqrt(qi.shape[-1])
    visible = (kp[None, :] <= qp[:, None])[None]
    if qs is not None:
        visible = visible & (qs[:, :, None] == ks[:, None, :])
    return jnp.where(visible[:, None, None], s, -jnp.inf)


def _visible(qp, kp, qs=None, ks=None):
    """Whether any key of the block may be visible to any of its queries: not all after them, and (with documents'
    ids) in some row, the ranges of the two blocks' ids overlap. A block of another document is skipped."""
    causal = kp.min() <= qp.max()
    if qs is None:
        return causal
    return causal & jnp.any((ks.max(-1) >= qs.min(-1)) & (ks.min(-1) <= qs.max(-1)))


def _forward(q, k, v, q_pos, kv_pos, block_q, block_k, segs=None):
    """-> (out [b, tq, heads, d] float32, lse [b, tq, heads] float32), in blocks of at most `block_q` queries and
    `block_k` keys; `segs` (q_seg [b, tq], kv_seg [b, tk]): documents' ids, or None."""
    b, tq, h, d = q.shape
    q, k, v, q_pos, kv_pos, segs, bq, bk = _blocked(q, k, v, q_pos, kv_pos, block_q, block_k, segs)
    qb, kb, vb = _split(q, k, v, bq, bk)
    qpb, kpb = q_pos.reshape(-1, bq), kv_pos.reshape(-1, bk)
    qsb, ksb = _segment_blocks(segs, bq, bk)
    stat_shape = (b, k.shape[2], h // k.shape[2], bq)

    def query_block(args):
        qi, qp, qs = args

        def key_block(carry, args):
            kj, vj, kp, ks = args

            def update(carry):
                m, l, acc = carry
                s = _scores(qi, kj, qp, kp, qs, ks)
                m_new = jnp.maximum(m, s.max(-1))
                base = jnp.where(jnp.isfinite(m_new), m_new, 0.0)
                p = jnp.exp(s - base[..., None])
                correction = jnp.exp(m - base)
                pv = jnp.einsum("bkgqs,bskd->bkgqd", p.astype(vj.dtype), vj, preferred_element_type=jnp.float32)
                return m_new, l * correction + p.sum(-1), acc * correction[..., None] + pv

            return jax.lax.cond(_visible(qp, kp, qs, ks), update, lambda c: c, carry), None

        init = tuple(_varying_like(t, q, k, v) for t in (
            jnp.full(stat_shape, -jnp.inf), jnp.zeros(stat_shape), jnp.zeros((*stat_shape, d))))
        (m, l, acc), _ = jax.lax.scan(key_block, init, (kb, vb, kpb, ksb))
        seen = l > 0
        lse = jnp.where(seen, m + jnp.log(jnp.where(seen, l, 1.0)), -jnp.inf)
        return acc / jnp.where(seen, l, 1.0)[..., None], lse

    out, lse = jax.lax.map(query_block, (qb, qpb, qsb))  # [nq, b, kvh, g, bq, (d)]
    out = out.transpose(1, 0, 4, 2, 3, 5).reshape(b, -1, h, d)[:, :tq]
    lse = lse.transpose(1, 0, 4, 2, 3).reshape(b, -1, h)[:, :tq]
    return out, lse


def _backward(q, k, v, q_pos, kv_pos, out, lse, d_out, d_lse, block_q, block_k, segs=None):
    """-> (dq, dk, dv) in the inputs' dtypes, given the rows' output, log-sum-exp and their cotangents."""
    b, tq, h, d = q.shape
    tk, kvh = k.shape[1], k.shape[2]
    g = h // kvh
    q, k, v, q_pos, kv_pos, segs, bq, bk = _blocked(q, k, v, q_pos, kv_pos, block_q, block_k, segs)
    qsb, ksb = _segment_blocks(segs, bq, bk)
    rows = q.shape[1]  # padded: the padded queries' output and cotangents are 0, their log-sum-exp -inf
    out, d_out, d_lse = (_padded(t.astype(jnp.float32), rows) for t in (out, d_out, d_lse))
    lse = _padded(lse, rows, -jnp.inf)
    qb, kb, vb = _split(q, k, v, bq, bk)
    qpb, kpb = q_pos.reshape(-1, bq), kv_pos.reshape(-1, bk)
    # per query and head: D = rowsum(dO * O) - dlse, and the log-sum-exp (+inf where no key was seen: p = 0)
    delta = (d_out * out).sum(-1) - d_lse
    per_block = lambda t: t.reshape(b, rows // bq, bq, kvh, g).transpose(1, 0, 3, 4, 2)  # noqa: E731
    lse_b, delta_b = per_block(jnp.where(jnp.isfinite(lse), lse, jnp.inf)), per_block(delta)
    do_b = d_out.astype(q.dtype).reshape(b, rows // bq, bq, kvh, g, d).swapaxes(0, 1)
    scale = 1.0 / math.sqrt(d)

    def query_block(carry, args):
        dk, dv = carry  # [nk, b, bk, kvh, d] float32
        qi, qp, qs, lse_i, delta_i, do_i = args

        def key_block(state, args):
            j, kj, vj, kp, ks = args

            def update(state):
                dq_i, dk, dv = state
                p = jnp.exp(_scores(qi, kj, qp, kp, qs, ks) - lse_i[..., None])
                dp = jnp.einsum("bqkgd,bskd->bkgqs", do_i, vj, preferred_element_type=jnp.float32)
                ds = (p * (dp - delta_i[..., None]) * scale).astype(q.dtype)
                dq_i = dq_i + jnp.einsum("bkgqs,bskd->bqkgd", ds, kj, preferred_element_type=jnp.float32)
                dk = dk.at[j].add(jnp.einsum("bkgqs,bqkgd->bskd", ds, qi, preferred_element_type=jnp.float32))
                dv = dv.at[j].add(jnp.einsum("bkgqs,bqkgd->bskd", p.astype(q.dtype), do_i,
                                             preferred_element_type=jnp.float32))
                return dq_i, dk, dv

            return jax.lax.cond(_visible(qp, kp, qs, ks), update, lambda s: s, state), None

        # the inner loop carries this query block's dq and the keys' running dk, dv
        state = (_varying_like(jnp.zeros(qi.shape, jnp.float32), q, k, v, d_out), dk, dv)
        (dq_i, dk, dv), _ = jax.lax.scan(key_block, state, (jnp.arange(kb.shape[0]), kb, vb, kpb, ksb))
        return (dk, dv), dq_i

    zeros = _varying_like(jnp.zeros((kb.shape[0], b, bk, kvh, d), jnp.float32), q, k, v, d_out)
    (dk, dv), dq = jax.lax.scan(query_block, (zeros, zeros), (qb, qpb, qsb, lse_b, delta_b, do_b))
    dq = dq.swapaxes(0, 1).reshape(b, rows, h, d)[:, :tq].astype(q.dtype)
    dk, dv = (t.swapaxes(0, 1).reshape(b, -1, kvh, d)[:, :tk].astype(k.dtype) for t in (dk, dv))
    return dq, dk, dv
