"""Seed 002's miniGPT in Flax NNX with every `nnx.with_partitioning` removed, sharded by plans alone.

The model code below knows nothing about meshes. The same module is trained with the `dp`, `fsdp` and `megatron`
presets and with the hand-written plan `plans/minigpt_hybrid.yaml` on 8 simulated CPU devices, and each run's
losses are compared with the unsharded model's:

    python examples/nnx_minigpt.py                 # 8 simulated devices, 20 steps per strategy
    python examples/nnx_minigpt.py --explain       # also print where every parameter lives under the hybrid plan

Two changes from the seed, both forced by current Flax: `nnx.List` instead of a plain list of blocks (Flax 0.12
refuses module lists stored as plain attributes), and no `NamedSharding` in the initializers.
"""

import argparse
import sys
import time
from pathlib import Path

import jax
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


def text_batches(n: int, batch_size: int, seq_len: int):
    """Byte-level windows of the built-in Shakespeare corpus (offline), [batch, seq + 1] each."""
    import numpy as np

    from shardlm.data.corpus import builtin_documents

    data = np.frombuffer("\n".join(builtin_documents("shakespeare")).encode("utf-8"), np.uint8).astype(np.int32)
    rng = np.random.default_rng(0)
    for _ in range(n):
        starts = rng.integers(0, len(data) - seq_len - 1, batch_size)
        yield np.stack([data[s:s + seq_len + 1] for s in starts])


def main(argv=None) -> int:
    parser = argparse.ArgumentParser(description=__doc__.splitlines()[0])
    parser.add_argument("--cpu-devices", type=int, default=8)
    parser.add_argument("--steps", type=int, default=20)
    parser.add_argument("--batch-size", type=int, default=16)
    parser.add_argument("--explain", action="store_true")
    args = parser.parse_args(argv)

    import shardlm

    shardlm.simulate_cpu_devices(args.cpu_devices)
    import optax

    batches = list(text_batches(args.steps, args.batch_size, SIZES["maxlen"]))
    build = lambda: MiniGPT(**SIZES, rngs=nnx.Rngs(0))  # noqa: E731
    strategies = {
        "unsharded (1 device)": ("dp", shardlm.make_mesh(devices=jax.devices()[:1])),
        "dp": ("dp", None),
        "fsdp": ("fsdp", None),
        "megatron": ("megatron", None),
        "megatron, data=2 x tensor=4": ("megatron", shardlm.make_mesh(data=2, tensor=4)),
        f"hand-written plan ({HYBRID_PLAN.name})": (HYBRID_PLAN, None),
    }
    reference = None
    for label, (plan, mesh) in strategies.items():
        sharded = shardlm.shard(build, plan, mesh)  # built sharded: no device ever holds the whole model
        trainer = sharded.trainer(optax.adamw(3e-3))
        start = time.perf_counter()
        losses = [float(trainer.step(b)["loss"]) for b in batches]
        elapsed = time.perf_counter() - start
        reference = reference or losses
        worst = max(abs(a - b) / abs(b) for a, b in zip(losses, reference))
        mesh_text = " x ".join(f"{k}={v}" for k, v in sharded.mesh.shape.items())
        print(f"{label:<42} mesh {mesh_text:<24} loss {losses[0]:.4f} -> "
              f"{losses[-1]:.4f}  max rel. diff vs unsharded {worst:.1e}  ({elapsed:.1f} s, {trainer.compiles} compile)")
        if args.explain and plan == HYBRID_PLAN:
            print(shardlm.explain(trainer))
    return 0


if __name__ == "__main__":
    sys.exit(main())
