"""The memory levers' pieces against plain references: the loss fused with the head and chunked over the vocabulary,
on one device and on a mesh, and the embedding table's gradient summed in float32. (Whole steps against the plain
step: `test_parity`; what the compilers keep per layer: `test_targets` and `benchmarks/memory.py`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from jax.sharding import PartitionSpec as P

from shardlm.mesh import make_mesh
from shardlm.models.head import chunk_width, head_loss, tiling
from shardlm.perf import kernels
from shardlm.sharding import logical_to_spec, sharded_lookup, use_mesh_rules, zero_rules

D, VOCAB, PADDED = 32, 250, 256  # the last 6 rows are padding


def plain_loss(x, w, targets, tied):
    logits = jnp.einsum("btd,vd->btv" if tied else "btd,dv->btv", x, w, preferred_element_type=jnp.float32)
    logits = jnp.where(jnp.arange(PADDED) < VOCAB, logits, -jnp.inf)
    return optax.softmax_cross_entropy_with_integer_labels(logits, targets).mean()


def inputs(tied, batch=8, t=16):
    kx, kw, kt = jax.random.split(jax.random.key(0), 3)
    x = jax.random.normal(kx, (batch, t, D), jnp.float32)
    w = jax.random.normal(kw, (PADDED, D) if tied else (D, PADDED), jnp.float32)
    return x, w, jax.random.randint(kt, (batch, t), 0, VOCAB)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunks, budget", [(0, 2**20), (3, 2**20), (8, 2**20), (0, 128 * 32 * 4)],
                         ids=["one tile", "3 chunks", "8 chunks", "2 chunks x 4 token blocks"])
def test_the_fused_loss_is_the_cross_entropy_of_the_whole_logits(tied, chunks, budget):
    """One chunk (0: automatic), 3 (the last of width 86 starts early and masks the rows already covered), 8, and a
    budget that takes token blocks too (128 tokens by 256 rows in tiles of 32 tokens by 128 rows): the loss and
    both gradients within float32 rounding of the plain loss's."""
    x, w, targets = inputs(tied)
    if budget < 2**20:
        assert tiling(PADDED, x.shape[0] * x.shape[1], chunks, budget) == (128, 4)
    fused = lambda x, w: head_loss(x, w, targets, tied=tied, vocab_size=VOCAB, compute_dtype=jnp.float32,  # noqa: E731
                                   chunks=chunks, budget=budget)
    got, got_grads = jax.value_and_grad(fused, argnums=(0, 1))(x, w)
    want, want_grads = jax.value_and_grad(lambda x, w: plain_loss(x, w, targets, tied), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    padding = w[VOCAB:] if tied else w[:, VOCAB:]
    assert padding.size and not np.any(got_grads[1][VOCAB:] if tied else got_grads[1][:, VOCAB:])


def test_the_input_gradient_is_added_to_in_place_not_copied_for_every_chunk():
    """2 chunks x 4 token blocks: the backward pass adds each block's share of the input's gradient into the
    buffer it carries; no kernel of the compiled step copies that buffer (XLA copied the blocks' loop output into
    the chunks' carry once per chunk, 201 MB a chunk for GPT-2 124M on an H100)."""
    x, w, targets = inputs(True)
    budget = 128 * 32 * 4
    grad = jax.jit(jax.grad(lambda x, w: head_loss(x, w, targets, tied=True, vocab_size=VOCAB,
                                                   compute_dtype=jnp.float32, budget=budget), argnums=(0, 1)))
    program = kernels.program(grad.lower(x, w).compile().as_text(), 1)
    copies = [k for k in program.kernels() if k.name.startswith("copy") and k.bytes == 2 * x.size * 4]
    assert tiling(PADDED, x.shape[0] * x.shape[1], 0, budget) == (128, 4) and not copies


def test_chunks_are_multiples_of_128_rows_within_their_budget():
    """Llama 3's 128,256 rows (no divisor a multiple of 128 near the budget) for 16,384 tokens: 63 chunks of 2,048
    rows, about 128 MiB of float32 logits each; GPT-2's 50,304 for 2,048 tokens: 4 chunks of 12,672 (0.8% of the
    rows computed twice); a vocabulary that fits is one chunk; a requested count is honoured."""
    assert chunk_width(128256, 16384) == 2048 and -(-128256 // 2048) == 63
    assert chunk_width(50304, 2048) == 12672
    assert chunk_width(512, 64) == 512
    assert chunk_width(256, 64, requested=3) == 86


def test_many_tokens_take_token_blocks_too():
    """The 70B pipeline's head, 262,144 tokens by 32,064 rows per device: chunks alone would be 251 of 128 rows,
    each adding an 8 GiB input gradient; the tiling takes wide chunks and token blocks, each tile within the
    budget, and moves the fewest bytes (tokens x chunks + blocks x rows) of any tiling in it."""
    tokens, rows = 262144, 32064
    assert tiling(rows, tokens, budget=2**40) == (rows, 1)  # fits: one tile
    width, blocks = tiling(rows, tokens)
    assert width % 128 == 0 and tokens % blocks == 0
    assert tokens // blocks * width * 4 <= 128 * 2**20
    chunks = -(-rows // width)
    assert tokens * chunks + blocks * rows < (tokens * 251 + rows) / 10  # ten times fewer bytes than chunks alone
    assert tiling(128256, 16384, requested=63) == (chunk_width(128256, 16384, 63), 1)  # a requested count: chunks


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
def test_the_fused_loss_on_a_mesh_sums_what_each_device_holds(tied):
    """data 2 x fsdp 2 x tensor 2, the state split over data as well: tokens over data x fsdp, the vocabulary over
    tensor, the head's embedding dimension over fsdp x data. The loss and gradients equal one device's, and the
    weight's gradient comes back in the weight's own sharding."""
    mesh = make_mesh(2, 2, 2)
    storage = zero_rules()
    x, w, targets = inputs(tied)
    names = ("vocab", "embed") if tied else ("embed", "vocab")
    w_sharding = NamedSharding(mesh, logical_to_spec(names, storage, shape=w.shape, mesh=mesh))
    x_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"), shape=x.shape, mesh=mesh))

    def fused(x, w):
        with use_mesh_rules(mesh, storage=storage):
            return head_loss(x, w, targets, tied=tied, vocab_size=VOCAB, compute_dtype=jnp.float32, chunks=2)

    run = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)), in_shardings=(x_sharding, w_sharding))
    got, (dx, dw) = run(jax.device_put(x, x_sharding), jax.device_put(w, w_sharding))
    want, (rx, rw) = jax.value_and_grad(lambda x, w: plain_loss(x, w, targets, tied), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    np.testing.assert_allclose(dx, rx, rtol=1e-5, atol=1e-7)
    np.testing.assert_allclose(dw, rw, rtol=1e-5, atol=1e-7)
    assert dw.sharding.is_equivalent_to(w_sharding, w.ndim)


def test_a_frequent_tokens_embedding_gradient_is_summed_in_float32():
    """A token that appears 10,000 times in a batch: its row of the table's gradient is the sum of 10,000 bfloat16
    cotangents. Looked up from the float32 table (FSDP 8: each device its columns of every token) and cast as they
    are read, it is summed in float32, within 1e-5 of a float64 sum; looked up from a bfloat16 copy of the table, as
    before, it was summed in bfloat16 and off by about a percent."""
    mesh = make_mesh(1, 8, 1)
    table = jax.random.normal(jax.random.key(1), (64, 16), jnp.float32)
    frequent = 7
    rng = np.random.default_rng(0)
    ids = rng.integers(0, 63, (8, 1280)).astype(np.int32)
    ids[ids >= frequent] += 1  # every token but the frequent one, which then takes 10,000 places
    ids.reshape(-1)[rng.choice(ids.size, 10_000, replace=False)] = frequent
    assert (ids == frequent).sum() == 10_000
    cotangent = (jax.random.normal(jax.random.key(2), (8, 1280, 16)) + 1).astype(jnp.bfloat16)
    exact = np.asarray(cotangent, np.float64)[ids == frequent].sum(0)

    def lookup(table):
        with use_mesh_rules(mesh):
            return sharded_lookup(table, jnp.asarray(ids), ("vocab", "embed"), jnp.bfloat16)

    table = jax.device_put(table, NamedSharding(mesh, P(None, "fsdp")))
    (grad,) = jax.jit(lambda t, g: jax.vjp(lookup, t)[1](g))(table, cotangent)
    assert grad.dtype == jnp.float32
    assert np.abs(np.asarray(grad[frequent], np.float64) / exact - 1).max() < 1e-5
    (old,) = jax.vjp(lambda t: t.astype(jnp.bfloat16)[jnp.asarray(ids)], table)[1](cotangent)
    assert np.abs(np.asarray(old[frequent], np.float64) / exact - 1).max() > 1e-3
