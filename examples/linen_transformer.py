"""A Flax Linen decoder-only transformer in the style of seed 003, with no sharding annotations, sharded by plans.

The same module and training code run under the `dp`, `fsdp` and `megatron` presets and under the hand-written
plan `plans/linen_transformer.yaml`, on 8 simulated CPU devices; each run's losses are compared with the
unsharded model's:

    python examples/linen_transformer.py            # 20 steps per strategy
    python examples/linen_transformer.py --explain  # also print every parameter's placement under the plan

Unlike the seed's model, attention is causal only (the seed also masked token id 0 as padding, which a language
model over real text must not do) and there is a final LayerNorm before the output projection.
"""

import sys
from pathlib import Path

import jax
import jax.numpy as jnp
from flax import linen as nn

# ---- the model: plain Linen, auto-named submodules, nothing about meshes ----------------------------------------


class MLP(nn.Module):
    hidden_dim: int
    out_dim: int

    @nn.compact
    def __call__(self, x):
        # One statement per layer, as in the seed: Linen names submodules in construction order, so
        # `Dense(out)(gelu(Dense(hidden)(x)))` would make the *output* projection Dense_0.
        x = nn.Dense(self.hidden_dim)(x)
        x = nn.gelu(x)
        return nn.Dense(self.out_dim)(x)


class DecoderBlock(nn.Module):
    embed_dim: int
    num_heads: int

    @nn.compact
    def __call__(self, x, mask):
        h = nn.LayerNorm()(x)
        y = nn.MultiHeadDotProductAttention(num_heads=self.num_heads, deterministic=True, name="attn")(
            h, mask=mask)
        x = x + y
        return x + MLP(hidden_dim=4 * self.embed_dim, out_dim=self.embed_dim)(nn.LayerNorm()(x))


class DecoderOnlyTransformer(nn.Module):
    vocab_size: int
    seq_len: int
    embed_dim: int
    num_layers: int
    num_heads: int

    @nn.compact
    def __call__(self, input_ids):
        pos_emb = self.param("pos_embedding", nn.initializers.normal(stddev=0.02), (self.seq_len, self.embed_dim))
        x = nn.Embed(self.vocab_size, self.embed_dim)(input_ids) + pos_emb[None, : input_ids.shape[1]]
        mask = nn.make_causal_mask(input_ids)
        for _ in range(self.num_layers):
            x = DecoderBlock(self.embed_dim, self.num_heads)(x, mask)
        return nn.Dense(self.vocab_size)(nn.LayerNorm()(x))


# ---- sharding it by plans, and checking the losses ------------------------------------------------------------

ROOT = Path(__file__).resolve().parents[1]
PLAN = ROOT / "plans" / "linen_transformer.yaml"
SIZES = dict(vocab_size=512, seq_len=64, embed_dim=128, num_layers=2, num_heads=8)


def main(argv=None) -> int:
    from common import compare_strategies, parse_args, text_batches

    args = parse_args(__doc__, argv)  # also simulates --cpu-devices (default 8) before JAX starts
    import shardlm

    batches = list(text_batches(args.steps, args.batch_size, SIZES["seq_len"]))
    model = DecoderOnlyTransformer(**SIZES)
    init = lambda: model.init(jax.random.key(0), jnp.ones((2, SIZES["seq_len"]), jnp.int32))  # noqa: E731
    # variables=init: the init itself runs sharded, inside jit.
    compare_strategies(lambda plan, mesh: shardlm.shard(model, plan, mesh, variables=init), PLAN, batches,
                       args.explain)
    return 0


if __name__ == "__main__":
    sys.exit(main())
