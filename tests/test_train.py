"""Optimizer, schedule and FLOP accounting: the numbers the loop reports must be the ones it uses."""

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import nnx

from conftest import MICRO
from shardlm.config import load_config
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
