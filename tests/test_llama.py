"""The Llama family and the memory levers: parity across strategies, grouped-query attention, bfloat16 compute,
rematerialisation and gradient accumulation."""

import jax
import jax.numpy as jnp
import numpy as np
import pytest
from flax import nnx

from conftest import MICRO, PARITY_STRATEGIES, run_steps, structured_tokens
from shardlm.config import load_config
from shardlm.errors import ShardlmError
from shardlm.mesh import make_mesh
from shardlm.train.source import model_source
from shardlm.train.state import create_train_state
from shardlm.train.step import batch_struct

LLAMA = MICRO + ["model.family=llama", "model.use_bias=false", "model.n_kv_heads=2", "model.d_mlp=96"]

@pytest.fixture(scope="module")
def llama_trajectories():
    return {name: run_steps(LLAMA, degrees, steps=12)[0] for name, degrees in PARITY_STRATEGIES.items()}


def test_llama_learns(llama_trajectories):
    losses = llama_trajectories["1 device"]
    assert losses[-1] < 0.85 * losses[0]


@pytest.mark.parametrize("name", [n for n in PARITY_STRATEGIES if n != "1 device"])
def test_llama_strategy_matches_single_device(llama_trajectories, name):
    ref, got = llama_trajectories["1 device"], llama_trajectories[name]
    np.testing.assert_allclose(got[0], ref[0], rtol=1e-5)
    np.testing.assert_allclose(got[-1], ref[-1], rtol=1e-3)


def _model(overrides, vocab=500):
    cfg = load_config(None, overrides)
    with nnx.use_eager_sharding(False):
        return model_source(cfg).factory(vocab, 1)()


@pytest.mark.parametrize("kv_heads", [1, 2])
def test_grouped_query_attention_is_attention_with_shared_kv_heads(kv_heads):
    """A model with kv_heads key/value heads computes what the 4-head model computes when every query head's k/v
    weights are those of its group's kv head (query head n reads kv head n // (heads / kv_heads))."""
    per_layer = ["model.scan_layers=false"]  # block by block
    gqa = _model(LLAMA + per_layer + [f"model.n_kv_heads={kv_heads}"])
    mha = _model(LLAMA + per_layer + ["model.n_kv_heads=4"])
    assert gqa.blocks[0].attn.wk[...].shape == (64, kv_heads, 16)
    g = 4 // kv_heads
    # Same seed, same order of initialisers: every other parameter is already equal.
    for shared_block, block in zip(mha.blocks, gqa.blocks):
        shared_block.attn.wk[...] = jnp.repeat(block.attn.wk[...], g, axis=1)
        shared_block.attn.wv[...] = jnp.repeat(block.attn.wv[...], g, axis=1)
    np.testing.assert_array_equal(np.asarray(mha.blocks[0].attn.wq[...]), np.asarray(gqa.blocks[0].attn.wq[...]))
    shared = mha
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 32)), jnp.int32)
    np.testing.assert_allclose(np.asarray(gqa(tokens)[..., :500]), np.asarray(shared(tokens)[..., :500]),
                               rtol=1e-5, atol=1e-5)


@pytest.mark.parametrize("kv_heads, degrees", [(1, (2, 4, 1)), (4, (1, 2, 4))])
def test_gqa_trains_the_same_sharded(kv_heads, degrees):
    """kv_heads 1 (multi-query) and all 4 (kv_heads 2 is the parity tests' model): the same losses on one device
    and on a mesh; under TP the kv heads are split over tensor, read back from the arrays."""
    overrides = LLAMA + [f"model.n_kv_heads={kv_heads}"]
    ref = run_steps(overrides, (1, 1, 1), steps=2)[0]
    got, ts, mesh = run_steps(overrides, degrees, steps=2)
    np.testing.assert_allclose(got, ref, rtol=2e-5)
    wk = ts.state["model"]["blocks"]["attn"]["wk"][...]  # stacked over the layers
    assert wk.shape == (2, 64, kv_heads, 16)
    shard = wk.sharding.shard_shape(wk.shape)
    # embed over fsdp, and over data too: the training state is sharded over the data-parallel replicas
    assert shard == (2, 64 // (degrees[0] * degrees[1]), kv_heads // degrees[2], 16)


def test_kv_heads_not_divisible_by_tensor_is_a_clear_error():
    from shardlm.train.state import check_shardable

    cfg = load_config(None, LLAMA + ["model.n_kv_heads=2"])
    with pytest.raises(ShardlmError, match=r"mesh.tensor=4 must divide the key/value heads \(model.n_kv_heads=2\)"):
        check_shardable(cfg, make_mesh(2, 1, 4))
    with pytest.raises(ShardlmError, match="must divide model.n_heads=4"):
        load_config(None, LLAMA + ["model.n_kv_heads=3"])
    with pytest.raises(ShardlmError, match="applies to the llama family"):
        load_config(None, MICRO + ["model.n_kv_heads=2"])
    with pytest.raises(ShardlmError, match="no biases"):
        load_config(None, MICRO + ["model.family=llama"])


def test_presets_reach_a_billion_parameters():
    counts = {}
    for preset in ("llama-tiny", "llama-125m", "llama-350m", "llama-1b"):
        cfg = load_config(None, [f"model={preset}"])
        with nnx.use_eager_sharding(False):
            abstract = nnx.eval_shape(model_source(cfg).factory(32000, 1))
        counts[preset] = sum(x.size for x in jax.tree.leaves(nnx.state(abstract)))
        assert cfg.model.family == "llama" and not cfg.model.use_bias
    assert counts["llama-tiny"] < counts["llama-125m"] < counts["llama-350m"] < counts["llama-1b"]
    assert 1.0e9 < counts["llama-1b"] < 1.1e9  # Llama 3.2 1B's body with a 32k vocabulary
    assert 0.12e9 < counts["llama-125m"] < 0.135e9


def test_bfloat16_compute_tracks_float32_and_keeps_float32_state(llama_trajectories):
    """The first steps in bfloat16 stay within bfloat16's precision of float32; the master weights and AdamW
    moments stay float32, the matmuls run in bfloat16, and the logits reach the loss in float32."""
    ref = llama_trajectories["DP 2 x FSDP 2 x TP 2"][:5]  # the same config's first steps in float32
    got, ts, _ = run_steps(LLAMA + ["model.dtype=bfloat16"], (2, 2, 2), steps=5)
    np.testing.assert_allclose(got, ref, rtol=2e-2)
    assert not np.allclose(got, ref, rtol=1e-6)  # bfloat16 really ran
    assert {x.dtype for x in jax.tree.leaves(ts.state)} <= {jnp.dtype(jnp.float32), jnp.dtype(jnp.int32),
                                                             jnp.dtype(jnp.uint32), jnp.dtype(bool)}  # (the spike
    # guard's halt flag: `train.spikes`)
    model = _model(LLAMA + ["model.dtype=bfloat16"])
    tokens = jnp.zeros((2, 16), jnp.int32)
    assert model(tokens).dtype == jnp.float32
    assert model.init_cache(2).k.dtype == jnp.bfloat16  # the KV cache follows the compute dtype
    hlo = jax.jit(lambda m, t: m(t)).lower(model, tokens).as_text()
    import re

    matmuls = re.findall(r"stablehlo.dot_general.*?: \((tensor<[^)]*)\)", hlo)
    assert matmuls and all(re.findall(r"tensor<[\dx]*bf16>", m) for m in matmuls), matmuls


def test_grad_accum_is_the_full_batch_step(llama_trajectories):
    """grad_accum=4 on a 2x2x2 mesh: the same loss and gradient as one pass over the whole batch (1e-5 relative),
    and the same losses over the next steps."""
    from shardlm.losses import cross_entropy
    from shardlm.train.step import accumulated_grads

    cfg = load_config(None, LLAMA)
    mesh = make_mesh(2, 2, 2)
    ts = create_train_state(cfg, mesh, 500)
    batch = jax.device_put(structured_tokens(16 * 33, 500).reshape(16, 33), batch_struct(cfg, mesh).sharding)
    params_sharding = ts.shardings["model"]

    def loss_fn(model, tokens, key):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        return loss, {"loss": loss}

    @jax.jit
    def both(state, batch):
        from shardlm.sharding import use_mesh_rules

        model = nnx.merge(ts.graphdef, state)["model"]
        with use_mesh_rules(mesh):
            full = nnx.value_and_grad(lambda *a: loss_fn(*a)[0])(model, batch, None)
            metrics, grads = accumulated_grads(loss_fn, model, batch, jax.random.key(0), 4, params_sharding,
                                               batch_struct(cfg, mesh).sharding)
        return full, (metrics["loss"], grads)

    (loss_1, grads_1), (loss_4, grads_4) = both(ts.state, batch)
    assert float(loss_4) == pytest.approx(float(loss_1), rel=1e-5)
    diff = jax.tree.map(lambda a, b: a - b, grads_1, grads_4)
    assert float(optax_norm(diff)) <= 1e-5 * float(optax_norm(grads_1))

    full = llama_trajectories["DP 2 x FSDP 2 x TP 2"][:3]
    accumulated = run_steps(LLAMA + ["train.grad_accum=4"], (2, 2, 2), steps=3)[0]
    np.testing.assert_allclose(accumulated, full, rtol=1e-5)


def _converts_to(jaxpr, dtype, shapes, in_scan=False) -> tuple[int, int]:
    """(outside, inside a scan): how many casts of a float32 array shaped like one of `shapes` to `dtype` `jaxpr`
    holds, nested jaxprs included."""
    counts = [0, 0]
    for eqn in jaxpr.eqns:
        if (eqn.primitive.name == "convert_element_type" and eqn.params["new_dtype"] == dtype
                and eqn.invars[0].aval.dtype == jnp.float32 and eqn.invars[0].aval.shape in shapes):
            counts[in_scan] += 1
        inner = in_scan or eqn.primitive.name == "scan"
        for value in eqn.params.values():
            for sub in value if isinstance(value, (tuple, list)) else (value,):
                sub = getattr(sub, "jaxpr", sub)
                if isinstance(sub, jax.extend.core.Jaxpr):
                    outside, inside = _converts_to(sub, dtype, shapes, inner)
                    counts[0] += outside
                    counts[1] += inside
    return counts[0], counts[1]


def test_grad_accum_casts_the_weights_once_with_the_same_gradients():
    """In bfloat16, the microbatches of grad_accum differentiate weights cast once before their loop (the source's
    `cast_once`), not cast by every microbatch, and the loss and gradients are exactly those of casting in the loop."""
    from shardlm.losses import cross_entropy
    from shardlm.sharding import use_mesh_rules
    from shardlm.train.step import accumulated_grads

    cfg = load_config(None, LLAMA + ["model.dtype=bfloat16"])
    mesh = make_mesh(2, 2, 2)
    ts = create_train_state(cfg, mesh, 500)
    bsh = batch_struct(cfg, mesh).sharding
    batch = jax.device_put(structured_tokens(16 * 33, 500).reshape(16, 33), bsh)
    params_sharding = nnx.filter_state(ts.shardings["model"], nnx.Param)

    def loss_fn(model, tokens, key):
        loss = cross_entropy(model(tokens[:, :-1]), tokens[:, 1:])
        return loss, {"loss": loss}

    def grads(state, batch, cast_once):
        model = nnx.merge(ts.graphdef, state)["model"]
        with use_mesh_rules(mesh):
            return accumulated_grads(loss_fn, model, batch, jax.random.key(0), 4, params_sharding, bsh, cast_once)

    once, each = (jax.jit(lambda s, b, c=c: grads(s, b, c)) for c in (model_source(cfg).cast_once, None))
    (metrics_once, grads_once), (metrics_each, grads_each) = once(ts.state, batch), each(ts.state, batch)
    assert float(metrics_once["loss"]) == float(metrics_each["loss"])
    assert jax.tree.all(jax.tree.map(lambda a, b: bool(jnp.array_equal(a, b)), grads_once, grads_each))
    assert {g.dtype for g in jax.tree.leaves(grads_once)} == {jnp.dtype(jnp.float32)}

    from shardlm.models.precision import CAST_WHERE_READ

    params = nnx.state(nnx.merge(ts.graphdef, ts.state)["model"], nnx.Param)
    shapes = {v[...].shape for v in jax.tree.leaves(params, is_leaf=lambda v: isinstance(v, nnx.Variable))
              if v[...].ndim >= 2 and not v.get_metadata().get(CAST_WHERE_READ)}  # the matmuls' weights
    outside, inside = _converts_to(jax.make_jaxpr(each)(ts.state, batch).jaxpr, jnp.bfloat16, shapes)
    assert inside > 0 and outside == 0  # each microbatch casts the weights
    outside, inside = _converts_to(jax.make_jaxpr(once)(ts.state, batch).jaxpr, jnp.bfloat16, shapes)
    assert inside == 0 and outside > 0  # once, before the loop


def optax_norm(tree):
    import optax

    return optax.tree.norm(tree)


def test_grad_accum_errors():
    with pytest.raises(ShardlmError, match="does not split into train.grad_accum=3"):
        load_config(None, LLAMA + ["train.grad_accum=3"])
    from shardlm.train.state import check_batch

    cfg = load_config(None, LLAMA + ["train.grad_accum=4"])  # 16 / 4 = 4 sequences per microbatch
    with pytest.raises(ShardlmError, match="multiple of 32"):
        check_batch(cfg, make_mesh(8, 1, 1))


def test_llama_cache_equals_the_full_forward_with_grouped_kv_heads_on_a_mesh():
    """Prefill + one-token decode steps give the full forward's logits at every position (rotary positions, 2 kv
    heads for 4 query heads, both split over tensor 2)."""
    from test_generate import VOCAB, cached_vs_full, placed

    cfg = load_config(None, LLAMA + ["model.seq_len=48"])
    with nnx.use_eager_sharding(False):
        graphdef, state = nnx.split(model_source(cfg).factory(VOCAB, 1)())
    state = jax.tree.map(lambda x: x * 3, state)  # O(1) logits, so the tolerance is a real bound
    mesh = make_mesh(2, 1, 2, devices=jax.devices()[:4])
    tokens = np.random.default_rng(0).integers(0, VOCAB, (4, 48)).astype(np.int32)
    cached, full = cached_vs_full(graphdef, placed(state, mesh), mesh, jnp.asarray(tokens), [3, 17, 1, 30])
    for row, length in enumerate([3, 17, 1, 30]):
        np.testing.assert_allclose(cached[row, length - 1:], full[row, length - 1:], rtol=1e-4, atol=1e-4)
        np.testing.assert_allclose(cached[row, :length], full[row, :length], rtol=1e-4, atol=1e-4)


def test_llama_trains_checkpoints_and_generates_with_every_lever(tmp_path, capsys):
    """`model=llama-...` runs the whole path of the GPT family: bfloat16 compute, remat and grad accumulation in
    training on data 2 x fsdp 2 x tensor 2, a checkpoint, and generation from it on another mesh."""
    from shardlm.cli import main
    from shardlm.load import load_model
    from shardlm.train.loop import train

    run = tmp_path / "llama"
    overrides = ["model=llama-tiny", "model.n_layers=2", "model.seq_len=64", "train.batch_size=16",
                 "train.steps=6", "train.warmup_steps=2", "train.eval_interval=6", "train.eval_batches=1",
                 "train.sample_tokens=8", "data.tokenizer=bytes", "checkpoint.every=3", "model.dtype=bfloat16",
                 "model.remat=full", "train.grad_accum=2", "mesh.fsdp=2", "mesh.tensor=2"]
    summary = train(load_config(None, overrides), run, progress=False)
    assert summary["final_eval_loss"] < summary["first_eval_loss"] and (run / "samples.txt").exists()
    loaded = load_model(run, overrides=["mesh.tensor=2"])
    assert loaded.step == 6 and loaded.cfg.model.family == "llama" and loaded.mesh.shape["data"] == 4
    wk = loaded.state["blocks"]["attn"]["wk"][...]  # stacked over the 2 layers
    assert wk.dtype == jnp.float32 and wk.sharding.shard_shape(wk.shape) == (2, 128, 1, 32)  # 2 kv heads / tp 2
    assert main(["generate", str(run), "--prompt", "ROMEO:", "--max-tokens", "8", "--temperature", "0", "--json",
                 "mesh.tensor=2"]) == 0
    out = capsys.readouterr().out
    assert '"new_tokens"' in out


def test_plan_only_the_named_strategies_with_the_compute_dtypes_peak(capsys):
    """`shardlm plan --strategies` compiles just those; a bfloat16 model is costed at the H100's bfloat16 peak."""
    import json

    from shardlm.cli import main

    assert main(["plan", "--strategies", "fsdp8,fsdp4+tp2", "--json", *LLAMA, "model.vocab_size=500",
                 "model.dtype=bfloat16", "model.remat=full"]) == 0
    rows = json.loads(capsys.readouterr().out)
    assert [r["name"] for r in rows if r["mesh"]["tensor"] == 1] == ["fsdp8"] and len(rows) == 2
    for r in rows:
        assert r["est_compute_s"] >= r["flops_per_device"] / 989e12  # no kernel beats the bfloat16 peak


def test_compute_settings_may_change_on_resume_the_weights_may_not():
    from shardlm.train.rundir import config_changes

    saved = load_config(None, LLAMA)
    changed = load_config(None, LLAMA + ["model.dtype=bfloat16", "model.remat=full", "train.grad_accum=2",
                                         "model.attention=xla"])
    assert sorted(c.split()[0] for c in config_changes(changed, saved, 10)) == [
        "model.attention", "model.dtype", "model.remat", "train.grad_accum"]
    with pytest.raises(ShardlmError, match="model.param_dtype=bfloat16 differs"):
        config_changes(load_config(None, LLAMA + ["model.param_dtype=bfloat16"]), saved, 10)
    with pytest.raises(ShardlmError, match="model.n_kv_heads=1 differs"):
        config_changes(load_config(None, LLAMA + ["model.n_kv_heads=1"]), saved, 10)
