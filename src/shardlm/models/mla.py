"""Multi-head latent attention (MLA, DeepSeek-V2 and V3): keys and values expanded from a low-rank latent per token,
queries from one too, each head's query and key a plain part and a rotary part, the rotary key shared by every
head. Math with logical axis names, and the latent KV cache generation keeps.

Design choices:
- The weights are stored per purpose, so that each is a plain split under the rules: `wkv_a` [embed, latent] and
  `wk_rope` [embed, rope] (Hugging Face's `kv_a_proj_with_mqa`, one tensor, is both), `wk_b` [latent, heads,
  nope] and `wv_b` [latent, heads, v] (`kv_b_proj`), `wq_a` [embed, q latent] and `wq_b` [q latent, heads,
  nope + rope] (or `wq` [embed, heads, nope + rope] without a query latent), `wo` [heads, v, embed].
- Under tensor parallelism the heads are split (`wk_b`, `wv_b`, `wq_b` column-parallel, `wo` row-parallel, as a
  GQA layer's); the latent projections are replicated over `tensor` (rule `latent`: split over fsdp only): every
  tensor device computes the whole latent of its tokens (d x (latent + rope) weights per token, 0.7% of the
  layer's active matmul FLOPs at DeepSeek-V3's shape, so about 0.7% more work per device under tensor 2) and
  expands it for its own heads, so the layer needs no collective before its
  heads and one all-reduce after `wo`, as any attention layer. Splitting the latent over tensor would need an
  all-gather of it before the expansion instead; under sequence parallelism the residual stream (and so the
  latent's input) is already split by sequence and is gathered once for the projections, as for q, k and v.
- Training and prefill expand the latent into per-head keys and values and run the model's attention kernel
  (`shardlm.models.attention.self_attention`, whichever the registry picks). Values are narrower than queries
  and keys (v < nope + rope) while the kernels take one head size, so values are zero-padded to it and the
  output sliced back: the kernels run unchanged (cuDNN, splash, the blockwise kernel, the ring), at the cost of
  the padded part of the P.V product.
- Generation caches the latent and the rotary key, `kv_rank + rope` values per token per layer, never the
  expanded keys and values (`2 x heads x head_dim`): `LayerCache(k=latent [L, batch, 1, seq, latent],
  v=rotary key [L, batch, 1, seq, rope])`, split by batch only (every tensor device reads the whole latent).
  A decode step attends in the latent space with the up-projections absorbed (DeepSeek-V2's trick): q_nope . k_nope
  = (q_nope wk_b^T) . latent and p . v = (p . latent) wv_b, so a step reads kv_rank + rope values per cached token.
- The softmax scale is 1 / sqrt(nope + rope), times YaRN's mscale(factor, mscale_all_dim)^2 under YaRN scaling (as
  DeepSeek's and transformers' MLA); the kernels take their default 1 / sqrt(head size), so queries are multiplied
  by that ratio before them.
"""

import math

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.models import remat
from shardlm.models.attention import Context, self_attention
from shardlm.models.norms import RMSNorm
from shardlm.models.params import param, use
from shardlm.models.precision import Precision
from shardlm.models.rope import apply_rope, yarn_mscale
from shardlm.models.stack import LAYERS, LayerCache
from shardlm.sharding import constrain

LATENT_EPS = 1e-6  # DeepSeek's latent norms keep their default epsilon, whatever rms_norm_eps is
# The latent cache's axes: split by batch (and its stacked layers by stage), never by heads: every head reads it
LATENT_CACHE_AXES = (LAYERS, "batch", None, "seq", None)


def softmax_scale(m) -> float:
    """The logits' scale of model config `m`'s MLA."""
    scale = 1.0 / math.sqrt(m.mla_nope_dim + m.mla_rope_dim)
    if m.rope_scaling == "yarn" and m.rope_mscale_all_dim:
        scale *= yarn_mscale(m.rope_factor, m.rope_mscale_all_dim) ** 2
    return scale


class LatentAttention(nnx.Module):
    def __init__(self, m, precision: Precision, rngs: nnx.Rngs):
        d, h, pd = m.d_model, m.n_heads, precision.param
        self.nope, self.rope, self.v_dim = m.mla_nope_dim, m.mla_rope_dim, m.mla_v_dim
        qk = self.nope + self.rope
        self.precision = precision
        self.q_factor = softmax_scale(m) * math.sqrt(qk)  # the kernels scale by 1 / sqrt(qk)
        init = nnx.initializers.normal(0.02)
        out_init = nnx.initializers.normal(0.02 / math.sqrt(2 * m.n_layers))
        if m.mla_q_rank:
            self.wq = None
            self.wq_a = param(rngs, init, (d, m.mla_q_rank), ("embed", "latent"), pd)
            self.q_norm = RMSNorm(m.mla_q_rank, LATENT_EPS, pd, rngs, axis="latent")
            self.wq_b = param(rngs, init, (m.mla_q_rank, h, qk), ("latent", "heads", "head_dim"), pd)
        else:
            self.wq = param(rngs, init, (d, h, qk), ("embed", "heads", "head_dim"), pd)
            self.wq_a = self.q_norm = self.wq_b = None
        self.wkv_a = param(rngs, init, (d, m.mla_kv_rank), ("embed", "latent"), pd)
        self.wk_rope = param(rngs, init, (d, self.rope), ("embed", "head_dim"), pd)
        self.kv_norm = RMSNorm(m.mla_kv_rank, LATENT_EPS, pd, rngs, axis="latent")
        self.wk_b = param(rngs, init, (m.mla_kv_rank, h, self.nope), ("latent", "heads", "head_dim"), pd)
        self.wv_b = param(rngs, init, (m.mla_kv_rank, h, self.v_dim), ("latent", "heads", "head_dim"), pd)
        self.wo = param(rngs, out_init, (h, self.v_dim, d), ("heads", "head_dim", "embed"), pd)

    def _queries(self, x):
        p = self.precision
        if self.wq is not None:
            q = p.dense("bte,ehd->bthd", x, use(self.wq, p.compute))
        else:
            q_latent = self.q_norm(p.dense("bte,er->btr", x, use(self.wq_a, p.compute)))
            q = p.dense("btr,rhd->bthd", q_latent, use(self.wq_b, p.compute))
        q = remat.named(constrain(q, "batch", "seq", "act_heads", "head_dim"), remat.QKV_PROJ)
        return q[..., :self.nope], q[..., self.nope:]

    def __call__(self, x, cache: LayerCache | None, ctx: Context):
        """x [batch, T, embed] -> ([batch, T, embed], cache), the cache's three modes as `self_attention`'s."""
        p = self.precision
        q_nope, q_rope = self._queries(x)
        latent = self.kv_norm(p.dense("bte,er->btr", x, use(self.wkv_a, p.compute)))
        latent = constrain(latent, "batch", "seq", None)
        k_rope = p.dense("bte,ed->btd", x, use(self.wk_rope, p.compute))[:, :, None, :]  # one head, shared
        q_rope, k_rope = apply_rope(q_rope, ctx.rope), apply_rope(k_rope, ctx.rope)
        if ctx.pos is None:
            y = self._expanded(q_nope, q_rope, latent, k_rope, ctx)
            if cache is not None:  # a prefill: positions 0..T-1 of every row
                t = x.shape[1]
                cache = LayerCache(*(constrain(c.at[ctx.layer, :, 0, :t].set(n.astype(c.dtype)), *LATENT_CACHE_AXES)
                                     for c, n in zip(cache, (latent, k_rope[:, :, 0]))))
        else:
            rows = jnp.arange(x.shape[0])
            cache = LayerCache(*(constrain(c.at[ctx.layer, rows, 0, ctx.pos].set(n[:, 0].astype(c.dtype)),
                                           *LATENT_CACHE_AXES) for c, n in zip(cache, (latent, k_rope[:, :, 0]))))
            y = self._absorbed(q_nope, q_rope, cache.k[ctx.layer], cache.v[ctx.layer], ctx.pos)
        b, t, h, v = y.shape
        out = p.dense("btf,fd->btd", y.reshape(b, t, h * v), use(self.wo, p.compute).reshape(h * v, -1))
        return remat.named(out, remat.OUT_PROJ), cache

    def _expanded(self, q_nope, q_rope, latent, k_rope, ctx: Context):
        """Training and prefill: per-head keys and values from the latent, through the model's kernel."""
        p = self.precision
        k_nope = p.dense("btr,rhd->bthd", latent, use(self.wk_b, p.compute))
        v = p.dense("btr,rhd->bthd", latent, use(self.wv_b, p.compute))
        heads = k_nope.shape[2]
        q = jnp.concatenate([q_nope, q_rope], -1) * jnp.asarray(self.q_factor, q_nope.dtype)
        k = jnp.concatenate([k_nope, jnp.broadcast_to(k_rope, (*k_rope.shape[:2], heads, self.rope))], -1)
        v = jnp.pad(v, ((0, 0), (0, 0), (0, 0), (0, q.shape[-1] - self.v_dim)))  # the kernels' one head size
        q, k, v = (constrain(a, "batch", "seq", "act_heads", "head_dim") for a in (q, k, v))
        y, _ = self_attention(q, k, v, None, ctx)
        return y[..., :self.v_dim]

    def _absorbed(self, q_nope, q_rope, latent, k_rope, pos):
        """One decode step against the cached latents [batch, 1, S, latent] and rotary keys [batch, 1, S, rope],
        the up-projections absorbed into the query and the output (see the module docstring). Softmax in
        float32."""
        q_latent = jnp.einsum("bthn,rhn->bthr", q_nope, use(self.wk_b, self.precision.compute))[:, 0]
        scores = (jnp.einsum("bhr,bsr->bhs", q_latent, latent[:, 0], preferred_element_type=jnp.float32)
                  + jnp.einsum("bhd,bsd->bhs", q_rope[:, 0], k_rope[:, 0], preferred_element_type=jnp.float32))
        scores = scores * (self.q_factor / math.sqrt(self.nope + self.rope))
        scores = jnp.where(jnp.arange(latent.shape[2]) <= pos[:, None, None], scores, -jnp.inf)
        probs = jax.nn.softmax(scores, axis=-1).astype(latent.dtype)
        out_latent = jnp.einsum("bhs,bsr->bhr", probs, latent[:, 0])
        y = jnp.einsum("bhr,rhv->bhv", out_latent, use(self.wv_b, self.precision.compute))[:, None]
        return constrain(y, "batch", "seq", "act_heads", "head_dim")


