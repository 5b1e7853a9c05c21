import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlm.config import load_config
from shardlm.models.gpt import GPT, padded_vocab_size

from conftest import MICRO


def _model(vocab=500, extra=()):
    cfg = load_config(None, MICRO + list(extra))
    with nnx.use_eager_sharding(False):
        return GPT(cfg.model, vocab, padded_vocab_size(vocab, 1), nnx.Rngs(params=0))


def test_vocab_padding():
    assert padded_vocab_size(50257) == 50304
    assert padded_vocab_size(500, 1) == 512
    assert padded_vocab_size(512, 8) == 512
    assert padded_vocab_size(100, 3) == 192  # lcm(64, 3)


def test_padding_never_receives_probability_mass():
    model = _model(vocab=500)
    tokens = jnp.asarray(np.random.default_rng(0).integers(0, 500, (2, 32)), jnp.int32)
    probs = jax.nn.softmax(model(tokens), axis=-1)
    assert probs.shape == (2, 32, 512)
    assert float(jnp.max(probs[..., 500:])) == 0.0
    np.testing.assert_allclose(np.asarray(probs[..., :500].sum(-1)), 1.0, rtol=1e-5)


def test_attention_is_causal():
    model = _model()
    rng = np.random.default_rng(1)
    a = rng.integers(0, 500, (1, 32))
    b = a.copy()
    b[0, 20:] = rng.integers(0, 500, 12)  # change only the future of position 19
    la, lb = model(jnp.asarray(a, jnp.int32)), model(jnp.asarray(b, jnp.int32))
    np.testing.assert_array_equal(np.asarray(la[0, :20]), np.asarray(lb[0, :20]))
    assert not np.allclose(np.asarray(la[0, 20:]), np.asarray(lb[0, 20:]))


def test_untied_head_and_no_bias():
    model = _model(extra=["model.tie_embeddings=false", "model.use_bias=false"])
    assert model.lm_head is not None and model.lm_head[...].shape == (64, 512)
    assert model.blocks.attn.q_bias is None and model.blocks.ln1.bias is None
    assert model(jnp.zeros((1, 8), jnp.int32)).shape == (1, 8, 512)


def test_dropout_only_with_rngs():
    model = _model(extra=["model.dropout=0.5"])
    x = jnp.zeros((2, 16), jnp.int32)
    np.testing.assert_array_equal(np.asarray(model(x)), np.asarray(model(x)))
    assert not np.allclose(np.asarray(model(x)), np.asarray(model(x, rngs=nnx.Rngs(dropout=0))))
