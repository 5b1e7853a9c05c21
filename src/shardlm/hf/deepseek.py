"""Hugging Face's DeepSeek-V3 (`DeepseekV3ForCausalLM`, model_type deepseek_v3) as shardlm's deepseek family, both
ways, multi-token prediction modules included.

Design choices:
- Multi-head latent attention's tensors split by purpose (`shardlm.models.mla`): `kv_a_proj_with_mqa` [latent +
  rope, hidden] is `wkv_a` (its first rows) and `wk_rope` (the rest), `kv_b_proj` [heads x (nope + v), latent] is
  `wk_b` and `wv_b` per head, `q_b_proj` [heads x (nope + rope), q latent] is `wq_b` (or `q_proj`, `wq`, without a
  query latent). Views, not copies: each device reads its own block.
- `rope_interleave` (DeepSeek's released weights, and transformers' default): the rotary features of q and k are
  stored as interleaved pairs (x0, x1), (x2, x3), ... . shardlm rotates (i, i + rope / 2) pairs, so the rotary
  rows of `q_b_proj` and `kv_a_proj_with_mqa` are read evens first, then odds (`Permuted`): q.k is unchanged by a
  permutation both share, and transformers' interleaved rotation returns the same de-interleaved order. Export
  writes the rotate-half order with `rope_interleave: false`, which transformers computes the same way.
- The MoE layers: `mlp.gate.weight` (the router), `mlp.gate.e_score_correction_bias` (the balancing bias,
  `router_bias`), routed experts per expert (or transformers 5's fused layout), `mlp.shared_experts.*` (the shared
  expert, of `moe_intermediate_size x n_shared_experts`; shardlm holds one shared expert, so n_shared_experts is 0
  or 1). Routing: sigmoid scores, `noaux_tc` (the bias, group-limited top-k): `topk_method` and `scoring_func`
  otherwise are refused.
- Multi-token prediction modules are layers `num_hidden_layers + k` (as DeepSeek's release stores its one at
  layer 61): `enorm`, `hnorm`, `eh_proj`, a decoder layer's tensors, `shared_head.norm`, and copies of the
  embedding (`embed_tokens`) and the head (`shared_head.head`), which shardlm shares with the main model (checked
  for shape on import, written on export). transformers computes no MTP and saves none: a checkpoint without
  them gets its modules as shardlm initialises them (`Initialised`), as a fresh MTP module starts.
- Training settings config.json does not hold take DeepSeek-V3's pretraining values on import: the balancing bias
  moves 1e-3 a step (`moe_bias_rate`); the batch-wise auxiliary loss is off (`moe_aux_loss_weight` 0).
"""

from __future__ import annotations

import zlib
from pathlib import Path

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.hf.config import refuse
from shardlm.hf.format import HfFormat
from shardlm.hf.llama import (LLAMA_DEFAULT_CONTEXT, embedding_views, expert_tensors, expert_views, mlp_tensors,
                              mlp_views)
from shardlm.hf.rope import read_rope, write_rope
from shardlm.hf.views import Initialised, Permuted, Split, Transposed, View, Window

EXPERTS = ("gate_proj", "up_proj", "down_proj")
BIAS_RATE = 1e-3  # DeepSeek-V3's balancing speed through most of its pretraining; config.json has no key for it


def read_fields(t: dict, d: Path) -> dict:
    if t.get("hidden_act", "silu") != "silu":
        raise refuse(d, "hidden_act", t["hidden_act"], "shardlm's DeepSeek uses SwiGLU with silu")
    if t.get("attention_bias", False):
        raise refuse(d, "attention_bias", True, "shardlm's latent attention has no biases")
    if t.get("topk_method", "noaux_tc") != "noaux_tc" or t.get("scoring_func", "sigmoid") != "sigmoid":
        raise refuse(d, "topk_method", t.get("topk_method"), "shardlm routes DeepSeek-V3's way: sigmoid scores, "
                                                             "group-limited top-k with the balancing bias")
    shared = t.get("n_shared_experts") or 0
    if shared > 1:
        raise refuse(d, "n_shared_experts", shared, "shardlm's mixture holds at most one shared expert")
    if t.get("moe_layer_freq", 1) != 1:
        raise refuse(d, "moe_layer_freq", t["moe_layer_freq"], "every layer after the first dense ones is sparse")
    return dict(family="deepseek", n_layers=t["num_hidden_layers"], n_heads=t["num_attention_heads"], n_kv_heads=0,
                d_model=t["hidden_size"], d_mlp=t["intermediate_size"],
                seq_len=min(t.get("max_position_embeddings", LLAMA_DEFAULT_CONTEXT), LLAMA_DEFAULT_CONTEXT),
                vocab_size=t["vocab_size"], use_bias=False, tie_embeddings=t.get("tie_word_embeddings", False),
                layer_norm_eps=t.get("rms_norm_eps", 1e-6), dropout=0.0,
                mla_kv_rank=t["kv_lora_rank"], mla_q_rank=t.get("q_lora_rank") or 0,
                mla_rope_dim=t["qk_rope_head_dim"], mla_nope_dim=t["qk_nope_head_dim"], mla_v_dim=t["v_head_dim"],
                moe_experts=t["n_routed_experts"], moe_top_k=t["num_experts_per_tok"],
                moe_d_ff=t["moe_intermediate_size"], moe_shared_expert=shared == 1,
                moe_first_dense=t.get("first_k_dense_replace", 0), moe_every=1, moe_router="sigmoid",
                moe_norm_topk=t.get("norm_topk_prob", True), moe_groups=t.get("n_group") or 1,
                moe_group_top_k=t.get("topk_group") or 1, moe_routed_scale=float(t.get("routed_scaling_factor", 1.0)),
                moe_aux_loss_weight=0.0, moe_bias_rate=BIAS_RATE, mtp_depth=t.get("num_nextn_predict_layers", 0),
                **read_rope(t, d, 10000.0))


def exportable(m, where: str) -> None:
    if m.moe_every != 1 or not m.moe_experts:
        raise ShardlmError(f"{where}: DeepseekV3ForCausalLM's layers after the first dense ones are all mixtures of "
                           "experts; only model.moe_every=1 with model.moe_experts > 0 exports")


def write_config(m, common: dict) -> dict:
    exportable(m, "the model")
    return {"architectures": ["DeepseekV3ForCausalLM"], "model_type": "deepseek_v3", **common,
            "num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_heads,
            "hidden_size": m.d_model, "intermediate_size": m.d_mlp, "moe_intermediate_size": m.moe_d_ff or m.d_mlp,
            "max_position_embeddings": m.seq_len, "rms_norm_eps": m.layer_norm_eps, **write_rope(m),
            "rope_interleave": False, "hidden_act": "silu", "attention_bias": False, "attention_dropout": 0.0,
            "kv_lora_rank": m.mla_kv_rank, "q_lora_rank": m.mla_q_rank or None, "qk_rope_head_dim": m.mla_rope_dim,
            "qk_nope_head_dim": m.mla_nope_dim, "v_head_dim": m.mla_v_dim, "head_dim": m.mla_rope_dim,
            "n_routed_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k,
            "n_shared_experts": int(m.moe_shared_expert), "first_k_dense_replace": m.moe_first_dense,
            "moe_layer_freq": 1, "n_group": m.moe_groups, "topk_group": m.moe_group_top_k,
            "routed_scaling_factor": m.moe_routed_scale, "norm_topk_prob": m.moe_norm_topk,
            "topk_method": "noaux_tc", "scoring_func": "sigmoid", "num_nextn_predict_layers": m.mtp_depth}


def _held(m, i: int) -> str:
    """Where layer i's parameters are held: the dense first layers one module each before the stack
    (`prefix/i/`), the sparse ones in it (`blocks/{i - first}/`)."""
    k = m.moe_first_dense
    return f"prefix/{i}/" if i < k else f"blocks/{i - k}/"


def _deinterleave(rope: int) -> tuple[int, ...]:
    """The rotate-half order of interleaved rotary features: evens, then odds."""
    return (*range(0, rope, 2), *range(1, rope, 2))


def attention_views(m, p: str, o: str, T, interleaved: bool) -> dict[str, View]:
    d, h, r = m.d_model, m.n_heads, m.mla_kv_rank
    nope, rope, v = m.mla_nope_dim, m.mla_rope_dim, m.mla_v_dim
    qk = nope + rope
    order = (*range(nope), *(nope + i for i in _deinterleave(rope))) if interleaved else tuple(range(qk))
    a = f"{p}self_attn."
    views = {f"{o}ln1/scale": T(f"{p}input_layernorm.weight", (d,)),
             f"{o}ln2/scale": T(f"{p}post_attention_layernorm.weight", (d,))}
    if m.mla_q_rank:
        views[f"{o}attn/wq_a"] = Transposed(T(f"{a}q_a_proj.weight", (m.mla_q_rank, d)))
        views[f"{o}attn/q_norm/scale"] = T(f"{a}q_a_layernorm.weight", (m.mla_q_rank,))
        q_b = Split(Transposed(T(f"{a}q_b_proj.weight", (h * qk, m.mla_q_rank))), 1, (h, qk))
        views[f"{o}attn/wq_b"] = Permuted(q_b, 2, order)
    else:
        views[f"{o}attn/wq"] = Permuted(Split(Transposed(T(f"{a}q_proj.weight", (h * qk, d))), 1, (h, qk)), 2, order)
    kv_a = T(f"{a}kv_a_proj_with_mqa.weight", (r + rope, d))
    views[f"{o}attn/wkv_a"] = Transposed(Window(kv_a, 0, 0, r))
    k_rope = Window(kv_a, 0, r, rope)
    views[f"{o}attn/wk_rope"] = Transposed(Permuted(k_rope, 0, _deinterleave(rope)) if interleaved else k_rope)
    views[f"{o}attn/kv_norm/scale"] = T(f"{a}kv_a_layernorm.weight", (r,))
    kv_b = Split(Transposed(T(f"{a}kv_b_proj.weight", (h * (nope + v), r))), 1, (h, nope + v))
    views[f"{o}attn/wk_b"] = Window(kv_b, 2, 0, nope)
    views[f"{o}attn/wv_b"] = Window(kv_b, 2, nope, v)
    views[f"{o}attn/wo"] = Split(Transposed(T(f"{a}o_proj.weight", (d, h * v))), 0, (h, v))
    return views


def layer_views(m, i: int, o: str, T, names: set[str], interleaved: bool, sparse: bool) -> dict[str, View]:
    p = f"model.layers.{i}."
    views = attention_views(m, p, o, T, interleaved)
    if not sparse:
        return {**views, **mlp_views(m.d_model, m.d_mlp, p, o, T)}
    f, d = m.moe_d_ff or m.d_mlp, m.d_model
    views.update(expert_views(d, m.moe_experts, f, p, f"{o}mlp/", T, names, f"{p}mlp.", EXPERTS))
    views[f"{o}mlp/router_bias"] = T(f"{p}mlp.gate.e_score_correction_bias", (m.moe_experts,))
    if m.moe_shared_expert:
        s = f"{p}mlp.shared_experts."
        views[f"{o}mlp/shared_gate"] = Transposed(T(f"{s}gate_proj.weight", (f, d)))
        views[f"{o}mlp/shared_up"] = Transposed(T(f"{s}up_proj.weight", (f, d)))
        views[f"{o}mlp/shared_down"] = Transposed(T(f"{s}down_proj.weight", (d, f)))
    return views


def _fresh(name: str, shape) -> Initialised:
    """An MTP tensor the checkpoint lacks, as shardlm initialises its kind."""
    if name.endswith("norm.weight"):
        return Initialised(tuple(shape), value=1.0)
    if name.endswith("bias"):
        return Initialised(tuple(shape))
    return Initialised(tuple(shape), std=0.02, seed=zlib.crc32(name.encode()))


def mtp_views(m, k: int, vocab: int, T, names: set[str], interleaved: bool) -> dict[str, View]:
    """Multi-token prediction module k, from layer n_layers + k, or initialised where the checkpoint has none."""
    i, d, o = m.n_layers + k, m.d_model, f"mtp/{k}/"
    p = f"model.layers.{i}."
    present = any(n.startswith(p) for n in names)
    get = T if present else _fresh
    if present:  # the shared embedding and head's copies: checked, not read
        T(f"{p}embed_tokens.weight", (vocab, d))
        T(f"{p}shared_head.head.weight", (vocab, d))
    views = {f"{o}enorm/scale": get(f"{p}enorm.weight", (d,)), f"{o}hnorm/scale": get(f"{p}hnorm.weight", (d,)),
             f"{o}eh_proj": Transposed(get(f"{p}eh_proj.weight", (d, 2 * d))),
             f"{o}norm/scale": get(f"{p}shared_head.norm.weight", (d,))}
    block = layer_views(m, i, f"{o}block/", get, names if present else set(), interleaved and present,
                        sparse=m.moe_experts > 0)
    return {**views, **block}


def tensor_views(m, vocab: int, padded: int, T, names: set[str], config: dict) -> dict[str, View]:
    interleaved = bool(config.get("rope_interleave", True))
    views = embedding_views(m, vocab, padded, T)
    for i in range(m.n_layers):
        views.update(layer_views(m, i, _held(m, i), T, names, interleaved, i >= m.moe_first_dense))
    for k in range(m.mtp_depth):
        views.update(mtp_views(m, k, vocab, T, names, interleaved))
    return views


def layer_tensors(m, i: int, o: str, get, sparse: bool):
    d, p = m.d_model, f"model.layers.{i}."
    a = f"{p}self_attn."
    yield f"{p}input_layernorm.weight", get(f"{o}ln1/scale")
    yield f"{p}post_attention_layernorm.weight", get(f"{o}ln2/scale")
    if m.mla_q_rank:
        yield f"{a}q_a_proj.weight", get(f"{o}attn/wq_a").T
        yield f"{a}q_a_layernorm.weight", get(f"{o}attn/q_norm/scale")
        yield f"{a}q_b_proj.weight", get(f"{o}attn/wq_b").reshape(m.mla_q_rank, -1).T
    else:
        yield f"{a}q_proj.weight", get(f"{o}attn/wq").reshape(d, -1).T
    yield f"{a}kv_a_proj_with_mqa.weight", np.concatenate([get(f"{o}attn/wkv_a"), get(f"{o}attn/wk_rope")], 1).T
    yield f"{a}kv_a_layernorm.weight", get(f"{o}attn/kv_norm/scale")
    kv_b = np.concatenate([get(f"{o}attn/wk_b"), get(f"{o}attn/wv_b")], 2)  # [latent, heads, nope + v]
    yield f"{a}kv_b_proj.weight", kv_b.reshape(m.mla_kv_rank, -1).T
    yield f"{a}o_proj.weight", get(f"{o}attn/wo").reshape(-1, d).T
    if not sparse:
        yield from mlp_tensors(p, o, get)
        return
    yield from expert_tensors(m, f"{p}mlp.", o, get, EXPERTS)
    yield f"{p}mlp.gate.e_score_correction_bias", get(f"{o}mlp/router_bias")
    if m.moe_shared_expert:
        for x in ("gate", "up", "down"):
            yield f"{p}mlp.shared_experts.{x}_proj.weight", get(f"{o}mlp/shared_{x}").T


def export_tensors(m, vocab: int, get):
    yield "model.embed_tokens.weight", get("wte")[:vocab]
    for i in range(m.n_layers):
        yield from layer_tensors(m, i, _held(m, i), get, i >= m.moe_first_dense)
    yield "model.norm.weight", get("ln_f/scale")
    head = get("wte")[:vocab] if m.tie_embeddings else get("lm_head")[:, :vocab].T
    if not m.tie_embeddings:
        yield "lm_head.weight", head
    for k in range(m.mtp_depth):
        o, p = f"mtp/{k}/", f"model.layers.{m.n_layers + k}."
        yield f"{p}embed_tokens.weight", get("wte")[:vocab]
        yield f"{p}enorm.weight", get(f"{o}enorm/scale")
        yield f"{p}hnorm.weight", get(f"{o}hnorm/scale")
        yield f"{p}eh_proj.weight", get(f"{o}eh_proj").T
        yield from layer_tensors(m, m.n_layers + k, f"{o}block/", get, m.moe_experts > 0)
        yield f"{p}shared_head.norm.weight", get(f"{o}norm/scale")
        yield f"{p}shared_head.head.weight", head


DEEPSEEK = HfFormat(model_types=("deepseek_v3",), fields=read_fields, config=write_config, views=tensor_views,
                    tensors=export_tensors, exportable=exportable)
