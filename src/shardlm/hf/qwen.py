"""Hugging Face's Qwen2 / Qwen2.5 (`Qwen2ForCausalLM`), Qwen3 (`Qwen3ForCausalLM`) and Qwen3-MoE
(`Qwen3MoeForCausalLM`) as shardlm's qwen family, both ways. Each is a Llama-shaped model, and the shared pieces
are `shardlm.hf.llama`'s; what differs is said here.

Design choices:
- Qwen2 / 2.5: biases on q, k and v (always; not on the output projection) -> `model.qkv_bias`.
- Qwen3: a per-head RMSNorm on q and k before the rotation (`q_norm`, `k_norm`, [head_dim]) -> `model.qk_norm`,
  and a `head_dim` apart from hidden / heads (128 at every size) -> `model.head_dim`. Its `attention_bias` would
  add an output bias too, which shardlm's block lacks: refused by name.
- Qwen3-MoE: Qwen3's attention with `num_experts` SwiGLU experts of `moe_intermediate_size` in every
  `decoder_sparse_step`-th layer (shardlm's `moe_every`: the same layers), routed top `num_experts_per_tok` by
  softmax, renormalised when `norm_topk_prob` (`model.moe_norm_topk`). Dense layers listed in `mlp_only_layers`
  are refused unless empty (shardlm's sparse layers are periodic). Per-expert tensors are
  `mlp.experts.{e}.gate_proj/up_proj/down_proj`; transformers 5's fused in-memory layout is read too.
  `router_aux_loss_coef` converts as Mixtral's does (times k, `shardlm.hf.llama`).
- Sliding-window attention (`use_sliding_window`) is refused: shardlm attends to the whole context.
- Export picks the architecture from the model: experts -> Qwen3-MoE, q/k norms -> Qwen3, q/k/v biases -> Qwen2;
  a qwen-family model with neither has no Qwen counterpart (train it as llama).
"""

from __future__ import annotations

from pathlib import Path

from shardlm.errors import ShardlmError
from shardlm.hf.config import refuse, round_float
from shardlm.hf.format import HfFormat
from shardlm.hf.llama import (attention_tensors, attention_views, embedding_views, expert_tensors, expert_views,
                              llama_shaped_config, llama_shaped_fields, mlp_tensors, mlp_views, softmax_routing_only)

QWEN_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": None}
QWEN_EXPERTS = ("gate_proj", "up_proj", "down_proj")


def read_fields(t: dict, d: Path) -> dict:
    """ModelConfig fields of a qwen2, qwen3 or qwen3_moe config.json."""
    kind = t.get("model_type")
    if t.get("use_sliding_window", False):
        raise refuse(d, "use_sliding_window", True, "shardlm attends to the whole context")
    if kind != "qwen2" and t.get("attention_bias", False):
        raise refuse(d, "attention_bias", True, "Qwen3's attention bias includes the output projection's, which "
                                                "shardlm's block has none of")
    fields = llama_shaped_fields(t, d, QWEN_DEFAULTS, "qwen")
    fields.update(qkv_bias=kind == "qwen2", qk_norm=kind != "qwen2")
    if kind == "qwen3_moe":
        fields.update(_expert_fields(t, d))
    return fields


def _expert_fields(t: dict, d: Path) -> dict:
    experts = t.get("num_experts", t.get("num_local_experts"))
    top_k, norm = t.get("num_experts_per_tok", 8), t.get("norm_topk_prob", False)
    every = t.get("decoder_sparse_step", 1)
    if t.get("mlp_only_layers"):
        raise refuse(d, "mlp_only_layers", t["mlp_only_layers"], "shardlm's sparse layers are every "
                                                                 "decoder_sparse_step-th layer, none excepted")
    if top_k == 1 and norm:
        raise refuse(d, "num_experts_per_tok", top_k, "norm_topk_prob weighs a single expert 1.0 where shardlm "
                                                      "keeps its router probability (Switch's)")
    coef = t.get("router_aux_loss_coef", 0.001)
    return dict(moe_experts=experts, moe_top_k=top_k, moe_every=every, moe_d_ff=t["moe_intermediate_size"],
                moe_shared_expert=False, moe_norm_topk=norm, moe_aux_loss_weight=round_float(coef * top_k),
                scan_layers=every == 1)


def exportable(m, where: str) -> None:
    """Raise if `m` has no Qwen counterpart."""
    if m.qk_norm and m.qkv_bias:
        raise ShardlmError(f"{where} has both q/k norms (Qwen3's) and q/k/v biases (Qwen2's), which no Qwen "
                           "architecture holds; drop one of model.qk_norm, model.qkv_bias")
    if not (m.qk_norm or m.qkv_bias):
        raise ShardlmError(f"{where} has neither q/k norms (Qwen3) nor q/k/v biases (Qwen2); export it as Llama: "
                           "model.family=llama")
    if m.moe_experts and not m.qk_norm:
        raise ShardlmError(f"{where} is a mixture of experts without q/k norms, which Qwen3MoeForCausalLM cannot "
                           "hold; set model.qk_norm=true")
    if m.moe_experts:
        softmax_routing_only(m, where, "Qwen3MoeForCausalLM")
    if m.moe_experts and m.moe_shared_expert:
        raise ShardlmError(f"{where} trained a shared expert (model.moe_shared_expert=true), which "
                           "Qwen3MoeForCausalLM cannot hold")
    if m.moe_experts and m.moe_top_k == 1 and m.moe_norm_topk:
        raise ShardlmError(f"{where} routes each token to one expert weighted by its router probability, which "
                           "Qwen3MoeForCausalLM with norm_topk_prob would weigh 1.0; set model.moe_norm_topk=false")


def write_config(m, common: dict) -> dict:
    exportable(m, "the model")
    base = llama_shaped_config(m, common)
    if m.qkv_bias:
        return {"architectures": ["Qwen2ForCausalLM"], "model_type": "qwen2", **base, "use_sliding_window": False,
                "sliding_window": None}
    qwen3 = {**base, "attention_bias": False, "use_sliding_window": False, "sliding_window": None}
    if not m.moe_experts:
        return {"architectures": ["Qwen3ForCausalLM"], "model_type": "qwen3", **qwen3}
    return {"architectures": ["Qwen3MoeForCausalLM"], "model_type": "qwen3_moe", **qwen3,
            "num_experts": m.moe_experts, "num_experts_per_tok": m.moe_top_k, "moe_intermediate_size": m.moe_d_ff
            or m.d_mlp, "decoder_sparse_step": m.moe_every, "mlp_only_layers": [], "norm_topk_prob": m.moe_norm_topk,
            "router_aux_loss_coef": round_float(m.moe_aux_loss_weight / m.moe_top_k), "output_router_logits": False}


def _sparse(m, i: int) -> bool:
    return bool(m.moe_experts) and (i + 1) % m.moe_every == 0


def tensor_views(m, vocab: int, padded: int, T, names: set[str], config: dict) -> dict:
    views = embedding_views(m, vocab, padded, T)
    for i in range(m.n_layers):
        p, o = f"model.layers.{i}.", f"blocks/{i}/"
        views.update(attention_views(m, p, o, T))
        if _sparse(m, i):
            views.update(expert_views(m.d_model, m.moe_experts, m.moe_d_ff or m.d_mlp, p, f"{o}mlp/", T, names,
                                      f"{p}mlp.", QWEN_EXPERTS))
        else:
            views.update(mlp_views(m.d_model, m.d_mlp, p, o, T))
    return views


def export_tensors(m, vocab: int, get):
    yield "model.embed_tokens.weight", get("wte")[:vocab]
    for i in range(m.n_layers):
        p, o = f"model.layers.{i}.", f"blocks/{i}/"
        yield from attention_tensors(m, p, o, get)
        yield from (expert_tensors(m, f"{p}mlp.", o, get, QWEN_EXPERTS) if _sparse(m, i) else mlp_tensors(p, o, get))
    yield "model.norm.weight", get("ln_f/scale")
    if not m.tie_embeddings:
        yield "lm_head.weight", get("lm_head")[:, :vocab].T


QWEN = HfFormat(model_types=("qwen2", "qwen3", "qwen3_moe"), fields=read_fields, config=write_config,
                views=tensor_views, tensors=export_tensors, exportable=exportable)
