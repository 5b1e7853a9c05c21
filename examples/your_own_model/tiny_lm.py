"""A language model as a user writes it: plain Flax NNX, no sharding code, no shardlm import.

    shardlm train model=py:examples/your_own_model/tiny_lm.py:build plan=examples/your_own_model/fsdp_tp.yaml

shardlm calls `build` with the arguments it declares (the vocabulary of the run's tokenizer, the sequence length,
the dropout rate and an nnx.Rngs from the run's seed) and trains what it returns; the plan says where each
parameter goes. docs/your-own-model.md walks through it.
"""

import jax.numpy as jnp
from flax import nnx


class Block(nnx.Module):
    def __init__(self, d: int, heads: int, dropout: float, *, rngs: nnx.Rngs):
        self.norm1 = nnx.LayerNorm(d, rngs=rngs)
        self.attn = nnx.MultiHeadAttention(num_heads=heads, in_features=d, decode=False, rngs=rngs)
        self.norm2 = nnx.LayerNorm(d, rngs=rngs)
        self.fc1 = nnx.Linear(d, 4 * d, rngs=rngs)
        self.fc2 = nnx.Linear(4 * d, d, rngs=rngs)
        self.drop = nnx.Dropout(dropout, rngs=rngs)

    def __call__(self, x):
        x = x + self.drop(self.attn(self.norm1(x), mask=nnx.make_causal_mask(x[..., 0])))
        return x + self.drop(self.fc2(nnx.gelu(self.fc1(self.norm2(x)))))


class TinyLM(nnx.Module):
    def __init__(self, vocab: int, context: int, d: int = 128, heads: int = 4, layers: int = 4, dropout: float = 0.0,
                 *, rngs: nnx.Rngs):
        self.embed = nnx.Embed(vocab, d, rngs=rngs)
        self.pos = nnx.Embed(context, d, rngs=rngs)
        self.blocks = nnx.List([Block(d, heads, dropout, rngs=rngs) for _ in range(layers)])
        self.norm = nnx.LayerNorm(d, rngs=rngs)
        self.head = nnx.Linear(d, vocab, rngs=rngs)

    def __call__(self, tokens):  # [batch, seq] -> logits [batch, seq, vocab]
        x = self.embed(tokens) + self.pos(jnp.arange(tokens.shape[1]))[None]
        for block in self.blocks:
            x = block(x)
        return self.head(self.norm(x))


def build(vocab_size: int, seq_len: int, dropout: float, rngs: nnx.Rngs) -> TinyLM:
    return TinyLM(vocab_size, seq_len, dropout=dropout, rngs=rngs)
