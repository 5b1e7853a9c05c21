"""Llama (`LlamaForCausalLM`, model_type llama: Llama 2/3 shapes, TinyLlama, SmolLM) and Mixtral
(`MixtralForCausalLM`: Llama's attention with a mixture of SwiGLU experts in every layer) as shardlm's llama
family, both ways.

Design choices:
- A setting the model code would compute differently is refused by name: rope scaling other than Llama 3.1's
  `llama3` and YaRN (`shardlm.hf.rope`), attention or MLP biases, another activation than silu, and Mixtral's
  sliding window when it is shorter than the context: by default the context is
  capped at the window (within it, Mixtral's attention is shardlm's full causal attention), and a longer
  `model.seq_len` is refused by `check_import` once the overrides are known. Mixtral's training-time
  regularisers (`router_jitter_noise`, `attention_dropout`) are not carried over: the forward pass is the same
  without them.
- Mixtral's `router_aux_loss_coef` weighs transformers' load-balancing loss, which counts each token's k
  assignments with weight 1 (k when perfectly balanced); shardlm's counts them 1/k (1.0 when balanced), so the
  same term in the objective is `moe_aux_loss_weight = router_aux_loss_coef * num_experts_per_tok` (and the
  export divides by k). transformers pools the layers' routing into one loss where shardlm averages the layers'
  losses, so the two agree exactly for one layer and closely otherwise; either only matters when training.
- Both spellings of the rotary settings are read (`shardlm.hf.rope`). Export writes the 4.x spelling, which 5.x
  reads.
- `head_dim` may differ from hidden / heads (transformers' Llama takes it); the projections are [heads x head_dim,
  hidden] whatever it is.
- The pieces other Llama-shaped mappings share (`shardlm.hf.qwen`) are functions here: the attention's views and
  tensors (with Qwen's q/k/v biases and per-head q/k norms when the model has them), the dense MLP's, and the
  experts' in either layout under the mapping's own names.
- Rotary embeddings need no permutation: Hugging Face stores the q/k projections for the "rotate half" form,
  which is the one shardlm computes (`shardlm.models.layers.apply_rope`).
"""

from __future__ import annotations

from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.models.config import head_size
from shardlm.hf.config import CONFIG_FILE, refuse, round_float
from shardlm.hf.format import HfFormat
from shardlm.hf.rope import read_rope, write_rope
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
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key, False):
            raise refuse(d, key, t[key], "shardlm's Llama has no biases")
    return llama_shaped_fields(t, d, defaults, "llama")


def llama_shaped_fields(t: dict, d: Path, defaults: dict, family: str) -> dict:
    """The fields every Llama-shaped config.json (Llama, Mixtral, Qwen) spells alike, for shardlm's `family`."""
    if t.get("hidden_act", "silu") != "silu":
        raise refuse(d, "hidden_act", t["hidden_act"], "shardlm's Llama uses SwiGLU with silu")
    heads, hidden = t["num_attention_heads"], t["hidden_size"]
    head_dim = t.get("head_dim") or hidden // heads
    return dict(family=family, n_layers=t["num_hidden_layers"], n_heads=heads,
                n_kv_heads=t.get("num_key_value_heads", defaults["num_key_value_heads"]) or heads, d_model=hidden,
                d_mlp=t["intermediate_size"], head_dim=0 if head_dim * heads == hidden else head_dim,
                seq_len=min(t.get("max_position_embeddings", LLAMA_DEFAULT_CONTEXT), LLAMA_DEFAULT_CONTEXT),
                vocab_size=t["vocab_size"], use_bias=False, tie_embeddings=t.get("tie_word_embeddings", False),
                layer_norm_eps=t.get("rms_norm_eps", defaults["rms_norm_eps"]), dropout=0.0,
                **read_rope(t, d, defaults["rope_theta"]))


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
                moe_norm_topk=True, moe_aux_loss_weight=round_float(coef * top_k))


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
    """Raise if `m` has no Hugging Face counterpart: Llama has no q/k norms nor q/k/v-only biases (Qwen's: export
    a qwen-family model), and a mixture of experts is exported as Mixtral, whose every layer is sparse, with one
    expert size, no shared expert, its top-k weights renormalised, and softmax routing (`softmax_routing_only`)."""
    if m.qk_norm or m.qkv_bias:
        raise ShardlmError(f"{where} has {'q/k norms' if m.qk_norm else 'q/k/v biases'} (Qwen's), which "
                           "LlamaForCausalLM cannot hold; train it as model.family=qwen to export it as Qwen")
    if not m.moe_experts:
        return
    softmax_routing_only(m, where, "MixtralForCausalLM")
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
    if not m.moe_norm_topk:
        raise ShardlmError(f"{where} weighs its top-k experts by their raw router probabilities "
                           "(model.moe_norm_topk=false), which MixtralForCausalLM renormalises; train it as "
                           "model.family=qwen to export it as Qwen3-MoE")


def softmax_routing_only(m, where: str, architecture: str) -> None:
    """Raise if `m`'s mixture routes otherwise than by softmax over every expert from the first layer on, which is
    all `architecture` (Mixtral's, Qwen3-MoE's) holds: a sigmoid router and its balancing bias, routing groups, a
    routed scale and dense first layers are DeepSeek-V3's, and written as either they would be silently dropped."""
    deepseek = [f"model.{key}={value}" for key, value, plain in (
        ("moe_router", m.moe_router, "softmax"), ("moe_groups", m.moe_groups, 1),
        ("moe_routed_scale", m.moe_routed_scale, 1.0), ("moe_first_dense", m.moe_first_dense, 0)) if value != plain]
    if deepseek:
        raise ShardlmError(f"{where} routes its experts as DeepSeek-V3 does ({', '.join(deepseek)}), which "
                           f"{architecture} cannot hold (softmax over every expert, from the first layer on): a "
                           "Llama-family mixture exports only routed by softmax (model.moe_router=softmax, balanced "
                           "by model.moe_aux_loss_weight)")


def llama_shaped_config(m, common: dict) -> dict:
    """The config.json keys every Llama-shaped architecture spells alike."""
    return {"num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
            "num_key_value_heads": m.n_kv_heads or m.n_heads, "hidden_size": m.d_model,
            "intermediate_size": m.d_mlp, "head_dim": head_size(m), "max_position_embeddings": m.seq_len,
            "rms_norm_eps": m.layer_norm_eps, **write_rope(m), "hidden_act": "silu", "attention_dropout": 0.0,
            **common}


def write_config(m, common: dict) -> dict:
    llama = llama_shaped_config(m, common)
    if m.moe_experts:  # every layer sparse (`check_exportable`), so d_mlp is unused and the experts' size is Mixtral's
        exportable(m, "the model")
        return {"architectures": ["MixtralForCausalLM"], "model_type": "mixtral", **llama,
                "intermediate_size": m.moe_d_ff or m.d_mlp, "num_local_experts": m.moe_experts,
                "num_experts_per_tok": m.moe_top_k,
                "router_aux_loss_coef": round_float(m.moe_aux_loss_weight / m.moe_top_k),
                "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
    return {"architectures": ["LlamaForCausalLM"], "model_type": "llama", **llama, "attention_bias": False,
            "mlp_bias": False}


def attention_views(m, p: str, o: str, T) -> dict[str, View]:
    """One layer's attention (Hugging Face prefix `p`, 'model.layers.3.'; shardlm's `o`, 'blocks/3/'): the
    projections per head, and Qwen's q/k/v biases and per-head q/k norms where the model has them."""
    d, h, hd, kv = m.d_model, m.n_heads, head_size(m), m.n_kv_heads or m.n_heads
    a, views = f"{p}self_attn.", {}
    for x, heads in (("q", h), ("k", kv), ("v", kv)):
        views[f"{o}attn/w{x}"] = Split(Transposed(T(f"{a}{x}_proj.weight", (heads * hd, d))), 1, (heads, hd))
        if m.qkv_bias:
            views[f"{o}attn/{x}_bias"] = Split(T(f"{a}{x}_proj.bias", (heads * hd,)), 0, (heads, hd))
    views[f"{o}attn/wo"] = Split(Transposed(T(f"{a}o_proj.weight", (d, h * hd))), 0, (h, hd))
    if m.qk_norm:
        views[f"{o}attn/q_norm/scale"] = T(f"{a}q_norm.weight", (hd,))
        views[f"{o}attn/k_norm/scale"] = T(f"{a}k_norm.weight", (hd,))
    views[f"{o}ln1/scale"] = T(f"{p}input_layernorm.weight", (d,))
    views[f"{o}ln2/scale"] = T(f"{p}post_attention_layernorm.weight", (d,))
    return views


def mlp_views(d: int, f: int, p: str, o: str, T) -> dict[str, View]:
    """A dense SwiGLU MLP's views (`mlp.gate_proj` / `up_proj` / `down_proj`)."""
    return {f"{o}mlp/w_gate": Transposed(T(f"{p}mlp.gate_proj.weight", (f, d))),
            f"{o}mlp/w_up": Transposed(T(f"{p}mlp.up_proj.weight", (f, d))),
            f"{o}mlp/w_down": Transposed(T(f"{p}mlp.down_proj.weight", (d, f)))}


def expert_views(d: int, e: int, f: int, p: str, o: str, T, names: set[str], moe: str,
                 per_expert: tuple[str, str, str]) -> dict[str, View]:
    """One sparse layer's MLP (`shardlm.models.moe.MoeMLP`) from the tensors under prefix `moe`, in either layout
    transformers reads:
    - per expert, as the published checkpoints and transformers' `save_pretrained` write them: `{moe}gate.weight`
      [E, d] and `{moe}experts.{e}.{gate}/{up}/{down}.weight` (`per_expert`'s names; gate and up [f, d], down
      [d, f]), each expert's tensor its own file entry; stacked by a view on the experts axis, so a device holding
      experts 2-3 reads experts 2 and 3 only;
    - fused, as transformers 5 holds them in memory: `mlp.gate.weight`, `mlp.experts.gate_up_proj` [E, 2f, d]
      (gate rows first, then up) and `mlp.experts.down_proj` [E, d, f]."""
    views = {f"{o}router": Transposed(T(f"{moe}gate.weight", (e, d)))}
    if f"{p}mlp.experts.gate_up_proj" in names:
        gate_up = T(f"{p}mlp.experts.gate_up_proj", (e, 2 * f, d))
        views[f"{o}w_gate"] = Transposed(Window(gate_up, 1, 0, f), (0, 2, 1))
        views[f"{o}w_up"] = Transposed(Window(gate_up, 1, f, f), (0, 2, 1))
        views[f"{o}w_down"] = Transposed(T(f"{p}mlp.experts.down_proj", (e, d, f)), (0, 2, 1))
        return views
    for ours, theirs, shape in zip(("w_gate", "w_up", "w_down"), per_expert, ((f, d), (f, d), (d, f))):
        views[f"{o}{ours}"] = Stacked(tuple(Transposed(T(f"{moe}experts.{x}.{theirs}.weight", shape))
                                            for x in range(e)))
    return views


def embedding_views(m, vocab: int, padded: int, T) -> dict[str, View]:
    d = m.d_model
    views = {"wte": Padded(T("model.embed_tokens.weight", (vocab, d)), 0, padded),
             "ln_f/scale": T("model.norm.weight", (d,))}
    if not m.tie_embeddings:
        views["lm_head"] = Padded(Transposed(T("lm_head.weight", (vocab, d))), 1, padded)
    return views


MIXTRAL_EXPERTS = ("w1", "w3", "w2")  # gate, up, down


def tensor_views(m, vocab: int, padded: int, T, names: set[str], config: dict) -> dict[str, View]:
    """Llama's tensors, and a mixture's as Mixtral's (`block_sparse_moe.` or `mlp.`, which transformers renames
    one to the other)."""
    views = embedding_views(m, vocab, padded, T)
    for i in range(m.n_layers):
        p, o = f"model.layers.{i}.", f"blocks/{i}/"
        views.update(attention_views(m, p, o, T))
        if m.moe_experts and (i + 1) % m.moe_every == 0:
            moe = f"{p}block_sparse_moe." if f"{p}block_sparse_moe.gate.weight" in names else f"{p}mlp."
            views.update(expert_views(m.d_model, m.moe_experts, m.moe_d_ff or m.d_mlp, p, f"{o}mlp/", T, names,
                                      moe, MIXTRAL_EXPERTS))
        else:
            views.update(mlp_views(m.d_model, m.d_mlp, p, o, T))
    return views


def attention_tensors(m, p: str, o: str, get) -> Iterator[tuple[str, np.ndarray]]:
    """One layer's norms and attention tensors, as `attention_views` reads them."""
    d, a = m.d_model, f"{p}self_attn."
    yield f"{p}input_layernorm.weight", get(f"{o}ln1/scale")
    yield f"{p}post_attention_layernorm.weight", get(f"{o}ln2/scale")
    for x in "qkv":
        yield f"{a}{x}_proj.weight", get(f"{o}attn/w{x}").reshape(d, -1).T  # [d, heads, head_dim]
        if m.qkv_bias:
            yield f"{a}{x}_proj.bias", get(f"{o}attn/{x}_bias").reshape(-1)
    yield f"{a}o_proj.weight", get(f"{o}attn/wo").reshape(-1, d).T
    if m.qk_norm:
        yield f"{a}q_norm.weight", get(f"{o}attn/q_norm/scale")
        yield f"{a}k_norm.weight", get(f"{o}attn/k_norm/scale")


def mlp_tensors(p: str, o: str, get) -> Iterator[tuple[str, np.ndarray]]:
    yield f"{p}mlp.gate_proj.weight", get(f"{o}mlp/w_gate").T
    yield f"{p}mlp.up_proj.weight", get(f"{o}mlp/w_up").T
    yield f"{p}mlp.down_proj.weight", get(f"{o}mlp/w_down").T


def expert_tensors(m, moe: str, o: str, get, per_expert: tuple[str, str, str]) -> Iterator[tuple[str, np.ndarray]]:
    """A sparse layer's router and experts, per expert as save_pretrained writes them, one expert's tensor
    gathered at a time."""
    yield f"{moe}gate.weight", get(f"{o}mlp/router").T
    for e in range(m.moe_experts):
        for ours, theirs in sorted(zip(("w_gate", "w_up", "w_down"), per_expert), key=lambda pair: pair[1]):
            yield f"{moe}experts.{e}.{theirs}.weight", get(f"{o}mlp/{ours}", e).T


def export_tensors(m, vocab: int, get: Callable[..., np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """LlamaForCausalLM's tensors, or Mixtral's per-expert ones, one at a time (see `HfFormat.tensors`)."""
    yield "model.embed_tokens.weight", get("wte")[:vocab]
    for i in range(m.n_layers):
        p, o = f"model.layers.{i}.", f"blocks/{i}/"
        yield from attention_tensors(m, p, o, get)
        if m.moe_experts:  # Mixtral (every layer sparse)
            yield from expert_tensors(m, f"{p}block_sparse_moe.", o, get, MIXTRAL_EXPERTS)
        else:
            yield from mlp_tensors(p, o, get)
    yield "model.norm.weight", get("ln_f/scale")
    if not m.tie_embeddings:
        yield "lm_head.weight", get("lm_head")[:, :vocab].T


LLAMA = HfFormat(model_types=("llama", "mixtral"), fields=read_fields, config=write_config, views=tensor_views,
                 tensors=export_tensors, exportable=exportable, check_import=check_import)
