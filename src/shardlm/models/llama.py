"""Llama-style language model (Llama 2/3, TinyLlama, SmolLM): RMSNorm, rotary position embeddings, grouped-query
attention, a SwiGLU MLP, no biases, tied or untied output. Math only; the forward pass, attention and the KV cache
are shared with the other families (`layers`).

Design choices:
- Logical axis names as in the GPT family, plus `kv_heads` for the key/value projections, whose head count
  (`n_kv_heads`) may be smaller than the query heads': every kv head serves n_heads / n_kv_heads query heads
  (1 kv head: multi-query attention). Under TP both head dimensions are split over `tensor`, so the tensor degree
  must divide n_kv_heads as well as n_heads (`check_shardable` says so by name).
- RMSNorm computes in float32 and returns the compute dtype; rotary embeddings rotate q and k in float32 with
  tables computed once per forward pass ("rotate half" layout, as Hugging Face stores Llama checkpoints), plain or
  scaled for long contexts (Llama 3.1's `llama3`, YaRN: `shardlm.models.rope`).
- Qwen's variations are settings of the same block: a head size apart from d_model / n_heads (`head_dim`), biases
  on q, k and v (`qkv_bias`, Qwen2), and a per-head RMSNorm on q and k before the rotation (`qk_norm`, Qwen3).
- The SwiGLU MLP has three matrices, gate and up [embed, mlp] (column-parallel under TP) and down [mlp, embed]
  (row-parallel); its hidden size `d_mlp` is usually ~8/3 d_model rounded, not GPT's 4 d_model.
- Initialisation: N(0, 0.02), with the residual output projections (wo, w_down) scaled by 1/sqrt(2 * n_layers)
  as in GPT-2; norm scales start at one.
- A mixture of experts (`model.moe_experts`, Mixtral's and Qwen3-MoE's shape): the MLP of every
  `model.moe_every`-th layer is a `MoeMLP` (routed SwiGLU experts, `shardlm.models.moe`); the rest of the block is
  unchanged, and the block reports the layer's load-balancing loss and expert loads with its output.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.models import remat
from shardlm.models.config import ModelConfig, head_size, is_sparse_layer, sparse_layer_count
from shardlm.models.attention import Attention
from shardlm.models.norms import RMSNorm
from shardlm.models.rope import Rope
from shardlm.models.layers import CausalLM, PreNormBlock
from shardlm.models.params import param, use
from shardlm.models.precision import Precision
from shardlm.models.moe import MoeMLP, Routing
from shardlm.sharding import constrain


class SwiGLU(nnx.Module):
    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        self.precision = Precision.of(cfg)
        d, f, pd = cfg.d_model, cfg.d_mlp, self.precision.param
        init = nnx.initializers.normal(0.02)
        self.w_gate = param(rngs, init, (d, f), ("embed", "mlp"), pd)
        self.w_up = param(rngs, init, (d, f), ("embed", "mlp"), pd)
        self.w_down = param(rngs, nnx.initializers.normal(0.02 / math.sqrt(2 * cfg.n_layers)), (f, d),
                            ("mlp", "embed"), pd)

    def __call__(self, x):
        p = self.precision
        gate, up = (remat.named(constrain(y, "batch", "seq", "act_mlp"), remat.MLP_HIDDEN)
                    for y in p.denses("btd,df->btf", x, [use(w, p.compute) for w in (self.w_gate, self.w_up)]))
        return p.dense("btf,fd->btd", jax.nn.silu(gate) * up, use(self.w_down, p.compute))


class Block(PreNormBlock):
    """A Llama block; with `sparse`, its MLP is a mixture of experts (`shardlm.models.moe`). A sparse block whose
    router's bias is balanced (`model.moe_bias_rate` > 0, a sigmoid router: DeepSeek-V3's and Qwen3-MoE-style
    auxiliary-loss-free balancing) reports its loads by layer, which the trainer moves the bias from
    (`shardlm.train.balance`); `balanced=False` for a block outside the stack's layers (DeepSeek's MTP)."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs, sparse: bool = False, balanced: bool = True):
        precision = Precision.of(cfg)
        pd = precision.param
        # ln1 / ln2 / ln_f: RMSNorms, named as the GPT family's norms (and Hugging Face's "input_layernorm").
        self.ln1 = RMSNorm(cfg.d_model, cfg.layer_norm_eps, pd, rngs)
        self.attn = self.attention(cfg, precision, rngs)
        self.ln2 = RMSNorm(cfg.d_model, cfg.layer_norm_eps, pd, rngs)
        self.sparse = sparse
        if sparse:
            self.mlp = MoeMLP(cfg.d_model, cfg.moe_d_ff or cfg.d_mlp, cfg.moe_experts, cfg.moe_top_k,
                              shared_expert=cfg.moe_shared_expert, n_layers=cfg.n_layers, precision=precision,
                              rngs=rngs, kernel=cfg.moe_kernel, capacity_factor=cfg.moe_capacity_factor,
                              exchange=cfg.moe_exchange, dropless=cfg.moe_dropless, routing=Routing.of(cfg))
        else:
            self.mlp = SwiGLU(cfg, rngs)
        self.layer_loads = cfg.n_layers if sparse and balanced and cfg.moe_bias_rate else 0
        self.dropout = nnx.Dropout(cfg.dropout)

    @staticmethod
    def attention(cfg: ModelConfig, precision: Precision, rngs: nnx.Rngs) -> nnx.Module:
        """The block's attention: grouped-query attention, with Qwen's settings (a family built on this block
        changes it: DeepSeek's latent attention)."""
        return Attention(cfg.d_model, cfg.n_heads, cfg.n_kv_heads or cfg.n_heads, cfg.n_layers, False, precision,
                         rngs, head_dim=cfg.head_dim, qkv_bias=cfg.qkv_bias,
                         qk_norm_eps=cfg.layer_norm_eps if cfg.qk_norm else 0.0)


def is_sparse(cfg: ModelConfig, layer: int | None) -> bool:
    """Whether `layer` has a mixture of experts for its MLP: every `moe_every`-th layer of a model with experts
    (None: the layer of a scanned stack, where every layer is the same; `moe_every` is then 1)."""
    return cfg.moe_experts > 0 and (layer is None or is_sparse_layer(cfg, layer))


class Llama(CausalLM):
    """`vocab_size` is the tokenizer's; the embedding tables are `padded_vocab` rows. A family built on it (DeepSeek)
    changes its block (`block_class`) and the width its rotary tables turn (`rope_width`)."""

    block_class = Block

    @staticmethod
    def rope_width(cfg: ModelConfig) -> int:
        return head_size(cfg)

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab: int, rngs: nnx.Rngs):
        self.vocab_size, self.padded_vocab, self.context = vocab_size, padded_vocab, cfg.seq_len
        self.precision, self.attention = Precision.of(cfg), cfg.attention
        self.remat, self.remat_offload = cfg.remat, cfg.remat_offload
        self.rope = Rope.of(cfg, self.rope_width(cfg))
        pd = self.precision.param
        init = nnx.initializers.normal(0.02)
        self.wte = param(rngs, init, (padded_vocab, cfg.d_model), ("vocab", "embed"), pd, cast_where_read=True)
        self.dropout = nnx.Dropout(cfg.dropout)
        self.moe_experts, self.sparse_count = cfg.moe_experts, sparse_layer_count(cfg)
        self.balanced_layers = cfg.n_layers if cfg.moe_experts and cfg.moe_bias_rate else 0  # every layer's row
        self._stack_blocks(cfg, lambda r, i=None: self.block_class(cfg, r, sparse=is_sparse(cfg, i)), rngs)
        self.ln_f = RMSNorm(cfg.d_model, cfg.layer_norm_eps, pd, rngs)
        self.lm_head = None if cfg.tie_embeddings else param(rngs, init, (cfg.d_model, padded_vocab),
                                                             ("embed", "vocab"), pd, cast_where_read=True)

    def _embed(self, tokens, rngs, pos):
        """`pos`: None (positions 0..T-1), each row's decode position [batch], or every token's [batch, T]."""
        positions = jnp.arange(tokens.shape[1])[None] if pos is None else pos[:, None] if pos.ndim == 1 else pos
        x = self.dropout(self._token_rows(tokens), deterministic=rngs is None, rngs=rngs)
        return x, self.rope.tables(positions)
