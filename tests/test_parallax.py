"""Seed 003's notebook through `shardlm.parallax`: its own code (examples/parallax_notebook.py, the seed's cells
verbatim but for the import), its two sharding configs, on 8 simulated devices. Only the model size is smaller
than the notebook's, so that the test runs in seconds."""

import contextlib
import copy
import io
from pathlib import Path

import jax
import jax.numpy as jnp
import numpy as np
import optax
import pytest
from flax import traverse_util
from jax.sharding import NamedSharding, PartitionSpec as P

from shardlm.errors import ShardlmError
from shardlm.parallax.manual_sharding_linen import _seed_repr
from shardlm.foreign.layout import canonical

NOTEBOOK = Path(__file__).resolve().parents[1] / "examples" / "parallax_notebook.py"
VOCAB, SEQ, BATCH = 64, 16, 16

# The per-parameter log the seed prints (its first lines for each config, verbatim from the seed document).
SEED_LOG_1 = """\
Sharded param ('params', 'Embed_0', 'embedding') with PartitionSpec('data', 'model')
Sharded param ('params', 'PositionalEmbedding_0', 'pos_embedding') with PartitionSpec(None, 'model')
Sharded param ('params', 'SelfAttentionBlock_0', 'LayerNorm_0', 'scale') with PartitionSpec('model',)
Sharded param ('params', 'SelfAttentionBlock_0', 'LayerNorm_0', 'bias') with PartitionSpec('model',)
Sharded param ('params', 'SelfAttentionBlock_0', 'SelfAttention_0', 'query', 'kernel') with PartitionSpec(None, 'model', None)
Sharded param ('params', 'SelfAttentionBlock_0', 'SelfAttention_0', 'query', 'bias') with PartitionSpec('model', None)
Sharded param ('params', 'SelfAttentionBlock_0', 'SelfAttention_0', 'key', 'kernel') with PartitionSpec(None, 'model', None)
Sharded param ('params', 'SelfAttentionBlock_0', 'SelfAttention_0', 'key', 'bias') with PartitionSpec('model', None)
""".splitlines()  # noqa: E501
SEED_LOG_2 = ["Sharded param ('params', 'Embed_0', 'embedding') with PartitionSpec(None, 'model')"] + SEED_LOG_1[1:]


@pytest.fixture(scope="module")
def notebook():
    """The notebook's namespace: every cell except the two full-size `train(...)` calls at the end."""
    source = NOTEBOOK.read_text()
    assert source.count("from shardlm.parallax import manual_sharding_linen") == 1
    cells = "\n".join(line for line in source.splitlines() if not line.startswith("train(sharding_config"))
    namespace = {"__name__": "parallax_notebook"}
    exec(compile(cells, str(NOTEBOOK), "exec"), namespace)  # noqa: S102 - the seed's own code
    return namespace


def small_model(nb):
    model = nb["DecoderOnlyTransformer"](vocab_size=VOCAB, seq_len=SEQ, embed_dim=32, num_layers=2, num_heads=4)
    return model, model.init(jax.random.PRNGKey(0), jnp.ones((2, SEQ), dtype=jnp.int32))


def shard(nb, model, init_vars, config):
    out = io.StringIO()
    with contextlib.redirect_stdout(out):
        result = nb["manual_sharding_linen"].shard_linen_model(model, init_vars, config)
    return result, out.getvalue().splitlines()


@pytest.mark.parametrize("config_name, seed_log", [("sharding_config", SEED_LOG_1), ("sharding_config_2", SEED_LOG_2)])
def test_seed_configs_give_the_seed_specs_and_train(notebook, config_name, seed_log):
    nb = notebook
    config = nb[config_name]
    model, init_vars = small_model(nb)
    (runner, sharded_params, mesh), log = shard(nb, model, init_vars, config)
    assert dict(mesh.shape) == {"data": 4, "model": 2}  # 8 devices over ("data", "model")

    # The log: the seed's own lines first, then one line per parameter, in the model's creation order.
    assert log[: len(seed_log)] == seed_log
    flat_config = traverse_util.flatten_dict(config["parameters"])
    flat_params = traverse_util.flatten_dict(sharded_params)
    assert list(flat_params) == list(traverse_util.flatten_dict(init_vars))
    assert log == [f"Sharded param {k} with {_seed_repr(flat_config[k])}" for k in flat_params]
    # ...and the arrays carry exactly those specs, on that mesh (in JAX's canonical form, trailing Nones dropped,
    # which is the form a jitted step returns them in).
    for key, arr in flat_params.items():
        assert arr.sharding.mesh == mesh and arr.sharding.spec == canonical(flat_config[key]), key

    # The notebook's own training code: TrainState.create, its @jax.jit train_step, under `with mesh:`.
    state = nb["create_train_state"](runner, sharded_params, 1e-3)
    for (path, mu), param in zip(jax.tree_util.tree_flatten_with_path(state.opt_state[0].mu)[0],
                                 jax.tree.leaves(sharded_params)):
        assert mu.sharding == param.sharding, path  # optimizer state sharded like the params from step 0
    x, y = nb["generate_fake_lm_data"](BATCH, SEQ, VOCAB)
    expected = optax.softmax_cross_entropy_with_integer_labels(model.apply(init_vars, x), y).mean()
    # Flax's TrainState starts `step` as a Python int and optax its `count` as an uncommitted one-device scalar;
    # the jitted step returns both as mesh arrays, which alone costs the notebook one recompile at step 2. Start
    # them as what they become, and the params and AdamW moments must then need none.
    replicated = NamedSharding(mesh, P())
    commit = lambda x: x if getattr(x, "committed", True) and not isinstance(x, int) else jax.device_put(  # noqa: E731
        jnp.asarray(x), replicated)
    state = jax.tree.map(commit, state)
    nb["train_step"]._clear_cache()
    losses = []
    with pytest.warns(DeprecationWarning, match="with mesh"), mesh:
        for _ in range(3):
            state, metrics = nb["train_step"](state, x, y)
            losses.append(float(metrics["loss"]))
    np.testing.assert_allclose(losses[0], float(expected), rtol=1e-5)
    assert losses[2] < losses[0]
    assert nb["train_step"]._cache_size() == 1  # shardings survive the step: no recompile
    logits = runner(state.params, x)
    assert logits.sharding.spec == canonical(config["out"])


def test_typo_missing_key_and_indivisible_axis_are_errors(notebook):
    nb = notebook
    model, init_vars = small_model(nb)
    config = copy.deepcopy(nb["sharding_config"])
    config["parameters"]["params"]["Embed_0"]["embeding"] = config["parameters"]["params"]["Embed_0"].pop("embedding")
    with pytest.raises(ShardlmError, match="rule 1 '/params/Embed_0/embeding' matches no parameter"):
        shard(nb, model, init_vars, config)

    config = copy.deepcopy(nb["sharding_config"])
    del config["parameters"]["params"]["Dense_0"]
    with pytest.raises(ShardlmError, match=r"2 parameter\(s\) match no rule: params/Dense_0/bias \(64,\), "
                                           r"params/Dense_0/kernel \(32, 64\)"):
        shard(nb, model, init_vars, config)
    config["unmatched"] = "replicate"  # the seed's behaviour, now asked for by name
    (_, params, _), log = shard(nb, model, init_vars, config)
    assert "[WARN] No sharding spec for param ('params', 'Dense_0', 'kernel'), replicating it on every device" in log
    assert params["params"]["Dense_0"]["kernel"].sharding.is_fully_replicated

    config = copy.deepcopy(nb["sharding_config"])
    config["mesh_shape"] = (8, 1)  # 'data' over 8 devices, asked to split the 4 heads of a bias
    config["parameters"]["params"]["SelfAttentionBlock_0"]["SelfAttention_0"]["query"]["bias"] = P("data", None)
    with pytest.raises(ShardlmError, match=r"parameter params/SelfAttentionBlock_0/SelfAttention_0/query/bias of "
                                           r"shape \(4, 8\): dimension 0 \(size 4\) is split 8 ways over mesh axis "
                                           r"'data' \(8\)"):
        shard(nb, model, init_vars, config)


def test_shard_linen_model_importable_both_ways():
    import shardlm.parallax as parallax

    assert parallax.shard_linen_model is parallax.manual_sharding_linen.shard_linen_model


def test_mesh_axes_forms(notebook):
    nb = notebook
    model, init_vars = small_model(nb)
    (_, params, mesh), log = shard(nb, model, init_vars, {"mesh_axes": "data", "parameters": {},
                                                          "unmatched": "replicate"})
    assert dict(mesh.shape) == {"data": 8} and all(line.startswith("[WARN]") for line in log)
    with pytest.raises(ShardlmError, match="names an axis twice"):
        shard(nb, model, init_vars, {"mesh_axes": ("data", "data"), "parameters": {}})
