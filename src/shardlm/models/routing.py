"""How a mixture of experts' tokens choose their experts (`Routing`, `route`). Math only, float32.

Design choices:
- One record of the choices the published routers differ in: softmax (Mixtral, Qwen) or sigmoid (DeepSeek-V3)
  scores; the chosen weights renormalised or raw; node-limited (group) routing; a scale on the weights; and
  DeepSeek's per-expert bias, which moves the choice and never the weights, and takes no gradient (the trainer
  moves it between steps: `shardlm.train.balance`).
- The scores as a distribution over the experts (softmax's probabilities; the sigmoid scores normalised, as
  DeepSeek's balance loss reads them) are returned for the load-balancing loss and the logged loads.
"""

from __future__ import annotations

import dataclasses

import jax
import jax.numpy as jnp


@dataclasses.dataclass(frozen=True)
class Routing:
    """How tokens pick their experts and weigh them.

    - `score`: softmax over the experts (Mixtral's, Qwen's) or each expert's sigmoid (DeepSeek-V3's).
    - `norm_topk`: the k chosen scores renormalised to sum to one (Mixtral's; Qwen3-MoE's and DeepSeek's
      `norm_topk_prob`), for k > 1 under softmax (one softmax expert keeps its raw probability, Switch's) and for
      any k under sigmoid; else the raw scores.
    - `groups` > 1 with `group_top_k`: node-limited routing (DeepSeek's `n_group` / `topk_group`): the experts are
      `groups` contiguous groups, each scored by its two best experts, and a token chooses among the experts of
      its `group_top_k` best groups only (under expert parallelism with a group per node, at most that many nodes).
    - `scale`: the chosen weights times it (DeepSeek's `routed_scaling_factor`).
    - A per-expert bias (`MoeMLP.router_bias`, DeepSeek's auxiliary-loss-free balancing) is added to the scores
      for the choice only; the weights are the unbiased scores.
    """

    top_k: int
    norm_topk: bool = True
    score: str = "softmax"
    groups: int = 1
    group_top_k: int = 1
    scale: float = 1.0

    @classmethod
    def of(cls, m) -> "Routing":
        """The routing of model config `m`."""
        return cls(m.moe_top_k, m.moe_norm_topk, m.moe_router, m.moe_groups, m.moe_group_top_k, m.moe_routed_scale)


ROUTER_SCORES = ("softmax", "sigmoid")  # model.moe_router


def _group_limited(choice: jax.Array, groups: int, keep: int) -> jax.Array:
    """`choice` [N, E] with every expert outside each token's `keep` best groups (scored by their two best experts
    each) set to -inf."""
    n, e = choice.shape
    by_group = choice.reshape(n, groups, e // groups)
    group_scores = jax.lax.top_k(by_group, min(2, e // groups))[0].sum(-1)  # [N, groups]
    best = jax.lax.top_k(group_scores, keep)[1]
    chosen = jnp.zeros((n, groups), jnp.bool_).at[jnp.arange(n)[:, None], best].set(True)
    return jnp.where(jnp.repeat(chosen, e // groups, axis=1), choice, -jnp.inf)


def route(x_flat: jax.Array, router: jax.Array, routing: Routing, bias: jax.Array | None = None
          ) -> tuple[jax.Array, jax.Array, jax.Array]:
    """x_flat [N, D] -> (weights [N, k] float32; experts [N, k] int32; probs [N, E], the scores as a distribution
    over the experts, which the load-balancing loss reads). `bias` [E] (or None) moves the choice, not the
    weights."""
    logits = x_flat.astype(jnp.float32) @ router.astype(jnp.float32)
    if routing.score == "sigmoid":
        scores = jax.nn.sigmoid(logits)
        probs = scores / scores.sum(-1, keepdims=True)
    else:
        scores = probs = jax.nn.softmax(logits, axis=-1)
    choice = scores if bias is None else scores + jax.lax.stop_gradient(bias.astype(jnp.float32))
    if routing.groups > 1:
        choice = _group_limited(choice, routing.groups, routing.group_top_k)
    _, experts = jax.lax.top_k(choice, routing.top_k)
    weights = jnp.take_along_axis(scores, experts, axis=-1)
    if routing.norm_topk and (routing.top_k > 1 or routing.score == "sigmoid"):
        weights = weights / weights.sum(-1, keepdims=True)
    if routing.scale != 1.0:
        weights = weights * routing.scale
    return weights, experts.astype(jnp.int32), probs
