"""A Hugging Face `config.json` as shardlm's model config, and back, for the two families shardlm implements.

Supported: `GPT2LMHeadModel` (model_type gpt2: GPT-2 124M to 1.5B), `LlamaForCausalLM` (model_type llama:
Llama 2/3 shapes, TinyLlama, SmolLM, ...) and `MixtralForCausalLM` (model_type mixtral: Llama's attention with a
mixture of SwiGLU experts in every layer, shardlm's Llama with `moe_experts`, `moe_every=1`). A setting the model
code would compute differently is refused by name instead of being imported into a model that silently computes
something else: rope scaling (Llama 3.1's `llama3`, linear, dynamic, YaRN), attention or MLP biases on Llama,
another activation than the family's, a `head_dim` other than hidden / heads, GPT-2's per-layer attention scaling
or cross-attention, and Mixtral's sliding window when it is shorter than the context: by default the context is
capped at the window (within it, Mixtral's attention is shardlm's full causal attention), and a longer
`model.seq_len` is refused by `check_context` once the overrides are known. Mixtral's training-time regularisers
(`router_jitter_noise`, `attention_dropout`) are not carried over: the forward pass is the same without them.

Mixtral's `router_aux_loss_coef` weighs transformers' load-balancing loss, which counts each token's k
assignments with weight 1 (k when perfectly balanced); shardlm's counts them 1/k (1.0 when balanced), so the
same term in the objective is `moe_aux_loss_weight = router_aux_loss_coef * num_experts_per_tok` (and the
export divides by k). transformers pools the layers' routing into one loss where shardlm averages the layers'
losses, so the two agree exactly for one layer and closely otherwise; either only matters when training.

Both spellings of Llama's rotary base are read: `rope_theta` with `rope_scaling` (transformers 4.x, most
checkpoints on the Hub) and `rope_parameters` (transformers 5). Export writes the 4.x spelling, which 5.x reads.
"""

from __future__ import annotations

import json
from pathlib import Path

from shardlm.errors import ShardlmError
from shardlm.files import read_mapping
from shardlm.models.config import ModelConfig

CONFIG_FILE = "config.json"
HF_PREFIX = "hf:"
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM", "mixtral": "MixtralForCausalLM"}
LLAMA_DEFAULT_CONTEXT = 2048  # Llama 3's 131,072 positions would be the default context otherwise
# transformers' defaults where a Llama and a Mixtral config.json without the key differ
LLAMA_DEFAULTS = {"rope_theta": 10000.0, "rms_norm_eps": 1e-6, "num_key_value_heads": None}
MIXTRAL_DEFAULTS = {"rope_theta": 1e6, "rms_norm_eps": 1e-5, "num_key_value_heads": 8, "num_local_experts": 8,
                    "num_experts_per_tok": 2, "router_aux_loss_coef": 0.001}


def model_label(spec: str) -> str:
    """A file-name-safe label for `hf:DIR`: 'hf:/ckpt/TinyLlama-1.1B' -> 'hf-TinyLlama-1.1B'."""
    return "hf-" + (hf_dir(spec).resolve().name or "model")


def is_hf(spec: str | Path) -> bool:
    """Whether a model or checkpoint spec names a Hugging Face directory ('hf:DIR')."""
    return str(spec).startswith(HF_PREFIX)


def hf_dir(spec: str) -> Path:
    """'hf:DIR' -> DIR."""
    return Path(spec[len(HF_PREFIX):]).expanduser()


def read_hf_config(directory: str | Path) -> dict:
    directory = Path(directory)
    if not directory.is_dir():
        raise ShardlmError(f"hf:{directory} is not a directory; give a local directory as save_pretrained writes it "
                           "(config.json and *.safetensors); shardlm does not download")
    if not (directory / CONFIG_FILE).is_file():
        raise ShardlmError(f"hf:{directory} holds no {CONFIG_FILE}; give the directory save_pretrained wrote")
    return read_mapping(directory / CONFIG_FILE, "", missing="give the directory save_pretrained wrote",
                        not_mapping="a Hugging Face config.json holds one JSON object")


def _refuse(path: Path, key: str, value, why: str) -> ShardlmError:
    return ShardlmError(f"{path / CONFIG_FILE}: {key}={json.dumps(value)} is not supported ({why}); shardlm would "
                        "compute another model")


def model_fields(tree: dict, directory: Path) -> dict:
    """ModelConfig fields for the checkpoint in `directory` whose config.json is `tree`."""
    kind = tree.get("model_type")
    if kind == "gpt2":
        return _gpt2_fields(tree, directory)
    if kind == "llama":
        return _llama_fields(tree, directory)
    if kind == "mixtral":
        return _mixtral_fields(tree, directory)
    arch = ", ".join(tree.get("architectures") or []) or "no architectures listed"
    raise ShardlmError(f"{directory / CONFIG_FILE}: model_type {kind!r} ({arch}) is not supported; shardlm imports "
                       f"gpt2 (GPT2LMHeadModel), llama (LlamaForCausalLM) and mixtral (MixtralForCausalLM) "
                       "checkpoints")


def _gpt2_fields(t: dict, d: Path) -> dict:
    act = t.get("activation_function", "gelu_new")
    if act not in ("gelu_new", "gelu_pytorch_tanh", "gelu_fast"):
        raise _refuse(d, "activation_function", act, "shardlm's GPT uses the tanh-approximated GELU, gelu_new")
    for key, want in (("scale_attn_by_inverse_layer_idx", False), ("add_cross_attention", False),
                      ("scale_attn_weights", True)):
        if t.get(key, want) != want:
            raise _refuse(d, key, t[key], f"shardlm's GPT has {key}={json.dumps(want)}")
    d_model = t["n_embd"]
    return dict(family="gpt", n_layers=t["n_layer"], n_heads=t["n_head"], n_kv_heads=0, d_model=d_model,
                d_mlp=t.get("n_inner") or 4 * d_model, seq_len=t.get("n_positions", 1024),
                vocab_size=t["vocab_size"], use_bias=True, tie_embeddings=t.get("tie_word_embeddings", True),
                layer_norm_eps=t.get("layer_norm_epsilon", 1e-5), dropout=0.0)


def _llama_fields(t: dict, d: Path, defaults: dict = LLAMA_DEFAULTS) -> dict:
    if t.get("hidden_act", "silu") != "silu":
        raise _refuse(d, "hidden_act", t["hidden_act"], "shardlm's Llama uses SwiGLU with silu")
    for key in ("attention_bias", "mlp_bias"):
        if t.get(key, False):
            raise _refuse(d, key, t[key], "shardlm's Llama has no biases")
    heads, hidden = t["num_attention_heads"], t["hidden_size"]
    if t.get("head_dim") not in (None, hidden // heads):
        raise _refuse(d, "head_dim", t["head_dim"], f"shardlm's head size is hidden_size / num_attention_heads = "
                                                    f"{hidden // heads}")
    params = t.get("rope_parameters") or {}
    scaling = t.get("rope_scaling")
    kind = (scaling or {}).get("rope_type", (scaling or {}).get("type")) if scaling else params.get("rope_type")
    if kind not in (None, "default"):
        key = "rope_scaling" if scaling else "rope_parameters"
        raise _refuse(d, key, scaling or params, f"rope scaling {kind!r}: shardlm implements plain rotary embeddings")
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
        raise _refuse(d, "num_experts_per_tok", top_k, "Mixtral weighs a single expert 1.0 where shardlm keeps its "
                      "router probability (Switch's), so the two would compute different models; use k >= 2")
    window = t.get("sliding_window")
    if window is not None:  # the default context within the window, where attention is shardlm's full attention
        if not isinstance(window, int) or window < 1:
            raise _refuse(d, "sliding_window", window, "a window is a positive number of tokens, or null")
        fields["seq_len"] = min(fields["seq_len"], window)
    coef = t.get("router_aux_loss_coef", MIXTRAL_DEFAULTS["router_aux_loss_coef"])
    return dict(fields, moe_experts=experts, moe_top_k=top_k, moe_every=1, moe_d_ff=0, moe_shared_expert=False,
                moe_aux_loss_weight=_round(coef * top_k))


def _round(x: float) -> float:
    """x without the last bits a division or product added (0.001 * 3 / 3 reads back 0.001)."""
    return float(f"{x:.12g}")


def check_context(directory: str | Path, model: ModelConfig) -> None:
    """Raise if the checkpoint in `directory` attends over a sliding window shorter than `model.seq_len` (the
    context after any override; by default the window caps it): within its window, Mixtral's attention is
    shardlm's full causal attention, beyond it another model."""
    directory = Path(directory)
    tree = read_hf_config(directory)
    window = tree.get("sliding_window") if tree.get("model_type") == "mixtral" else None
    if window is not None and window < model.seq_len:
        raise ShardlmError(f"{directory.resolve() / CONFIG_FILE}: sliding_window={window} is not supported with "
                           f"model.seq_len={model.seq_len} (each token attends to the last {window} only, where "
                           f"shardlm attends to the whole context; shardlm would compute another model); set "
                           f"model.seq_len={window} or lower")


def check_exportable(m: ModelConfig, where: str) -> None:
    """Raise if `m` has no Hugging Face counterpart shardlm writes: a GPT is exported as GPT-2, which has biases;
    a mixture of experts as Mixtral, whose every layer is sparse, with one expert size and no shared expert."""
    if m.family == "gpt" and not m.use_bias:
        raise ShardlmError(f"{where} trained a GPT without biases (model.use_bias=false), which transformers' "
                           "GPT2LMHeadModel cannot hold; only GPT runs with biases export")
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


def model_config_from(spec: str) -> ModelConfig:
    """`model=hf:DIR`: the ModelConfig of that checkpoint (its architecture; `init.from=hf:DIR` also loads the
    weights). Missing keys in config.json are one-line errors naming them."""
    directory = hf_dir(spec).resolve()  # one spelling of the path, whatever the working directory
    tree = read_hf_config(directory)
    try:
        fields = model_fields(tree, directory)
    except KeyError as e:
        raise ShardlmError(f"{directory / CONFIG_FILE} has no {e.args[0]!r}, which a {tree.get('model_type')} "
                           "config needs") from None
    return ModelConfig(preset=f"{HF_PREFIX}{directory}", **fields)


def hf_config(m: ModelConfig, vocab_size: int, special: dict[str, int | None]) -> dict:
    """config.json for a shardlm model config `m` (vocabulary without its padding); `special` holds
    bos_token_id and eos_token_id."""
    common = {"vocab_size": vocab_size, "tie_word_embeddings": m.tie_embeddings, "dtype": "float32",
              "bos_token_id": special.get("bos_token_id"), "eos_token_id": special.get("eos_token_id")}
    if m.family == "gpt":
        return {"architectures": [ARCHITECTURES["gpt2"]], "model_type": "gpt2", "n_layer": m.n_layers,
                "n_head": m.n_heads, "n_embd": m.d_model, "n_inner": m.d_mlp, "n_positions": m.seq_len,
                "n_ctx": m.seq_len, "activation_function": "gelu_new", "layer_norm_epsilon": m.layer_norm_eps,
                "resid_pdrop": 0.0, "embd_pdrop": 0.0, "attn_pdrop": 0.0, "scale_attn_weights": True,
                "scale_attn_by_inverse_layer_idx": False, "reorder_and_upcast_attn": False, **common}
    llama = {"num_hidden_layers": m.n_layers, "num_attention_heads": m.n_heads,
             "num_key_value_heads": m.n_kv_heads or m.n_heads, "hidden_size": m.d_model,
             "intermediate_size": m.d_mlp, "head_dim": m.d_model // m.n_heads, "max_position_embeddings": m.seq_len,
             "rms_norm_eps": m.layer_norm_eps, "rope_theta": m.rope_theta, "rope_scaling": None, "hidden_act": "silu",
             "attention_dropout": 0.0, **common}
    if m.moe_experts:  # every layer sparse (`check_exportable`), so d_mlp is unused and the experts' size is Mixtral's
        check_exportable(m, "the model")
        return {"architectures": [ARCHITECTURES["mixtral"]], "model_type": "mixtral", **llama,
                "intermediate_size": m.moe_d_ff or m.d_mlp, "num_local_experts": m.moe_experts,
                "num_experts_per_tok": m.moe_top_k, "router_aux_loss_coef": _round(m.moe_aux_loss_weight / m.moe_top_k),
                "router_jitter_noise": 0.0, "output_router_logits": False, "sliding_window": None}
    return {"architectures": [ARCHITECTURES["llama"]], "model_type": "llama", **llama, "attention_bias": False,
            "mlp_bias": False}
