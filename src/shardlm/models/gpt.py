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
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.config import ModelConfig
from shardlm.sharding import constrain

VOCAB_MULTIPLE = 64  # GPT-2's 50257 -> 50304, the usual choice; also keeps matmuls aligned.


def padded_vocab_size(vocab_size: int, tensor_degree: int = 1) -> int:
    multiple = math.lcm(VOCAB_MULTIPLE, tensor_degree)
    return -(-vocab_size // multiple) * multiple


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

    def __call__(self, x):
        def project(w, b):
            y = jnp.einsum("bte,ehd->bthd", x, w[...])
            y = y + b[...] if b is not None else y
            return constrain(y, "batch", "seq", "act_heads", "head_dim")

        q, k, v = project(self.wq, self.q_bias), project(self.wk, self.k_bias), project(self.wv, self.v_bias)
        y = jax.nn.dot_product_attention(q, k, v, is_causal=True)
        y = constrain(y, "batch", "seq", "act_heads", "head_dim")
        out = jnp.einsum("bthd,hde->bte", y, self.wo[...])
        return out + self.out_bias[...] if self.out_bias is not None else out


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

    def __call__(self, x, rngs: nnx.Rngs | None):
        x = x + self.dropout(self.attn(self.ln1(x)), deterministic=rngs is None, rngs=rngs)
        x = constrain(x, "batch", "seq", "act_embed")
        x = x + self.dropout(self.mlp(self.ln2(x)), deterministic=rngs is None, rngs=rngs)
        return constrain(x, "batch", "seq", "act_embed")


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

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None) -> jax.Array:
        """tokens [batch, seq] int32 -> logits [batch, seq, padded_vocab] float32. `rngs` enables dropout."""
        t = tokens.shape[1]
        # Gather FSDP shards of the table before the lookup (what FSDP does for every weight): a lookup into a
        # table split over the same axis as the batch is otherwise fully rematerialised by XLA's partitioner.
        wte = constrain(self.wte[...], "vocab", "act_embed")
        x = wte[tokens] + self.wpe[...][:t]
        x = constrain(self.dropout(x, deterministic=rngs is None, rngs=rngs), "batch", "seq", "act_embed")
        for block in self.blocks:
            x = block(x, rngs)
        x = self.ln_f(x)
        head = wte.T if self.lm_head is None else self.lm_head[...]
        logits = constrain(x @ head, "batch", "seq", "act_vocab")
        if self.padded_vocab != self.vocab_size:
            is_real = jnp.arange(self.padded_vocab) < self.vocab_size
            logits = jnp.where(is_real, logits, -jnp.inf)
        return logits
