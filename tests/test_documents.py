"""Attention within the documents packed in a window (`data.document_mask`, `shardlm.models.documents`): every
kernel keeps a token's attention inside its document (XLA's mask, the blockwise kernel, splash's segment ids, the
ring's ids travelling with the keys), so no token's logits move when an earlier document of its row changes; the
masked and unmasked losses differ; and the ring over fsdp 2 x context 2 trains as one device."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import MICRO, run_steps
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.models.documents import document_ids, document_positions
from shardlm.sharding import use_mesh_rules
from shardlm.train.source import model_source

SEPARATOR = 0


def documents_stream(n: int, vocab: int, seed: int = 0) -> np.ndarray:
    """Tokens of short documents (4 to 40 tokens), each opened by the separator, as prepared data is."""
    rng = np.random.default_rng(seed)
    parts = []
    while sum(map(len, parts)) < n:
        parts.append(np.concatenate([[SEPARATOR], rng.integers(1, vocab, int(rng.integers(4, 40)))]))
    return np.concatenate(parts)[:n].astype(np.int32)


def test_document_ids_open_at_each_separator_and_positions_restart_there():
    ids = document_ids(jnp.array([[5, 0, 7, 7, 0, 0, 3]]), SEPARATOR)
    assert ids.tolist() == [[0, 1, 1, 1, 2, 3, 3]]
    assert document_positions(ids).tolist() == [[0, 0, 1, 2, 0, 0, 1]]


def test_masked_losses_differ_and_the_ring_over_fsdp_and_context_trains_as_one_device():
    """(With positions restarting at each document too: the rotary tables per token, moved to the ring's zigzag
    layout with the residual stream.)"""
    tokens = documents_stream(40_000, 500)
    llama = MICRO + ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2"]
    unmasked = run_steps(llama + ["data.document_mask=false"], (1, 1, 1), steps=1, tokens=tokens)[0]
    masked = llama + ["data.document_mask=true", "data.document_positions=true"]
    one = run_steps(masked, (1, 1, 1), steps=4, tokens=tokens, separator=SEPARATOR)[0]
    ring = run_steps(masked, {"fsdp": 2, "context": 2}, steps=4, tokens=tokens, separator=SEPARATOR)[0]
    assert abs(one[0] - unmasked[0]) > 1e-4
    # Rotary embeddings are relative: within a document, restarting its positions changes nothing (up to
    # rounding). A GPT's learned positions are absolute: there they are other rows of the table.
    gpt = [run_steps(MICRO + ["data.document_mask=true", f"data.document_positions={restart}"], (1, 1, 1), steps=1,
                     tokens=tokens, separator=SEPARATOR)[0][0] for restart in (True, False)]
    assert abs(gpt[0] - gpt[1]) > 1e-4
    np.testing.assert_allclose(ring[0], one[0], rtol=1e-5)
    np.testing.assert_allclose(ring, one, rtol=2e-3)


def _logits(overrides, degrees, tokens, documents: bool, restart: bool = False):
    """The model's logits for `tokens` [rows, T], attending within documents or not, on a mesh of `degrees`."""
    cfg = load_config(None, MICRO + overrides)
    mesh = make_mesh(**degrees, devices=jax.devices()[:int(np.prod(list(degrees.values())))])
    source = model_source(cfg)
    with nnx.use_eager_sharding(False):
        model = source.factory(500, mesh.shape["tensor"])()

    @jax.jit
    def run(tokens):
        with use_mesh_rules(mesh, source.rules()):
            segments = document_ids(tokens, SEPARATOR) if documents else None
            positions = document_positions(segments) if restart else None
            return model._forward(tokens, None, segments=segments, positions=positions)[0]

    return np.asarray(run(jnp.asarray(tokens)))[..., :500]  # (the padded rows are -inf)


KERNELS = {  # name: (overrides, mesh, length)
    "xla, a GPT's positions restarting": (["model.attention=xla", "model.family=gpt", "model.use_bias=true"],
                                          {"fsdp": 1}, 32),
    "flash": (["model.attention=flash", "model.attention_block=8"], {"fsdp": 1}, 32),
    "splash (interpreted)": (["model.attention=splash", "model.d_model=128", "model.n_heads=2"], {"fsdp": 1}, 128),
    "ring, fsdp 2 x context 2": (["model.attention_block=8"], {"fsdp": 2, "context": 2}, 32),
}


@pytest.mark.parametrize("kernel", list(KERNELS))
def test_no_tokens_logits_change_when_an_earlier_document_in_its_window_changes(kernel):
    overrides, degrees, length = KERNELS[kernel]
    overrides = ["model.family=llama", "model.use_bias=false", *overrides, f"model.seq_len={length}"]
    restart = "restarting" in kernel
    rng = np.random.default_rng(1)
    rows = rng.integers(1, 500, (4, length)).astype(np.int32)
    cut = length // 2 + 3  # a second document opens here, a row's first ends before it
    rows[:, 0], rows[:, cut] = SEPARATOR, SEPARATOR
    changed = rows.copy()
    changed[:, 1:cut] = rng.integers(1, 500, (4, cut - 1))
    before, after = (_logits(overrides, degrees, t, documents=True, restart=restart) for t in (rows, changed))
    np.testing.assert_allclose(after[:, cut:], before[:, cut:], rtol=0, atol=2e-6)
    assert np.abs(after[:, 1:cut] - before[:, 1:cut]).max() > 1e-2  # the changed document's own logits move
    # across documents, the later one's logits do move: what the mask stops
    unmasked = (_logits(overrides, degrees, t, documents=False) for t in (rows, changed))
    assert np.abs(np.subtract(*unmasked)[:, cut:]).max() > 1e-3


def test_where_document_masks_cannot_run_is_one_line():
    with pytest.raises(ShardlmError, match="data.document_mask must be true, false or auto"):
        load_config(None, MICRO + ["data.document_mask=sometimes"])
    cfg = load_config(None, MICRO + ["data.document_mask=true", "model.n_layers=2"])
    with pytest.raises(ShardlmError, match="a pipeline's microbatches .* carry no documents' ids") as e:
        model_source(cfg).check(make_mesh(stage=2, devices=jax.devices()[:2]))
    assert "\n" not in str(e.value)
    auto = model_source(load_config(None, MICRO + ["model.n_layers=2", "data.document_mask=auto"]))
    assert auto.documents(make_mesh(stage=2, devices=jax.devices()[:2])) is False  # auto: off on stages
    assert auto.documents(make_mesh(fsdp=2, devices=jax.devices()[:2])) is True  # and on where XLA's kernel runs
    assert load_config(None, []).data.document_mask == "auto"  # the default (docs/recipe.md: what was measured)


def test_evaluation_attends_within_documents_as_training_does():
    """The eval step of a run that trains within documents (positions restarting too) masks within them: its loss on
    a batch is the masked training loss on it; on a batch with no separator, the unmasked model's. A step that
    masks documents and is given no separator is refused, not handed token 0."""
    from shardlm.data.loader import BatchLoader
    from shardlm.sharding import batch_sharding
    from shardlm.train.state import create_train_state
    from shardlm.train.step import eval_step_for, train_step_for

    llama = MICRO + ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2"]
    mesh = make_mesh(fsdp=1, devices=jax.devices()[:1])
    bytes_ = np.ones(500, np.int32)
    masked, unmasked = (load_config(None, llama + o) for o in (
        ["data.document_mask=true", "data.document_positions=true"], ["data.document_mask=false"]))
    ts = create_train_state(masked, mesh, 500)
    with pytest.raises(ShardlmError, match="given no separator"):
        train_step_for(masked, ts, mesh)
    with pytest.raises(ShardlmError, match="given no separator"):
        eval_step_for(masked, ts, mesh, bytes_)
    rows = masked.train.batch_size
    with_documents = BatchLoader(documents_stream(4_000, 500), masked.model.seq_len, rows, batch_sharding(mesh),
                                 seed=0, shuffle=False).get(0)
    assert int((np.asarray(with_documents)[:, :-1] == SEPARATOR).sum()) > rows  # several documents a row
    without = jax.device_put(np.random.default_rng(0).integers(1, 500, (rows, masked.model.seq_len + 1),
                                                               dtype=np.int32), batch_sharding(mesh))
    evaluate = eval_step_for(masked, ts, mesh, bytes_, separator=SEPARATOR)
    plain = eval_step_for(unmasked, ts, mesh, bytes_)
    evaluated = {name: float(evaluate(ts.state, b)["loss"]) for name, b in (("docs", with_documents),
                                                                            ("none", without))}
    across = float(plain(ts.state, with_documents)["loss"])
    np.testing.assert_allclose(evaluated["none"], float(plain(ts.state, without)["loss"]), rtol=1e-6)
    _, metrics = train_step_for(masked, ts, mesh, separator=SEPARATOR)(ts.state, with_documents)  # (donates)
    np.testing.assert_allclose(evaluated["docs"], float(metrics["loss"]), rtol=1e-6)  # (float32 sums)
    assert abs(evaluated["docs"] - across) > 1e-4  # what evaluating across documents measured instead
