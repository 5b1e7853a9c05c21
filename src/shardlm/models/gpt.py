"""GPT-2 family language model (the miniGPT of the JAX AI stack tutorial, in pre-LN form as in GPT-2 and nanoGPT).
Math only; the forward pass, attention and the KV cache are shared with the other families (`layers`).

Design choices:
- Every parameter carries logical axis names (`embed`, `heads`, `kv_heads`, `head_dim`, `mlp`, `vocab`, `pos`)
  and a few activations are pinned with `constrain(x, "batch", "seq", ...)`. No mesh axis is named here: the
  table in `shardlm.sharding.rules` decides what DP, FSDP and TP mean.
- Learned position embeddings, LayerNorm (computed in float32), a GELU MLP, biases by default; every head has
  its own keys and values (kv_heads = heads).
- Dropout is applied on the embeddings and on each residual branch (fused attention kernels have no dropout on
  attention probabilities).
- The vocabulary is padded (see `padded_vocab_size`) so that every tensor degree divides it; padded logits are set
  to -inf, so the padding never receives probability mass, in the loss or in sampling.
- Initialisation follows GPT-2: N(0, 0.02), residual output projections scaled by 1/sqrt(2 * n_layers).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.models import remat
from shardlm.models.config import ModelConfig
from shardlm.models.attention import CACHE_AXES, Attention
from shardlm.models.layers import CausalLM, PreNormBlock
from shardlm.models.params import padded_vocab_size, param, use
from shardlm.models.stack import LayerCache
from shardlm.models.precision import Precision, add_bias
from shardlm.sharding import constrain

__all__ = ["GPT", "CACHE_AXES", "LayerCache", "padded_vocab_size"]


class LayerNorm(nnx.Module):
    def __init__(self, d: int, eps: float, use_bias: bool, param_dtype, rngs: nnx.Rngs):
        self.eps = eps
        self.scale = param(rngs, nnx.initializers.ones_init(), (d,), ("embed",), param_dtype, read_in_float32=True)
        self.bias = param(rngs, nnx.initializers.zeros_init(), (d,), ("embed",), param_dtype,
                          read_in_float32=True) if use_bias else None

    def __call__(self, x):
        x32 = x.astype(jnp.float32)
        mean = x32.mean(-1, keepdims=True)
        var = jnp.square(x32 - mean).mean(-1, keepdims=True)
        y = (x32 - mean) * jax.lax.rsqrt(var + self.eps) * self.scale[...].astype(jnp.float32)
        y = y + self.bias[...].astype(jnp.float32) if self.bias is not None else y
        return y.astype(x.dtype)


class MLP(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.precision = Precision.of(cfg)
        d, f, pd = cfg.d_model, cfg.d_mlp, self.precision.param
        self.w_in = param(rngs, nnx.initializers.normal(0.02), (d, f), ("embed", "mlp"), pd)
        self.w_out = param(rngs, nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers)), (f, d),
                           ("mlp", "embed"), pd)
        zeros = nnx.initializers.zeros_init()
        bias = lambda shape, names: param(rngs, zeros, shape, names, pd, read_in_float32=True)  # noqa: E731
        self.in_bias = bias((f,), ("mlp",)) if cfg.use_bias else None
        self.out_bias = bias((d,), ("embed",)) if cfg.use_bias else None

    def __call__(self, x):
        p = self.precision
        h = add_bias(p.dense("btd,df->btf", x, use(self.w_in, p.compute)), self.in_bias)
        h = remat.named(constrain(h, "batch", "seq", "act_mlp"), remat.MLP_HIDDEN)
        h = jax.nn.gelu(h, approximate=True)
        return add_bias(p.dense("btf,fd->btd", h, use(self.w_out, p.compute)), self.out_bias)


class Block(PreNormBlock):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        precision = Precision.of(cfg)
        pd = precision.param
        self.ln1 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, pd, rngs)
        self.attn = Attention(cfg.d_model, cfg.n_heads, cfg.n_heads, cfg.n_layers, cfg.use_bias, precision, rngs,
                              qk_norm_eps=cfg.layer_norm_eps if cfg.qk_norm else 0.0)  # OLMo 2's QK-norm
        self.ln2 = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, pd, rngs)
        self.mlp = MLP(cfg, rngs)
        self.dropout = nnx.Dropout(cfg.dropout)


class GPT(CausalLM):
    """`vocab_size` is the tokenizer's; the embedding tables are `padded_vocab` rows."""

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab: int, rngs: nnx.Rngs):
        self.vocab_size, self.padded_vocab, self.context = vocab_size, padded_vocab, cfg.seq_len
        self.precision, self.attention = Precision.of(cfg), cfg.attention
        self.remat, self.remat_offload = cfg.remat, cfg.remat_offload
        pd = self.precision.param
        init = nnx.initializers.normal(0.02)
        self.wte = param(rngs, init, (padded_vocab, cfg.d_model), ("vocab", "embed"), pd, cast_where_read=True)
        self.wpe = param(rngs, init, (cfg.seq_len, cfg.d_model), ("pos", "embed"), pd, cast_where_read=True)
        self.dropout = nnx.Dropout(cfg.dropout)
        self._stack_blocks(cfg, lambda r, i=None: Block(cfg, r), rngs)
        self.ln_f = LayerNorm(cfg.d_model, cfg.layer_norm_eps, cfg.use_bias, pd, rngs)
        self.lm_head = None if cfg.tie_embeddings else param(rngs, init, (cfg.d_model, padded_vocab),
                                                             ("embed", "vocab"), pd, cast_where_read=True)

    def _embed(self, tokens, rngs, pos):
        """`pos`: None (positions 0..T-1), each row's decode position [batch], or every token's [batch, T]."""
        if pos is None:
            positions = self.wpe[...][: tokens.shape[1]]
        else:  # a lookup per row (per token): gather FSDP shards of the table first
            positions = constrain(self.wpe[...], "pos", "act_embed")[pos]
            positions = positions[:, None] if pos.ndim == 1 else positions
        # added in float32, then cast: the positions' gradient is a float32 sum over the batch
        x = (self._token_rows(tokens).astype(jnp.float32) + positions).astype(self.precision.compute)
        return self.dropout(x, deterministic=rngs is None, rngs=rngs), None
