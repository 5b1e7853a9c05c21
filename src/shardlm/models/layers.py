"""The decoder every family shares: the pre-norm block around a family's attention and MLP, and the decoder-only
forward pass (embed -> blocks -> final norm -> logits or the fused loss). Math only.

Design choices:
- Norms, softmax and the output logits are computed in float32 whatever the compute dtype: norms upcast their
  input, attention's logits and softmax are float32 inside the kernels, and the head accumulates in float32
  (`float32_logits`, `shardlm.models.head`), so the loss never sees bfloat16 logits. The modules run on their
  weights' compute copies (`shardlm.models.precision.compute_view`).
- Attention (`shardlm.models.attention`) is chosen once per pass, and its `Context` (the kernel, the mask or
  positions it reads, the rotary tables, the ring's layout) is handed to every block.
- Every block trains under a remat policy over its named activations (`shardlm.models.remat`), `model.remat=none`
  included: "none" saves the matmul outputs the backward pass needs and recomputes the elementwise work from them;
  "full" saves only the block's input; the others save subsets, or offload them to host memory.
- The blocks are one module per layer or one scanned stack (`model.scan_layers`, `shardlm.models.stack`); the
  KV cache is stacked over the layers either way.
"""

import jax
import jax.numpy as jnp
from flax import nnx

from shardlm.kernels.gradients import with_gradient
from shardlm.kernels.ring import from_zigzag, to_zigzag
from shardlm.models import remat
from shardlm.models.attention import STACKED_CACHE_AXES, Context, attention_context
from shardlm.models.config import head_size, stack_layer_count
from shardlm.models.head import head_loss
from shardlm.models.params import use
from shardlm.models.precision import compute_view
from shardlm.models.stack import RESIDUAL, LayerCache, build_blocks, layer_rngs, run_blocks, stacked_repeats
from shardlm.sharding import constrain, constrain_with_gradient, sharded_lookup


PREFIX_DROPOUT = 2**20  # the prefix layers' dropout stream: the pass's key folded with it, then with the layer
LAYER_LOADS = "layer_expert_tokens"  # a block's statistic: [layers, experts] assignments per layer and expert


def _offset(make_block, k: int):
    """`make_block` for a stack whose layer i is the model's layer k + i."""
    return lambda rngs, i=None: make_block(rngs) if i is None else make_block(rngs, i + k)


def _projections_input(y: jax.Array) -> jax.Array:
    """A norm's output as the projections after it read it. The norm runs as the residual stream is split; under
    sequence parallelism its output is then gathered over the sequence once for all of them (q, k and v; the gate
    and up projections), and their gradients' partial sums, added, are reduce-scattered straight back to the
    residual stream's split (`sharding.constrain_with_gradient`). Left to propagation with the sequence split over
    context too, XLA gathered the input once per projection where it recomputed them, and again for every
    weight's gradient (compiled for 64 H100s, the 70B row of docs/targets.md gathered each norm output of the
    backward pass 5 times). Without sequence parallelism both splits are the same."""
    return constrain_with_gradient(constrain(y, *RESIDUAL), ("batch", "seq", "act_embed"), RESIDUAL)


def _residual_branch(y: jax.Array) -> jax.Array:
    """A row-parallel projection's output (attention's output projection, the MLP's down projection) as the
    residual stream receives it: its partial sums reduce-scattered into the stream's split, and its gradient
    gathered over the sequence once, where both of the projection's transposes read it (the input's gradient and
    the weight's); left to propagation, XLA gathered it once for each, over different groups."""
    return constrain_with_gradient(y, RESIDUAL, ("batch", "seq", "act_embed"))


class PreNormBlock(nnx.Module):
    """x + attn(ln1(x)), then x + mlp(ln2(x)), with dropout on both residual branches. A family's block builds
    `ln1`, `attn`, `ln2`, `mlp` and `dropout`, and sets `sparse` when its MLP is a mixture of experts (which
    returns its statistics with its output: `shardlm.models.moe`)."""

    sparse = False
    layer_loads = 0  # > 0: a sparse block also reports its loads as row `ctx.layer` of [layer_loads, experts]

    def __call__(self, x, rngs: nnx.Rngs | None, cache: LayerCache | None, ctx: Context):
        """-> (x, cache, stats): `stats` {"aux_loss", "expert_tokens", "moe_dropped", "moe_overflow"} for a sparse
        block, {} for a dense one."""
        x = remat.named(x, remat.BLOCK_INPUT)
        a, cache = self.attn(_projections_input(self.ln1(x)), cache, ctx)
        x = x + self._dropout(_residual_branch(a), rngs, ctx)
        x = constrain(x, *RESIDUAL)
        h, stats = self.mlp(_projections_input(self.ln2(x))), {}
        if self.sparse:
            h, moe = h
            stats = {"aux_loss": moe.aux_loss, "expert_tokens": moe.expert_tokens, "moe_dropped": moe.dropped,
                     "moe_overflow": moe.overflow}
            if self.layer_loads:  # summed over the layers, each layer's own row (`shardlm.train.balance`)
                row = jax.nn.one_hot(ctx.layer, self.layer_loads, dtype=jnp.float32)
                stats[LAYER_LOADS] = row[:, None] * moe.expert_tokens[None]
        h = remat.named(_residual_branch(h), remat.MLP_OUT)
        x = x + self._dropout(h, rngs, ctx)
        return constrain(x, *RESIDUAL), cache, stats

    def _dropout(self, x, rngs, ctx: Context):
        """Dropout on a residual branch. In the ring's zigzag layout the mask is drawn in the sequence's own order
        (and the branch moved there and back for it), so that it is the mask any other mesh draws."""
        if rngs is None or not ctx.zigzag or not self.dropout.rate:
            return self.dropout(x, deterministic=rngs is None, rngs=rngs)
        # In the sequence's order the branch stays split over context (contiguous shares), and so does the mask:
        # each device draws its share of the bits. Unpinned, XLA gathered the whole sequence to every context
        # device and drew the whole mask on each (dp2 x cp4 on 8 CPU devices: four times the bits).
        in_order = constrain(from_zigzag(x, ctx.zigzag), *RESIDUAL)
        return to_zigzag(constrain(self.dropout(in_order, rngs=rngs), *RESIDUAL), ctx.zigzag)


class CausalLM(nnx.Module):
    """The decoder-only forward pass every family shares. A family provides `_embed(tokens, rngs, pos)` (tokens to
    the residual stream, from `_token_rows`, and rotary tables if it uses them), `blocks` (`PreNormBlock`s, built by
    `shardlm.models.stack.build_blocks`), the final norm `ln_f`, the token table `wte` and, untied, `lm_head`, and
    sets `vocab_size` (the tokenizer's; the tables have `padded_vocab` rows), `context` (seq_len), `precision`
    (`models.precision.Precision.of` its config), `attention` (the requested implementation), `remat` and
    `remat_offload` (`shardlm.models.remat`), and builds its blocks with `_stack_blocks`.

    On pipeline stages a schedule runs the blocks (`shardlm.schedules`), from the pieces this class exposes: the
    embedding (`enter`), a block's step (`block_step`), the final norm and head (`finish`), the fused head and
    loss (`head_loss`). The model itself holds no pipeline setting and runs its blocks one after another.
    """

    def _stack_blocks(self, cfg, make_block, rngs: nnx.Rngs):
        """The blocks (`make_block(rngs[, layer])` per layer) and what running them needs: their number and layout
        (a stack held as [repeats, layers] for circular pipeline repeats: `stack.in_repeats`) and the head shape of
        the KV cache. A model whose first `moe_first_dense` layers are dense and the rest sparse (DeepSeek's) holds
        those first layers apart, one module each (`prefix`, run before the stack by `run_prefix`), so that the
        sparse layers stack, scan and split over pipeline stages; `n_layers` counts the stack, layer i of it being
        the model's layer `prefix_layers` + i."""
        self.n_layers, self.scan_layers = stack_layer_count(cfg), cfg.scan_layers
        self.prefix_layers = k = cfg.n_layers - self.n_layers
        self.kv_heads, self.head_dim = cfg.n_kv_heads or cfg.n_heads, head_size(cfg)
        self.loss_chunks = cfg.loss_chunks
        self.context_attention, self.attention_block = cfg.context_attention, cfg.attention_block
        key, prefix = rngs.params(), None
        if k:  # the stack's layer i is the model's k + i (which `make_block` reads to tell dense from sparse)
            key, prefix_key = jax.random.split(key)
            prefix = build_blocks(make_block, k, prefix_key, scan=False)
            make_block = _offset(make_block, k)
        self.prefix = nnx.data(prefix)
        self.blocks = build_blocks(make_block, self.n_layers, key, cfg.scan_layers,
                                   stacked_repeats(self.n_layers, cfg.pipeline_repeats, cfg.scan_layers))

    def __call__(self, tokens: jax.Array, rngs: nnx.Rngs | None = None, *, at: jax.Array | None = None
                 ) -> jax.Array:
        """tokens [batch, seq] int32 -> logits [batch, seq, padded_vocab] float32. `rngs` enables dropout. With
        `at` [batch], only the logits at position at[b] of each row: [batch, 1, padded_vocab] (the output head is
        most of a small model's FLOPs, and all the positions' logits of a long batch are gigabytes)."""
        return self._forward(tokens, rngs, at=at)[0]

    def with_stats(self, tokens: jax.Array, rngs: nnx.Rngs | None = None, segments=None, positions=None
                   ) -> tuple[jax.Array, dict]:
        """(logits, the blocks' statistics): a mixture of experts' {"aux_loss" (its load-balancing loss, the mean
        over the sparse layers), "expert_tokens" ([experts]: token-assignments each expert received, summed over
        them)}; {} for a dense model. What an evaluation step reads. `segments` and `positions` as `loss` takes
        them (evaluation attends as training did)."""
        logits, _, stats = self._forward(tokens, rngs, segments=segments, positions=positions)
        return logits, self.mean_aux(stats)

    # The KV cache's logical axes, keys' and values' (`shardlm.generate` places the cache by them)
    cache_layout = LayerCache(STACKED_CACHE_AXES, STACKED_CACHE_AXES)

    def cache_kind(self) -> str:
        """What the KV cache holds per token and layer, for reports."""
        return f"keys and values of {self.kv_heads} kv heads x {self.head_dim}"

    def init_cache(self, batch: int) -> LayerCache:
        """An empty KV cache for `batch` rows and the whole context, stacked over the layers, in the compute dtype
        (shard it with `STACKED_CACHE_AXES`)."""
        shape = (self.prefix_layers + self.n_layers, batch, self.kv_heads, self.context, self.head_dim)
        return LayerCache(jnp.zeros(shape, self.precision.compute), jnp.zeros(shape, self.precision.compute))

    def prefill(self, tokens: jax.Array, cache: LayerCache, *, at: jax.Array | None = None
                ) -> tuple[jax.Array, LayerCache]:
        """tokens [batch, T] at positions 0..T-1 -> (logits [batch, T, padded_vocab], cache holding them); with
        `at` [batch], only each row's logits at position at[b] ([batch, 1, padded_vocab])."""
        return self._forward(tokens, None, cache, at=at)[:2]

    def decode(self, tokens: jax.Array, pos: jax.Array, cache: LayerCache) -> tuple[jax.Array, LayerCache]:
        """tokens [batch, 1], row b at position pos[b] (< seq_len) -> (logits [batch, 1, padded_vocab], cache)."""
        return self._forward(tokens, None, cache, pos)[:2]

    def stats_zeros(self) -> dict:
        """The structure the blocks' statistics take, zero: a mixture of experts' (see `with_stats`), or {}."""
        if not getattr(self, "moe_experts", 0):
            return {}
        zeros = {"aux_loss": jnp.zeros((), jnp.float32), "expert_tokens": jnp.zeros((self.moe_experts,), jnp.float32),
                 "moe_dropped": jnp.zeros((), jnp.float32), "moe_overflow": jnp.zeros((), jnp.float32)}
        if getattr(self, "balanced_layers", 0):
            zeros[LAYER_LOADS] = jnp.zeros((self.balanced_layers, self.moe_experts), jnp.float32)
        return zeros

    def compute_view(self):
        """The model on its weights' compute copies (`shardlm.models.precision.compute_view`): what a pass runs on."""
        return compute_view(self, self.precision.compute, self.precision.reduce)

    def _forward(self, tokens, rngs, cache=None, pos=None, at=None, head=True, segments=None, positions=None):
        """(logits, cache, stats); with `head=False`, the final norm's output [batch, T, d_model] instead of the
        logits (what `loss` multiplies out chunk by chunk). The modules run on their weights' compute copies
        (`shardlm.models.precision`)."""
        return self.compute_view()._run(tokens, rngs, cache, pos, at, head, segments, positions)

    def loss(self, tokens: jax.Array, targets: jax.Array, rngs: nnx.Rngs | None = None, segments=None,
             z_loss: bool = False, positions=None) -> tuple[jax.Array, dict]:
        """(mean cross entropy of `targets` [batch, T] after `tokens` [batch, T], the blocks' statistics as
        `with_stats` gives them): the head and the loss fused and chunked over the vocabulary
        (`shardlm.models.head`), float32 logits never held for the whole vocabulary. What a training step
        minimises (on pipeline stages, through a schedule: `shardlm.schedules`). `segments` [batch, T]: each
        token's document's id (`shardlm.models.documents`), attention staying within documents; None: none. With
        `z_loss`, the statistics hold the mean of log^2 Z of the logits too (`z_loss`, PaLM's). `positions`
        [batch, T]: each token's position (restarting at each document), else 0..T-1."""
        x, _, stats = self._forward(tokens, rngs, head=False, segments=segments, positions=positions)
        return self.with_z_loss(self.head_loss(x, targets, z_loss=z_loss), self.mean_aux(stats), z_loss)

    @staticmethod
    def with_z_loss(loss, stats: dict, z_loss: bool) -> tuple:
        """(the cross entropy, the statistics) from what `head_loss` returned: with `z_loss`, the mean of log^2 Z
        joins the statistics."""
        if not z_loss:
            return loss, stats
        return loss[0], {**stats, "z_loss": loss[1]}

    def head_weight(self) -> jax.Array:
        """The output head as stored: the token table [vocab, embed] when tied, else `lm_head` [embed, vocab]."""
        return (self.wte if self.lm_head is None else self.lm_head)[...]

    def head_loss(self, x, targets, head_weight=None, token_copies: bool = False, z_loss: bool = False):
        """The fused head and loss of the final norm's output `x` (`models.head.head_loss`), on `head_weight`
        (default: the stored head; with `token_copies`, one copy per device of the tokens' axes); with `z_loss`,
        (it, the mean of log^2 Z)."""
        head_weight = self.head_weight() if head_weight is None else head_weight
        with jax.named_scope("loss"):  # the output head's matmuls with it
            return head_loss(x, head_weight, targets, tied=self.lm_head is None, vocab_size=self.vocab_size,
                             compute_dtype=self.precision.compute, reduce_dtype=self.precision.reduce,
                             chunks=self.loss_chunks, token_copies=token_copies, z_loss=z_loss)

    def mean_aux(self, stats: dict) -> dict:
        """The blocks' statistics with the load-balancing loss a mean over the sparse layers (balanced reads 1.0)."""
        if "aux_loss" in stats:
            stats = {**stats, "aux_loss": stats["aux_loss"] / self.sparse_layers()}
        return stats

    def sparse_layers(self) -> int:
        """How many layers are mixtures of experts."""
        return getattr(self, "sparse_count", 0)

    def _token_rows(self, tokens):
        """The token table's rows for `tokens` in the compute dtype, looked up where the table lies
        (`sharding.sharded_lookup`) and cast as they are read: the table's gradient is a scatter-add into its own
        float32 shards."""
        return sharded_lookup(self.wte[...], tokens, tuple(self.wte.get_metadata()["out_sharding"]),
                              self.precision.compute)

    def enter(self, tokens, rngs, cache=None, pos=None, segments=None, positions=None):
        """(the embedding's output in the blocks' layout, the blocks' attention `Context`, the pass's dropout key):
        what every pass does before the blocks. `segments`: documents' ids, for attention within them;
        `positions` [batch, T]: every token's position, in place of 0..T-1."""
        # One dropout key for the pass: layer i draws from it folded with i, the embedding with n_layers
        # (`stack.layer_rngs`), whichever layout the blocks are in.
        key = rngs.dropout() if rngs is not None else None
        with jax.named_scope("embed"):
            x, rope = self._embed(tokens, layer_rngs(key, self.n_layers), pos if positions is None else positions)
            x = constrain(x, "batch", "seq", "act_embed")
        ctx = attention_context(self.attention, self.precision.compute, self.head_dim, tokens.shape[1],
                                block=self.attention_block, context=self.context_attention,
                                decoding=cache is not None or pos is not None, rope=rope, pos=pos,
                                segments=segments)
        if ctx.zigzag:  # the blocks run in the ring's zigzag layout (`shardlm.kernels.ring`), the rest in order
            x = constrain(to_zigzag(x, ctx.zigzag), "batch", "seq", "act_embed")
            ctx = ctx._replace(rope=None if rope is None else tuple(to_zigzag(t, ctx.zigzag) for t in rope),
                               segments=None if segments is None else constrain(
                                   to_zigzag(ctx.segments, ctx.zigzag), "batch", "seq"))
        return x, ctx, key

    def block_step(self, ctx: Context):
        """step(block, x, rngs, cache, i): block i of a pass whose attention `Context` is `ctx`
        (`shardlm.models.stack.Step`)."""
        k = self.prefix_layers  # the stack's layer i is the model's k + i (its cache row, its loads' row)
        return lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=i + k))

    def run_prefix(self, x, ctx: Context, key, cache=None):
        """(x, cache) through the layers held before the stack (`prefix`, dense; none for most models), one module
        each, under the model's remat policy when training. Every pass runs them after `enter`, a pipeline's
        outside its stages (as the embedding)."""
        if self.prefix is None:
            return x, cache
        policy = remat.policy(self.remat, self.remat_offload) if cache is None else None
        step = lambda block, x, rngs, cache, i: block(x, rngs, cache, ctx._replace(layer=i))  # noqa: E731
        key = None if key is None else jax.random.fold_in(key, PREFIX_DROPOUT)
        x, cache, _ = run_blocks(self.prefix, self.prefix_layers, False, step, x, dropout_key=key, cache=cache,
                                 policy=policy)
        return x, cache

    def _run(self, tokens, rngs, cache, pos, at, head, segments=None, positions=None):
        x, ctx, key = self.enter(tokens, rngs, cache, pos, segments, positions)
        x, cache = self.run_prefix(x, ctx, key, cache)
        policy = remat.policy(self.remat, self.remat_offload) if cache is None else None
        x, cache, stats = run_blocks(self.blocks, self.n_layers, self.scan_layers, self.block_step(ctx), x,
                                     dropout_key=key, cache=cache, policy=policy, stats=self.stats_zeros())
        return self.finish(x, ctx, at, head), cache, stats

    def finish(self, x, ctx: Context, at=None, head: bool = True):
        """The blocks' output `x` back in the sequence's order, at positions `at` [batch] if given (one per row),
        through the final norm and, with `head`, the output head (float32 logits, the padded rows -inf); without
        it, the final norm's output, for the fused loss."""
        if ctx.zigzag:
            x = constrain(from_zigzag(x, ctx.zigzag), "batch", "seq", "act_embed")
        if at is not None:  # one position per row reaches the head
            x = jnp.take_along_axis(x, at[:, None, None], axis=1)
        with jax.named_scope("head"):
            # the final norm's float32 work is recomputed in the backward pass, as the blocks' is
            x = nnx.remat(lambda ln, x: ln(x), policy=jax.checkpoint_policies.nothing_saveable)(self.ln_f, x)
            if not head:
                return x
            if self.lm_head is None:  # tied: contract with the table as stored; a `wte.T` operand made XLA:CPU
                logits = float32_logits("bte,ve->btv", x, use(self.wte, self.precision.compute))  # copy it every call
            else:
                logits = float32_logits("bte,ev->btv", x, use(self.lm_head, self.precision.compute))
            logits = constrain(logits, "batch", "seq", "act_vocab")
            if self.padded_vocab != self.vocab_size:  # padded rows never receive probability mass
                logits = jnp.where(jnp.arange(self.padded_vocab) < self.vocab_size, logits, -jnp.inf)
        return logits


def float32_logits(contraction: str, x: jax.Array, w: jax.Array) -> jax.Array:
    """The output head: `einsum(contraction, x, w)` accumulated and returned in float32 (the loss never sees
    bfloat16 logits), whose gradient flows back in the compute dtype. Left to autodiff, the float32 cotangent of
    the logits would make both backward matmuls float32 (XLA:GPU compiled them so, at half the tensor cores'
    bfloat16 rate): it is cast to `x`'s dtype first, as the forward matmul's inputs are."""

    def gradient(saved, g):
        x, w = saved
        g = g.astype(x.dtype)
        # Each operand's matmul transposed on its own: `jax.vjp` would also recompute the forward matmul, dead
        # code that XLA drops but that a count of the program's matmuls (`flops.jaxpr_matmul_flops`) would not.
        (dx,) = jax.linear_transpose(lambda a: jnp.einsum(contraction, a, w), x)(g)
        (dw,) = jax.linear_transpose(lambda b: jnp.einsum(contraction, x, b), w)(g)
        return dx, dw

    return with_gradient(lambda x, w: jnp.einsum(contraction, x, w, preferred_element_type=jnp.float32), gradient,
                         x, w)
