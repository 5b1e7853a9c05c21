"""Seed 002's miniGPT in Flax NNX with every `nnx.with_partitioning` removed, sharded by plans alone.

The model code below knows nothing about meshes. The same module is trained with the `dp`, `fsdp` and `megatron`
presets and with the hand-written plan `plans/minigpt_hybrid.yaml` on 8 simulated CPU devices, and each run's
losses are compared with the unsharded model's:

    python examples/nnx_minigpt.py                 # 8 simulated devices, 20 steps per strategy
    python examples/nnx_minigpt.py --explain       # also print where every parameter lives under the hybrid plan

Two changes from the seed, both forced by current Flax: `nnx.List` instead of a plain list of blocks (Flax 0.12
refuses module lists stored as plain attributes), and no `NamedSharding` in the initializers.
"""

import sys
from pathlib import Path

import jax.numpy as jnp
from flax import nnx

# ---- the model: seed 002's miniGPT, unannotated ----------------------------------------------------------------


def causal_attention_mask(seq_len):
    return jnp.tril(jnp.ones((seq_len, seq_len)))


class TransformerBlock(nnx.Module):
    def __init__(self, embed_dim: int, num_heads: int, ff_dim: int, *, rngs: nnx.Rngs, rate: float = 0.1):
        self.mha = nnx.MultiHeadAttention(num_heads=num_heads, in_features=embed_dim, decode=False, rngs=rngs)
        self.dropout1 = nnx.Dropout(rate=rate)
        self.layer_norm1 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)
        self.linear1 = nnx.Linear(in_features=embed_dim, out_features=ff_dim, rngs=rngs)
        self.linear2 = nnx.Linear(in_features=ff_dim, out_features=embed_dim, rngs=rngs)
        self.dropout2 = nnx.Dropout(rate=rate)
        self.layer_norm2 = nnx.LayerNorm(epsilon=1e-6, num_features=embed_dim, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        _, seq_len, _ = inputs.shape
        attention_output = self.mha(inputs_q=inputs, mask=causal_attention_mask(seq_len), decode=False)
        attention_output = self.dropout1(attention_output, deterministic=not training)
        out1 = self.layer_norm1(inputs + attention_output)
        ffn_output = self.linear2(nnx.relu(self.linear1(out1)))
        ffn_output = self.dropout2(ffn_output, deterministic=not training)
        return self.layer_norm2(out1 + ffn_output)


class TokenAndPositionEmbedding(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, *, rngs: nnx.Rngs):
        self.token_emb = nnx.Embed(num_embeddings=vocab_size, features=embed_dim, rngs=rngs)
        self.pos_emb = nnx.Embed(num_embeddings=maxlen, features=embed_dim, rngs=rngs)

    def __call__(self, x):
        positions = jnp.arange(0, x.shape[1])[None, :]
        return self.token_emb(x) + self.pos_emb(positions)


class MiniGPT(nnx.Module):
    def __init__(self, maxlen: int, vocab_size: int, embed_dim: int, num_heads: int, feed_forward_dim: int,
                 num_transformer_blocks: int, rngs: nnx.Rngs):
        self.embedding_layer = TokenAndPositionEmbedding(maxlen, vocab_size, embed_dim, rngs=rngs)
        self.transformer_blocks = nnx.List([
            TransformerBlock(embed_dim, num_heads, feed_forward_dim, rngs=rngs) for _ in range(num_transformer_blocks)
        ])
        self.output_layer = nnx.Linear(in_features=embed_dim, out_features=vocab_size, rngs=rngs)

    def __call__(self, inputs, training: bool = False):
        x = self.embedding_layer(inputs)
        for transformer_block in self.transformer_blocks:
            x = transformer_block(x, training=training)
        return self.output_layer(x)


# ---- sharding it by plans, and checking the losses ------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
HYBRID_PLAN = ROOT / "plans" / "minigpt_hybrid.yaml"
SIZES = dict(maxlen=64, vocab_size=512, embed_dim=128, num_heads=8, feed_forward_dim=512, num_transformer_blocks=2)


def main(argv=None) -> int:
    from common import compare_strategies, parse_args, text_batches

    args = parse_args(__doc__, argv)  # also simulates --cpu-devices (default 8) before JAX starts
    import shardlm

    batches = list(text_batches(args.steps, args.batch_size, SIZES["maxlen"]))
    build = lambda: MiniGPT(**SIZES, rngs=nnx.Rngs(0))  # noqa: E731
    # Built sharded from the constructor: no device ever holds the whole model.
    compare_strategies(lambda plan, mesh: shardlm.shard(build, plan, mesh), HYBRID_PLAN, batches, args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
