"""GPT-2 (`GPT2LMHeadModel`, model_type gpt2: GPT-2 124M to 1.5B) as shardlm's GPT family, both ways.

Design choices:
- What shardlm's GPT would compute differently is refused by name: another activation than the tanh-approximated
  GELU, per-layer attention scaling, cross-attention, a GPT without biases (GPT-2 has them).
- GPT-2's Conv1D stores its weights [in, out], as shardlm does; only the fused q/k/v `c_attn` is split (a window
  per projection) and the heads are split out of the width.
"""

from __future__ import annotations

import json
from pathlib import Path
from typing import Callable, Iterator

import numpy as np

from shardlm.errors import ShardlmError
from shardlm.hf.config import refuse
from shardlm.hf.format import HfFormat
from shardlm.hf.views import Padded, Split, Transposed, View, Window


def read_fields(t: dict, d: Path) -> dict:
    act = t.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise refuse(d, "activation_function", act, "shardlm's GPT uses the tanh-approximated GELU, gelu_new")
    for key, want in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                      ("scale_attn_weights", True)):
        if t.get(key, want) != want:
            raise refuse(d, key, t[key], f"shardlm's GPT has {key}={json.dumps(want)}")
    d_model = t["n_embd"]
    return dict(family="gpt", n_layers=t["n_layer"], n_heads=t["n_head"], n_kv_heads=0, d_model=d_model,
                d_mlp=t.get("n_inner") or 4 * d_model, seq_len=t.get("n_positions", 1024),
                vocab_size=t["vocab_size"], use_bias=True, tie_embeddings=t.get("tie_word_embeddings", True),
                layer_norm_eps=t.get("layer_norm_epsilon", 1e-5), dropout=0.0)


def check_import(m, tree: dict, directory: Path) -> None:
    if not m.use_bias:
        raise ShardlmError(f"hf:{directory} is a GPT-2 checkpoint, whose layers have biases; drop "
                           "model.use_bias=false")


def exportable(m, where: str) -> None:
    """A GPT is exported as GPT-2, which has biases and no q/k norms."""
    if not m.use_bias:
        raise ShardlmError(f"{where} trained a GPT without biases (model.use_bias=false), which transformers' "
                           "GPT2LMHeadModel cannot hold; only GPT runs with biases export")
    if m.qk_norm:
        raise ShardlmError(f"{where} trained a GPT with q/k norms (model.qk_norm=true), which transformers' "
                           "GPT2LMHeadModel cannot hold; only GPT runs without them export")


def write_config(m, common: dict) -> dict:
    return {"architectures": ["GPT2LMHeadModel"], "model_type": "gpt2", "n_layer": m.n_layers,
            "n_head": m.n_heads, "n_embd": m.d_model, "n_inner": m.d_mlp, "n_positions": m.seq_len,
            "n_ctx": m.seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": m.layer_norm_eps,
            "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
            "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, **common}


def tensor_views(m, vocab: int, padded: int, T, names: set[str], config: dict) -> dict[str, View]:
    """GPT-2's tensors (under `transformer.` as GPT2LMHeadModel saves them, or bare as GPT2Model does)."""
    prefix = "transformer." if "transformer.wte.weight" in names else ""
    d, h, hd, f = m.d_model, m.n_heads, m.d_model // m.n_heads, m.d_mlp
    views = {"wte": Padded(T(f"{prefix}wte.weight", (vocab, d)), 0, padded),
             "wpe": Window(T(f"{prefix}wpe.weight", None), 0, 0, m.seq_len),
             "ln_f/scale": T(f"{prefix}ln_f.weight", (d,)), "ln_f/bias": T(f"{prefix}ln_f.bias", (d,))}
    for i in range(m.n_layers):
        p, o = f"{prefix}h.{i}.", f"blocks/{i}/"
        qkv, qkv_bias = T(f"{p}attn.c_attn.weight", (d, 3 * d)), T(f"{p}attn.c_attn.bias", (3 * d,))
        for k, name in enumerate(("q", "k", "v")):
            views[f"{o}attn/w{name}"] = Split(Window(qkv, 1, k * d, d), 1, (h, hd))
            views[f"{o}attn/{name}_bias"] = Split(Window(qkv_bias, 0, k * d, d), 0, (h, hd))
        views[f"{o}attn/wo"] = Split(T(f"{p}attn.c_proj.weight", (d, d)), 0, (h, hd))
        views[f"{o}attn/out_bias"] = T(f"{p}attn.c_proj.bias", (d,))
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            views[f"{o}{ours}/scale"] = T(f"{p}{theirs}.weight", (d,))
            views[f"{o}{ours}/bias"] = T(f"{p}{theirs}.bias", (d,))
        views[f"{o}mlp/w_in"] = T(f"{p}mlp.c_fc.weight", (d, f))  # GPT-2's Conv1D stores [in, out], as shardlm
        views[f"{o}mlp/in_bias"] = T(f"{p}mlp.c_fc.bias", (f,))
        views[f"{o}mlp/w_out"] = T(f"{p}mlp.c_proj.weight", (f, d))
        views[f"{o}mlp/out_bias"] = T(f"{p}mlp.c_proj.bias", (d,))
    if not m.tie_embeddings:
        views["lm_head"] = Padded(Transposed(T("lm_head.weight", (vocab, d))), 1, padded)
    return views


def export_tensors(m, vocab: int, get: Callable[..., np.ndarray]) -> Iterator[tuple[str, np.ndarray]]:
    """GPT2LMHeadModel's tensors, one at a time (see `HfFormat.tensors`)."""
    d = m.d_model
    yield "transformer.wte.weight", get("wte")[:vocab]
    yield "transformer.wpe.weight", get("wpe")
    for i in range(m.n_layers):
        p, o = f"transformer.h.{i}.", f"blocks/{i}/"
        for ours, theirs in (("ln1", "ln_1"), ("ln2", "ln_2")):
            yield f"{p}{theirs}.weight", get(f"{o}{ours}/scale")
            yield f"{p}{theirs}.bias", get(f"{o}{ours}/bias")
        yield f"{p}attn.c_attn.weight", np.concatenate([get(f"{o}attn/w{x}").reshape(d, d) for x in "qkv"], 1)
        yield f"{p}attn.c_attn.bias", np.concatenate([get(f"{o}attn/{x}_bias").reshape(d) for x in "qkv"])
        yield f"{p}attn.c_proj.weight", get(f"{o}attn/wo").reshape(d, d)
        yield f"{p}attn.c_proj.bias", get(f"{o}attn/out_bias")
        yield f"{p}mlp.c_fc.weight", get(f"{o}mlp/w_in")
        yield f"{p}mlp.c_fc.bias", get(f"{o}mlp/in_bias")
        yield f"{p}mlp.c_proj.weight", get(f"{o}mlp/w_out")
        yield f"{p}mlp.c_proj.bias", get(f"{o}mlp/out_bias")
    yield "transformer.ln_f.weight", get("ln_f/scale")
    yield "transformer.ln_f.bias", get("ln_f/bias")
    if not m.tie_embeddings:
        yield "lm_head.weight", get("lm_head")[:, :vocab].T


GPT2 = HfFormat(model_types=("gpt2",), fields=read_fields, config=write_config, views=tensor_views,
                tensors=export_tensors,
                exportable=exportable, check_import=check_import)
