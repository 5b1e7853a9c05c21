"""GPT-2 family language model (the miniGPT of the JAX AI stack tutorial, in pre-LN form as in GPT-2 and nanoGPT).
Math only.

Design choices:
- Every parameter carries logical axis names (`embed`, `heads`, `head_dim`, `mlp`, `vocab`, `pos`) and a few
  activations are pinned with `constrain(x, "batch", "seq", ...)`. No mesh axis is named here: the table in
  `shardlm.sharding.rules` decides what DP, FSDP and TP mean.
- Attention weights are stored per head, [embed, heads, head_dim], so splitting heads over a mesh axis is a plain
  dimension split (Megatron column-parallel for q/k/v, row-parallel for the output projection).
- Attention runs through `jax.nn.dot_product_attention` (fused/cuDNN where available, XLA elsewhere), so there is
  no dropout on attention probabilities; dropout is applied on the embeddings and on each residual branch.
- The vocabulary is padded (see `padded_vocab_size`) so that every tensor degree divides it; padded logits are set
  to -inf, so the padding never receives probability mass, in the loss or in sampling.
- Initialisation follows GPT-2: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers).
- Decoding keeps a fixed-size KV cache, [batch, seq_len, heads, head_dim] per layer for keys and for values, with
  the same logical names as the attention activations (so TP splits it by heads and DP/FSDP by batch).
  `prefill` fills positions 0..T-1 from a prompt; `decode` feeds one token per row at that row's own position and
  attends to the cache up to it. Rows may sit at different positions (prompts of different lengths).
"""

import math
from typing import NamedTuple

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.config import ModelConfig
from shardlm.sharding import constrain

VOCAB_MULTIPLE = 64  # GPT-2's 50257 -> 50304, the usual choice; also keeps matmuls aligned.


def padded_vocab_size(vocab_size: int, tensor_degree: int = 1) -> int:
    multiple = math.lcm(VOCAB_MULTIPLE, tensor_degree)
    return -(-vocab_size // multiple) * multiple


CACHE_AXES = ("batch", "act_heads", "seq", "head_dim")


class LayerCache(NamedTuple):
    """One layer's keys and values, [batch, heads, seq_len, head_dim] each (`CACHE_AXES`)."""

    k: jax.Array
    v: jax.Array


def _attend_to_cache(q, cache: LayerCache, pos):
    """One query per row, q [batch, 1, heads, head_dim], against cached positions 0..pos[b] -> [batch, 1, heads,
    head_dim]. Written out rather than through `jax.nn.dot_product_attention`: with the cache laid out heads-major,
    these einsums need no transposed copy of the cache (XLA:CPU made one per layer per step, 4x the attention's
    cost at batch 8), and a single query gains nothing from a fused kernel. Softmax in float32."""
    scores = jnp.einsum("bhd,bhsd->bhs", q[:, 0], cache.k).astype(jnp.float32) / math.sqrt(q.shape[-1])
    scores = jnp.where(jnp.arange(cache.k.shape[2]) <= pos[:, None, None], scores, -jnp.inf)
    probs = jax.nn.softmax(scores, axis=-1).astype(cache.v.dtype)
    return jnp.einsum("bhs,bhsd->bhd", probs, cache.v)[:, None]


def _param(rngs: nnx.Rngs, init, shape: tuple[int, ...], names: tuple[str | None, ...]) -> nnx.Param:
    return nnx.Param(nnx.with_partitioning(init, names)(rngs.params(), shape))


class LayerNorm(nnx.Module):
    def __init__(self, d: int, eps: float, use_bias: bool, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = _param(rngs, nnx.initializers.ones_init(), (d,), ("embed",))
        self.bias = _param(rngs, nnx.initializers.zeros_init(), (d,), ("embed",)) if use_bias else None

    def __call__(self, x):
        mean = x.mean(-1, keepdims=True)
        var = jnp.square(x - mean).mean(-1, keepdims=True)
        y = (x - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...]
        return y + self.bias[...] if self.bias is not None else y


class CausalSelfAttention(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, h = cfg.d_model, cfg.n_heads
        hd = d // h
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers))
        self.wq = _param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"))
        self.wk = _param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"))
        self.wv = _param(rngs, init, (d, h, hd), ("embed", "heads", "head_dim"))
        self.wo = _param(rngs, out_init, (h, hd, d), ("heads", "head_dim", "embed"))
        zeros = nnx.initializers.zeros_init()
        if cfg.use_bias:
            self.q_bias = _param(rngs, zeros, (h, hd), ("heads", "head_dim"))
            self.k_bias = _param(rngs, zeros, (h, hd), ("heads", "head_dim"))
            self.v_bias = _param(rngs, zeros, (h, hd), ("heads", "head_dim"))
            self.out_bias = _param(rngs, zeros, (d,), ("embed",))
        else:
            self.q_bias = self.k_bias = self.v_bias = self.out_bias = None

    def __call__(self, x, cache: LayerCache | None = None, pos: jax.Array | None = None):
        """x [batch, T, embed] -> ([batch, T, embed], cache).

        No cache: causal attention over x (training). A cache and no `pos`: a prefill, x is positions 0..T-1; its
        keys and values are written to the cache. A cache and `pos` [batch]: one decode step, x [batch, 1] is at
        position pos[b] of row b; its key and value are written there and it attends to positions 0..pos[b].
        """

        def project(w, b):
            y = jnp.einsum("bte,ehd->bthd", x, w[...])
            y = y + b[...] if b is not None else y
            return constrain(y, "batch", "seq", "act_heads", "head_dim")

        q, k, v = project(self.wq, self.q_bias), project(self.wk, self.k_bias), project(self.wv, self.v_bias)
        if pos is None:
            y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
            if cache is not None:
                t = x.shape[1]
                cache = LayerCache(*(constrain(c.at[:, :, :t].set(n.transpose(0, 2, 1, 3)), *CACHE_AXES)
                                     for c, n in zip(cache, (k, v))))
        else:
            # A scatter of one position per row, in place in the donated cache: O(1) per step, where a select over
            # the whole cache cost ~40% of a step. Sharded over batch, XLA all-gathers only the new rows' k and v
            # ([batch, heads, head_dim] per layer), never the cache.
            rows = jnp.arange(x.shape[0])
            cache = LayerCache(*(constrain(c.at[rows, :, pos].set(n[:, 0]), *CACHE_AXES)
                                 for c, n in zip(cache, (k, v))))
            y = _attend_to_cache(q, cache, pos)
        y = constrain(y, "batch", "seq", "act_heads", "head_dim")
        # [b, t, heads*head_dim] @ [heads*head_dim, embed]: both reshapes are free (row-major), and unlike an einsum
        # over (h, d) this needs no transposed copy of wo when y comes from `_attend_to_cache` (12% of a decode
        # step). heads stays the major half of the merged dimension, so a split over tensor carries over.
        b, t, h, d = y.shape
        out = y.reshape(b, t, h * d) @ self.wo[...].reshape(h * d, -1)
        return (out + self.out_bias[...] if self.out_bias is not None else out), cache


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        d, f = cfg.d_model, cfg.d_mlp
        self.w_in = _param(rngs, nnx.initializers.normal(0.02), (d, f), ("embed", "mlp"))
        self.w_out = _param(
            rngs, nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers)), (f, d), ("mlp", "embed")
        )
        zeros = nnx.initializers.zeros_init()
        self.in_bias = _param(rngs, zeros, (f,), ("mlp",)) if cfg.use_bias else None
        self.out_bias = _param(rngs, zeros, (d,), ("embed",)) if cfg.use_bias else None

    def __call__(self, x):
        h = x @ self.w_in[...]
        h = h + self.in_bias[...] if self.in_bias is not None else h
        h = constrain(jax.nn.gelu(h, approximate=True), "batch", "seq", "act_mlp")
        out = h @ self.w_out[...]
        return out + self.out_bias[...] if self.out_bias is not None else out


class Block(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.ln1 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, rngs)
        self.attn = CausalSelfAttention(cfg, rngs)
        self.ln2 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, rngs)
        self.mlp = MLP(cfg, rngs)
        self.dropout = nnx.Dropout(cfg.dropout)

    def __call__(self, x, rngs: nnx.Rngs | None, cache: LayerCache | None = None, pos: jax.Array | None = None):
        a, cache = self.attn(self.ln1(x), cache, pos)
        x = x + self.dropout(a, deterministic=rngs is None, rngs=rngs)
        x = constrain(x, "batch", "seq", "act_embed")
        x = x + self.dropout(self.mlp(self.ln2(x)), deterministic=rngs is None, rngs=rngs)
        return constrain(x, "batch", "seq", "act_embed"), cache


class GPT(nnx.Module):
    """`vocab_size` is the tokenizer's; the embedding tables are `padded_vocab` rows."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab: int, rngs: nnx.Rngs):
        self.vocab_size = vocab_size
        self.padded_vocab = padded_vocab
        init = nnx.initializers.normal(0.02)
        self.wte = _param(rngs, init, (padded_vocab, cfg.d_model), ("vocab", "embed"))
        self.wpe = _param(rngs, init, (cfg.seq_len, cfg.d_model), ("pos", "embed"))
        self.dropout = nnx.Dropout(cfg.dropout)
        self.blocks = nnx.List([Block(cfg, rngs) for _ in range(cfg.n_layers)])
        self.ln_f = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, rngs)
        self.lm_head = None if cfg.tie_embeddings else _param(rngs, init, (cfg.d_model, padded_vocab), ("embed", "vocab"))

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None, *, at: jax.Array | None = None
                 ) -> jax.Array:
        """tokens [batch, seq] int32 -> logits [batch, seq, padded_vocab] float32. `rngs` enables dropout. With
        `at` [batch], only the logits at position at[b] of each row: [batch, 1, padded_vocab] (the output head is
        most of a small model's FLOPs, and all the positions' logits of a long batch are gigabytes)."""
        return self._forward(tokens, rngs, at=at)[0]

    def init_cache(self, batch: int) -> list[LayerCache]:
        """An empty KV cache for `batch` rows and the whole context (shard it with `CACHE_AXES`)."""
        attn = self.blocks[0].attn
        heads, head_dim = attn.wk.shape[1:]
        shape = (batch, heads, self.wpe.shape[0], head_dim)
        return [LayerCache(jnp.zeros(shape, self.wte.dtype), jnp.zeros(shape, self.wte.dtype)) for _ in self.blocks]

    def prefill(self, tokens: jax.Array, cache: list[LayerCache], *, at: jax.Array | None = None
                ) -> tuple[jax.Array, list[LayerCache]]:
        """tokens [batch, T] at positions 0..T-1 -> (logits [batch, T, padded_vocab], cache holding them); with
        `at` [batch], only each row's logits at position at[b] ([batch, 1, padded_vocab])."""
        return self._forward(tokens, None, cache, at=at)

    def decode(self, tokens: jax.Array, pos: jax.Array, cache: list[LayerCache]
               ) -> tuple[jax.Array, list[LayerCache]]:
        """tokens [batch, 1], row b at position pos[b] (< seq_len) -> (logits [batch, 1, padded_vocab], cache)."""
        return self._forward(tokens, None, cache, pos)

    def _forward(self, tokens, rngs, cache=None, pos=None, at=None):
        t = tokens.shape[1]
        # Gather FSDP shards of the table before the lookup (what FSDP does for every weight): a lookup into a
        # table split over the same axis as the batch is otherwise fully rematerialised by XLA's partitioner.
        with jax.named_scope("embed"):
            wte = constrain(self.wte[...], "vocab", "act_embed")
            if pos is None:
                positions = self.wpe[...][:t]
            else:  # a lookup per row: gather FSDP shards of the table first, as for wte
                positions = constrain(self.wpe[...], "pos", "act_embed")[pos][:, None]
            x = wte[tokens] + positions
            x = constrain(self.dropout(x, deterministic=rngs is None, rngs=rngs), "batch", "seq", "act_embed")
        new_cache = None if cache is None else []
        for i, block in enumerate(self.blocks):
            with jax.named_scope(f"layer{i}"):  # names the layer's ops in profiles and HLO (`shardlm profile`)
                x, layer = block(x, rngs, None if cache is None else cache[i], pos)
            if cache is not None:
                new_cache.append(layer)
        if at is not None:  # one position per row reaches the head
            x = jnp.take_along_axis(x, at[:, None, None], axis=1)
        with jax.named_scope("head"):
            x = self.ln_f(x)
            if self.lm_head is None:  # tied: contract with the table as stored; a `wte.T` operand made XLA:CPU
                logits = jnp.einsum("bte,ve->btv", x, wte)  # copy the transposed table (all of it) every call
            else:
                logits = x @ self.lm_head[...]
            logits = constrain(logits, "batch", "seq", "act_vocab")
            if self.padded_vocab != self.vocab_size:
                is_real = jnp.arange(self.padded_vocab) < self.vocab_size
                logits = jnp.where(is_real, logits, -jnp.inf)
        return logits, new_cache
