"""A Hugging Face `config.json` as shardlm's model config, and back, for the two families shardlm implements.

Supported: `GPT2LMHeadModel` (model_type gpt2: GPT-2 124M to 1.5B) and `LlamaForCausalLM` (model_type llama:
Llama 2/3 shapes, TinyLlama, SmolLM, ...). A setting the model code would compute differently is refused by name
instead of being imported into a model that silently computes something else: rope scaling (Llama 3.1's
`llama3`, linear, dynamic, YaRN), attention or MLP biases on Llama, another activation than the family's, a
`head_dim` other than hidden / heads, GPT-2's per-layer attention scaling or cross-attention.

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
ARCHITECTURES = {"gpt2": "GPT2LMHeadModel", "llama": "LlamaForCausalLM"}
LLAMA_DEFAULT_CONTEXT = 2048  # Llama 3's 131,072 positions would be the default context otherwise


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
    arch = ", ".join(tree.get("architectures") or []) or "no architectures listed"
    raise ShardlmError(f"{directory / CONFIG_FILE}: model_type {kind!r} ({arch}) is not supported; shardlm imports "
                       f"gpt2 (GPT2LMHeadModel) and llama (LlamaForCausalLM) checkpoints")


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


def _llama_fields(t: dict, d: Path) -> dict:
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
    theta = t.get("rope_theta", params.get("rope_theta", 10000.0))
    return dict(family="llama", n_layers=t["num_hidden_layers"], n_heads=heads,
                n_kv_heads=t.get("num_key_value_heads") or heads, d_model=hidden, d_mlp=t["intermediate_size"],
                seq_len=min(t.get("max_position_embeddings", LLAMA_DEFAULT_CONTEXT), LLAMA_DEFAULT_CONTEXT),
                vocab_size=t["vocab_size"], use_bias=False, tie_embeddings=t.get("tie_word_embeddings", False),
                layer_norm_eps=t.get("rms_norm_eps", 1e-6), rope_theta=float(theta), dropout=0.0)


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
    return {"architectures": [ARCHITECTURES["llama"]], "model_type": "llama", "num_hidden_layers": m.n_layers,
            "num_attention_heads": m.n_heads, "num_key_value_heads": m.n_kv_heads or m.n_heads,
            "hidden_size": m.d_model, "intermediate_size": m.d_mlp, "head_dim": m.d_model // m.n_heads,
            "max_position_embeddings": m.seq_len, "rms_norm_eps": m.layer_norm_eps, "rope_theta": m.rope_theta,
            "rope_scaling": None, "hidden_act": "silu", "attention_bias": False, "mlp_bias": False,
            "attention_dropout": 0.0, **common}
