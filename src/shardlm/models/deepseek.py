"""DeepSeek-V3-style language model: the Llama decoder (RMSNorm, SwiGLU, rotary embeddings, `shardlm.models.llama`)
with multi-head latent attention (`shardlm.models.mla`), the first `moe_first_dense` layers dense and the rest
mixtures of fine-grained experts beside a shared one (sigmoid routing, node-limited, with the
auxiliary-loss-free bias: `shardlm.models.routing`), and multi-token prediction. Math only.

Design choices:
- The block is Llama's with `LatentAttention` in place of grouped-query attention; the rotary tables turn the
  rotary part only (`mla_rope_dim`), and the KV cache holds latents (`mla.LATENT_CACHE_AXES`).
- The first `moe_first_dense` layers are dense and held apart, one module each (`CausalLM.prefix`, run after the
  embedding); the sparse layers after them are the stack, scanned and split over pipeline stages as any model's.
- Each sparse block reports its expert loads as its own row of a [layers, experts] statistic when the bias is
  balanced (`model.moe_bias_rate` > 0); the trainer moves each layer's bias from it after the update
  (`shardlm.train.balance`), outside the gradient.
- Multi-token prediction (`model.mtp_depth` modules, DeepSeek-V3 section 2.2): module k combines the previous
  depth's hidden state h (the main model's last block output, before the final norm, for k = 0) and the
  embedding of the token k + 1 ahead, M_k [RMSNorm(emb); RMSNorm(h)] (DeepSeek's `eh_proj`, embedding first as
  DeepSeek's released weights are laid out), runs one block of the model's kind (sparse when the model has
  experts, as DeepSeek-V3's) and predicts the token k + 2 ahead through its own norm and the shared output head.
  Its loss is the mean over every depth of the cross entropy over the positions that have such a token: the
  fused head runs over every position, with the last k + 1 positions' inputs zeroed, which contribute exactly
  ln(vocabulary) each and no gradient, taken back out of the mean. Training only: evaluation, generation and the
  logits are the main model's. Its blocks' router biases are not balanced (their loads are not collected).
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.kernels.ring import from_zigzag, to_zigzag
from shardlm.models import llama, remat
from shardlm.models.config import ModelConfig
from shardlm.models.llama import Llama
from shardlm.models.mla import LATENT_CACHE_AXES, LatentAttention
from shardlm.models.norms import RMSNorm
from shardlm.models.params import param, use
from shardlm.models.precision import Precision
from shardlm.models.stack import LayerCache, run_blocks
from shardlm.sharding import constrain


class Block(llama.Block):
    """A DeepSeek block: Llama's with latent attention (its mixture routed by `Routing.of(cfg)`: sigmoid, groups,
    the shared expert)."""

    @staticmethod
    def attention(cfg: ModelConfig, precision: Precision, rngs: nnx.Rngs) -> nnx.Module:
        return LatentAttention(cfg, precision, rngs)


class Mtp(nnx.Module):
    """One multi-token prediction module: the two norms, the projection of their concatenation, a block, and the
    norm before the shared head."""

    def __init__(self, cfg: ModelConfig, rngs: nnx.Rngs):
        pd, d = Precision.of(cfg).param, cfg.d_model
        self.enorm = RMSNorm(d, cfg.layer_norm_eps, pd, rngs)
        self.hnorm = RMSNorm(d, cfg.layer_norm_eps, pd, rngs)
        self.eh_proj = param(rngs, nnx.initializers.normal(0.02), (2 * d, d), (None, "embed"), pd)
        self.block = Block(cfg, rngs, sparse=cfg.moe_experts > 0, balanced=False)
        self.norm = RMSNorm(d, cfg.layer_norm_eps, pd, rngs)


def _ahead(a: jax.Array, k: int, fill=0) -> jax.Array:
    """a [batch, T, ...] moved k positions earlier: position i holds a[:, i + k], the last k positions `fill`."""
    pad = [(0, 0)] * a.ndim
    pad[1] = (0, k)
    return jnp.pad(a[:, k:], pad, constant_values=fill)


class DeepSeek(Llama):
    block_class = Block
    cache_layout = LayerCache(LATENT_CACHE_AXES, LATENT_CACHE_AXES)

    @staticmethod
    def rope_width(cfg: ModelConfig) -> int:
        return cfg.mla_rope_dim

    def __init__(self, cfg: ModelConfig, vocab_size: int, padded_vocab: int, rngs: nnx.Rngs):
        super().__init__(cfg, vocab_size, padded_vocab, rngs)
        self.kv_rank, self.rope_dim = cfg.mla_kv_rank, cfg.mla_rope_dim
        self.mtp = nnx.List([Mtp(cfg, rngs) for _ in range(cfg.mtp_depth)])

    def cache_kind(self) -> str:
        return f"a latent of {self.kv_rank} and a rotary key of {self.rope_dim}"

    def init_cache(self, batch: int) -> LayerCache:
        """The latent cache: [layers, batch, 1, seq_len, latent] latents and [..., rope] rotary keys, in the
        compute dtype."""
        shape = (self.prefix_layers + self.n_layers, batch, 1, self.context)
        dtype = self.precision.compute
        return LayerCache(jnp.zeros((*shape, self.kv_rank), dtype), jnp.zeros((*shape, self.rope_dim), dtype))

    def loss(self, tokens, targets, rngs=None, segments=None, z_loss: bool = False, positions=None):
        """The main model's cross entropy, and the blocks' statistics with the multi-token prediction's mean loss
        (`mtp_loss`) when the model has it; `segments` as `CausalLM.loss` takes them."""
        view = self.compute_view()
        x, ctx, key = view.enter(tokens, rngs, segments=segments, positions=positions)
        x, _ = view.run_prefix(x, ctx, key)
        policy = remat.policy(self.remat, self.remat_offload)
        h, _, stats = run_blocks(view.blocks, self.n_layers, self.scan_layers, view.block_step(ctx), x,
                                 dropout_key=key, policy=policy, stats=view.stats_zeros())
        loss, stats = self.with_z_loss(view.head_loss(view.finish(h, ctx, None, head=False), targets, z_loss=z_loss),
                                       view.mean_aux(stats), z_loss)
        if len(self.mtp):
            stats = {**stats, "mtp_loss": view.mtp_loss(h, ctx, key, targets, policy)}
        return loss, stats

    def mtp_loss(self, h, ctx, key, targets, policy):
        """The multi-token prediction modules' mean loss from the main model's last block output `h` (in the
        blocks' layout)."""
        in_order = (lambda a: from_zigzag(a, ctx.zigzag)) if ctx.zigzag else (lambda a: a)  # noqa: E731
        blocks_layout = (lambda a: to_zigzag(a, ctx.zigzag)) if ctx.zigzag else (lambda a: a)  # noqa: E731
        losses, t = [], targets.shape[1]
        for k, module in enumerate(self.mtp):
            # position i: the token k + 1 ahead of the next (targets[:, i + k]) in, the one after it out
            kept = (jnp.arange(t) < t - k - 1)[None, :, None]
            emb = module.enorm(self._token_rows(_ahead(targets, k)))
            combined = jnp.concatenate([emb, module.hnorm(in_order(h)).astype(emb.dtype)], -1)
            x = self.precision.dense("btc,cd->btd", combined, use(module.eh_proj, self.precision.compute))
            x = constrain(blocks_layout(x), "batch", "seq", "act_embed")
            step = lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=0))  # noqa: E731
            mtp_key = None if key is None else jax.random.fold_in(key, self.prefix_layers + self.n_layers + 1 + k)
            h, _, _ = run_blocks([module.block], 1, False, step, x, dropout_key=mtp_key, policy=policy)
            out = jnp.where(kept, module.norm(in_order(h)), 0)
            mean = self.head_loss(constrain(out, "batch", "seq", "act_embed"), _ahead(targets, k + 1))
            n, dropped = targets.size, targets.shape[0] * (k + 1)
            losses.append((mean * n - dropped * math.log(self.vocab_size)) / (n - dropped))
        return sum(losses) / len(losses)
