"""Sampling text from a trained model, on the training mesh, with temperature and top-k.

This first version recomputes the whole (fixed-length) context for every new token inside one jitted
`lax.fori_loop`: simple and exact, fine for the short end-of-training samples. KV-cache decoding will replace it.
"""

import jax
import jax.numpy as jnp
import numpy as np
from flax import nnx

from shardlm.sharding import batch_sharding, replicated, use_mesh_rules


def sample_tokens(graphdef, state, mesh, prompts: np.ndarray, prompt_len: int, max_new: int,
                  temperature: float, top_k: int, seed: int) -> np.ndarray:
    """`graphdef`, `state`: the model's (`nnx.split(model)`). prompts: [batch, seq_len] int32 with the prompt in the
    first `prompt_len` positions. Returns the buffer."""
    seq_len = prompts.shape[1]
    max_new = min(max_new, seq_len - prompt_len)

    def run(state, buf, key):
        model = nnx.merge(graphdef, state)

        def body(i, carry):
            buf, key = carry
            pos = prompt_len + i
            with use_mesh_rules(mesh):
                logits = model(buf)
            logits = jax.lax.dynamic_index_in_dim(logits, pos - 1, axis=1, keepdims=False)
            logits = logits / max(temperature, 1e-6)
            if top_k > 0:
                kth = jax.lax.top_k(logits, top_k)[0][:, -1:]
                logits = jnp.where(logits < kth, -jnp.inf, logits)
            key, sub = jax.random.split(key)
            nxt = jax.random.categorical(sub, logits).astype(buf.dtype)
            return buf.at[:, pos].set(nxt), key

        return jax.lax.fori_loop(0, max_new, body, (buf, key))[0]

    shard = batch_sharding(mesh)
    fn = jax.jit(run, out_shardings=shard)
    buf = jax.device_put(prompts, shard)
    out = fn(state, buf, jax.device_put(jax.random.key(seed), replicated(mesh)))
    return np.asarray(jax.device_get(out))[:, : prompt_len + max_new]


def sample_text(graphdef, state, mesh, tokenizer, prompt: str, n_samples: int, max_new: int, seq_len: int,
                temperature: float = 0.8, top_k: int = 40, seed: int = 0) -> list[str]:
    dp = mesh.shape["data"] * mesh.shape["fsdp"]
    batch = -(-n_samples // dp) * dp  # the batch dimension is split over data x fsdp
    ids = tokenizer.encode(prompt)[: seq_len - 1] or [tokenizer.eot_id]
    prompts = np.zeros((batch, seq_len), np.int32)
    prompts[:, : len(ids)] = ids
    out = sample_tokens(graphdef, state, mesh, prompts, len(ids), max_new, temperature,
                        top_k, seed)
    return [tokenizer.decode(row[len(ids):]) for row in out[:n_samples]]  # the continuations
