"""The memory levers' pieces against plain references: the loss fused with the head and chunked over the vocabulary,
on one device and on a mesh, and the embedding table's gradient summed in float32. (Whole steps against the plain
step: `test_parity`; what the compilers keep per layer: `test_targets` and `benchmarks/memory.py`.)"""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from jax.sharding import NamedSharding
from flax import nnx
from jax.sharding import PartitionSpec as P

from shardlm.flops import jaxpr_matmul_flops
from shardlm.mesh import make_mesh
from shardlm.kernels.fused_head import (FLOPS_PER_BYTE, FORWARD_TILE_BYTES, Tiling, chunk_width, recompute_tiling,
                                        tiling)
from shardlm.models.head import head_loss, recording
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


SCHEDULES = {  # (chunks, recomputed tiles' budget, the forward schedule's budget) -> the tiling they give
    "one tile, in the forward": ((0, 2**20, 2**20), Tiling(256, 1, True)),
    "4 blocks in the forward": ((0, 2**20, 2 * 256 * 32 * 8), Tiling(256, 4, True)),
    "3 chunks": ((3, 2**20, 2**20), Tiling(86, 1, False)),
    "8 chunks": ((8, 2**20, 2**20), Tiling(32, 1, False)),
    "2 chunks x 4 blocks": ((0, 128 * 32 * 4, 0), Tiling(128, 4, False)),
}


def fused_loss(targets, tied, chunks=0, budget=2**20, forward_budget=2**20):
    return lambda x, w: head_loss(x, w, targets, tied=tied, vocab_size=VOCAB, compute_dtype=jnp.float32,
                                  chunks=chunks, budget=budget, forward_budget=forward_budget, flops_per_byte=0)


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("schedule", list(SCHEDULES))
def test_the_fused_loss_is_the_cross_entropy_of_the_whole_logits(tied, schedule):
    """Gradients in the forward pass over one tile and over 4 token blocks (32 tokens by all 256 rows each);
    recomputed over 3 chunks (the last of width 86 starts early and masks the rows already covered), 8, and 2
    chunks by 4 token blocks (tiles of 32 tokens by 128 rows): the loss and both gradients within float32
    rounding of the plain loss's, and no gradient for the padding rows."""
    (chunks, budget, forward_budget), expected = SCHEDULES[schedule]
    x, w, targets = inputs(tied)
    assert tiling(PADDED, x.shape[0] * x.shape[1], chunks, budget, d=D, forward_budget=forward_budget,
                  flops_per_byte=0) == expected
    got, got_grads = jax.value_and_grad(fused_loss(targets, tied, chunks, budget, forward_budget),
                                        argnums=(0, 1))(x, w)
    want, want_grads = jax.value_and_grad(lambda x, w: plain_loss(x, w, targets, tied), argnums=(0, 1))(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-7)
    padding = w[VOCAB:] if tied else w[:, VOCAB:]
    assert padding.size and not np.any(got_grads[1][VOCAB:] if tied else got_grads[1][:, VOCAB:])


@pytest.mark.parametrize("schedule", ["4 blocks in the forward", "2 chunks x 4 blocks"])
def test_the_gradients_scale_with_any_cotangent(schedule):
    """Gradients computed in the forward pass are the loss's for a cotangent of 1, scaled in the backward pass: a
    sum of two losses weighted 0.3 and -1.7 (as gradient accumulation and a pipeline's loss weights weight them)
    has the plain head's gradients, and a loss that is not differentiated is the plain one too."""
    (chunks, budget, forward_budget), _ = SCHEDULES[schedule]
    x, w, targets = inputs(True)
    fused = fused_loss(targets, True, chunks, budget, forward_budget)
    weighted = lambda loss: lambda x, w: 0.3 * loss(x, w) - 1.7 * loss(2 * x, w)  # noqa: E731
    got = jax.grad(weighted(fused), argnums=(0, 1))(x, w)
    want = jax.grad(weighted(lambda x, w: plain_loss(x, w, targets, True)), argnums=(0, 1))(x, w)
    for g, r in zip(got, want):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)
    np.testing.assert_allclose(jax.jit(fused)(x, w), plain_loss(x, w, targets, True), rtol=1e-6)


@pytest.mark.parametrize("schedule", ["4 blocks in the forward", "2 chunks x 4 blocks"])
def test_the_z_loss_goes_through_the_fused_head(schedule):
    """With `z_loss` the fused head returns (cross entropy, mean log^2 Z), each with its own gradient: the
    objective ce + 0.3 z (train.z_loss=0.3, as the step weights it) has the plain logits' gradients, in both
    schedules."""
    (chunks, budget, forward_budget), _ = SCHEDULES[schedule]
    x, w, targets = inputs(False)

    def fused(x, w):
        ce, z = head_loss(x, w, targets, tied=False, vocab_size=VOCAB, compute_dtype=jnp.float32, chunks=chunks,
                          budget=budget, forward_budget=forward_budget, flops_per_byte=0, z_loss=True)
        return ce + 0.3 * z, (ce, z)

    def plain(x, w):
        logits = jnp.where(jnp.arange(PADDED) < VOCAB, jnp.einsum("btd,dv->btv", x, w), -jnp.inf)
        z = (jax.nn.logsumexp(logits, -1) ** 2).mean()
        ce = plain_loss(x, w, targets, False)
        return ce + 0.3 * z, (ce, z)

    (_, got), got_grads = jax.value_and_grad(fused, argnums=(0, 1), has_aux=True)(x, w)
    (_, want), want_grads = jax.value_and_grad(plain, argnums=(0, 1), has_aux=True)(x, w)
    np.testing.assert_allclose(got, want, rtol=1e-6)
    assert want[1] > 1.0  # the z term is large enough to count
    for g, r in zip(got_grads, want_grads):
        np.testing.assert_allclose(g, r, rtol=1e-5, atol=1e-6)


def head_matmuls(loss, x, w) -> float:
    """A value-and-gradient of `loss`'s matmul FLOPs, in head matmuls (2 x tokens x rows x d each)."""
    jaxpr = jax.jit(jax.value_and_grad(loss, argnums=(0, 1))).trace(x, w).jaxpr
    return jaxpr_matmul_flops(jaxpr) / (2 * x.shape[0] * x.shape[1] * PADDED * D)


def test_the_forward_schedule_runs_three_head_matmuls_and_recomputing_four():
    """What runs: in the forward schedule three head matmuls (logits, the input's gradient, the weight's), as a
    plain head does, in one tile or four blocks, and over the 250 rows of the vocabulary, not the 6 of padding;
    recomputing, four (the logits again in the backward pass)."""
    x, w, targets = inputs(True)
    assert head_matmuls(lambda x, w: plain_loss(x, w, targets, True), x, w) == 3
    for schedule, matmuls in [("one tile, in the forward", 3 * VOCAB / PADDED),
                              ("4 blocks in the forward", 3 * VOCAB / PADDED), ("2 chunks x 4 blocks", 4)]:
        (chunks, budget, forward_budget), _ = SCHEDULES[schedule]
        assert head_matmuls(fused_loss(targets, True, chunks, budget, forward_budget), x, w) == matmuls


def test_the_input_gradient_is_added_to_in_place_not_copied_for_every_chunk():
    """Recomputing, 2 chunks x 4 token blocks: the backward pass adds each block's share of the input's gradient
    into the buffer it carries; no kernel of the compiled step copies that buffer (XLA copied the blocks' loop
    output into the chunks' carry once per chunk, 201 MB a chunk for GPT-2 124M on an H100)."""
    x, w, targets = inputs(True)
    (chunks, budget, forward_budget), expected = SCHEDULES["2 chunks x 4 blocks"]
    grad = jax.jit(jax.grad(fused_loss(targets, True, chunks, budget, forward_budget), argnums=(0, 1)))
    program = kernels.program(grad.lower(x, w).compile().as_text(), 1)
    copies = [k for k in program.kernels() if k.name.startswith("copy") and k.bytes == 2 * x.size * 4]
    assert expected == (128, 4, False) and not copies


def test_chunks_are_multiples_of_128_rows_within_their_budget():
    """Llama 3's 128,256 rows (no divisor a multiple of 128 near the budget) for 16,384 tokens: 63 chunks of 2,048
    rows, about 128 MiB of float32 logits each; GPT-2's 50,304 for 2,048 tokens: 4 chunks of 12,672 (0.8% of the
    rows computed twice); a vocabulary that fits is one chunk; a requested count is honoured."""
    assert chunk_width(128256, 16384) == 2048 and -(-128256 // 2048) == 63
    assert chunk_width(50304, 2048) == 12672
    assert chunk_width(512, 64) == 512
    assert chunk_width(256, 64, requested=3) == 86


def test_many_tokens_take_token_blocks_too():
    """Recomputing the 70B pipeline's head, 262,144 tokens by 32,064 rows per device: chunks alone would be 251 of
    128 rows, each adding an 8 GiB input gradient; the tiling takes wide chunks and token blocks, each tile within
    the budget, and moves the fewest bytes (tokens x chunks + blocks x rows) of any tiling in it."""
    tokens, rows = 262144, 32064
    assert recompute_tiling(rows, tokens, budget=2**40) == (rows, 1, False)  # fits: one tile
    width, blocks, _ = recompute_tiling(rows, tokens)
    assert width % 128 == 0 and tokens % blocks == 0
    assert tokens // blocks * width * 4 <= 128 * 2**20
    chunks = -(-rows // width)
    assert tokens * chunks + blocks * rows < (tokens * 251 + rows) / 10  # ten times fewer bytes than chunks alone
    assert tiling(128256, 16384, requested=63) == (chunk_width(128256, 16384, 63), 1, False)  # requested: chunks
    assert tiling(128256, 16384, requested=1) == (128256, 1, True)  # one chunk: one tile, in the forward


def test_the_schedule_is_the_forward_one_where_the_head_fits_and_blocks_are_few():
    """Per device: GPT-2's head (50,304 x 256, float32) for 2,048 tokens on a CPU is in the forward pass, in 16
    blocks of 128 tokens whose 25 MiB of logits stay in a CPU's cache; GPT-2 124M's (x 768, bfloat16) for 8 x 1,024 tokens on a GPU, 4 blocks in the forward;
    for 64 x 1,024 tokens, 32 blocks still beat a fourth matmul at an H100's 295 FLOPs per byte. Llama 3's 128,256
    x 4,096 does not fit the forward schedule's GiB (3 GiB gathered with its gradient): recomputed, in tiles;
    split over 8 tensor devices, it fits."""
    cpu = dict(flops_per_byte=FLOPS_PER_BYTE["cpu"], forward_tile=FORWARD_TILE_BYTES["cpu"])
    assert tiling(50304, 2048, d=256, compute_bytes=4, **cpu) == (50304, 16, True)
    assert tiling(2048, 2048, d=512, compute_bytes=4, **cpu) == (2048, 1, True)  # 16 MiB: one block
    assert tiling(50304, 8192, d=768, compute_bytes=2) == (50304, 4, True)
    assert tiling(50304, 65536, d=768, compute_bytes=2) == (50304, 32, True)
    assert not tiling(128256, 16384, d=4096, compute_bytes=2).in_forward
    assert tiling(128256 // 8, 16384, d=4096, compute_bytes=2).in_forward
    # where blocks are many and the platform moves few bytes per FLOP, recomputing wins
    assert not tiling(50304, 65536, d=768, compute_bytes=2, forward_budget=2**28).in_forward


@pytest.mark.parametrize("tied", [True, False], ids=["tied", "untied"])
@pytest.mark.parametrize("chunks, forward_budget, expected", [(2, 2**30, Tiling(64, 1, False)),
                                                                (0, 128 * 32 * 8 + 16 * 128 * 8, Tiling(128, 2, True))],
                         ids=["2 chunks recomputed", "2 blocks in the forward"])
def test_the_fused_loss_on_a_mesh_sums_what_each_device_holds(tied, chunks, forward_budget, expected):
    """data 2 x fsdp 2 x tensor 2, the state split over data as well: tokens over data x fsdp, the vocabulary over
    tensor, the head's embedding dimension over fsdp x data; per device (32 tokens, 128 rows) the logits
    recomputed over 2 chunks, or the gradients taken in the forward pass over 2 token blocks. The loss and gradients equal one device's, and the weight's gradient comes back in
    the weight's own sharding."""
    mesh = make_mesh(2, 2, 2)
    storage = zero_rules()
    x, w, targets = inputs(tied)
    names = ("vocab", "embed") if tied else ("embed", "vocab")
    w_sharding = NamedSharding(mesh, logical_to_spec(names, storage, shape=w.shape, mesh=mesh))
    x_sharding = NamedSharding(mesh, logical_to_spec(("batch", "seq", "act_embed"), shape=x.shape, mesh=mesh))

    def fused(x, w):
        with use_mesh_rules(mesh, storage=storage):
            return head_loss(x, w, targets, tied=tied, vocab_size=VOCAB, compute_dtype=jnp.float32, chunks=chunks,
                             forward_budget=forward_budget, flops_per_byte=0)

    run = jax.jit(jax.value_and_grad(fused, argnums=(0, 1)), in_shardings=(x_sharding, w_sharding))
    with recording() as traced:
        got, (dx, dw) = run(jax.device_put(x, x_sharding), jax.device_put(w, w_sharding))
    assert [(s.tiling, s.rows, s.tokens) for s in traced] == [(expected, 128, 32)]
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


HEAD_MESHES = {"DP 2": {"data": 2}, "FSDP 2": {"fsdp": 2}, "TP 2": {"tensor": 2},
               "FSDP 2 x TP 2": {"fsdp": 2, "tensor": 2}, "PP 2 GPipe": {"stage": 2},
               "PP 2 1F1B": {"stage": 2, "1f1b": True}}


@pytest.mark.parametrize("name", list(HEAD_MESHES))
def test_the_heads_gradients_in_the_forward_pass_are_the_plain_heads(name):
    """A train step's loss and every parameter's gradient, with the head's gradients taken in the forward pass
    (the default schedule on a CPU), under gradient accumulation over 2 microbatches (each microbatch's loss
    weighted 1/2 in the backward pass; a 1F1B pipeline's head weights each of its own microbatches too): within
    1e-6 of the plain head's (one device, float32 logits for the whole vocabulary, optax's cross entropy,
    autodiff), relative to each gradient's largest entry. Untied under tensor parallelism (the head's own
    [embed, vocab] split over the vocabulary), tied elsewhere."""
    from conftest import MICRO

    from shardlm.config import load_config
    from shardlm.losses import cross_entropy
    from shardlm.train.source import model_source
    from shardlm.train.state import create_train_state
    from shardlm.train.step import accumulated_grads

    degrees = dict(HEAD_MESHES[name])
    schedule = ["model.pipeline_schedule=1f1b"] if degrees.pop("1f1b", False) else []
    cfg = load_config(None, MICRO + ["model.vocab_size=500", "train.grad_accum=2", "model.pipeline_microbatches=2",
                                     "model.tie_embeddings=false" if "TP" in name else "model.dropout=0"] + schedule)
    mesh = make_mesh(**degrees, devices=jax.devices()[:int(np.prod(list(degrees.values())))])
    source, ts = model_source(cfg), create_train_state(cfg, mesh, 500)
    batch = jax.random.randint(jax.random.key(3), (16, 33), 0, 500)
    params = nnx.filter_state(ts.shardings["model"], nnx.Param)

    @jax.jit
    def fused(state, batch):
        model = nnx.merge(ts.graphdef, state)["model"]
        with recording() as traced:
            loss_fn = lambda model, tokens, key: (source.loss(model, tokens, mesh)[0], {})  # noqa: E731
            _, grads = accumulated_grads(loss_fn, model, batch, jax.random.key(0), 2, params,
                                         source.batch_sharding(mesh), source.cast_once)
        assert traced and all(s.tiling.in_forward for s in traced)
        return grads, nnx.value_and_grad(lambda m: source.loss(m, batch, mesh)[0])(model)[0]

    one = make_mesh(devices=jax.devices()[:1])
    state = jax.device_put(ts.state, NamedSharding(one, P()))

    @jax.jit
    def plain(state, batch):
        model = nnx.merge(ts.graphdef, state)["model"]
        graphdef, p, rest = nnx.split(model, nnx.Param, ...)
        micro = batch.reshape(8, 2, 33).swapaxes(0, 1)  # as accumulated_grads cuts it
        loss = lambda p, tokens: cross_entropy(nnx.merge(graphdef, p, rest)(tokens[:, :-1]), tokens[:, 1:])  # noqa: E731
        return jax.grad(lambda p: (loss(p, micro[0]) + loss(p, micro[1])) / 2)(p), loss(p, batch)

    (got, got_loss), (want, want_loss) = fused(ts.state, batch), plain(state, batch)
    np.testing.assert_allclose(got_loss, want_loss, rtol=1e-6)
    errors = {jax.tree_util.keystr(path): (np.abs(np.asarray(g) - np.asarray(r)).max(), np.abs(np.asarray(r)).max())
              for (path, g), r in zip(jax.tree_util.tree_leaves_with_path(got), jax.tree.leaves(want))}
    # the keys' bias has no gradient in exact arithmetic (softmax ignores a constant per query): rounding only
    assert all(error <= 1e-6 * largest + 1e-10 for error, largest in errors.values()), errors


@pytest.mark.parametrize("overrides", [["mesh.fsdp=2", "mesh.tensor=2", "train.grad_accum=2"],
                                       ["mesh.stage=2", "model.pipeline_schedule=1f1b", "model.pipeline_microbatches=4"]],
                         ids=["FSDP 2 x TP 2, 2 microbatches", "1F1B over 2 stages, 4 microbatches"])
def test_explain_names_the_schedule_the_step_traces(overrides):
    """`shardlm explain`'s note on the head is the schedule the train step traces, with its bytes: per
    gradient-accumulation microbatch, or per pipeline microbatch where 1F1B runs the head."""
    from conftest import MICRO

    from shardlm.config import load_config
    from shardlm.mesh import mesh_from_config
    from shardlm.train.explain import explain_run
    from shardlm.train.state import TrainState, abstract_train_state
    from shardlm.train.step import batch_struct, train_step_for

    cfg = load_config(None, MICRO + ["model.vocab_size=500", "data.tokenizer=bytes"] + overrides)
    ex = explain_run(cfg, log=lambda m: None)
    (note,) = [n for n in ex.notes if n.startswith("output head and loss")]
    mesh = mesh_from_config(cfg.mesh)  # as explain lays it out: mesh.data=-1 takes the other devices
    _, graphdef, abstract, shardings = abstract_train_state(cfg, mesh, 500)
    with recording() as traced:
        train_step_for(cfg, TrainState(graphdef, abstract, shardings), mesh).trace(abstract, batch_struct(cfg, mesh))
    assert {f"output head and loss, per device: {s.describe()}" for s in traced} == {note}
    assert "gradients in the forward pass, three head matmuls: 1 block(s) of" in note
