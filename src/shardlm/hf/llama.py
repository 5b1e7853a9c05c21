"""Llama (`LlamaForCausalLM`, model_type llama: Llama 2/3 shapes, TinyLlama, SmolLM) and Mixtral
(`MixtralForCausalLM`: Llama's attention with a mixture of SwiGLU experts in every layer) as shardlm's llama
family, both ways.

Design choices:
- A setting the model code would compute differently is refused by name: rope scaling (Llama 3.1's `llama3`,
  linear, dynamic, YaRN), attention or MLP biases, another activation than silu, a `head_dim` other than
  hidden / heads, and Mixtral's sliding window when it is shorter than the context: by default the context is
  capped at the window (within it, Mixtral's attention is shardlm's full causal attention), and a longer
  `model.seq_len` is refused by `check_import` once the overrides are known. Mixtral's training-time
  regularisers (`router_jitter_noise`, `attention_dropout`) are not carried over: the forward pass is the same
  without them.
- Mixtral's `router_aux_loss_coef` weighs transformers' load-balancing loss, which counts each token's k
  assignments with weight 1 (k when perfectly balanced); shardlm's counts them 1/k (1.0 when balanced), so the
  same term in the objective is `moe_aux_loss_weight = router_aux_loss_coef * num_experts_per_tok` (and the
  export divides by k). transformers pools the layers' routing into one loss where shardlm averages the layers'
  losses, so the two agree exactly for one layer and closely otherwise; either only matters when training.
- Both spellings of the rotary base are read: `rope_theta` with `rope_scaling` (transformers 4.x, most
  checkpoints on the Hub) and `rope_parameters` (transformers 5). Export writes the 4.x spelling, which 5.x reads.
- Rotary embeddings need no permutation: Hugging Face stores the q/k projections for the "rotate half" form,
  which is the one shardlm computes (`shardlm.models.layers.apply_rope`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.hf.config import CONFIG_FILE, refuse, round_float
from shardlm.hf.format import HfFormat
from shardlm.hf.views import Padded, Split, Stacked, Transposed, View, Window

LLAMA_DEFAULT_CONTEXT = 2048  # Llama 3's 131,072 positions would be the default context otherwise
# transformers' defaults where a Llama and a Mixtral config.json without the key differ
LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": None}
MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}


def read_fields(tree: dict, directory: Path) -> dict:
    """ModelConfig fields of a llama or a mixtral config.json."""
    return (_mixtral_fields if tree.get("model_type") == "mixtral" else _llama_fields)(tree, directory)


def _llama_fields(t: dict, d: Path, defaults: dict = LLAMA_DEFAULTS) -> dict:
    if t.get("hidden_act", "silu") != "silu":
        raise refuse(d, "hidden_act", t["hidden_act"], "shardlm's Llama uses SwiGLU with silu")
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key, False):
            raise refuse(d, key, t[key], "shardlm's Llama has no biases")
    heads, hidden = t["num_attention_heads"], t["hidden_size"]
    if t.get("head_dim") not in (None, hidden // heads):
        raise refuse(d, "head_dim", t["head_dim"], f"shardlm's head size is hidden_size / num_attention_heads = "
                                                    f"{hidden // heads}")
    params = t.get("rope_parameters") or {}
    scaling = t.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else params.get("rope_type")
    if kind not in (None, "default"):
        key = "rope_scaling" if scaling else "rope_parameters"
        raise refuse(d, key, scaling or params, f"rope scaling {kind!r}: shardlm implements plain rotary embeddings")
    theta = t.get("rope_theta", params.get("rope_theta", defaults["rope_theta"]))
    return dict(family="llama", n_layers=t["num_hidden_layers"], n_heads=heads,
                n_kv_heads=t.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads, d_model=hidden,
                d_mlp=t["intermediate_size"],
                seq_len=min(t.get("max_position_embeddings", LLAMA_DEFAULT_CONTEXT), LLAMA_DEFAULT_CONTEXT),
                vocab_size=t["vocab_size"], use_bias=False, tie_embeddings=t.get("tie_word_embeddings", False),
                layer_norm_eps=t.get("rms_norm_eps", defaults["rms_norm_eps"]), rope_theta=float(theta),
                dropout=0.0)


def _mixtral_fields(t: dict, d: Path) -> dict:
    """Llama's fields, and every layer's MLP a mixture of `num_local_experts` SwiGLU experts of hidden size
    `intermediate_size`, top `num_experts_per_tok` routing renormalised (shardlm's routing is Mixtral's for k > 1;
    with one expert shardlm keeps its raw probability, Switch's, where Mixtral's renormalises it to 1.0)."""
    fields = _llama_fields(t, d, MIXTRAL_DEFAULTS)
    experts = t.get("num_local_experts", t.get("num_experts", MIXTRAL_DEFAULTS["num_local_experts"]))
    top_k = t.get("num_experts_per_tok", MIXTRAL_DEFAULTS["num_experts_per_tok"])
    if top_k == 1:
        raise refuse(d, "num_experts_per_tok", top_k, "Mixtral weighs a single expert 1.0 where shardlm keeps its "
                      "router probability (Switch's), so the two would compute different models; use k >= 2")
    window = t.get("sliding_window")
    if window is not None:  # the default context within the window, where attention is shardlm's full attention
        if not isinstance(window, int) or window < 1:
            raise refuse(d, "sliding_window", window, "a window is a positive number of tokens, or null")
        fields["seq_len"] = min(fields["seq_len"], window)
    coef = t.get("router_aux_loss_coef", MIXTRAL_DEFAULTS["router_aux_loss_coef"])
    return dict(fields, moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_d_ff=0, moe_shared_expert=False,
                moe_aux_loss_weight=round_float(coef * top_k))


def check_import(model, tree: dict, directory: Path) -> None:
    """Raise if the overrides ask for what the checkpoint cannot hold: a shared expert (Mixtral has none), or a
    context longer than its sliding window (`model.seq_len` after any override; by default the window caps it):
    within its window, Mixtral's attention is shardlm's full causal attention, beyond it another model."""
    if model.moe_experts and model.moe_shared_expert:
        raise ShardlmError(f"hf:{directory}: Mixtral checkpoints have no shared expert; drop "
                           "model.moe_shared_expert=true")
    window = tree.get("sliding_window") if tree.get("model_type") == "mixtral" else None
    if window is not None and window < model.seq_len:
        raise ShardlmError(f"{directory.resolve() / CONFIG_FILE}: sliding_window={window} is not supported with "
                           f"model.seq_len={model.seq_len} (each token attends to the last {window} only, where "
                           f"shardlm attends to the whole context; shardlm would compute another model); set "
                           f"model.seq_len={window} or lower")


def exportable(m, where: str) -> None:
    """Raise if `m` has no Hugging Face counterpart: a mixture of experts is exported as Mixtral, whose every layer
    is sparse, with one expert size and no shared expert."""
    if not m.moe_experts:
        return
    if m.moe_every != 1:
        raise ShardlmError(f"{where} trained a mixture of experts in every {m.moe_every}-th layer "
                           f"(model.moe_every={m.moe_every}), which MixtralForCausalLM cannot hold (every layer of "
                           "Mixtral is sparse); only model.moe_every=1 runs export")
    if m.moe_shared_expert:
        raise ShardlmError(f"{where} trained a shared expert (model.moe_shared_expert=true), which "
                           "MixtralForCausalLM cannot hold (it has routed experts only); only runs without one export")
    if m.moe_top_k == 1:
        raise ShardlmError(f"{where} routes each token to one expert weighted by its router probability "
                           "(model.moe_top_k=1, Switch's), which MixtralForCausalLM would weigh 1.0; only runs with "
                           "model.moe_top_k >= 2 export")


def write_config(m, common: dict) -> dict:
    llama = {"num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
             "num_key_value_heads": m.n_kv_heads or m.n_heads, "hidden_size": m.d_model,
             "intermediate_size": m.d_mlp, "head_dim": m.d_model // m.n_heads, "max_position_embeddings": m.seq_len,
             "rms_norm_eps": m.layer_norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None, "hidden_act": "silu",
             "attention_dropout": 0.0, **common}
    if m.moe_experts:  # every layer sparse (`check_exportable`), so d_mlp is unused and the experts' size is Mixtral's
        exportable(m, "the model")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **llama,
                "intermediate_size": m.moe_d_ff or m.d_mlp, "num_local_experts": m.moe_experts,
                "num_experts_per_tok": m.moe_top_k,
                "router_aux_loss_coef": round_float(m.moe_aux_loss_weight / m.moe_top_k),
                "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama, "attention_bias": False,
            "mlp_bias": False}


def tensor_views(m, vocab: int, padded: int, T, names: set[str]) -> dict[str, View]:
    """Llama's tensors, and a mixture's as Mixtral's (`_mixtral_views`)."""
    prefix = "model."
    d, h, f = m.d_model, m.n_heads, m.d_mlp
    hd, kv = d // h, m.n_kv_heads or h
    views = {"wte": Padded(T(f"{prefix}embed_tokens.weight", (vocab, d)), 0, padded),
             "ln_f/scale": T(f"{prefix}norm.weight", (d,))}
    for i in range(m.n_layers):
        p, o = f"{prefix}layers.{i}.", f"blocks/{i}/"
        views[f"{o}attn/wq"] = Split(Transposed(T(f"{p}self_attn.q_proj.weight", (h * hd, d))), 1, (h, hd))
        views[f"{o}attn/wk"] = Split(Transposed(T(f"{p}self_attn.k_proj.weight", (kv * hd, d))), 1, (kv, hd))
        views[f"{o}attn/wv"] = Split(Transposed(T(f"{p}self_attn.v_proj.weight", (kv * hd, d))), 1, (kv, hd))
        views[f"{o}attn/wo"] = Split(Transposed(T(f"{p}self_attn.o_proj.weight", (d, h * hd))), 0, (h, hd))
        views[f"{o}ln1/scale"] = T(f"{p}input_layernorm.weight", (d,))
        views[f"{o}ln2/scale"] = T(f"{p}post_attention_layernorm.weight", (d,))
        if m.moe_experts and (i + 1) % m.moe_every == 0:
            views.update(_mixtral_views(m, p, f"{o}mlp/", T, names))
            continue
        views[f"{o}mlp/w_gate"] = Transposed(T(f"{p}mlp.gate_proj.weight", (f, d)))
        views[f"{o}mlp/w_up"] = Transposed(T(f"{p}mlp.up_proj.weight", (f, d)))
        views[f"{o}mlp/w_down"] = Transposed(T(f"{p}mlp.down_proj.weight", (d, f)))
    if not m.tie_embeddings:
        views["lm_head"] = Padded(Transposed(T("lm_head.weight", (vocab, d))), 1, padded)
    return views


def _mixtral_views(m, p: str, o: str, T, names: set[str]) -> dict[str, View]:
    """One sparse layer's MLP (`shardlm.models.moe.MoeMLP`) from Mixtral's tensors (prefix `p`, 'model.layers.3.'),
    in either layout transformers reads:
    - per expert, as the published checkpoints and transformers' `save_pretrained` write them:
      `block_sparse_moe.gate.weight` [E, d] and `block_sparse_moe.experts.{e}.w1/w3/w2.weight` (gate and up
      [f, d], down [d, f]), each expert's tensor its own file entry; stacked by a view on the experts axis, so a
      device holding experts 2-3 reads experts 2 and 3 only;
    - fused, as transformers 5 holds them in memory: `mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2f, d]
      (gate rows first, then up) and `mlp.experts.down_proj` [E, d, f].
    (`mlp.` also stands for `block_sparse_moe.` in the first, as transformers renames one to the other.)"""
    d, e, f = m.d_model, m.moe_experts, m.moe_d_ff or m.d_mlp
    moe = f"{p}block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else f"{p}mlp."
    views = {f"{o}router": Transposed(T(f"{moe}gate.weight", (e, d)))}
    if f"{p}mlp.experts.gate_up_proj" in names:
        gate_up = T(f"{p}mlp.experts.gate_up_proj", (e, 2 * f, d))
        views[f"{o}w_gate"] = Transposed(Window(gate_up, 1, 0, f), (0, 2, 1))
        views[f"{o}w_up"] = Transposed(Window(gate_up, 1, f, f), (0, 2, 1))
        views[f"{o}w_down"] = Transposed(T(f"{p}mlp.experts.down_proj", (e, d, f)), (0, 2, 1))
        return views
    for ours, theirs, shape in (("w_gate", "w1", (f, d)), ("w_up", "w3", (f, d)), ("w_down", "w2", (d, f))):
        views[f"{o}{ours}"] = Stacked(tuple(Transposed(T(f"{moe}experts.{x}.{theirs}.weight", shape))
                                            for x in range(e)))
    return views


def export_tensors(m, vocab: int, get: Callable[..., np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """LlamaForCausalLM's tensors, or Mixtral's per-expert ones, one at a time (see `HfFormat.tensors`); one
    expert's tensor is gathered at a time."""
    d = m.d_model
    yield "model.embed_tokens.weight", get("wte")[:vocab]
    for i in range(m.n_layers):
        p, o = f"model.layers.{i}.", f"blocks/{i}/"
        yield f"{p}input_layernorm.weight", get(f"{o}ln1/scale")
        yield f"{p}post_attention_layernorm.weight", get(f"{o}ln2/scale")
        for x in "qkv":
            w = get(f"{o}attn/w{x}")  # [d, heads, head_dim]
            yield f"{p}self_attn.{x}_proj.weight", w.reshape(d, -1).T
        yield f"{p}self_attn.o_proj.weight", get(f"{o}attn/wo").reshape(d, d).T
        if m.moe_experts:  # Mixtral (every layer sparse), per expert as save_pretrained writes it
            moe = f"{p}block_sparse_moe."
            yield f"{moe}gate.weight", get(f"{o}mlp/router").T
            for e in range(m.moe_experts):  # one expert at a time
                yield f"{moe}experts.{e}.w1.weight", get(f"{o}mlp/w_gate", e).T
                yield f"{moe}experts.{e}.w2.weight", get(f"{o}mlp/w_down", e).T
                yield f"{moe}experts.{e}.w3.weight", get(f"{o}mlp/w_up", e).T
            continue
        yield f"{p}mlp.gate_proj.weight", get(f"{o}mlp/w_gate").T
        yield f"{p}mlp.up_proj.weight", get(f"{o}mlp/w_up").T
        yield f"{p}mlp.down_proj.weight", get(f"{o}mlp/w_down").T
    yield "model.norm.weight", get("ln_f/scale")
    if not m.tie_embeddings:
        yield "lm_head.weight", get("lm_head")[:, :vocab].T


LLAMA = HfFormat(model_types=("llama", "mixtral"), fields=read_fields, config=write_config, views=tensor_views,
                 tensors=export_tensors, exportable=exportable, check_import=check_import)
