"""Optimizer, schedule and FLOP accounting: the numbers the loop reports must be the ones it uses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import MICRO
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.models.gpt import padded_vocab_size
from shardlm.flops import flops_per_token, matmul_params, table_peak
from shardlm.train.source import model_source
from shardlm.train.optimizers import effective_warmup, make_optimizer, make_schedule


def test_schedule_warmup_then_cosine_to_the_floor():
    cfg = load_config(None, ["train.steps=100", "train.warmup_steps=10", "train.lr=1e-3", "train.min_lr_ratio=0.1"])
    lr = make_schedule(cfg)  # indexed by update count: count 0 is step 1
    assert float(lr(0)) == pytest.approx(1e-4)  # step 1: lr / warmup, not a wasted zero step
    assert float(lr(9)) == pytest.approx(1e-3)  # step 10: the peak
    assert float(lr(99)) == pytest.approx(1e-4)  # the last step: the floor
    mids = [float(lr(c)) for c in range(9, 100)]
    assert all(a >= b for a, b in zip(mids, mids[1:]))


def test_warmup_longer_than_the_run_is_shortened():
    cfg = load_config(None, ["train.steps=20", "train.warmup_steps=30", "train.lr=1e-3", "train.min_lr_ratio=0.1"])
    assert effective_warmup(cfg) == 2
    assert float(make_schedule(cfg)(19)) == pytest.approx(1e-4)


def test_weight_decay_only_on_matrices_and_embeddings():
    """Zero gradients: AdamW's only effect is decay, so exactly the decayed parameters move."""
    cfg = load_config(None, MICRO + ["train.weight_decay=0.5", "train.grad_clip=0"])
    with nnx.use_eager_sharding(False):
        model = model_source(cfg).factory(500, 1)()
        before = {k: np.asarray(v) for k, v in nnx.to_flat_state(nnx.state(model))}
        opt = nnx.Optimizer(model, make_optimizer(cfg), wrt=nnx.Param)
        for _ in range(10):  # past step 1, where warmup makes lr tiny
            opt.update(model, jax.tree.map(jnp.zeros_like, nnx.state(model, nnx.Param)))
    moved = {".".join(map(str, k)) for k, v in nnx.to_flat_state(nnx.state(model)) if not np.array_equal(before[k], np.asarray(v))}
    names = {".".join(map(str, k)) for k, _ in nnx.to_flat_state(nnx.state(model))}
    expected = {n for n in names if n.split(".")[-1] in {"wte", "wpe", "wq", "wk", "wv", "wo", "w_in", "w_out"}}
    assert moved == expected


def test_flops_per_token_by_hand():
    cfg = load_config(None, ["model.n_layers=4", "model.n_heads=8", "model.d_model=256", "model.d_mlp=1024",
                             "model.seq_len=128"])
    v = padded_vocab_size(50257)
    n = 4 * (4 * 256 * 256 + 2 * 256 * 1024) + 256 * 50304
    assert matmul_params(cfg.model, v) == n
    assert flops_per_token(cfg.model, v) == 6 * n + 12 * 4 * 128 * 256


@pytest.mark.parametrize("preset", ["tiny", "llama-tiny"])
def test_the_jaxpr_count_of_a_forward_pass_is_the_6n_plus_12ltd_convention(preset):
    """The count used for models from a user's file (3x the forward's matmuls, from its jaxpr) gives exactly the
    formula's FLOPs on shardlm's own models: the two conventions are one."""
    from shardlm.flops import jaxpr_matmul_flops

    cfg = load_config(None, [f"model={preset}"])
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(nnx.eval_shape(model_source(cfg).factory(500, 1)))
    tokens = jax.ShapeDtypeStruct((1, cfg.model.seq_len), jnp.int32)
    jaxpr = jax.make_jaxpr(lambda s, t: nnx.merge(graphdef, s)(t))(state, tokens)
    assert 3 * jaxpr_matmul_flops(jaxpr) == cfg.model.seq_len * flops_per_token(cfg.model, padded_vocab_size(500))


@pytest.mark.parametrize("kind, dtype, peak", [
    ("NVIDIA H100 80GB HBM3", "bfloat16", 989e12),
    ("NVIDIA H100 PCIe", "bfloat16", 756e12),
    ("NVIDIA H200", "float32", 494.5e12),
    ("NVIDIA L4", "bfloat16", 121e12),
    ("NVIDIA L40S", "bfloat16", None),
    ("TPU v5 lite", "bfloat16", 197e12),
    ("TPU v5", "bfloat16", 459e12),
    ("cpu", "float32", None),
])
def test_peak_table(kind, dtype, peak):
    assert table_peak(kind, dtype) == peak


def test_optax_version_has_tree_norm():
    assert float(optax.tree.norm({"a": jnp.ones(4)})) == 2.0


def test_eval_step_bits_per_byte_by_hand():
    """nats summed over tokens that spell text, divided by ln 2 and the bytes they spell."""
    from shardlm.mesh import make_mesh
    from shardlm.train.state import create_train_state
    from shardlm.train.step import eval_step_for

    cfg = load_config(None, MICRO)
    mesh = make_mesh(2, 2, 2)
    ts = create_train_state(cfg, mesh, 300)
    token_bytes = np.arange(300) % 4  # 0 for every fourth token, as for special tokens
    batch = np.random.default_rng(0).integers(0, 300, (16, 33)).astype(np.int32)
    out = jax.device_get(eval_step_for(cfg, ts, mesh, token_bytes)(ts.state, batch))
    model = nnx.merge(ts.graphdef, ts.state)["model"]
    logits = np.asarray(model(jnp.asarray(batch[:, :-1])), np.float64)[..., :300]
    logp = logits - np.log(np.exp(logits - logits.max(-1, keepdims=True)).sum(-1, keepdims=True)) - logits.max(
        -1, keepdims=True)
    nll = -np.take_along_axis(logp, batch[:, 1:, None], -1)[..., 0]
    b = token_bytes[batch[:, 1:]]
    assert float(out["loss"]) == pytest.approx(nll.mean(), rel=1e-5)
    assert float(out["nats"]) == pytest.approx(nll[b > 0].sum(), rel=1e-5)
    assert int(out["bytes"]) == b.sum()


def test_the_opening_lines_name_the_optimizer_and_each_recipe_setting():
    """What `recipe_lines` says of a recipe with every setting on, and of the defaults (each named as off): the
    optimizer with its summary, the spike guard with its numbers, document masks, QK-norm and the z-loss's
    weight."""
    from shardlm.train.loop import recipe_lines
    from shardlm.train.source import within_documents

    cfg = load_config(None, MICRO + ["train.optimizer=muon", "train.muon_nesterov=false", "data.document_mask=true",
                                     "data.document_positions=true", "model.qk_norm=true", "train.z_loss=1e-4",
                                     "train.spike_sigmas=5", "train.spike_window=64", "train.max_skips=4"])
    assert within_documents(cfg)
    optimizer, recipe = recipe_lines(cfg, within_documents(cfg))
    assert optimizer == ("optimizer: muon (train.optimizer): Muon on the hidden matrices (one momentum each), AdamW "
                         "on the rest; Muon's momentum heavy-ball (train.muon_nesterov=false)")
    assert recipe == ("recipe: spike guard on (skips an update beyond 5 sigmas of the last 64, stops after 4 skips in "
                      "a row) | document masks on (data.document_mask=true, positions restarting at each document) | "
                      "QK-norm on | z-loss 0.0001 x log^2 Z")
    cfg = load_config(None, MICRO + ["train.skip_spikes=false", "data.document_mask=false"])
    assert recipe_lines(cfg, within_documents(cfg)) == [
        "optimizer: adamw (train.optimizer): AdamW (two moments per parameter)",
        "recipe: spike guard off (train.skip_spikes=false) | document masks off (data.document_mask=false): attention "
        "across documents | QK-norm off | z-loss off"]


def test_a_run_halted_before_any_checkpoint_says_none_was_written_after_opening_lines_naming_its_recipe(
        tmp_path, capsys):
    """The spike guard's stop names the newest checkpoint only where one exists (tests/test_optimizers.py halts a run
    that has one); here none was written, and the line says so and how to start again, which is what re-running
    the directory does. The run's opening lines name its optimizer and recipe. (The configuration is
    test_optimizers' halted run's, checkpoints apart: the same compiled step.)"""
    from shardlm.checkpoint import local_steps
    from shardlm.train import step as step_module
    from shardlm.train.loop import recipe_lines, train
    from shardlm.train.rundir import plan_start
    from shardlm.train.source import within_documents

    cfg = load_config(None, MICRO + ["model.n_layers=1", "train.batch_size=4", "train.steps=12",
                                     "train.log_interval=1", "train.eval_interval=12", "train.eval_batches=1",
                                     "train.sample_tokens=0", "train.max_skips=3", "checkpoint.every=0",
                                     "data.tokenizer=bytes", "train.z_loss=1e-4"])
    run_dir = tmp_path / "run"
    step_module.LOSS_HOOK = lambda index: jnp.where(index >= 5, jnp.nan, 1.0)  # step 6 on: a non-finite loss
    try:
        with pytest.raises(ShardlmError) as err:
            train(cfg, run_dir, progress=False, devices=jax.devices()[:1])
    finally:
        step_module.LOSS_HOOK = None
    message = str(err.value)
    assert "\n" not in message and message.startswith("3 updates in a row were skipped by step 8 (train.max_skips=3)")
    assert ("no checkpoint was written before them, so there is none to resume from: start the run again (shardlm "
            f"train --run-dir {run_dir} restarts a run without checkpoints from step 0) with a lower train.lr") in message
    assert "checkpoint step" not in message and local_steps(run_dir) == []
    assert plan_start(run_dir, cfg, False, lambda line: None).reset  # as the line says: it starts again
    out = capsys.readouterr().out
    optimizer, recipe = recipe_lines(cfg, within_documents(cfg))  # (whichever way data.document_mask's default is)
    assert f"\n{optimizer}\n" in out and f"\n{recipe}\n" in out
    assert optimizer == "optimizer: adamw (train.optimizer): AdamW (two moments per parameter)"
    assert recipe.startswith("recipe: spike guard on (skips an update beyond 6 sigmas of the last 128, stops after 3 "
                             "skips in a row) | document masks ")
    assert recipe.endswith(" | QK-norm off | z-loss 0.0001 x log^2 Z")
    assert out.index("optimizer: ") < out.index("step 0 | eval loss")  # opening lines, before the first evaluation


def test_the_spike_guards_stop_names_the_newest_checkpoint_where_there_is_one(tmp_path):
    from shardlm.train.loop import spikes_halted

    message = str(spikes_halted(load_config(None, ["train.max_skips=5"]), 40, tmp_path / "run", 30))
    assert message.startswith("5 updates in a row were skipped by step 40 (train.max_skips=5)")
    assert (f"checkpoint step 30 ({tmp_path / 'run' / 'checkpoints' / '30'}) holds the weights from before them: "
            f"resume from it (shardlm train --run-dir {tmp_path / 'run'}) with a lower train.lr") in message
