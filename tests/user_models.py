"""Models shardlm did not write, as a user's file holds them: plain Flax, no sharding code anywhere. The tests train
them with `shardlm train model=py:tests/user_models.py:build_nnx plan=...` (and `:build_linen`).

Both are small pre-norm transformers over tokens [batch, seq] -> logits [batch, seq, vocab], with layer names the
megatron preset knows (query/key/value/out, fc1/fc2), so a plan of a few lines splits them over fsdp x tensor.
"""

import jax.numpy as jnp
from flax import linen as nn
from flax import nnx

D_MODEL, HEADS, LAYERS = 32, 4, 2


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        x = x + self.attn(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0]))
        return x + self.drop(self.fc2(nnx.gelu(self.fc1(self.norm2(x)))))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, seq_len: int, dropout: float = 0.0, *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, D_MODEL, rngs=rngs)
        self.pos = nnx.Embed(seq_len, D_MODEL, rngs=rngs)
        self.blocks = nnx.List([Block(D_MODEL, HEADS, dropout, rngs=rngs) for _ in range(LAYERS)])
        self.norm = nnx.LayerNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, vocab, rngs=rngs)

    def __call__(self, tokens):
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build_nnx(vocab_size: int, seq_len: int, dropout: float, rngs: nnx.Rngs) -> TinyLM:
    return TinyLM(vocab_size, seq_len, dropout, rngs=rngs)


class LinenBlock(nn.Module):
    heads: int

    @nn.compact
    def __call__(self, x):
        d = x.shape[-1]
        mask = nn.make_causal_mask(x[..., 0])
        x = x + nn.MultiHeadDotProductAttention(num_heads=self.heads, name="attn")(nn.LayerNorm()(x), mask=mask)
        h = nn.Dense(4 * d, name="fc1")(nn.LayerNorm()(x))
        h = nn.with_logical_constraint(h, ("batch", "length", "mlp"))  # a no-op unless a plan maps these names
        return x + nn.Dense(d, name="fc2")(nn.gelu(h))


class LinenLM(nn.Module):
    vocab: int
    seq_len: int

    @nn.compact
    def __call__(self, tokens):
        x = nn.Embed(self.vocab, D_MODEL, name="embed")(tokens)
        x = x + nn.Embed(self.seq_len, D_MODEL, name="pos")(jnp.arange(tokens.shape[1]))[None]
        for i in range(LAYERS):
            x = LinenBlock(HEADS, name=f"block_{i}")(x)
        return nn.Dense(self.vocab, name="head")(nn.LayerNorm()(x))


def build_linen(vocab_size: int, seq_len: int) -> nn.Module:
    return LinenLM(vocab_size, seq_len)


def build_nothing(vocab_size: int):
    return {"not": "a module"}


def build_needs_width(width: int):
    return TinyLM(width, 8, rngs=nnx.Rngs(0))


class LinenWithTrainFlag(nn.Module):
    """A Linen model whose training mode is an argument: it needs `model.call=call_with_train`."""
    vocab: int

    @nn.compact
    def __call__(self, tokens, train):
        x = nn.Embed(self.vocab, D_MODEL, name="embed")(tokens)
        x = nn.Dropout(0.1, deterministic=not train)(x)
        return nn.Dense(self.vocab, name="head")(x)


def build_linen_train_flag(vocab_size: int):
    return LinenWithTrainFlag(vocab_size)


def call_with_train(model, tokens, train):
    return model(tokens, train=train)


class BatchNormLM(nnx.Module):
    """Batch statistics that a training step updates (and evaluation reads)."""

    def __init__(self, vocab: int, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, D_MODEL, rngs=rngs)
        self.bn = nnx.BatchNorm(D_MODEL, rngs=rngs)
        self.head = nnx.Linear(D_MODEL, vocab, rngs=rngs)

    def __call__(self, tokens):
        return self.head(self.bn(self.embed(tokens)))


def build_batchnorm(vocab_size: int, rngs: nnx.Rngs):
    return BatchNormLM(vocab_size, rngs)


class TupleLM(TinyLM):
    def __call__(self, tokens):
        return super().__call__(tokens), {"aux": 0}


def build_tuple(vocab_size: int, seq_len: int, rngs: nnx.Rngs):
    return TupleLM(vocab_size, seq_len, rngs=rngs)
